"""What an ipc pull costs when the prefill engine's event loop is busy: this tree against an earlier one.

The isolated form of ``bench.engine.pd_pull_latency``: no model, just the KV relay of two processes on
loopback, as a prefill and a decode engine hold it (SmolLM2's cache shape, 90 regions, fp32, pools in
shared memory: ``bench.engine.kv_transfer``'s caches), over ``protocol`` ipc. The producer process
keeps its event loop busy the way a serving engine's is: a task that runs Python for ``--busy-ms``
at a time (scheduling, detokenising, streaming hold the loop and the GIL) and then yields. The
consumer process (decode) pulls ``--n`` requests of ``--tokens`` tokens at once, ``--rounds`` times,
and reports each pull's latency. Both processes run the code of one tree: this checkout (*now*) or
``--before`` (a git revision unpacked with ``git archive``: the peer); runs alternate between the
two trees, ``--repeats`` each. Reported: median and p90 pull latency per tree and busy setting, and
before / now. Printed (and written as JSON with ``--json``), never asserted.

    python -m bench.engine.pd_pull_busy_loop --before 05e01c4 [--busy-ms 0,20] [--n 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine.pd_pull_latency import ROOT, unpack

PRODUCER = r"""
import asyncio, json, sys, time
import torch
from engine.kv_transfer import KVProducer, MooncakeAgent
from bench.engine.kv_transfer import fill, make_caches
from engine.kv_transfer.ipc import PoolExport
from engine.kv_transfer.layout import view_region

async def main(num_blocks, busy_s):
    caches = make_caches(num_blocks, torch.float32)
    fill(caches)
    export = PoolExport(caches.views)
    regions = [view_region(v) for v in caches.views]
    agent = MooncakeAgent("127.0.0.1")
    producer = KVProducer(agent, regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          timeout_s=60, ipc=export)
    await producer.start()

    async def busy():  # the engine loop's own work: Python that holds the loop (and the GIL), then a yield
        while True:
            t = time.perf_counter()
            while time.perf_counter() - t < busy_s:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(busy()) if busy_s > 0 else None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"port": producer.port}), flush=True)
    while line := await reader.readline():
        params = [producer.offer(ids, 1, lambda reason: None).to_dict() for ids in json.loads(line)]
        print(json.dumps(params), flush=True)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""

CONSUMER = r"""
import asyncio, inspect, json, subprocess, sys, time
import torch
from engine.kv_transfer import KVConsumer, MooncakeAgent
from bench.engine.kv_transfer import make_caches
from engine.kv_transfer.ipc import IpcMode, IpcPeers

async def main(producer_code, n, tokens, rounds, busy_s):
    per = tokens // 16
    num_blocks = per * n + 8
    proc = subprocess.Popen([sys.executable, "-c", producer_code, str(num_blocks), str(busy_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        json.loads(proc.stdout.readline())
        caches = make_caches(num_blocks, torch.float32)
        agent = MooncakeAgent("127.0.0.1")
        kw = {"workers": n} if "workers" in inspect.signature(IpcPeers).parameters else {}  # trees before had none
        consumer = KVConsumer(agent, caches.regions, ipc=IpcPeers(caches.views, IpcMode.FORCED, **kw),
                              max_inflight=n, timeout_s=60)
        ids = [list(range(k * per, (k + 1) * per)) for k in range(n)]

        def offers():
            proc.stdin.write(json.dumps(ids) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        await consumer.pull(offers()[0], ids[0])  # maps the pools
        latencies = []
        for _ in range(rounds):
            params = offers()

            async def timed(p, dst):
                t = time.perf_counter()
                await consumer.pull(p, dst)
                return time.perf_counter() - t

            latencies += await asyncio.gather(*(timed(p, dst) for p, dst in zip(params, ids)))
        print(json.dumps(latencies))
    finally:
        proc.kill()
        proc.wait()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
"""


def run(tree: Path, a: argparse.Namespace, busy_ms: float) -> list[float]:
    # The tree under test's engine first; the cache helpers of bench.engine.kv_transfer from this checkout.
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
    argv = [sys.executable, "-c", CONSUMER, PRODUCER, str(a.n), str(a.tokens), str(a.rounds), str(busy_ms / 1e3)]
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-3000:]}")
    return [s * 1e3 for s in json.loads(out.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine.pd_pull_busy_loop", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--before", required=True, help="the git revision to measure against (the peer)")
    p.add_argument("--busy-ms", default="0,20", help="how long the producer's loop runs Python between yields")
    p.add_argument("--n", type=int, default=8, help="pulls at once")
    p.add_argument("--tokens", type=int, default=256, help="tokens per pull (16 per block)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of n pulls per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per tree and busy setting (alternating)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": unpack(a.before, Path(tmp)), "now": ROOT}
        print(f"{a.n} ipc pulls at once of {a.tokens} tokens (SmolLM2 cache shape, fp32, CPU), {a.rounds} rounds "
              f"x {a.repeats} runs per tree; now = this tree, before = {a.before}")  # fmt: skip
        print(f"{'busy ms':>8} {'tree':>7} {'p50 ms':>8} {'p90 ms':>8}")
        for busy in (float(x) for x in a.busy_ms.split(",")):
            got: dict[str, list[float]] = {"before": [], "now": []}
            for r in range(a.repeats):
                for k in ("before", "now") if r % 2 == 0 else ("now", "before"):
                    got[k] += run(trees[k], a, busy)
            row: dict[str, Any] = {"busy_ms": busy}
            for k, lat in got.items():
                lat.sort()
                row[k] = {"p50_ms": statistics.median(lat), "p90_ms": lat[int(0.9 * (len(lat) - 1))], "pulls": len(lat)}
                print(f"{busy:>8g} {k:>7} {row[k]['p50_ms']:>8.1f} {row[k]['p90_ms']:>8.1f}", flush=True)
            row["before_over_now_p50"] = row["before"]["p50_ms"] / row["now"]["p50_ms"]
            row["before_over_now_p90"] = row["before"]["p90_ms"] / row["now"]["p90_ms"]
            print(
                f"{busy:>8g} before / now: p50 {row['before_over_now_p50']:.2f}x, p90 {row['before_over_now_p90']:.2f}x"
            )
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            command = "python -m bench.engine.pd_pull_busy_loop " + " ".join(argv or sys.argv[1:])
            date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            json.dump({"command": command, "args": vars(a), "date": date, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
