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
                        self.spans.append({"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                           "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                           "attrs": {a.key: a.value for a in s.attributes}})
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
        receiver: tuple[Receiver, str], gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mooncake.engine", reason="P/D engines relay KV over Mooncake (make install puts it in)")
    r, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export batches every 0.1 s (default 5 s)
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100", "MC_TRANSFER_TIMEOUT": "5"}
    engine = [sys.executable, "-m", "engine.openai_server", "--model", "tiny-random", "--host", "127.0.0.1",
              "--num-kvcache-blocks", "128", "--torch-threads", "1", "--otlp-traces-endpoint", endpoint]
    engines = {role: EngineProcess(f"trace-{role}", [*engine, "--kv-transfer-config", json.dumps(
        {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(), "staging_buffer_mb": 1})], env)
        for role in ("kv_producer", "kv_consumer")}
    try:
        for e in engines.values():
            e.wait_up()
        gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": engines["kv_producer"].url}],
                           decode=[engines["kv_consumer"].url], enable_trace=True, otlp_traces_endpoint=endpoint)
        body = {"model": "tiny-random", "prompt": "hello there", "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(
                base_url(gw) + "/v1/completions", json=body,
                headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as resp:
            assert resp.status == 200
            await resp.read()
        deadline = time.monotonic() + 30
        want = {"atomesh-gateway", "atomesh-engine-kv_producer", "atomesh-engine-kv_consumer"}
        while {s["service"] for s in r.of(TRACE_ID) if s["name"] == "engine.request"} | {"atomesh-gateway"} != want \
                or not any(s["name"] == "POST /v1/completions" for s in r.of(TRACE_ID)):
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
