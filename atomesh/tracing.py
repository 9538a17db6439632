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
engines record nothing either), taken ready-made from a pool. A sampled request's `Trace` records its
spans as one flat list of strings, ints and floats (the record `atomesh.otlp` describes): its ids as
the hex its `traceparent`s start with, taken from a pool of random ids made 256 at a time; its times
from the monotonic clock, as floats (the sender turns them into wall-clock nanoseconds); no span
objects, no attribute dicts, no tuple per span. When the request ends its record joins the batch, one
flat list; a batch goes to a sender process as one `marshal` frame, and the sender writes the OTLP
protobuf and sends it (`otlp.py`, `otlp_sender.py`). The OpenTelemetry SDK's span objects, processor
and encoder cost more than the gateway's whole request path, so none of them is used here.
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

from atomesh.otlp import ADMISSION, ATTEMPT, DECODE, PREFILL, SPANS, UPSTREAM, SpanExporter, exporter_settings
from atomesh.request import Route
from atomesh.tenancy import PriorityClass

if TYPE_CHECKING:
    from atomesh.transport import Exchange

__all__ = ["ADMISSION", "ATTEMPT", "DECODE", "PREFILL", "UPSTREAM", "Trace", "Tracing"]

TRACEPARENT = "traceparent"
_TRACEPARENT = re.compile(r"\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-\S*)?\s*", re.IGNORECASE)
_CLASSES = {c: c.name.lower() for c in PriorityClass}
_ROUTES = {r: r.value for r in Route}  # plain strings (an Enum's `value` is a property: slow)
_clock = time.monotonic  # a record's times; see atomesh.otlp
_VALUES = tuple(len(keys) for _, _, keys, _ in SPANS)  # the values of each kind of span's begin
# What follows a record's prefix in the traceparent of the span whose begin is item i (i < 256): the
# span id's last byte, and the sampled flag.
_SAMPLED = tuple(f"{i:02x}-01" for i in range(256))
_POOL = 256  # ids made at a time
_U64 = (1 << 64) - 1


class Trace:
    """The spans of one sampled request, as it runs: `items`, its record (`atomesh.otlp` describes it).

    A child span begins with `trace.admission(...)`, `trace.attempt(...)` or `trace.leg(...)`, which
    add its begin (kind, time, values) to the record, and ends with `trace.end()` in a `finally`, which
    adds its end time and so closes the innermost open span (not a `with` block: calling `__enter__`
    and `__exit__` costs as much again as the span). Made by `Tracing.start` only (no `__init__`:
    calling one costs as much as a span)."""

    __slots__ = ("error", "items", "spans", "status")

    items: list[Any]  # the record so far: prefix, parent, start, then begins and ends
    spans: int  # the request span and the children begun
    status: int  # the refusal's HTTP status, when `error` is set
    error: str | None  # the gateway's error code when it refused or failed the request, else None

    def admission(self, model: str | None, cls: PriorityClass, tenant: str) -> None:
        """Waiting for admission begins (the model, known from here, goes on the request span too)."""
        self.items += (ADMISSION, _clock(), _CLASSES[cls], tenant, model)
        self.spans += 1

    def attempt(self, number: int, kind: str, policies: tuple[str, ...], workers: tuple[str, ...]) -> None:
        """One placement and its run begins (kind: first, retry or migration)."""
        self.items += (ATTEMPT, _clock(), number, kind, policies, workers)
        self.spans += 1

    def leg(self, leg: int, url: str) -> None:
        """A call to one worker begins (leg: PREFILL, DECODE or UPSTREAM)."""
        self.items += (leg, _clock(), url)
        self.spans += 1

    def failed(self, status: int, code: str) -> None:
        """The request ends with the gateway's error (the request span's status and `error.type`)."""
        self.status, self.error = status, code

    def end(self) -> None:
        """End the innermost open span."""
        self.items.append(_clock())

    def current(self) -> int:
        """The innermost open span, as the index of its begin in `items` (0: the request span)."""
        items = self.items
        begun = [0]
        i, n = 3, len(items)
        while i < n:
            item = items[i]
            if item.__class__ is float:
                if len(begun) > 1:
                    begun.pop()
                i += 1
            else:
                begun.append(i)
                i += 2 + _VALUES[item]
        return begun[-1]

    def traceparent(self, span: int) -> str:
        """The sampled `traceparent` naming the span whose begin is item `span` (0: the request span)."""
        prefix: str = self.items[0]
        if span < 256:
            return prefix + _SAMPLED[span]
        return f"{prefix[:36]}{((int(prefix[36:], 16) << 8) + span) & _U64:016x}-01"


def random_ids(template: str, span_bytes: int, n: int = _POOL) -> list[str]:
    """`n` strings `template % (trace id, span id)` (`template` ending in a space), the ids random (16 and
    `span_bytes` bytes, in lower-case hex) and none all zeros (W3C: invalid)."""
    while True:
        data = os.urandom((16 + span_bytes) * n)
        traces = data[: 16 * n].hex(" ", 16).split()
        spans = data[16 * n :].hex(" ", span_bytes).split()
        if "0" * 32 not in traces and "0" * (2 * span_bytes) not in spans:
            break
    ids: list[str] = [""] * (2 * n)
    ids[::2], ids[1::2] = traces, spans
    return (template * n % tuple(ids)).split()


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
        self._random = random.Random().random  # seeded from os.urandom
        # Ids made _POOL at a time (one system call, a few C-level passes), taken one a request; filled on
        # first use, so that processes forked from this one draw their own.
        self._prefixes: list[str] = []  # "00-<trace id>-<the request span id's first 7 bytes>"
        self._unsampled: list[str] = []  # whole traceparents, flagged not sampled
        settings = exporter_settings(endpoint, service)
        # Records go to the sender in frames of up to half the queue's bound (and at least one export
        # batch), which it sends in export batches: the sender wakes once for several batches (about a
        # third of its CPU a request at 128 requests a frame was waking up cold).
        self._hand_over = max(settings.max_batch, settings.max_queue // 2)
        self._delay = settings.schedule_delay_s
        # The records of the requests ended since the last batch left (one flat list), and their spans.
        self._batch: list[Any] = []
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
            pool = self._prefixes
            prefix = pool.pop() if pool else self._new_prefix()
            parent = ""
        elif client[2]:
            prefix = "00-" + client[0] + (self._prefixes.pop() if self._prefixes else self._new_prefix())[35:]
            parent = client[1]
        else:
            return None  # the client's trace, not sampled
        trace = exchange.trace = Trace()
        trace.items = [prefix, parent, _clock()]
        trace.spans = 1
        trace.error = None
        return trace

    def _new_prefix(self) -> str:
        self._prefixes = random_ids("00-%s-%s ", 7)
        return self._prefixes.pop()

    def finish(self, trace: Trace, route: Route, exchange: Exchange) -> None:
        """End the request span and put the request's record in the batch; a full batch leaves."""
        error = trace.error
        batch = self._batch
        batch += trace.items
        batch += (
            _ROUTES[route],
            exchange.request_id,
            trace.status if error is not None else exchange.status or 0,
            error,
            _clock(),
        )
        self._batch_spans += trace.spans
        if self._batch_spans >= self._hand_over:
            self.ship()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self.ship)

    def ship(self) -> None:
        """Send the batch to the sender process (on the event loop: when full, when due, and at stop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batch:
            # The clocks' anchor: the sender turns the records' monotonic times into wall-clock times by it.
            frame = marshal.dumps((time.time_ns(), _clock(), self._batch), 4)
            self.exporter.send(len(frame).to_bytes(4, "big") + frame, self._batch_spans)
            self._batch, self._batch_spans = [], 0

    def inject(self, headers: MutableMapping[str, str], exchange: Exchange) -> None:
        """Put the request's current span in the `traceparent` of a call to a worker (with the not-sampled
        flag when the request is not traced, so the engine records nothing either)."""
        trace = exchange.trace
        if trace is not None:
            items = trace.items
            # A call to a worker comes right after its leg begins: the leg's kind (the only int three
            # items from the end of a record), time and address are the last items.
            span = len(items) - 3
            if items[span].__class__ is not int:
                span = trace.current()
            headers[TRACEPARENT] = items[0] + _SAMPLED[span] if span < 256 else trace.traceparent(span)
        else:
            headers[TRACEPARENT] = self._not_sampled(exchange.headers)

    def _not_sampled(self, headers: Mapping[str, str]) -> str:
        value = headers.get(TRACEPARENT)
        if value is not None:
            client = parse_traceparent(value)
            if client is not None:
                return f"00-{client[0]}-{client[1]}-00"  # the client's trace, passed through
        pool = self._unsampled
        if not pool:
            pool = self._unsampled = random_ids("00-%s-%s-00 ", 8)
        return pool.pop()

    def shutdown(self) -> None:
        """Send what is queued and stop (at gateway stop)."""
        if self.on:
            self.ship()
            self.exporter.shutdown()
