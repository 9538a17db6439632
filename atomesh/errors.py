"""The one error hierarchy of the gateway: each error knows its HTTP status and OpenAI type/code.

Handlers and the request path raise these; one middleware (atomesh.api.middleware) renders them
as `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class GatewayError(Exception):
    """Base of every error that becomes an HTTP response."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]
        if status is not None:
            self.status = status  # type: ignore[misc]

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str | int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class TooManyRequests(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class NotServed(GatewayError):
    """A route the gateway knows but does not serve in this mode."""

    status = 501
    type = "invalid_request_error"
    code = "route_not_served"


class LoopDetected(GatewayError):
    """A request the gateway itself sent came back to it (it is registered as its own worker)."""

    status = 508
    type = "invalid_request_error"
    code = "loop_detected"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class NoWorkerAvailable(ServiceUnavailable):
    code = "no_available_workers"


class ShuttingDown(ServiceUnavailable):
    code = "shutting_down"


class UpstreamError(GatewayError):
    """The worker could not be reached or broke the connection."""

    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"

    def __init__(
        self, message: str, *, code: str | None = None, status: int | None = None, retryable: bool = True
    ) -> None:
        super().__init__(message, code=code, status=status)
        self.retryable = retryable
        # The worker at fault, set by the backend that called it (for breakers and retries).
        self.worker: Any = None


class UpstreamUnreachable(UpstreamError):
    """No connection could be made to the worker (refused, unroutable, connect timeout)."""


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamStatus(UpstreamError):
    """The worker answered with an error status; its body is passed to the client as it was."""

    code = "upstream_status"

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"worker answered {status}", status=status, retryable=status in RETRYABLE_STATUSES)
        self.upstream_body = body
        self.content_type = content_type


def upstream_error_code(body: bytes) -> str | None:
    """The ``error.code`` of a worker's OpenAI-shaped error body, or None (not JSON, not that shape, not a string)."""
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


# Upstream statuses worth another attempt (as SMG retries them; docs/workers.md).
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
