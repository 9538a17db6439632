"""Skinny matmuls of decode steps: ``y = x @ W.T`` for a handful of tokens, weight-bandwidth bound.

At batch 1-16 a decode step's linear layers read every weight once and do almost no arithmetic, so their
speed is the speed the weight streams from HBM. One program owns ``BLOCK_N`` output channels and walks the
reduction in ``BLOCK_K`` slices, ``x`` padded to 16 rows for the tensor cores. Weights may be bf16/fp16, or
FP8 e4m3 with one float32 scale per output channel: the FP8 bytes are widened to fp16 in registers (a native
conversion on Hopper) and the activations stay in 16 bits, so an FP8 layer streams half the bytes without
quantizing the activations (the weight-only FP8 path of small batches; large batches keep the FP8 x FP8
``_scaled_mm``).

At one token an FP8 weight takes another kernel (``_gemv_token_kernel``): no tensor cores, each program multiplies a
``[BLOCK_N, BLOCK_K]`` tile of the widened weight by ``x`` on the CUDA cores in float32 and reduces along K once at
the end, optionally split along K over several programs whose float32 partials a second launch sums. Streamed from
HBM on an H200 it moves qkv / o / down at 51 / 46 / 55% of bandwidth where the tensor-core kernel moves 47 / 33 / 45%
(bench/device/gemv_swap.py, docs/engine.md); bf16 weights gain nothing from it and keep the tensor cores.

FP8 x FP8 (``_w8a8_kernel``, Hopper's warp-group MMA): the down projection of an FP8 MLP in small steps reads its
activations already in FP8, quantized by the fused gate/up kernel's SwiGLU epilogue (``gemv(..., quantize=True)``)
per token and run of columns that one of its programs writes (``Fp8Rows``: a float32 scale each), so the weight
streams into the MMA with no widening at all, cut into float32 parts along K that the next residual add + RMSNorm
sums. Quantizing inside the W8A8 kernel instead, in each of its programs, cost more than the widening it saves
(docs/engine.md, thirteenth round).

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

from engine.kernels import PDL_EARLY, PDL_LOOP, PDL_OFF, interpret_mode, pdl_launch, sm_count
from engine.kernels.pdl import enter, leave_loop

_INTERPRET = interpret_mode()

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


# An FP8 MLP's down projection runs FP8 x FP8 in steps of at most this many tokens (0: always weight-only).
W8A8_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations in FP8 e4m3 ``q [M, K]`` with a float32 scale per token and run of ``group`` columns,
    ``scales [M, K / group]``: row ``m``'s values are ``q[m, j] * scales[m, j // group]``. ``dtype``: the model's,
    which a product of them comes back in."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        m, k = self.q.shape
        return (self.q.float().view(m, -1, self.group) * self.scales[:, :, None]).view(m, k)


@dataclass(frozen=True, slots=True)
class W8A8Config:
    """Tile of the FP8 x FP8 kernel: ``block_n`` weight rows (the warp-group MMA's M, 64 or 128) by ``block_k``
    columns a loop step (whole runs of the activations' group)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def w8a8_config_for(weight: torch.Tensor) -> W8A8Config:
    """The measured W8A8 tile for this weight on this GPU (kind ``w8a8`` of the table), else the rule the H200's
    sweep gave (bench/device/w8a8_token.py): 64 rows by 128 columns over 5 stages, in parts."""
    n, k = weight.shape
    if weight.is_cuda:
        hit = _tiles(weight.device.index or 0).get("w8a8", {}).get(f"{n}x{k}")
        if hit:
            return W8A8Config(*hit)
    return W8A8Config(64, 128, 4, 5)


def w8a8_parts(weight: torch.Tensor) -> int:
    """Runs of K for the W8A8 kernel: the sweep's best for o and down was four (a 64 x 128 tile over 5 stages
    takes 50 KB of shared memory, so four programs share an SM); fewer where K does not cut into whole slices."""
    cfg = w8a8_config_for(weight)
    k = weight.shape[1]
    parts = MAX_PARTS
    while parts > 1 and k % (parts * cfg.block_k):
        parts //= 2
    return parts


def quantized_swiglu_group(weight: torch.Tensor) -> int:
    """Columns under one scale when the fused gate/up ``weight`` quantizes its output: its tile's rows (each program
    quantizes what it writes); 0 when that is fewer than the 32 an FP8 MMA step takes along K."""
    cfg = config_for(weight)
    return cfg.block_n if cfg.block_n >= 32 and (weight.shape[0] // 2) % cfg.block_n == 0 else 0


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
def _to_e4m3(x, INTERPRET: tl.constexpr):
    """float32 values within e4m3's range to ``float8e4nv``, rounded to nearest even (Hopper's ``cvt.rn``)."""
    if INTERPRET:
        # Triton's interpreter does not round this conversion (it converts exact values right): round first, on the
        # bits for normal values (3 mantissa bits kept of 23) and to a multiple of 2^-9 below 2^-6 (subnormals).
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        sub = (x * 512.0 + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds to whole numbers
        x = tl.where(tl.abs(x) < 0.015625, sub * (1.0 / 512.0), bits.to(tl.float32, bitcast=True))
    return x.to(tl.float8e4nv)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_x, stride_w, stride_out, K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, FP16_DOT: tl.constexpr,
    PRECISION: tl.constexpr, K_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    QUANT: tl.constexpr = False, qs_ptr=None, stride_qs=0, INTERPRET: tl.constexpr = False,
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
    dt = x_ptr.dtype.element_ty  # the model's dtype, to which each result rounds as torch's ops would
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
    if QUANT:
        # The activation as the model dtype holds it, then in FP8 with one scale per token for this program's run of
        # BLOCK_N columns, its largest magnitude mapped to e4m3's largest.
        y = acc.to(dt).to(tl.float32)
        amax = tl.max(tl.abs(y), axis=1)
        q = _to_e4m3(y * (448.0 / tl.maximum(amax, 1e-30))[:, None], INTERPRET)
        tl.store(out, q, mask=m_ok[:, None] & n_ok[None, :])
        tl.store(qs_ptr + rm * stride_qs + pid, amax / 448.0, mask=m_ok)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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


@triton.jit
def _w8a8_kernel(
    x_ptr, xs_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_x, stride_xs, stride_w, stride_out,
    K: tl.constexpr, K_SPLIT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # acc[i, j]: weight row i of the tile, token j (the weight is the MMA's first operand: 64-128 rows). Each run of
    # GROUP columns is its own product, scaled by its tokens' scales as it joins the float32 sum.
    pid = tl.program_id(0)
    part = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            run = part * K_SPLIT + k0 + g * GROUP
            k = run + tl.arange(0, GROUP)
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            xs = tl.load(xs_ptr + rm * stride_xs + run // GROUP, mask=m_ok & (run < K), other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(w, tl.trans(x)) * xs[None, :]
    leave_loop(PDL)
    y = tl.trans(acc) * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok & (part == 0), other=0.0).to(tl.float32)[None, :]  # added by one part
    out = out_ptr + rm[:, None].to(tl.int64) * stride_out + part * N + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _w8a8(
    x: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, parts: int,
    cfg: W8A8Config,
) -> torch.Tensor:  # fmt: skip
    m, k = x.q.shape
    n = out.shape[-1]
    if x.group < 32 or cfg.block_k % x.group:
        raise ValueError(f"gemv: W8A8 takes runs of 32 columns or more that divide the tile's {cfg.block_k}, "
                         f"got {x.group}")  # fmt: skip
    k_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    if triton.cdiv(k, k_split) != parts:
        raise ValueError(f"gemv: {k} columns do not make {parts} runs of whole {cfg.block_k}-column slices")
    # The next kernel let in after the loop, as the other split and FP8 kernels.
    pdl = pdl_launch(out.device, m, PDL_LOOP)
    _w8a8_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x.q, x.scales, weight, scale, bias if bias is not None else scale, out, m, n, x.q.stride(0),
        x.scales.stride(0), weight.stride(0), out.stride(0), k, K_SPLIT=k_split, GROUP=x.group,
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    return out


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


def parts_for(weight: torch.Tensor, tokens: int, w8a8: bool = False) -> int:
    """How many runs of K the tensor-core kernel cuts ``weight`` into when its caller takes unsummed parts
    (``gemv(..., parts=...)``): ``split_rule`` on this GPU's SMs for the weight's tile, or ``w8a8_parts`` for the
    W8A8 kernel (FP8 activations). One (no split) off CUDA and for FP8 at one token on the weight-only kernels (its
    own kernel)."""
    if not weight.is_cuda:
        return 1
    if w8a8:
        return w8a8_parts(weight)
    if weight.element_size() == 1 and tokens == 1:
        return 1
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
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    config: GemvConfig | TokenConfig | W8A8Config | None = None,
    parts: int = 1,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` (times ``scale [N]`` per channel, plus ``bias``) for ``M <= 16``.

    With ``swiglu`` the weight is a fused ``[2N', K]`` gate/up projection and the result ``silu(gate) * up``
    ``[M, N']``. Output in ``x``'s dtype. One token without SwiGLU takes the CUDA-core kernel when ``config`` is
    a ``TokenConfig``, and on an FP8 weight when no ``config`` is given (its measured tile then).

    With ``parts > 1`` (tensor-core kernels, no SwiGLU) K is cut into that many runs, one program per (row tile,
    run), and the result is float32 ``[M, parts, N]`` whose sum over the parts is the product (bias in the first
    part): for a consumer that sums parts (``triton_ops.add_rms_norm``), so that the split costs no launch.

    ``x`` given as ``Fp8Rows`` (``swiglu_fp8``'s result; an FP8 weight with its scales) runs FP8 x FP8
    (``_w8a8_kernel``), in parts or not.
    """
    if isinstance(x, Fp8Rows):
        return _w8a8_call(x, weight, scale, bias, swiglu, config, parts)
    out = _skinny(x, weight, scale, bias, swiglu, config, parts, quantize=False)
    assert isinstance(out, torch.Tensor)
    return out


def swiglu_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, config: GemvConfig | None = None
) -> Fp8Rows:
    """``gemv(x, weight, scale, swiglu=True)`` quantized to FP8 in the tensor-core kernel's epilogue, each program
    quantizing its ``block_n`` columns of each token (one scale each): the activations of a W8A8 down projection."""
    out = _skinny(x, weight, scale, None, True, config, 1, quantize=True)
    assert isinstance(out, Fp8Rows)
    return out


def _skinny(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, swiglu: bool,
    config: GemvConfig | TokenConfig | W8A8Config | None, parts: int, quantize: bool,
) -> torch.Tensor | Fp8Rows:  # fmt: skip
    m, k = x.shape
    if m > MAX_TOKENS:
        raise ValueError(f"gemv takes at most {MAX_TOKENS} tokens, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"gemv: x has {k} columns, the weight {weight.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if isinstance(config, W8A8Config):
        raise ValueError("gemv: a W8A8Config is for activations already in FP8 (Fp8Rows)")
    if quantize and (not swiglu or parts > 1 or isinstance(config, TokenConfig)):
        raise ValueError("gemv: quantize is for the SwiGLU projection on the tensor-core kernel, without parts")
    if parts > 1:
        if swiglu or isinstance(config, TokenConfig):
            raise ValueError("gemv: parts are for the tensor-core kernels without SwiGLU")
        out = torch.empty(m, parts, n, dtype=torch.float32, device=x.device)
    elif quantize:
        out = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp8 = weight.element_size() == 1
    cfg = config
    if parts == 1 and (isinstance(config, TokenConfig) or (config is None and fp8 and m == 1 and not swiglu)):
        if m != 1 or swiglu:
            raise ValueError("a TokenConfig is for one token without SwiGLU")
        return out if m == 0 else _gemv_token(x, weight, scale, bias, out, config or token_config_for(weight))
    cfg = config or config_for(weight)
    assert isinstance(cfg, GemvConfig)
    scales = out
    if quantize:
        if cfg.block_n < 32 or n % cfg.block_n:
            raise ValueError(f"gemv: quantized runs of {cfg.block_n} columns: an FP8 MMA step takes 32 or more, "
                             f"and they must divide the {n} outputs")  # fmt: skip
        scales = torch.empty(m, n // cfg.block_n, dtype=torch.float32, device=x.device)
    result: torch.Tensor | Fp8Rows = Fp8Rows(out, scales, cfg.block_n, x.dtype) if quantize else out
    if m == 0:
        return result
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
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        QUANT=quantize, qs_ptr=scales, stride_qs=scales.stride(0), INTERPRET=_INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    return result


def _w8a8_call(
    x: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, swiglu: bool,
    config: GemvConfig | TokenConfig | W8A8Config | None, parts: int,
) -> torch.Tensor:  # fmt: skip
    m, k = x.q.shape
    if m > MAX_TOKENS:
        raise ValueError(f"gemv takes at most {MAX_TOKENS} tokens, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"gemv: x has {k} columns, the weight {weight.shape[1]}")
    if weight.element_size() != 1 or scale is None:
        raise ValueError("gemv: FP8 activations take an FP8 weight with its per-channel scales")
    if swiglu or not (config is None or isinstance(config, W8A8Config)):
        raise ValueError("gemv: FP8 activations take a W8A8Config, without SwiGLU")
    n = weight.shape[0]
    shape = (m, parts, n) if parts > 1 else (m, n)
    out = torch.empty(shape, dtype=torch.float32 if parts > 1 else x.dtype, device=x.q.device)
    if m == 0:
        return out
    return _w8a8(x, weight, scale, bias, out, parts, config or w8a8_config_for(weight))
