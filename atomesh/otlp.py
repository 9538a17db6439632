"""OTLP/gRPC trace export written by hand: spans encoded straight into protobuf bytes, sent in batches
by a sender process (`atomesh.otlp_sender`).

The wire format is opentelemetry-proto's `ExportTraceServiceRequest` (trace/v1/trace.proto), the
collector's own; the fields written are the ones the gateway's spans have (ids, name, kind, times,
attributes, an error status). An attribute's encoding is cached by key and value: most repeat from
request to request (route, model, worker, status), so a span costs a few byte joins.

The SDK's environment applies as it reads it: `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`,
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`, `_COMPRESSION` (gzip) and
`_TIMEOUT` (seconds), `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; any other
`OTEL_EXPORTER_OTLP_*` variable stops start-up by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import threading
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

import atomesh

if TYPE_CHECKING:
    from atomesh.tracing import RequestSpan

log = structlog.get_logger("atomesh.tracing")

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3  # opentelemetry-proto's Span.SpanKind
_SMALL = [bytes((n,)) for n in range(0x80)]
_TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano (7) and end_time_unix_nano (8), both fixed64
_DOUBLE = struct.Struct("<Bd")
_KINDS = [b"\x30" + bytes((k,)) for k in range(4)]  # kind (6)
_SMALL_FIELD2 = [b"\x12" + bytes((n,)) for n in range(0x80)]
_STATUS_ERROR = b"\x7a\x02\x18\x02"  # status (15) { code (3): STATUS_CODE_ERROR }
_CACHE_ENTRIES = 4096
REQUEST_ID = "atomesh.request_id"  # the request span's attribute that differs with every request
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


class SpanEncoder:
    """Writes a finished request's spans as `ScopeSpans.spans` entries (field 2, each length-prefixed).

    Encodings are cached: a span's name, kind and attributes whole, by their values (the same call site
    with the same values writes the same bytes), else each attribute's by key and value."""

    def __init__(self) -> None:
        self._attributes: dict[tuple[Any, ...], bytes] = {}
        self._blocks: dict[tuple[Any, ...], bytes] = {}

    def request(self, root: RequestSpan) -> bytes:
        ids = b"\x0a\x10" + root.trace_id + b"\x12\x08"  # trace_id (1), then span_id's tag (2)
        attrs = root.attributes
        # The request id is the one attribute new with every request: kept out of the cached block.
        request_id = attrs.pop(REQUEST_ID, None)
        status = attrs.get("http.response.status_code")
        tail = self._tail(root.name, root.kind, attrs)
        if request_id is not None:
            value = str(request_id).encode()
            n = len(value)
            if n < 100:  # KeyValue {key, value {string_value}}, every length in one byte
                tail += b"".join(
                    (
                        b"\x4a",
                        _SMALL[n + len(_REQUEST_ID_KEY) + 3],
                        _REQUEST_ID_KEY,
                        _SMALL[n + 2],
                        b"\x0a",
                        _SMALL[n],
                        value,
                    )
                )
            else:
                tail += field(0x4A, key_value(REQUEST_ID, request_id))
        if status.__class__ is int and status >= 500:
            tail += _STATUS_ERROR
        pack = _TIMES.pack
        out = [
            self._framed(
                (
                    ids,
                    root.span_id.to_bytes(8, "big"),
                    b"\x22\x08" + root.parent_id if root.parent_id else b"",
                    pack(0x39, root.start_ns, 0x41, root.end_ns),
                    tail,
                )
            )
        ]
        for s in root.children:
            parent = (s.parent or root).span_id
            out.append(
                self._framed(
                    (
                        ids,
                        s.span_id.to_bytes(8, "big"),
                        b"\x22\x08",
                        parent.to_bytes(8, "big"),
                        pack(0x39, s.start_ns, 0x41, s.end_ns),
                        self._tail(s.name, s.kind, s.attributes),
                    )
                )
            )
        return b"".join(out)

    def _tail(self, name: str, kind: int, attributes: dict[str, Any]) -> bytes:
        """A span's name (5), kind (6) and attributes (9), cached whole by their values where they are hashable."""
        key: tuple[Any, ...] | None = (name, kind, *attributes.items())
        blocks = self._blocks
        try:
            tail = blocks.get(key)  # type: ignore[arg-type]
        except TypeError:  # a list among the values
            key, tail = None, None
        if tail is None:
            tail = field(0x2A, name.encode()) + _KINDS[kind] + self._attribute_block(attributes)
            if key is not None:
                if len(blocks) >= _CACHE_ENTRIES:
                    blocks.clear()
                blocks[key] = tail
        return tail

    @staticmethod
    def _framed(parts: tuple[bytes, ...]) -> bytes:
        body = b"".join(parts)
        n = len(body)
        if n < 0x4000:  # ScopeSpans.spans (2), its length in two bytes at most
            return (_SMALL_FIELD2[n] if n < 0x80 else bytes((0x12, n & 0x7F | 0x80, n >> 7))) + body
        return field(0x12, body)

    def _attribute_block(self, attributes: dict[str, Any]) -> bytes:
        """Span.attributes (9), each attribute's encoding cached by key and value."""
        cache = self._attributes
        parts = []
        for k, v in attributes.items():
            cls = v.__class__
            # The class is part of the key where equal values differ in type (True == 1).
            key = (k, v) if cls is str else (k, tuple(v)) if cls is list else (k, v, cls)
            encoded = cache.get(key)
            if encoded is None:
                if len(cache) >= _CACHE_ENTRIES:  # per-request values (the request id) come and go
                    cache.clear()
                encoded = cache[key] = field(0x4A, key_value(k, v))
            parts.append(encoded)
        return b"".join(parts)


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
    max_queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
    return ExporterSettings(
        target=target,
        secure=secure,
        gzip=compression == "gzip",
        timeout_s=timeout_s,
        headers=_pairs(_exporter_env("HEADERS") or "", "OTEL_EXPORTER_OTLP_HEADERS"),
        schedule_delay_s=_env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
        max_queue=max_queue,
        max_batch=min(max_queue, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
        resource=tuple(resource.items()),
    )


class SpanExporter:
    """A bounded queue of encoded spans, the thread that hands them over in batches, and the sender process.

    A batch goes when `max_batch` spans wait or every `schedule_delay_s`, as one encoded
    ExportTraceServiceRequest written to the sender's stdin (`atomesh.otlp_sender`: the gRPC client and
    its retries run there). With `max_queue` spans waiting (the collector slow or away and the pipe
    full), new ones are dropped and counted."""

    def __init__(self, settings: ExporterSettings) -> None:
        if importlib.util.find_spec("grpc") is None:
            raise RuntimeError("--enable-trace needs grpcio (pip install 'atomesh[tracing]')")
        self.settings = settings
        resource = field(0x0A, b"".join(field(0x0A, key_value(k, v)) for k, v in settings.resource))
        self._resource = resource  # ResourceSpans.resource (1)
        self._scope = field(0x0A, field(0x0A, b"atomesh") + field(0x12, atomesh.__version__.encode()))
        self._queue: deque[tuple[bytes, int]] = deque()
        # Spans queued so far and taken out so far, each counter written by one thread only.
        self._added = self._taken = 0
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
        }
        self._sender = subprocess.Popen(
            [sys.executable, "-m", "atomesh.otlp_sender", json.dumps(config)], stdin=subprocess.PIPE
        )
        self._thread = threading.Thread(target=self._run, name="atomesh-otlp-export", daemon=True)
        self._thread.start()

    def add(self, spans: bytes, count: int) -> None:
        """Queue one request's `count` encoded spans (from the event loop: an append, and a wake-up once a
        batch is full)."""
        queued = self._added - self._taken + count
        if queued > self.settings.max_queue:
            self.dropped += count
            return
        self._queue.append((spans, count))
        self._added += count
        if queued >= self.settings.max_batch and not self._wake.is_set():
            self._wake.set()

    def request_bytes(self, spans: list[bytes]) -> bytes:
        """An ExportTraceServiceRequest holding `spans` (ScopeSpans.spans entries, as SpanEncoder writes)."""
        scope_spans = field(0x12, self._scope + b"".join(spans))
        return field(0x0A, self._resource + scope_spans)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.settings.schedule_delay_s)
            self._wake.clear()
            stopping = self._stopping
            self._drain()
            if stopping:
                return

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            batch: list[bytes] = []
            count = 0
            while queue and count < self.settings.max_batch:
                spans, n = queue.popleft()
                batch.append(spans)
                count += n
            data = self.request_bytes(batch)
            try:
                assert self._sender.stdin is not None
                self._sender.stdin.write(len(data).to_bytes(4, "big") + data)  # blocks while the pipe is full
                self._sender.stdin.flush()
                self.handed += count
            except (BrokenPipeError, ValueError):
                self.dropped += count
                log.warning("otlp_sender_gone", returncode=self._sender.poll())
            self._taken += count

    def shutdown(self) -> None:
        """Hand over what is queued, then let the sender send it (within the export timeout) and exit."""
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
