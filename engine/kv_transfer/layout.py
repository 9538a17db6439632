"""Where KV blocks live in memory and how a block copy becomes a few large writes.

A *region* is one contiguous registered buffer holding ``num_blocks`` equal units: block ``b`` of
the region lives at ``base + b * unit_bytes``. The engine's KV cache is one K and one V region per
layer; the sparse indexer-key cache adds one region per layer. Producer and consumer list their
regions in the same order with the same ``unit_bytes``; only the bases and block counts differ.

Copying block ids ``src[i] -> dst[i]`` in every region becomes one :class:`WriteOp` per run of
consecutive ids on both sides (per region), then ops adjacent in memory on both sides are merged
(e.g. K's last block and V's first). Mooncake moves one 64 MiB entry ~6x faster than 1024 4 KiB ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

SKIP = -1  # a destination block id meaning "do not send this block"


MAX_FORMAT_CHARS = 96


@dataclass(frozen=True, slots=True)
class Region:
    """One registered buffer of ``num_blocks`` units of ``unit_bytes``, block ``b`` at ``base + b * unit_bytes``.

    ``fmt`` says what a unit holds, its element type and shape (``region_formats``), where the region is a cache's
    (empty for staging buffers and peers that do not say): units of equal size but another format are not the same
    KV."""

    base: int
    unit_bytes: int
    num_blocks: int
    fmt: str = ""

    @property
    def nbytes(self) -> int:
        return self.unit_bytes * self.num_blocks

    def to_wire(self) -> list[int | str]:
        return [self.base, self.unit_bytes, self.num_blocks, *([self.fmt] if self.fmt else [])]

    @classmethod
    def from_wire(cls, raw: object) -> Region:
        if not (
            isinstance(raw, list | tuple)
            and len(raw) in (3, 4)
            and all(isinstance(x, int) for x in raw[:3])
            and (len(raw) == 3 or (isinstance(raw[3], str) and 0 < len(raw[3]) <= MAX_FORMAT_CHARS))
        ):
            raise ValueError(f"a region is [base, unit_bytes, num_blocks] and a format string, got {raw!r}"[:200])
        base, unit, n = raw[:3]
        if base <= 0 or unit <= 0 or n <= 0:
            raise ValueError(f"region fields must be positive, got {raw!r}")
        return cls(base, unit, n, raw[3] if len(raw) == 4 else "")


@dataclass(frozen=True, slots=True)
class WriteOp:
    """One Mooncake write entry: ``nbytes`` from local ``src`` to remote ``dst``."""

    src: int
    dst: int
    nbytes: int


def block_region(t: torch.Tensor) -> Region:
    """The region of a contiguous ``[num_blocks, ...]`` tensor: an indexer cache, or a block-major KV cache."""
    if not t.is_contiguous() or t.dim() < 1 or t.shape[0] == 0:
        raise ValueError(f"a block region must be a contiguous [num_blocks, ...] tensor, got {tuple(t.shape)}")
    return Region(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0])


def _region_tensors(kv_caches: Sequence[torch.Tensor], indexer_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each region's tensor, in order: per layer K then V of a ``[2, num_blocks, ...]`` cache, then the indexer
    caches."""
    tensors: list[torch.Tensor] = []
    for t in kv_caches:
        if not t.is_contiguous() or t.dim() < 2 or t.shape[0] != 2:
            raise ValueError(f"a KV cache must be a contiguous [2, num_blocks, ...] tensor, got {tuple(t.shape)}")
        tensors += [t[0], t[1]]
    return tensors + list(indexer_caches)


def region_views(
    kv_caches: Sequence[torch.Tensor], indexer_caches: Sequence[torch.Tensor] = (), num_blocks: int | None = None
) -> list[torch.Tensor]:
    """Each region of the engine's caches as a ``[num_blocks, unit_bytes]`` uint8 view (what staging copies).

    The order is per layer K then V of a ``[2, num_blocks, ...]`` tensor, then the indexer caches
    (``[num_blocks, ...]``, one per sparse layer). ``num_blocks`` (the engine's pool size) trims
    tensors that hold more blocks (a trailing scratch block is not the pool's). Every tensor must be
    contiguous, since a region is addressed by plain pointer arithmetic.
    """
    views: list[torch.Tensor] = []
    for t in _region_tensors(kv_caches, indexer_caches):
        if not t.is_contiguous() or t.dim() < 1 or t.shape[0] == 0:
            raise ValueError(f"a block region must be a contiguous [num_blocks, ...] tensor, got {tuple(t.shape)}")
        if num_blocks is not None and not 0 < num_blocks <= t.shape[0]:
            raise ValueError(f"num_blocks {num_blocks} does not fit a cache of {t.shape[0]} blocks")
        rows = t.reshape(t.shape[0], -1)[: num_blocks or t.shape[0]]
        views.append(rows.view(torch.uint8))
    return views


def view_region(view: torch.Tensor, fmt: str = "") -> Region:
    """The region of a ``[num_blocks, unit_bytes]`` uint8 view (``fmt``: what a unit holds, see ``Region``)."""
    return Region(view.data_ptr(), view.shape[1], view.shape[0], fmt)


def region_formats(kv_caches: Sequence[torch.Tensor], indexer_caches: Sequence[torch.Tensor] = ()) -> list[str]:
    """What a unit of each region holds, in ``region_views``' order: its element type and shape, e.g.
    ``bfloat16[8,16,128]`` for a head-major block of 8 KV heads, 16 slots and 128 dims. Two engines whose caches
    differ in it (one in float16, the other in bfloat16; another block size or head layout of the same bytes)
    cannot exchange blocks, though their units are the same size."""
    return [f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape[1:]))}]"
            for t in _region_tensors(kv_caches, indexer_caches)]  # fmt: skip


def regions_from_kv_caches(
    kv_caches: Sequence[torch.Tensor], indexer_caches: Sequence[torch.Tensor] = (), num_blocks: int | None = None
) -> list[Region]:
    """Regions of the engine's caches: per layer K then V, then indexer caches (see ``region_views``), each with its
    format (``region_formats``)."""
    views = region_views(kv_caches, indexer_caches, num_blocks)
    return [view_region(v, f) for v, f in zip(views, region_formats(kv_caches, indexer_caches), strict=True)]


def spans(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """Merged ``(start, end)`` address ranges of the regions: what an agent registers with Mooncake.

    Touching or overlapping regions (K and V of one layer tensor) merge, since Mooncake refuses
    overlapping registrations.
    """
    merged: list[tuple[int, int]] = []
    for r in sorted(regions, key=lambda r: r.base):
        end = r.base + r.nbytes
        if merged and r.base <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((r.base, end))
    return merged


def check_compatible(local: Sequence[Region], remote: Sequence[Region]) -> str | None:
    """Why two region lists cannot exchange blocks (count, unit sizes or, where both say, formats differ), or None
    when they can."""
    if len(local) != len(remote):
        return f"region count differs: producer has {len(local)}, consumer {len(remote)}"
    for i, (a, b) in enumerate(zip(local, remote, strict=True)):
        if a.unit_bytes != b.unit_bytes:
            return f"region {i}: unit_bytes differ (producer {a.unit_bytes}, consumer {b.unit_bytes})"
        if a.fmt and b.fmt and a.fmt != b.fmt:
            return f"region {i}: KV formats differ (producer {a.fmt}, consumer {b.fmt})"
    return None


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs ``(src_start, dst_start, length)`` of ids consecutive on both sides, in order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"block lists differ in length: {len(src_ids)} vs {len(dst_ids)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def pair_blocks(
    src_regions: Sequence[Region], dst_regions: Sequence[Region], src_ids: Sequence[int], dst_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The block pairs to copy, without the ``SKIP`` destinations, checked against both sides' regions.

    Raises ValueError when the regions are incompatible, the lists differ in length, or an id is
    outside a region.
    """
    why = check_compatible(src_regions, dst_regions)
    if why:
        raise ValueError(why)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} source blocks")
    pairs = [(int(s), int(d)) for s, d in zip(src_ids, dst_ids, strict=True) if d != SKIP]
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    for side, regions, ids in (("source", src_regions, src), ("destination", dst_regions, dst)):
        limit = min((r.num_blocks for r in regions), default=0)
        bad = [b for b in ids if not 0 <= b < limit]
        if bad:
            raise ValueError(f"{side} block ids out of range [0, {limit}): {bad[:8]}")
    return src, dst


def plan_writes(
    src_regions: Sequence[Region], dst_regions: Sequence[Region], src_ids: Sequence[int], dst_ids: Sequence[int]
) -> list[WriteOp]:
    """The coalesced writes that copy block ``src_ids[i]`` to ``dst_ids[i]`` in every region.

    A destination id of ``SKIP`` (-1) leaves that block out: the consumer already holds it (e.g. a
    prefix-cache hit on the decode side). Raises ValueError when the regions are incompatible, the
    lists differ in length, or an id is outside a region.
    """
    src_ids, dst_ids = pair_blocks(src_regions, dst_regions, src_ids, dst_ids)
    runs = block_runs(src_ids, dst_ids)
    ops: list[WriteOp] = []
    for src, dst in zip(src_regions, dst_regions, strict=True):
        u = src.unit_bytes
        ops.extend(WriteOp(src.base + s * u, dst.base + d * u, n * u) for s, d, n in runs)
    return merge_adjacent(ops)


def merge_adjacent(ops: Sequence[WriteOp]) -> list[WriteOp]:
    """Merge ops that continue each other in memory on both sides (order-independent)."""
    merged: list[WriteOp] = []
    for op in sorted(ops, key=lambda o: o.src):
        if merged:
            last = merged[-1]
            if op.src == last.src + last.nbytes and op.dst == last.dst + last.nbytes:
                merged[-1] = WriteOp(last.src, last.dst, last.nbytes + op.nbytes)
                continue
        merged.append(op)
    return merged


def batches(ops: Sequence[WriteOp], max_entries: int) -> Iterator[Sequence[WriteOp]]:
    """Consecutive slices of at most ``max_entries`` ops (Mooncake refuses >1024 queued per peer)."""
    if max_entries <= 0:
        raise ValueError("max_entries must be positive")
    for i in range(0, len(ops), max_entries):
        yield ops[i : i + max_entries]
