"""What the gateway knows about one inference request: parsed once, read by placement and backends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class Route(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    GENERATE = "/generate"
    RESPONSES = "/v1/responses"  # OpenAI's Responses API: relayed to workers that serve it (P/D: atom's engine)
    # Relayed in regular mode to a worker serving the model, as the worker answers them (SMG's set).
    MESSAGES = "/v1/messages"  # Anthropic's Messages API
    EMBEDDINGS = "/v1/embeddings"
    RERANK = "/v1/rerank"
    RERANK_SGLANG = "/rerank"
    SCORE = "/v1/score"
    CLASSIFY = "/v1/classify"
    TOKENIZE = "/v1/tokenize"
    DETOKENIZE = "/v1/detokenize"


# Routes relayed in regular mode only, and why P/D mode answers them 501.
_NOT_SPLIT = (
    "a request that generates nothing has no decode phase to split off: run such models as regular "
    "workers behind a gateway of their own"
)
REGULAR_ONLY: dict[Route, str] = {
    Route.MESSAGES: "an Anthropic Messages request is not split into prefill and decode legs (send it to "
    "/v1/chat/completions)",
    **{
        r: _NOT_SPLIT
        for r in (
            Route.EMBEDDINGS,
            Route.RERANK,
            Route.RERANK_SGLANG,
            Route.SCORE,
            Route.CLASSIFY,
            Route.TOKENIZE,
            Route.DETOKENIZE,
        )
    },
}


# Routes split into prefill and decode legs only by `--backend atom`: its engine takes kv_transfer_params
# on them (vLLM's and SGLang's Responses routes take no P/D fields).
ATOM_PD_ONLY: dict[Route, str] = {
    Route.RESPONSES: "with --backend atom only (its engine takes kv_transfer_params on /v1/responses; vLLM's and "
    "SGLang's do not): send /v1/chat/completions, or use --backend atom"
}


def pd_refusal(route: Route, backend: str) -> str | None:
    """Why a P/D gateway with `backend` answers `route` 501, or None when it relays it."""
    if route in REGULAR_ONLY:
        return f"POST {route.value} is relayed in regular mode only: {REGULAR_ONLY[route]}"
    if route in ATOM_PD_ONLY and backend != "atom":
        return f"POST {route.value} is split into prefill and decode legs {ATOM_PD_ONLY[route]}"
    return None


# Headers that carry a sticky routing key (sessions, users), first match wins (SMG's first).
ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-session-id", "x-routing-key", "x-user-id")
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(slots=True)
class RequestView:
    """A parsed inference request. `raw` is forwarded untouched unless a backend must rewrite it."""

    route: Route
    body: dict[str, Any]
    raw: bytes | bytearray  # as received (a large body is the buffer it arrived in)
    request_id: str
    routing_key: str | None = None
    # The client's request headers (lower-case names), for policies that read more of them.
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS, repr=False)
    model: str | None = field(init=False)  # the requested model name, if a string
    stream: bool = field(init=False)
    _locality_text: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        m = self.body.get("model")
        self.model = m if isinstance(m, str) else None
        self.stream = self.body.get("stream") is True

    @property
    def locality_text(self) -> str:
        """The text whose prefix decides cache locality: the prompt, or the whole conversation."""
        if self._locality_text is None:
            self._locality_text = _locality_text(self.route, self.body)
        return self._locality_text

    @property
    def input_length(self) -> int:
        """Approximate prompt length in characters (token ids count one each)."""
        ids = self.body.get("input_ids")
        if isinstance(ids, list):
            return len(ids)
        return len(self.locality_text)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: keep the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _responses_text(body: dict[str, Any]) -> str:
    """The instructions and input of a Responses API request (a string, or a list of message items)."""
    parts = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    items = body.get("input")
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list):
        for item in items[:4096]:
            if isinstance(item, dict):
                parts.append(f"<|{item.get('role', '')}|>{_content_text(item.get('content'))}")
    return "".join(parts)


def _locality_text(route: Route, body: dict[str, Any]) -> str:
    if route is Route.CHAT or route is Route.MESSAGES:
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                parts.append(f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}")
        return "".join(parts)
    if route is Route.RESPONSES:
        return _responses_text(body)
    prompt = body.get("prompt", body.get("text", body.get("input", body.get("query"))))
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str):
            return prompt[0]
        return " ".join(map(str, prompt[:4096]))
    if isinstance(prompt, str):
        return prompt
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return " ".join(map(str, ids[:4096]))
    return ""
