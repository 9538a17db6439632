"""Block-sparse decode attention in the manner of MiniMax Sparse Attention (MSA).

Every KV block has an entry in an *indexer-key cache* paged with the same block ids: one key vector
per KV head that summarises the block. At decode, each sequence's query scores its blocks through
those indexer keys, and attends only to the `topk` best blocks plus the first block (attention
sinks) and the most recent one (local context). With `topk` >= the number of blocks, every block is
selected and the result is dense attention exactly.

For a dense checkpoint (SmolLM2) the indexer keys are derived from the keys themselves, training
free: the mean of the block's (post-RoPE) keys. A model with a trained indexer would write its own
projection into the same cache through `IndexerKeys`; selection does not care where they come from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class IndexerKeys(Protocol):
    """Writes the indexer keys of the blocks a step touched (the seam for a trained indexer)."""

    def update(self, indexer: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...


class MeanKeyIndexer:
    """Training-free indexer keys: each block's mean key per KV head, over the slots filled so far."""

    def update(self, indexer: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        block_size = kv_cache.shape[3]
        slot_mapping = slot_mapping.long()
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * block_size
        touched, inverse = torch.unique(blocks, return_inverse=True)
        # Slots of a block fill in order, so the highest offset written says how much of it is valid.
        filled = torch.zeros(touched.shape[0], dtype=torch.long, device=slot_mapping.device)
        filled.scatter_reduce_(0, inverse, offsets + 1, reduce="amax")
        keys = _raw(kv_cache)[0, touched]  # [n, kv_heads, block_size, head_dim]
        indexer[touched] = _mean_keys(_cooked(keys, kv_cache.dtype).to(indexer.dtype), filled)

    def update_decode(self, indexer: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``update`` for steps whose tokens each touch a different block (decodes): no data-dependent shapes.

        Same values as ``update`` there, and capturable in a CUDA graph.
        """
        block_size = kv_cache.shape[3]
        slots = slot_mapping.long()
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        filled = slots - blocks * block_size + 1
        keys = _cooked(_rows(_raw(kv_cache)[0], blocks), kv_cache.dtype).to(indexer.dtype)
        indexer[blocks] = _mean_keys(keys, filled)


def _mean_keys(keys: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Each block's mean key per KV head over its first ``filled`` slots: ``[n, kv_heads, block_size, head_dim]``
    -> ``[n, kv_heads, head_dim]``."""
    valid = (torch.arange(keys.shape[2], device=keys.device)[None, :] < filled[:, None]).to(keys.dtype)
    summed = (keys * valid[:, None, :, None]).sum(dim=2)
    return summed / filled[:, None, None].to(keys.dtype)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    # CPU indexing kernels lack fp8: index the bytes, then reinterpret.
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _cooked(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    return t.view(cache_dtype) if cache_dtype in _FP8 else t


def _rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``t[ids]`` for a contiguous ``t``, through ``F.embedding`` on a 2-D view of it.

    Same values as advanced indexing, but on CPU with several threads ``aten::index`` /
    ``index_select`` of these small gathers cost milliseconds (decode runs them once per layer per
    step), while the embedding kernel costs tens of microseconds.
    """
    return F.embedding(ids, t.view(t.shape[0], -1)).view(*ids.shape, *t.shape[1:])


def select_blocks(
    q: torch.Tensor,
    indexer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    topk: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each sequence's blocks for one decode step.

    q: [seqs, heads, head_dim]; indexer: [num_blocks, kv_heads, head_dim]; block_tables: [seqs, max_blocks].
    Returns (selected block tables [seqs, n], valid token count of each [seqs]); blocks stay in
    ascending position order, the most recent (partial) block last. ``reduce`` (tensor parallel) adds the
    other ranks' scores, whose KV heads this rank does not hold.
    """
    seqs, max_blocks = block_tables.shape
    num_blocks = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    n = min(max_blocks, topk + 2)
    heads, kv_heads = q.shape[1], indexer.shape[1]
    group = heads // kv_heads
    idx = _rows(indexer, block_tables).view(seqs, max_blocks, -1)  # [seqs, max_blocks, kv_heads * head_dim]
    # Score of a block: the query heads' affinity with its indexer keys, summed over heads; the heads
    # of a KV group share its indexer key, so their queries are summed first (one bmm, no einsum copies).
    qs = q.view(seqs, kv_heads, group, -1).sum(dim=2).to(idx.dtype).reshape(seqs, -1, 1)
    scores = torch.bmm(idx, qs).squeeze(2)
    if reduce is not None:
        scores = reduce(scores)
    positions = torch.arange(max_blocks, device=q.device)[None, :]
    last = (num_blocks - 1)[:, None]
    scores = scores.masked_fill(positions >= last, float("-inf"))  # the last block and padding: chosen below
    scores[:, 0] = float("inf")  # the first block is always kept
    middle = min(max(n - 1, 0), max_blocks)
    chosen = torch.topk(scores, k=middle, dim=1).indices if middle else positions[:, :0].expand(seqs, 0)
    # Sequences with fewer blocks than slots pick padding (-inf) entries: replace them by the last block.
    chosen = torch.where(chosen < last, chosen, last)
    chosen = torch.cat([chosen, last], dim=1)
    chosen, _ = torch.sort(chosen, dim=1)
    # Duplicates (short sequences) point at the last block; keep one, mask the others out.
    dup = torch.zeros_like(chosen, dtype=torch.bool)
    dup[:, :-1] = chosen[:, :-1] == chosen[:, 1:]
    selected = torch.gather(block_tables, 1, chosen)
    last_len = context_lens - (num_blocks - 1) * block_size
    lens = torch.where(dup, 0, block_size)
    lens[:, -1] = last_len
    return selected, lens


def select_blocks_paged(
    q: torch.Tensor,
    indexer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    topk: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each decoding sequence attends to, as a block table a paged kernel reads in place.

    Returns (tables ``[seqs, n]``, valid tokens of each row ``[seqs]``): a sequence with at most
    ``n = topk + 2`` blocks keeps its own table and length (dense); a longer one gets its first
    block, its ``topk`` best-scored and its last (partial) block in position order, so its row
    holds ``n - 1`` full blocks and the last block's tokens. Same keys as ``sparse_decode``;
    fixed shapes, so it can be captured in a CUDA graph.
    """
    _seqs, width = block_tables.shape
    n = min(width, topk + 2)
    if n == width:
        return block_tables, context_lens
    selected, _ = select_blocks(q, indexer, block_tables, context_lens, block_size, topk, reduce)
    num_blocks = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    short = (num_blocks <= n)[:, None]
    tables = torch.where(short, block_tables[:, :n], selected.to(block_tables.dtype))
    last_len = context_lens - (num_blocks - 1) * block_size
    lens = torch.where(short.squeeze(1), context_lens, (n - 1) * block_size + last_len)
    return tables, lens


def sparse_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indexer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    topk: int,
    dtype: torch.dtype,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention over the selected blocks only. q: [seqs, heads, head_dim] -> same shape."""
    block_size = kv_cache.shape[3]
    seqs, width = block_tables.shape
    if topk + 2 >= width:
        # Every block would be selected: this is dense attention, computed the dense way (bit-exact).
        selected = block_tables
        mask = torch.arange(width * block_size, device=q.device)[None, :] < context_lens[:, None]
    else:
        selected, lens = select_blocks(q, indexer, block_tables, context_lens, block_size, topk, reduce)
        # A slot is visible if its block is kept and it is within that block's valid length.
        offs = torch.arange(block_size, device=q.device)
        mask = (offs[None, None, :] < lens[:, :, None]).reshape(seqs, -1)
    kv = gather_blocks(kv_cache, selected).to(dtype)  # [2, seqs, kv_heads, n * block_size, head_dim]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), kv[0], kv[1], attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def gather_blocks(kv_cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Keys and values of the blocks ``table [..., n]`` names, each KV head's run of them joined in table order:
    ``[2, ..., kv_heads, n * block_size, head_dim]``, contiguous, in the cache's dtype.

    The cache is head-major (``[2, num_blocks, kv_heads, block_size, head_dim]``), so one head's slots of a block
    are one row of a ``[2 * num_blocks * kv_heads, block_size * head_dim]`` view and the gather comes out in
    attention's ``[batch, heads, keys, dim]`` order with no copy after it.
    """
    _, num_blocks, kv_heads, block_size, head_dim = kv_cache.shape
    heads = torch.arange(kv_heads, device=table.device)
    ids = torch.stack([table, table + num_blocks]).long().unsqueeze(-2) * kv_heads + heads[:, None]
    rows = _rows(_raw(kv_cache).view(2 * num_blocks * kv_heads, block_size, head_dim), ids)
    n = table.shape[-1]
    return _cooked(rows, kv_cache.dtype).view(2, *table.shape[:-1], kv_heads, n * block_size, head_dim)
