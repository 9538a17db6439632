"""Cross-cutting HTTP concerns: request ids, the one error-to-response mapping, HTTP metrics."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from atomesh.errors import GatewayError, UpstreamStatus, error_body
from atomesh.metrics import ENDPOINTS, Metrics

log = structlog.get_logger("atomesh.api")

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
    return web.Response(body=error_body(message, type_, code), status=status,
                        headers={"Content-Type": "application/json", "x-request-id": request_id})


def render(err: GatewayError, request_id: str) -> web.Response:
    """The one place a GatewayError becomes an HTTP response."""
    if isinstance(err, UpstreamStatus):
        # Pass the worker's own error through: it knows best what was wrong with the request.
        if err.content_type == "application/json" and err.upstream_body:
            return web.Response(body=err.upstream_body, status=err.status,
                                headers={"Content-Type": "application/json", "x-request-id": request_id})
        text = err.upstream_body[:500].decode("utf-8", "replace").strip()
        message = f"worker answered {err.status}" + (f": {text}" if text else "")
        return json_error(err.status, message, err.type, err.code, request_id)
    return json_error(err.status, err.message, err.type, err.code, request_id)


# Admission refusals, by error code -> `mesh_http_rate_limit_total{result}`.
_ADMISSION_RESULTS = {"queue_full": "rejected", "rate_limited": "rejected", "queue_timeout": "timeout"}
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})


def make_middleware(request_id_headers: Sequence[str], metrics: Metrics, max_payload: int) -> Middleware:
    headers = tuple(request_id_headers)
    next_id = request_ids()
    child = metrics.child

    @web.middleware
    async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = None
        for h in headers:
            if rid := request.headers.get(h):
                break
        rid = rid or next_id()
        request[REQUEST_ID] = rid
        # aiohttp runs every request in a task of its own, with its own copy of the context: binding
        # here cannot leak into another request, so there is nothing to unbind afterwards.
        structlog.contextvars.bind_contextvars(request_id=rid)
        return await _serve(request, handler, rid)

    async def _serve(request: web.Request, handler: Handler, rid: str) -> web.StreamResponse:
        # Labels are the route pattern (never the raw path, which may carry ids) and a known method.
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else "unmatched"
        method = request.method if request.method in _METHODS else "OTHER"
        child(metrics.http_requests, method, path).inc()
        metrics.http_active.inc()
        started = time.perf_counter()
        inference = path in ENDPOINTS
        admission = "allowed"
        try:
            resp = await handler(request)
        except GatewayError as e:
            admission = _ADMISSION_RESULTS.get(e.code, admission)
            if e.status >= 500:
                log.warning("request_failed", status=e.status, code=e.code, error=e.message)
            resp = render(e, rid)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            type_, code = _HTTP_TYPES.get(e.status, ("invalid_request_error", "http_error"))
            message = e.text if e.status != 404 else f"no route for {request.method} {request.path}"
            if e.status == 413:
                message = f"request body is larger than the {max_payload} bytes allowed (--max-payload-size)"
            resp = json_error(e.status, message or e.reason, type_, code, rid)
        except Exception:
            # A bug, not a user error: log it with its traceback (and request id), answer a plain 500.
            log.exception("request_crashed", method=request.method, path=path)
            resp = json_error(500, "internal gateway error", "internal_error", "internal_error", rid)
        finally:
            metrics.http_active.dec()
        if not resp.prepared:
            resp.headers.setdefault("x-request-id", rid)
        if inference:
            child(metrics.rate_limit, admission).inc()
        child(metrics.http_responses, path, str(resp.status)).inc()
        child(metrics.http_duration, method, path).observe(time.perf_counter() - started)
        return resp

    return gateway_middleware
