"""Decode attention over an FP8 (e4m3) paged KV cache in CUDA C++ (``fp8_decode.cu``), compiled by NVRTC.

Triton's one-warp dot reads an FP8 key tile through shared memory and rebuilds the query's fragments from it every
tile; this kernel computes scores transposed (keys in the MMA's rows) with each lane widening its own contiguous
bytes straight into MMA registers (see the source's header). Same inputs, semantics and split partials as
``engine.kernels.triton_ops.paged_attention`` for a decode step (one query per sequence, no sliding window), head
size 128 and at most 8 query heads per KV head; ``supports`` says whether a call qualifies.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from engine.kernels import nvrtc
from engine.kernels.merge import merge_splits

_SOURCE = Path(__file__).with_name("fp8_decode.cu")
HEAD_DIM = 128
MAX_GROUP = 8
KEYS_PER_TILE = 32
# Programs resident on an SM: one warp each at the kernel's 152 registers a thread (sm_90, 64K registers an SM).
PROGRAMS_PER_SM = 13
# A program's cost beyond its tiles (its query's fragments, its partials' stores and their merge), in tiles: measured
# alone on the H200, 2 splits beat 1 and 4 at batch 256 and 2K context (264, 293, 290 us).
PROGRAM_OVERHEAD_TILES = 8


def enabled() -> bool:
    """``ENGINE_FP8_ATTENTION``: ``cuda`` (unset) runs FP8 decode attention on this kernel, ``triton`` on Triton's."""
    return nvrtc.use_cuda_kernel("ENGINE_FP8_ATTENTION")


def splits(num_seqs: int, kv_heads: int, max_context: int, sms: int, max_splits: int) -> int:
    """Programs a sequence for this kernel: the power of two whose waves of programs times a program's tiles (plus
    its overhead) is least, at most one a tile and ``max_splits``. More splits shorten the last, partial wave."""
    tiles = -(-max_context // KEYS_PER_TILE)
    slots = PROGRAMS_PER_SM * sms
    best, best_cost = 1, float("inf")
    s = 1
    while s <= min(max_splits, tiles):
        waves = -(-num_seqs * kv_heads * s // slots)
        cost = waves * (-(-tiles // s) + PROGRAM_OVERHEAD_TILES)
        if cost < best_cost:
            best, best_cost = s, cost
        s *= 2
    return best


def supports(q: torch.Tensor, kv_cache: torch.Tensor, max_query_len: int, window: int) -> bool:
    """Whether ``fp8_decode_attention`` runs this call: a CUDA decode step (one query each, no window) over an e4m3
    cache of head size 128, 16-bit queries, at most 8 query heads per KV head, blocks of a multiple of 16 slots."""
    _, _, kv_heads, bs, d = kv_cache.shape
    return (
        q.is_cuda and kv_cache.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)
        and max_query_len == 1 and window == 0 and d == HEAD_DIM and bs % 16 == 0
        and q.shape[1] % kv_heads == 0 and q.shape[1] // kv_heads <= MAX_GROUP and q.is_contiguous()
        and kv_cache.stride(4) == 1 and kv_cache.stride(3) == HEAD_DIM
    )  # fmt: skip


@cache
def _kernel(device: int, bs: int, sb: int, sh: int, ss: int, v_offset: int, bf16: bool) -> nvrtc.Kernel:
    defines = {"BS": bs, "SB": f"{sb}LL", "SH": f"{sh}LL", "SS": ss, "V_OFFSET": f"{v_offset}LL", "BF16": int(bf16)}
    return nvrtc.build(_SOURCE, "fp8_decode_attention", device, defines)


def fp8_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Attention of each sequence's one query ``q [seqs, H, 128]`` over its cached context (``kv_cache``
    ``[2, blocks, kv_heads, block_size, 128]`` of e4m3, addressed through its strides), ``num_splits`` programs a
    sequence whose partials the Triton merge sums. Block tables, query starts and context lengths are int32."""
    for name, t in (("block_tables", block_tables), ("query_start", query_start), ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"fp8_decode_attention: {name} must be int32, got {t.dtype}")
    _, _, kv_heads, bs, _ = kv_cache.shape
    seqs, heads = block_tables.shape[0], q.shape[1]
    el = kv_cache.element_size()
    kernel = _kernel(q.device.index or 0, bs, kv_cache.stride(1) * el, kv_cache.stride(2) * el,
                     kv_cache.stride(3) * el, kv_cache.stride(0) * el, q.dtype == torch.bfloat16)  # fmt: skip
    out = torch.empty_like(q)
    splits = max(1, num_splits)
    if splits > 1:
        part_acc = torch.empty((seqs, heads, splits, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    tables = block_tables
    args = [
        nvrtc.ptr(q), nvrtc.ptr(kv_cache), nvrtc.ptr(out), nvrtc.ptr(tables), nvrtc.ptr(query_start),
        nvrtc.ptr(context_lens), nvrtc.ptr(part_acc), nvrtc.ptr(part_ml), ctypes.c_float(scale * 1.4426950408889634),
        ctypes.c_longlong(tables.stride(0)), ctypes.c_int(splits), ctypes.c_int(heads), ctypes.c_int(heads // kv_heads),
    ]  # fmt: skip
    kernel((splits, seqs, kv_heads), 32, args)
    if splits > 1:
        merge_splits(part_acc, part_ml, out, splits)
    return out
