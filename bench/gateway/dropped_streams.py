"""A gateway's memory as clients drop their streams, side by side with SMG: `python -m bench.gateway.dropped_streams`.

Each gateway in turn is put in front of one fresh mock worker process (`atomesh.testing.mock_worker`,
`--tokens` events `--chunk-interval-secs` apart, so that every stream is still under way when it is
dropped) and `--concurrency` clients open streamed completions, read until the first event arrives and
close the connection, `--streams` times in all. The gateway's resident memory (VmRSS) is read at every
`--every` drops, and its CPU time (user + system) is counted over the whole run.

Gateways: `atomesh` as `atomesh launch` runs it (its collector tuned: `gc.freeze()` and thresholds
10000 / 20 / 50, `atomesh.service.tune_gc`), `atomesh-default-gc` (the same without that tuning, to tell
whether it still pays), and `smg` when installed. Printed: RSS at each checkpoint, the growth from the
first checkpoint to the last (flat: within 5 %), CPU ms per dropped stream. It prints (and writes
`--json`); it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from bench.gateway.procs import free_port, loopback_flags, smg_launch, start, stop, wait_serving

SYSTEMS = ("atomesh", "atomesh-default-gc", "smg")
# `atomesh launch` with the collector left as Python sets it: tune_gc replaced before the app imports it.
_DEFAULT_GC = "import atomesh.service as s; s.tune_gc = lambda: None; from atomesh.cli import main; main()"


@dataclass(slots=True)
class Report:
    """One gateway's run."""

    system: str
    rss_mb: dict[int, float] = field(default_factory=dict)  # dropped streams so far -> VmRSS
    growth_pct: float = 0.0  # from the first checkpoint to the last
    cpu_ms_per_stream: float = 0.0
    seconds: float = 0.0
    errors: int = 0  # drops that did not see a first event (refused, reset, timed out)


def rss_mb(pid: int) -> float:
    """VmRSS of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_secs(pid: int) -> float:
    """User + system CPU time of a process (and its reaped children), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / ticks  # utime, stime, cutime, cstime


def gateway_command(system: str, port: int, mport: int, worker: str) -> list[str]:
    common = [*loopback_flags(port, mport), "--worker-urls", worker]
    if system == "smg":
        smg = smg_launch()
        assert smg is not None
        return [*smg, *common]
    if system == "atomesh-default-gc":
        return [sys.executable, "-c", _DEFAULT_GC, "launch", *common]
    return [sys.executable, "-m", "atomesh", "launch", *common]


async def drop_streams(port: int, pid: int, args: argparse.Namespace, report: Report) -> None:
    body = orjson.dumps({"model": "mock-model", "prompt": "hi", "max_tokens": args.tokens, "stream": True})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    done = 0
    next_mark = args.every
    lock = asyncio.Lock()

    async def one() -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        except (OSError, TimeoutError):
            report.errors += 1
            return
        try:
            writer.write(request)
            await asyncio.wait_for(reader.readuntil(b"data: "), 10)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            report.errors += 1
        finally:
            writer.close()

    async def client() -> None:
        nonlocal done, next_mark
        while True:
            async with lock:
                if done >= args.streams:
                    return
                done += 1
            await one()
            if done >= next_mark:
                async with lock:
                    if done >= next_mark:
                        report.rss_mb[next_mark] = round(rss_mb(pid), 1)
                        print(f"  {report.system}: {next_mark} dropped, RSS {report.rss_mb[next_mark]} MB", flush=True)
                        next_mark += args.every

    await asyncio.gather(*(client() for _ in range(args.concurrency)))


def run_system(system: str, args: argparse.Namespace, workdir: Path) -> Report:
    mock_port, port, mport = free_port(), free_port(), free_port()
    mock = start(
        [
            sys.executable,
            "-m",
            "atomesh.testing.mock_worker",
            "--port",
            str(mock_port),
            "--stream-chunks",
            str(args.tokens),
            "--chunk-interval-secs",
            str(args.chunk_interval_secs),
        ],
        workdir / f"{system}-mock.log",
    )
    gw = None
    report = Report(system)
    try:
        wait_serving(f"http://127.0.0.1:{mock_port}", "mock-model", 20)
        gw = start(
            gateway_command(system, port, mport, f"http://127.0.0.1:{mock_port}"), workdir / f"{system}-gateway.log"
        )
        wait_serving(f"http://127.0.0.1:{port}", "mock-model", 60)
        cpu0, t0 = cpu_secs(gw.pid), time.monotonic()
        asyncio.run(drop_streams(port, gw.pid, args, report))
        report.seconds = round(time.monotonic() - t0, 1)
        report.cpu_ms_per_stream = round((cpu_secs(gw.pid) - cpu0) * 1000 / args.streams, 3)
    finally:
        if gw is not None:
            stop(gw)
        stop(mock, grace=2)
    marks = sorted(report.rss_mb)
    if len(marks) >= 2:
        first, last = report.rss_mb[marks[0]], report.rss_mb[marks[-1]]
        report.growth_pct = round(100 * (last - first) / first, 1)
    return report


def print_reports(reports: list[Report], args: argparse.Namespace) -> None:
    print(
        f"\ndropped streams: {args.streams} streamed completions ({args.tokens} events, "
        f"{args.chunk_interval_secs} s apart), each closed by its client at its first event, "
        f"{args.concurrency} clients at a time; RSS every {args.every}"
    )
    marks = sorted({m for r in reports for m in r.rss_mb})
    print(
        "| gateway | "
        + " | ".join(f"RSS MB at {m:,}" for m in marks)
        + " | growth first to last | CPU ms per stream | seconds | errors |"
    )
    print("|---|" + "---|" * (len(marks) + 4))
    for r in reports:
        cells = " | ".join(f"{r.rss_mb[m]:.1f}" if m in r.rss_mb else "-" for m in marks)
        print(
            f"| {r.system} | {cells} | {r.growth_pct:+.1f} % | {r.cpu_ms_per_stream:.3f} | {r.seconds:.0f} "
            f"| {r.errors} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.dropped_streams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=SYSTEMS,
        default=None,
        help=f"gateways to run (default: {', '.join(SYSTEMS)}; smg when installed)",
    )
    p.add_argument("--streams", type=int, default=100_000, help="streams dropped in all")
    p.add_argument("--every", type=int, default=10_000, help="read RSS after this many drops")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200, help="events in each stream (it is dropped at the first)")
    p.add_argument("--chunk-interval-secs", type=float, default=0.005)
    p.add_argument("--json", type=Path, default=None, help="also write the reports here")
    args = p.parse_args(argv)
    systems = [s for s in SYSTEMS if (s != "smg" or smg_launch() is not None) and (not args.only or s in args.only)]
    workdir = Path(tempfile.mkdtemp(prefix="atomesh-bench-dropped-"))
    print(f"logs in {workdir}", flush=True)
    reports = [run_system(s, args, workdir) for s in systems]
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
