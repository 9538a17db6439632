"""OpenTelemetry tracing of the gateway (SMG's `--enable-trace`, `--otlp-traces-endpoint`).

Off (the default), `Tracing.on` is false and nothing below runs: each hook is one attribute test.
On, every inference request gets a server span (route, model, status, workers) under the client's
W3C `traceparent` when it sent one, with children for admission (class, tenant), each attempt
(placement: policy and workers; first try, retry or migration) and each upstream leg (prefill,
decode, or the single worker); the current span goes on to the worker as `traceparent`, so an engine
that traces puts its own spans under it.

The request path keeps only ids and times (the SDK's span objects and context machinery cost more
than the gateway's whole request path); a finished request of a sampled trace becomes SDK spans for
the batch processor, which exports them over OTLP/gRPC. Sampling follows the parent's flag, else
`OTEL_TRACES_SAMPLER_ARG` when `OTEL_TRACES_SAMPLER` is `traceidratio` / `parentbased_traceidratio`
(as the SDK reads them), else every trace.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

TRACEPARENT = "traceparent"
_HEX = frozenset("0123456789abcdef")


@dataclass(slots=True)
class _Span:
    name: str
    span_id: int
    parent_id: int
    kind: str  # server | client | internal
    start_ns: int
    end_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value


@dataclass(slots=True)
class RequestTrace:
    """One request's trace: its ids, whether it is exported, and its spans once they end."""

    trace_id: int
    remote_parent: int  # the client's span id, 0 for none
    sampled: bool
    root: _Span
    spans: list[_Span] = field(default_factory=list)


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, or None when absent or invalid."""
    if not value:
        return None
    parts = value.strip().lower().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 \
            or len(parts[3]) != 2 or not _HEX.issuperset(parts[0] + parts[1] + parts[2] + parts[3]):
        return None
    trace_id, span_id = int(parts[1], 16), int(parts[2], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(parts[3], 16) & 1)


def _ratio_from_env() -> float:
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "")
    if sampler not in ("traceidratio", "parentbased_traceidratio"):
        return 1.0
    try:
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


class Tracing:
    """The gateway's tracer, or nothing."""

    def __init__(self, endpoint: str | None, service: str = "atomesh-gateway") -> None:
        self.on = endpoint is not None
        self.ratio = _ratio_from_env()
        self._current: ContextVar[tuple[RequestTrace, _Span] | None] = ContextVar("atomesh_span", default=None)
        self._rng = random.Random()
        self._processor: Any = None
        if endpoint is None:
            return
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise RuntimeError(f"--enable-trace needs the OpenTelemetry SDK and its OTLP exporter (pip install "
                               f"'atomesh[tracing]'): {e}") from None
        self._resource = Resource.create({"service.name": service})
        target = endpoint.removeprefix("http://").removeprefix("grpc://")
        self._processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=target, insecure=True))

    # ------------------------------------------------------------------ the request path
    def request(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> _RequestScope:
        """`with tracing.request(...) as root:` the server span of one request, current for its duration,
        under the client's traceparent (`root` takes the attributes known at the end)."""
        parent = parse_traceparent(headers.get(TRACEPARENT))
        if parent is not None:
            trace_id, remote, sampled = parent
        else:
            trace_id, remote = self._rng.getrandbits(128) or 1, 0
            sampled = self.ratio >= 1.0 or self._rng.random() < self.ratio
        root = _Span(name, self._rng.getrandbits(64) or 1, remote, "server", time.time_ns(), attributes=attributes)
        return _RequestScope(self, RequestTrace(trace_id, remote, sampled, root))

    def span(self, name: str, attributes: dict[str, Any] | None = None,
             client: bool = False) -> _SpanScope | _Unsampled:
        """`with tracing.span(...):` a child of the current span, current for its duration; nothing (and
        next to no cost) outside a request or in a trace that is not sampled."""
        frame = self._current.get()
        if frame is None or not frame[0].sampled:
            return _UNSAMPLED
        trace, parent = frame
        return _SpanScope(self, trace, _Span(name, self._rng.getrandbits(64) or 1, parent.span_id,
                                             "client" if client else "internal", time.time_ns(),
                                             attributes=attributes or {}))

    def current(self) -> _Span | None:
        frame = self._current.get()
        return None if frame is None else frame[1]

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Put the current span's `traceparent` in an upstream request's headers."""
        frame = self._current.get()
        if frame is not None:
            trace, span = frame
            headers[TRACEPARENT] = f"00-{trace.trace_id:032x}-{span.span_id:016x}-{'01' if trace.sampled else '00'}"

    # ------------------------------------------------------------------ export (sampled traces only)
    def _export(self, trace: RequestTrace) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        kinds = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
        flags = TraceFlags(TraceFlags.SAMPLED)
        scope = InstrumentationScope("atomesh")
        for s in (trace.root, *trace.spans):
            parent = None
            if s.parent_id:
                parent = SpanContext(trace.trace_id, s.parent_id, is_remote=s is trace.root, trace_flags=flags)
            self._processor.on_end(ReadableSpan(
                name=s.name, context=SpanContext(trace.trace_id, s.span_id, is_remote=False, trace_flags=flags),
                parent=parent, resource=self._resource, attributes=s.attributes, kind=kinds[s.kind],
                start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=scope))

    def shutdown(self) -> None:
        """Export what is buffered and stop (at gateway stop)."""
        if self._processor is not None:
            self._processor.shutdown()


class _RequestScope:
    __slots__ = ("_token", "_tracing", "trace")

    def __init__(self, tracing: Tracing, trace: RequestTrace) -> None:
        self._tracing = tracing
        self.trace = trace
        self._token: Any = None

    def __enter__(self) -> _Span:
        self._token = self._tracing._current.set((self.trace, self.trace.root))
        return self.trace.root

    def __exit__(self, *exc: object) -> None:
        self._tracing._current.reset(self._token)
        self.trace.root.end_ns = time.time_ns()
        if self.trace.sampled:
            self._tracing._export(self.trace)


class _SpanScope:
    __slots__ = ("_span", "_token", "_trace", "_tracing")

    def __init__(self, tracing: Tracing, trace: RequestTrace, span: _Span) -> None:
        self._tracing = tracing
        self._trace = trace
        self._span = span
        self._token: Any = None

    def __enter__(self) -> _Span:
        self._token = self._tracing._current.set((self._trace, self._span))
        return self._span

    def __exit__(self, *exc: object) -> None:
        self._tracing._current.reset(self._token)
        self._span.end_ns = time.time_ns()
        self._trace.spans.append(self._span)


class _Unsampled:
    """The span of a trace that is not exported: nothing to record."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_UNSAMPLED = _Unsampled()
