"""CORS for browser clients (`--cors-allowed-origins`, as SMG).

A request whose `Origin` is allowed gets `Access-Control-Allow-Origin` (its origin, or `*` when every
origin is) on its answer, streams and errors included; a preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-Method`) is answered 204 by the front door itself. Nothing is added for other
origins: the browser then refuses the answer, as it should. No `Allow-Credentials`: API keys travel
in the `Authorization` header, which the preflight allows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

ALLOWED_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "authorization, content-type, x-request-id"
PREFLIGHT_MAX_AGE = "600"  # seconds a browser may cache a preflight answer
MAX_REQUESTED_HEADERS = 1024  # bytes of Access-Control-Request-Headers echoed back


def check_origin(origin: str) -> str:
    """`*`, or `scheme://host[:port]` without a path; returns it without a trailing slash, else ValueError."""
    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"CORS origin {origin!r} must be '*' or scheme://host[:port]")
    return origin.rstrip("/")


class Cors:
    """The allowed origins and the headers an answer or a preflight gets."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(o for o in origins if o != "*")

    def allow(self, origin: str | None) -> str | None:
        """The `Access-Control-Allow-Origin` value for a request from `origin`, or None."""
        if origin is None:
            return None
        if self.any:
            return "*"
        return origin if origin in self.origins else None

    def headers(self, request: Mapping[str, str]) -> dict[str, str]:
        """Headers to add to the answer of a request (headers looked up lower-case); {} when not allowed."""
        allowed = self.allow(request.get("origin"))
        if allowed is None:
            return {}
        return {
            "access-control-allow-origin": allowed,
            "access-control-expose-headers": "x-request-id",
            "vary": "Origin",
        }

    def preflight(self, method: bytes, request: Mapping[str, str]) -> dict[str, str] | None:
        """The headers of a 204 answering a preflight, or None when the request is no (allowed) preflight."""
        if method != b"OPTIONS" or "access-control-request-method" not in request:
            return None
        headers = self.headers(request)
        if not headers:
            return None
        asked = request.get("access-control-request-headers", "")
        headers.update(
            {
                "access-control-allow-methods": ALLOWED_METHODS,
                "access-control-allow-headers": asked[:MAX_REQUESTED_HEADERS] if asked else DEFAULT_ALLOWED_HEADERS,
                "access-control-max-age": PREFLIGHT_MAX_AGE,
            }
        )
        return headers
