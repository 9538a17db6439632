"""The torch (CPU) path's KV cache work per layer and step, head-major cache against the slot-major one it replaced.

The engine's cache is ``[2, num_blocks, kv_heads, block_size, head_dim]`` (``engine.attention.kv_cache_shape``);
before, it was ``[2, num_blocks, block_size, kv_heads, head_dim]``. Measured here on the same values: storing a
step's new K/V (decode: one token per sequence; a prompt: 512 tokens) and gathering a decode batch's blocks into
attention's ``[seqs, kv_heads, keys, head_dim]`` (what ``_decode`` hands SDPA), each as the engine does it now
against the code it replaced (advanced indexing, then a transposed view; ``index_copy_`` by slot). SmolLM2's heads.
Times are the minimum over rounds (a shared machine's load only ever adds), per call.

    python -m bench.engine.kv_layout [--seqs 16] [--context 1024] [--rounds 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, kv_cache_shape, store_kv
from engine.sparse import gather_blocks

KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 64, 16


def best_us(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    width = -(-a.context // BLOCK_SIZE)
    num_blocks = a.seqs * width + 64
    head = torch.randn(kv_cache_shape(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=g)
    slot = head.transpose(2, 3).contiguous()  # the same values, slot-major
    tables = torch.randperm(num_blocks, generator=g)[: a.seqs * width].view(a.seqs, width)

    def gather_slot() -> torch.Tensor:
        kv = slot[:, tables]  # [2, seqs, width, block_size, kv_heads, head_dim]
        return kv.reshape(2, a.seqs, width * BLOCK_SIZE, KV_HEADS, HEAD_DIM).transpose(2, 3)

    assert torch.equal(gather_blocks(head, tables), gather_slot())
    print(f"{a.seqs} sequences x {a.context} tokens, kv_heads {KV_HEADS}, head_dim {HEAD_DIM}, {a.threads} threads")
    rows: list[tuple[str, float, float]] = [
        ("gather a decode batch", best_us(lambda: gather_blocks(head, tables), a.rounds),
         best_us(gather_slot, a.rounds)),
    ]  # fmt: skip
    for label, tokens in (("store a decode step", a.seqs), ("store a 512-token prompt", 512)):
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:tokens]
        k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        meta = AttentionMetadata(num_decodes=0, slot_mapping=slots, block_tables=tables, context_lens=slots,
                                 query_lens=[], cached_lens=[], max_query_len=0, max_context=0)  # fmt: skip
        store_rows = meta.store_rows(KV_HEADS, BLOCK_SIZE)  # once per step, for every layer

        def store_slot(slots: torch.Tensor = slots, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            flat = slot.view(2, num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)

        store_kv(head, k, v, store_rows)
        store_slot()
        assert torch.equal(head, slot.transpose(2, 3))

        def store_head(k: torch.Tensor = k, v: torch.Tensor = v, rows: torch.Tensor = store_rows) -> None:
            store_kv(head, k, v, rows)

        rows.append((label, best_us(store_head, a.rounds), best_us(store_slot, a.rounds)))
    print(f"{'per layer':<26} {'head-major':>11} {'slot-major':>11} {'ratio':>7}")
    for label, new, old in rows:
        print(f"{label:<26} {new:>9.1f}us {old:>9.1f}us {new / old:>6.2f}x")


if __name__ == "__main__":
    main()
