"""``python -m bench.engine.kv_transfer_concurrency``: N requests' KV pulls at once, serial against concurrent.

Two processes on loopback as in a P/D pair (this one decode, a spawned child prefill, SmolLM2-135M's
cache shape, see ``bench.engine.kv_transfer``), the staged memory backend by default. For each
concurrency N, N transfers of ``--tokens`` tokens each (scattered block ids, distinct for every
request) are offered, then pulled all at once through one KVConsumer (``--protocol ipc``: copied
from the producer's mapped pools, see ``engine.kv_transfer.ipc``):

- *serial*: ``max_inflight`` 1 (one pull after another, what a single staging lease per pull gave);
- *concurrent*: ``max_inflight`` N (every pull in flight; the staging buffers and the agents' lanes
  sized for it, as ``max_inflight_pulls`` N does in an engine).

Reported per mode (median of ``--repeats``): the wall time until the last pull returned, the mean
pull latency (what each request's TTFT pays), and the aggregate GB/s; then concurrent / serial.
Printed (and written as JSON with ``--json``), never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

import torch

from bench.engine.kv_transfer import BLOCK_SIZE, DTYPES, _producer_main, make_caches, open_side
from engine.kv_transfer.connector import KVConsumer
from engine.kv_transfer.ipc import IpcMode, IpcPeers
from engine.kv_transfer.layout import Region


async def _timed_pull(consumer: KVConsumer, params: dict[str, Any], dst: list[int], start: float) -> float:
    """Seconds from ``start`` (all pulls asked for at once) until this pull returned."""
    await consumer.pull(params, dst)
    return time.perf_counter() - start


async def _mode(args: argparse.Namespace, n: int, inflight: int) -> dict[str, Any]:
    blocks_per = args.tokens // BLOCK_SIZE
    num_blocks = blocks_per * n + 16
    caches = make_caches(num_blocks, DTYPES[args.dtype], "engine", args.device)
    side = open_side(caches, args.backend, args.staging_mb, inflight, args.protocol)
    peers = IpcPeers(caches.views, IpcMode.FORCED) if args.protocol == "ipc" else None
    consumer = KVConsumer(side.agent, caches.regions, timeout_s=300, staging=side.staging, max_inflight=inflight,
                          ipc=peers)  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_producer_main,
        daemon=True,
        args=(
            child,
            num_blocks,
            args.dtype,
            "engine",
            args.backend,
            args.staging_mb,
            args.device,
            inflight,
            args.protocol,
        ),
    )
    proc.start()
    loop = asyncio.get_running_loop()

    async def ask(*cmd: Any) -> Any:
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    rng = random.Random(n)
    walls, latencies = [], []
    try:
        await loop.run_in_executor(None, parent.recv)  # the producer is up
        for _ in range(args.repeats):
            src = rng.sample(range(num_blocks), blocks_per * n)
            dst = rng.sample(range(num_blocks), blocks_per * n)
            offers = [await ask("offer", src[i * blocks_per : (i + 1) * blocks_per]) for i in range(n)]
            start = time.perf_counter()
            done = await asyncio.gather(*(_timed_pull(consumer, offers[i], dst[i * blocks_per:(i + 1) * blocks_per],
                                                      start) for i in range(n)))  # fmt: skip
            walls.append(time.perf_counter() - start)
            latencies.append(statistics.mean(done))
        released = await ask("released")
        assert set(released) == {"written"}, released
    finally:
        parent.send(("stop",))
        await loop.run_in_executor(None, proc.join, 30)
        side.close()
    total = n * blocks_per * sum(r.unit_bytes for r in caches.regions if isinstance(r, Region))
    wall = statistics.median(walls)
    return {
        "concurrency": n,
        "max_inflight": inflight,
        "wall_ms": wall * 1e3,
        "mean_pull_ms": statistics.median(latencies) * 1e3,
        "gb_s": total / wall / 1e9,
        "bytes": total,
    }


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(
        f"{args.tokens} tokens per request, SmolLM2 shape {args.dtype} on {args.device}, backend {args.backend}, "
        f"staging {args.staging_mb} MiB per side, median of {args.repeats}"
    )
    print(f"{'N':>3} {'mode':>10} {'wall ms':>8} {'mean pull ms':>12} {'GB/s':>6}")
    for n in [int(c) for c in args.concurrency.split(",")]:
        pair = []
        for mode, inflight in (("serial", 1), ("concurrent", n)):
            row = {"mode": mode, "tokens": args.tokens, **await _mode(args, n, inflight)}
            print(f"{n:>3} {mode:>10} {row['wall_ms']:>8.1f} {row['mean_pull_ms']:>12.1f} {row['gb_s']:>6.2f}",
                  flush=True)  # fmt: skip
            pair.append(row)
            rows.append(row)
        serial, concurrent = pair
        print(
            f"{n:>3} {'ratio':>10} {serial['wall_ms'] / concurrent['wall_ms']:>7.2f}x "
            f"{serial['mean_pull_ms'] / concurrent['mean_pull_ms']:>11.2f}x  (serial / concurrent)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine.kv_transfer_concurrency", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--concurrency", default="1,4,8", help="requests pulled at once, comma-separated")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--backend", choices=["staged", "direct"], default="staged")
    p.add_argument("--staging-mb", type=int, default=128, help="staging buffer per side (staging_buffer_mb)")
    p.add_argument(
        "--protocol",
        choices=["ipc", "tcp", "rdma"],
        default=None,
        help="ipc: decode maps the producer's pools; tcp / rdma: Mooncake's transport (default: chosen)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides' caches live")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.engine.kv_transfer_concurrency", "args": vars(args),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
