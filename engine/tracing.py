"""OpenTelemetry spans of the engine (`--otlp-traces-endpoint`, vLLM's flag), off by default.

Each request's spans are made when it ends, from the times the handler noted (arrival, KV pulled,
admitted for prefill, first token, end), under the `traceparent` the request came with (the gateway's
leg span): `engine.request`, with children `queue`, `prefill`, `kv_transfer` (a decode engine's pull)
and `decode` as they apply. Nothing is imported or done while tracing is off.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

Phase = tuple[str, float, float]  # name, start, end: time.monotonic() seconds


class EngineTracing:
    def __init__(self, endpoint: str, service: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporter: {e}") from None
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        target = endpoint.removeprefix("http://").removeprefix("grpc://")
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target, insecure=True)))
        self._tracer = self._provider.get_tracer("atomesh.engine")
        self._offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def emit(
        self,
        headers: Mapping[str, str],
        start: float,
        end: float,
        phases: Sequence[Phase],
        attributes: Mapping[str, Any],
    ) -> None:
        """One request's spans, under the `traceparent` in `headers` (a root span without one; none when that
        traceparent is not sampled)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(headers)
        caller = trace.get_current_span(parent).get_span_context()
        if caller.is_valid and not caller.trace_flags.sampled:
            return  # the caller's trace is not sampled: neither are its engine spans
        root = self._tracer.start_span(
            "engine.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=dict(attributes),
            start_time=self._ns(start),
        )
        inside = trace.set_span_in_context(root)
        for name, a, b in phases:
            if b >= a:
                self._tracer.start_span(name, context=inside, start_time=self._ns(a)).end(end_time=self._ns(b))
        root.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        self._provider.shutdown()
