"""OpenTelemetry tracing of the gateway (SMG's `--enable-trace`, `--otlp-traces-endpoint`).

Off (the default), `Tracing.on` is false and nothing below runs: each hook is one attribute test.
On, every inference request gets a server span (route, model, status, workers) under the client's
W3C `traceparent` when it sent one, with children for admission (class, tenant), each attempt
(placement: policy and workers; first try, retry or migration) and each upstream leg (prefill,
decode, or the single worker); the current span goes on to the worker as `traceparent`, so an engine
that traces puts its own spans under it.

What it costs is what the request path does, so that path does little: a span is a small object made
current through one context variable; when it ends it is written straight into OTLP protobuf bytes
(`otlp.py`: attribute encodings cached, ids kept as bytes) and queued; the `SpanExporter` thread
sends queued spans in batches over OTLP/gRPC. The OpenTelemetry SDK's span objects, processor and
encoder cost more than the gateway's whole request path, so none of them is used here. Sampling
follows the parent's flag, else `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` as the SDK reads
them, else every trace; a trace that is not sampled records nothing.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from typing import Any

from atomesh.otlp import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, SpanEncoder, SpanExporter, exporter_settings

TRACEPARENT = "traceparent"
_HEX = frozenset("0123456789abcdef")


class Span:
    """One child span of a sampled request, the innermost open span of its request inside its `with` block."""

    __slots__ = ("attributes", "end_ns", "kind", "name", "parent", "root", "span_id", "start_ns")

    def __init__(self, root: RequestSpan, name: str, kind: int, attributes: dict[str, Any]) -> None:
        self.root = root
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self.span_id = root.rng()
        self.parent: Span | RequestSpan | None = None  # None: the request span
        self.start_ns = self.end_ns = 0

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def __enter__(self) -> Span:
        root = self.root
        self.parent = root.open
        root.open = self
        self.start_ns = time.time_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_ns = time.time_ns()
        root = self.root
        root.open = self.parent
        root.children.append(self)


class RequestSpan:
    """The server span of one request: current (one context variable) for the request's duration; its
    children nest through `open` (the innermost open span), as the request path runs one step at a time."""

    __slots__ = (
        "_token",
        "_tracing",
        "attributes",
        "children",
        "end_ns",
        "kind",
        "name",
        "open",
        "parent_id",
        "rng",
        "sampled",
        "span_id",
        "start_ns",
        "trace_id",
    )

    def __init__(
        self, tracing: Tracing, trace_id: bytes, parent_id: bytes, sampled: bool, name: str, attributes: dict[str, Any]
    ) -> None:
        self._tracing = tracing
        self.rng = tracing.span_id
        self.trace_id = trace_id
        self.parent_id = parent_id  # the client's span, b"" for none
        self.sampled = sampled
        self.name = name
        self.kind = KIND_SERVER
        self.attributes = attributes
        self.span_id = self.rng()
        self.open: Span | RequestSpan | None = None  # None: the request span itself (no reference cycle)
        self.children: list[Span] = []
        self.start_ns = self.end_ns = 0
        self._token: Any = None

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def __enter__(self) -> RequestSpan:
        self._token = self._tracing.current_request.set(self)
        self.start_ns = time.time_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_ns = time.time_ns()
        tracing = self._tracing
        tracing.current_request.reset(self._token)
        if self.sampled:
            tracing.exporter.add(tracing.encoder.request(self), 1 + len(self.children))
            self.children = []  # no cycle through the children's `root`: freed by reference counting


def parse_traceparent(value: str | None) -> tuple[bytes, bytes, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, or None when absent or invalid."""
    if not value:
        return None
    parts = value.strip().lower().split("-")
    if (
        len(parts) < 4
        or len(parts[0]) != 2
        or parts[0] == "ff"
        or len(parts[1]) != 32
        or len(parts[2]) != 16
        or len(parts[3]) != 2
        or not _HEX.issuperset(parts[0] + parts[1] + parts[2] + parts[3])
    ):
        return None
    trace_id, span_id = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id, bool(int(parts[3], 16) & 1)


def ratio_from_env() -> float:
    """The share of new traces to sample, from the SDK's `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`."""
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    if sampler in ("always_on", "parentbased_always_on"):
        return 1.0
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler not in ("traceidratio", "parentbased_traceidratio"):
        raise RuntimeError(
            f"OTEL_TRACES_SAMPLER={sampler}: the gateway samples always_on, always_off, traceidratio "
            "or their parentbased_ forms (a client's sampled flag is always followed)"
        )
    try:
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        raise RuntimeError(
            f"OTEL_TRACES_SAMPLER_ARG={os.environ['OTEL_TRACES_SAMPLER_ARG']!r} is not a number in [0, 1]"
        ) from None


class Tracing:
    """The gateway's tracer, or nothing (`on` false)."""

    def __init__(self, endpoint: str | None, service: str = "atomesh-gateway") -> None:
        self.on = endpoint is not None
        self.current_request: ContextVar[RequestSpan | None] = ContextVar("atomesh_request_span", default=None)
        rng = random.Random()
        self._bits = rng.getrandbits
        self._random = rng.random
        if endpoint is None:
            return
        self.ratio = ratio_from_env()
        self.encoder = SpanEncoder()
        self.exporter = SpanExporter(exporter_settings(endpoint, service))  # starts its thread; `shutdown` stops it

    def span_id(self) -> int:
        return self._bits(64) or 1

    # ------------------------------------------------------------------ the request path
    def request(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> RequestSpan:
        """`with tracing.request(...) as root:` the server span of one request, current for its duration,
        under the client's traceparent (`root` takes the attributes known at the end)."""
        parent = parse_traceparent(headers.get(TRACEPARENT))
        if parent is not None:
            trace_id, remote, sampled = parent
        else:
            trace_id, remote = (self._bits(128) or 1).to_bytes(16, "big"), b""
            sampled = self.ratio >= 1.0 or self._random() < self.ratio
        return RequestSpan(self, trace_id, remote, sampled, name, attributes)

    def span(self, name: str, attributes: dict[str, Any] | None = None, client: bool = False) -> Span | _Unsampled:
        """`with tracing.span(...):` a child of the current span, current for its duration; nothing (and
        next to no cost) outside a request or in a trace that is not sampled."""
        root = self.current_request.get()
        if root is None or not root.sampled:
            return _UNSAMPLED
        return Span(root, name, KIND_CLIENT if client else KIND_INTERNAL, attributes if attributes is not None else {})

    def current(self) -> Span | RequestSpan | None:
        root = self.current_request.get()
        return None if root is None else root.open or root

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Put the current span's `traceparent` in an upstream request's headers."""
        root = self.current_request.get()
        if root is not None:
            span = root.open or root
            headers[TRACEPARENT] = f"00-{root.trace_id.hex()}-{span.span_id:016x}-{'01' if root.sampled else '00'}"

    def shutdown(self) -> None:
        """Send what is queued and stop (at gateway stop)."""
        if self.on:
            self.exporter.shutdown()


class _Unsampled:
    """The span of a trace that is not exported: nothing to record."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_UNSAMPLED = _Unsampled()
