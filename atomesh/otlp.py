"""OTLP/gRPC trace export written by hand: a request's spans, recorded as one flat record on the request
path (`atomesh.tracing`; the record is described below), shipped in batches to a sender process that
writes them as OTLP protobuf and sends them (`atomesh.otlp_sender`).

Gateway side: a request's record joins the batch when it ends (`atomesh.tracing`); half of
`OTEL_BSP_MAX_QUEUE_SIZE` spans (at least `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`), or what gathered in
`OTEL_BSP_SCHEDULE_DELAY`, goes as one frame in `marshal`'s format, which `SpanExporter`'s thread writes
to the sender's stdin. Sender side: each frame is cut into export batches of at most
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans and each is written as one opentelemetry-proto
`ExportTraceServiceRequest` (trace/v1/trace.proto, the collector's own), the fields written being the
ones the gateway's spans have (ids, name, kind, times, attributes, an error status), by the compiled
encoder (`atomesh/otlp_encode.c`, `atomesh.otlp_native`) or, without a C compiler, by `SpanEncoder`
here, which writes the same bytes (and is the reference the compiled one is tested against). In
`SpanEncoder` a span's name, kind and attributes are encoded once per distinct set of values and cached
(they repeat from request to request: route, model, worker, status), so a span costs one `struct.pack`
of its ids and times and a cache lookup.

The SDK's environment applies as it reads it: `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`,
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`, `_COMPRESSION` (gzip) and
`_TIMEOUT` (seconds), `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; any other
`OTEL_EXPORTER_OTLP_*` variable stops start-up by name. The two batch sizes' defaults are 4 times the
SDK's (`MAX_EXPORT_BATCH`, `MAX_QUEUE`: why there).
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import math
import os
import struct
import subprocess
import sys
import threading
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

import atomesh

log = structlog.get_logger("atomesh.tracing")

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3  # opentelemetry-proto's Span.SpanKind

# A frame is `marshal.dumps((anchor_ns, anchor, batch), 4)`: `time.time_ns()` and `time.monotonic()`
# read together as the batch leaves, and the batch, its requests' records one after the other in one
# flat list of strings, ints, floats, None and tuples (`marshal`'s cost is per object, so a record has
# no container of its own and a span no tuple). A record, as `atomesh.tracing.Trace` makes it:
#
#   prefix, parent, start, events..., route, request id, HTTP status, error code or None, end
#
# `prefix` is "00-<trace id>-<the request span id's first 7 bytes>" in lower-case hex (what its
# traceparents start with); the request span's id is those 7 bytes and a zero byte, and a child
# span's id is the request span's plus the index of its begin in the record (so a child whose begin
# is item i < 256 sends `prefix + f"{i:02x}-01"` upstream). An id's bytes are the 8 big-endian bytes
# of the int. `parent` is the client's span id in hex, or "". Times are `time.monotonic()` floats,
# which are cheap to read and to marshal; the sender makes them wall-clock nanoseconds,
# `anchor_ns + floor((t - anchor) * 1e9 + 0.5)`. Events are the child spans as they happened: a
# span's begin, its kind (an int) followed by its time and values (as many as `SPANS` names for the
# kind), and its end, a float (the end time); spans nest, so a begin's parent is the innermost span
# open then (or the request span), and an end closes the innermost open span. The route, a string,
# ends the events. The request span's model is the admission span's (it is known from there on), its
# workers the last attempt's; spans left open end with the request.
ADMISSION, ATTEMPT, PREFILL, DECODE, UPSTREAM = range(5)
# Each kind of child span: its name, OTLP kind, the keys of its begin event's values, constant attributes.
SPANS: tuple[tuple[str, int, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = (
    ("admission", KIND_INTERNAL, ("atomesh.class", "atomesh.tenant", "gen_ai.request.model"), ()),
    (
        "attempt",
        KIND_INTERNAL,
        ("atomesh.attempt", "atomesh.attempt.kind", "atomesh.placement.policy", "atomesh.placement.workers"),
        (),
    ),
    ("prefill", KIND_CLIENT, ("server.address",), (("atomesh.leg", "prefill"),)),
    ("decode", KIND_CLIENT, ("server.address",), (("atomesh.leg", "decode"),)),
    ("upstream", KIND_CLIENT, ("server.address",), (("atomesh.leg", "single"),)),
)
REQUEST_ID = "atomesh.request_id"  # the request span's attribute that differs with every request

_SMALL = [bytes((n,)) for n in range(0x80)]
_DOUBLE = struct.Struct("<Bd")
# A child span's ids and times, after its name, kind and attributes: trace_id (1) with span_id's tag
# (2), span_id, parent_span_id (4), start_time_unix_nano (7) and end_time_unix_nano (8), both fixed64.
_CHILD = struct.Struct("<20s8s2s8sBQBQ")
_CHILD_SIZE = _CHILD.size
_ROOT = struct.Struct("<20s8sBQBQ")  # the request span's: its parent goes apart (the client's, if any)
_ID = struct.Struct(">Q")
_U64 = (1 << 64) - 1
_VALUES = tuple(len(keys) for _, _, keys, _ in SPANS)  # the values of each kind of span's begin
_STATUS_ERROR = b"\x7a\x02\x18\x02"  # status (15) { code (3): STATUS_CODE_ERROR }
_CACHE_ENTRIES = 4096
_REQUEST_ID_KEY = b"\x0a" + bytes((len(REQUEST_ID),)) + REQUEST_ID.encode() + b"\x12"  # key, then value's tag


def varint(n: int) -> bytes:
    """A protobuf varint (a negative int64 as its 64-bit two's complement)."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    n &= 0xFFFF_FFFF_FFFF_FFFF
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte (field number << 3 | 2), length, payload."""
    return _SMALL[tag] + varint(len(payload)) + payload


def any_value(v: Any) -> bytes:
    """An AnyValue: string (1), bool (2), int (3), double (4) or an array (5) of those."""
    if isinstance(v, str):
        return field(0x0A, v.encode())
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return _DOUBLE.pack(0x21, v)
    if isinstance(v, (list, tuple)):
        return field(0x2A, b"".join(field(0x0A, any_value(x)) for x in v))
    return field(0x0A, str(v).encode())


def key_value(key: str, value: Any) -> bytes:
    """A KeyValue message's bytes: key (1), value (2)."""
    return field(0x0A, key.encode()) + field(0x12, any_value(value))


def attributes(pairs: Any) -> bytes:
    """Span.attributes (9): one KeyValue each."""
    return b"".join(field(0x4A, key_value(k, v)) for k, v in pairs)


class SpanEncoder:
    """Writes batches of requests' records (the sender's side) as `ExportTraceServiceRequest`s.

    A span's name, kind and attributes are encoded once per distinct set of values and cached: the
    same call site with the same values writes the same bytes."""

    def __init__(self, resource: tuple[tuple[str, str], ...]) -> None:
        self._resource = field(0x0A, b"".join(field(0x0A, key_value(k, v)) for k, v in resource))
        self._scope = field(0x0A, field(0x0A, b"atomesh") + field(0x12, atomesh.__version__.encode()))
        self._children: dict[tuple[Any, ...], bytes] = {}  # (kind, *values): the entry up to its ids
        self._roots: dict[tuple[Any, ...], bytes] = {}  # (route, model, status, workers, error): tail
        self._varints = [varint(n) for n in range(0x4000)]  # a request span's length: 2 bytes at most

    @property
    def resource(self) -> bytes:
        """ResourceSpans.resource (1), written."""
        return self._resource

    @property
    def scope(self) -> bytes:
        """ScopeSpans.scope (1), written."""
        return self._scope

    def export_requests(self, frame: bytes, max_spans: int) -> list[bytes]:
        """A frame's records (see above) as ExportTraceServiceRequests of at most `max_spans` spans each (a
        request's spans together in one)."""
        anchor_ns, anchor, items = marshal.loads(frame)
        return [
            self.export_request(items, batch, anchor_ns, anchor) for batch in export_batches(records(items), max_spans)
        ]

    def export_request(
        self, items: list[Any], batch: list[tuple[int, int, int]], anchor_ns: int, anchor: float
    ) -> bytes:
        """One ExportTraceServiceRequest holding the spans of the records `batch` finds in `items` (as
        `records` gives them; times turned into nanoseconds by the frame's anchor).

        One loop over the whole batch, its names bound once: a child span costs a cache lookup of
        its values (which gives its entry's tag, length, name, kind and attributes in one bytes
        object), one `struct.pack` of its ids and times, and two list appends."""
        out = [self._scope]
        append = out.append
        children, roots = self._children, self._roots
        child_head, root_tail = self._child_head, self._root_tail
        pack_child, pack_root, pack_id = _CHILD.pack, _ROOT.pack, _ID.pack
        small, varints, rid_key, rid_size = _SMALL, self._varints, _REQUEST_ID_KEY, len(_REQUEST_ID_KEY) + 3
        values, floor = _VALUES, math.floor
        for first, tail, _ in batch:
            prefix = items[first]
            ids = b"\x0a\x10" + bytes.fromhex(prefix[3:35]) + b"\x12\x08"  # trace_id (1), then span_id's tag (2)
            base = int(prefix[36:50], 16) << 8  # a child's id is base + the index of its begin in the record
            parent = items[first + 1]
            start = anchor_ns + floor((items[first + 2] - anchor) * 1e9 + 0.5)
            route, request_id, status, error, end = items[tail : tail + 5]
            end = anchor_ns + floor((end - anchor) * 1e9 + 0.5)
            model, workers = "", ()
            begun: list[tuple[int, int]] = []  # the open spans, innermost last: (begin's index, parent's id)
            up = base  # the innermost open span's id
            i = first + 3
            while i < tail or begun:
                if i < tail:
                    item = items[i]
                    if item.__class__ is not float:  # a begin
                        if item == ATTEMPT:
                            workers = items[i + 5]
                        elif item == ADMISSION:
                            model = items[i + 4] or ""
                        begun.append((i, up))
                        up = (base + i - first) & _U64
                        i += 2 + values[item]
                        continue
                    ended = anchor_ns + floor((item - anchor) * 1e9 + 0.5)
                    i += 1
                else:  # not ended (the request path always ends its spans): they end with the request
                    ended = end
                j, parent_id = begun.pop()
                kind = items[j]
                key = (kind, *items[j + 2 : j + 2 + values[kind]])
                append(children.get(key) or child_head(key))
                begin = anchor_ns + floor((items[j + 1] - anchor) * 1e9 + 0.5)
                append(pack_child(ids, pack_id(up), b"\x22\x08", pack_id(parent_id), 0x39, begin, 0x41, ended))
                up = parent_id
            tail_bytes = roots.get((route, model, status, workers, error)) or root_tail(
                route, model, status, workers, error
            )
            value = request_id.encode()
            n = len(value)
            head = pack_root(ids, pack_id(base), 0x39, start, 0x41, end)
            if parent:
                head += b"\x22\x08" + bytes.fromhex(parent)
            if n < 100:  # KeyValue {key, value {string_value}}, every length in one byte
                size = len(head) + len(tail_bytes) + n + rid_size + 2
                append(
                    b"".join(
                        (
                            b"\x12",
                            varints[size] if size < 0x4000 else varint(size),
                            head,
                            tail_bytes,
                            b"\x4a",
                            small[n + rid_size],
                            rid_key,
                            small[n + 2],
                            b"\x0a",
                            small[n],
                            value,
                        )
                    )
                )
            else:
                append(field(0x12, head + tail_bytes + field(0x4A, key_value(REQUEST_ID, request_id))))
        scope_spans = field(0x12, b"".join(out))  # ResourceSpans.scope_spans (2)
        return field(0x0A, self._resource + scope_spans)  # ExportTraceServiceRequest.resource_spans (1)

    def _root_tail(self, route: str, model: str, status: int, workers: tuple[str, ...], error: str | None) -> bytes:
        """The request span's name (5), kind (6), attributes (9) but its request id, and error status (15)."""
        pairs: list[tuple[str, Any]] = [("http.route", route)]
        if model:
            pairs.append(("gen_ai.request.model", model))
        pairs.append(("http.response.status_code", status))
        if workers:
            pairs.append(("atomesh.workers", workers))
        if error is not None:
            pairs.append(("error.type", error))
        tail = field(0x2A, f"POST {route}".encode()) + b"\x30" + _SMALL[KIND_SERVER] + attributes(pairs)
        if status >= 500:
            tail += _STATUS_ERROR
        if len(self._roots) >= _CACHE_ENTRIES:
            self._roots.clear()
        self._roots[(route, model, status, workers, error)] = tail
        return tail

    def _child_head(self, key: tuple[Any, ...]) -> bytes:
        """A child span's ScopeSpans.spans entry up to its ids and times: the entry's tag and length,
        the span's name (5), kind (6) and attributes (9) (a message's fields may come in any order)."""
        name, kind, keys, constant = SPANS[key[0]]
        tail = (
            field(0x2A, name.encode())
            + b"\x30"
            + _SMALL[kind]
            + attributes((*zip(keys, key[1:], strict=True), *constant))
        )
        head = b"\x12" + varint(_CHILD_SIZE + len(tail)) + tail
        if len(self._children) >= _CACHE_ENTRIES:
            self._children.clear()
        self._children[key] = head
        return head


def records(items: list[Any]) -> list[tuple[int, int, int]]:
    """Where a batch's records are in it: (the record's first item, its route's (the first after its
    events), its spans) each."""
    out = []
    i, n = 0, len(items)
    while i < n:
        first = i
        i += 3
        spans = 1
        while (item := items[i]).__class__ is not str:
            if item.__class__ is float:
                i += 1
            else:
                i += 2 + _VALUES[item]
                spans += 1
        out.append((first, i, spans))
        i += 5
    return out


def export_batches(found: list[tuple[int, int, int]], max_spans: int) -> list[list[tuple[int, int, int]]]:
    """The records (as `records` finds them) in export batches of at most `max_spans` spans (a request's
    spans stay together)."""
    batches: list[list[tuple[int, int, int]]] = [[]]
    spans = 0
    for record in found:
        n = record[2]
        if spans + n > max_spans and batches[-1]:
            batches.append([])
            spans = 0
        batches[-1].append(record)
        spans += n
    return batches


# The defaults of OTEL_BSP_MAX_EXPORT_BATCH_SIZE and OTEL_BSP_MAX_QUEUE_SIZE: 4 times the SDK's (512 and
# 2048). An export call costs the sender about 1.4 ms of CPU whatever it carries (gRPC's client, woken
# from idle), the spans' compiled encoding about 1 us a request: at 512 spans a call (128 requests) the calls
# were most of the sender's CPU a request. 2048 spans (512 of the gateway's requests, about 400 KB)
# stay well under gRPC's and the collector's 4 MiB message limit; the queue keeps its 4:1 ratio.
MAX_EXPORT_BATCH, MAX_QUEUE = 2048, 8192


@dataclass(frozen=True, slots=True)
class ExporterSettings:
    """Where and how spans are sent (from `--otlp-traces-endpoint` and the SDK's environment)."""

    target: str  # HOST:PORT
    secure: bool  # https:// endpoints: TLS with the system's roots
    headers: tuple[tuple[str, str], ...]
    gzip: bool
    timeout_s: float
    schedule_delay_s: float
    max_queue: int
    max_batch: int
    resource: tuple[tuple[str, str], ...]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RuntimeError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise RuntimeError(f"{name}={raw!r} must be positive")
    return value


def _exporter_env(name: str) -> str | None:
    """`OTEL_EXPORTER_OTLP_TRACES_<name>`, else `OTEL_EXPORTER_OTLP_<name>` (the SDK's order)."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}", os.environ.get(f"OTEL_EXPORTER_OTLP_{name}"))


def _pairs(raw: str, what: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` with URL-encoded values (the SDK's headers and resource attributes)."""
    out = []
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RuntimeError(f"{what}: {item!r} is not key=value")
        out.append(
            (key.strip().lower() if what.endswith("HEADERS") else key.strip(), urllib.parse.unquote(value.strip()))
        )
    return tuple(out)


def exporter_settings(endpoint: str, service: str = "atomesh-gateway") -> ExporterSettings:
    """The settings for `endpoint` and the environment; a setting not honoured stops start-up by name."""
    for name in os.environ:
        if name.startswith("OTEL_EXPORTER_OTLP_"):
            setting = name.removeprefix("OTEL_EXPORTER_OTLP_").removeprefix("TRACES_")
            if setting not in ("HEADERS", "COMPRESSION", "TIMEOUT", "PROTOCOL"):
                raise RuntimeError(
                    f"{name} is not honoured by the gateway's OTLP exporter (it honours _HEADERS, "
                    "_COMPRESSION, _TIMEOUT and _PROTOCOL grpc; the endpoint is "
                    "--otlp-traces-endpoint)"
                )
    protocol = _exporter_env("PROTOCOL")
    if protocol not in (None, "grpc"):
        raise RuntimeError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: the gateway exports over OTLP/gRPC only")
    compression = (_exporter_env("COMPRESSION") or "none").lower()
    if compression not in ("none", "gzip"):
        raise RuntimeError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression}: gzip or none")
    timeout = _exporter_env("TIMEOUT")
    try:
        timeout_s = float(timeout) if timeout is not None else 10.0
    except ValueError:
        raise RuntimeError(f"OTEL_EXPORTER_OTLP_TIMEOUT={timeout!r} is not a number of seconds") from None
    secure = endpoint.startswith("https://")
    target = endpoint.removeprefix("https://").removeprefix("http://").removeprefix("grpc://").rstrip("/")
    resource = dict(_pairs(os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES"))
    resource["service.name"] = os.environ.get("OTEL_SERVICE_NAME") or service
    resource.setdefault("telemetry.sdk.language", "python")
    resource.setdefault("telemetry.sdk.name", "atomesh")
    resource.setdefault("telemetry.sdk.version", atomesh.__version__)
    max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUE)
    return ExporterSettings(
        target=target,
        secure=secure,
        gzip=compression == "gzip",
        timeout_s=timeout_s,
        headers=_pairs(_exporter_env("HEADERS") or "", "OTEL_EXPORTER_OTLP_HEADERS"),
        schedule_delay_s=_env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
        max_queue=max_queue,
        max_batch=min(max_queue, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_EXPORT_BATCH)),
        resource=tuple(resource.items()),
    )


class SpanExporter:
    """The sender process, and the thread that writes batches to it.

    A batch comes as one `marshal` frame (`atomesh.tracing.Recorder.frame`: a 4-byte big-endian length,
    then `(anchor_ns, anchor, [records' items...])`), written to the sender's stdin
    (`atomesh.otlp_sender`: the encoding, the gRPC client and its retries run there). The
    writes block while the pipe is full, so they run on a thread; a batch that would put more than
    `max_queue` spans in waiting (the collector slow or away) is dropped and counted."""

    def __init__(self, settings: ExporterSettings) -> None:
        if importlib.util.find_spec("grpc") is None:
            raise RuntimeError("--enable-trace needs grpcio (pip install 'atomesh[tracing]')")
        self.settings = settings
        self._frames: deque[tuple[bytes, int]] = deque()  # (frame, spans), for the writer
        # Spans sent so far (the event loop's count) and written or lost so far (the writer's).
        self._sent = self._written = 0
        self.dropped = 0  # spans not handed over: the queue was full, or the sender had gone
        self.handed = 0  # spans handed to the sender
        self._wake = threading.Event()
        self._stopping = False
        config = {
            "target": settings.target,
            "secure": settings.secure,
            "headers": settings.headers,
            "gzip": settings.gzip,
            "timeout_s": settings.timeout_s,
            "max_batch": settings.max_batch,
            "resource": settings.resource,
        }
        self._sender = subprocess.Popen(
            [sys.executable, "-m", "atomesh.otlp_sender", json.dumps(config)], stdin=subprocess.PIPE
        )
        self._thread = threading.Thread(target=self._write, name="atomesh-otlp-export", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Spans sent, not yet written to the sender."""
        return self._sent - self._written

    def send(self, frame: bytes, spans: int) -> None:
        """Hand one batch of `spans` spans to the writer thread (from the event loop)."""
        if self._sent - self._written + spans > self.settings.max_queue:
            self.dropped += spans
            return
        self._frames.append((frame, spans))
        self._sent += spans
        self._wake.set()

    def _write(self) -> None:
        frames = self._frames
        while True:
            self._wake.wait()
            self._wake.clear()
            stopping = self._stopping
            while frames:
                frame, spans = frames.popleft()
                try:
                    assert self._sender.stdin is not None
                    self._sender.stdin.write(frame)  # blocks while the pipe is full
                    self._sender.stdin.flush()
                    self.handed += spans
                except (BrokenPipeError, ValueError):
                    self.dropped += spans
                    log.warning("otlp_sender_gone", returncode=self._sender.poll())
                self._written += spans
            if stopping:
                return

    def shutdown(self) -> None:
        """Write what was sent, then let the sender send it (within the export timeout) and exit."""
        self._stopping = True
        self._wake.set()
        self._thread.join(self.settings.timeout_s + 1)
        if self._sender.stdin is not None:
            try:
                self._sender.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._sender.wait(self.settings.timeout_s + 2)
        except subprocess.TimeoutExpired:
            self._sender.kill()
            self._sender.wait()
        if self.dropped:
            log.warning("otlp_spans_dropped", spans=self.dropped, handed=self.handed)
