"""Paged attention in plain PyTorch: KV stored by slot, read back through per-sequence block tables.

The KV cache of one layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``:
index 0 holds keys, 1 values. Each layer's K (and V) is therefore one contiguous region in which
block ``b`` occupies ``unit_bytes`` at offset ``b * unit_bytes``; that is the layout a KV transfer
(Mooncake) registers and addresses per block id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """What the attention of one forward step needs to know about the batch layout.

    Tokens of all sequences are concatenated along one axis (no padding). ``slot_mapping[i]`` is
    where token ``i``'s K/V are written (``block_id * block_size + offset``).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int64: tokens in the cache after this step
    # Prefill only (python ints: used to slice, never sent to the device).
    query_lens: list[int]
    cached_lens: list[int]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    # Indexing kernels lack fp8 on CPU: move fp8 bytes as uint8 (a free reinterpretation).
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _cooked(t: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    if cache_dtype in _FP8:
        t = t.view(cache_dtype)
    return t.to(dtype)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values ``[num_tokens, kv_heads, head_dim]`` into their slots."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = _raw(kv_cache).view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, _raw(k.to(kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, _raw(v.to(kv_cache.dtype)))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``length`` cached tokens of one sequence as ``[length, kv_heads, head_dim]``."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_blocks = (length + block_size - 1) // block_size
    blocks = _raw(kv_cache)[:, block_table[:num_blocks]]  # [2, n, block_size, kv_heads, head_dim]
    kv = _cooked(blocks, kv_cache.dtype, dtype).reshape(2, num_blocks * block_size, kv_heads, head_dim)
    return kv[0, :length], kv[1, :length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V, then attend every query to its sequence's cached context.

    q: ``[num_tokens, heads, head_dim]``; k, v: ``[num_tokens, kv_heads, head_dim]``.
    Returns ``[num_tokens, heads * head_dim]``.
    """
    store_kv(kv_cache, k, v, meta.slot_mapping)
    if meta.is_prefill:
        out = _prefill(q, k, v, kv_cache, meta, scale)
    else:
        out = _decode(q, kv_cache, meta, scale)
    return out.reshape(q.shape[0], -1)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    # One SDPA call per sequence: per sequence, not per token, so the Python cost stays small.
    outs = []
    start = 0
    for i, (q_len, cached) in enumerate(zip(meta.query_lens, meta.cached_lens, strict=True)):
        qi = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
        if cached == 0:
            # Nothing cached: the new keys are the whole context, no need to read the cache back.
            ki = k[start : start + q_len].transpose(0, 1)
            vi = v[start : start + q_len].transpose(0, 1)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kc, vc = gather_kv(kv_cache, meta.block_tables[i], cached + q_len, q.dtype)
            # Query j sits at absolute position cached + j and may see keys 0..cached + j.
            kpos = torch.arange(cached + q_len, device=q.device)
            qpos = torch.arange(cached, cached + q_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            oi = F.scaled_dot_product_attention(
                qi, kc.transpose(0, 1), vc.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
            )
        outs.append(oi.transpose(0, 1))
        start += q_len
    return torch.cat(outs, dim=0)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # Batched: gather every sequence's blocks (padded to the longest table), mask the tail.
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_seqs, max_blocks = meta.block_tables.shape
    length = max_blocks * block_size
    kv = _raw(kv_cache)[:, meta.block_tables]  # [2, seqs, max_blocks, block_size, kv_heads, head_dim]
    kv = _cooked(kv, kv_cache.dtype, q.dtype).reshape(2, num_seqs, length, kv_heads, head_dim).transpose(2, 3)
    mask = torch.arange(length, device=q.device)[None, :] < meta.context_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [seqs, heads, 1, head_dim]
        kv[0],
        kv[1],
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)
