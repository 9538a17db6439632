"""One token's linear layer on the CUDA cores in CUDA C++ (``token_gemv.cu``), compiled by NVRTC.

At batch 1 a linear layer streams its weight from HBM once; this kernel keeps UNROLL 16-byte chunks of each of a
warp's rows in flight per lane and asks for the first ones before it waits for the kernel before (PDL), where the
Triton kernels (``engine.kernels.gemv``) hold one slice a program. Weights in e4m3 with a float32 scale per output
channel, or in the activations' 16-bit dtype; optional bias; or SwiGLU of a fused gate/up weight, with the unfused
ops' roundings. ``supports`` says whether a call qualifies; ``engine.kernels.gemv.gemv`` dispatches to it.

The same kernel runs one token's MoE layer: its router and routing (``token_route``; ``token_norm_route`` with the
residual add and RMS norm before the router in the same launch) and its experts (``token_experts``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from engine.kernels import nvrtc, pdl_launch, token_norm

_SOURCE = Path(__file__).with_name("token_gemv.cu")
CHUNK_BYTES = 16
# Columns at most: the token is staged in shared memory (2 bytes a column, 48 KB a block statically).
MAX_K = 16384
# Under PDL (docs/engine.md, nineteenth round): the first chunks asked for before the wait in the compiled code too,
# not only in the source (token_gemv.cu's PIN); and which launches let the next kernel in first thing, the others once
# a block has left its loop: 0 none, 1 those of e4m3 weights, 2 those of 16-bit weights, 3 all. e4m3 launches after
# their loop (0) lost 3% on qwen3-8b with FP8 weights (twenty-third round).
PIN_LOADS = 1
EARLY = 1
# The residual add and RMS norm before a MoE router run in the router's launch where they qualify
# (token_norm_route), else in one of their own (token_norm.cu). Measured on the H200 at batch 1 (docs/engine.md,
# twenty-first round): qwen3-30b-a3b gained 1.1-1.2%. The same fold into the QKV and gate/up projections lost 0.7% and
# 3.2% on qwen3-8b, and was taken out (the code as it was at commit cade3aa).
ROUTER_NORM = 1
# Runs of each 16-bit row, after the first, that a linear layer's launch under PDL asks for before its wait into
# shared memory (token_gemv.cu's STAGE), as many as the block's static shared memory holds. A block placed while an
# attention still runs (triton_ops.ATTENTION_TRIGGER early) then streams more of its weight in that time. Launches
# without PDL stage none (nothing runs before them; cp.async also needs sm_80), and nor do e4m3 ones: they let the
# next kernel in first thing, and staging them lost 7% (docs/engine.md, twenty-first round).
STAGE_RUNS = 1
# e4m3 rows staged as 16-bit ones are (1), or not (0, the default; an A/B knob). Measured slower both with e4m3
# launches letting the next kernel in first thing (7%, twenty-first round) and after their loop, as 16-bit ones do
# (5.6%, twenty-third round; after the loop alone lost 3%).
STAGE_E4M3 = 0
# The rules' e4m3 tiles (warps, rows a warp, chunks a row in flight), without and with SwiGLU: the sixteenth round's
# sweep chose them. In the engine (twenty-third round) 8 chunks a row in flight lost 9%, 2 lost 2%, 1 lost 3.5%.
E4M3_TILE = (8, 1, 4)
E4M3_SWIGLU_TILE = (4, 2, 4)
# e4m3 tiles for one weight's shape, (rows, columns) -> (warps, rows a warp, chunks a row in flight), over the rules
# (an A/B knob: none is measured better in the engine).
E4M3_TILES: dict[tuple[int, int], tuple[int, int, int]] = {}
# e4m3 launches stage the token as float32, laid out so that the loop reads it without bank conflicts and does not
# widen it (token_gemv.cu's XF32), where it fits (K * 4 bytes, at most 32 KB) and no run is staged (an A/B knob):
# 0 off; 1 on; 2 on, the registers bounded so that an SM holds as many blocks as with 16-bit x (X_F32_BLOCKS).
X_F32 = 0
# Blocks an SM holds of the rules' e4m3 tiles with 16-bit x, by (warps, rows a warp): ptxas gives them 48 and 124
# registers for qwen3-8b's rows of 4,096, and float32 x 54 and 161 unbounded (one block an SM fewer).
X_F32_BLOCKS = {(8, 1): 5, (4, 2): 4}
STATIC_SHARED = 48 * 1024  # a block's static shared memory at most
SM_SHARED = 228 * 1024  # an H200 SM's shared memory, 1 KB of it reserved a block


@dataclass(frozen=True, slots=True)
class TokenTile:
    warps: int = 4
    rows_per_warp: int = 2
    unroll: int = 8


def enabled() -> bool:
    """``ENGINE_TOKEN_GEMV``: ``cuda`` (unset) runs one token's linear layers on this kernel, ``triton`` on Triton's."""
    return nvrtc.use_cuda_kernel("ENGINE_TOKEN_GEMV")


def supports(x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> bool:
    """One token on CUDA, 16-bit activations, an e4m3 weight or one of the activations' dtype whose rows are whole
    runs of 32 lanes' 16-byte chunks, 16-byte aligned."""
    if not (x.is_cuda and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if weight.dtype not in (torch.float8_e4m3fn, x.dtype):
        return False
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return takes_weight(weight) and x.data_ptr() % CHUNK_BYTES == 0 and x.stride(1) == 1 and n > 0


def takes_weight(weight: torch.Tensor) -> bool:
    """``supports``'s conditions on the weight alone: on CUDA, e4m3 or 16-bit, rows of whole runs of 32 lanes'
    16-byte chunks, 16-byte aligned, at most ``MAX_K`` columns."""
    k, es = weight.shape[1], weight.element_size()
    return (
        weight.is_cuda and weight.dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float16)
        and weight.stride(1) == 1 and k * es % (32 * CHUNK_BYTES) == 0 and weight.stride(0) * es % CHUNK_BYTES == 0
        and weight.data_ptr() % CHUNK_BYTES == 0 and k <= MAX_K
    )  # fmt: skip


# Tiles measured best for a 16-bit weight's shape, (rows, columns) -> tile, where they beat the rules of ``tile_for``
# alone (docs/engine.md, sixteenth round's sweep; twentieth round: qwen3-8b at batch 1 gained 0.7% in the engine).
# The sweeps' best e4m3 tiles (QKV 4 rows a warp, down 2) were 5-16% faster alone but lost in the engine, 0.5% in the
# sixteenth round and 1% in the twenty-second, so e4m3 weights keep the rules. SHAPE_TILES = 0: the rules alone.
MEASURED_TILES = {
    (4096, 12288): TokenTile(8, 1, 8),  # qwen3-8b's down projection: 25.49 us against 26.18
    (151936, 4096): TokenTile(8, 1, 8),  # its LM head: 279.4 against 281.8
}
SHAPE_TILES = 1


def tile_for(weight: torch.Tensor, swiglu: bool) -> TokenTile:
    """The tile of a weight: a measured one (16-bit, ``MEASURED_TILES``), else by the rules from a sweep over qwen3-8b's
    projections on the H200 (docs/engine.md, sixteenth round): 16-bit rows one a warp, 8 chunks a row in flight;
    e4m3 rows (half the bytes a chunk of K) 4 in flight, one a warp of 8 or, for SwiGLU, two gate and two up rows a
    warp of 4. Fewer (the largest divisor) where a lane's chunks do not divide."""
    if SHAPE_TILES and weight.element_size() == 2 and not swiglu:
        measured = MEASURED_TILES.get((weight.shape[0], weight.shape[1]))
        if measured is not None:
            return measured
    per_lane = weight.shape[1] * weight.element_size() // (32 * CHUNK_BYTES)
    if weight.element_size() == 1:
        shaped = E4M3_TILES.get((weight.shape[0], weight.shape[1]))
        tile = TokenTile(*(shaped or (E4M3_SWIGLU_TILE if swiglu else E4M3_TILE)))
    else:
        tile = TokenTile(4, 1, 8)
    unroll = max(u for u in range(1, tile.unroll + 1) if per_lane % u == 0)
    return TokenTile(tile.warps, tile.rows_per_warp, unroll)


def stage_for(k: int, wbytes: int, tile: TokenTile, swiglu: bool, runs: int) -> int:
    """How many of ``runs`` runs after the first a linear layer's launch stages before its wait (token_gemv.cu's
    STAGE): those the row has, and the block's static shared memory holds beside the staged token and 256 bytes (once
    a norm's partial sums; kept, since without them rows of 8,192 and 16,384 columns would stage one run more and
    fill all 48 KB, which no GPU has measured); none with SwiGLU (the kernel's 64 registers a thread would not hold
    both rows' first runs in flight), and none of e4m3 weights unless ``STAGE_E4M3`` (measured slower; the kernel
    takes them, as ``stage`` in ``defines``)."""
    if swiglu or (wbytes == 1 and not STAGE_E4M3):
        return 0
    per_lane = k * wbytes // (32 * CHUNK_BYTES)
    per_run = tile.rows_per_warp * tile.unroll * CHUNK_BYTES * 32 * tile.warps
    room = (STATIC_SHARED - 2 * k - 256) // per_run
    return max(0, min(runs, per_lane // tile.unroll - 1, room))


def stage_bounds(k: int, wbytes: int, tile: TokenTile, stage: int) -> int:
    """The blocks an SM must hold at once for a staged launch (token_gemv.cu's MIN_BLOCKS; 0: no bound): 32 warps'
    worth, 64 registers a thread, as the unstaged kernel of a 16-bit row of 4,096 has, where shared memory holds that
    many; only for tiles of one row a warp and rows of at most 10 KB, where ptxas keeps that without spilling (wider
    16-bit rows spilled 8 to 24 bytes, e4m3 rows two a warp 120)."""
    if not stage or k * wbytes > 10240 or tile.rows_per_warp > 1:
        return 0
    shared = 2 * k + stage * tile.rows_per_warp * tile.unroll * CHUNK_BYTES * 32 * tile.warps
    return min(1024 // (32 * tile.warps), SM_SHARED // (shared + 1024))


def x_f32_for(k: int, wbytes: int, stage: int) -> int:
    """How a linear layer's launch stages its token (``X_F32``'s values; token_gemv.cu's XF32): as float32 where
    ``X_F32`` says so, the weight is e4m3, stages no run, and K float32 values fit in 32 KB; else 0."""
    return X_F32 if wbytes == 1 and not stage and k * 4 <= 32768 else 0


def defines(k: int, wbytes: int, bf16: bool, tile: TokenTile, swiglu: bool, has_scale: bool, has_bias: bool,
            pdl: bool, routed: int = 0, router: tuple[int, int, bool, bool] | None = None, *, pin: int,
            early: int, norm: tuple[int, bool] | None = None, stage: int = 0,
            xf32: int = 0) -> dict[str, int]:  # fmt: skip
    """The compile-time constants of a launch (token_gemv.cu's header). ``routed``: 0 a linear layer; 1 a MoE
    layer's experts, not weighted; 2 weighted by float32 routing weights, 3 by 16-bit ones. ``router``: a MoE router
    and its routing, ``(top_k, experts, renormalize, float32 weights)``. ``pin``, ``early``: as ``PIN_LOADS`` and
    ``EARLY``. ``norm``: the residual add and RMS norm before a router, ``(x's parts, float32 parts)``. ``stage``:
    runs staged before the wait, as ``stage_for`` gives them for a linear layer. ``xf32``: the token staged as float32
    (1; 2 with ``X_F32_BLOCKS``'s bound), as ``x_f32_for`` says."""
    out = {"K": k, "WBYTES": wbytes, "BF16": int(bf16), "WARPS": tile.warps, "ROWS_PER_WARP": tile.rows_per_warp,
           "UNROLL": tile.unroll, "SWIGLU": int(swiglu), "HAS_SCALE": int(has_scale), "HAS_BIAS": int(has_bias),
           "PDL": int(pdl), "EXPERTS": int(routed > 0), "ROUTED": int(routed > 1), "ROUTE_F32": int(routed == 2),
           "PIN": int(bool(pin)), "EARLY": int(bool(early & (1 if wbytes == 1 else 2))), "STAGE": stage,
           "MIN_BLOCKS": stage_bounds(k, wbytes, tile, stage), "XF32": int(bool(xf32))}  # fmt: skip
    if xf32 == 2:
        out["MIN_BLOCKS"] = X_F32_BLOCKS.get((tile.warps, tile.rows_per_warp), 0)
    if router is not None:
        top_k, experts, renormalize, keep_float32 = router
        out |= {"ROUTER": top_k, "ROUTER_E": experts, "RENORM": int(renormalize), "ROUTE_F32": int(keep_float32)}
    if norm is not None:
        parts, x_f32 = norm
        out |= {"NORM": 1, "NORM_PARTS": parts, "NORM_F32": int(x_f32)}
    return out


@cache
def _kernel(device: int, *args: Any, **kwargs: Any) -> nvrtc.Kernel:
    """The kernel of ``defines(*args, **kwargs)`` for ``device``, compiled once a process (cached by the arguments:
    a launch looks it up without building its constants)."""
    return nvrtc.build(_SOURCE, "token_gemv", device, defines(*args, **kwargs))


def _no_router(out: torch.Tensor) -> list[ctypes.c_void_p]:
    """The router's four arguments of a launch without one (never read)."""
    return [nvrtc.ptr(out)] * 4


def _no_norm(out: torch.Tensor) -> list[Any]:
    """The norm's five arguments of a launch without one (never read)."""
    return [nvrtc.ptr(out)] * 3 + [ctypes.c_float(0.0), nvrtc.ptr(out)]


def token_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
               swiglu: bool, out: torch.Tensor, tile: TokenTile | None = None) -> torch.Tensor:  # fmt: skip
    """``out [1, N] = x [1, K] @ weight.T`` (times ``scale``, plus ``bias``), or SwiGLU of a fused ``[2N, K]``
    gate/up weight; see the module's docstring."""
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    tile = tile or tile_for(weight, swiglu)
    pdl = bool(pdl_launch(x.device, 1).get("launch_pdl"))
    k, wbytes = weight.shape[1], weight.element_size()
    stage = stage_for(k, wbytes, tile, swiglu, STAGE_RUNS) if pdl else 0
    kernel = _kernel(x.device.index or 0, k, wbytes, out.dtype == torch.bfloat16, tile, swiglu, scale is not None,
                     bias is not None, pdl, pin=PIN_LOADS, early=EARLY, stage=stage,
                     xf32=x_f32_for(k, wbytes, stage))  # fmt: skip
    rows_per_block = tile.warps * tile.rows_per_warp
    args = [nvrtc.ptr(x), nvrtc.ptr(weight), nvrtc.ptr(scale if scale is not None else out),
            nvrtc.ptr(bias if bias is not None else out), nvrtc.ptr(out), ctypes.c_int(n),
            ctypes.c_longlong(weight.stride(0) * weight.element_size()), nvrtc.ptr(out), nvrtc.ptr(out),
            ctypes.c_longlong(0), ctypes.c_int(0), *_no_router(out), *_no_norm(out)]  # fmt: skip
    kernel((-(-n // rows_per_block), 1, 1), 32 * tile.warps, args, pdl=pdl)
    return out


def moe_enabled() -> bool:
    """``ENGINE_MOE_TOKEN_GEMV``: ``cuda`` (unset) runs one token's MoE router, routing and experts on this kernel;
    ``triton`` the fused MoE's routing and grouped GEMMs (qwen3-30b-a3b at batch 1: 7% slower, docs/engine.md)."""
    return nvrtc.use_cuda_kernel("ENGINE_MOE_TOKEN_GEMV")


def supports_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """One token on CUDA whose experts' weights are stacks of the token's 16-bit dtype, with rows of whole runs of 32
    lanes' 16-byte chunks in both projections."""
    return (
        x.is_cuda and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
        and w13.dtype == x.dtype and w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()
        and w13.shape[2] * w13.element_size() % (32 * CHUNK_BYTES) == 0
        and w2.shape[2] * w2.element_size() % (32 * CHUNK_BYTES) == 0 and max(w13.shape[2], w2.shape[2]) <= MAX_K
    )  # fmt: skip


def token_experts(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor | None,
                  gated: bool) -> torch.Tensor:  # fmt: skip
    """One token's ``top_k`` experts of a stack ``w [E, rows, K]``: with ``gated``, ``silu(gate) * up`` of
    ``x [1, K]`` through each expert's gate rows and up rows (``[top_k, rows / 2]``); else each pair's own row of
    ``x [top_k, K]`` through its expert, times ``route_w`` (``[top_k, rows]``). ``ids [1, top_k]`` int64, on the
    device (the routing kernel's)."""
    top_k = ids.shape[1]
    n = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.empty((top_k, n), dtype=x.dtype, device=x.device)
    tile = tile_for(w[0], gated)
    pdl = bool(pdl_launch(x.device, 1).get("launch_pdl"))
    routed = 1 if route_w is None else 2 if route_w.dtype == torch.float32 else 3
    kernel = _kernel(x.device.index or 0, w.shape[2], w.element_size(), x.dtype == torch.bfloat16, tile, gated,
                     False, False, pdl, routed, pin=PIN_LOADS, early=EARLY)  # fmt: skip
    ids = ids if ids.is_contiguous() else ids.contiguous()
    args = [nvrtc.ptr(x), nvrtc.ptr(w), nvrtc.ptr(out), nvrtc.ptr(out), nvrtc.ptr(out), ctypes.c_int(n),
            ctypes.c_longlong(w.stride(1) * w.element_size()), nvrtc.ptr(ids),
            nvrtc.ptr(route_w if route_w is not None else out), ctypes.c_longlong(w.stride(0) * w.element_size()),
            ctypes.c_int(0 if gated else x.shape[1]), *_no_router(out), *_no_norm(out)]  # fmt: skip
    kernel((-(-n // (tile.warps * tile.rows_per_warp)), top_k, 1), 32 * tile.warps, args, pdl=pdl)
    return out


# Experts a router may have, at most (its last block routes in one warp, ROUTER_E / 32 experts a lane).
MAX_ROUTER_EXPERTS = 1024


def supports_router(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> bool:
    """One token's router ``gate [E, K]`` qualifies for ``token_route``: a linear layer this kernel takes, up to
    ``MAX_ROUTER_EXPERTS`` experts and 32 picks."""
    return (
        supports(x, gate, False) and gate.dtype == x.dtype and 0 < top_k <= min(32, gate.shape[0])
        and gate.shape[0] <= MAX_ROUTER_EXPERTS
    )  # fmt: skip


_COUNTERS: dict[int, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """A device's count of the router's finished blocks: zero between launches (the last block resets it), and one
    for all routers, whose launches on the device's stream never overlap (each waits for the kernel before)."""
    index = device.index or 0
    if index not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():  # it would live in the graph's pool, zeroed at each replay
            raise RuntimeError("token_route: the first router launch on a device must come before a CUDA graph's "
                               "capture (a warm-up step)")  # fmt: skip
        _COUNTERS[index] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[index]


def token_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
                keep_float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token's MoE routing from its router weight ``gate [E, K]`` in one launch: ``engine.models.moe.route`` of
    ``x @ gate.T``, the weights (``[1, top_k]``, float32 with ``keep_float32``, else ``x``'s dtype) and int64 ids."""
    weights, ids = _route(x, gate, top_k, renormalize, keep_float32, x.dtype, None, _no_norm(x))
    return weights, ids


def supports_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor,
                        top_k: int) -> bool:  # fmt: skip
    """``token_norm_route`` takes the call: a residual add and norm ``token_norm`` would take, of one token, before a
    router ``supports_router`` takes, of the norm's width, whose tile gives each thread whole 16-byte chunks of the
    norm (token_gemv.cu's NORM)."""
    k = gate.shape[1]
    return (
        token_norm.supports(x, residual, norm_weight) and supports_router(residual, gate, top_k)
        and residual.shape[1] == k and (k // 8) % (32 * tile_for(gate, False).warps) == 0
    )  # fmt: skip


def fuses_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor,
                     top_k: int) -> bool:  # fmt: skip
    """The residual add and norm before a router run in its launch: ``ROUTER_NORM`` is on, the CUDA norm is enabled
    (``ENGINE_TOKEN_NORM``; the router's own switches are its caller's), and ``supports_norm_route``."""
    return (
        bool(ROUTER_NORM) and token_norm.enabled()
        and supports_norm_route(x, residual, norm_weight, gate, top_k)
    )  # fmt: skip


def token_norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    top_k: int,
    renormalize: bool,
    keep_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_route`` of ``h = norm_weight * rmsnorm(residual + x)`` with the add and the norm in the same launch:
    ``(weights, ids, h, residual + x)`` (block 0 stores ``h``, which the experts read, and the residual stream).
    ``supports_norm_route`` says which calls qualify."""
    h = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    norm = (x.shape[1] if x.dim() == 3 else 1, x.dtype == torch.float32)
    args = [nvrtc.ptr(residual), nvrtc.ptr(norm_weight), nvrtc.ptr(res_out), ctypes.c_float(eps), nvrtc.ptr(h)]
    weights, ids = _route(x, gate, top_k, renormalize, keep_float32, residual.dtype, norm, args)
    return weights, ids, h, res_out


def _route(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool, keep_float32: bool,
           dtype: torch.dtype, norm: tuple[int, bool] | None,
           norm_args: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A router's launch (``token_route``) of activations in ``dtype``, with the residual add and norm before it
    (``norm``: ``defines``'s) or without."""
    experts = gate.shape[0]
    logits = torch.empty(experts, dtype=torch.float32, device=x.device)
    weights = torch.empty((1, top_k), dtype=torch.float32 if keep_float32 else dtype, device=x.device)
    ids = torch.empty((1, top_k), dtype=torch.int64, device=x.device)
    tile = tile_for(gate, False)
    pdl = bool(pdl_launch(x.device, 1).get("launch_pdl"))
    kernel = _kernel(x.device.index or 0, gate.shape[1], gate.element_size(), dtype == torch.bfloat16, tile, False,
                     False, False, pdl, router=(top_k, experts, renormalize, keep_float32), pin=PIN_LOADS,
                     early=EARLY, norm=norm)  # fmt: skip
    args = [nvrtc.ptr(x), nvrtc.ptr(gate), nvrtc.ptr(logits), nvrtc.ptr(logits), nvrtc.ptr(weights),
            ctypes.c_int(experts), ctypes.c_longlong(gate.stride(0) * gate.element_size()), nvrtc.ptr(ids),
            nvrtc.ptr(weights), ctypes.c_longlong(0), ctypes.c_int(0), nvrtc.ptr(logits),
            nvrtc.ptr(_counter(x.device)), nvrtc.ptr(weights), nvrtc.ptr(ids), *norm_args]  # fmt: skip
    kernel((-(-experts // (tile.warps * tile.rows_per_warp)), 1, 1), 32 * tile.warps, args, pdl=pdl)
    return weights, ids
