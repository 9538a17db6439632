"""``python -m engine.openai_server``: the ATOM-compatible OpenAI HTTP server of the engine.

Endpoints: POST /v1/completions, /v1/chat/completions, /generate (SSE when ``stream``), /flush_cache;
GET /v1/models, /health, /health_generate, /get_model_info, /metrics, /server_info, /kv_transfer_info.
Errors are OpenAI-shaped, rendered in one middleware from the engine's error hierarchy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.args import EngineArgs, parse_args
from engine.disagg import Disaggregation, check_transfer_support
from engine.errors import EngineError, InvalidRequestError, ModelNotFoundError
from engine.kv_events import ZmqEventPublisher, advertised
from engine.llm_engine import AsyncLLMEngine, LLMEngine, RequestOutput
from engine.metrics import ServerMetrics
from engine.sequence import SamplingParams

log = logging.getLogger("engine.server")

MAX_STOP_STRINGS = 16


# -- request bodies (pydantic at the edge only) ---------------------------------------------------


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    data_parallel_rank: int | None = None

    def refuse_unsupported(self) -> None:
        """Refuse, with a message naming it, every field we would otherwise have to ignore."""
        if self.n != 1 or (self.best_of is not None and self.best_of != 1):
            raise InvalidRequestError("only n=1 (and best_of=1) is supported")
        if self.logprobs not in (None, False) or self.top_logprobs:
            raise InvalidRequestError("logprobs are not supported by this engine")
        if self.echo:
            raise InvalidRequestError("echo is not supported by this engine")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise InvalidRequestError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.tools:
            raise InvalidRequestError("tools are not supported by this engine")
        if self.data_parallel_rank not in (None, 0):
            raise InvalidRequestError(f"data_parallel_rank {self.data_parallel_rank}: this engine has dp_size 1")
        kv = self.kv_transfer_params or {}
        if kv.get("do_remote_decode") and kv.get("do_remote_prefill"):
            raise InvalidRequestError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        if kv.get("do_remote_decode") and self.stream:
            raise InvalidRequestError("kv_transfer_params: a prefill for remote decode must have stream=false")

    @property
    def kv_role_needed(self) -> str | None:
        """The KV role this request needs of the engine: a remote-decode prefill or a remote-prefill decode."""
        kv = self.kv_transfer_params or {}
        if kv.get("do_remote_decode"):
            return "kv_producer"
        if kv.get("do_remote_prefill"):
            return "kv_consumer"
        return None

    def sampling_params(self) -> tuple[SamplingParams, bool]:
        """The engine's SamplingParams and whether the client set a token limit."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=limit if limit is not None else 1,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            stop=tuple(stops),
        )
        return params, limit is not None


class CompletionBody(_SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    """One chat message; ``content`` may be a string or OpenAI text parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequestError(f"message content of type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatBody(_SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)


class GenerateSampling(BaseModel):
    """SGLang's ``sampling_params`` of POST /generate (the fields this engine implements)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None


class GenerateBody(BaseModel):
    """POST /generate (SGLang's native route): one prompt as ``text`` or ``input_ids``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    # A P/D prefill leg may also carry OpenAI's field (atomesh sets both).
    max_tokens: int | None = Field(default=None, ge=1)
    kv_transfer_params: dict[str, Any] | None = None

    def as_completion(self) -> CompletionBody:
        """The same request as a /v1/completions body (one path through the engine)."""
        prompt: Any = self.text if self.text is not None else self.input_ids
        if prompt is None:
            raise InvalidRequestError("'text' or 'input_ids' is required")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("batched prompts are not supported; send one prompt per request")
            prompt = prompt[0]
        sp = self.sampling_params
        return CompletionBody(
            model=self.model, prompt=prompt, stream=self.stream, kv_transfer_params=self.kv_transfer_params,
            max_tokens=self.max_tokens if self.max_tokens is not None else sp.max_new_tokens,
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop, ignore_eos=sp.ignore_eos,
            seed=sp.seed)


# -- the app ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the handlers share: the engine, names, settings and metrics."""

    engine: AsyncLLMEngine
    args: EngineArgs
    served_model_name: str
    metrics: ServerMetrics
    disagg: Disaggregation | None = None

    def disagg_for(self, role: str) -> Disaggregation:
        """This engine's KV relay, if it plays `role`; else a 400 naming what it is."""
        if self.disagg is None or self.disagg.role != role:
            have = self.disagg.role if self.disagg else "none"
            raise InvalidRequestError(
                f"kv_transfer_params need a {role} engine; this one's kv_role is {have} (--kv-transfer-config)")
        return self.disagg


STATE = web.AppKey("state", ServerState)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The one place errors become OpenAI-shaped HTTP responses."""
    try:
        return await handler(request)
    except EngineError as exc:
        return _json(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": exc.reason, "type": "invalid_request_error", "code": str(exc.status)}}
        return _json(body, status=exc.status)
    except Exception as exc:  # the last resort: never a bare 500 page
        log.exception("unhandled error")
        body = {"error": {"message": f"internal error: {exc}", "type": "internal_server_error", "code": "500"}}
        return _json(body, status=500)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _read_body(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await request.read()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequestError(f"{where}: {first['msg']}") from exc


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in (state.served_model_name, state.args.model):
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {state.served_model_name!r}")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state = request.app[STATE]
    body: CompletionBody = await _read_body(request, CompletionBody)
    return await _generate(request, state, body, _prompt_ids(state, body), chat=False)


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: SGLang's native route, answered in its shape (`text`, `meta_info`)."""
    state = request.app[STATE]
    native: GenerateBody = await _read_body(request, GenerateBody)
    body = native.as_completion()
    return await _generate(request, state, body, _prompt_ids(state, body), chat=False, native=True)


def _prompt_ids(state: ServerState, body: CompletionBody) -> list[int]:
    _check_model(state, body.model)
    body.refuse_unsupported()
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError("batched prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.engine.engine.tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        vocab = state.engine.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    return ids


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = request.app[STATE]
    body: ChatBody = await _read_body(request, ChatBody)
    _check_model(state, body.model)
    body.refuse_unsupported()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = state.engine.engine.tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
    ids = state.engine.engine.tokenizer.encode(text)
    return await _generate(request, state, body, ids, chat=True)


async def _generate(
    request: web.Request, state: ServerState, body: _SamplingBody, ids: list[int], chat: bool, native: bool = False
) -> web.StreamResponse:
    arrived = time.monotonic()
    params, limit_given = body.sampling_params()
    role = body.kv_role_needed
    disagg = state.disagg_for(role) if role is not None else None
    if role == "kv_consumer":
        assert disagg is not None
        kv = disagg.parse(body.kv_transfer_params or {})
        seq = await state.engine.reserve(ids, params, limit_given)  # raises before any byte is sent
        await disagg.pull(seq, kv)  # gives the blocks back itself if the transfer fails
        state.metrics.kv_pull.observe(time.monotonic() - arrived)
        handle = state.engine.submit_prefilled(seq, kv.first_token_id)
    else:
        handle = state.engine.submit(ids, params, limit_given, hold_kv=role == "kv_producer")
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    outputs = _timed(state.engine.stream(handle), state.metrics, arrived)
    offered = False
    try:
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            if native:
                return await _stream_native(request, outputs, request_id)
            return await _stream(request, state, outputs, request_id, created, chat, include_usage)
        resp = await (_collect_native(outputs, request_id) if native
                      else _collect(state, outputs, request_id, created, chat))
        if role == "kv_producer":
            assert disagg is not None
            seq = handle.seq
            answer = orjson.loads(resp.body)  # type: ignore[arg-type]
            answer["kv_transfer_params"] = disagg.offer(seq, lambda: state.engine.engine.release(seq))
            offered = True
            return _json(answer)
        return resp
    finally:
        # Whatever ended the handler (done, client gone, write error), the request's blocks go now,
        # not when the generator above is garbage-collected.
        state.engine.abort(handle.seq_id)
        if role == "kv_producer" and not offered:
            state.engine.engine.release(handle.seq)  # held blocks nobody will pull


async def _collect(
    state: ServerState, outputs: AsyncIterator[RequestOutput], request_id: str, created: int, chat: bool
) -> web.Response:
    text: list[str] = []
    last: RequestOutput | None = None
    async for out in outputs:
        if out.error is not None:
            raise out.error
        text.append(out.text)
        last = out
    assert last is not None
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    return _json(
        {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": state.served_model_name,
            "choices": [choice],
            "usage": _usage(last),
        }
    )


def _meta_info(request_id: str, out: RequestOutput) -> dict[str, Any]:
    """SGLang's `meta_info` of a /generate answer."""
    return {"id": request_id, "finish_reason": {"type": out.finish_reason} if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens}


async def _collect_native(outputs: AsyncIterator[RequestOutput], request_id: str) -> web.Response:
    text: list[str] = []
    last: RequestOutput | None = None
    async for out in outputs:
        if out.error is not None:
            raise out.error
        text.append(out.text)
        last = out
    assert last is not None
    return _json({"text": "".join(text), "meta_info": _meta_info(request_id, last)})


async def _stream_native(
    request: web.Request, outputs: AsyncIterator[RequestOutput], request_id: str
) -> web.StreamResponse:
    """SGLang's /generate stream: each event carries the whole text so far."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
    )
    await resp.prepare(request)
    text = ""
    async for out in outputs:
        if out.error is not None:
            await resp.write(b"data: " + orjson.dumps(out.error.body()) + b"\n\n")
            break
        if not out.text and not out.finished:
            continue
        text += out.text
        await resp.write(b"data: " + orjson.dumps({"text": text, "meta_info": _meta_info(request_id, out)}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _timed(
    outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics, arrived: float
) -> AsyncIterator[RequestOutput]:
    first = True
    async for out in outputs:
        if first:
            metrics.ttft.observe(time.monotonic() - arrived)
            first = False
        if out.finished and out.error is None:
            metrics.e2e.observe(time.monotonic() - arrived)
        yield out


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


async def _stream(
    request: web.Request,
    state: ServerState,
    outputs: AsyncIterator[RequestOutput],
    request_id: str,
    created: int,
    chat: bool,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": state.served_model_name,
            "choices": choices,
        }
        if usage is not None:
            payload["usage"] = usage
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    if chat:
        await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
    last: RequestOutput | None = None
    async for out in outputs:
        last = out
        if out.error is not None:
            await resp.write(b"data: " + orjson.dumps(out.error.body()) + b"\n\n")
            break
        if not out.text and not out.finished:
            continue
        if chat:
            delta = {"content": out.text} if out.text else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        await resp.write(chunk([choice]))
    if include_usage and last is not None and last.error is None:
        await resp.write(chunk([], _usage(last)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    state = request.app[STATE]
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "atomesh",
        "root": state.engine.engine.model_id,
        "max_model_len": state.engine.engine.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """GET /health: answers once the model is loaded (the server binds only after that)."""
    return _json({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """GET /health_generate: generate one token, so a router knows the model really runs."""
    state = request.app[STATE]
    ids = state.engine.engine.tokenizer.encode("ping")[:8] or [0]
    handle = state.engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=1), True)
    try:
        async for out in state.engine.stream(handle):
            if out.error is not None:
                raise out.error
    finally:
        state.engine.abort(handle.seq_id)
    return _json({"status": "ok"})


async def get_model_info(request: web.Request) -> web.Response:
    """GET /get_model_info: SGLang's shape."""
    state = request.app[STATE]
    return _json({"model_path": state.args.model, "tokenizer_path": state.args.model,
                  "served_model_name": state.served_model_name, "is_generation": True,
                  "max_model_len": state.engine.engine.max_model_len})


async def flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache: forget the prefix cache's free blocks (blocks in use keep theirs)."""
    flushed = request.app[STATE].engine.engine.block_manager.flush()
    return _json({"status": "ok", "flushed_blocks": flushed})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text from the server's own registry."""
    registry = request.app[STATE].metrics.registry
    resp = web.Response(body=generate_latest(registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info: what a router needs to know about this worker."""
    state = request.app[STATE]
    eng = state.engine.engine
    return _json(
        {
            "model_id": state.served_model_name,
            "served_model_name": state.served_model_name,
            "model_path": state.args.model,
            "tp_size": state.args.tensor_parallel_size,
            "dp_size": state.args.data_parallel_size,
            "block_size": state.args.block_size,
            "max_model_len": eng.max_model_len,
            "max_num_seqs": state.args.max_num_seqs,
            "max_num_batched_tokens": state.args.max_num_batched_tokens,
            "num_kvcache_blocks": eng.num_blocks,
            "kv_cache_dtype": str(eng.runner.cache_dtype).removeprefix("torch."),
            "enable_prefix_caching": state.args.enable_prefix_caching,
            "enable_chunked_prefill": state.args.enable_chunked_prefill,
            "device": str(eng.device),
            "dtype": str(eng.dtype).removeprefix("torch."),
            # vLLM's --kv-events-config as this engine publishes it (a "*" host means this worker's host).
            "kv_events_config": advertised(state.args.kv_events) if state.args.kv_events.enabled else None,
        }
    )


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info: the tokenizer and chat template, so a router can tokenize prompts exactly as here."""
    return _json(request.app[STATE].engine.engine.tokenizer.describe())


async def kv_transfer_info(request: web.Request) -> web.Response:
    """GET /kv_transfer_info: ATOM's shape; kv_role is null while no transfer is configured."""
    state = request.app[STATE]
    args = state.args
    info: dict[str, Any] = {
        "tp_size": args.tensor_parallel_size,
        "dp_size": args.data_parallel_size,
        "kv_role": args.kv_transfer.kv_role,
        "handshake_port": args.kv_transfer.handshake_port,
        "sparse_attention": args.sparse_attention,
    }
    if state.disagg is not None:
        info.update(state.disagg.info())
    return _json(info)


def create_app(engine: LLMEngine, args: EngineArgs) -> web.Application:
    """The aiohttp application around an already-built engine; the engine loop lives in cleanup_ctx."""
    served = args.served_model_name or args.model
    async_engine = AsyncLLMEngine(engine)
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    disagg = (Disaggregation(engine, args.kv_transfer, args.host, args.kv_transfer_timeout)
              if args.kv_transfer.kv_role else None)
    server_metrics = ServerMetrics(engine.stats, served)
    if disagg is not None:
        server_metrics.watch_transfers(lambda: disagg.stats)
    app[STATE] = ServerState(async_engine, args, served, server_metrics, disagg)

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        # The KV relay is up before the port opens: a router reads /kv_transfer_info at registration.
        if disagg is not None:
            await disagg.start()
        publisher = ZmqEventPublisher(args.kv_events) if args.kv_events.enabled else None
        if publisher is not None:
            engine.kv_events_sink = publisher.publish
            engine.flush_kv_events()  # AllBlocksCleared: this engine starts empty
        await async_engine.start()
        yield
        await async_engine.stop()
        if publisher is not None:
            engine.kv_events_sink = None
            publisher.close()
        if disagg is not None:
            await disagg.stop()

    app.cleanup_ctx.append(engine_loop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/kv_transfer_info", kv_transfer_info)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    return app


def configure_torch(args: EngineArgs) -> None:
    """CPU threads: one per core by default; more threads than cores only adds contention."""
    threads = args.torch_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)


async def serve(args: EngineArgs, engine: LLMEngine) -> None:
    """Serve until cancelled (SIGINT / SIGTERM)."""
    app = create_app(engine, args)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request
    # and frees its KV blocks at once.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.server_port)
    await site.start()
    log.info("serving %s on http://%s:%d", args.model, args.host, args.server_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse flags, load the model, serve."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    configure_torch(args)
    try:
        engine = LLMEngine(args)
        check_transfer_support(engine, args.kv_transfer)
    except ValueError as exc:  # a bad model path, a setting the model cannot honour
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    log.info(
        "engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
        engine.model_id,
        engine.device,
        engine.dtype,
        engine.num_blocks,
        args.block_size,
        engine.max_model_len,
    )
    try:
        import uvloop

        uvloop.run(serve(args, engine))
    except ImportError:
        asyncio.run(serve(args, engine))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
