"""Workers dying and freezing under load, side by side with SMG: `python -m bench.gateway.chaos` (`--help`: options).

Like with like first: atomesh without migration (`--migration-limit 0`, the `atomesh-no-migration` row),
then SMG (which has no migration), then atomesh with `--migration-limit` (what migration adds). Each in
turn is put in front of fresh mock worker processes (`atomesh.testing.mock_worker`, streaming `--tokens`
words at `--chunk-interval-secs`) and loaded by `--concurrency` clients for `--duration` seconds: every
other request a streamed chat completion (with `include_usage`), the others whole completions, each
answer checked word by word against the uninterrupted one. At `--kill-at` seconds one worker is killed
(SIGKILL); at `--freeze-at` another is frozen (SIGSTOP), accepting connections and answering nothing.
Every gateway gets the same health-check, retry and timeout flags.

Printed per gateway: requests, lost (an error status, an error event, a missing end, a wrong text; a
wrong usage count is listed apart), latency p50 / p99 / max, how long the gateway took to show each
broken worker unhealthy in `GET /workers` (the detection time), and whether max latency stayed within
detection + 1 s. It prints (and writes `--json`); it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from bench.gateway.procs import free_port, loopback_flags, smg_launch, start, stop, wait_serving

MODEL = "mock-model"
NO_MIGRATION = "atomesh-no-migration"  # atomesh with --migration-limit 0: like for like with SMG
SYSTEMS = (NO_MIGRATION, "smg", "atomesh")  # the order of the rows


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    kind: str  # "stream" or "whole"
    started: float  # seconds from the start of the load
    latency: float
    problem: str | None = None  # why it is lost
    bad_usage: bool = False


@dataclass(slots=True)
class Report:
    """One gateway's run."""

    system: str
    requests: int = 0
    lost: int = 0
    lost_by_reason: dict[str, int] = field(default_factory=dict)
    bad_usage: int = 0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    max_streamed_s: float = 0.0
    max_whole_s: float = 0.0
    killed_out_after_s: float | None = None  # kill -> GET /workers shows it unhealthy
    frozen_out_after_s: float | None = None  # freeze -> GET /workers shows it unhealthy (the detection time)
    target_met: bool | None = None  # max latency <= detection + 1 s


# ---------------------------------------------------------------------------- the load
def _expected(tokens: int) -> tuple[str, str]:
    words = [f"tok{i}" for i in range(tokens)]
    return "".join(w + " " for w in words), " ".join(words)


async def _stream(s: aiohttp.ClientSession, url: str, tokens: int, out: Outcome) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        raw = await r.read()
        if r.status != 200:
            out.problem = f"status {r.status}"
            return
    text, done, usage = [], False, None
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: "):
            continue
        data = block[6:]
        if data == b"[DONE]":
            done = True
            continue
        event = orjson.loads(data)
        if "error" in event:
            out.problem = "error event"
            return
        for choice in event.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
        usage = event.get("usage") or usage
    if not done:
        out.problem = "no [DONE]"
    elif "".join(text) != _expected(tokens)[0]:
        out.problem = "wrong text"
    out.bad_usage = not usage or usage.get("completion_tokens") != tokens or usage.get("prompt_tokens") != 3


async def _whole(s: aiohttp.ClientSession, url: str, tokens: int, out: Outcome) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": tokens}
    async with s.post(url + "/v1/completions", json=body) as r:
        raw = await r.read()
        if r.status != 200:
            out.problem = f"status {r.status}"
            return
    answer = orjson.loads(raw)
    if answer["choices"][0]["text"] != _expected(tokens)[1]:
        out.problem = "wrong text"
    out.bad_usage = answer.get("usage", {}).get("completion_tokens") != tokens


async def load(url: str, concurrency: int, duration: float, tokens: int, t0: float) -> list[Outcome]:
    outcomes: list[Outcome] = []
    end = t0 + duration
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def client(i: int) -> None:
            n = i
            while time.monotonic() < end:
                kind = "stream" if n % 2 == 0 else "whole"
                n += 1
                started = time.monotonic()
                out = Outcome(kind, started - t0, 0.0)
                try:
                    await (_stream if kind == "stream" else _whole)(s, url, tokens, out)
                except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError) as e:
                    out.problem = type(e).__name__
                out.latency = time.monotonic() - started
                outcomes.append(out)

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return outcomes


async def _out_after(url: str, worker: str, since: float, until: float) -> float | None:
    """Seconds from `since` until the gateway's GET /workers shows `worker` unhealthy (None: never)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < until:
            try:
                async with s.get(url + "/workers") as r:
                    listed = (await r.json())["workers"]
                if any(w["url"] == worker and not w["is_healthy"] for w in listed):
                    return time.monotonic() - since
            except (aiohttp.ClientError, TimeoutError, KeyError):
                pass
            await asyncio.sleep(0.05)
    return None


# ---------------------------------------------------------------------------- one gateway
def gateway_command(system: str, port: int, mport: int, workers: list[str], args: argparse.Namespace) -> list[str]:
    common = [
        *loopback_flags(port, mport),
        "--worker-urls",
        *workers,
        "--health-check-interval-secs",
        str(args.health_interval_secs),
        "--health-check-timeout-secs",
        str(args.health_timeout_secs),
        "--health-failure-threshold",
        str(args.health_failure_threshold),
        "--request-timeout-secs",
        str(args.request_timeout_secs),
        "--retry-max-retries",
        str(args.retry_max_retries),
    ]
    if system == "smg":
        smg = smg_launch()
        assert smg is not None
        return [*smg, *common]
    limit = 0 if system == NO_MIGRATION else args.migration_limit
    return [sys.executable, "-m", "atomesh", "launch", *common, "--migration-limit", str(limit)]


def run_system(system: str, args: argparse.Namespace, workdir: Path) -> Report:
    mocks: list[subprocess.Popen[bytes]] = []
    urls = []
    for i in range(args.workers):
        port = free_port()
        mocks.append(
            start(
                [
                    sys.executable,
                    "-m",
                    "atomesh.testing.mock_worker",
                    "--port",
                    str(port),
                    "--name",
                    f"w{i}",
                    "--stream-chunks",
                    str(args.tokens),
                    "--chunk-interval-secs",
                    str(args.chunk_interval_secs),
                    "--latency-secs",
                    str(args.latency_secs),
                ],
                workdir / f"{system}-mock-w{i}.log",
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    gw_port, gw_mport = free_port(), free_port()
    gw_url = f"http://127.0.0.1:{gw_port}"
    gw = None
    try:
        for u in urls:
            wait_serving(u, MODEL, 20)
        gw = start(gateway_command(system, gw_port, gw_mport, urls, args), workdir / f"{system}-gateway.log")
        wait_serving(gw_url, MODEL, 60)
        outcomes, killed_out, frozen_out = asyncio.run(_chaos(gw_url, urls, mocks, args))
    finally:
        if len(mocks) > 1 and mocks[1].poll() is None:
            mocks[1].send_signal(signal.SIGCONT)
        if gw is not None:
            stop(gw)
        for m in mocks:
            stop(m, grace=2)
    return summarize(system, outcomes, killed_out, frozen_out)


async def _chaos(
    gw_url: str, urls: list[str], mocks: list[subprocess.Popen[bytes]], args: argparse.Namespace
) -> tuple[list[Outcome], float | None, float | None]:
    t0 = time.monotonic()
    running = asyncio.ensure_future(load(gw_url, args.concurrency, args.duration, args.tokens, t0))
    await asyncio.sleep(args.kill_at)
    mocks[0].kill()
    killed_at = time.monotonic()
    killed = asyncio.ensure_future(_out_after(gw_url, urls[0], killed_at, killed_at + 60))
    await asyncio.sleep(max(0.0, args.freeze_at - (time.monotonic() - t0)))
    mocks[1].send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    frozen = await _out_after(gw_url, urls[1], frozen_at, frozen_at + 60)
    outcomes = await running
    return outcomes, await killed, frozen


def summarize(system: str, outcomes: list[Outcome], killed_out: float | None, frozen_out: float | None) -> Report:
    rep = Report(system, requests=len(outcomes), killed_out_after_s=killed_out, frozen_out_after_s=frozen_out)
    lat = sorted(o.latency for o in outcomes)
    for o in outcomes:
        if o.problem is not None:
            rep.lost += 1
            rep.lost_by_reason[o.problem] = rep.lost_by_reason.get(o.problem, 0) + 1
        rep.bad_usage += o.bad_usage and o.problem is None
    if lat:
        rep.p50_s = statistics.median(lat)
        rep.p99_s = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        rep.max_s = lat[-1]
        rep.max_streamed_s = max((o.latency for o in outcomes if o.kind == "stream"), default=0.0)
        rep.max_whole_s = max((o.latency for o in outcomes if o.kind == "whole"), default=0.0)
    if frozen_out is not None:
        rep.target_met = rep.lost == 0 and rep.max_s <= frozen_out + 1.0
    return rep


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_reports(reports: list[Report], args: argparse.Namespace) -> None:
    print(
        f"\nchaos: {args.workers} mock workers ({args.tokens} tokens, {args.chunk_interval_secs} s apart), "
        f"{args.concurrency} clients for {args.duration} s (half streamed chat, half whole completions); "
        f"worker 0 killed at {args.kill_at} s, worker 1 frozen at {args.freeze_at} s; health checks every "
        f"{args.health_interval_secs} s, timeout {args.health_timeout_secs} s, {args.health_failure_threshold} "
        f"failures; request timeout {args.request_timeout_secs} s; {NO_MIGRATION}: --migration-limit 0 (like "
        f"SMG, which has no migration); atomesh: --migration-limit {args.migration_limit}"
    )
    print(
        "| gateway | requests | lost | lost by reason | wrong usage | p50 s | p99 s | max s | max streamed s "
        "| max whole s | killed worker out after s | frozen worker out after s (detection) "
        "| max <= detection + 1 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(r.lost_by_reason.items())) or "-"
        met = "-" if r.target_met is None else ("yes" if r.target_met else "no")
        print(
            f"| {r.system} | {r.requests} | {r.lost} | {reasons} | {r.bad_usage} | {r.p50_s:.2f} | {r.p99_s:.2f} "
            f"| {r.max_s:.2f} | {r.max_streamed_s:.2f} | {r.max_whole_s:.2f} | {_fmt(r.killed_out_after_s)} "
            f"| {_fmt(r.frozen_out_after_s)} | {met} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=SYSTEMS,
        default=None,
        help=f"gateways to run (default: {', '.join(SYSTEMS)}; smg when installed)",
    )
    p.add_argument("--workers", type=int, default=4, help="mock workers (>= 3: one killed, one frozen)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load")
    p.add_argument("--kill-at", type=float, default=4.0)
    p.add_argument("--freeze-at", type=float, default=7.0)
    p.add_argument("--tokens", type=int, default=32, help="words in every answer")
    p.add_argument("--chunk-interval-secs", type=float, default=0.02)
    p.add_argument("--latency-secs", type=float, default=0.02, help="mock time to first token")
    p.add_argument("--health-interval-secs", type=int, default=1)
    p.add_argument("--health-timeout-secs", type=int, default=1)
    p.add_argument("--health-failure-threshold", type=int, default=2)
    p.add_argument("--request-timeout-secs", type=int, default=60)
    p.add_argument("--retry-max-retries", type=int, default=5)
    p.add_argument("--migration-limit", type=int, default=3, help="atomesh only (SMG has no migration)")
    p.add_argument("--json", type=Path, default=None, help="also write the reports here")
    args = p.parse_args(argv)
    if args.workers < 3:
        p.error("--workers must be at least 3")
    systems = [s for s in SYSTEMS if (s != "smg" or smg_launch() is not None) and (not args.only or s in args.only)]
    workdir = Path(tempfile.mkdtemp(prefix="atomesh-bench-chaos-"))
    print(f"logs in {workdir}", flush=True)
    reports = []
    for system in systems:
        reports.append(run_system(system, args, workdir))
        print(f"{system}: done", flush=True)
    print_reports(reports, args)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json)}, "reports": [asdict(r) for r in reports]},
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
