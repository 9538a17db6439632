"""Fused mixture-of-experts kernels (Triton): sort (token, expert) pairs by expert, two grouped GEMMs.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes what ``engine.models.moe.experts_torch``
does, in a fixed number of launches whose sizes depend only on the shapes, never on the routing,
so it never synchronises with the host and runs inside a captured CUDA graph.

1. Align. The ``tokens * top_k`` pairs are sorted by expert, each expert's run padded to a
   multiple of ``BLOCK_M``, one run after another; padding rows hold the sentinel
   ``tokens * top_k``, and each ``BLOCK_M`` block of rows records its expert. The buffers have a
   static size: at most ``min(E, pairs)`` experts get a run, each wasting at most ``BLOCK_M - 1``
   rows, so ``pairs + min(E, pairs) * (BLOCK_M - 1)`` rows; the used length stays on the device.
   A decode-sized batch (up to ``ONE_PROGRAM_PAIRS`` pairs) is aligned by one program in one
   launch: a histogram of the ids, the runs' starts, then ``tl.sort`` of ``(expert, pair)`` keys
   places each pair at its run's start plus its rank (stable: pairs in token order). Larger
   batches spread the work: count per expert (atomics), lay out the runs (one program), then each
   pair claims the next free row of its run (atomics). There the order inside a run depends on
   the atomics, but no result does: each output row of a GEMM depends only on its own input row.
2. Up: one program per (block of ``BLOCK_M`` sorted rows, ``BLOCK_N`` columns of I). It gathers
   its rows' tokens from ``x``, multiplies them by the expert's gate rows and up rows of ``w13``
   (two float32 accumulators over ``BLOCK_K`` steps) and writes ``silu(gate) * up`` per pair.
   Fusing the activation into the epilogue saves writing and re-reading ``[pairs, 2 * I]`` and a
   launch, at the cost of a second accumulator (registers); gate and up columns ``n`` and
   ``I + n`` sit in the same program so the epilogue needs nothing from another program.
3. Down: the same kernel over ``[pairs, I] @ w2[e]^T``, the routing weight multiplied into the
   epilogue, one output row per pair; then a sum over each token's ``top_k`` rows (float32).
   Programs whose block lies past the used length (read from the device) exit at once.

``route`` does the router's softmax, top-k and renormalisation in one launch (torch takes five).

Roundings follow the torch reference: each projection is rounded to the model dtype before the
activation, the product and the routing weight, as torch does between its ops. Only the sum over
a token's experts differs: float32 then one rounding, where torch adds them one by one in the
model dtype (equal in float32 up to addition order).
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from engine.kernels import nvrtc, pdl_launch, token_gemv
from engine.kernels.pdl import enter, leave_loop


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Tile sizes and warps of the grouped GEMMs for one batch shape."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3


def moe_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for ``num_pairs`` (token, expert) pairs over ``num_experts`` experts.

    Decode (a few tokens, most experts get 0 or 1 pair): the GEMMs are weight-bandwidth bound and a
    row block is mostly padding, so the smallest block ``tl.dot`` takes (16 rows) and narrow column
    tiles, which spread each expert's weights over many programs. Prefill (many pairs per expert):
    64- then 128-row blocks reuse each weight tile over more rows. (Measured on an H200 with
    Qwen3-30B-A3B's shapes, bf16: the decode choices were within 5% of the best of the variants
    tried, the 128-row tiles 16% faster than 64-row ones at 8192 tokens.)
    """
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4)
    if per_expert <= 48:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4)
    if per_expert <= 192:
        return MoeTiles(block_m=64, block_n=64, block_k=64, num_warps=4)
    return MoeTiles(block_m=128, block_n=128, block_k=64, num_warps=8)


@functools.cache
def measured_decode_tiles(device_name: str) -> dict[str, list[int]]:
    """Decode tiles of a tuning run for this GPU model (``ENGINE_MOE_TILES`` names a file
    ``{"<device name>": {"up" | "down": [block_n, block_k, num_warps, num_stages]}}``, as
    bench/device/moe_tiles.py writes it), else none."""
    path = os.environ.get("ENGINE_MOE_TILES")
    if not path:
        return {}
    table: dict[str, dict[str, list[int]]] = json.loads(Path(path).read_text())
    tiles = table.get(device_name, {})
    for gemm, tile in tiles.items():
        ints = len(tile) == 4 and all(isinstance(v, int) and v > 0 for v in tile)
        if gemm not in ("up", "down") or not ints or any(v & (v - 1) for v in tile[:3]):
            raise ValueError(
                f"ENGINE_MOE_TILES ({path}): {gemm!r}: {tile!r}; expected 'up' or 'down' with "
                "[block_n, block_k, num_warps, num_stages], the first three powers of two"
            )
    return tiles


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)  # asked once, not on every MoE layer of every step


def gemm_tiles(num_pairs: int, num_experts: int, device: torch.device) -> tuple[MoeTiles, MoeTiles]:
    """The up and the down projection's tiles: ``moe_tiles``, or a tuning run's for decode batches (same rows)."""
    tiles = moe_tiles(num_pairs, num_experts)
    decode = device.type == "cuda" and tiles.block_m == 16
    measured = measured_decode_tiles(_device_name(device.index or 0)) if decode else {}
    up, down = (
        replace(tiles, block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3]) if t else tiles
        for t in (measured.get("up"), measured.get("down"))
    )
    return up, down


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted pair list: every pair, plus the padding of each expert that can get one."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


# -- align: sort the pairs by expert, runs padded to BLOCK_M -------------------------------------


@triton.jit
def _store_block_experts(expert_ids_ptr, ends, valid, num_blocks, BLOCK_M: tl.constexpr, BB: tl.constexpr):
    # Block b belongs to the expert whose run covers row b * BLOCK_M: the number of runs ending at
    # or before it (``ends``: each expert's run end, ``valid``: which lanes are experts). Blocks
    # past the used length get num_experts; their programs never read it.
    # (A `while`: Triton's interpreter cannot run a `for` over a runtime bound.)
    b0 = 0
    while b0 < num_blocks:
        b = b0 + tl.arange(0, BB)
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & valid[None, :]
        tl.store(expert_ids_ptr + b, tl.sum(before.to(tl.int32), 1), mask=b < num_blocks)
        b0 += BB


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num_pairs
    e = tl.load(ids_ptr + i, mask=mask, other=0)
    tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=mask)


@triton.jit
def _layout_kernel(
    counts_ptr, cursor_ptr, expert_ids_ptr, used_ptr, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, BB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    e = tl.arange(0, EP)
    em = e < num_experts
    c = tl.load(counts_ptr + e, mask=em, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded, mask=em)  # each run's start: the next free row
    tl.store(used_ptr, tl.sum(padded, 0))
    _store_block_experts(expert_ids_ptr, ends, em, num_blocks, BLOCK_M, BB)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num_pairs
    e = tl.load(ids_ptr + i, mask=mask, other=0)
    row = tl.atomic_add(cursor_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=mask)
    tl.store(sorted_ptr + row, i, mask=mask)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, used_ptr, offset_ptr, num_pairs, num_experts, capacity, num_blocks,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, B: tl.constexpr, BB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    _align_one_program(ids_ptr, sorted_ptr, expert_ids_ptr, used_ptr, offset_ptr, num_pairs, num_experts, capacity,
                       num_blocks, BLOCK_M, EP, B, BB)  # fmt: skip


@triton.jit
def _align_one_program(
    ids_ptr, sorted_ptr, expert_ids_ptr, used_ptr, offset_ptr, num_pairs, num_experts, capacity, num_blocks,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, B: tl.constexpr, BB: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, B)
    e = tl.load(ids_ptr + i, mask=i < num_pairs, other=num_experts).to(tl.int32)  # padding: expert E
    x = tl.arange(0, EP)
    xm = x < num_experts
    counts = tl.where(xm, tl.histogram(e, EP), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    # The j-th pair in sorted order, of expert x, goes to row (run start - pairs before x) + j.
    tl.store(offset_ptr + x, ends - padded - (tl.cumsum(counts, 0) - counts), mask=xm)
    tl.store(used_ptr, tl.sum(padded, 0))
    _store_block_experts(expert_ids_ptr, ends, xm, num_blocks, BLOCK_M, BB)
    r0 = 0
    while r0 < capacity:
        r = r0 + tl.arange(0, B)
        tl.store(sorted_ptr + r, tl.full([B], 0, tl.int32) + num_pairs, mask=r < capacity)
        r0 += B
    tl.debug_barrier()  # the offsets and the sentinel rows, written by other threads, are in place
    key = tl.sort(e * B + i)  # by expert, then pair: unique keys, so the order is total
    ke = key // B
    km = ke < num_experts
    row = tl.load(offset_ptr + ke, mask=km, other=0) + i
    tl.store(sorted_ptr + row, key % B, mask=km)


# Batches of at most this many pairs are aligned by one program (one launch; decode).
ONE_PROGRAM_PAIRS = 1024


@dataclass(frozen=True, slots=True)
class Alignment:
    """The pairs sorted by expert (device tensors of static size; see the module docstring)."""

    sorted_pairs: torch.Tensor  # [capacity] int32: pair index t * top_k + k, or num_pairs for padding
    expert_ids: torch.Tensor  # [capacity // block_m] int32: the expert of each block of rows
    used: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)


def _one_program_alignment(
    num_pairs: int, num_experts: int, block_m: int, dev: torch.device
) -> tuple[Alignment, torch.Tensor, dict[str, int]]:
    """What a one-program alignment (``_align_one_program``) writes: the ``Alignment``'s buffers, its scratch of
    per-expert offsets, and its launch's sizes (runtime ``capacity, num_blocks``, then the constexprs)."""
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    num_blocks = capacity // block_m
    al = Alignment(
        torch.empty(capacity, dtype=torch.int32, device=dev),
        torch.empty(num_blocks, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
    )
    sizes = {"capacity": capacity, "num_blocks": num_blocks, "BLOCK_M": block_m,
             "EP": triton.next_power_of_2(num_experts + 1), "B": max(16, triton.next_power_of_2(num_pairs)),
             "BB": min(64, triton.next_power_of_2(num_blocks))}  # fmt: skip
    return al, torch.empty(num_experts, dtype=torch.int32, device=dev), sizes


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the flattened ``topk_ids [tokens, top_k]`` pairs by expert, each run padded to ``block_m``."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    dev = ids.device
    pdl = pdl_launch(dev, topk_ids.shape[0])
    if num_pairs <= ONE_PROGRAM_PAIRS:
        al, offsets, sizes = _one_program_alignment(num_pairs, num_experts, block_m, dev)
        _align_one_program_kernel[(1,)](
            ids, al.sorted_pairs, al.expert_ids, al.used, offsets, num_pairs, num_experts, **sizes, **pdl
        )
        return al
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    num_blocks = capacity // block_m
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    used = torch.empty(1, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=dev)
    block = 1024
    grid = (triton.cdiv(num_pairs, block),)
    _count_kernel[grid](ids, counts, num_pairs, BLOCK=block, **pdl)
    _layout_kernel[(1,)](
        counts, cursor, expert_ids, used, num_experts, num_blocks,
        BLOCK_M=block_m, EP=triton.next_power_of_2(num_experts), BB=64, **pdl,
    )  # fmt: skip
    _scatter_kernel[grid](ids, cursor, sorted_pairs, num_pairs, BLOCK=block, **pdl)
    return Alignment(sorted_pairs, expert_ids, used)


# -- grouped GEMM ---------------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, used_ptr, route_w_ptr,
    num_pairs, w_stride_e, num_n_blocks, N: tl.constexpr, K: tl.constexpr,
    A_DIV: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)  # before the early exit: every program waits
    # out[pair, n] = sum_k a[pair // A_DIV, k] * w[e, n, k] for the rows of one block of one expert.
    # GATED: w holds gate rows [0, N) then up rows [N, 2N); out = silu(gate) * up.
    # ROUTED: out is scaled by the pair's routing weight.
    pid = tl.program_id(0)
    pid_m = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return  # a block past the used rows: the grid is sized for the worst routing
    dt: tl.constexpr = out_ptr.dtype.element_ty
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // A_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None] * K
    w_cols = w_ptr + expert * w_stride_e + n.to(tl.int64)[None, :] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        km = k < K
        a = tl.load(a_rows + k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            wu = tl.load(w_cols + N * K + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    leave_loop(PDL)
    if GATED:
        # torch rounds each projection, the activation and the product to the model dtype.
        g = acc.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (s * acc_up.to(dt).to(tl.float32)).to(dt)
    else:
        y = acc.to(dt)
    if ROUTED:
        # torch: the projection's output (model dtype) times the weight, in the weight's dtype.
        rw = tl.load(route_w_ptr + pairs, mask=valid, other=0.0)
        y = (y.to(tl.float32) * rw.to(tl.float32)[:, None]).to(rw.dtype).to(dt)
    out = out_ptr + pairs.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, y, mask=valid[:, None] & nm[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, al: Alignment, route_w: torch.Tensor,
    a_div: int, gated: bool, routed: bool, tiles: MoeTiles,
) -> None:  # fmt: skip
    n = out.shape[1]
    k = a.shape[1]
    num_pairs = out.shape[0]
    tokens = route_w.shape[0]
    bn = min(tiles.block_n, max(16, triton.next_power_of_2(n)))
    bk = min(tiles.block_k, max(16, triton.next_power_of_2(k)))
    num_n = triton.cdiv(n, bn)
    grid = (al.expert_ids.shape[0] * num_n,)
    _grouped_gemm_kernel[grid](
        a, w, out, al.sorted_pairs, al.expert_ids, al.used, route_w,
        num_pairs, w.stride(0), num_n, N=n, K=k,
        A_DIV=a_div, GATED=gated, ROUTED=routed,
        BLOCK_M=tiles.block_m, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(a.device, tokens),
    )  # fmt: skip


@triton.jit
def _route_tokens(
    logits_ptr, weights_ptr, ids_ptr, t0, tokens, E: tl.constexpr, TOP_K: tl.constexpr, TOP_KP: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PARTS: tl.constexpr,
    LOGITS_DT: tl.constexpr,
):  # fmt: skip
    # Tokens t0 .. t0 + BLOCK_T - 1 (those below ``tokens``): softmax over E experts in float32, the TOP_K largest
    # (ties to the lower id), optionally divided by their sum (added in selection order, as torch does). With
    # PARTS > 1 the logits are the router's float32 parts [tokens, PARTS, E] (a skinny matmul split along K): summed
    # in float32 and rounded once to LOGITS_DT, the router's output as one launch would have written it.
    t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    tm = t < tokens
    e = tl.arange(0, BLOCK_E)
    em = e < E
    mask = tm[:, None] & em[None, :]
    if PARTS > 1:
        logits = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for part in tl.static_range(PARTS):
            logits += tl.load(logits_ptr + (t[:, None] * PARTS + part) * E + e[None, :], mask=mask, other=0.0)
        logits = tl.where(mask, logits.to(LOGITS_DT), float("-inf"))
    else:
        logits = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=mask, other=float("-inf"))
    logits = tl.where(tm[:, None], logits.to(tl.float32), 0.0)  # rows past the batch: finite, never stored
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # One reduction a pick: a probability (>= 0, so its bits order as it does) above the complement of its id, so
    # the largest key is the largest probability, ties to the lower id. Lanes past E and taken lanes hold -1.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e)[None, :]
    key = tl.where(em[None, :], key, -1)
    j = tl.arange(0, TOP_KP)
    picked = tl.zeros([BLOCK_T, TOP_KP], tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        idx = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        w = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        key = tl.where(e[None, :] == idx[:, None], -1, key)
        total += w
        picked = tl.where(j[None, :] == k, w[:, None], picked)
        tl.store(ids_ptr + t * TOP_K + k, idx.to(tl.int64), mask=tm)
    if RENORMALIZE:
        picked = picked / total[:, None]
    out = weights_ptr + t[:, None] * TOP_K + j[None, :]
    tl.store(out, picked.to(weights_ptr.dtype.element_ty), mask=tm[:, None] & (j < TOP_K)[None, :])


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, tokens, E: tl.constexpr, TOP_K: tl.constexpr, TOP_KP: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    _route_tokens(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0), tokens, E, TOP_K, TOP_KP, RENORMALIZE, 1, BLOCK_E,
                  1, tl.float32)  # fmt: skip


@triton.jit
def _route_and_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ids_ptr, used_ptr, offset_ptr, tokens, num_experts, capacity,
    num_blocks, E: tl.constexpr, TOP_K: tl.constexpr, TOP_KP: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, EP: tl.constexpr, B: tl.constexpr,
    BB: tl.constexpr, PDL: tl.constexpr, PARTS: tl.constexpr, LOGITS_DT: tl.constexpr,
):  # fmt: skip
    # A decode batch's routing and alignment in one program: the ids go through memory to the alignment.
    enter(PDL)
    _route_tokens(logits_ptr, weights_ptr, ids_ptr, 0, tokens, E, TOP_K, TOP_KP, RENORMALIZE, BLOCK_T, BLOCK_E,
                  PARTS, LOGITS_DT)  # fmt: skip
    tl.debug_barrier()  # every token's ids, stored by other threads, are in place
    _align_one_program(ids_ptr, sorted_ptr, expert_ids_ptr, used_ptr, offset_ptr, tokens * TOP_K, num_experts,
                       capacity, num_blocks, BLOCK_M, EP, B, BB)  # fmt: skip


# Warps of a routing program (measured on an H200, qwen3-30b-a3b at batch 1: four 2.6% faster than one).
ROUTE_WARPS = 4


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, keep_float32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.models.moe.route`` in one launch: routing weights (float32 with ``keep_float32``, else the
    logits' dtype) and int64 expert ids, ``[tokens, top_k]`` each."""
    tokens, experts = router_logits.shape
    dtype = torch.float32 if keep_float32 else router_logits.dtype
    weights = torch.empty((tokens, top_k), dtype=dtype, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            router_logits.contiguous(), weights, ids, tokens, E=experts, TOP_K=top_k,
            TOP_KP=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(experts),
            num_warps=ROUTE_WARPS, **pdl_launch(router_logits.device, tokens),
        )  # fmt: skip
    return weights, ids


# Batches of at most this many tokens are routed and aligned by one program in one launch (decode steps).
ROUTE_AND_ALIGN_TOKENS = 16


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, keep_float32: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:  # fmt: skip
    """``route``, then ``align`` for the up projection's tiles, in one launch: for at most ``ROUTE_AND_ALIGN_TOKENS``
    tokens, where each launch is a few microseconds of a step; larger batches take the two. Pass the
    ``Alignment`` to ``fused_moe``.

    ``router_logits`` may be the router's float32 parts ``[tokens, parts, experts]`` (``gemv(..., parts=...)``),
    with ``dtype`` the router's own: the kernel sums them and rounds once to ``dtype``, so a split router costs no
    launch (larger batches sum them first)."""
    if router_logits.dim() == 3:
        if dtype is None:
            raise ValueError("route_and_align: the router's parts need the dtype their sum rounds to")
        parts = router_logits.shape[1]
        tokens, experts = router_logits.shape[0], router_logits.shape[2]
    else:
        if dtype not in (None, router_logits.dtype):
            raise ValueError(f"route_and_align: {router_logits.dtype} logits, not {dtype}: a dtype is for parts")
        parts, dtype = 1, router_logits.dtype
        tokens, experts = router_logits.shape
    block_m = gemm_tiles(tokens * top_k, experts, router_logits.device)[0].block_m
    if not 0 < tokens <= ROUTE_AND_ALIGN_TOKENS:
        logits = router_logits.sum(dim=1, dtype=torch.float32).to(dtype) if parts > 1 else router_logits
        weights, ids = route(logits, top_k, renormalize, keep_float32)
        return weights, ids, align(ids, experts, block_m)
    dev = router_logits.device
    weights = torch.empty((tokens, top_k), dtype=torch.float32 if keep_float32 else dtype, device=dev)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=dev)
    al, offsets, sizes = _one_program_alignment(tokens * top_k, experts, block_m, dev)
    _route_and_align_kernel[(1,)](
        router_logits.contiguous(), weights, ids, al.sorted_pairs, al.expert_ids, al.used, offsets, tokens, experts,
        E=experts, TOP_K=top_k, TOP_KP=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        BLOCK_T=max(2, triton.next_power_of_2(tokens)), BLOCK_E=triton.next_power_of_2(experts),
        PARTS=parts, LOGITS_DT=_TL_DTYPES[dtype], num_warps=ROUTE_WARPS, **sizes, **pdl_launch(dev, tokens),
    )  # fmt: skip
    return weights, ids, al


def one_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``fused_moe`` runs one token's experts on the CUDA one-token kernel (``engine.kernels.token_gemv``),
    which needs no alignment."""
    return (
        x.shape[0] == 1 and token_gemv.supports_experts(x, w13, w2) and token_gemv.moe_enabled()
        and nvrtc.available()
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    alignment: Alignment | None = None, sum_experts: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for ``x [tokens, H]``.

    ``w13 [E, 2 * I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``; an expert is
    ``w2 @ (silu(gate @ x) * (up @ x))``. ``topk_weights`` may be float32 or the model dtype (the
    weighting is done in its dtype, as torch does). ``alignment``: ``route_and_align``'s, else aligned here.
    Without ``sum_experts`` the result is ``[tokens, top_k, H]``, each expert's weighted output, for the
    caller's next kernel to sum (the decoder's residual add: one launch fewer a layer).
    """
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    route_w = topk_weights.contiguous()
    if one_token(x, w13, w2):
        # One token: each routed expert's rows streamed by the CUDA kernel, no alignment needed.
        h1 = token_gemv.token_experts(x, w13, topk_ids, None, gated=True)
        y1 = token_gemv.token_experts(h1, w2, topk_ids, route_w, gated=False)
        return y1.view(1, top_k, hidden) if not sum_experts else y1.sum(dim=0, keepdim=True)
    up, down = gemm_tiles(num_pairs, num_experts, x.device)
    if alignment is not None and alignment.sorted_pairs.shape[0] != padded_capacity(num_pairs, num_experts, up.block_m):
        raise ValueError("fused_moe: the alignment was made for other tiles or another number of experts")
    al = alignment or align(topk_ids.contiguous(), num_experts, up.block_m)
    h = torch.empty((num_pairs, two_i // 2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, al, route_w, top_k, True, False, up)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, y, al, route_w, 1, False, True, down)
    if not sum_experts:
        return y.view(tokens, top_k, hidden)
    if top_k == 1:
        return y
    return y.view(tokens, top_k, hidden).sum(dim=1)
