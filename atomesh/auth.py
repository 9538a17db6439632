"""Who may call what: the inference key (`--api-key`) and the admin key (`--admin-api-key`).

As in SMG, `--api-key` guards inference and admin routes alike. `--admin-api-key` is for deployments
that want the admin routes closed and inference open (or behind a different key): when it is set,
only it opens the admin routes. Health probes, readiness and `/v1/models` are always open.
Keys are compared in constant time; a key never reaches a log line, a label or an error message.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from atomesh.errors import Unauthorized


def _bearer(key: str | None) -> bytes | None:
    return None if key is None else f"Bearer {key}".encode()


class Keys:
    """The configured keys, as the exact `Authorization` header values that match them."""

    __slots__ = ("admin", "inference")

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self.inference = _bearer(api_key)
        self.admin = _bearer(admin_api_key) if admin_api_key is not None else self.inference

    @staticmethod
    def _matches(expected: bytes, headers: Mapping[str, str]) -> bool:
        given = headers.get("authorization") or headers.get("Authorization") or ""
        return hmac.compare_digest(given.encode("latin-1", "replace"), expected)

    def check_inference(self, headers: Mapping[str, str]) -> None:
        """Raise Unauthorized unless the request may run inference (always allowed without --api-key)."""
        if self.inference is not None and not self._matches(self.inference, headers):
            raise Unauthorized("this route needs 'Authorization: Bearer <api key>'")

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """Raise Unauthorized unless the request may use the admin routes."""
        if self.admin is not None and not self._matches(self.admin, headers):
            raise Unauthorized("the admin API needs 'Authorization: Bearer <admin api key>'")
