"""OpenTelemetry tracing end to end: a client's traceparent, the gateway's spans (request, admission,
attempt, prefill and decode legs) and both P/D engines' spans arrive at a real OTLP/gRPC receiver,
linked into one trace."""

from __future__ import annotations

import asyncio
import json
import marshal
import os
import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
import pytest
from gwtest import EngineProcess, MakeGateway, MakeWorkers, base_url, free_port, require
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_service
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as trace_grpc
from opentelemetry.proto.common.v1 import common_pb2 as trace_common

require("opentelemetry.sdk", "the tracing extra")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_grpc.TraceServiceServicer):  # type: ignore[misc]
    """An OTLP/gRPC trace receiver (the collector's protocol) keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.calls: list[int] = []  # spans in each Export call
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        with self.lock:
            self.calls.append(sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans))
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "service": service,
                                "name": s.name,
                                "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "attrs": {a.key: a.value for a in s.attributes},
                            }
                        )
        return trace_service.ExportTraceServiceResponse()

    def of(self, trace: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    r = Receiver()
    trace_grpc.add_TraceServiceServicer_to_server(r, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield r, f"127.0.0.1:{port}"
    server.stop(0)


async def test_tracing_is_off_by_default(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    assert not gw.gateway.tracing.on and gw.gateway.upstream.tracing is None


@pytest.mark.timeout(110)
async def test_one_request_is_one_trace_across_gateway_and_both_pd_engines(
    receiver: tuple[Receiver, str], gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("mooncake.engine", "P/D engines relay KV over Mooncake")
    r, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export batches every 0.1 s (default 5 s)
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100", "MC_TRANSFER_TIMEOUT": "5"}
    engine = [
        sys.executable,
        "-m",
        "engine.openai_server",
        "--model",
        "tiny-random",
        "--host",
        "127.0.0.1",
        "--num-kvcache-blocks",
        "128",
        "--torch-threads",
        "1",
        "--otlp-traces-endpoint",
        endpoint,
    ]
    engines = {
        role: EngineProcess(
            f"trace-{role}",
            [
                *engine,
                "--kv-transfer-config",
                json.dumps(
                    {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(), "staging_buffer_mb": 1}
                ),
            ],
            env,
        )
        for role in ("kv_producer", "kv_consumer")
    }
    try:
        for e in engines.values():
            e.wait_up()
        gw = await gateway(
            pd_disaggregation=True,
            backend="atom",
            prefill=[{"url": engines["kv_producer"].url}],
            decode=[engines["kv_consumer"].url],
            enable_trace=True,
            otlp_traces_endpoint=endpoint,
        )
        body = {"model": "tiny-random", "prompt": "hello there", "max_tokens": 4, "stream": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                base_url(gw) + "/v1/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
            ) as resp,
        ):
            assert resp.status == 200
            await resp.read()
        deadline = time.monotonic() + 30
        want = {"atomesh-gateway", "atomesh-engine-kv_producer", "atomesh-engine-kv_consumer"}
        while {s["service"] for s in r.of(TRACE_ID) if s["name"] == "engine.request"} | {
            "atomesh-gateway"
        } != want or not any(s["name"] == "POST /v1/completions" for s in r.of(TRACE_ID)):
            assert time.monotonic() < deadline, r.of(TRACE_ID)
            await asyncio.sleep(0.1)
    finally:
        for e in engines.values():
            e.stop()
    spans = r.of(TRACE_ID)
    by_name = {(s["service"], s["name"]): s for s in spans}
    root = by_name[("atomesh-gateway", "POST /v1/completions")]
    assert root["parent"] == CLIENT_SPAN  # under the client's span
    assert root["attrs"]["http.response.status_code"].int_value == 200
    attempt = by_name[("atomesh-gateway", "attempt")]
    admission = by_name[("atomesh-gateway", "admission")]
    assert attempt["parent"] == admission["parent"] == root["id"]
    prefill, decode = by_name[("atomesh-gateway", "prefill")], by_name[("atomesh-gateway", "decode")]
    assert prefill["parent"] == decode["parent"] == attempt["id"]
    # Each engine's request span sits under the gateway leg that called it, its phases under it.
    p_req = by_name[("atomesh-engine-kv_producer", "engine.request")]
    d_req = by_name[("atomesh-engine-kv_consumer", "engine.request")]
    assert p_req["parent"] == prefill["id"] and d_req["parent"] == decode["id"]
    assert {s["name"] for s in spans if s["parent"] == p_req["id"]} == {"queue", "prefill"}
    assert {s["name"] for s in spans if s["parent"] == d_req["id"]} == {"kv_transfer", "decode"}


def _exchange(headers: dict[str, str], request_id: str = "req-1") -> Any:
    """What the tracer reads of an Exchange: the client's headers, the request id, its workers and its
    `trace` slot."""
    return SimpleNamespace(headers=headers, request_id=request_id, trace=None, workers=("http://a",), status=200)


RECORDERS = pytest.mark.parametrize("kind", ["compiled", "python"])


def _recorder(kind: str) -> Any:
    """The gateway's trace recorder: the compiled one (built here: the tests need a C compiler and Python's
    headers) or Python's."""
    from atomesh.tracing import PyRecorder, native_recorder

    if kind == "python":
        return PyRecorder()
    recorder, why_not = native_recorder()
    assert recorder is not None, why_not
    return recorder


def _encoders() -> tuple[Any, Any]:
    """The sender's two encoders: Python's and the compiled one (built here: the tests need a C compiler)."""
    from atomesh.otlp import SpanEncoder
    from atomesh.otlp_native import NativeEncoder, build_encoder

    encoder = SpanEncoder((("service.name", "atomesh-gateway"),))
    build = build_encoder()
    assert build.library is not None, build.why_not
    return encoder, NativeEncoder(build.library, encoder.resource, encoder.scope)


def _parsed(frames: list[bytes]) -> list[Any]:
    """The spans of the frames the gateway sends its sender process, encoded as the sender encodes
    them (the compiled encoder and Python's write the same bytes), parsed with opentelemetry-proto's
    own classes."""
    encoder, native = _encoders()
    spans = []
    for frame in frames:
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        [data] = encoder.export_requests(frame[4:], 1 << 20)
        assert native.export_requests(frame[4:], 1 << 20) == [data]
        request = trace_service.ExportTraceServiceRequest()
        request.ParseFromString(data)
        [resource_spans] = request.resource_spans
        assert resource_spans.resource.attributes[0].value.string_value == "atomesh-gateway"
        [scope_spans] = resource_spans.scope_spans
        assert scope_spans.scope.name == "atomesh"
        spans += scope_spans.spans
    return spans


@RECORDERS
async def test_spans_are_written_as_the_collectors_protobuf(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The records the request path makes (with either recorder), shipped and encoded by hand, parse with
    opentelemetry-proto's own classes: every span and value intact at every length (cached or not), parents
    linked, the traceparent sent upstream naming the leg, a 5xx request span marked as an error."""
    from atomesh.otlp import key_value
    from atomesh.request import Route
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import UPSTREAM, Tracing

    # Nothing listens: the frames are taken before they are sent.
    tracing = Tracing("127.0.0.1:9", recorder=_recorder(kind))
    frames: list[tuple[bytes, int]] = []
    monkeypatch.setattr(tracing.exporter, "send", lambda frame, n: frames.append((frame, n)))
    request_ids = ["req-1", "x" * 99, "y" * 300, "é" * 60, "req-1"]
    headers: list[dict[str, str]] = []
    for i, rid in enumerate(request_ids):
        exchange = _exchange({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}, rid)
        trace = tracing.start(exchange)
        assert trace is not None and exchange.trace is trace
        trace.admission("m" * i * 70, PriorityClass.INTERACTIVE, "tenant-a")
        trace.end()
        trace.attempt(i, "retry" if i else "first", ("cache_aware",), ("http://a", "http://b"))
        trace.leg(UPSTREAM, "http://a" * (i * 40 + 1))
        headers.append({})
        tracing.inject(headers[-1], exchange)
        trace.end()
        trace.end()
        if i == 1:
            trace.failed(503, "upstream_error")
        tracing.finish(trace, Route.COMPLETIONS, exchange)
    tracing.shutdown()  # sends the batch
    assert [n for _, n in frames] == [4 * len(request_ids)]
    spans = _parsed([f for f, _ in frames])
    assert len(spans) == 4 * len(request_ids)
    for i, rid in enumerate(request_ids):
        named = {s.name: s for s in spans[4 * i : 4 * i + 4]}
        root, admission, attempt, upstream = (
            named["POST /v1/completions"],
            named["admission"],
            named["attempt"],
            named["upstream"],
        )
        assert {s.trace_id.hex() for s in named.values()} == {TRACE_ID}
        assert root.parent_span_id.hex() == CLIENT_SPAN
        assert admission.parent_span_id == attempt.parent_span_id == root.span_id
        assert upstream.parent_span_id == attempt.span_id
        assert len({s.span_id for s in spans}) == len(spans)
        assert (root.kind, admission.kind, attempt.kind, upstream.kind) == (2, 1, 1, 3)  # server, internal, client
        assert headers[i]["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"
        attrs = {a.key: a.value for a in root.attributes}
        assert attrs["atomesh.request_id"].string_value == rid and attrs["http.route"].string_value == "/v1/completions"
        assert attrs["http.response.status_code"].int_value == (503 if i == 1 else 200)
        assert [v.string_value for v in attrs["atomesh.workers"].array_value.values] == ["http://a", "http://b"]
        assert ("gen_ai.request.model" in attrs) == (i > 0)
        if i:
            assert attrs["gen_ai.request.model"].string_value == "m" * i * 70
        assert root.status.code == (2 if i == 1 else 0)  # STATUS_CODE_ERROR for a 5xx
        assert ("error.type" in attrs) == (i == 1)
        a = {kv.key: kv.value for kv in admission.attributes}
        assert a["atomesh.class"].string_value == "interactive" and a["atomesh.tenant"].string_value == "tenant-a"
        a = {kv.key: kv.value for kv in attempt.attributes}
        assert a["atomesh.attempt"].int_value == i and a["atomesh.attempt.kind"].string_value == (
            "retry" if i else "first"
        )
        assert [v.string_value for v in a["atomesh.placement.policy"].array_value.values] == ["cache_aware"]
        assert [v.string_value for v in a["atomesh.placement.workers"].array_value.values] == ["http://a", "http://b"]
        a = {kv.key: kv.value for kv in upstream.attributes}
        assert a["server.address"].string_value == "http://a" * (i * 40 + 1)
        assert a["atomesh.leg"].string_value == "single"
        assert (
            time.time_ns() - 60 * 10**9
            < root.start_time_unix_nano
            <= admission.start_time_unix_nano
            <= admission.end_time_unix_nano
            <= attempt.start_time_unix_nano
            <= upstream.start_time_unix_nano
            <= upstream.end_time_unix_nano
            <= attempt.end_time_unix_nano
            <= root.end_time_unix_nano
            <= time.time_ns()
        )
    # Every value type an attribute may have (the resource's and the spans' writer).
    kv = trace_common.KeyValue()
    for value, read in (
        (True, lambda v: v.bool_value),
        (0.5, lambda v: v.double_value),
        (-3, lambda v: v.int_value),
        (["l", 2], lambda v: [v.array_value.values[0].string_value, v.array_value.values[1].int_value]),
        ("s" * 200, lambda v: v.string_value),
    ):
        kv.ParseFromString(key_value("k", value))
        assert kv.key == "k" and read(kv.value) == value


def _record(rng: random.Random, i: int, now: float) -> list[Any]:
    """One request's record as `atomesh.otlp` describes it, of any shape the request path makes: spans left
    open, no model, a client's parent or none, long and non-ASCII values, errors, begins past item 255."""
    prefix = "00-" + rng.getrandbits(128).to_bytes(16, "big").hex() + "-" + rng.getrandbits(56).to_bytes(7, "big").hex()
    record: list[Any] = [prefix, rng.choice(["", rng.getrandbits(64).to_bytes(8, "big").hex()]), now]
    record += (0, now + 1e-5, "interactive", f"tenant-{i % 3}", rng.choice(["m" * rng.randrange(300), None]))
    record.append(now + 2e-5)
    for attempt in range(rng.choice([1, 1, 2, 60])):  # 60 attempts: begins past item 255
        workers = tuple(f"http://w{j}" for j in range(rng.randrange(3)))
        record += (1, now + 3e-5, attempt, "retry", ("cache_aware",) * rng.randrange(3), workers)
        record += (rng.randrange(2, 5), now + 4e-5, "http://é" * rng.randrange(1, 40))
        record += [now + 5e-5, now + 6e-5][: rng.randrange(3) if attempt else 2]  # a leg, an attempt left open, or not
    record += (
        "/v1/completions",
        rng.choice(["req-1", "x" * 150, "é" * 70]),
        rng.choice([200, 503]),
        rng.choice([None, "upstream_error"]),
        now + rng.choice([7e-5, 3e3]),
    )
    return record


def test_the_compiled_encoder_writes_what_pythons_writes() -> None:
    """Records of every shape the request path makes in export batches of any size: the same bytes from
    both encoders; a frame that is not one of records is refused (the sender then uses Python's)."""
    encoder, native = _encoders()
    rng = random.Random(7)
    for _ in range(40):
        now = time.monotonic()
        batch: list[Any] = []
        for i in range(rng.randrange(1, 40)):
            batch += _record(rng, i, now)
        frame = marshal.dumps((time.time_ns(), now + rng.random(), batch), 4)
        max_spans = rng.choice([1, 5, 100, 2048])
        assert native.export_requests(frame, max_spans) == encoder.export_requests(frame, max_spans)
    good = _record(rng, 0, 1.0)
    assert native.export_requests(marshal.dumps((1, 1.0, good), 4), 10) is not None
    for bad in (
        b"junk",
        marshal.dumps([(1, 2)], 4),
        marshal.dumps((1, 1.0, good[:-1]), 4),  # the record cut short
        marshal.dumps((1, 1.0, ["00-" + "g" * 32 + good[0][35:], *good[1:]]), 4),  # an id not in hex
        marshal.dumps((1, 1.0, [*good[:2], float("nan"), *good[3:]]), 4),  # a time that is no time
        marshal.dumps((1, 1.0, [*good[:3], 9, *good[4:]]), 4),  # a kind of span there is not
        marshal.dumps((1, 1.0, [*good[:3], 1.5, *good[3:]]), 4),  # an end with no span open
    ):
        assert native.export_requests(bad, 10) is None, bad


def _requests(recorder: Any) -> tuple[list[str], bytes, int]:
    """Requests of every shape the request path makes, recorded by `recorder`: the traceparents they send
    upstream, the frame of their batch, its spans."""
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import DECODE, PREFILL, UPSTREAM

    sent = []
    # A new trace: admitted, one attempt and its upstream leg.
    t = recorder.trace(None, "")
    t.admission("m", PriorityClass.DEFAULT, "anonymous")
    t.end()
    t.attempt(0, "first", ("round_robin",), ("http://a",))
    t.leg(UPSTREAM, "http://a")
    sent.append(t.traceparent())
    t.end()
    t.end()
    assert recorder.add(t, "/v1/completions", "r1", 200) == 4
    # The client's trace; P/D legs; refused; non-ASCII and long values; no model.
    t = recorder.trace(TRACE_ID, CLIENT_SPAN)
    t.admission(None, PriorityClass.INTERACTIVE, "é" * 300)
    t.end()
    t.attempt(1, "retry", ("cache_aware", "round_robin"), ("http://p", "http://d"))
    t.leg(PREFILL, "http://p")
    sent.append(t.traceparent())
    t.end()
    t.leg(DECODE, "http://d" * 40)
    sent.append(t.traceparent())
    t.end()
    t.end()
    t.failed(503, "upstream_error")
    recorder.add(t, "/v1/chat/completions", "x" * 300, 0)
    # SGLang's P/D: both calls under the attempt (no leg span); an admission wait cut (left open).
    t = recorder.trace(None, "")
    t.attempt(0, "first", ("a",), ("http://p", "http://d"))
    sent += (t.traceparent(), t.traceparent())
    t.end()
    t.admission("m", PriorityClass.BULK, "t")
    recorder.add(t, "/generate", "r3", 499)
    # 60 attempts: begins past item 255 (their ids written out in full in the traceparent).
    t = recorder.trace(None, "")
    for i in range(60):
        t.attempt(i, "migration", (), ())
        t.leg(UPSTREAM, "u")
        sent.append(t.traceparent())
        t.end()
        t.end()
    spans = recorder.add(t, "/v1/completions", "r4", 200)
    assert recorder.spans == spans == 4 + 5 + 3 + 121
    return sent, recorder.frame(time.time_ns(), time.monotonic()), spans


def test_both_recorders_make_the_same_records() -> None:
    """The compiled recorder writes the records Python's makes (its frame is `marshal`'s, read by both
    encoders alike), ids and times aside; the traceparents sent upstream name the spans the sender
    exports."""
    from atomesh.otlp import records

    def mask(item: Any) -> Any:
        if isinstance(item, float):
            return "time"
        if isinstance(item, str) and item.startswith("00-"):  # a prefix: the client's trace id, if any
            return item[:36] if item[3:35] == TRACE_ID else "new"
        return item

    made = {}
    for kind in ("compiled", "python"):
        sent, frame, spans = _requests(_recorder(kind))
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        _, _, items = marshal.loads(frame[4:])
        found = records(items)
        assert sum(n for _, _, n in found) == spans
        # The traceparents: the trace's ids, each naming the span whose begin is at its offset from the base.
        offsets = []
        for tp in sent:
            prefix = next(items[first] for first, _, _ in found if items[first][3:35] == tp[3:35])
            assert tp.startswith(prefix[:36]) and tp.endswith("-01")
            offsets.append(int(tp[36:52], 16) - (int(prefix[36:50], 16) << 8))
        # The records, their random ids and times masked.
        shape = [mask(x) for x in items]
        exported = {s.span_id.hex(): s.name for s in _parsed([frame])}
        assert len(exported) == spans
        assert [exported[tp[36:52]] for tp in sent] == ["upstream", "prefill", "decode", "attempt", "attempt"] + [
            "upstream"
        ] * 60
        made[kind] = (offsets, shape)
    assert made["compiled"] == made["python"]
    assert made["python"][0][:5] == [15, 15, 19, 3, 3]


def test_the_compiled_recorder_refuses_values_of_the_wrong_type() -> None:
    """A value the record cannot hold is refused with the reason, and the record is left as it was."""
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import UPSTREAM

    recorder = _recorder("compiled")
    t = recorder.trace(None, "")
    with pytest.raises(TypeError, match="tenant must be a str"):
        t.admission("m", PriorityClass.DEFAULT, 3)
    with pytest.raises(TypeError, match="workers must be a tuple of str"):
        t.attempt(0, "first", ("a",), ["http://a"])
    with pytest.raises(ValueError, match="not a leg"):
        t.leg(0, "http://a")
    with pytest.raises(ValueError, match="trace_id must be 32 lower-case hex digits"):
        recorder.trace("ABC", "")
    t.attempt(0, "first", ("a",), ("http://a",))
    t.leg(UPSTREAM, "http://a")
    assert t.traceparent().endswith("09-01")  # the leg's begin is the record's item 9: nothing refused was kept
    t.end()
    t.end()
    assert t.spans == 3 and recorder.add(t, "/v1/completions", "r", 200) == 3
    [data] = _encoders()[1].export_requests(recorder.frame(time.time_ns(), time.monotonic())[4:], 100)
    assert data


def test_a_forked_child_draws_ids_of_its_own() -> None:
    """The compiled recorder's pool of random bytes is emptied in a child after fork: parent and child do
    not hand out the same ids."""
    recorder = _recorder("compiled")
    recorder.unsampled()  # the pool filled
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(write, recorder.unsampled().encode())
        os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 100).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert len(child) == 55 and child != recorder.unsampled()


def test_without_a_compiler_the_recorder_says_why_and_a_cached_build_still_serves(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from atomesh.tracing import PyRecorder, Tracing, native_recorder

    recorder, why_not = native_recorder(tmp_path)
    assert recorder is not None, why_not
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    assert native_recorder(tmp_path)[0] is not None  # built before: no compiler needed
    missing, why_not = native_recorder(tmp_path / "empty")
    assert missing is None and "no C compiler" in why_not
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    tracing = Tracing("127.0.0.1:9")  # the gateway then records in Python
    try:
        assert isinstance(tracing.recorder, PyRecorder)
    finally:
        tracing.shutdown()


@RECORDERS
def test_a_request_not_sampled_records_nothing_and_passes_the_flag_on(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's not-sampled flag is followed, and so is OTEL_TRACES_SAMPLER for a request without one;
    either way the worker is told not to record (the client's trace passed through when it sent one, else
    new ids each time)."""
    from atomesh.tracing import Tracing

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    tracing = Tracing("127.0.0.1:9", recorder=_recorder(kind))
    try:
        for sent in (f"00-{TRACE_ID}-{CLIENT_SPAN}-00", f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-00", None, "00-bad"):
            exchange = _exchange({"traceparent": sent} if sent is not None else {})
            assert tracing.start(exchange) is None and exchange.trace is None
            headers: dict[str, str] = {}
            tracing.inject(headers, exchange)
            version, trace_id, span_id, flags = headers["traceparent"].split("-")
            assert (version, flags) == ("00", "00") and len(trace_id) == 32 and len(span_id) == 16
            assert (trace_id, span_id) == (
                (TRACE_ID, CLIENT_SPAN) if sent and "bad" not in sent else (trace_id, span_id)
            )
            if sent is None or "bad" in sent:
                assert trace_id != TRACE_ID and int(trace_id, 16) and int(span_id, 16)
                assert re.fullmatch("[0-9a-f]{32}-[0-9a-f]{16}", f"{trace_id}-{span_id}")
        assert len({tracing.recorder.unsampled() for _ in range(1000)}) == 1000
        # A client's sampled flag is followed whatever the sampler says.
        assert tracing.start(_exchange({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}))
    finally:
        tracing.shutdown()


async def test_a_frame_of_several_export_batches_goes_in_calls_of_at_most_the_batch_size(
    receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway hands its sender half the queue's bound at a time; the sender sends it in export
    calls of at most OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans, a request's spans together in one."""
    from atomesh.request import Route
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import Tracing

    r, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "24")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "5")
    tracing = Tracing(endpoint)
    try:
        for _ in range(6):  # 2 spans each: one frame of 12 spans
            exchange = _exchange({})
            trace = tracing.start(exchange)
            assert trace is not None
            trace.admission("m", PriorityClass.DEFAULT, "t")
            trace.end()
            tracing.finish(trace, Route.CHAT, exchange)
        assert tracing.exporter.handed + tracing.exporter.waiting == 12
        deadline = time.monotonic() + 20
        while len(r.spans) < 12:
            assert time.monotonic() < deadline, r.calls
            await asyncio.sleep(0.05)
    finally:
        tracing.shutdown()
    assert r.calls == [4, 4, 4]
    assert all(sum(s["name"] == "admission" for s in r.of(t)) == 1 for t in {s["trace"] for s in r.spans})


def test_exporter_settings_not_honoured_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from atomesh.otlp import exporter_settings
    from atomesh.tracing import ratio_from_env

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "Authorization=Bearer%20k")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    s = exporter_settings("https://collector:4317")
    assert s.schedule_delay_s == 0.25 and s.headers == (("authorization", "Bearer k"),) and s.gzip and s.secure
    assert s.target == "collector:4317" and s.max_batch == 2048 and s.max_queue == 8192
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", "/ca.pem")
    with pytest.raises(RuntimeError, match="OTEL_EXPORTER_OTLP_CERTIFICATE"):
        exporter_settings("collector:4317")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_CERTIFICATE")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(RuntimeError, match="gRPC only"):
        exporter_settings("collector:4317")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "jaeger_remote")
    with pytest.raises(RuntimeError, match="OTEL_TRACES_SAMPLER=jaeger_remote"):
        ratio_from_env()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    assert ratio_from_env() == 0.25


async def test_spans_reach_a_receiver_and_a_full_queue_drops_and_counts(
    receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches go when full and on the schedule; a batch past the queue's bound is dropped, counted, not kept."""
    from atomesh.request import Route
    from atomesh.tenancy import PriorityClass
    from atomesh.tracing import Tracing

    r, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    tracing = Tracing(endpoint)
    trace_ids = [f"{i + 1:032x}" for i in range(2)]
    for t in trace_ids:
        exchange = _exchange({"traceparent": f"00-{t}-{CLIENT_SPAN}-01"})
        trace = tracing.start(exchange)
        assert trace is not None
        trace.admission("m", PriorityClass.DEFAULT, "t")
        trace.end()
        tracing.finish(trace, Route.CHAT, exchange)
    deadline = time.monotonic() + 20
    while sum(len(r.of(t)) for t in trace_ids) < 4:
        assert time.monotonic() < deadline, r.spans
        await asyncio.sleep(0.05)
    tracing.shutdown()
    assert tracing.exporter.handed == 4 and tracing.exporter.dropped == 0
    # With its sender stopped (as a collector that never answers holds it), the queue fills up to its
    # bound: the third batch of 4 is dropped.
    for _ in range(12):
        exchange = _exchange({})
        trace = tracing.start(exchange)
        assert trace is not None
        tracing.finish(trace, Route.COMPLETIONS, exchange)
    assert tracing.exporter.dropped == 4 and tracing.exporter.waiting == 8
