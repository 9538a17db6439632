"""OpenTelemetry tracing of the gateway (SMG's `--enable-trace`, `--otlp-traces-endpoint`).

Off (the default), `Tracing.on` is false and no request has a `Trace`: each hook is one attribute
test. On, every sampled inference request gets a server span (route, model, status, workers) under the
client's W3C `traceparent` when it sent one, with children for admission (class, tenant), each attempt
(placement: policy and workers; first try, retry or migration) and each upstream leg (prefill, decode,
or the single worker); the current span goes on to the worker as `traceparent`, so an engine that
traces puts its own spans under it.

What it costs is what the request path does, so that path does little. Whether a request is sampled
is decided once, as it arrives: the client's flag, else `OTEL_TRACES_SAMPLER` /
`OTEL_TRACES_SAMPLER_ARG` as the SDK reads them, else every trace. A request not sampled gets no
`Trace`; all tracing does for it is the `traceparent` it passes on (flagged not sampled, so the
engines record nothing either). A sampled request's `Trace` records its spans as tuples and ints in a
list (`time.time_ns()` times, the few values each kind of span has, span ids counted from one random
base): no span objects, no attribute dicts. When the request ends the record is queued; a thread ships
queued records in batches to a sender process, which writes the OTLP protobuf and sends it (`otlp.py`,
`otlp_sender.py`). The OpenTelemetry SDK's span objects, processor and encoder cost more than the
gateway's whole request path, so none of them is used here.
"""

from __future__ import annotations

import asyncio
import marshal
import os
import random
import re
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from atomesh.otlp import ADMISSION, ATTEMPT, DECODE, PREFILL, UPSTREAM, SpanExporter, exporter_settings
from atomesh.request import Route
from atomesh.tenancy import PriorityClass

if TYPE_CHECKING:
    from atomesh.transport import Exchange

__all__ = ["ADMISSION", "ATTEMPT", "DECODE", "PREFILL", "UPSTREAM", "Trace", "Tracing"]

TRACEPARENT = "traceparent"
_TRACEPARENT = re.compile(r"\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-\S*)?\s*", re.IGNORECASE)
_CLASSES = {c: c.name.lower() for c in PriorityClass}
_ROUTES = {r: r.value for r in Route}  # plain strings (an Enum's `value` is a property: slow)
_now = time.time_ns  # see atomesh.otlp on a record's times


class Trace:
    """The spans of one sampled request, as it runs (the record `atomesh.otlp` describes).

    A child span begins with `trace.admission(...)`, `trace.attempt(...)` or `trace.leg(...)`, which
    write its begin event, and ends with `trace.end()` in a `finally`, which writes its end event and so
    closes the innermost open span (not a `with` block: calling `__enter__` and `__exit__` costs as
    much again as the span). Made by `Tracing.start` only (no `__init__`: calling one costs as much as
    a span)."""

    __slots__ = ("base", "error", "events", "parent", "start", "status", "trace_id")

    trace_id: bytes  # 16 bytes
    parent: bytes  # the client's span (8 bytes), or b""
    base: int  # the request span's id; a child's is base + 1 + the index of its begin event
    events: list[Any]  # begin events (tuples) and end events (ints)
    start: int  # time.time_ns(); the events' times are nanoseconds since it
    status: int  # the refusal's HTTP status, when `error` is set
    error: str | None  # the gateway's error code when it refused or failed the request, else None

    def admission(self, model: str | None, cls: PriorityClass, tenant: str) -> None:
        """Waiting for admission begins (the model, known from here, goes on the request span too)."""
        self.events.append((_now() - self.start, ADMISSION, _CLASSES[cls], tenant, model))

    def attempt(self, number: int, kind: str, policies: tuple[str, ...], workers: tuple[str, ...]) -> None:
        """One placement and its run begins (kind: first, retry or migration)."""
        self.events.append((_now() - self.start, ATTEMPT, number, kind, policies, workers))

    def leg(self, leg: int, url: str) -> None:
        """A call to one worker begins (leg: PREFILL, DECODE or UPSTREAM)."""
        self.events.append((_now() - self.start, leg, url))

    def failed(self, status: int, code: str) -> None:
        """The request ends with the gateway's error (the request span's status and `error.type`)."""
        self.status, self.error = status, code

    def end(self) -> None:
        """End the innermost open span."""
        self.events.append(_now() - self.start)

    def current(self) -> int:
        """The innermost open span's id."""
        events = self.events
        i = len(events)
        ended = 0
        while i:
            i -= 1
            if events[i].__class__ is int:
                ended += 1
            elif ended:
                ended -= 1
            else:
                return self.base + 1 + i
        return self.base


def parse_traceparent(value: str | None) -> tuple[str, str, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, in lower-case hex, or None when absent or
    invalid."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    version, trace_id, span_id, flags = m.groups()
    if version in ("ff", "FF") or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id.lower(), span_id.lower(), flags[1] in "13579bdfBDF"


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
        if endpoint is None:
            return
        self.ratio = ratio_from_env()
        rng = random.Random()  # seeded from os.urandom
        self._random, self._bits = rng.random, rng.getrandbits
        settings = exporter_settings(endpoint, service)
        # Records go to the sender in frames of up to half the queue's bound (and at least one export
        # batch), which it sends in export batches: the sender wakes once for several batches (about a
        # third of its CPU a request at 128 requests a frame was waking up cold).
        self._hand_over = max(settings.max_batch, settings.max_queue // 2)
        self._delay = settings.schedule_delay_s
        # The records of the requests ended since the last batch left, and their spans.
        self._batch: list[tuple[Any, ...]] = []
        self._batch_spans = 0
        self._timer: asyncio.TimerHandle | None = None
        self.exporter = SpanExporter(settings)  # starts the sender process and its writer thread; `shutdown` stops them

    # ------------------------------------------------------------------ the request path
    def start(self, exchange: Exchange) -> Trace | None:
        """The trace of a request that is sampled, also set as `exchange.trace`; None for one that is not."""
        value = exchange.headers.get(TRACEPARENT)
        client = None if value is None else parse_traceparent(value)
        if client is None:
            if self.ratio < 1.0 and self._random() >= self.ratio:
                return None
            # Random bits as the SDK's id generator takes them (Python's `random`): no system call.
            trace_id, parent = (self._bits(128) | 1).to_bytes(16, "little"), b""
        elif client[2]:
            trace_id, parent = bytes.fromhex(client[0]), bytes.fromhex(client[1])
        else:
            return None  # the client's trace, not sampled
        trace = exchange.trace = Trace()
        trace.trace_id = trace_id
        trace.parent = parent
        # 62 random bits, odd: never zero, and the request's child span ids (counted up from it) stay in 64 bits.
        trace.base = self._bits(62) | 1
        trace.events = []
        trace.error = None
        trace.start = _now()
        return trace

    def finish(self, trace: Trace, route: Route, exchange: Exchange) -> None:
        """End the request span and put the request's record in the batch; a full batch leaves."""
        events = trace.events
        batch = self._batch
        error = trace.error
        batch.append(
            (
                trace.trace_id,
                trace.parent,
                trace.base,
                trace.start,
                _now() - trace.start,
                _ROUTES[route],
                exchange.request_id,
                trace.status if error is not None else exchange.status or 0,
                error,
                events,
            )
        )
        self._batch_spans += 1 + len(events) // 2  # the request span, and a begin and an end per child
        if self._batch_spans >= self._hand_over:
            self.ship()
        elif len(batch) == 1:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self.ship)

    def ship(self) -> None:
        """Send the batch to the sender process (on the event loop: when full, when due, and at stop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batch:
            frame = marshal.dumps(self._batch, 4)
            self.exporter.send(len(frame).to_bytes(4, "big") + frame, self._batch_spans)
            self._batch, self._batch_spans = [], 0

    def inject(self, headers: MutableMapping[str, str], exchange: Exchange) -> None:
        """Put the request's current span in the `traceparent` of a call to a worker (with the not-sampled
        flag when the request is not traced, so the engine records nothing either)."""
        trace = exchange.trace
        if trace is not None:
            events = trace.events
            # A call to a worker comes right after its span begins: that span is the last event.
            span = trace.base + len(events) if events[-1].__class__ is tuple else trace.current()
            # One hex call writes both ids, the dash between them too (after the trace id's 16 bytes).
            headers[TRACEPARENT] = "00-" + (trace.trace_id + span.to_bytes(8, "little")).hex("-", -16) + "-01"
        else:
            headers[TRACEPARENT] = self._not_sampled(exchange.headers)

    def _not_sampled(self, headers: Mapping[str, str]) -> str:
        client = parse_traceparent(headers.get(TRACEPARENT))
        if client is not None:
            return f"00-{client[0]}-{client[1]}-00"  # the client's trace, passed through
        return f"00-{self._bits(128) | 1:032x}-{self._bits(64) | 1:016x}-00"  # random bits: no system call

    def shutdown(self) -> None:
        """Send what is queued and stop (at gateway stop)."""
        if self.on:
            self.ship()
            self.exporter.shutdown()
