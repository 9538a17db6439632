"""OpenTelemetry tracing end to end: a client's traceparent, the gateway's spans (request, admission,
attempt, prefill and decode legs) and both P/D engines' spans arrive at a real OTLP/gRPC receiver,
linked into one trace."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import aiohttp
import pytest
from gwtest import EngineProcess, MakeGateway, MakeWorkers, base_url, free_port

grpc = pytest.importorskip("grpc")
trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (make install puts it in)")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(trace_grpc.TraceServiceServicer):  # type: ignore[misc]
    """An OTLP/gRPC trace receiver (the collector's protocol) keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        with self.lock:
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
    assert not gw.gateway.tracing.on and gw.gateway.upstream.tracing is None and gw.gateway.router.tracing is None


@pytest.mark.timeout(110)
async def test_one_request_is_one_trace_across_gateway_and_both_pd_engines(
    receiver: tuple[Receiver, str], gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mooncake.engine", reason="P/D engines relay KV over Mooncake (make install puts it in)")
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


def _parsed(tracing: Any, blobs: list[bytes]) -> list[Any]:
    request = trace_service.ExportTraceServiceRequest()
    request.ParseFromString(tracing.exporter.request_bytes(blobs))
    [resource_spans] = request.resource_spans
    [scope_spans] = resource_spans.scope_spans
    assert scope_spans.scope.name == "atomesh"
    return list(scope_spans.spans)


def test_spans_are_written_as_the_collectors_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-written encoding parses with opentelemetry-proto's own classes, every value type and length
    (cached or not) intact, parents linked, a 5xx request span marked as an error."""
    from atomesh.tracing import Tracing

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=a%20b")
    tracing = Tracing("127.0.0.1:9")  # nothing listens: the spans are taken before they are sent
    blobs: list[bytes] = []
    counts: list[int] = []
    monkeypatch.setattr(tracing.exporter, "add", lambda b, n: (blobs.append(b), counts.append(n)))
    request_ids = ["req-1", "x" * 99, "y" * 300, "é" * 60, "req-1"]
    headers: list[dict[str, str]] = []
    for i, rid in enumerate(request_ids):
        with tracing.request(
            "POST /v1/completions",
            {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            {"http.route": "/v1/completions", "atomesh.request_id": rid},
        ) as root:
            with tracing.span(
                "attempt",
                {
                    "atomesh.attempt": i,
                    "flag": i % 2 == 0,
                    "share": 0.5,
                    "atomesh.placement.workers": ("http://a", "http://b"),
                    "list": ["l"],
                },
            ):
                with tracing.span("upstream", {"server.address": "http://a" * (i * 40 + 1)}, client=True):
                    headers.append({})
                    tracing.inject(headers[-1])
            root.set_attribute("http.response.status_code", 503 if i == 1 else 200)
    tracing.shutdown()
    assert counts == [3] * len(request_ids)
    spans = _parsed(tracing, blobs)
    assert len(spans) == 3 * len(request_ids)
    for i, rid in enumerate(request_ids):
        root, attempt, upstream = (
            sorted(spans[3 * i : 3 * i + 3], key=lambda s: s.kind != 2)[0],
            *(s for s in spans[3 * i : 3 * i + 3] if s.name == "attempt"),
            *(s for s in spans[3 * i : 3 * i + 3] if s.name == "upstream"),
        )
        assert {s.trace_id.hex() for s in (root, attempt, upstream)} == {TRACE_ID}
        assert root.name == "POST /v1/completions" and root.parent_span_id.hex() == CLIENT_SPAN
        assert attempt.parent_span_id == root.span_id and upstream.parent_span_id == attempt.span_id
        assert (root.kind, attempt.kind, upstream.kind) == (2, 1, 3)  # server, internal, client
        assert headers[i]["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"
        attrs = {a.key: a.value for a in root.attributes}
        assert attrs["atomesh.request_id"].string_value == rid and attrs["http.route"].string_value == "/v1/completions"
        assert attrs["http.response.status_code"].int_value == (503 if i == 1 else 200)
        assert root.status.code == (2 if i == 1 else 0)  # STATUS_CODE_ERROR for a 5xx
        a = {kv.key: kv.value for kv in attempt.attributes}
        assert a["atomesh.attempt"].int_value == i and a["flag"].bool_value == (i % 2 == 0)
        assert a["share"].double_value == 0.5 and a["list"].array_value.values[0].string_value == "l"
        assert [v.string_value for v in a["atomesh.placement.workers"].array_value.values] == ["http://a", "http://b"]
        assert upstream.attributes[0].value.string_value == "http://a" * (i * 40 + 1)
        assert (
            0
            < root.start_time_unix_nano
            <= attempt.start_time_unix_nano
            <= upstream.end_time_unix_nano
            <= root.end_time_unix_nano
        )
    request = trace_service.ExportTraceServiceRequest()
    request.ParseFromString(tracing.exporter.request_bytes(blobs))
    resource = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "atomesh-gateway" and resource["team"] == "a b"
    assert resource["deployment.environment"] == "test"


def test_exporter_settings_not_honoured_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from atomesh.otlp import exporter_settings
    from atomesh.tracing import ratio_from_env

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "Authorization=Bearer%20k")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    s = exporter_settings("https://collector:4317")
    assert s.schedule_delay_s == 0.25 and s.headers == (("authorization", "Bearer k"),) and s.gzip and s.secure
    assert s.target == "collector:4317" and s.max_batch == 512 and s.max_queue == 2048
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
    """Batches go when full and on the schedule; past the queue's bound spans are dropped, counted, not kept."""
    from atomesh.tracing import Tracing

    r, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    tracing = Tracing(endpoint)
    trace_ids = [f"{i + 1:032x}" for i in range(2)]
    for t in trace_ids:
        with tracing.request("POST /v1/chat/completions", {"traceparent": f"00-{t}-{CLIENT_SPAN}-01"}, {}):
            with tracing.span("admission"):
                pass
    deadline = time.monotonic() + 20
    while sum(len(r.of(t)) for t in trace_ids) < 4:
        assert time.monotonic() < deadline, r.spans
        await asyncio.sleep(0.05)
    tracing.shutdown()
    assert tracing.exporter.handed == 4 and tracing.exporter.dropped == 0
    # With its sender stopped (as a collector that never answers holds it), the queue fills up to its bound.
    for _ in range(10):
        with tracing.request("POST /v1/completions", {}, {}):
            pass
    assert tracing.exporter.dropped == 2 and len(tracing.exporter._queue) == 8
