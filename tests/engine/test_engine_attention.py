"""Paged attention against plain dense causal attention, for prefill groups, cached prefixes and decode."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, paged_attention, plan_prefill

BS, KVH, H, D = 4, 2, 4, 8


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: causal attention over one whole sequence, [T, H, D] with GQA by repetition."""
    t = q.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def meta_for(lens: list[int], cached: list[int], tables: list[list[int]], prefill: bool) -> AttentionMetadata:
    slots, q_lens = [], []
    for n, c, table in zip(lens, cached, tables, strict=True):
        start = c if prefill else n - 1
        slots += [table[p // BS] * BS + p % BS for p in range(start, n)]
        q_lens.append(n - start)
    width = max(len(t) for t in tables)
    groups, cached_seqs = plan_prefill(q_lens, cached, torch.device("cpu")) if prefill else ([], [])
    return AttentionMetadata(
        num_decodes=0 if prefill else len(lens),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(lens),
        query_lens=q_lens,
        cached_lens=[n - 1 for n in lens] if not prefill else cached,
        max_query_len=max(q_lens),
        max_context=max(lens),
        prefill_groups=groups,
        cached_seqs=cached_seqs,
        decode_width=0 if prefill else width,
    )


def test_prefill_groups_cached_prefix_and_decode_match_dense() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [6, 9, 6]  # seqs 0 and 2 share a length (one batched call, rows not contiguous)
    full = [(torch.randn(n, H, D, generator=gen), torch.randn(n, KVH, D, generator=gen),
             torch.randn(n, KVH, D, generator=gen)) for n in lens]  # fmt: skip
    expected = [dense(q, k, v) for q, k, v in full]
    tables = [[3, 0], [5, 1, 7], [2, 6]]
    cache = torch.zeros(2, 8, KVH, BS, D)

    # Prefill: sequence 1 has its first 4 tokens cached already (written by an earlier step).
    pre = meta_for([4], [0], [tables[1]], prefill=True)
    q1, k1, v1 = full[1]
    paged_attention(q1[:4], k1[:4], v1[:4], cache, pre, D**-0.5)
    cached = [0, 4, 0]
    meta = meta_for([n - 1 for n in lens], cached, tables, prefill=True)  # all but the last token
    rows = [slice(c, n - 1) for n, c in zip(lens, cached, strict=True)]
    q = torch.cat([f[0][r] for f, r in zip(full, rows, strict=True)])
    k = torch.cat([f[1][r] for f, r in zip(full, rows, strict=True)])
    v = torch.cat([f[2][r] for f, r in zip(full, rows, strict=True)])
    out = paged_attention(q, k, v, cache, meta, D**-0.5).view(-1, H, D)
    got = torch.split(out, [r.stop - r.start for r in rows])
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], expected[i][r])

    # Decode: each sequence's last token, batched, through the padded block tables.
    meta = meta_for(lens, [0, 0, 0], tables, prefill=False)
    q = torch.stack([f[0][-1] for f in full])
    k = torch.stack([f[1][-1] for f in full])
    v = torch.stack([f[2][-1] for f in full])
    out = paged_attention(q, k, v, cache, meta, D**-0.5).view(-1, H, D)
    for i in range(3):
        torch.testing.assert_close(out[i], expected[i][-1])


def test_a_mixed_step_attends_decodes_and_prompt_chunks_together() -> None:
    # Sequence 0 decodes its 7th token; sequence 1 computes tokens 4..8 after a cached prefix of 4;
    # sequence 2 is a fresh prompt of 3: one call, decodes first.
    gen = torch.Generator().manual_seed(1)
    lens = [7, 9, 3]
    full = [(torch.randn(n, H, D, generator=gen), torch.randn(n, KVH, D, generator=gen),
             torch.randn(n, KVH, D, generator=gen)) for n in lens]  # fmt: skip
    expected = [dense(q, k, v) for q, k, v in full]
    tables = [[3, 0], [5, 1, 7], [2]]
    cache = torch.zeros(2, 8, KVH, BS, D)
    # Earlier steps wrote sequence 0's first 6 tokens and sequence 1's first 4.
    for i, n in ((0, 6), (1, 4)):
        paged_attention(*(t[:n] for t in full[i]), cache, meta_for([n], [0], [tables[i]], prefill=True), D**-0.5)
    starts, ends = [6, 4, 0], lens
    q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
    slots = [tables[i][p // BS] * BS + p % BS for i in range(3) for p in range(starts[i], ends[i])]
    groups, cached_seqs = plan_prefill(q_lens, starts, torch.device("cpu"), first=1)
    meta = AttentionMetadata(
        num_decodes=1,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables]),
        context_lens=torch.tensor(lens),
        query_lens=q_lens,
        cached_lens=starts,
        max_query_len=max(q_lens),
        max_context=max(lens),
        prefill_groups=groups,
        cached_seqs=cached_seqs,
        decode_width=2,
    )
    q, k, v = (torch.cat([f[j][s:e] for f, s, e in zip(full, starts, ends, strict=True)]) for j in range(3))
    out = paged_attention(q, k, v, cache, meta, D**-0.5).view(-1, H, D)
    got = torch.split(out, q_lens)
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i][starts[i] :])
