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
engines record nothing either). A sampled request's `Trace` records its spans as a record: one flat
run of strings, ints and floats (`atomesh.otlp` describes it), its ids as the hex its `traceparent`s
start with, its times from the monotonic clock; no span objects, no attribute dicts, no container per
span. When the request ends its record joins the batch; a batch goes to a sender process as one
`marshal` frame, and the sender writes the OTLP protobuf and sends it (`otlp.py`, `otlp_sender.py`).

The recorder (`Recorder`: the traces, the batch, the ids) is compiled (`atomesh/trace_record.c`, built on
first use and cached as the native relay is), which writes each record straight into the frame's
bytes: a hook is one call into C. Where it cannot be built it is `PyRecorder` here, which makes the
same records as Python objects and `marshal`s the batch (tracing then adds about 3 times the
instructions to a request; the gateway logs why once). The OpenTelemetry SDK's span objects, processor
and encoder cost more than the gateway's whole request path, so none of them is used here.
"""

from __future__ import annotations

import asyncio
import marshal
import os
import random
import re
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from atomesh.native import build_extension
from atomesh.otlp import ADMISSION, ATTEMPT, DECODE, PREFILL, SPANS, UPSTREAM, SpanExporter, exporter_settings
from atomesh.request import Route
from atomesh.tenancy import PriorityClass

if TYPE_CHECKING:
    from atomesh.transport import Exchange

__all__ = ["ADMISSION", "ATTEMPT", "DECODE", "PREFILL", "UPSTREAM", "Recorder", "Trace", "Tracing"]

log = structlog.get_logger("atomesh.tracing")

TRACEPARENT = "traceparent"
_TRACEPARENT = re.compile(r"\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-\S*)?\s*", re.IGNORECASE)
_CLASSES = tuple(c.name.lower() for c in sorted(PriorityClass))  # by value: 0, 1, ...
_ROUTES = {r: r.value for r in Route}  # plain strings (an Enum's `value` is a property: slow)
_clock = time.monotonic  # a record's times; see atomesh.otlp
_VALUES = tuple(len(keys) for _, _, keys, _ in SPANS)  # the values of each kind of span's begin
# What follows a record's prefix in the traceparent of the span whose begin is item i (i < 256): the
# span id's last byte, and the sampled flag.
_SAMPLED = tuple(f"{i:02x}-01" for i in range(256))
_NONZERO = 1 | 1 << 128  # ids of random bytes (little-endian): a set bit in the trace id and in the span id
_U64 = (1 << 64) - 1
_SOURCE = Path(__file__).with_name("trace_record.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-fvisibility=hidden")


class Trace(Protocol):
    """The spans of one sampled request, as it runs (a `Recorder` makes it; the record `atomesh.otlp`
    describes).

    A child span begins with `trace.admission(...)`, `trace.attempt(...)` or `trace.leg(...)` and ends
    with `trace.end()` in a `finally`, which closes the innermost open span (not a `with` block: calling
    `__enter__` and `__exit__` costs as much again as the span)."""

    @property
    def spans(self) -> int:
        """The request span and the children begun."""

    def admission(self, model: str | None, cls: PriorityClass, tenant: str) -> None:
        """Waiting for admission begins (the model, known from here, goes on the request span too)."""

    def attempt(self, number: int, kind: str, policies: tuple[str, ...], workers: tuple[str, ...]) -> None:
        """One placement and its run begins (kind: first, retry or migration)."""

    def leg(self, leg: int, url: str) -> None:
        """A call to one worker begins (leg: PREFILL, DECODE or UPSTREAM)."""

    def end(self) -> None:
        """End the innermost open span."""

    def failed(self, status: int, code: str) -> None:
        """The request ends with the gateway's error (the request span's status and `error.type`)."""

    def traceparent(self) -> str:
        """The sampled `traceparent` naming the innermost open span (for a call to a worker)."""


class Recorder(Protocol):
    """The traces of one gateway process and their batch: `atomesh/trace_record.c`'s, or `PyRecorder`."""

    @property
    def spans(self) -> int:
        """The spans in the batch."""

    def trace(self, trace_id: str | None, parent: str) -> Trace:
        """A new request's trace, its span started now: in the client's trace (32 hex digits, its span
        `parent` in 16) or, with None and "", a new one."""

    def unsampled(self) -> str:
        """A `traceparent` of new random ids, flagged not sampled."""

    def add(self, trace: Trace, route: str, request_id: str, status: int) -> int:
        """The request ends: its record joins the batch, with its route, request id, status (`status`, or the
        refusal's when it failed) and end. Returns the batch's spans."""

    def frame(self, anchor_ns: int, anchor: float) -> bytes:
        """The batch as its sender reads it (a 4-byte big-endian length, then the `marshal`led frame, with the
        clocks' anchor: `time.time_ns()` and `time.monotonic()` read together), and empty it."""


class PyTrace:
    """`Trace` in Python: `items` is its record so far (prefix, parent, start, then begins and ends). Made by
    `PyRecorder.trace` only (no `__init__`: calling one costs as much as a span)."""

    __slots__ = ("error", "items", "spans", "status")

    items: list[Any]
    spans: int
    status: int  # the refusal's HTTP status, when `error` is set
    error: str | None  # the gateway's error code when it refused or failed the request, else None

    def admission(self, model: str | None, cls: PriorityClass, tenant: str) -> None:
        self.items += (ADMISSION, _clock(), _CLASSES[cls], tenant, model)
        self.spans += 1

    def attempt(self, number: int, kind: str, policies: tuple[str, ...], workers: tuple[str, ...]) -> None:
        self.items += (ATTEMPT, _clock(), number, kind, policies, workers)
        self.spans += 1

    def leg(self, leg: int, url: str) -> None:
        self.items += (leg, _clock(), url)
        self.spans += 1

    def end(self) -> None:
        self.items.append(_clock())

    def failed(self, status: int, code: str) -> None:
        self.status, self.error = status, code

    def traceparent(self) -> str:
        items = self.items
        # A call to a worker comes right after its leg begins: the leg's kind (the only int three items from
        # the end of a record), time and address are the last items.
        span = len(items) - 3
        if items[span].__class__ is not int:
            span = self.current()
        prefix: str = items[0]
        if span < 256:
            return prefix + _SAMPLED[span]
        return f"{prefix[:36]}{((int(prefix[36:], 16) << 8) + span) & _U64:016x}-01"

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


class PyRecorder:
    """`Recorder` in Python (where `atomesh/trace_record.c` cannot be built): the batch is a list of the
    records' items, `marshal`led when it leaves; ids are random bits from Python's `random` (no system
    call)."""

    def __init__(self) -> None:
        self._bits = random.Random().getrandbits  # seeded from os.urandom
        self._items: list[Any] = []
        self.spans = 0

    def trace(self, trace_id: str | None, parent: str) -> PyTrace:
        # One hex call writes the trace id, a dash, and the request span id's first 7 bytes.
        ids = (self._bits(184) | _NONZERO).to_bytes(23, "little").hex("-", -16)
        trace = PyTrace()
        trace.items = ["00-" + ids if trace_id is None else "00-" + trace_id + ids[32:], parent, _clock()]
        trace.spans = 1
        trace.error = None
        return trace

    def unsampled(self) -> str:
        return "00-" + (self._bits(192) | _NONZERO).to_bytes(24, "little").hex("-", -16) + "-00"

    def add(self, trace: Trace, route: str, request_id: str, status: int) -> int:
        assert isinstance(trace, PyTrace)
        error = trace.error
        items = self._items
        items += trace.items
        items += (route, request_id, trace.status if error is not None else status, error, _clock())
        self.spans += trace.spans
        return self.spans

    def frame(self, anchor_ns: int, anchor: float) -> bytes:
        frame = marshal.dumps((anchor_ns, anchor, self._items), 4)
        self._items, self.spans = [], 0
        return len(frame).to_bytes(4, "big") + frame


def native_recorder(cache_dir: Path | None = None) -> tuple[Recorder | None, str]:
    """`atomesh/trace_record.c`'s recorder (compiled once per source and Python, kept under `cache_dir`, by
    default `$XDG_CACHE_HOME/atomesh` or `~/.cache/atomesh`), or None and why not."""
    module, why_not = build_extension(_SOURCE, "_atomesh_trace", _FLAGS, what="trace recorder", cache_dir=cache_dir)
    if module is None:
        return None, why_not
    recorder: Recorder = module.Recorder(_CLASSES)
    return recorder, ""


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

    def __init__(
        self, endpoint: str | None, service: str = "atomesh-gateway", recorder: Recorder | None = None
    ) -> None:
        """`recorder`: the compiled one by default, else `PyRecorder` (the reason logged)."""
        self.on = endpoint is not None
        if endpoint is None:
            return
        self.ratio = ratio_from_env()
        self._random = random.Random().random  # seeded from os.urandom
        if recorder is None:
            recorder, why_not = native_recorder()
            if recorder is None:
                log.warning("trace_recorder_in_python", reason=why_not)
                recorder = PyRecorder()
        self.recorder = recorder
        settings = exporter_settings(endpoint, service)
        # Records go to the sender in frames of up to half the queue's bound (and at least one export
        # batch), which it sends in export batches: the sender wakes once for several batches (about a
        # third of its CPU a request at 128 requests a frame was waking up cold).
        self._hand_over = max(settings.max_batch, settings.max_queue // 2)
        self._delay = settings.schedule_delay_s
        self._timer: asyncio.TimerHandle | None = None  # the batch's schedule, while it has records
        self.exporter = SpanExporter(settings)  # starts the sender process and its writer thread; `shutdown` stops them

    # ------------------------------------------------------------------ the request path
    def start(self, exchange: Exchange) -> Trace | None:
        """The trace of a request that is sampled, also set as `exchange.trace`; None for one that is not."""
        value = exchange.headers.get(TRACEPARENT)
        client = None if value is None else parse_traceparent(value)
        if client is None:
            if self.ratio < 1.0 and self._random() >= self.ratio:
                return None
            trace = exchange.trace = self.recorder.trace(None, "")
        elif client[2]:
            trace = exchange.trace = self.recorder.trace(client[0], client[1])
        else:
            return None  # the client's trace, not sampled
        return trace

    def finish(self, trace: Trace, route: Route, exchange: Exchange) -> None:
        """End the request span and put the request's record in the batch; a full batch leaves."""
        if self.recorder.add(trace, _ROUTES[route], exchange.request_id, exchange.status or 0) >= self._hand_over:
            self.ship()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self.ship)

    def ship(self) -> None:
        """Send the batch to the sender process (on the event loop: when full, when due, and at stop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        spans = self.recorder.spans
        if spans:
            # The clocks' anchor: the sender turns the records' monotonic times into wall-clock times by it.
            self.exporter.send(self.recorder.frame(time.time_ns(), _clock()), spans)

    def inject(self, headers: MutableMapping[str, str], exchange: Exchange) -> None:
        """Put the request's current span in the `traceparent` of a call to a worker (with the not-sampled
        flag when the request is not traced, so the engine records nothing either)."""
        trace = exchange.trace
        if trace is not None:
            headers[TRACEPARENT] = trace.traceparent()
        elif (value := exchange.headers.get(TRACEPARENT)) is None:
            headers[TRACEPARENT] = self.recorder.unsampled()
        else:
            headers[TRACEPARENT] = self._not_sampled(value)

    def _not_sampled(self, value: str) -> str:
        client = parse_traceparent(value)
        if client is not None:
            return f"00-{client[0]}-{client[1]}-00"  # the client's trace, passed through
        return self.recorder.unsampled()

    def shutdown(self) -> None:
        """Send what is queued and stop (at gateway stop)."""
        if self.on:
            self.ship()
            self.exporter.shutdown()
