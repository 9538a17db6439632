"""The probes of issue #31 as an operator and an attacker would run them, side by side with SMG:
`python -m bench.gateway.probes` (`--help` lists options).

Each gateway in turn runs under `ulimit -n --fd-limit` in front of one engine (`--engine`: a real
`python -m engine.openai_server` with the tiny random model, so that a request's cancellation is seen
where it matters, in the engine's own running-request gauge), and is asked:

- `upgrade`: GET /health with `Connection: Upgrade` and `Upgrade: websocket`: the status, and the seconds
  until the gateway closed the connection (none: still open after `--wait-secs`);
- `connect`: a CONNECT request, the same;
- `http09`: a versionless request line (`GET /health` and a line end), the same;
- `flood`: `--flood` upgrade and CONNECT connections (half of them closed without reading the answer),
  then whether a normal completion is still answered, and the gateway's open descriptors afterwards;
- `left`: `--clients` whole completions of `--tokens` tokens whose clients close their connections once
  the engine runs them all: how many still run on the engine 1 s later.

It prints a table (and writes `--json`); it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.gateway.procs import free_port, loopback_flags, smg_launch, start, stop

SYSTEMS = ("atomesh", "smg")
UPGRADE = b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
CONNECT = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
HTTP09 = b"GET /health\r\n"


@dataclass(slots=True)
class Report:
    """One gateway's answers to the probes."""

    system: str
    upgrade: str = ""
    connect: str = ""
    http09: str = ""
    flood_then_served: bool = False
    flood_fds_after: int = 0
    left_running_after_1s: str = ""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _running(engine_url: str) -> float:
    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^atom:requests_running(?:\{[^}]*\})? (\S+)$", text, re.M))


async def _probe(port: int, data: bytes, wait: float) -> str:
    """`status, closed after N s` (or `no answer`, `open after N s`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(data)
    got = b""
    closed: float | None = None
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, t0 + wait - time.monotonic()))
            if not chunk:
                closed = time.monotonic() - t0
                break
            got += chunk
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
    status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.") else "no answer"
    end = f"closed after {closed:.2f} s" if closed is not None else f"open after {wait:g} s"
    return f"{status}, {end}"


async def _flood(port: int, n: int) -> None:
    async def one(i: int) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        except (OSError, TimeoutError):
            return
        try:
            writer.write(CONNECT if i % 3 == 0 else UPGRADE)
            if i % 2 == 0:
                await asyncio.wait_for(reader.read(), 5)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    for first in range(0, n, 250):
        await asyncio.gather(*(one(i) for i in range(first, min(n, first + 250))))


async def _complete(port: int, timeout: float) -> int:
    body = orjson.dumps({"model": "tiny-random", "prompt": "hi", "max_tokens": 2})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
    )
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        writer.write(request)
        got = await asyncio.wait_for(reader.read(), timeout)
        writer.close()
    except (OSError, TimeoutError):
        return 0
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.") else 0


async def _left(port: int, engine_url: str, clients: int, tokens: int) -> str:
    body = orjson.dumps(
        {
            "model": "tiny-random",
            "prompt": "the quick brown fox",
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    writers = []
    for _ in range(clients):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        writers.append(writer)
    deadline = time.monotonic() + 30
    while _running(engine_url) < clients and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    started = _running(engine_url)
    for writer in writers:
        writer.close()
    await asyncio.sleep(1.0)
    still = _running(engine_url)
    deadline = time.monotonic() + 120  # let them end before the next probe
    while _running(engine_url) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return f"{still:g} of {started:g}"


def run_system(system: str, args: argparse.Namespace, workdir: Path, engine_url: str) -> Report:
    port, mport = free_port(), free_port()
    common = [*loopback_flags(port, mport), "--worker-urls", engine_url, "--request-timeout-secs", "600"]
    smg = smg_launch()
    cmd = [*smg, *common] if system == "smg" and smg else [sys.executable, "-m", "atomesh", "launch", *common]
    limit = args.fd_limit

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with open(workdir / f"{system}-gateway.log", "wb") as log:  # the child keeps its own copy
        gw = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limit_fds)
    report = Report(system)
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(_complete(port, 2)) != 200:
            if time.monotonic() > deadline or gw.poll() is not None:
                raise SystemExit(f"{system} did not start; see {workdir}")
            time.sleep(0.3)
        report.upgrade = asyncio.run(_probe(port, UPGRADE, args.wait_secs))
        report.connect = asyncio.run(_probe(port, CONNECT, args.wait_secs))
        report.http09 = asyncio.run(_probe(port, HTTP09, args.wait_secs))
        asyncio.run(_flood(port, args.flood))
        report.flood_then_served = asyncio.run(_complete(port, 10)) == 200
        time.sleep(1.0)
        report.flood_fds_after = _fds(gw.pid)
        report.left_running_after_1s = asyncio.run(_left(port, engine_url, args.clients, args.tokens))
    finally:
        stop(gw)
    return report


def print_reports(reports: list[Report], args: argparse.Namespace) -> None:
    print(
        f"\nprobes: gateways under ulimit -n {args.fd_limit} in front of one tiny engine; flood of {args.flood} "
        f"upgrade/CONNECT connections; {args.clients} whole completions of {args.tokens} tokens left by their "
        "clients"
    )
    print(
        "| gateway | Upgrade: websocket | CONNECT | HTTP/0.9 line | serves after the flood | descriptors after "
        "| still running 1 s after the clients left |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in reports:
        print(
            f"| {r.system} | {r.upgrade} | {r.connect} | {r.http09} | {'yes' if r.flood_then_served else 'no'} "
            f"| {r.flood_fds_after} | {r.left_running_after_1s} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.probes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", choices=SYSTEMS, default=None)
    p.add_argument("--fd-limit", type=int, default=1024)
    p.add_argument("--flood", type=int, default=2000)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--wait-secs", type=float, default=12.0, help="how long a probe waits for an answer and a close")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    systems = [s for s in SYSTEMS if (s != "smg" or smg_launch() is not None) and (not args.only or s in args.only)]
    workdir = Path(tempfile.mkdtemp(prefix="atomesh-bench-probes-"))
    print(f"logs in {workdir}", flush=True)
    engine_port = free_port()
    engine = start(
        [
            sys.executable,
            "-m",
            "engine.openai_server",
            "--model",
            "tiny-random",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--server-port",
            str(engine_port),
            "--num-kvcache-blocks",
            "4096",
            "--torch-threads",
            "1",
        ],
        workdir / "engine.log",
    )
    engine_url = f"http://127.0.0.1:{engine_port}"
    reports: list[Report] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(engine_url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise SystemExit(f"the engine did not start; see {workdir}") from None
                time.sleep(0.3)
        for system in systems:
            reports.append(run_system(system, args, workdir, engine_url))
            print(f"{system}: done", flush=True)
    finally:
        stop(engine)
    print_reports(reports, args)
    if args.json is not None:
        out: dict[str, Any] = {
            "settings": vars(args) | {"json": str(args.json)},
            "reports": [asdict(r) for r in reports],
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
