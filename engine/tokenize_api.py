"""`/tokenize` and `/detokenize` in vLLM's shapes, and a refusal naming the pooling routes this engine
does not serve (it runs a causal LM: no embeddings, scores, classes or reranking).

Requests: `/tokenize` takes `prompt` (a string) or `messages` (a chat, rendered with the model's chat
template; `add_generation_prompt` defaults to true) and answers `{"count", "max_model_len", "tokens",
"token_strs": null}`: the ids the engine computes for that prompt. `/detokenize` takes `tokens` and
answers `{"prompt"}`. Both take an optional `model`, checked like every route's. The `/v1/` spellings
(SGLang's and the gateway's) are served too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.errors import InvalidRequestError
from engine.protocol import json_object
from engine.tokenizer import Tokenizer

# Routes of pooling / scoring models and of other APIs, refused with the reason (400, never a 5xx: a
# client's mistake must not count against the worker in a gateway's circuit breaker).
NOT_SERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "reranking",
    "/rerank": "reranking",
    "/v1/score": "scoring",
    "/v1/classify": "classification",
}


def _json(body: Any) -> web.Response:
    return web.json_response(body)


def add_routes(
    app: web.Application, tokenizer: Tokenizer, max_model_len: int, check_model: Callable[[str | None], None]
) -> None:
    """Register the routes on `app` (the engine's server)."""

    async def tokenize(request: web.Request) -> web.Response:
        body = json_object(await request.read())
        check_model(_model(body))
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidRequestError("'messages' must be a non-empty list of message objects")
            add = body.get("add_generation_prompt", True)
            if not isinstance(add, bool):
                raise InvalidRequestError("'add_generation_prompt' must be a boolean")
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=add)
            except (ValueError, TypeError) as exc:
                raise InvalidRequestError(str(exc)) from exc
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise InvalidRequestError("'prompt' (a string) or 'messages' is required")
        ids = tokenizer.encode(text)
        return _json({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(request: web.Request) -> web.Response:
        body = json_object(await request.read())
        check_model(_model(body))
        ids = body.get("tokens")
        vocab = tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("'tokens' (a list of token ids) is required")
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        return _json({"prompt": tokenizer.decode(ids)})

    def refuse(what: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            raise InvalidRequestError(
                f"{request.path} is not served: this engine runs a causal language model "
                f"(text generation), not a model for {what}"
            )

        return handler

    for prefix in ("", "/v1"):
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)
    for path, what in NOT_SERVED.items():
        app.router.add_post(path, refuse(what))


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("'model' must be a string")
    return model
