"""Fused GPU kernels (Triton) for the model's hot path, each beside the torch code it must equal.

``engine.kernels.triton_ops`` holds the kernels; the plain-torch reference of each op lives with the
model (``engine.models.decoder`` and ``engine.attention``) and is what the CPU runs. Triton is only
imported when a CUDA device asks for it, or when ``TRITON_INTERPRET=1`` runs the kernels on the CPU
in tests.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (it comes with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """``TRITON_INTERPRET=1``: kernels run on CPU tensors through Triton's interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


# Keys per tile of the decode attention kernel; a split covers a multiple of it.
DECODE_BLOCK_N = 64


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


# Decode attention programs an SM runs at once, by the measured decode tiles (triton_ops.decode_tile): one-warp
# programs, for a 16-bit cache as for an FP8 one. A decode step splits contexts until its programs fill one such
# wave: a second, partial wave costs more than the split saves (bench/device/fp8_tune.py --only splits).
DECODE_PROGRAMS_PER_SM = {False: 8, True: 8}
MAX_DECODE_SPLITS = 64


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device, fp8: bool = False) -> int:
    """How many programs share one sequence's context in a decode step: as many as fill one wave of the GPU (see
    ``DECODE_PROGRAMS_PER_SM``), at most one per 32 keys of the longest context and ``MAX_DECODE_SPLITS``. Each
    program's share is sized from its sequence's own context in the kernel, so a CUDA graph captured with the
    longest context splits short ones as finely. ``fp8``: the cache is float8 (its decode programs are smaller)."""
    # On CPU (Triton's interpreter, in tests) a few programs: each costs the interpreter time.
    programs = DECODE_PROGRAMS_PER_SM[fp8] * sm_count(device.index or 0) if device.type == "cuda" else 12
    fit = programs // max(num_seqs * num_kv_heads, 1)
    return max(1, min(fit, MAX_DECODE_SPLITS, -(-max_context // (DECODE_BLOCK_N // 2))))


def prefill_block_m(group: int) -> int:
    """Rows of one attention program over prompt tokens: query tokens x the heads of one KV group."""
    return max(64, 1 << (group - 1).bit_length())


def tile_map(query_lens: list[int], group: int, capacity: int) -> tuple[list[int], list[int]]:
    """(sequence, query tile) of each attention program for a batch, padded with -1 to ``capacity``.

    A sequence of ``q`` query tokens needs ``ceil(q / tile)`` programs, ``tile`` being
    ``prefill_block_m(group) // group`` tokens.
    """
    tile = prefill_block_m(group) // group
    seqs: list[int] = []
    tiles: list[int] = []
    for s, q in enumerate(query_lens):
        n = -(-q // tile)
        seqs.extend([s] * n)
        tiles.extend(range(n))
    if len(seqs) > capacity:
        raise ValueError(f"the batch needs {len(seqs)} attention programs, more than {capacity}")
    pad = capacity - len(seqs)
    return seqs + [-1] * pad, tiles + [0] * pad


def tile_capacity(max_tokens: int, max_seqs: int, group: int) -> int:
    """Programs enough for any batch of at most ``max_tokens`` tokens in ``max_seqs`` sequences."""
    tile = prefill_block_m(group) // group
    return -(-max_tokens // tile) + min(max_seqs, max_tokens)
