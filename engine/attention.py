"""Paged attention in plain PyTorch: KV stored by slot, read back through per-sequence block tables.

The KV cache of one layer is one tensor ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(``kv_cache_shape``): index 0 holds keys, 1 values. Each layer's K (and V) is therefore one contiguous
region in which block ``b`` occupies ``unit_bytes`` at offset ``b * unit_bytes``; that is the layout a KV
transfer (Mooncake) registers and addresses per block id. Within a block the cache is head-major: one KV
head's keys of the block are one contiguous run (``block_size * head_dim`` elements), which is what an
attention program, one KV head of one sequence, reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.sparse import MeanKeyIndexer, gather_blocks, sparse_decode


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Fresh sequences (nothing cached) of one length: their attention is one batched causal call."""

    token_index: torch.Tensor  # [num_seqs * q_len] rows of the flattened batch, sequence-major
    num_seqs: int
    q_len: int
    contiguous_start: int | None  # set when the rows are one contiguous run (no gather needed)


@dataclass(slots=True)
class AttentionMetadata:
    """What the attention of one forward step needs to know about the batch layout.

    Tokens of all sequences are concatenated along one axis (no padding). The first
    ``num_decodes`` sequences are decodes (one token each, so also the first ``num_decodes``
    tokens); the rest compute prompt tokens (a whole prompt, a chunk of one, or the part after a
    cached prefix). ``slot_mapping[i]`` is where token ``i``'s K/V are written
    (``block_id * block_size + offset``).
    """

    num_decodes: int
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded
    context_lens: torch.Tensor  # [num_seqs]: tokens in the cache after this step
    # Host values (used to slice and size grids, never read from the device).
    query_lens: list[int]
    cached_lens: list[int]
    max_query_len: int
    max_context: int
    # Torch path, prompt part: fresh sequences grouped by length; sequences with a cached prefix.
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    cached_seqs: list[int] = field(default_factory=list)
    decode_width: int = 0  # block-table columns the decodes use (the torch path gathers only those)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, decode_width * block_size]
    # Triton path: query rows of sequence s are query_start[s]:query_start[s + 1].
    query_start: torch.Tensor | None = None
    num_splits: int = 1  # decode programs per sequence (flash-decoding); 1 in steps with prompts
    # (sequence, query tile) of each attention program, -1 for none: a captured mixed step's grid.
    tile_map: tuple[torch.Tensor, torch.Tensor] | None = None
    sparse_topk: int = 0  # decode attends to this many indexer-chosen blocks (+ first + last); 0: dense
    # Tensor parallel: sums the block scores of this rank's KV heads with the other ranks' (the model sets it),
    # so that every rank picks the blocks that all heads together choose.
    score_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Torch path: store_rows' answers, computed by a step's first layer for all of them.
    _store_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)

    def store_rows(self, kv_heads: int, block_size: int) -> torch.Tensor:
        """Where ``store_kv`` writes this step's tokens in a cache of ``kv_heads`` and ``block_size``."""
        key = (kv_heads, block_size)
        if key not in self._store_rows:
            self._store_rows[key] = store_rows(self.slot_mapping, kv_heads, block_size)
        return self._store_rows[key]


def decode_mask(context_lens: torch.Tensor, length: int) -> torch.Tensor:
    """Which of the ``length`` gathered slots each decoding sequence may see: ``[seqs, 1, 1, length]``."""
    mask = torch.arange(length, device=context_lens.device)[None, :] < context_lens[:, None]
    return mask[:, None, None, :]


def window_decode_mask(context_lens: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """``decode_mask`` that also hides the slots more than ``window`` positions behind each sequence's last."""
    slots = torch.arange(length, device=context_lens.device)[None, :]
    mask = (slots < context_lens[:, None]) & (slots >= context_lens[:, None] - window)
    return mask[:, None, None, :]


# A query no more than 1/16 of its cached context attends with an explicit mask instead of padded queries.
SHORT_QUERY_RATIO = 16


def causal_window_mask(rows: int, cols: int, window: int, device: torch.device) -> torch.Tensor:
    """``[rows, cols]``: query i (at position ``cols - rows + i``) sees key j when j <= its position and
    j > its position - ``window``."""
    pos = torch.arange(cols - rows, cols, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    return (j <= pos) & (j > pos - window)


def plan_prefill(
    query_lens: list[int], cached_lens: list[int], device: torch.device, first: int = 0
) -> tuple[list[PrefillGroup], list[int]]:
    """Group the prompt sequences (index ``first`` on) so each group's attention runs as one batched call.

    Done once per step (not per layer). Fresh sequences of one length share a call; sequences with
    a cached prefix attend one by one over their gathered context.
    """
    by_len: dict[int, list[int]] = {}
    cached: list[int] = []
    starts: list[int] = []
    offset = 0
    for i, (q_len, c) in enumerate(zip(query_lens, cached_lens, strict=True)):
        starts.append(offset)
        offset += q_len
        if i < first:
            continue
        if c == 0:
            by_len.setdefault(q_len, []).append(i)
        else:
            cached.append(i)
    groups = []
    for q_len, seqs in by_len.items():
        start = starts[seqs[0]]
        contiguous = all(starts[s] == start + k * q_len for k, s in enumerate(seqs))
        index = torch.cat([torch.arange(starts[s], starts[s] + q_len) for s in seqs]).to(device)
        groups.append(PrefillGroup(index, len(seqs), q_len, start if contiguous else None))
    return groups, cached


def kv_cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one layer's KV cache (K at index 0, V at 1; head-major within a block)."""
    return (2, num_blocks, kv_heads, block_size, head_dim)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_INDEXER = MeanKeyIndexer()  # stateless: the training-free indexer of dense checkpoints


def _raw(t: torch.Tensor) -> torch.Tensor:
    # Indexing kernels lack fp8 on CPU: move fp8 bytes as uint8 (a free reinterpretation).
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def store_rows(slot_mapping: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """The rows of a ``[num_blocks * kv_heads * block_size, head_dim]`` view of K (or V) that each token's KV heads
    go to, token-major: token t's row of head h is ``(block * kv_heads + h) * block_size + offset``."""
    slots = slot_mapping.long()
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    rows = (blocks[:, None] * kv_heads + torch.arange(kv_heads, device=slots.device)) * block_size
    return (rows + (slots - blocks * block_size)[:, None]).flatten()


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Write this step's keys and values ``[num_tokens, kv_heads, head_dim]`` to ``rows`` (``store_rows``)."""
    _, num_blocks, kv_heads, block_size, head_dim = kv_cache.shape
    flat = _raw(kv_cache).view(2, num_blocks * kv_heads * block_size, head_dim)
    flat[0].index_copy_(0, rows, _raw(k.to(kv_cache.dtype)).reshape(-1, head_dim))
    flat[1].index_copy_(0, rows, _raw(v.to(kv_cache.dtype)).reshape(-1, head_dim))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``length`` cached tokens of one sequence as ``[kv_heads, length, head_dim]``."""
    block_size = kv_cache.shape[3]
    num_blocks = (length + block_size - 1) // block_size
    kv = gather_blocks(kv_cache, block_table[:num_blocks]).to(dtype)  # [2, kv_heads, num_blocks * block_size, dim]
    return kv[0, :, :length], kv[1, :, :length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    indexer: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Store this step's K/V, then attend every query to its sequence's cached context (plain torch).

    q: ``[num_tokens, heads, head_dim]``; k, v: ``[num_tokens, kv_heads, head_dim]``. ``window`` > 0: a
    query at position i sees keys at positions j with i - window < j <= i (sliding-window attention).
    Returns ``[num_tokens, heads * head_dim]``.
    """
    store_kv(kv_cache, k, v, meta.store_rows(kv_cache.shape[2], kv_cache.shape[3]))
    if kv_cache.dtype in _FP8:
        # Attend over this step's keys as the cache holds them, so that a prompt's KV read back from the cache
        # (a prefix-cache hit, a later chunk, the Triton kernels) gives what its first computation gave.
        k, v = k.to(kv_cache.dtype).to(k.dtype), v.to(kv_cache.dtype).to(v.dtype)
    if indexer is not None:
        # Sparse attention: keep the indexer keys of the blocks this step wrote up to date.
        _INDEXER.update(indexer, kv_cache, meta.slot_mapping)
    n, nd = q.shape[0], meta.num_decodes
    decoded: torch.Tensor | None = None
    if nd:
        tables = meta.block_tables[:nd, : meta.decode_width]
        context = meta.context_lens[:nd]
        if indexer is not None and meta.sparse_topk:
            decoded = sparse_decode(q[:nd], kv_cache, indexer, tables, context, scale, meta.sparse_topk, q.dtype,
                                    meta.score_reduce)  # fmt: skip
        else:
            mask = meta.decode_mask
            if window:
                mask = window_decode_mask(context, tables.shape[1] * kv_cache.shape[3], window)
            decoded = _decode(q[:nd], kv_cache, tables, context, mask, scale)
        if nd == n:
            return decoded.reshape(n, -1)
    out = _prefill(q, k, v, kv_cache, meta, scale, window)
    if decoded is not None:
        out[:nd] = decoded
    return out.reshape(n, -1)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    out = torch.empty_like(q)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    for g in meta.prefill_groups:
        # Nothing cached: the new keys are the whole context, no need to read the cache back.
        if g.contiguous_start is not None:
            rows = slice(g.contiguous_start, g.contiguous_start + g.num_seqs * g.q_len)
            qg, kg, vg = q[rows], k[rows], v[rows]
        else:
            qg, kg, vg = q[g.token_index], k[g.token_index], v[g.token_index]
        # A window shorter than the prompt needs an explicit mask; otherwise causal is the same thing.
        windowed = 0 < window < g.q_len
        og = F.scaled_dot_product_attention(
            qg.view(g.num_seqs, g.q_len, heads, head_dim).transpose(1, 2),
            kg.view(g.num_seqs, g.q_len, kv_heads, head_dim).transpose(1, 2),
            vg.view(g.num_seqs, g.q_len, kv_heads, head_dim).transpose(1, 2),
            attn_mask=causal_window_mask(g.q_len, g.q_len, window, q.device) if windowed else None,
            is_causal=not windowed,
            scale=scale,
            enable_gqa=True,
        )
        og = og.transpose(1, 2).reshape(-1, heads, head_dim)
        if g.contiguous_start is not None:
            out[rows] = og
        else:
            out.index_copy_(0, g.token_index, og)
    if meta.cached_seqs:
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        for i in meta.cached_seqs:
            q_len, cached, start = meta.query_lens[i], meta.cached_lens[i], starts[i]
            if q_len * SHORT_QUERY_RATIO <= cached:
                # A few queries over a long context (a speculative verify row, a short chunk).
                out[start : start + q_len] = _short_queries(q[start : start + q_len], kv_cache, meta.block_tables[i],
                                                            cached, scale, window)  # fmt: skip
                continue
            # Only the cached part is read back from the cache; this step's own keys are at hand.
            kp, vp = gather_kv(kv_cache, meta.block_tables[i], cached, q.dtype)
            kc = torch.cat([kp, k[start : start + q_len].transpose(0, 1)], dim=1)  # [kv_heads, context, head_dim]
            vc = torch.cat([vp, v[start : start + q_len].transpose(0, 1)], dim=1)
            # Query j sits at absolute position cached + j. Padding the queries with `cached` zero
            # rows in front makes that plain causal attention, which runs on the fused kernels; an
            # explicit mask would fall to the slow math kernel. The padding rows are dropped.
            qp = q.new_zeros(cached + q_len, heads, head_dim)
            qp[cached:] = q[start : start + q_len]
            # 4-D inputs: with 3-D ones the CPU takes the math kernel, ten times slower.
            windowed = 0 < window < cached + q_len
            mask = causal_window_mask(cached + q_len, cached + q_len, window, q.device) if windowed else None
            oi = F.scaled_dot_product_attention(
                qp.transpose(0, 1)[None], kc[None], vc[None],
                attn_mask=mask, is_causal=not windowed, scale=scale, enable_gqa=True,
            )[0]  # fmt: skip
            out[start : start + q_len] = oi[:, cached:].transpose(0, 1)
    return out


def _short_queries(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cached: int, scale: float,
                   window: int) -> torch.Tensor:  # fmt: skip
    """Attention of a few queries ``[q_len, heads, head_dim]`` at positions ``cached ..`` of one sequence: its whole
    context, this step's keys included (stored before), read from the cache in whole blocks as a decode reads
    it, with an explicit mask on the kernel, which costs q_len x context, far less than padding the queries to the
    context; no copy of the cached keys joined to this step's."""
    block_size = kv_cache.shape[3]
    q_len = q.shape[0]
    blocks = -(-(cached + q_len) // block_size)
    kv = gather_blocks(kv_cache, block_table[None, :blocks]).to(q.dtype)  # [2, 1, kv_heads, keys, head_dim]
    pos = torch.arange(cached, cached + q_len, device=q.device)[:, None]
    slot = torch.arange(blocks * block_size, device=q.device)[None, :]
    mask = (slot <= pos) & (slot > pos - window) if window else slot <= pos
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kv[0], kv[1], attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # fmt: skip
    return out[0].transpose(0, 1)


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    # Batched: gather every sequence's blocks (padded to the longest table), mask the tail.
    length = block_tables.shape[1] * kv_cache.shape[3]
    kv = gather_blocks(kv_cache, block_tables).to(q.dtype)  # [2, seqs, kv_heads, length, head_dim]
    if mask is None:
        mask = decode_mask(context_lens, length)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [seqs, heads, 1, head_dim]
        kv[0],
        kv[1],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)
