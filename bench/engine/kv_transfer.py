"""KV transfer benchmark: bytes moved per request and GB/s, against Mooncake's raw throughput.

    python -m bench.engine.kv_transfer [--tokens 1024,4096,8192] [--dtype fp32|bf16] [--repeats 5]
                                       [--backend staged|direct] [--staging-mb 128] [--device cpu|cuda]
                                       [--cache-layout engine|merged-indexer|block-major] [--json PATH]
                                       [--protocol ipc|tcp|rdma]

Two processes on loopback, as in a P/D pair: this one is decode (KVConsumer), a spawned child is
prefill (KVProducer). Caches have SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64, block
size 16, per layer one ``[2, num_blocks, 16, 3, 64]`` K/V tensor plus one ``[num_blocks, 64]``
indexer-key tensor (one head_dim vector per block per layer, the cache's dtype), on ``--device``.
All caches of a side are views of one flat buffer. The raw peer is one contiguous Mooncake write
of the same byte count between the same two processes: from the flat cache buffer on CPU, between
pinned host buffers on CUDA (what the CPU-only wheel can move). On CUDA each row also carries the copy
limits measured in the same run: a device-to-device copy of the same bytes in this process, and a copy
from the producer's caches into a tensor of this process opened in the producer through CUDA IPC
(``d2d_gb_s``, ``ipc_gb_s``); on CPU the limit is a copy of the same bytes within this process
(``d2d_gb_s``). With ``--protocol ipc`` decode maps the producer's pools (``ipc``: CUDA IPC handles,
or shared memory on CPU) and each pull is a gather copy of the blocks; the raw Mooncake write stays
the peer it is printed against. Each request is timed from decode's
side (handshake + gather + writes + scatter + reply); the raw write is timed inside the producer
(the write alone), right before each request; ``ratio`` is the median over those back-to-back
pairs of raw time / request time, which tolerates a noisy shared machine better than a ratio of
medians.

Memory backends (``--backend``, see ``backend``): ``direct`` writes the caches in place, one entry
per run of blocks per region; ``staged`` goes through each side's staging buffer of
``--staging-mb`` MiB. Block layouts: ``contiguous`` (fresh pools: consecutive ids on both sides),
``fragmented`` (each side's ids in shuffled runs of 1..16 blocks: a pool after churn) and
``scattered`` (random ids on both sides, the worst case for direct). Cache layouts
(``--cache-layout``): the engine's per-layer tensors (90 regions), the same with one indexer tensor
for all layers (61 regions), or block-major (1 region); see ``make_caches``. Printed (and written
as JSON with ``--json``), never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.kv_transfer.backend import MemoryBackend, choose_backend, installed_wheel
from engine.kv_transfer.connector import KVConsumer, KVProducer, ReleaseReason
from engine.kv_transfer.ipc import IpcMode, IpcPeers, PoolExport
from engine.kv_transfer.layout import Region, WriteOp, plan_writes, region_views, view_region
from engine.kv_transfer.mooncake import MooncakeAgent
from engine.kv_transfer.staging import DEFAULT_STAGING_MB, SLOTS_PER_TRANSFER, StagingBuffer, plan_chunks

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Caches:
    """One side's KV and indexer caches, all views of ``flat``; ``views`` are the regions as uint8 rows."""

    flat: torch.Tensor
    regions: list[Region]
    views: list[torch.Tensor]


CACHE_LAYOUTS = ("engine", "merged-indexer", "block-major")


def make_caches(num_blocks: int, dtype: torch.dtype, cache_layout: str = "engine", device: str = "cpu") -> Caches:
    """Caches in one of ``CACHE_LAYOUTS`` (the same bytes, cut into regions differently).

    engine: per layer a ``[2, num_blocks, ...]`` K/V tensor and a ``[num_blocks, head_dim]`` indexer
    tensor (90 regions); merged-indexer: the indexer keys of all layers in one
    ``[num_blocks, layers, head_dim]`` tensor (61 regions); block-major: all of a block's bytes
    contiguous (1 region).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    kv_numel = 2 * num_blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    idx_numel = num_blocks * HEAD_DIM
    flat = torch.zeros(LAYERS * (kv_numel + idx_numel) * elem, dtype=torch.uint8, device=device)
    if cache_layout == "block-major":  # viewed as [num_blocks, everything]: one write per run
        views = [flat.view(num_blocks, -1)]
        return Caches(flat, [view_region(views[0])], views)
    typed = flat.view(dtype)
    kv = [typed[i * kv_numel : (i + 1) * kv_numel].view(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
          for i in range(LAYERS)]  # fmt: skip
    base = LAYERS * kv_numel
    if cache_layout == "merged-indexer":
        views = region_views(kv, [typed[base:].view(num_blocks, LAYERS, HEAD_DIM)])
    else:
        idx = [typed[base + i * idx_numel : base + (i + 1) * idx_numel].view(num_blocks, HEAD_DIM)
               for i in range(LAYERS)]  # fmt: skip
        views = region_views(kv, idx)
    return Caches(flat, [view_region(v) for v in views], views)


def fill(caches: Caches, seed: int = 0) -> None:
    """Deterministic bytes, so that another process can rebuild what the producer holds."""
    g = torch.Generator().manual_seed(seed)
    caches.flat.copy_(torch.randint(0, 256, caches.flat.shape, generator=g, dtype=torch.uint8))


@dataclass
class Side:
    """One process's transfer set-up: its agent, staging buffer (staged) and raw-write buffer."""

    agent: MooncakeAgent
    staging: StagingBuffer | None
    raw: torch.Tensor

    def close(self) -> None:
        self.agent.close()
        if self.staging is not None:
            self.staging.close()


def open_side(caches: Caches, backend: str, staging_mb: int, inflight: int = 2, protocol: str | None = None) -> Side:
    """An agent with what ``backend`` needs registered, plus a host buffer for raw writes.

    ``inflight``: transfers the staging buffer serves at once (two slots each), as ``max_inflight_pulls``.
    ``protocol`` ipc: Mooncake runs with the transport it would choose (it moves only the raw peer)."""
    device = caches.flat.device
    protocol = None if protocol == "ipc" else protocol
    choose_backend(MemoryBackend(backend), device.type, installed_wheel())  # refuses direct GPU memory without it
    raw = caches.flat if device.type == "cpu" else torch.empty(caches.flat.numel(), dtype=torch.uint8, pin_memory=True)
    staging = (StagingBuffer(caches.views, staging_mb << 20, slots=SLOTS_PER_TRANSFER * inflight)
               if backend == MemoryBackend.STAGED else None)  # fmt: skip
    agent = MooncakeAgent("127.0.0.1", protocol=protocol)
    regions = [Region(raw.data_ptr(), raw.numel(), 1)]
    regions += caches.regions if staging is None else [staging.region]
    agent.register(regions)
    return Side(agent, staging, raw)


def _producer_main(
    conn: Connection, num_blocks: int, dtype_name: str, cache_layout: str, backend: str = "direct",
    staging_mb: int = DEFAULT_STAGING_MB, device: str = "cpu", inflight: int = 2, protocol: str | None = None,
) -> None:  # fmt: skip
    """The prefill process: answers ``offer`` / ``raw`` / ``ipc_copy`` / ``released`` / ``stop`` on ``conn``."""
    torch.set_num_threads(1)
    caches = make_caches(num_blocks, DTYPES[dtype_name], cache_layout, device)
    asyncio.run(_producer(conn, caches, backend, staging_mb, inflight, protocol))


async def _producer(conn: Connection, caches: Caches, backend: str, staging_mb: int, inflight: int = 2,
                    protocol: str | None = None) -> None:  # fmt: skip
    export = None
    if protocol == "ipc":  # before any address is taken: on CPU the caches move into shared memory
        export = PoolExport(caches.views)
        caches.regions = [view_region(v) for v in caches.views]
    fill(caches)
    side = open_side(caches, backend, staging_mb, inflight, protocol)
    producer = KVProducer(side.agent, caches.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          staging=side.staging, ipc=export, ipc_only=export is not None)  # fmt: skip
    await producer.start()
    loop = asyncio.get_running_loop()
    released: list[ReleaseReason] = []
    conn.send((side.agent.rpc_address, producer.port))
    try:
        while True:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
            if cmd == "offer":
                conn.send(producer.offer(args[0], 0, released.append).to_dict())
            elif cmd == "raw":
                peer, dst, nbytes = args
                start = time.perf_counter()
                await side.agent.write(peer, [WriteOp(side.raw.data_ptr(), dst, nbytes)])
                conn.send(time.perf_counter() - start)
            elif cmd == "ipc_copy":  # CUDA: the consumer's tensor, opened here through CUDA IPC
                conn.send(_timed_copy(args[0], caches.flat, args[1], args[2]))
            elif cmd == "released":
                conn.send([str(r) for r in released])
            else:
                break
    finally:
        await producer.close()
        side.close()


def _timed_copy(dst: torch.Tensor, src: torch.Tensor, nbytes: int, repeats: int) -> float:
    """Median seconds of one device copy of ``nbytes`` from ``src`` into ``dst`` (the copy limit)."""
    times = []
    cuda = dst.device.type == "cuda"
    for _ in range(repeats + 1):  # the first is a warm-up (IPC mapping, clocks)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst[:nbytes].copy_(src.view(torch.uint8)[:nbytes])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


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


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = max(tokens) // BLOCK_SIZE + 16  # a little headroom: contiguous ids do not cover a whole region
    dtype = DTYPES[args.dtype]
    caches = make_caches(num_blocks, dtype, args.cache_layout, args.device)
    side = open_side(caches, args.backend, args.staging_mb, protocol=args.protocol)
    peers = IpcPeers(caches.views, IpcMode.FORCED) if args.protocol == "ipc" else None
    consumer = KVConsumer(side.agent, caches.regions, timeout_s=120, staging=side.staging, ipc=peers)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, daemon=True, args=(
        child, num_blocks, args.dtype, args.cache_layout, args.backend, args.staging_mb, args.device, 2,
        args.protocol))  # fmt: skip
    proc.start()
    loop = asyncio.get_running_loop()
    results: list[dict[str, Any]] = []

    async def ask(*cmd: Any) -> Any:
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    try:
        await loop.run_in_executor(None, parent.recv)  # the producer is up
        elem = torch.empty((), dtype=dtype).element_size()
        unit_kv, unit_idx = BLOCK_SIZE * KV_HEADS * HEAD_DIM * elem, HEAD_DIM * elem
        staging = f", staging {side.staging.nbytes >> 20} MiB in {side.staging.slots} slots" if side.staging else ""
        print(f"SmolLM2 shape: {LAYERS} layers x (K, V) {KV_HEADS}x{HEAD_DIM} {args.dtype}, block {BLOCK_SIZE}; "
              f"indexer 1x{HEAD_DIM} per block per layer; units {unit_kv} B (KV), {unit_idx} B (indexer); "
              f"{args.cache_layout} layout, {len(caches.regions)} region(s); {args.device}; "
              f"backend {args.backend}{staging}; protocol {args.protocol or side.agent.protocol}; "
              f"median of {args.repeats}")  # fmt: skip
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
                    raws.append(await ask("raw", side.agent.rpc_address, side.raw.data_ptr(), total))
                    src, dst = _block_ids(n, num_blocks, layout, rng)
                    if peers is not None:
                        writes = len(caches.views)  # regions copied (in layer groups on CUDA)
                    elif side.staging is None:
                        writes = len(plan_writes(caches.regions, caches.regions, src, dst))
                    else:
                        writes = len(plan_chunks(side.staging.unit_bytes, n, side.staging.slot_bytes))
                    params = await ask("offer", src)
                    start = time.perf_counter()
                    await consumer.pull(params, dst)
                    pulls.append(time.perf_counter() - start)
                pull, raw = statistics.median(pulls), statistics.median(raws)
                limits = await _copy_limits(args, caches, total, ask)
                ratio = statistics.median(r / p for r, p in zip(raws, pulls, strict=True))  # back-to-back pairs
                print(f"{t:>6} {layout:>10} {kv_bytes / 2**20:>7.1f} {idx_bytes / 2**10:>7.1f} {writes:>6} "
                      f"{pull * 1e3:>7.1f} {total / pull / 1e9:>6.2f} {raw * 1e3:>7.1f} {total / raw / 1e9:>8.2f} "
                      f"{ratio:>6.0%}", flush=True)  # fmt: skip
                results.append({
                    "tokens": t, "layout": layout, "bytes": total, "writes": writes, "ms": pull * 1e3,
                    "gb_s": total / pull / 1e9, "raw_ms": raw * 1e3, "raw_gb_s": total / raw / 1e9, "ratio": ratio,
                    "backend": args.backend, "device": args.device, "dtype": args.dtype,
                    "staging_mb": args.staging_mb if side.staging else None,
                    "protocol": "ipc" if peers is not None else side.agent.protocol, **limits,
                })  # fmt: skip
                if "ipc_gb_s" in limits:
                    print(f"{'':>6} {'':>10} copy limits: device-to-device {limits['d2d_gb_s']:.1f} GB/s, "
                          f"IPC between the processes {limits['ipc_gb_s']:.1f} GB/s; the pull is "
                          f"{total / pull / 1e9 / limits['ipc_gb_s']:.1%} of the IPC copy", flush=True)  # fmt: skip
                else:
                    print(f"{'':>6} {'':>10} copy limit: one copy of the bytes in this process "
                          f"{limits['d2d_gb_s']:.2f} GB/s; the pull is {total / pull / 1e9 / limits['d2d_gb_s']:.1%} "
                          "of it", flush=True)  # fmt: skip
        released = await ask("released")
        print(f"producer releases: {len(released)}, all written: {set(released) == {'written'}}")
    finally:
        parent.send(("stop",))
        await loop.run_in_executor(None, proc.join, 30)
        side.close()
    return results


async def _copy_limits(args: argparse.Namespace, caches: Caches, nbytes: int, ask: Any) -> dict[str, float]:
    """What a plain copy of ``nbytes`` takes in this process (device to device, or memory to memory on CPU)
    and, on CUDA, from the producer's caches into a tensor of this process opened there through CUDA IPC
    (the limit of any GPU-to-GPU transport)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=caches.flat.device)
    d2d = _timed_copy(dst, caches.flat, nbytes, args.repeats)
    if args.device != "cuda":
        return {"d2d_gb_s": nbytes / d2d / 1e9}
    ipc = float(await ask("ipc_copy", dst, nbytes, args.repeats))
    return {"d2d_gb_s": nbytes / d2d / 1e9, "ipc_gb_s": nbytes / ipc / 1e9}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.kv_transfer", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--layouts", default="contiguous,fragmented,scattered")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-layout", choices=CACHE_LAYOUTS, default="engine", help="how caches are cut into regions")
    p.add_argument("--backend", choices=["staged", "direct"], default="staged", help="KV memory backend")
    p.add_argument("--staging-mb", type=int, default=DEFAULT_STAGING_MB, help="staging buffer per side (staged)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the caches live")
    p.add_argument(
        "--protocol",
        choices=["ipc", "tcp", "rdma"],
        default=None,
        help="ipc: decode maps the producer's pools (engine.kv_transfer.ipc); tcp / rdma: Mooncake's "
        "transport (default: chosen, see transport)",
    )
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m bench.engine.kv_transfer", "args": vars(args), "rows": results}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
