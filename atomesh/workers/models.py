"""The model names clients may send: the served ones, their `--model-alias` names, or none at all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from atomesh.errors import BadRequest
from atomesh.request import Route
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import WorkerRole

# Routes whose bodies name a model the OpenAI way (SGLang's /generate names none).
_NAMED_ROUTES = frozenset(r for r in Route if r is not Route.GENERATE)


class ModelNames:
    """Resolves a request's `model` before placement: an alias becomes its canonical name (SMG's
    `--model-alias`), and a request naming none gets the one model the workers serve (several: 400)."""

    def __init__(self, registry: WorkerRegistry, role: WorkerRole, aliases: Mapping[str, str]) -> None:
        self.registry = registry
        self.role = role  # the pool whose workers' models answer /v1/models (decode in P/D mode)
        self.aliases = dict(aliases)

    def served(self) -> list[str]:
        return sorted({m for w in self.registry.ready(self.role) for m in w.models})

    def resolve(self, route: Route, body: dict[str, Any], raw: bytes | bytearray) -> bytes | bytearray:
        """Rewrite `body["model"]` in place where needed; return the body to forward (`raw` if unchanged)."""
        if route not in _NAMED_ROUTES:
            return raw
        model = body.get("model")
        if isinstance(model, str):
            canonical = self.aliases.get(model)
            if canonical is None:
                return raw
            body["model"] = canonical
            return orjson.dumps(body)
        if model is not None:
            return raw  # not a string: validation's business, not a name to resolve
        served = self.served()
        if len(served) > 1:
            raise BadRequest(
                f"the request names no model and this gateway serves several: {', '.join(served)}; "
                "set `model` to one of them",
                code="model_required",
            )
        if not served:
            return raw  # the workers advertise no name: they answer for their one model
        body["model"] = served[0]
        return orjson.dumps(body)

    def listed(self) -> list[tuple[str, str]]:
        """(id, root) of every name /v1/models shows: each served model, then each alias of one."""
        served = self.served()
        return [*((m, m) for m in served), *((a, c) for a, c in self.aliases.items() if c in served)]
