"""Fused GPU kernels (Triton) for the model's hot path, each beside the torch code it must equal.

``engine.kernels.triton_ops`` holds the kernels; the plain-torch reference of each op lives with the
model (``engine.models.decoder`` and ``engine.attention``) and is what the CPU runs. Triton is only
imported when a CUDA device asks for it, or when ``TRITON_INTERPRET=1`` runs the kernels on the CPU
in tests.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os

import torch


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (it comes with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """``TRITON_INTERPRET=1``: kernels run on CPU tensors through Triton's interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


# Programmatic dependent launch (``engine.kernels.pdl``): a kernel's ``PDL`` constexpr. OFF: a plain launch. EARLY:
# the next kernel may launch as soon as this one has started. LOOP: once this one's programs have left their main
# loop. Which kernel takes which was measured (docs/engine.md, "Tenth round").
PDL_OFF, PDL_EARLY, PDL_LOOP = 0, 1, 2
# Steps of at most this many tokens take PDL: those whose linear layers run on the skinny-matmul kernel
# (engine.kernels.gemv), so that nearly every kernel of the step is one of ours. In larger steps cuBLAS's kernels sit
# between ours, and PDL measured slower there (SmolLM2 at batch 64).
PDL_MAX_TOKENS = 16
_PLAIN: dict[str, object] = {"PDL": PDL_OFF}


@functools.cache
def pdl_enabled(device_index: int, setting: str) -> bool:
    """``ENGINE_PDL``: unset, on wherever the GPU has programmatic dependent launch (NVIDIA, compute capability 9.0
    and later); ``0`` off; ``1`` on, and an error on a GPU without it."""
    if setting not in ("", "0", "1"):
        raise ValueError(f"ENGINE_PDL must be 0 or 1, got {setting!r}")
    if setting == "0" or interpret_mode():
        return False  # Triton's interpreter runs no PTX; the kernels compute the same with PDL off
    if torch.version.hip is not None:  # ROCm reports its GPUs as "cuda" devices, with capabilities of its own
        if setting == "1":
            raise ValueError("ENGINE_PDL=1 needs an NVIDIA GPU (programmatic dependent launch is CUDA's, sm_90 on)")
        return False
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9 and setting == "1":
        raise ValueError(f"ENGINE_PDL=1 needs programmatic dependent launch (compute capability 9.0 or later); "
                         f"{torch.cuda.get_device_name(device_index)} is {major}.{minor}")  # fmt: skip
    return major >= 9


def pdl_launch(device: torch.device, tokens: int, trigger: int = PDL_EARLY) -> dict[str, object]:
    """Keyword arguments of a kernel launch in a step of ``tokens`` tokens: its ``PDL`` constexpr (``trigger``, or
    ``PDL_OFF``) and, when it takes part in programmatic dependent launch, ``launch_pdl``."""
    if trigger == PDL_OFF or device.type != "cuda" or tokens > PDL_MAX_TOKENS:
        return _PLAIN
    if not pdl_enabled(device.index or 0, os.environ.get("ENGINE_PDL", "")):
        return _PLAIN
    return {"PDL": trigger, "launch_pdl": True}


# Keys per tile of the decode attention kernel; a split covers a multiple of it.
DECODE_BLOCK_N = 64


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """How a decode step's attention programs (``triton_ops.paged_attention``) run: keys per tile, warps, pipeline
    stages, a register cap (0: the compiler's choice; fewer registers fit more programs on an SM, at the price of
    spills), the loop's form (``unmasked`` runs tiles every query sees whole without masks, ``lazy_rescale`` moves
    the running maximum, and rescales the output, only when a row's grew by more than 2^8) and how many of them an
    SM holds, which sizes a step's splits (``decode_splits``)."""

    block_n: int
    warps: int
    stages: int
    max_registers: int = 0
    unmasked: bool = False
    lazy_rescale: bool = False
    # Programs an SM runs at once: a decode step splits contexts until its programs fill one such wave (a second,
    # partial wave costs more than the split saves: bench/device/fp8_tune.py --only splits).
    programs_per_sm: int = 8


# Measured on an H200 (docs/engine.md, decode attention rounds six, seven and fourteen): both cache dtypes stream best
# from 1-warp programs over 32 keys, eight of which fit on an SM (192-255 registers a thread: two on each scheduler's
# 16K registers); a 16-bit cache with the lazy rescale and masks kept, an FP8 one (V widened in registers) without
# masks on whole tiles and with the eager rescale. A register cap spills and loses, alone and at the power cap;
# 4-warp programs lose their pipeline's fill twice over two loops.
DECODE_TILES = {False: DecodeTile(DECODE_BLOCK_N // 2, 1, 3, lazy_rescale=True),
                True: DecodeTile(DECODE_BLOCK_N // 2, 1, 3, unmasked=True)}  # fmt: skip


def _decode_tile_override(text: str) -> dict[str, dict[str, object]]:
    fields = {f.name for f in dataclasses.fields(DecodeTile)}
    try:
        override = json.loads(text)
        if not isinstance(override, dict) or any(
            k not in ("bf16", "fp8") or not isinstance(v, dict) or set(v) - fields for k, v in override.items()
        ):
            raise ValueError("not of that form")
    except ValueError as e:
        example = '{"fp8": {"max_registers": 128}}'
        raise ValueError(f"ENGINE_DECODE_TILES must be a JSON object of 'bf16' and/or 'fp8' to DecodeTile fields "
                         f"({', '.join(sorted(fields))}), e.g. {example}: {e}") from e  # fmt: skip
    return override


def decode_tile(fp8: bool) -> DecodeTile:
    """The measured decode tile for a 16-bit or an FP8 cache (``DECODE_TILES``). ``ENGINE_DECODE_TILES`` (a tuning
    run's choice, JSON: ``{"fp8": {"max_registers": 128}}``) overrides fields of either."""
    return _decode_tile(fp8, os.environ.get("ENGINE_DECODE_TILES", ""))


@functools.cache
def _decode_tile(fp8: bool, override: str) -> DecodeTile:
    # Every attention launch of an eager step asks: the override is parsed and applied once per value.
    fields = _decode_tile_override(override).get("fp8" if fp8 else "bf16", {}) if override else {}
    return dataclasses.replace(DECODE_TILES[fp8], **fields)  # type: ignore[arg-type]


MAX_DECODE_SPLITS = 64


def decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device, fp8: bool = False) -> int:
    """How many programs share one sequence's context in a decode step: as many as fill one wave of the GPU (the
    decode tile's ``programs_per_sm``), at most one per tile of the longest context and ``MAX_DECODE_SPLITS``. Each
    program's share is sized from its sequence's own context in the kernel, so a CUDA graph captured with the
    longest context splits short ones as finely. ``fp8``: the cache is float8 (its own measured tile)."""
    if fp8 and device.type == "cuda":
        from engine.kernels import fp8_decode, nvrtc  # the CUDA kernel's own rule (its module imports this one)

        if fp8_decode.enabled() and nvrtc.available():
            return fp8_decode.splits(num_seqs, num_kv_heads, max_context, sm_count(device.index or 0),
                                     MAX_DECODE_SPLITS)  # fmt: skip
    # On CPU (Triton's interpreter, in tests) a few programs: each costs the interpreter time.
    tile = decode_tile(fp8)
    programs = tile.programs_per_sm * sm_count(device.index or 0) if device.type == "cuda" else 12
    fit = programs // max(num_seqs * num_kv_heads, 1)
    return max(1, min(fit, MAX_DECODE_SPLITS, -(-max_context // tile.block_n)))


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
