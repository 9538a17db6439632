"""Priority classes and tenant shares under overload: `python -m bench.gateway.priority` (`--help` lists options).

A mock worker (`--latency-secs` per request) sits behind an atomesh gateway admitting
`--concurrency` requests at once, so its capacity is concurrency / latency requests a second.

1. Classes. An interactive stream arrives at `--high-share` of capacity (Poisson), alone (the unloaded
   p99), then with bulk traffic on top at `--overload` times capacity, through two gateways measured in
   the same run: one with `--priority-scheduler-enabled` (X-SMG-Priority: interactive / bulk) and the
   plain FIFO one as the peer. Target: the interactive p99 under overload within 1.5x of its unloaded p99.
2. Tenants. Two tenants (`X-SMG-Tenant-Id`, trusted) send at `--tenant-demand` and a tenth of it, each
   configured `--tenant-rpm` requests a minute; each should get min(its demand, its share), within 10%.

It prints (and writes `--json`); it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.gateway.procs import free_port, gateway_argv, start, stop

MODEL = "mock-model"


@dataclass(slots=True)
class ClassRun:
    gateway: str
    unloaded_p99_s: float
    overloaded_p99_s: float
    ratio: float
    high_sent: int
    high_failed: int
    bulk_ok: int
    bulk_refused: int


@dataclass(slots=True)
class TenantRun:
    tenant: str
    demand_per_s: float
    share_per_s: float
    admitted_per_s: float
    within_10pct: bool


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


async def _ready(url: str, deadline: float) -> None:
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


async def _poisson(
    session: aiohttp.ClientSession,
    url: str,
    rate: float,
    seconds: float,
    headers: dict[str, str],
    out: list[tuple[int, float]],
    rng: random.Random | None,
) -> None:
    """Send at `rate` a second for `seconds` (Poisson arrivals with `rng`, else evenly spaced); record
    (status, latency) of each."""
    tasks: list[asyncio.Task[None]] = []

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            async with session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=headers) as r:
                await r.read()
                out.append((r.status, time.perf_counter() - t0))
        except aiohttp.ClientError:
            out.append((0, time.perf_counter() - t0))

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(rng.expovariate(rate) if rng is not None else 1 / rate)
    await asyncio.gather(*tasks)


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int:
    async with session.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=headers) as r:
        await r.read()
        return r.status


def _gateway(port: int, mock: str, extra: list[str], log: Path) -> subprocess.Popen[bytes]:
    return start(gateway_argv(port, mock, *extra), log)


async def run(args: argparse.Namespace, tmp: Path) -> tuple[list[ClassRun], list[TenantRun]]:
    capacity = args.concurrency / args.latency_secs
    mock_port = free_port()
    mock = start(
        [
            sys.executable,
            "-m",
            "atomesh.testing.mock_worker",
            "--port",
            str(mock_port),
            "--latency-secs",
            str(args.latency_secs),
        ],
        tmp / "mock.log",
    )
    procs: list[subprocess.Popen[bytes]] = [mock]
    mock_url = f"http://127.0.0.1:{mock_port}"
    try:
        await _ready(mock_url + "/health", time.monotonic() + 30)
        limits = tmp / "limits.yaml"
        limits.write_text(f"default_policy: {{tokens_per_minute: 100000000, requests_per_minute: {args.tenant_rpm}}}\n")
        base = [
            "--max-concurrent-requests",
            str(args.concurrency),
            "--queue-size",
            "100000",
            "--queue-timeout-secs",
            "60",
        ]
        scheduler = tmp / "scheduler.yaml"  # SMG's interactive share of the slots (its floor suits big fleets)
        scheduler.write_text(
            f"classes:\n  interactive: {{reserved_per_slot: {args.interactive_reserved}}}\n"
            "  bulk: {queue_size: 100000}\n"
        )
        systems = {
            "atomesh-priority": [
                *base,
                "--priority-scheduler-enabled",
                "--priority-scheduler-config",
                str(scheduler),
                "--priority-scheduler-default-max-class",
                "system",
            ],
            "atomesh-fifo": base,
        }
        classes = []
        rng = random.Random(args.seed)
        for name, extra in systems.items():
            port = free_port()
            procs.append(_gateway(port, mock_url, extra, tmp / f"{name}.log"))
            await _ready(f"http://127.0.0.1:{port}/readiness", time.monotonic() + 60)
            url = f"http://127.0.0.1:{port}/v1/completions"
            high = {"X-SMG-Priority": "interactive"}
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
                alone: list[tuple[int, float]] = []
                await _poisson(s, url, capacity * args.high_share, args.seconds, high, alone, rng)
                loaded: list[tuple[int, float]] = []
                bulk: list[tuple[int, float]] = []
                await asyncio.gather(
                    _poisson(s, url, capacity * args.high_share, args.seconds, high, loaded, rng),
                    _poisson(s, url, capacity * args.overload, args.seconds, {"X-SMG-Priority": "bulk"}, bulk, rng),
                )
            a = p99([t for st, t in alone if st == 200])
            b = p99([t for st, t in loaded if st == 200])
            classes.append(
                ClassRun(
                    name,
                    a,
                    b,
                    b / a,
                    len(loaded),
                    sum(st != 200 for st, _ in loaded),
                    sum(st == 200 for st, _ in bulk),
                    sum(st != 200 for st, _ in bulk),
                )
            )
        # Tenants: shares of a rate limit under 10:1 demand.
        port = free_port()
        procs.append(
            _gateway(
                port,
                mock_url,
                [
                    *base,
                    "--trust-tenant-header",
                    "--tenant-rate-limit-enabled",
                    "--tenant-rate-limit-config",
                    str(limits),
                ],
                tmp / "tenants.log",
            )
        )
        await _ready(f"http://127.0.0.1:{port}/readiness", time.monotonic() + 60)
        url = f"http://127.0.0.1:{port}/v1/completions"
        share = args.tenant_rpm / 60
        results: dict[str, list[tuple[int, float]]] = {"heavy": [], "light": []}
        demand = {"heavy": args.tenant_demand, "light": args.tenant_demand / 10}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # A bucket starts full (a minute's worth may come at once): both tenants spend that first,
            # then send evenly at their demand for --tenant-seconds.
            emptied: dict[str, float] = {}  # when each tenant's bucket first refused: it refills from then

            async def spend(tenant: str) -> None:
                async def post() -> None:
                    if await _post(s, url, {"x-smg-tenant-id": tenant}) == 429:
                        emptied.setdefault(tenant, time.monotonic())

                while tenant not in emptied:  # a burst at a time until the bucket refuses
                    await asyncio.gather(*(post() for _ in range(50)))

            await asyncio.gather(*(spend(t) for t in results))
            started = time.monotonic()
            await asyncio.gather(
                *(
                    _poisson(s, url, demand[t], args.tenant_seconds, {"x-smg-tenant-id": t}, results[t], None)
                    for t in results
                )
            )
            ended = time.monotonic()
        tenants = []
        for t, outs in results.items():
            # A tenant over its share is admitted what its bucket refilled since it was emptied.
            elapsed = ended - (emptied[t] if demand[t] > share else started)
            admitted = sum(st == 200 for st, _ in outs) / elapsed
            expected = min(demand[t], share)
            tenants.append(TenantRun(t, demand[t], share, admitted, abs(admitted - expected) <= 0.1 * expected))
        return classes, tenants
    finally:
        for p in procs:
            stop(p)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.priority",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests the gateway admits at once")
    p.add_argument("--latency-secs", type=float, default=0.1, help="mock worker time per request")
    p.add_argument("--high-share", type=float, default=0.3, help="interactive load, share of capacity")
    p.add_argument("--overload", type=float, default=2.0, help="bulk load on top, multiple of capacity")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of each class phase")
    p.add_argument(
        "--interactive-reserved",
        type=float,
        default=0.25,
        help="share of the slots bulk may not take (the priority gateway's reserved_per_slot)",
    )
    p.add_argument("--tenant-rpm", type=int, default=300, help="requests a minute each tenant is configured")
    p.add_argument("--tenant-demand", type=float, default=20.0, help="the heavy tenant's requests a second")
    p.add_argument("--tenant-seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        classes, tenants = asyncio.run(run(args, Path(tmp)))
    print(
        f"capacity {args.concurrency / args.latency_secs:.0f} req/s; interactive at {args.high_share:.0%}, "
        f"bulk at {args.overload:g}x on top"
    )
    print(
        f"{'gateway':<18} {'p99 alone':>10} {'p99 loaded':>11} {'ratio':>6} {'hi failed':>9} {'bulk ok':>8} "
        f"{'bulk refused':>12}"
    )
    for c in classes:
        print(
            f"{c.gateway:<18} {c.unloaded_p99_s * 1000:>8.1f}ms {c.overloaded_p99_s * 1000:>9.1f}ms "
            f"{c.ratio:>6.2f} {c.high_failed:>9} {c.bulk_ok:>8} {c.bulk_refused:>12}"
        )
    print("tenants (10:1 demand, equal configured shares):")
    for t in tenants:
        print(
            f"  {t.tenant:<6} demand {t.demand_per_s:6.1f}/s  share {t.share_per_s:5.1f}/s  "
            f"admitted {t.admitted_per_s:6.2f}/s  within 10%: {t.within_10pct}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"classes": [asdict(c) for c in classes], "tenants": [asdict(t) for t in tenants]}, indent=2)
        )


if __name__ == "__main__":
    main()
