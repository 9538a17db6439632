"""Block manager: reference counts, hash-chain prefix reuse, freeing, bounded index, no leaks."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, block_hash
from engine.sequence import SamplingParams, Sequence

BS = 4


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(), BS)


def prefill(bm: BlockManager, s: Sequence) -> None:
    """What a prefill step does to the block manager: allocate, then record the KV as written."""
    bm.allocate(s)
    bm.mark_computed(s, len(s))


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    s = seq(1, list(range(10)))  # 3 blocks (4 + 4 + 2)
    assert bm.can_allocate(s)
    prefill(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    bm.deallocate(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_shared_prefix_reuses_blocks_and_counts_references() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, [*list(range(12)), 100])
    b = seq(2, [*list(range(12)), 200, 201])
    prefill(bm, a)
    bm.allocate(b)
    # The three full blocks of the common 12-token prefix are shared.
    assert a.block_table[:3] == b.block_table[:3]
    assert b.num_cached_tokens == 12
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table[:3])
    assert a.block_table[3] != b.block_table[3]
    bm.deallocate(a)
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_table[:3])
    bm.deallocate(b)
    assert bm.num_free_blocks == 16


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(9)))
    prefill(bm, a)
    first = list(a.block_table)
    bm.deallocate(a)
    again = seq(2, list(range(9)))
    bm.allocate(again)
    assert again.block_table[:2] == first[:2]
    assert again.num_cached_tokens == 8
    assert bm.stats().prefix_hits == 8


def test_last_token_is_never_served_from_cache() -> None:
    # A prompt that is exactly cached still computes its last block: its logits start generation.
    bm = BlockManager(16, BS)
    a = seq(1, list(range(8)))
    prefill(bm, a)
    bm.deallocate(a)
    b = seq(2, list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    assert block_hash([1, 2, 3, 4], None) != block_hash([1, 2, 3, 4], block_hash([9, 9, 9, 9], None))
    bm = BlockManager(16, BS)
    a = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    b = seq(2, [9, 9, 9, 9, 5, 6, 7, 8, 0])  # same second block, different first
    prefill(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_prefix_caching_off_shares_nothing() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(1, list(range(9)))
    b = seq(2, list(range(9)))
    prefill(bm, a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.stats().cached == 0


def test_can_allocate_counts_cached_blocks_in_use_as_free() -> None:
    bm = BlockManager(4, BS)
    a = seq(1, [*list(range(12)), 1])  # 4 blocks: the whole pool
    prefill(bm, a)
    assert bm.num_free_blocks == 0
    b = seq(2, [*list(range(12)), 2])  # shares 3 blocks, needs 1 more
    assert bm.blocks_needed(b) == 1
    assert not bm.can_allocate(b)
    with pytest.raises(RuntimeError):
        bm.allocate(b)


def test_append_adds_a_block_at_the_boundary_and_hashes_full_blocks() -> None:
    bm = BlockManager(8, BS)
    s = seq(1, [1, 2, 3, 4])
    prefill(bm, s)
    assert len(s.block_table) == 1
    for t in (5, 6, 7, 8):
        s.append_token(t)
        assert bm.can_append(s)
        bm.may_append(s)
        bm.mark_computed(s, len(s))  # the decode step wrote the token's KV
    assert len(s.block_table) == 2
    # The second block, filled by decoding, is now findable by a new prompt.
    bm.deallocate(s)
    other = seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(other)
    assert other.num_cached_tokens == 8


def test_can_append_is_false_when_pool_is_exhausted() -> None:
    bm = BlockManager(1, BS)
    s = seq(1, [1, 2, 3, 4])
    prefill(bm, s)
    s.append_token(5)
    assert not bm.can_append(s)


def test_hash_index_is_bounded_by_the_pool() -> None:
    bm = BlockManager(8, BS)
    for i in range(200):
        s = seq(i, [i * 100 + t for t in range(13)])  # 3 full blocks each, all distinct
        prefill(bm, s)
        bm.deallocate(s)
        assert bm.stats().cached <= 8
    assert bm.num_free_blocks == 8


def test_lru_evicts_the_oldest_freed_blocks_first() -> None:
    bm = BlockManager(4, BS)
    old = seq(1, list(range(5)))  # one full (cached) block + one partial
    prefill(bm, old)
    bm.deallocate(old)
    new = seq(2, list(range(100, 105)))
    prefill(bm, new)
    bm.deallocate(new)
    filler = seq(3, list(range(200, 205)))  # takes two blocks: the least recently freed
    prefill(bm, filler)
    probe_new = seq(4, list(range(100, 105)))
    probe_old = seq(5, list(range(5)))
    assert bm.cached_prefix_len(probe_new) == 4
    assert bm.cached_prefix_len(probe_old) == 0


def test_invalidate_forgets_hashes() -> None:
    bm = BlockManager(8, BS)
    a = seq(1, list(range(9)))
    prefill(bm, a)
    bm.invalidate(a)
    b = seq(2, list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert bm.num_free_blocks == 8 - 3


def test_blocks_are_indexed_only_once_computed() -> None:
    bm = BlockManager(16, BS)
    a = seq(1, list(range(13)))
    bm.allocate(a)
    probe = seq(2, list(range(13)))
    assert bm.cached_prefix_len(probe) == 0  # allocated, KV not written yet: not findable
    bm.mark_computed(a, 6)  # a chunk covering one full block and a half
    assert bm.cached_prefix_len(probe) == 4
    bm.mark_computed(a, 13)
    assert bm.cached_prefix_len(probe) == 12


def test_a_prompt_is_hashed_once_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission asks whether a prompt fits, allocates it, indexes it as its KV is written, and finds it
    again for a second request: each sequence's full blocks are hashed once, whatever asks for them."""
    import engine.block_manager as module

    hashed: list[int] = []
    real = module.chain_hashes

    def counting(blocks: list[tuple[int, ...]], prefix: int | None) -> list[int]:
        hashed.append(len(blocks))
        return real(blocks, prefix)

    monkeypatch.setattr(module, "chain_hashes", counting)
    bm = BlockManager(64, BS)
    prompt = list(range(4 * 30 + 2))  # 30 full blocks and a partial one
    for seq_id in (1, 2):
        s = seq(seq_id, prompt)
        assert bm.cached_prefix_len(s) == (0 if seq_id == 1 else 30 * BS)
        assert bm.can_allocate(s)
        prefill(bm, s)
        assert sum(hashed) == 30 * seq_id, "each full block of each sequence hashed exactly once"
        bm.deallocate(s)
    # The chain is the one ``block_hash`` defines, block after block.
    expect: list[int] = []
    for i in range(30):
        expect.append(block_hash(prompt[i * BS : (i + 1) * BS], expect[-1] if expect else None))
    assert s.block_hashes == expect


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_a_graphs_staged_tables_follow_growth_trims_frees_and_reordering(kind: str) -> None:
    """A decode or mixed-step graph's host tables keep each row between steps and write only what a row's sequence
    appended; a trim, a free (preemption) or another sequence in the row makes it copy the whole table again. After
    every kind of change, each staged row holds exactly its sequence's table."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from engine.cuda_graph import DecodeGraphs, MixedGraphs

    graphs: DecodeGraphs | MixedGraphs
    if kind == "decode":
        graphs = DecodeGraphs(None, [torch.zeros(1)], [], [4], BS, 63, 64, 0)  # type: ignore[arg-type]
    else:
        model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2))
        graphs = MixedGraphs(model, [torch.zeros(1)], [8], 4, BS, 63, 64)  # type: ignore[arg-type]

    bm = BlockManager(64, BS)
    a, b, c = seq(1, list(range(9))), seq(2, list(range(5))), seq(3, list(range(2)))
    for s in (a, b, c):
        prefill(bm, s)

    def decode(*seqs: Sequence) -> None:
        if isinstance(graphs, DecodeGraphs):
            graphs.stage(seqs)
            for i, s in enumerate(seqs):
                assert graphs.buf.np["slots"][i] == s.block_table[(len(s) - 1) // BS] * BS + (len(s) - 1) % BS
        else:
            n, last = len(seqs), [len(s) - 1 for s in seqs]
            slots = [s.block_table[p // BS] * BS + p % BS for s, p in zip(seqs, last, strict=True)]
            graphs.stage(np.zeros(n, np.int32), np.array(last), np.array(slots), [1] * n, [p + 1 for p in last],
                         seqs, list(range(n)))  # fmt: skip
        for i, s in enumerate(seqs):
            assert graphs._tables[i, : len(s.block_table)].tolist() == s.block_table, (i, s.seq_id)
        for s in seqs:  # the step's token, and a block at each boundary
            s.append_token(0)
            bm.may_append(s)

    for _ in range(6):  # rows grow in place
        decode(a, b, c)
    decode(a, b)  # fewer rows: the third is padding (its first entry the scratch block)
    decode(a, b, c)  # and the same sequence comes back to it
    decode(c, a)  # reordered
    decode(b, c, a)
    a.append_token(0)  # speculative drafts' blocks, then a trim back (epoch bumped), then growth again
    bm.reserve(a, len(a) + 9)
    decode(a, b)
    del a.token_ids[-1]
    bm.trim(a)
    decode(a, b)
    epoch = b.table_epoch
    bm.deallocate(b)  # preempted and re-admitted: the same list, new blocks
    assert b.table_epoch == epoch + 1
    bm.allocate(b)
    decode(a, b, c)
    b.block_table = list(b.block_table)  # a new list (as ranks' copies make): copied whole
    decode(a, b, c)
