"""The gateway's OTLP/gRPC sender: a child process that encodes the gateway's trace batches and sends
them to the collector.

`python -m atomesh.otlp_sender SETTINGS_JSON`, started and stopped by `atomesh.otlp.SpanExporter`. It
reads frames from stdin (a 4-byte big-endian length, then a `marshal`led list of requests' records),
cuts each into export batches of at most `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans, writes each as one
`ExportTraceServiceRequest` (with the compiled encoder, `atomesh.otlp_native`, built on first use; without
a C compiler with `atomesh.otlp.SpanEncoder`, which writes the same bytes, and a warning saying why) and
sends it with one gRPC call, retrying
what the collector may get over (unavailable, overloaded) with backoff until the export timeout; at
the end of stdin it exits. The encoding and the gRPC client run here, not in the gateway: there they
would take the event loop's time, or contend with it for the interpreter lock.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any, BinaryIO

import structlog

from atomesh.otlp import SpanEncoder
from atomesh.otlp_native import NativeEncoder, build_encoder

log = structlog.get_logger("atomesh.tracing")
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _read(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def serve(settings: dict[str, Any], stream: BinaryIO) -> None:
    import grpc

    if settings["secure"]:
        channel = grpc.secure_channel(settings["target"], grpc.ssl_channel_credentials())
    else:
        channel = grpc.insecure_channel(settings["target"])
    # Bytes in, bytes out: the request is already encoded and the (empty) answer is not read.
    call = channel.unary_unary(_EXPORT_METHOD, request_serializer=None, response_deserializer=None)
    metadata = [tuple(h) for h in settings["headers"]] or None
    compression = grpc.Compression.Gzip if settings["gzip"] else None
    retryable = {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DATA_LOSS,
    }
    encoder = SpanEncoder(tuple((k, v) for k, v in settings["resource"]))
    native = None
    build = build_encoder()
    if build.library is not None:
        native = NativeEncoder(build.library, encoder.resource, encoder.scope)
    else:
        log.warning("otlp_encoder_in_python", reason=build.why_not)
    failed = 0
    max_spans = settings["max_batch"]
    while (head := _read(stream, 4)) is not None:
        frame = _read(stream, int.from_bytes(head, "big"))
        if frame is None:
            break
        requests = native.export_requests(frame, max_spans) if native is not None else None
        if requests is None:  # no compiler, or a frame the compiled encoder does not read: Python's says why
            requests = encoder.export_requests(frame, max_spans)
        for data in requests:
            failed += _export(call, data, settings, metadata, compression, retryable, failed)
    channel.close()


def _export(
    call: Any, data: bytes, settings: dict[str, Any], metadata: Any, compression: Any, retryable: set[Any], failed: int
) -> int:
    """Send one ExportTraceServiceRequest, retrying what the collector may get over (with backoff, until
    the export timeout); 1 if it failed, else 0."""
    import grpc

    deadline = time.monotonic() + settings["timeout_s"]
    backoff = 0.5
    while True:
        try:
            call(data, timeout=max(0.01, deadline - time.monotonic()), metadata=metadata, compression=compression)
            return 0
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code in retryable and time.monotonic() + backoff < deadline:
                time.sleep(backoff)
                backoff *= 2
                continue
            log.warning(
                "otlp_export_failed",
                endpoint=settings["target"],
                code=str(code),
                batches_failed=failed + 1,
                detail=e.details() if hasattr(e, "details") else str(e),
            )
            return 1


if __name__ == "__main__":
    # The gateway ends it by closing stdin, after handing over its last spans: a signal to the whole
    # process group (Ctrl-C, a supervisor's SIGTERM) must not drop them first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(json.loads(sys.argv[1]), sys.stdin.buffer)
