"""Gateway overhead, side by side with SMG: `python -m bench.gateway.gateway` (`--help` lists options).

One run starts fast mock workers once (`atomesh.testing.fast_mock`, separate processes: two regular
workers, one prefill and one decode), then puts each gateway in front of them in turn, alternating
the order every round, under the same load from `wrk` (Debian's `wrk`, C, one thread), and prints
medians over the rounds with ratios atomesh / SMG:

(a) requests/s, p50 and p99 latency of small non-streamed completions at 1, 32 and 256 clients;
(b) SSE chunks/s relayed for 256-chunk streamed completions at 32 concurrent streams;
(c) gateway CPU seconds per 10,000 requests (utime + stime of the gateway's process tree from
    /proc, read around each phase);
(d) added latency: gateway p50 at 1 client minus the worker's own p50 called directly;
(e) all of it again in P/D mode: atomesh's ATOM relay (`--backend atom`, prefill then decode) and
    atomesh's SGLang dual dispatch (`--backend sglang`) vs SMG's P/D mode (SGLang dual dispatch; SMG
    has no ATOM relay).

The load generator's own CPU (wrk's rusage) and the mocks' CPU are printed with each phase, so a
saturated client or mock shows. It prints; it never asserts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.gateway import help_formatter
from bench.gateway.procs import free_port, loopback_flags, smg_launch, start, stop

STREAM_CHUNKS = 256
TOKENS = 16
PROMPT = "Say hello in a few words."
SMALL_BODY = json.dumps({"model": "mock-model", "prompt": PROMPT, "max_tokens": TOKENS}, separators=(",", ":"))
STREAM_BODY = json.dumps(
    {"model": "mock-model", "prompt": PROMPT, "max_tokens": STREAM_CHUNKS, "stream": True}, separators=(",", ":")
)
# What a P/D gateway sends each leg, for the direct (no gateway) baseline of the ATOM relay.
_KV_DECODE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [0, 1],
    "remote_engine_id": "x",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_handshake_port": 2,
    "transfer_id": "mock",
    "first_token_id": 7,
    "remote_dp_size": 1,
    "remote_tp_size": 1,
    "remote_dp_rank": 0,
}
PREFILL_BODY = json.dumps(
    {
        "model": "mock-model",
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    },
    separators=(",", ":"),
)
DECODE_BODY = json.dumps(
    {"model": "mock-model", "prompt": PROMPT, "max_tokens": TOKENS, "kv_transfer_params": _KV_DECODE},
    separators=(",", ":"),
)
PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Phase:
    """One load step: `clients` connections sending `body` for the phase's duration."""

    name: str
    clients: int
    body: str
    stream: bool = False


PHASES = (
    Phase("c1", 1, SMALL_BODY),
    Phase("c32", 32, SMALL_BODY),
    Phase("c256", 256, SMALL_BODY),
    Phase("stream32", 32, STREAM_BODY, stream=True),
)


@dataclass(slots=True)
class Sample:
    """What one phase measured."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    errors: int
    gateway_cpu_s: float = 0.0
    wrk_cpu_s: float = 0.0
    mocks_cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass(slots=True)
class Results:
    """Samples by (mode, system, phase), one per round."""

    samples: dict[str, list[Sample]] = field(default_factory=lambda: defaultdict(list))

    def add(self, mode: str, system: str, phase: str, s: Sample) -> None:
        self.samples[f"{mode}/{system}/{phase}"].append(s)

    def get(self, mode: str, system: str, phase: str) -> list[Sample]:
        return self.samples.get(f"{mode}/{system}/{phase}", [])


# ---------------------------------------------------------------------------- processes

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """utime + stime (seconds) of `pid` and its live descendants, from /proc."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        p = int(entry)
        parents[p] = int(fields[1])
        cpu[p] = (int(fields[11]) + int(fields[12])) / _TICK
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(c for c, pp in parents.items() if pp == p)
    return total


def _post(url: str, body: str, timeout: float = 5.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", PATH, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_serving(url: str, body: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Poll with a real inference request until it answers 200 (the workers are registered)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            status, data = _post(url, body)
            if status == 200:
                return
            last = f"{status} {data[:200]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise RuntimeError(f"{url} not serving after {timeout:g}s: {last}")


def count_events(url: str) -> int:
    """SSE `data:` events (less [DONE]) of one streamed answer: the gateway must relay all 256."""
    _, data = _post(url, STREAM_BODY, timeout=30)
    return data.count(b"data: ") - data.count(b"data: [DONE]")


# ---------------------------------------------------------------------------- load
_LUA = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {{"requests":%d,"duration_us":%d,"p50":%d,"p99":%d,"mean":%f,"errors":%d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def run_wrk(
    url: str, phase: Phase, seconds: int, workdir: Path, watch: list[int], mocks: list[int], body: str | None = None
) -> Sample:
    """One wrk run; CPU of the `watch` pids (the gateway) and of the mocks is read around it."""
    script = workdir / f"{phase.name}-{abs(hash(body or phase.body))}.lua"
    script.write_text(_LUA.format(body=body or phase.body))
    cmd = ["wrk", "-t1", f"-c{phase.clients}", f"-d{seconds}s", "--timeout", "30s", "-s", str(script), url + PATH]
    gw0 = sum(tree_cpu(p) for p in watch)
    m0 = sum(tree_cpu(p) for p in mocks)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    gw1 = sum(tree_cpu(p) for p in watch)
    m1 = sum(tree_cpu(p) for p in mocks)
    line = next((x for x in out.decode(errors="replace").splitlines() if x.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {out.decode(errors='replace')[-500:]}")
    r = json.loads(line.removeprefix("WRKJSON "))
    return Sample(
        requests=r["requests"],
        seconds=r["duration_us"] / 1e6,
        p50_ms=r["p50"] / 1e3,
        p99_ms=r["p99"] / 1e3,
        mean_ms=r["mean"] / 1e3,
        errors=r["errors"],
        gateway_cpu_s=gw1 - gw0,
        wrk_cpu_s=usage.ru_utime + usage.ru_stime,
        mocks_cpu_s=m1 - m0,
    )


# ---------------------------------------------------------------------------- systems
@dataclass(frozen=True, slots=True)
class Mocks:
    regular: list[str]
    prefill: str
    bootstrap_port: int
    decode: str
    pids: list[int]


def gateway_command(
    system: str, mode: str, mocks: Mocks, port: int, mport: int, policy: str, extra: list[str]
) -> list[str]:
    common = loopback_flags(port, mport, policy)
    if mode == "regular":
        workers = ["--worker-urls", *mocks.regular]
    else:
        workers = [
            "--pd-disaggregation",
            "--prefill",
            mocks.prefill,
            str(mocks.bootstrap_port),
            "--decode",
            mocks.decode,
        ]
    if system == "smg":
        smg = smg_launch()
        assert smg is not None
        return [*smg, *common, *workers]
    base, _, processes = system.partition("-x")  # "atomesh-x2": atomesh with --processes 2
    backend = ["--backend", "sglang" if base == "atomesh-sglang" else "atom"] if mode == "pd" else []
    many = ["--processes", processes] if processes else []
    return [sys.executable, "-m", "atomesh", "launch", *common, *workers, *backend, *many, *extra]


def start_mocks(workdir: Path) -> tuple[Mocks, list[subprocess.Popen[bytes]]]:
    procs, urls = [], []
    bootstrap = free_port()
    for name, role in (("r0", "regular"), ("r1", "regular"), ("p0", "prefill"), ("d0", "decode")):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "atomesh.testing.fast_mock",
            "--port",
            str(port),
            "--name",
            name,
            "--role",
            role,
            "--tokens",
            str(TOKENS),
            "--stream-chunks",
            str(STREAM_CHUNKS),
        ]
        if role == "prefill":
            cmd += ["--bootstrap-port", str(bootstrap)]
        procs.append(start(cmd, workdir / f"mock-{name}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for u, body in zip(urls, (SMALL_BODY, SMALL_BODY, PREFILL_BODY, DECODE_BODY), strict=True):
        _wait_serving(u, body, None, 20)
    return Mocks(urls[:2], urls[2], bootstrap, urls[3], [p.pid for p in procs]), procs


# ---------------------------------------------------------------------------- run
def systems_for(mode: str, only: list[str] | None, processes: list[int]) -> list[str]:
    """The gateways measured: atomesh as one process and as `-xN` (`--processes N`), then SMG."""
    bases = ["atomesh"] if mode == "regular" else ["atomesh", "atomesh-sglang"]
    names = [b if n == 1 else f"{b}-x{n}" for b in bases for n in processes]
    if smg_launch() is not None:
        names.append("smg")
    return [n for n in names if not only or n.partition("-x")[0] in only]


def measure_direct(mocks: Mocks, seconds: int, workdir: Path, results: Results) -> None:
    """The floor: the workers called without a gateway, at 1 client (and 32 streams)."""
    c1 = PHASES[0]
    results.add("regular", "direct", "c1", run_wrk(mocks.regular[0], c1, seconds, workdir, [], mocks.pids))
    results.add("regular", "direct", "stream32", run_wrk(mocks.regular[0], PHASES[3], seconds, workdir, [], mocks.pids))
    # ATOM relay floor: the prefill leg then the decode leg, each called directly.
    results.add(
        "pd", "direct-prefill", "c1", run_wrk(mocks.prefill, c1, seconds, workdir, [], mocks.pids, body=PREFILL_BODY)
    )
    results.add(
        "pd", "direct-decode", "c1", run_wrk(mocks.decode, c1, seconds, workdir, [], mocks.pids, body=DECODE_BODY)
    )


def run(args: argparse.Namespace) -> Results:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk; `make sysdeps` does it)")
    workdir = Path(tempfile.mkdtemp(prefix="atomesh-bench-gateway-"))
    results = Results()
    phases = [p for p in PHASES if not args.phases or p.name in args.phases]
    mocks, mock_procs = start_mocks(workdir)
    mocks = replace(mocks, regular=mocks.regular[: args.regular_workers])
    print(
        f"mock workers: regular {' '.join(mocks.regular)}, prefill {mocks.prefill} (bootstrap "
        f"{mocks.bootstrap_port}), decode {mocks.decode}; logs in {workdir}",
        flush=True,
    )
    try:
        for rnd in range(args.rounds):
            measure_direct(mocks, args.duration, workdir, results)
            for mode in args.modes:
                order = systems_for(mode, args.only, args.processes)
                if rnd % 2:
                    order.reverse()
                for system in order:
                    run_system(system, mode, mocks, phases, args, workdir, results, rnd)
    finally:
        for p in mock_procs:
            stop(p)
    report(results, args, phases)
    if args.save:
        args.save.write_text(json.dumps({k: [asdict(s) for s in v] for k, v in results.samples.items()}, indent=1))
    return results


def run_system(
    system: str,
    mode: str,
    mocks: Mocks,
    phases: list[Phase],
    args: argparse.Namespace,
    workdir: Path,
    results: Results,
    rnd: int,
) -> None:
    port, mport = free_port(), free_port()
    extra = list(args.atomesh_args.split()) if args.atomesh_args else []
    cmd = gateway_command(system, mode, mocks, port, mport, args.policy, extra if system != "smg" else [])
    proc = start(cmd, workdir / f"{system}-{mode}-{rnd}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(url, SMALL_BODY, proc, 60)
        events = count_events(url)
        if events != STREAM_CHUNKS:
            print(f"  warning: {system} {mode} relayed {events} of {STREAM_CHUNKS} events", flush=True)
        if args.warmup:
            run_wrk(url, PHASES[1], args.warmup, workdir, [], [])  # connections, first-use caches
        for phase in phases:
            s = run_wrk(url, phase, args.duration, workdir, [proc.pid], mocks.pids)
            results.add(mode, system, phase.name, s)
            print(
                f"  round {rnd + 1} {mode:<7} {system:<15} {phase.name:<9} {s.rps:>9.0f} req/s  p50 "
                f"{s.p50_ms:7.3f} ms  p99 {s.p99_ms:7.3f} ms  gw cpu {s.gateway_cpu_s / s.seconds:4.0%}  "
                f"wrk cpu {s.wrk_cpu_s / s.seconds:4.0%}  mocks cpu {s.mocks_cpu_s / s.seconds:4.0%}"
                f"{f'  errors {s.errors}' if s.errors else ''}",
                flush=True,
            )
    except RuntimeError as e:
        print(f"  {system} {mode}: skipped ({e}); log: {workdir / f'{system}-{mode}-{rnd}.log'}", flush=True)
    finally:
        stop(proc)


# ---------------------------------------------------------------------------- report
def _med(samples: list[Sample], attr: str) -> float:
    vals = [getattr(s, attr) for s in samples]
    return statistics.median(vals) if vals else float("nan")


def _cpu_per_10k(samples: list[Sample], per_chunk: bool = False) -> float:
    vals = [s.gateway_cpu_s / max(1, s.requests * (STREAM_CHUNKS if per_chunk else 1)) * 10_000 for s in samples]
    return statistics.median(vals) if vals else float("nan")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b == b and a == a else "-"


def _ratios(values: dict[str, float], peer: str | None) -> str:
    if peer is None or len(values) < 2:
        return ""
    return "   [" + ", ".join(f"{n}/{peer} {_ratio(v, values[peer])}" for n, v in values.items() if n != peer) + "]"


def report(results: Results, args: argparse.Namespace, phases: list[Phase]) -> None:
    names = [p.name for p in phases]
    print(
        f"\nmedians of {args.rounds} round(s) x {args.duration}s per phase; load: wrk -t1 (one thread); "
        f"policy {args.policy}; {args.regular_workers} regular mock(s) / 1 prefill + 1 decode mock; "
        "ratios are atomesh / smg"
    )
    for mode in args.modes:
        systems = systems_for(mode, args.only, args.processes)
        peer = "smg" if "smg" in systems else None
        print(
            "\n== regular mode"
            if mode == "regular"
            else "\n== (e) P/D mode (atomesh: ATOM relay, atomesh-sglang: SGLang dual dispatch; "
            "smg: SGLang dual dispatch)"
        )
        small = [p for p in names if p != "stream32"]
        if small:
            print("(a) non-streamed completions (16 tokens): req/s | p50 ms | p99 ms   [ratio of req/s]")
        for ph in small:
            got = {n: results.get(mode, n, ph) for n in systems}
            cells = [
                f"{n} {_med(s, 'rps'):7.0f} | {_med(s, 'p50_ms'):6.3f} | {_med(s, 'p99_ms'):7.3f}"
                for n, s in got.items()
            ]
            print(f"  {ph:<6} " + "   ".join(cells) + _ratios({n: _med(s, "rps") for n, s in got.items()}, peer))
        if "stream32" in names:
            print(f"(b) streamed chunks/s relayed ({STREAM_CHUNKS}-chunk SSE, 32 streams)")
            chunks = {n: _med(results.get(mode, n, "stream32"), "rps") * STREAM_CHUNKS for n in systems}
            direct = _med(results.get("regular", "direct", "stream32"), "rps") * STREAM_CHUNKS
            print(
                "  "
                + "   ".join(f"{n} {v:8.0f}" for n, v in chunks.items())
                + _ratios(chunks, peer)
                + (f"   (worker direct {direct:8.0f})" if mode == "regular" else "")
            )
        print("(c) gateway CPU seconds per 10,000 requests (stream32: per 10,000 chunks)")
        for ph in names:
            cpu = {n: _cpu_per_10k(results.get(mode, n, ph), ph == "stream32") for n in systems}
            print(f"  {ph:<8} " + "   ".join(f"{n} {v:6.3f}" for n, v in cpu.items()) + _ratios(cpu, peer))
        if "c1" in names:
            if mode == "regular":
                base = _med(results.get("regular", "direct", "c1"), "p50_ms")
                what = "worker called directly"
            else:
                base = _med(results.get("pd", "direct-prefill", "c1"), "p50_ms") + _med(
                    results.get("pd", "direct-decode", "c1"), "p50_ms"
                )
                what = "prefill leg + decode leg called directly, one after the other"
            print(f"(d) added latency at 1 client: p50 minus the p50 of the {what} ({base:.3f} ms)")
            print(
                "  "
                + "   ".join(
                    f"{n} {(_med(results.get(mode, n, 'c1'), 'p50_ms') - base) * 1e3:6.0f} us" for n in systems
                )
            )
        loadgen = [s for n in systems for ph in names for s in results.get(mode, n, ph)]
        if loadgen:
            print(
                f"load generator: wrk used at most {max(s.wrk_cpu_s / s.seconds for s in loadgen):.0%} of a core "
                f"(median {statistics.median(s.wrk_cpu_s / s.seconds for s in loadgen):.0%}); mocks at most "
                f"{max(s.mocks_cpu_s / s.seconds for s in loadgen):.0%} of a core in all (4 processes)"
            )
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end (shared machine: "
        "figures are noisy; compare ratios from the same run)"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.gateway", description=__doc__.split("\n")[0], formatter_class=help_formatter
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds; each alternates the order of the gateways")
    p.add_argument("--duration", type=int, default=3, help="seconds of load per phase (wrk -d)")
    p.add_argument("--warmup", type=int, default=1, help="seconds of load before measuring each gateway (0: none)")
    p.add_argument("--quick", action="store_true", help="one round of 1 s phases (a smoke run)")
    p.add_argument("--modes", nargs="+", choices=("regular", "pd"), default=["regular", "pd"])
    p.add_argument(
        "--only",
        nargs="+",
        choices=("atomesh", "atomesh-sglang", "smg"),
        default=None,
        help="gateways to measure (default: all; smg when installed)",
    )
    p.add_argument("--phases", nargs="+", choices=[ph.name for ph in PHASES], default=None)
    p.add_argument("--policy", default="round_robin", help="placement policy of every gateway")
    p.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[1, 2],
        help="atomesh process counts to measure (`atomesh-xN` runs `--processes N`)",
    )
    p.add_argument("--atomesh-args", default="", help="extra `atomesh launch` flags, one string")
    p.add_argument(
        "--regular-workers",
        type=int,
        choices=(1, 2),
        default=2,
        help="regular mock workers behind each gateway in regular mode",
    )
    p.add_argument("--save", type=Path, default=None, help="write every sample as JSON here")
    return p


def main(argv: list[str] | None = None) -> Results:
    args = parser().parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 1, 1
    return run(args)


if __name__ == "__main__":
    main()
