"""Block-sparse (MSA-style) decode attention: indexer keys, block selection, equality with dense."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.sparse import MeanKeyIndexer, select_blocks, sparse_decode

BS, KVH, HD, HEADS = 4, 2, 8, 4


def _cache(num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, KVH, BS, HD, generator=g)  # head-major blocks, as the engine's


def _dense(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    seqs, width = tables.shape
    g = kv[:, tables].transpose(2, 3).reshape(2, seqs, KVH, width * BS, HD)
    mask = torch.arange(width * BS)[None, :] < lens[:, None]
    return F.scaled_dot_product_attention(
        q.unsqueeze(2), g[0], g[1], attn_mask=mask[:, None, None, :], scale=HD**-0.5, enable_gqa=True
    ).squeeze(2)


def test_indexer_keys_are_block_means_of_filled_slots() -> None:
    kv = _cache(6)
    idx = torch.zeros(6, KVH, HD)
    # Block 2 fully written, block 5 written up to offset 1 (two slots).
    slots = torch.tensor([8, 9, 10, 11, 20, 21])
    MeanKeyIndexer().update(idx, kv, slots)
    torch.testing.assert_close(idx[2], kv[0, 2].mean(dim=1))
    torch.testing.assert_close(idx[5], kv[0, 5, :, :2].mean(dim=1))
    assert idx[0].abs().sum() == 0  # untouched blocks unchanged


def test_selection_keeps_first_last_and_topk_in_order() -> None:
    kv = _cache(16)
    idx = torch.zeros(16, KVH, HD)
    MeanKeyIndexer().update(idx, kv, torch.arange(16 * BS))
    q = torch.randn(2, HEADS, HD)
    tables = torch.tensor([list(range(16)), [3, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([16 * BS - 2, 3 * BS])
    selected, valid = select_blocks(q, idx, tables, lens, BS, topk=3)
    assert selected.shape == (2, 5)
    first = selected[0].tolist()
    assert first[0] == 0 and first[-1] == 15 and first == sorted(first) and len(set(first)) == 5
    assert valid[0].tolist() == [BS, BS, BS, BS, BS - 2]
    # A short sequence keeps all its blocks; the padding slots are masked out.
    assert sorted(set(selected[1][valid[1] > 0].tolist())) == [1, 3, 4]
    assert int(valid[1].sum()) == 3 * BS


def test_topk_covering_every_block_equals_dense_exactly() -> None:
    kv = _cache(12, seed=1)
    idx = torch.zeros(12, KVH, HD)
    MeanKeyIndexer().update(idx, kv, torch.arange(12 * BS))
    q = torch.randn(3, HEADS, HD)
    tables = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 0], [9, 10, 11, 4]])
    lens = torch.tensor([4 * BS - 1, 2 * BS + 1, 3 * BS])
    dense = _dense(q, kv, tables, lens)
    sparse = sparse_decode(q, kv, idx, tables, lens, HD**-0.5, topk=4, dtype=torch.float32)
    assert torch.equal(sparse, dense)


def test_sparse_attends_only_to_selected_blocks() -> None:
    kv = _cache(10, seed=2)
    idx = torch.zeros(10, KVH, HD)
    MeanKeyIndexer().update(idx, kv, torch.arange(10 * BS))
    q = torch.randn(1, HEADS, HD)
    tables = torch.arange(10)[None, :]
    lens = torch.tensor([10 * BS])
    selected, valid = select_blocks(q, idx, tables, lens, BS, topk=2)
    got = sparse_decode(q, kv, idx, tables, lens, HD**-0.5, topk=2, dtype=torch.float32)
    want = _dense(q, kv, selected, valid.sum(dim=1))  # dense attention over the chosen blocks only
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, _dense(q, kv, tables, lens))
