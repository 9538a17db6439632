"""KV transfer benchmark: bytes moved per request and GB/s, against Mooncake's raw throughput.

    python -m engine.kv_transfer.bench [--tokens 1024,4096,8192] [--dtype fp32|bf16] [--repeats 5]
                                       [--cache-layout engine|merged-indexer|block-major]

Two processes on loopback, as in a P/D pair: this one is decode (KVConsumer), a spawned child is
prefill (KVProducer). Caches have SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64, block
size 16, per layer one ``[2, num_blocks, 16, 3, 64]`` K/V tensor plus one ``[num_blocks, 64]``
indexer-key tensor (one head_dim vector per block per layer, the cache's dtype). All caches of a
side are views of one flat buffer, so the raw peer, one contiguous Mooncake write of the same byte
count between the same two processes, reuses that memory. Each request is timed from decode's side
(handshake + writes + reply); the raw write is timed inside the producer (the write alone), right
before each request; ``ratio`` is the median over those back-to-back pairs of raw time / request
time, which tolerates a noisy shared machine better than a ratio of medians.

Block layouts: ``contiguous`` (fresh pools: consecutive ids on both sides, one write per region),
``fragmented`` (each side's ids in shuffled runs of 1..16 blocks: a pool after churn) and
``scattered`` (random ids on both sides: one write per block per region, the worst case).
Cache layouts (``--cache-layout``): the engine's per-layer tensors (90 regions), the same with
one indexer tensor for all layers (61 regions), or block-major (1 region); see ``make_caches``.
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.kv_transfer.connector import KVConsumer, KVProducer, ReleaseReason
from engine.kv_transfer.layout import Region, WriteOp, plan_writes, regions_from_kv_caches
from engine.kv_transfer.mooncake import MooncakeAgent

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Caches:
    """One side's KV and indexer caches, all views of ``flat``."""

    flat: torch.Tensor
    regions: list[Region]


CACHE_LAYOUTS = ("engine", "merged-indexer", "block-major")


def make_caches(num_blocks: int, dtype: torch.dtype, cache_layout: str = "engine") -> Caches:
    """Caches in one of ``CACHE_LAYOUTS`` (the same bytes, cut into regions differently).

    engine: per layer a ``[2, num_blocks, ...]`` K/V tensor and a ``[num_blocks, head_dim]`` indexer
    tensor (90 regions); merged-indexer: the indexer keys of all layers in one
    ``[num_blocks, layers, head_dim]`` tensor (61 regions); block-major: all of a block's bytes
    contiguous (1 region).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    kv_numel = 2 * num_blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    idx_numel = num_blocks * HEAD_DIM
    flat = torch.zeros(LAYERS * (kv_numel + idx_numel) * elem, dtype=torch.uint8)
    if cache_layout == "block-major":  # viewed as [num_blocks, everything]: one write per run
        return Caches(flat, [Region(flat.data_ptr(), flat.numel() // num_blocks, num_blocks)])
    typed = flat.view(dtype)
    kv = [typed[i * kv_numel : (i + 1) * kv_numel].view(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
          for i in range(LAYERS)]  # fmt: skip
    base = LAYERS * kv_numel
    if cache_layout == "merged-indexer":
        return Caches(flat, regions_from_kv_caches(kv, [typed[base:].view(num_blocks, LAYERS, HEAD_DIM)]))
    idx = [typed[base + i * idx_numel : base + (i + 1) * idx_numel].view(num_blocks, HEAD_DIM) for i in range(LAYERS)]
    return Caches(flat, regions_from_kv_caches(kv, idx))


def fill(caches: Caches, seed: int = 0) -> None:
    """Deterministic bytes, so that another process can rebuild what the producer holds."""
    caches.flat.random_(0, 256, generator=torch.Generator().manual_seed(seed))


def _producer_main(conn: Connection, num_blocks: int, dtype_name: str, cache_layout: str) -> None:
    """The prefill process: answers ``offer`` / ``raw`` / ``released`` / ``stop`` commands on ``conn``."""
    torch.set_num_threads(1)
    asyncio.run(_producer(conn, make_caches(num_blocks, DTYPES[dtype_name], cache_layout)))


async def _producer(conn: Connection, caches: Caches) -> None:
    fill(caches)
    agent = MooncakeAgent("127.0.0.1")
    agent.register(caches.regions)
    producer = KVProducer(agent, caches.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1")
    await producer.start()
    loop = asyncio.get_running_loop()
    released: list[ReleaseReason] = []
    conn.send((agent.rpc_address, producer.port))
    try:
        while True:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
            if cmd == "offer":
                conn.send(producer.offer(args[0], 0, released.append).to_dict())
            elif cmd == "raw":
                peer, dst, nbytes = args
                start = time.perf_counter()
                await agent.write(peer, [WriteOp(caches.flat.data_ptr(), dst, nbytes)])
                conn.send(time.perf_counter() - start)
            elif cmd == "released":
                conn.send([str(r) for r in released])
            else:
                break
    finally:
        await producer.close()
        agent.close()


def _block_ids(n: int, num_blocks: int, layout: str, rng: random.Random) -> tuple[list[int], list[int]]:
    if layout == "contiguous":
        return list(range(n)), list(range(n))
    if layout == "fragmented":
        return _runs(n, num_blocks, rng), _runs(n, num_blocks, rng)
    return rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)


def _runs(n: int, num_blocks: int, rng: random.Random) -> list[int]:
    """``n`` ids from the pool cut into runs of 1..16 consecutive blocks, shuffled: a pool after churn."""
    runs, start = [], 0
    while start < num_blocks:
        length = min(rng.randint(1, 16), num_blocks - start)
        runs.append(range(start, start + length))
        start += length
    rng.shuffle(runs)
    return [b for run in runs for b in run][:n]


async def _run(args: argparse.Namespace) -> None:
    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = max(tokens) // BLOCK_SIZE + 16  # a little headroom: contiguous ids do not cover a whole region
    dtype = DTYPES[args.dtype]
    caches = make_caches(num_blocks, dtype, args.cache_layout)
    agent = MooncakeAgent("127.0.0.1")
    agent.register(caches.regions)
    consumer = KVConsumer(agent, caches.regions, timeout_s=120)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(child, num_blocks, args.dtype, args.cache_layout), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()

    async def ask(*cmd: Any) -> Any:
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    try:
        await loop.run_in_executor(None, parent.recv)  # the producer is up
        elem = torch.empty((), dtype=dtype).element_size()
        unit_kv, unit_idx = BLOCK_SIZE * KV_HEADS * HEAD_DIM * elem, HEAD_DIM * elem
        print(f"SmolLM2 shape: {LAYERS} layers x (K, V) {KV_HEADS}x{HEAD_DIM} {args.dtype}, block {BLOCK_SIZE}; "
              f"indexer 1x{HEAD_DIM} per block per layer; units {unit_kv} B (KV), {unit_idx} B (indexer); "
              f"{args.cache_layout} layout, {len(caches.regions)} region(s); median of {args.repeats}")  # fmt: skip
        print(f"{'tokens':>6} {'layout':>10} {'KV MiB':>7} {'idx KiB':>7} {'writes':>6} "
              f"{'ms':>7} {'GB/s':>6} {'raw ms':>7} {'raw GB/s':>8} {'ratio':>6}")  # fmt: skip
        rng = random.Random(0)
        for t in tokens:
            n = t // BLOCK_SIZE
            kv_bytes, idx_bytes = n * 2 * LAYERS * unit_kv, n * LAYERS * unit_idx
            total = kv_bytes + idx_bytes
            for layout in args.layouts.split(","):
                pulls, raws, writes = [], [], 0
                for _ in range(args.repeats):
                    raws.append(await ask("raw", agent.rpc_address, caches.flat.data_ptr(), total))
                    src, dst = _block_ids(n, num_blocks, layout, rng)
                    writes = len(plan_writes(caches.regions, caches.regions, src, dst))
                    params = await ask("offer", src)
                    start = time.perf_counter()
                    await consumer.pull(params, dst)
                    pulls.append(time.perf_counter() - start)
                pull, raw = statistics.median(pulls), statistics.median(raws)
                ratio = statistics.median(r / p for r, p in zip(raws, pulls, strict=True))  # back-to-back pairs
                print(f"{t:>6} {layout:>10} {kv_bytes / 2**20:>7.1f} {idx_bytes / 2**10:>7.1f} {writes:>6} "
                      f"{pull * 1e3:>7.1f} {total / pull / 1e9:>6.2f} {raw * 1e3:>7.1f} {total / raw / 1e9:>8.2f} "
                      f"{ratio:>6.0%}")  # fmt: skip
        released = await ask("released")
        print(f"producer releases: {len(released)}, all written: {set(released) == {'written'}}")
    finally:
        parent.send(("stop",))
        await loop.run_in_executor(None, proc.join, 30)
        agent.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--layouts", default="contiguous,fragmented,scattered")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-layout", choices=CACHE_LAYOUTS, default="engine", help="how caches are cut into regions")
    torch.set_num_threads(1)
    asyncio.run(_run(p.parse_args()))


if __name__ == "__main__":
    main()
