"""OpenTelemetry tracing of the gateway (SMG's `--enable-trace`, `--otlp-traces-endpoint`).

Off (the default), `Tracing.on` is false and nothing below is imported or called: each hook is one
attribute test. On, every inference request gets a server span (route, model, status, workers) under
the client's W3C `traceparent` when it sent one, with children for admission (queue wait and class),
each attempt (placement: policy and workers; first try, retry or migration) and each upstream leg
(prefill, decode, or the single worker); the leg's context goes on to the worker as `traceparent`, so
an engine that traces puts its own spans under it. Spans leave in batches over OTLP/gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any


class Tracing:
    """The gateway's tracer, or nothing."""

    def __init__(self, endpoint: str | None, service: str = "atomesh-gateway") -> None:
        self.on = endpoint is not None
        self._tracer: Any = None
        self._provider: Any = None
        if endpoint is None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise RuntimeError(f"--enable-trace needs the OpenTelemetry SDK and its OTLP exporter (pip install "
                               f"'atomesh[tracing]'): {e}") from None
        # Not the global provider: a library embedding the gateway keeps its own.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        target = endpoint.removeprefix("http://").removeprefix("grpc://")
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target, insecure=True)))
        self._tracer = self._provider.get_tracer("atomesh")

    @contextmanager
    def request(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> Iterator[Any]:
        """The server span of one request, current for its duration, under the client's traceparent."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(headers)
        with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                                attributes=dict(attributes)) as span:
            yield span

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False) -> Iterator[Any]:
        """A child of the current span, current for its duration."""
        from opentelemetry.trace import SpanKind

        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        with self._tracer.start_as_current_span(name, kind=kind, attributes=dict(attributes or {})) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Put the current span's `traceparent` in an upstream request's headers."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(headers)

    def current(self) -> Any:
        from opentelemetry import trace

        return trace.get_current_span()

    def shutdown(self) -> None:
        """Export what is buffered and stop (at gateway stop)."""
        if self._provider is not None:
            self._provider.shutdown()
