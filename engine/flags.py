"""Parsing shared by the engine's JSON-valued flags (``--kv-transfer-config``, ``--kv-events-config``)."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def json_object_flag(flag: str, text: str, known: Collection[str]) -> dict[str, Any]:
    """The JSON object a flag was given (empty text: ``{}``); ValueError naming the flag for bad JSON,
    a value that is not an object, or keys outside ``known``."""
    try:
        raw: Any = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{flag}: unsupported keys {unknown} (known: {sorted(known)})")
    return raw
