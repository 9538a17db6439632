"""Cross-cutting HTTP concerns: request ids, the one error-to-response mapping, HTTP metrics, the access log."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from atomesh.errors import GatewayError, LoopDetected, UpstreamStatus, error_body
from atomesh.logs import AccessLog
from atomesh.metrics import ENDPOINTS, Metrics
from atomesh.transport import HOP_HEADER

LOOP_MESSAGE = "this request came from this gateway: a worker URL points back at the gateway itself"

log = structlog.get_logger("atomesh.api")

# The status counted and logged for a request whose client went away before any answer (as nginx).
CLIENT_GONE = 499

REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)

# aiohttp's own HTTP errors, in OpenAI shape.
_HTTP_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "payload_too_large"),
}


def request_ids() -> Callable[[], str]:
    """Cheap unique ids: a random per-process prefix and a counter (os.urandom per request is a syscall)."""
    prefix = os.urandom(8).hex()
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter):08x}"


def json_error(status: int, message: str, type_: str, code: str | int, request_id: str) -> web.Response:
    return web.Response(
        body=error_body(message, type_, code),
        status=status,
        headers={"Content-Type": "application/json", "x-request-id": request_id},
    )


def error_answer(err: GatewayError) -> tuple[int, bytes]:
    """The one place a GatewayError becomes an answer: its status and OpenAI-shaped JSON body."""
    if isinstance(err, UpstreamStatus):
        # Pass the worker's own error through: it knows best what was wrong with the request.
        if err.content_type == "application/json" and err.upstream_body:
            return err.status, err.upstream_body
        text = err.upstream_body[:500].decode("utf-8", "replace").strip()
        message = f"worker answered {err.status}" + (f": {text}" if text else "")
        return err.status, error_body(message, err.type, err.code)
    return err.status, err.body()


def render(err: GatewayError, request_id: str) -> web.Response:
    status, body = error_answer(err)
    return web.Response(
        body=body, status=status, headers={"Content-Type": "application/json", "x-request-id": request_id}
    )


# Admission refusals, by error code -> `mesh_http_rate_limit_total{result}`.
_ADMISSION_RESULTS = {"queue_full": "rejected", "rate_limited": "rejected", "queue_timeout": "timeout"}
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})


class HttpAccounting:
    """What every request does to the books, whichever server took it (aiohttp or the front door):
    its request id, the `mesh_http_*` metrics, the error-to-response mapping and the failure log."""

    def __init__(
        self,
        request_id_headers: Sequence[str],
        metrics: Metrics,
        max_payload: int,
        instance_id: str = "",
        access_log_sample_rate: float = 1.0,
        access_log: AccessLog | None = None,
    ) -> None:
        self.instance_id = instance_id  # the gateway's hop mark (atomesh.transport.HOP_HEADER)
        # Share of successful requests logged (errors always are, unless the access log is off: 0).
        self.sample_rate = access_log_sample_rate
        self.id_headers = tuple(h.lower() for h in request_id_headers)
        self.metrics = metrics
        self.max_payload = max_payload
        self.next_id = request_ids()
        # Batched (written off the request path) where the server passes one; else each line at once.
        self.access_log = access_log if access_log is not None else AccessLog(batched=False)
        # Whether a line is written at all (at --log-level warn a batched access log writes none).
        self.logging = self.sample_rate > 0 and (not self.access_log.fast or self.access_log.enabled)

    def request_id(self, headers: Mapping[str, str]) -> str:
        """The caller's id from the configured headers (looked up lower-case), or a new one."""
        for h in self.id_headers:
            if rid := headers.get(h):
                return rid
        return self.next_id()

    def begin(self, method: str, path: str) -> float:
        # Labels are the route pattern (never the raw path, which may carry ids) and a known method.
        self.metrics.http_received(method if method in _METHODS else "OTHER", path)
        return time.perf_counter()

    def end(
        self,
        method: str,
        path: str,
        status: int,
        started: float,
        admission: str | None,
        request_id: str = "",
        workers: Sequence[str] = (),
        sent: int = 0,
        target: str | None = None,
    ) -> None:
        """One request answered (or abandoned by its client: `status` 499, or that of the stream it cut):
        the metrics and the access log line. `admission` is the admission result of an inference
        request (None for other routes); `target` the raw path, when it is not the route's own."""
        elapsed = time.perf_counter() - started
        self.metrics.http_answered(method if method in _METHODS else "OTHER", path, status, admission, elapsed)
        if self.logging and (status >= 400 or self.sample_rate >= 1 or random.random() < self.sample_rate):
            self.access_log.write(
                request_id, method, target or path, status, ",".join(workers) or None, round(elapsed * 1000, 3), sent
            )

    def refused(self, status: int, request_id: str | None = None, target: bytes = b"", sent: int = 0) -> None:
        """A request the front door answered itself, its head or body at fault (no route is known)."""
        self.metrics.http_responses.labels("unmatched", str(status)).inc()
        if self.logging:
            self.access_log.write(
                request_id, None, _bare_path(target.decode("latin-1")) or None, status, None, None, sent
            )

    def close(self) -> None:
        """Write the access log lines still waiting."""
        self.access_log.close()

    @staticmethod
    def failed(err: GatewayError) -> str:
        """Log a gateway-side failure; returns the admission result the error stands for."""
        if err.status >= 500:
            log.warning("request_failed", status=err.status, code=err.code, error=err.message)
        return _ADMISSION_RESULTS.get(err.code, "allowed")


def _bare_path(target: str) -> str:
    """A request target without its query (which may carry tokens), bounded for a log line."""
    return target.partition("?")[0][:512]


def make_middleware(accounting: HttpAccounting) -> Middleware:
    acc = accounting

    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = acc.request_id(request.headers)
        request[REQUEST_ID] = rid
        # aiohttp runs every request in a task of its own, with its own copy of the context: binding
        # here cannot leak into another request, so there is nothing to unbind afterwards.
        structlog.contextvars.bind_contextvars(request_id=rid)
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else "unmatched"
        method = request.method
        started = acc.begin(method, path)
        admission = "allowed" if path in ENDPOINTS else None
        try:
            if request.headers.get(HOP_HEADER) == acc.instance_id:
                raise LoopDetected(LOOP_MESSAGE)
            resp = await handler(request)
        except GatewayError as e:
            result = acc.failed(e)
            admission = admission and result
            resp = render(e, rid)
        except web.HTTPException as e:
            if e.status < 400:
                acc.metrics.http_active.dec()
                raise
            type_, code = _HTTP_TYPES.get(e.status, ("invalid_request_error", "http_error"))
            message = e.text if e.status != 404 else f"no route for {request.method} {request.path}"
            if e.status == 413:
                message = f"request body is larger than the {acc.max_payload} bytes allowed (--max-payload-size)"
            resp = json_error(e.status, message or e.reason, type_, code, rid)
        except Exception:
            # A bug, not a user error: log it with its traceback (and request id), answer a plain 500.
            log.exception("request_crashed", method=method, path=path)
            resp = json_error(500, "internal gateway error", "internal_error", "internal_error", rid)
        except BaseException:
            # Cancelled: the client went away before the answer was complete.
            acc.end(method, path, CLIENT_GONE, started, None, rid, target=_bare_path(request.path))
            raise
        if not resp.prepared:
            resp.headers.setdefault("x-request-id", rid)
        sent = resp.body_length if resp.prepared else (resp.content_length or 0)
        acc.end(method, path, resp.status, started, admission, rid, target=_bare_path(request.path), sent=sent)
        return resp

    return gateway_middleware
