"""Skinny matmuls of decode steps: ``y = x @ W.T`` for a handful of tokens, weight-bandwidth bound.

At batch 1-16 a decode step's linear layers read every weight once and do almost no arithmetic, so their
speed is the speed the weight streams from HBM. One program owns ``BLOCK_N`` output channels and walks the
reduction in ``BLOCK_K`` slices, ``x`` padded to 16 rows for the tensor cores. Weights may be bf16/fp16, or
FP8 e4m3 with one float32 scale per output channel: the FP8 bytes are widened to fp16 in registers (a native
conversion on Hopper) and the activations stay in 16 bits, so an FP8 layer streams half the bytes without
quantizing the activations (the weight-only FP8 path of small batches; large batches keep the FP8 x FP8
``_scaled_mm``).

At one token, on CUDA, a linear layer runs on a CUDA C++ kernel (``engine.kernels.token_gemv``) wherever it
applies (``ENGINE_TOKEN_GEMV=triton`` keeps the Triton kernels). Otherwise an FP8 weight at one token takes another
Triton kernel (``_gemv_token_kernel``): no tensor cores, each program multiplies a
``[BLOCK_N, BLOCK_K]`` tile of the widened weight by ``x`` on the CUDA cores in float32 and reduces along K once at
the end, optionally split along K over several programs whose float32 partials a second launch sums. Streamed from
HBM on an H200 it moves qkv / o / down at 51 / 46 / 55% of bandwidth where the tensor-core kernel moves 47 / 33 / 45%
(bench/device/gemv_swap.py, docs/engine.md); bf16 weights gain nothing from it and keep the tensor cores.

``SWIGLU`` fuses the gated activation of a fused gate/up projection: the program reads the gate rows
``n`` and the up rows ``n + N`` and writes ``silu(gate) * up`` with the roundings of the unfused ops
(each matmul output, and the activation, rounded to the model dtype as torch does).
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.kernels import PDL_EARLY, PDL_LOOP, PDL_OFF, nvrtc, pdl_launch, sm_count, token_gemv
from engine.kernels.pdl import enter, leave_loop

# Tokens up to which a linear layer takes this path (decode steps; verify steps of short drafts).
MAX_TOKENS = 16

# At most this many runs of K for a narrow weight whose consumer sums parts (``parts_for``); 1 turns splitting off.
MAX_PARTS = 4
# Where a kernel split into parts lets the next one in under PDL. Measured (docs/engine.md, twelfth round): after its
# loop; let in first thing, the next kernels' programs take the SMs that the parts now fill, and the step is slower.
PARTS_TRIGGER = PDL_LOOP


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles measured per GPU model, weight dtype and weight shape (bench/device/fp8_tune.py, with every call reading
# a different copy of the weight so that it streams from HBM as a model's layers do; docs/engine.md):
# {"<device name>": {"bf16" | "fp8": {"<N>x<K>": [block_n, block_k, num_warps, num_stages]}}}.
# ENGINE_GEMV_TILES names another file of that form whose entries take precedence (a tuning run's output).
TILES_FILE = Path(__file__).with_name("gemv_tiles.json")


@functools.cache
def _tiles(device_index: int) -> dict[str, dict[str, list[int]]]:
    name = torch.cuda.get_device_name(device_index) if torch.cuda.is_available() else "cpu"
    table: dict[str, dict[str, list[int]]] = {}
    for path in (TILES_FILE, os.environ.get("ENGINE_GEMV_TILES")):
        if path:
            for kind, shapes in json.loads(Path(path).read_text()).get(name, {}).items():
                table.setdefault(kind, {}).update(shapes)
    return table


@dataclass(frozen=True, slots=True)
class TokenConfig:
    """Tile of the one-token FP8 kernel: ``splits`` programs share each row tile along K."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int


def token_config_for(weight: torch.Tensor) -> TokenConfig:
    """The measured one-token tile for this FP8 weight on this GPU (kind ``fp8_token`` of the table), else a rule:
    8-row tiles of 1,024 columns, split in four along a long K."""
    n, k = weight.shape
    if weight.is_cuda:
        hit = _tiles(weight.device.index or 0).get("fp8_token", {}).get(f"{n}x{k}")
        if hit:
            return TokenConfig(*hit)
    return TokenConfig(8, 1024 if k >= 4096 else 256, 4, 2, 4 if k >= 8192 else 1)


def config_for(weight: torch.Tensor) -> GemvConfig:
    """The measured tile for this weight on this GPU, else a rule: wide weights (gate/up, LM heads) stream
    best in 64-row tiles, square and narrow ones in 32-row tiles with longer slices."""
    n, k = weight.shape
    fp8 = weight.element_size() == 1
    if weight.is_cuda:
        hit = _tiles(weight.device.index or 0).get("fp8" if fp8 else "bf16", {}).get(f"{n}x{k}")
        if hit:
            block_n, block_k, warps, stages = hit
            return GemvConfig(block_n, block_k, warps, stages)
    if n >= 16384:
        return GemvConfig(64, 256, 4, 3)
    if n > 4096:
        return GemvConfig(64, 512 if fp8 else 256, 4, 3 if fp8 else 4)
    return GemvConfig(32, 512, 4, 3)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_x, stride_w, stride_out, K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, FP16_DOT: tl.constexpr,
    PRECISION: tl.constexpr, K_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    part = tl.program_id(1)  # this program's run of K_SPLIT columns of K (one run unless split along K)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    enter(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = part * K_SPLIT + k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FP16_DOT:
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if SWIGLU:
            u = tl.load(w_rows + N * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if FP16_DOT:
                u = u.to(tl.float16)
            acc_up += tl.dot(x, tl.trans(u), input_precision=PRECISION)
    leave_loop(PDL)
    dt = out_ptr.dtype.element_ty
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if SWIGLU:
            acc_up = acc_up * tl.load(scale_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_ok & (part == 0), other=0.0).to(tl.float32)  # added by one part
        acc += bias[None, :]
    if SWIGLU:
        gate = acc.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
        acc = act * acc_up.to(dt).to(tl.float32)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_out + part * N + rn[None, :]
    tl.store(out, acc.to(dt), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_token_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, N, stride_w, K: tl.constexpr, K_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = s * K_SPLIT + k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    leave_loop(PDL)
    y = tl.sum(acc, axis=1)
    if SPLIT:
        tl.store(part_ptr + s * N + rn, y, mask=n_ok)
    else:
        if HAS_SCALE:
            y = y * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(
    part_ptr, scale_ptr, bias_ptr, out_ptr, N, S: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * N + rn, mask=ok, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _gemv_token(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: TokenConfig,
) -> torch.Tensor:  # fmt: skip
    n, k = weight.shape
    k_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    dummy = scale if scale is not None else out
    pdl = pdl_launch(x.device, 1, PDL_LOOP)  # measured: FP8 at one token streams best with the next kernel held back
    _gemv_token_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, weight, dummy, bias if bias is not None else dummy, out, part, n, weight.stride(0), k, k_split,
        SPLIT=splits > 1, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](
            part, dummy, bias if bias is not None else dummy, out, n, splits,
            HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK=1024, **pdl_launch(x.device, 1),
        )  # fmt: skip
    return out


# Whether one token's narrow weight is split along K where the CUDA one-token kernel could take it whole.
SPLIT_ONE_TOKEN = False


def parts_for(weight: torch.Tensor, tokens: int) -> int:
    """How many runs of K the tensor-core kernel cuts ``weight`` into when its caller takes unsummed parts
    (``gemv(..., parts=...)``): ``split_rule`` on this GPU's SMs for the weight's tile. One (no split) off CUDA and
    for FP8 at one token (its own kernel)."""
    if not weight.is_cuda or (weight.element_size() == 1 and tokens == 1):
        return 1
    if (
        tokens == 1
        and not SPLIT_ONE_TOKEN
        and token_gemv.takes_weight(weight)
        and token_gemv.enabled()
        and nvrtc.available()
    ):
        return 1  # the CUDA one-token kernel's blocks of 4 rows fill the SMs unsplit (qwen3-30b-a3b: 4% faster)
    n, k = weight.shape
    cfg = config_for(weight)
    return split_rule(triton.cdiv(n, cfg.block_n), sm_count(weight.device.index or 0), k, cfg.block_k)


def split_rule(tiles: int, sms: int, k: int, block_k: int) -> int:
    """Parts along K for ``tiles`` row tiles on ``sms`` SMs: doubled while the programs still fit the SMs once
    (a decode tile's pipeline fills most of an SM's shared memory, so a second wave would wait) and K still cuts
    into whole slices, at most ``MAX_PARTS``. A narrow weight is the case: Qwen3-30B-A3B's o projection is 64 tiles
    of 32 rows, which leave 68 of an H200's 132 SMs idle."""
    parts = 1
    while parts < MAX_PARTS and 2 * parts * tiles <= sms and k % (2 * parts * block_k) == 0:
        parts *= 2
    return parts


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    config: GemvConfig | TokenConfig | None = None,
    parts: int = 1,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` (times ``scale [N]`` per channel, plus ``bias``) for ``M <= 16``.

    With ``swiglu`` the weight is a fused ``[2N', K]`` gate/up projection and the result ``silu(gate) * up``
    ``[M, N']``. Output in ``x``'s dtype. One token without SwiGLU takes the CUDA-core kernel when ``config`` is
    a ``TokenConfig``, and on an FP8 weight when no ``config`` is given (its measured tile then).

    With ``parts > 1`` (tensor-core kernel, no SwiGLU) K is cut into that many runs, one program per (row tile,
    run), and the result is float32 ``[M, parts, N]`` whose sum over the parts is the product (bias in the first
    part): for a consumer that sums parts (``triton_ops.add_rms_norm``), so that the split costs no launch.
    """
    m, k = x.shape
    if m > MAX_TOKENS:
        raise ValueError(f"gemv takes at most {MAX_TOKENS} tokens, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"gemv: x has {k} columns, the weight {weight.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if parts > 1:
        if swiglu or isinstance(config, TokenConfig):
            raise ValueError("gemv: parts are for the tensor-core kernel without SwiGLU")
        out = torch.empty(m, parts, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if (
        m == 1 and parts == 1 and config is None and token_gemv.supports(x, weight, swiglu) and token_gemv.enabled()
        and nvrtc.available()
    ):  # fmt: skip
        return token_gemv.token_gemv(x, weight, scale, bias, swiglu, out)
    fp8 = weight.element_size() == 1
    if parts == 1 and (isinstance(config, TokenConfig) or (config is None and fp8 and m == 1 and not swiglu)):
        if m != 1 or swiglu:
            raise ValueError("a TokenConfig is for one token without SwiGLU")
        return _gemv_token(x, weight, scale, bias, out, config or token_config_for(weight))
    cfg = config or config_for(weight)
    assert isinstance(cfg, GemvConfig)
    k_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    if triton.cdiv(k, k_split) != parts:
        raise ValueError(f"gemv: {k} columns do not make {parts} runs of whole {cfg.block_k}-column slices")
    fp16_dot = fp8 or x.dtype == torch.float16
    # Measured (docs/engine.md, tenth round): 16-bit weights stream best with the next kernel let in early; FP8 ones
    # at one token (the SwiGLU projection) with it held back until their loop ends, and at more tokens they lose
    # under PDL either way, so they launch plainly.
    trigger = (PDL_LOOP if m == 1 else PDL_OFF) if fp8 else (PARTS_TRIGGER if parts > 1 else PDL_EARLY)
    pdl = pdl_launch(x.device, m, trigger)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x, weight, scale if scale is not None else x, bias if bias is not None else x, out,
        m, n, x.stride(0), weight.stride(0), out.stride(0), k,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, SWIGLU=swiglu, FP16_DOT=fp16_dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", K_SPLIT=k_split,
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl,
    )  # fmt: skip
    return out
