"""Instructions per request of the gateway, side by side with SMG, counted by callgrind (load-independent).

`python -m bench.gateway.instructions [--json docs/results/gateway-instructions.json]`

Wall-clock figures on a shared machine move by 10-30 % from run to run; the instructions a gateway
executes per request do not depend on the load beside it. One run starts one fast mock worker
(`atomesh.testing.fast_mock`: small JSON answers; streams of 32 SSE events 5 ms apart, as an engine's
decode steps are spaced), then puts each gateway (atomesh, one process; SMG) in front of it under
`valgrind --tool=callgrind`, twice: at `--log-level warn` (no access log) and at the default `info`
(atomesh writes its access log line per request, SMG its two request lines). After a warm-up, each
phase is bracketed by `callgrind_control --dump` (counts since the previous dump; an idle gateway
executes next to nothing between phases), and divided by its request count:

- `small`: `--requests` small non-streamed completions from 16 keep-alive connections at once, at `warn`;
- `small_info_log`: the same at `info` (the access log on: the default);
- `small_c1`: the same at `info` from one connection, one request after the other;
- `spaced_stream`: `--streams` streamed completions of 32 events 5 ms apart, one after the other, at `info`;
- `spaced_stream_warn`: the same at `warn`.

Then each gateway runs natively (no valgrind) for the same phases: CPU seconds of its process tree
from /proc per request and requests/s, printed and written beside the counts (noisy here; the counts
are the measure). Gateways alternate their order between the two log levels. It prints and writes
JSON; it never asserts.

SMG's counts with 16 connections move between runs (its idle tokio workers spin for as long as
valgrind's one-at-a-time scheduling lets them): `--only smg smg-1w` adds SMG with one worker thread,
whose counts hold. docs/performance.md has the figures. User-space instructions only: callgrind does
not see the kernel (socket writes cost the same syscalls for both gateways).
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.gateway import help_formatter
from bench.gateway.gateway import tree_cpu
from bench.gateway.procs import free_port, smg_launch, start, stop

PROMPT = "Say hello in a few words."
SMALL = json.dumps({"model": "mock-model", "prompt": PROMPT, "max_tokens": 16}, separators=(",", ":"))
STREAM = json.dumps({"model": "mock-model", "prompt": PROMPT, "max_tokens": 32, "stream": True}, separators=(",", ":"))
EVENTS = 32
INTERVAL_MS = 5.0
# Streams in flight. One: a gateway under valgrind runs ~50x slower, and with more streams it would fall
# behind the 5 ms pace and read several events at once, which makes a slower gateway look cheaper.
STREAM_CLIENTS = 1
SMALL_CLIENTS = 16  # connections sending small requests at once
# smg-1w: SMG with one tokio worker thread (TOKIO_WORKER_THREADS=1). Under valgrind, whose threads run one
# at a time, SMG's idle workers spin for as long as the scheduler lets them, so its counts move with the
# machine's load between runs; with one worker there is no other worker to spin.
SYSTEMS = ("atomesh", "smg", "smg-1w")
ATOMESH_PATH: str | None = None  # PYTHONPATH of the atomesh gateway (--atomesh-tree); None: this tree


@dataclass(frozen=True, slots=True)
class Load:
    """One phase's traffic: `n` small requests from `clients` connections, or `n` streams `STREAM_CLIENTS`
    at a time."""

    key: str
    stream: bool
    n: int
    clients: int = SMALL_CLIENTS


def _post(port: int, body: str, timeout: float = 60.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _small(port: int, n: int, clients: int = 1) -> None:
    errors: list[str] = []

    def client(count: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for _ in range(count):
                conn.request("POST", "/v1/completions", body=SMALL, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    errors.append(f"small request answered {resp.status}: {data[:200]!r}")
                    return
        except OSError as e:
            errors.append(str(e))
        finally:
            conn.close()

    _threads(client, n, clients)
    if errors:
        raise RuntimeError(errors[0])


def _threads(client: Callable[[int], None], n: int, clients: int) -> None:
    threads = [threading.Thread(target=client, args=(n // clients + (i < n % clients),)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _streams(port: int, n: int) -> None:
    errors: list[str] = []

    def client(count: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for _ in range(count):
                conn.request("POST", "/v1/completions", body=STREAM, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                events = data.count(b"data: ")
                if resp.status != 200 or events != EVENTS + 1:  # + [DONE]
                    errors.append(f"stream answered {resp.status} with {events} events")
                    return
        except OSError as e:
            errors.append(str(e))
        finally:
            conn.close()

    _threads(client, n, STREAM_CLIENTS)
    if errors:
        raise RuntimeError(errors[0])


def drive(port: int, load: Load) -> None:
    if load.stream:
        _streams(port, load.n)
    else:
        _small(port, load.n, load.clients)


def wait_serving(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll with a real request until it answers 200 (the worker is registered)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            status, data = _post(port, SMALL, timeout=10)
            if status == 200:
                return
            last = f"{status} {data[:200]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    raise RuntimeError(f"gateway not serving after {timeout:g}s: {last}")


def gateway_command(system: str, worker: str, port: int, mport: int, level: str) -> list[str]:
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(mport),
        "--log-level",
        level,
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--worker-urls",
        worker,
    ]
    if system.startswith("smg"):
        smg = smg_launch()
        if smg is None:
            raise SystemExit("smg is not installed (pip install smg): nothing to compare with")
        return [*smg, *common]
    return [sys.executable, "-m", "atomesh", "launch", *common]


def _cwd(system: str) -> Path | None:
    # `python -m` looks in the working directory first: the tree's own, for the tree's code to run.
    return Path(ATOMESH_PATH) if system == "atomesh" and ATOMESH_PATH else None


def _env(system: str) -> dict[str, str]:
    # Set here, not with `env` in the command: valgrind follows no exec.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if system == "atomesh" and ATOMESH_PATH:
        env["PYTHONPATH"] = ATOMESH_PATH
    if system == "smg-1w":
        env["TOKIO_WORKER_THREADS"] = "1"
    return env


def _dump(pid: int) -> None:
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, stdout=subprocess.DEVNULL, timeout=120)


def _totals(prefix: str) -> list[int]:
    """Instructions of each dump of one callgrind run, in order (dump 1 is start-up and warm-up)."""
    files = sorted(glob.glob(prefix + ".*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    out = []
    for f in files:
        with open(f) as fh:
            out.append(next(int(line.split()[1]) for line in fh if line.startswith("totals:")))
    return out


def count(
    system: str, level: str, loads: list[Load], worker: str, workdir: Path, warmup: int, startup_timeout: float
) -> dict[str, float]:
    """Instructions per request of each load, one gateway under callgrind."""
    port, mport = free_port(), free_port()
    out = workdir / f"cg-{system}-{level}"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        *gateway_command(system, worker, port, mport, level),
    ]
    env_log = workdir / f"{system}-{level}-callgrind.log"
    proc = start(cmd, env_log, _env(system), _cwd(system))
    try:
        wait_serving(port, proc, startup_timeout)
        _small(port, warmup, SMALL_CLIENTS)
        _streams(port, STREAM_CLIENTS)
        time.sleep(0.5)
        _dump(proc.pid)
        for load in loads:
            drive(port, load)
            time.sleep(0.2)  # the last answers' bookkeeping (access log lines) is counted with its phase
            _dump(proc.pid)
    finally:
        stop(proc, grace=30)
    totals = _totals(str(out))
    return {load.key: totals[i + 1] / load.n for i, load in enumerate(loads)}


def native(
    system: str, level: str, loads: list[Load], worker: str, workdir: Path, scale: int
) -> dict[str, dict[str, float]]:
    """CPU seconds per request (process tree, /proc) and requests/s of each load, without valgrind."""
    port, mport = free_port(), free_port()
    proc = start(
        gateway_command(system, worker, port, mport, level),
        workdir / f"{system}-{level}-native.log",
        _env(system),
        _cwd(system),
    )
    result: dict[str, dict[str, float]] = {}
    try:
        wait_serving(port, proc, 60)
        _small(port, 200)
        for load in loads:
            n = load.n * (scale if not load.stream else max(1, scale // 4))
            big = Load(load.key, load.stream, n, load.clients)
            cpu0, t0 = tree_cpu(proc.pid), time.perf_counter()
            drive(port, big)
            t1 = time.perf_counter()
            time.sleep(0.1)
            cpu1 = tree_cpu(proc.pid)
            result[load.key] = {
                "cpu_us_per_request": round((cpu1 - cpu0) / n * 1e6, 1),
                "requests_per_s": round(n / (t1 - t0), 1),
            }
    finally:
        stop(proc)
    return result


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.instructions", description=__doc__, formatter_class=help_formatter
    )
    p.add_argument("--requests", type=int, default=800, help="small requests per phase under callgrind")
    p.add_argument("--streams", type=int, default=12, help="spaced streams per phase under callgrind")
    p.add_argument(
        "--native-scale", type=int, default=10, help="the native (CPU, req/s) phases run this many times the requests"
    )
    p.add_argument("--only", nargs="+", choices=SYSTEMS, default=["atomesh", "smg"])
    p.add_argument("--no-native", action="store_true", help="skip the native CPU / req/s pass")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a gateway under valgrind may take")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--atomesh-tree",
        type=Path,
        default=None,
        help="run atomesh from this source tree (e.g. a `git archive` of an older commit): an A/B",
    )
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not installed: apt-get install valgrind")
    if args.atomesh_tree is not None:
        global ATOMESH_PATH
        ATOMESH_PATH = str(args.atomesh_tree.resolve())
    workdir = Path(tempfile.mkdtemp(prefix="atomesh-instructions-"))
    mport = free_port()
    mock = start(
        [
            sys.executable,
            "-m",
            "atomesh.testing.fast_mock",
            "--port",
            str(mport),
            "--stream-chunks",
            str(EVENTS),
            "--event-interval-ms",
            str(INTERVAL_MS),
        ],
        workdir / "mock.log",
    )
    worker = f"http://127.0.0.1:{mport}"
    levels = {
        "warn": [Load("small", False, args.requests), Load("spaced_stream_warn", True, args.streams)],
        "info": [
            Load("small_info_log", False, args.requests),
            Load("small_c1", False, args.requests // 2, 1),
            Load("spaced_stream", True, args.streams),
        ],
    }
    counts: dict[str, dict[str, float]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for k, (level, loads) in enumerate(levels.items()):
            order = args.only if k % 2 == 0 else list(reversed(args.only))  # alternate who goes first
            for system in order:
                print(f"# {system} at --log-level {level} under callgrind ...", flush=True)
                for key, ir in count(system, level, loads, worker, workdir, 100, args.startup_timeout).items():
                    counts.setdefault(key, {})[system] = round(ir)
                if not args.no_native:
                    for key, v in native(system, level, loads, worker, workdir, args.native_scale).items():
                        cpu.setdefault(key, {})[system] = v
    finally:
        stop(mock)
    print(f"\ninstructions per request (callgrind, user space; workdir {workdir})")
    both = "atomesh" in args.only and "smg" in args.only
    print(f"{'phase':<22}" + "".join(f"{s:>14}" for s in args.only) + ("   atomesh/smg" if both else ""))
    order = ("small", "small_info_log", "small_c1", "spaced_stream", "spaced_stream_warn")
    for key in order:
        row = counts.get(key, {})
        ratio = f"{row['atomesh'] / row['smg']:>14.2f}x" if "atomesh" in row and row.get("smg") else ""
        print(f"{key:<22}" + "".join(f"{row.get(s, 0):>14,.0f}" for s in args.only) + ratio)
    if cpu:
        print("\nnative: CPU us per request (process tree, /proc, 10 ms ticks) and requests/s (noisy)")
        for key in order:
            measured = cpu.get(key, {})
            print(
                f"{key:<22}"
                + "".join(
                    f"  {s}: {v['cpu_us_per_request']:>7.1f} us {v['requests_per_s']:>8.1f}/s"
                    for s, v in measured.items()
                )
            )
    doc: dict[str, object] = {k: counts[k] for k in order if k in counts}
    doc["ratios"] = {k: round(v["atomesh"] / v["smg"], 3) for k, v in counts.items() if "atomesh" in v and v.get("smg")}
    doc["native"] = cpu
    doc["settings"] = {
        "requests": args.requests,
        "small_clients": SMALL_CLIENTS,
        "streams": args.streams,
        "stream_events": EVENTS,
        "event_interval_ms": INTERVAL_MS,
        "stream_clients": STREAM_CLIENTS,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python -m bench.gateway.instructions " + " ".join(argv or sys.argv[1:]),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
