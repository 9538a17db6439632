"""The gateway's CPU per request with `--enable-trace` against without it: `python -m bench.gateway.tracing`.

One mock worker and two gateway processes beside each other, one without tracing and one with
`--enable-trace` exporting to an OTLP/gRPC receiver in this process. Each of `--rounds` rounds sends
`--requests` completions (`--concurrency` at a time) to one gateway, then to the other, so that what
else the machine runs weighs on both alike. Each gateway's CPU time per request (user + system of all
its threads and of its OTLP sender process, from /proc; and of the gateway process alone) is
compared; the target is at most 10% more with tracing. It prints (and writes `--json`); it never
asserts. `--instructions N` first counts each gateway's instructions per request under callgrind (the
gateway process's threads; its sender process is not counted there), which the machine's other load
does not move: the steadier measure on a shared box.

`--hooks N` counts, under callgrind, only what tracing adds to a request in the gateway process: the
request path's tracing calls (start, the admission, attempt and upstream spans, the traceparent put in
the worker's request and that request's head written, the record added to the batch, the batch
shipped) as the gateway makes them for this benchmark's requests, N times, without HTTP around them:
tracing off, on but the request not sampled, sampled with the compiled recorder and with Python's.

`--sender N` measures the sender process alone: N requests' records (as `Tracing` makes them for this
benchmark's requests) in the frames the gateway would hand it, replayed at the rate the gateway makes
them, its compiled encoder's rounds alternating with Python's (the sender falls back to Python when it
finds no C compiler: the replay gives it none); with `--instructions`, also counted under callgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway.gateway import tree_cpu
from bench.gateway.procs import free_port, gateway_argv, start, stop

# A batch of spans leaves on the exporter's schedule (OTEL_BSP_SCHEDULE_DELAY, 5 s by default) when it
# is not full: the instruction counts wait that long so that each phase's export is counted in it.
EXPORT_WAIT_SECS = 6.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receiver() -> tuple[Any, str, list[int]]:
    """An OTLP/gRPC trace receiver counting the spans it is sent."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
            count[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)  # type: ignore[no-untyped-call]
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}", count


async def load(url: str, requests: int, concurrency: int) -> None:
    body = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}
    todo = iter(range(requests))

    async def client(s: aiohttp.ClientSession) -> None:
        for _ in todo:
            async with s.post(url, json=body) as r:
                await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(concurrency)))


async def ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def instructions(endpoint: str, requests: int) -> dict[str, float]:
    """Instructions per request of each gateway (every thread), counted by callgrind (load-independent)."""
    from bench.gateway.instructions import _dump, _small, _totals, wait_serving

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mport = free_port()
        mock = start([sys.executable, "-m", "atomesh.testing.fast_mock", "--port", str(mport)], Path(tmp) / "m.log")
        try:
            for name, extra in (("off", []), ("on", ["--enable-trace", "--otlp-traces-endpoint", endpoint])):
                port, prefix = free_port(), Path(tmp) / f"cg-{name}"
                gw = start(
                    [
                        "valgrind",
                        "--tool=callgrind",
                        f"--callgrind-out-file={prefix}",
                        *gateway_argv(port, f"http://127.0.0.1:{mport}", *extra),
                    ],
                    Path(tmp) / f"{name}-callgrind.log",
                    {**os.environ, "PYTHONHASHSEED": "0"},
                )
                try:
                    wait_serving(port, gw, 300)
                    _small(port, 300, 16)  # warm up
                    time.sleep(EXPORT_WAIT_SECS)
                    _dump(gw.pid)
                    _small(port, requests, 16)
                    time.sleep(EXPORT_WAIT_SECS)
                    _dump(gw.pid)
                finally:
                    stop(gw, grace=30)
                out[name] = _totals(str(prefix))[1] / requests
        finally:
            stop(mock)
    return out


async def frames(requests: int, per_frame: int) -> list[bytes]:
    """Frames of `per_frame` requests' records as the gateway hands them to its sender: each request as the
    benchmark's (admission, an attempt, its upstream leg), recorded through `Tracing` itself."""
    from types import SimpleNamespace

    from atomesh.request import Route
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import UPSTREAM, Tracing

    tracing = Tracing("127.0.0.1:9")  # nothing listens: its frames are taken before they reach its sender
    out: list[bytes] = []
    tracing.exporter.send = lambda frame, spans: out.append(frame)  # type: ignore[method-assign]
    worker = "http://127.0.0.1:8000"
    for i in range(requests):
        exchange = SimpleNamespace(headers={}, request_id=f"{i:08x}", trace=None, status=200)
        trace = tracing.start(exchange)  # type: ignore[arg-type]
        assert trace is not None
        trace.admission("mock-model", PriorityClass.DEFAULT, "anonymous")
        trace.end()
        trace.attempt(0, "first", ("round_robin",), (worker,))
        trace.leg(UPSTREAM, worker)
        trace.end()
        trace.end()
        tracing.finish(trace, Route.COMPLETIONS, exchange)  # type: ignore[arg-type]
        if (i + 1) % per_frame == 0:
            tracing.ship()
    tracing.shutdown()
    return out


def replay(
    endpoint: str, spans: list[int], sent: list[bytes], every_s: float, native: bool, callgrind: Path | None = None
) -> float:
    """The sender process's CPU seconds for `sent`, one frame every `every_s` (its start-up not counted), or
    with `callgrind` (an output file prefix) its instructions, counted by callgrind (every thread).
    `native` false: its compiler made unavailable, so it encodes in Python (its fallback)."""
    from atomesh.otlp import exporter_settings
    from bench.gateway.instructions import _dump, _totals

    settings = exporter_settings(endpoint)
    config = {
        "target": settings.target,
        "secure": False,
        "headers": [],
        "gzip": False,
        "timeout_s": settings.timeout_s,
        "max_batch": settings.max_batch,
        "resource": settings.resource,
    }
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if not native:
            env.update(CC="/nonexistent/cc", XDG_CACHE_HOME=cache)
        argv = [sys.executable, "-m", "atomesh.otlp_sender", json.dumps(config)]
        if callgrind is not None:
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *argv]
        sender = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, stderr=subprocess.DEVNULL)
        assert sender.stdin is not None
        want = spans[0] + frame_spans(sent[0])
        sender.stdin.write(sent[0])  # warm up: start-up and the first frame not counted
        sender.stdin.flush()
        while spans[0] < want:
            time.sleep(0.01)
        if callgrind is not None:
            _dump(sender.pid)
        before = cpu_seconds(sender.pid)
        for frame in sent:
            sender.stdin.write(frame)
            sender.stdin.flush()
            want += frame_spans(frame)
            time.sleep(every_s)
        deadline = time.monotonic() + 60
        while spans[0] < want and time.monotonic() < deadline:
            time.sleep(0.01)
        took = cpu_seconds(sender.pid) - before
        if callgrind is not None:
            _dump(sender.pid)
        sender.stdin.close()
        sender.wait(60)
    if callgrind is not None:
        return float(_totals(str(callgrind))[1])
    return took


def frame_spans(frame: bytes) -> int:
    """The spans of a frame the gateway hands its sender."""
    import marshal

    from atomesh.otlp import records

    _, _, items = marshal.loads(frame[4:])
    return sum(spans for _, _, spans in records(items))


HOOKS = ("off", "not_sampled", "compiled", "python")


def hooks_phase() -> None:
    """The child of `--hooks` (argv: mode, requests, warm-up requests): the request path's tracing calls for
    `requests` requests after `warm-up` ones, a line on stdout and one read from stdin around them (the
    parent dumps callgrind's counts then)."""
    mode, n, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if mode == "not_sampled":
        os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
    from collections.abc import Mapping
    from dataclasses import dataclass

    from atomesh.httpclient import _encode
    from atomesh.request import Route
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import UPSTREAM, PyRecorder, Tracing
    from atomesh.transport import Exchange, Upstream

    class Client(Exchange):
        def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
            pass

        async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
            pass

        async def write(self, data: bytes) -> None:
            pass

        async def end(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class Worker:
        url: str
        api_key: str | None = None

    tracing = Tracing(None if mode == "off" else "127.0.0.1:9", recorder=PyRecorder() if mode == "python" else None)
    if tracing.on:
        tracing.exporter.send = lambda frame, spans: None  # type: ignore[method-assign]
    upstream = Upstream(10.0, hop="bench", tracing=tracing)
    worker = Worker("http://127.0.0.1:8000")
    policies, body = ("round_robin",), b'{"model":"mock-model","prompt":"hello","max_tokens":4}'

    async def requests(count: int) -> None:
        # What the request path has at hand anyway (an Enum's class attribute is slow to look up).
        cls, route = PriorityClass.DEFAULT, Route.COMPLETIONS
        for i in range(count):
            exchange = Client(f"{i:08x}", {"host": "127.0.0.1", "content-type": "application/json"})
            # openai._serve, router.serve and SingleBackend.forward, as they call the tracer.
            trace = tracing.start(exchange) if tracing.on else None
            if trace is not None:
                trace.admission("mock-model", cls, "anonymous")
                trace.end()
            exchange.workers = (worker.url,)
            trace = exchange.trace
            if trace is not None:
                trace.attempt(0, "first", policies, exchange.workers)
                trace.leg(UPSTREAM, worker.url)
            _encode("POST", "/v1/completions", "127.0.0.1:8000", upstream.headers_for(exchange, worker), body)
            if trace is not None:
                trace.end()
                trace.end()
            exchange.status = 200
            if trace is not None:
                tracing.finish(trace, route, exchange)
        if tracing.on:
            tracing.ship()

    async def phases() -> None:
        await requests(warm)
        print("ready", flush=True)
        sys.stdin.readline()
        await requests(n)
        print("ready", flush=True)
        sys.stdin.readline()

    asyncio.run(phases())
    tracing.shutdown()


def hooks(n: int) -> dict[str, float]:
    """Instructions per request of `hooks_phase` in each mode of HOOKS, counted by callgrind."""
    from bench.gateway.instructions import _dump, _totals

    out: dict[str, float] = {}
    code = "from bench.gateway.tracing import hooks_phase; hooks_phase()"
    for mode in HOOKS:
        with tempfile.TemporaryDirectory() as tmp:
            prefix = f"{tmp}/cg"
            child = subprocess.Popen(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={prefix}", sys.executable, "-c", code, mode,
                 str(n), str(max(n // 2, 1024))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )  # fmt: skip
            assert child.stdin is not None and child.stdout is not None
            for _ in range(2):
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"--hooks {mode}: the child stopped (exit {child.wait()})")
                _dump(child.pid)
                child.stdin.write("\n")
                child.stdin.flush()
            child.wait(120)
            out[mode] = _totals(prefix)[1] / n
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.tracing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=3000, help="completions per gateway and round")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds, each loading one gateway then the other (the machine's other load shared out)",
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--instructions",
        type=int,
        default=0,
        metavar="N",
        help="also count instructions per request under callgrind over N requests (needs valgrind)",
    )
    p.add_argument(
        "--sender",
        type=int,
        default=0,
        metavar="N",
        help="only replay N requests' frames into the sender process, compiled encoder and Python's alternating "
        "(with --instructions, also counted under callgrind)",
    )
    p.add_argument(
        "--hooks",
        type=int,
        default=0,
        metavar="N",
        help="only count, under callgrind, the request path's tracing calls for N requests: off, not sampled, "
        "sampled with the compiled recorder and with Python's (needs valgrind)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.hooks:
        calls = hooks(args.hooks)
        print(
            f"tracing's calls on the request path, instructions per request (callgrind, {args.hooks} requests): "
            + ", ".join(f"{mode} {v:,.0f}" for mode, v in calls.items())
            + "; added to a request: "
            + ", ".join(f"{mode} +{calls[mode] - calls['off']:,.0f}" for mode in HOOKS[1:])
        )
        if args.json is not None:
            args.json.write_text(json.dumps(calls, indent=2))
        return
    server, endpoint, spans = receiver()
    if args.sender:
        sender_only(args, endpoint, spans)
        server.stop(0)
        return
    counted: dict[str, float] = {}
    if args.instructions:
        counted = instructions(endpoint, args.instructions)
        print(
            f"gateway instructions per request (callgrind, {args.instructions} requests): tracing off "
            f"{counted['off']:,.0f}, on {counted['on']:,.0f} ({counted['on'] / counted['off']:.2f}x)"
        )
    cpu = {"off": 0.0, "on": 0.0}  # the gateway's process tree: with tracing, its OTLP sender too
    own = {"off": 0.0, "on": 0.0}  # the gateway process alone
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        mport = free_port()
        mock = start([sys.executable, "-m", "atomesh.testing.mock_worker", "--port", str(mport)], Path(tmp) / "m.log")
        gateways: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            asyncio.run(ready(f"http://127.0.0.1:{mport}/health"))
            for name, extra in (("off", []), ("on", ["--enable-trace", "--otlp-traces-endpoint", endpoint])):
                port = free_port()
                gateways[name] = (
                    start(gateway_argv(port, f"http://127.0.0.1:{mport}", *extra), Path(tmp) / f"{name}.log"),
                    f"http://127.0.0.1:{port}",
                )
            for _, url in gateways.values():
                asyncio.run(ready(url + "/readiness"))
                asyncio.run(load(url + "/v1/completions", 500, args.concurrency))  # warm up
            for _ in range(args.rounds):
                took = {}
                for name, (gw, url) in gateways.items():
                    before, own_before = tree_cpu(gw.pid), cpu_seconds(gw.pid)
                    asyncio.run(load(url + "/v1/completions", args.requests, args.concurrency))
                    took[name] = tree_cpu(gw.pid) - before
                    cpu[name] += took[name]
                    own[name] += cpu_seconds(gw.pid) - own_before
                ratios.append(took["on"] / took["off"])
        finally:
            for gw, _ in gateways.values():
                stop(gw)
            stop(mock)
            time.sleep(0.5)
            server.stop(0)
    n = args.requests * args.rounds
    per = {k: v / n for k, v in cpu.items()}
    ratio = per["on"] / per["off"]
    median = statistics.median(ratios)
    sender = (cpu["on"] - own["on"]) / n
    print(
        f"gateway CPU per request over {args.rounds} rounds of {args.requests}, its OTLP sender process included: "
        f"tracing off {per['off'] * 1e6:.0f} us, on {per['on'] * 1e6:.0f} us ({ratio:.2f}x, median round "
        f"{median:.2f}x; target <= 1.10x; rounds {', '.join(f'{r:.2f}' for r in ratios)}); the gateway process "
        f"alone: {own['on'] / n * 1e6:.0f} us ({own['on'] / own['off']:.2f}x), the sender {sender * 1e6:.1f} us; "
        f"spans received: {spans[0]}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    **{f"cpu_us_{k}": v * 1e6 for k, v in per.items()},
                    "ratio": ratio,
                    "median_round_ratio": median,
                    "sender_cpu_us": sender * 1e6,
                    "gateway_process_ratio": own["on"] / own["off"],
                    "round_ratios": ratios,
                    "spans": spans[0],
                    **{f"instructions_{k}": v for k, v in counted.items()},
                },
                indent=2,
            )
        )


def sender_only(args: argparse.Namespace, endpoint: str, spans: list[int]) -> None:
    """The sender's CPU per request for the same frames, the compiled encoder's rounds alternating with
    Python's, one frame each `per_frame` requests at the rate the gateway's load makes them."""
    from atomesh.otlp import exporter_settings

    settings = exporter_settings(endpoint)
    per_frame = max(settings.max_batch, settings.max_queue // 2) // 4  # Tracing's hand-over: 4 spans a request
    sent = asyncio.run(frames(args.sender, per_frame))
    every_s = per_frame * 130e-6  # a frame per per_frame requests at 130 us of gateway CPU each
    took: dict[str, list[float]] = {"native": [], "python": []}
    for _ in range(args.rounds):
        for name in took:
            took[name].append(replay(endpoint, spans, sent, every_s, name == "native") / args.sender * 1e6)
    med = {k: statistics.median(v) for k, v in took.items()}
    counted: dict[str, float] = {}
    if args.instructions:
        with tempfile.TemporaryDirectory() as tmp:
            for name in took:
                prefix = Path(tmp) / f"sender-{name}"
                counted[name] = replay(endpoint, spans, sent, every_s, name == "native", prefix) / args.sender
        print(
            f"sender instructions per request (callgrind, every thread): compiled encoder {counted['native']:,.0f}, "
            f"Python encoder {counted['python']:,.0f} ({counted['native'] / counted['python']:.2f}x)"
        )
    print(
        f"sender CPU per request ({args.sender} requests in frames of {per_frame}, export calls of at most "
        f"{settings.max_batch} spans, {args.rounds} alternating rounds): compiled encoder {med['native']:.1f} us, "
        f"Python encoder {med['python']:.1f} us ({med['native'] / med['python']:.2f}x); rounds "
        + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in took.items())
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"per_frame": per_frame, "max_batch": settings.max_batch, "cpu_us": took, "instructions": counted},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
