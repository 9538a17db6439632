"""Placement benchmark: decision cost, index memory, and a shared-prefix trace through real gateways.

`python -m bench.gateway.placement` prints three tables:

(a) decision time per request for each policy, 16 workers, 32 KB prompts (one of 64 shared 24 KB
    prefixes + an 8 KB unique tail), measured around `Placement.place` + `release` with 32 requests
    kept in flight, so load-aware policies see loads;
(b) cache-aware index size and resident memory after N distinct 1 KB prompts at the default
    `--max-tree-size` (the index must plateau at its bound);
(c) a multi-turn chat trace (S system prompts x U users x T turns, streamed) replayed through a real
    `atomesh launch` process per policy, and through SGLang's router (`smg`, `sglang-router`, when
    installed) with `cache_aware`, in front of the same mock engines (`atomesh.testing.mock_engine`,
    reset between runs): engine prefix-cache hit rate, mean / p99 TTFT and max/min requests per engine.

It prints; it never asserts. Ratios are against the peers measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from atomesh.config import GatewayConfig, PolicyName
from atomesh.placement import Placement, Plan
from atomesh.policies import make_policy
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.request import RequestView, Route
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState
from bench.gateway import help_formatter
from bench.gateway.procs import free_port, start, stop

# The load-balancing policies compared here (consistent_hashing and dp_sticky route by session, not load).
POLICIES = (
    PolicyName.RANDOM,
    PolicyName.ROUND_ROBIN,
    PolicyName.POWER_OF_TWO,
    PolicyName.LEAST_LOAD,
    PolicyName.PREFIX_HASH,
    PolicyName.CACHE_AWARE,
)
WORDS = (
    "the quick brown fox jumps over lazy dogs while engines prefill long prompts and decode tokens "
    "system user assistant context window cache block prefix router gateway latency"
).split()


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ---------------------------------------------------------------------------- (a) decision time
def bench_decision(requests: int, workers: int = 16, prompt_kb: int = 32) -> None:
    rng = random.Random(0)
    shared = [words(rng, prompt_kb * 1024 * 3 // 4) for _ in range(64)]
    prompts = [rng.choice(shared) + words(rng, prompt_kb * 1024 // 4) for _ in range(min(requests, 512))]
    cfg = GatewayConfig.model_validate({})
    print(
        f"\n(a) decision time per request: {workers} workers, {prompt_kb} KB prompts "
        f"(64 shared {prompt_kb * 3 // 4} KB prefixes + unique tail), {requests} requests, 32 in flight"
    )
    print(f"{'policy':<14}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    for name in POLICIES:
        registry = WorkerRegistry()
        for i in range(workers):
            w = Worker(f"http://10.0.0.{i}:8000")
            registry.add(w)
            registry.set_state(w, WorkerState.READY)
        placement = Placement(registry, {WorkerRole.REGULAR: make_policy(name, cfg)}, pd=False)
        inflight: deque[Plan] = deque()
        times: list[float] = []
        gc.collect()
        for k in range(requests):
            view = RequestView(Route.COMPLETIONS, {"prompt": prompts[k % len(prompts)]}, b"", "r")
            t0 = time.perf_counter_ns()
            plan = placement.place(view)
            times.append((time.perf_counter_ns() - t0) / 1000)
            inflight.append(plan)
            if len(inflight) > 32:
                placement.release(inflight.popleft())
        print(f"{name:<14}{pct(times, 0.5):>10.1f}{pct(times, 0.99):>10.1f}{statistics.fmean(times):>10.1f}")


# ---------------------------------------------------------------------------- (b) index memory
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_index_memory(prompts: int) -> None:
    cfg = GatewayConfig.model_validate({})
    policy = CacheAwarePolicy(max_tree_size=cfg.max_tree_size)
    ws = [Worker(f"http://10.0.0.{i}:8000") for i in range(16)]
    filler = words(random.Random(1), 1024)
    gc.collect()
    base = _rss()
    t0 = time.perf_counter()
    peak = 0
    for i in range(prompts):
        view = RequestView(Route.COMPLETIONS, {"prompt": f"prompt {i} {filler}"}, b"", "r")
        policy.record(policy.select(ws, view), view)
        if i % 65536 == 0:
            peak = max(peak, len(policy.index))
    peak = max(peak, len(policy.index))
    dt = time.perf_counter() - t0
    gc.collect()
    grown = _rss() - base
    idx = policy.index
    print(
        f"\n(b) cache-aware index after {prompts:,} distinct ~1 KB prompts, default --max-tree-size "
        f"{cfg.max_tree_size:,} chars = {idx.max_entries:,} entries of {idx.chunk_chars} chars"
    )
    print(
        f"entries {len(idx):,} (max seen {peak:,}, bound {idx.max_entries:,}), evictions {idx.evictions:,}, "
        f"RSS growth {grown / 2**20:.1f} MiB = {grown / max(1, len(idx)):.0f} B/entry, "
        f"{dt / prompts * 1e6:.1f} us per 1 KB request"
    )


# ---------------------------------------------------------------------------- (c) trace


@dataclass
class TraceResult:
    system: str
    hit_rate: float
    ttft_mean: float
    ttft_p99: float
    load_ratio: float
    per_engine: list[int]
    errors: int
    seconds: float


async def wait_http(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    """Poll `url` until it answers 200, or raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up in {timeout}s")
        await asyncio.sleep(0.1)


def _conversations(systems: int, users: int, turns: int, system_chars: int, seed: int = 7) -> list[list[str]]:
    rng = random.Random(seed)
    sys_prompts = [f"[system {s}] " + words(rng, system_chars) for s in range(systems)]
    convs = []
    for u in range(users):
        convs.append([sys_prompts[u % systems]] + [f"user {u} turn {t}: " + words(rng, 300) for t in range(turns)])
    return convs


async def _replay(
    session: aiohttp.ClientSession, url: str, convs: list[list[str]], turns: int, concurrency: int
) -> tuple[list[float], int]:
    ready: deque[tuple[int, int, list[dict[str, str]]]] = deque(
        (u, 0, [{"role": "system", "content": c[0]}]) for u, c in enumerate(convs)
    )
    ttfts: list[float] = []
    errors = 0
    cond = asyncio.Condition()
    active = 0

    async def client() -> None:
        nonlocal errors, active
        while True:
            async with cond:
                while not ready and active:
                    await cond.wait()
                if not ready:
                    cond.notify_all()
                    return
                u, t, msgs = ready.popleft()
                active += 1
            msgs = [*msgs, {"role": "user", "content": convs[u][1 + t]}]
            body = {"model": "mock-model", "messages": msgs, "max_tokens": 8, "stream": True}
            t0 = time.perf_counter()
            answer = []
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        errors += 1
                    first = True
                    async for line in r.content:
                        if first and line.startswith(b"data: "):
                            ttfts.append(time.perf_counter() - t0)
                            first = False
                        answer.append(line)
            except aiohttp.ClientError:
                errors += 1
            msgs = [*msgs, {"role": "assistant", "content": f"answer {u}.{t} " + "t0 t1 t2 t3 t4 t5 t6 t7"}]
            async with cond:
                active -= 1
                if t + 1 < turns:
                    ready.append((u, t + 1, msgs))
                cond.notify_all()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, errors


def _log(name: str) -> Path:
    return Path(f"/tmp/atomesh-bench-{name}.log")


def _external_routers() -> list[tuple[str, list[str]]]:
    out = []
    bindir = os.path.dirname(sys.executable)
    smg = shutil.which("smg") or (os.path.join(bindir, "smg") if os.path.exists(os.path.join(bindir, "smg")) else None)
    if smg:
        out.append(("smg cache_aware", [smg, "launch"]))
    try:
        import sglang_router  # noqa: F401

        out.append(("sglang-router cache_aware", [sys.executable, "-m", "sglang_router.launch_router"]))
    except ImportError:
        pass
    return out


async def bench_trace(
    engines: int,
    systems: int,
    users: int,
    turns: int,
    concurrency: int,
    cache_blocks: int,
    system_chars: int,
    external: bool,
    processes: int = 1,
) -> list[TraceResult]:
    ports = [free_port() for _ in range(engines)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    engine_proc = start(
        [
            sys.executable,
            "-m",
            "atomesh.testing.mock_engine",
            "--ports",
            *map(str, ports),
            "--cache-blocks",
            str(cache_blocks),
        ],
        _log("engines"),
    )
    cfg = GatewayConfig.model_validate({})
    ca_flags = [
        "--cache-threshold",
        str(cfg.cache_threshold),
        "--balance-abs-threshold",
        str(cfg.balance_abs_threshold),
        "--balance-rel-threshold",
        str(cfg.balance_rel_threshold),
        "--eviction-interval-secs",
        str(int(cfg.eviction_interval_secs)),
        "--max-tree-size",
        str(cfg.max_tree_size),
    ]
    systems_to_run: list[tuple[str, list[str]]] = []
    for name in POLICIES:
        systems_to_run.append(
            (
                f"atomesh {name}",
                [
                    sys.executable,
                    "-m",
                    "atomesh",
                    "launch",
                    "--policy",
                    name,
                    *(ca_flags if name == "cache_aware" else []),
                ],
            )
        )
    if processes > 1:  # the index replicated between gateway processes (atomesh.cluster)
        systems_to_run.append(
            (
                f"atomesh cache_aware x{processes}",
                [
                    sys.executable,
                    "-m",
                    "atomesh",
                    "launch",
                    "--policy",
                    "cache_aware",
                    *ca_flags,
                    "--processes",
                    str(processes),
                ],
            )
        )
    if external:
        systems_to_run += [(n, [*cmd, "--policy", "cache_aware", *ca_flags]) for n, cmd in _external_routers()]
    convs = _conversations(systems, users, turns, system_chars)
    results: list[TraceResult] = []
    timeout = aiohttp.ClientTimeout(total=120)
    conn = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
            for u in urls:
                await wait_http(session, u + "/health", 30)
            for label, cmd in systems_to_run:
                for u in urls:
                    async with session.post(u + "/_mock/reset") as r:
                        await r.read()
                port, mport = free_port(), free_port()
                proc = start(
                    [
                        *cmd,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--prometheus-port",
                        str(mport),
                        "--log-level",
                        "warn",
                        "--worker-urls",
                        *urls,
                    ],
                    _log(label.replace(" ", "-")),
                )
                gw = f"http://127.0.0.1:{port}"
                try:
                    await wait_http(session, gw + "/readiness" if label.startswith("atomesh") else gw + "/health", 60)
                    for u in urls:  # startup probes must not count
                        async with session.post(u + "/_mock/reset") as r:
                            await r.read()
                    t0 = time.perf_counter()
                    ttfts, errors = await _replay(session, gw, convs, turns, concurrency)
                    seconds = time.perf_counter() - t0
                    stats = []
                    for u in urls:
                        async with session.get(u + "/_mock/stats") as r:
                            stats.append(await r.json())
                except RuntimeError as e:
                    print(f"{label}: skipped ({e})")
                    continue
                finally:
                    stop(proc)
                prompt = sum(s["prompt_tokens"] for s in stats)
                cached = sum(s["cached_tokens"] for s in stats)
                per = [s["requests"] for s in stats]
                res = TraceResult(
                    label,
                    cached / prompt if prompt else 0.0,
                    statistics.fmean(ttfts) if ttfts else 0,
                    pct(ttfts, 0.99),
                    max(per) / max(1, min(per)),
                    per,
                    errors,
                    seconds,
                )
                results.append(res)
                print(
                    f"{res.system:<28}{res.hit_rate:>8.1%}{res.ttft_mean * 1e3:>10.1f}{res.ttft_p99 * 1e3:>10.1f}"
                    f"{res.load_ratio:>8.2f}{res.errors:>7}{res.seconds:>7.1f}  {per}",
                    flush=True,
                )
    finally:
        stop(engine_proc)
    return results


def run_trace(args: argparse.Namespace) -> None:
    print(
        f"\n(c) multi-turn shared-prefix trace: {args.systems} system prompts of {args.system_chars} chars x "
        f"{args.users} users x {args.turns} turns = {args.users * args.turns} streamed chat requests, "
        f"{args.concurrency} concurrent clients, {args.engines} mock engines of {args.cache_blocks} blocks "
        "(16 tokens each) prefix cache"
    )
    print(
        f"{'system':<28}{'hit':>8}{'TTFT ms':>10}{'p99 ms':>10}{'max/min':>8}{'errors':>7}{'secs':>7}  requests/engine"
    )
    results = asyncio.run(
        bench_trace(
            args.engines,
            args.systems,
            args.users,
            args.turns,
            args.concurrency,
            args.cache_blocks,
            args.system_chars,
            not args.no_external,
            args.processes,
        )
    )
    ours = next((r for r in results if r.system == "atomesh cache_aware"), None)
    for peer in results:
        if ours is not None and not peer.system.startswith("atomesh"):
            print(
                f"atomesh cache_aware vs {peer.system}: hit rate {ours.hit_rate:.1%} vs {peer.hit_rate:.1%}, "
                f"mean TTFT x{ours.ttft_mean / peer.ttft_mean:.2f}, load ratio {ours.load_ratio:.2f} vs "
                f"{peer.load_ratio:.2f}"
            )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.placement", description=__doc__.split("\n")[0], formatter_class=help_formatter
    )
    p.add_argument(
        "--only",
        choices=("decision", "memory", "trace"),
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    p.add_argument("--decision-requests", type=int, default=3000)
    p.add_argument("--index-prompts", type=int, default=1_000_000)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--systems", type=int, default=64)
    p.add_argument("--users", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cache-blocks", type=int, default=512)
    p.add_argument("--system-chars", type=int, default=2048)
    p.add_argument("--no-external", action="store_true", help="skip smg / sglang-router")
    p.add_argument(
        "--processes", type=int, default=1, help="also run atomesh cache_aware with --processes N (trace only)"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    parts = args.only or ["decision", "memory", "trace"]
    if "decision" in parts:
        bench_decision(args.decision_requests)
    if "memory" in parts:
        bench_index_memory(args.index_prompts)
    if "trace" in parts:
        run_trace(args)


if __name__ == "__main__":
    main()
