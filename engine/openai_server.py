"""``python -m engine.openai_server``: the ATOM-compatible OpenAI HTTP server of the engine.

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/responses, /generate (SSE when ``stream``), /flush_cache;
GET /v1/models, /health, /health_generate, /get_model_info, /metrics, /server_info, /kv_transfer_info,
/tokenizer_info.
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
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine import tokenize_api
from engine.args import EngineArgs, parse_args
from engine.async_engine import AsyncLLMEngine, RequestOutput
from engine.disagg import Disaggregation, RelayConfigError, check_transfer_support
from engine.errors import BindError, EngineError, InvalidRequestError, ModelNotFoundError
from engine.kv_events import ZmqEventPublisher, advertised
from engine.llm_engine import LLMEngine
from engine.metrics import ServerMetrics
from engine.models.loader import SMOLLM2_NAMES
from engine.protocol import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    NamedToolChoice,
    SamplingBody,
    json_object,
    parse_body,
    validated,
)
from engine.responses import ChatExtras, Choice, Head, ResponsesBody, ResponseShape
from engine.sequence import SamplingParams
from engine.sequence import Sequence as EngineSequence
from engine.structured import GrammarCompiler
from engine.tools import ForcedParser, ToolParser, hermes_system_prompt, make_parser, tools_for_template
from engine.tracing import EngineTracing

log = logging.getLogger("engine.server")


# -- the app ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the handlers share: the engine, names, settings and metrics."""

    engine: AsyncLLMEngine
    args: EngineArgs
    served_model_name: str
    metrics: ServerMetrics
    disagg: Disaggregation | None = None  # read for /kv_transfer_info and /metrics; the engine drives it
    tracing: EngineTracing | None = None  # --otlp-traces-endpoint
    _grammars: list[GrammarCompiler] = field(default_factory=list)  # built on first use (holds one)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (made at the first constrained request)."""
        if not self._grammars:
            info = self.engine.info
            self._grammars.append(GrammarCompiler(self.engine.tokenizer, info.vocab_size, info.eos_token_ids))
        return self._grammars[0]


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
        log.exception("unhandled_error path=%s", request.path)
        body = {"error": {"message": f"internal error: {exc}", "type": "internal_server_error", "code": "500"}}
        return _json(body, status=500)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in (state.served_model_name, state.args.model):
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {state.served_model_name!r}")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state = request.app[STATE]
    body: CompletionBody = parse_body(await request.read(), CompletionBody)
    _check_model(state, body.model)
    return await _generate(request, state, body, _prompt_ids(state, body), None)


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: SGLang's native route, answered in its shape (`text`, `meta_info`)."""
    state = request.app[STATE]
    native = validated(GenerateBody, json_object(await request.read()))
    body = native.as_completion()
    _check_model(state, body.model)
    return await _generate(request, state, body, _prompt_ids(state, body), None, native=True)


def _prompt_ids(state: ServerState, body: CompletionBody) -> list[int]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError("batched prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.engine.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.engine.info.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    return ids


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = request.app[STATE]
    body: ChatBody = parse_body(await request.read(), ChatBody)
    _check_model(state, body.model)
    ids, extras = _chat_prompt(state, body)
    return await _generate(request, state, body, ids, extras)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: OpenAI's Responses API, stateless (engine/responses.py), run as a chat completion."""
    state = request.app[STATE]
    native = validated(ResponsesBody, json_object(await request.read()))
    body = native.as_chat()
    _check_model(state, body.model)
    ids, extras = _chat_prompt(state, body)
    shape = ResponseShape(native, "resp_" + uuid.uuid4().hex, state.served_model_name)
    return await _generate(request, state, body, ids, extras, shape=shape)


def _chat_prompt(state: ServerState, body: ChatBody) -> tuple[list[int], ChatExtras]:
    """A chat request's prompt token ids (its messages through the chat template, tools described) and how
    its output is read."""
    tokenizer = state.engine.tokenizer
    messages = [m.for_template() for m in body.messages]
    tools = body.tools_active()
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if tools:
        if tokenizer.template_uses_tools:
            kwargs["tools"] = tools_for_template(tools)
        else:  # the model's template knows no tools: describe them in the system message (Hermes' format)
            system = hermes_system_prompt(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": system + "\n\n" + messages[0]["content"]}
            else:
                messages.insert(0, {"role": "system", "content": system})
    add_generation_prompt, continue_final_message = body.template_switches()
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from exc
    ids = tokenizer.encode(text)
    if body.tools_forced():
        forced = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        parsers: Callable[[], ToolParser] | None = lambda: ForcedParser(forced)  # noqa: E731
    elif tools:
        parser_name = state.args.tool_call_parser
        if parser_name is None or not state.args.enable_auto_tool_choice:
            raise InvalidRequestError(
                'tool_choice "auto" needs the engine started with --enable-auto-tool-choice '
                "and --tool-call-parser (as vLLM); or send tool_choice required, a named "
                "function, or none"
            )
        parallel = body.parallel_tool_calls is not False
        parsers = lambda: make_parser(parser_name, parallel)  # noqa: E731
    else:
        parsers = None
    named = isinstance(body.tool_choice, NamedToolChoice) and body.tools_forced()
    return ids, ChatExtras(parsers, named)


async def _generate(request: web.Request, state: ServerState, body: SamplingBody, ids: list[int],
                    chat: ChatExtras | None, native: bool = False,
                    shape: ResponseShape | None = None) -> web.StreamResponse:  # fmt: skip
    """Check everything against this model, then run the request (the engine decides how: colocated, or
    either side of P/D) and answer (in the Responses API's shape with ``shape``)."""
    arrived = time.monotonic()
    engine = state.engine
    limit = body.token_limit()
    params = body.sampling_params(limit or 1)
    if params.priority and state.args.scheduling_policy != "priority":
        raise InvalidRequestError(
            f"priority {params.priority}: this engine schedules first come, first served; "
            "start it with --scheduling-policy priority (as vLLM)"
        )
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    if echo and params.logprobs is not None:  # echo with logprobs scores the prompt's tokens too (OpenAI)
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
    if _best_of(body) is not None and params.logprobs is None:
        params = replace(params, logprobs=0)  # best_of ranks its sequences by cumulative logprob
    # Context length, token ids, the KV role: checked once, before anything runs.
    admission = engine.check(ids, params, limit is not None, body.kv_transfer_params)
    params = admission.params
    show_logprobs = params.logprobs is not None
    spec = body.grammar()
    matcher: Callable[[], Any] | None = None
    if spec is not None:  # compiled off the event loop (and cached): other requests keep streaming
        compiler = state.grammar_compiler()
        grammar = await asyncio.get_running_loop().run_in_executor(None, compiler.compile, spec)
        matcher = lambda: compiler.state_of(grammar)  # noqa: E731  (one matcher per sample)
    n = body.num_sequences
    generation = await engine.open(admission, n, matcher)  # raises before any byte is sent
    if generation.early_params is not None:  # a prefill offered before it runs: the decode engine reads it
        role = admission.role.value

        def prefilled(seq: EngineSequence) -> None:
            _prefilled(state.metrics, arrived, seq)
            if state.tracing is not None:  # its span ends with the prefill, as a producer's answered late does
                times = _Times(arrived, admitted=seq.admitted_at, first=time.monotonic())
                _trace(state.tracing, request, role, times, None, len(ids), n)

        generation.on_prefilled(prefilled)
        return _json({"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                      "model": state.served_model_name, "choices": [],
                      "kv_transfer_params": generation.early_params})  # fmt: skip
    if generation.pulled_at is not None:
        state.metrics.kv_pull.observe(generation.pulled_at - arrived)
    if generation.reserved_at is not None:
        state.metrics.pd_reserve.observe(generation.reserved_at - arrived)
    request_id = shape.id if shape is not None else ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    tokenizer = engine.tokenizer
    choices = [Choice(i, tokenizer, chat is not None, show_logprobs,
                      chat.parser() if chat is not None and chat.parser is not None else None,
                      chat.named if chat is not None else False) for i in range(n)]  # fmt: skip
    for c in choices:
        if echo:
            c.echo(ids)
        if body.prompt_logprobs is not None:
            c.want_prompt_logprobs(ids)
    times = _Times(arrived, remote_kv=generation.pulled_at is not None)
    try:
        outputs = _merged([_timed(engine.stream(h), state.metrics, times) for h in generation.handles])
        head = Head(request_id, created, state.served_model_name, chat is not None)
        if native and body.stream:
            return await _stream_native(request, outputs, request_id)
        if shape is not None and body.stream:
            return await _stream_response(request, shape, outputs, choices[0])
        if body.stream:
            include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
            return await _stream(request, head, outputs, choices, include_usage)
        if native:
            answer = await _collect_native(outputs, request_id)
        elif shape is not None:
            answer = shape.from_chat(await _collect(head, outputs, choices, None))
        else:
            answer = await _collect(head, outputs, choices, _best_of(body))
        kv_params = generation.hand_over()  # a prefill for a remote decode: where its KV waits
        if kv_params is not None:
            answer["kv_transfer_params"] = kv_params
        return _json(answer)
    finally:
        # Whatever ended the handler (done, client gone, write error), the request's blocks go now,
        # not when the generators above are garbage-collected.
        generation.close()
        if state.tracing is not None:
            _trace(state.tracing, request, admission.role.value, times, generation.pulled_at, len(ids), n)


def _meta_info(request_id: str, out: RequestOutput) -> dict[str, Any]:
    """SGLang's `meta_info` of a /generate answer."""
    return {
        "id": request_id,
        "finish_reason": {"type": out.finish_reason} if out.finish_reason else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
    }


async def _collect_native(outputs: AsyncIterator[tuple[int, RequestOutput]], request_id: str) -> dict[str, Any]:
    text: list[str] = []
    last: RequestOutput | None = None
    async for _, out in outputs:
        if out.error is not None:
            raise out.error
        text.append(out.text)
        last = out
    assert last is not None
    return {"text": "".join(text), "meta_info": _meta_info(request_id, last)}


async def _stream_native(
    request: web.Request, outputs: AsyncIterator[tuple[int, RequestOutput]], request_id: str
) -> web.StreamResponse:
    """SGLang's /generate stream: each event carries the whole text so far."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
    )
    await resp.prepare(request)
    text = ""
    async for _, out in outputs:
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


async def _stream_response(
    request: web.Request, shape: ResponseShape, outputs: AsyncIterator[tuple[int, RequestOutput]], choice: Choice
) -> web.StreamResponse:
    """A Responses API stream: its named events (engine/responses.py), no [DONE]."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": shape.id}
    )
    await resp.prepare(request)
    await shape.stream(resp, outputs, choice)
    await resp.write_eof()
    return resp


def _best_of(body: SamplingBody) -> int | None:
    """How many choices to answer with when more were generated (best_of): the n most likely."""
    if isinstance(body, CompletionBody) and body.best_of is not None and body.best_of > (body.n or 1):
        return body.n or 1
    return None


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several sequences as they come, each tagged with its choice index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, got = await queue.get()
            if got is None:
                live -= 1
                continue
            yield i, got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(head: Head, outputs: AsyncIterator[tuple[int, RequestOutput]], choices: list[Choice],
                   keep: int | None) -> dict[str, Any]:  # fmt: skip
    last: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        if out.error is not None:
            raise out.error
        choices[i].add(out)
        last[i] = out
    if keep is not None:  # best_of: the n choices of highest cumulative logprob, renumbered
        choices = sorted(choices, key=lambda c: -c.cumulative_logprob)[:keep]
        for i, c in enumerate(choices):
            c.index = i
    answer = head.body([c.final() for c in choices], _usage(list(last.values())))
    if head.chat and choices[0].show_prompt_logprobs:  # vLLM: at the top of a chat completion
        answer["prompt_logprobs"] = choices[0].vllm_prompt_logprobs()
    return answer


@dataclass(slots=True)
class _Times:
    """When things happened to one request (time.monotonic()), noted as its outputs go out."""

    arrived: float
    admitted: float | None = None  # first given blocks (None: its KV came from a prefill engine)
    first: float | None = None  # its first token went out
    remote_kv: bool = False  # a decode from remote KV: its first token goes out before its first step
    stepped: float | None = None  # ... and this is when it was admitted to that step


def _trace(tracing: EngineTracing, request: web.Request, role: str | None, times: _Times, pulled: float | None,
           prompt_tokens: int, n: int) -> None:  # fmt: skip
    """The request's spans, from the times noted along the way."""
    end = time.monotonic()
    arrived, first = times.arrived, times.first
    phases: list[tuple[str, float, float]] = []
    if pulled is not None:
        phases.append(("kv_transfer", arrived, pulled))
    elif times.admitted is not None:
        phases.append(("queue", arrived, times.admitted))
        if first is not None:
            phases.append(("prefill", times.admitted, first))
    if role != "kv_producer":
        start = pulled if pulled is not None else first
        if start is not None:
            phases.append(("decode", start, end))
    tracing.emit(
        request.headers,
        arrived,
        end,
        phases,
        {
            "atomesh.kv_role": role or "colocated",
            "gen_ai.usage.input_tokens": prompt_tokens,
            "atomesh.n": n,
            "http.route": request.path,
        },
    )


def _prefilled(metrics: ServerMetrics, arrived: float, seq: EngineSequence) -> None:
    """An early offer's prefill produced its first token: its TTFT and queue time, as a streamed one's."""
    metrics.ttft.observe(time.monotonic() - arrived)
    if seq.admitted_at is not None:
        metrics.queue.observe(max(seq.admitted_at - arrived, 0.0))


async def _timed(outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics,
                 times: _Times) -> AsyncIterator[RequestOutput]:  # fmt: skip
    first = True
    async for out in outputs:
        if first:
            now = time.monotonic()
            if times.first is None:
                times.first, times.admitted = now, out.admitted_at
            metrics.ttft.observe(now - times.arrived)
            # A sequence whose KV came from a transfer is never admitted for prefill: no queue time.
            if out.admitted_at is not None:
                metrics.queue.observe(max(out.admitted_at - times.arrived, 0.0))
            first = False
        elif times.remote_kv and times.stepped is None and out.admitted_at is not None:
            times.stepped = out.admitted_at
            metrics.pd_first_step.observe(max(out.admitted_at - times.arrived, 0.0))
        if out.finished and out.error is None:
            metrics.e2e.observe(time.monotonic() - times.arrived)
        yield out


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, the completion tokens of every sequence generated."""
    prompt = outs[0].prompt_tokens if outs else 0
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens if outs else 0},
    }


async def _stream(request: web.Request, head: Head, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  choices: list[Choice], include_usage: bool) -> web.StreamResponse:  # fmt: skip
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": head.request_id}
    )
    await resp.prepare(request)
    # OpenAI sends "usage": null in every chunk until the usage chunk when usage was asked for.
    no_usage: dict[str, Any] = {"usage": None} if include_usage else {}
    for c in choices:
        first = c.opening()
        if first is not None:
            await resp.write(head.chunk([first], **no_usage))
    last: dict[int, RequestOutput] = {}
    failed = False
    async for i, out in outputs:
        last[i] = out
        if out.error is not None:
            await resp.write(b"data: " + orjson.dumps(out.error.body()) + b"\n\n")
            failed = True
            break
        delta = choices[i].delta(out)
        if delta is not None:
            await resp.write(head.chunk([delta], **no_usage))
    if include_usage and not failed and last:
        await resp.write(head.chunk([], usage=_usage(list(last.values()))))
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
        "root": state.engine.info.model_id,
        "max_model_len": state.engine.info.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """GET /health: ok once the model is loaded (the server binds only after that); 503 once the engine
    died, so that a router takes this worker out."""
    dead = request.app[STATE].engine.dead
    if dead is not None:
        return _json({"status": "dead", **dead.body()}, status=503)
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text from the server's own registry."""
    registry = request.app[STATE].metrics.registry
    resp = web.Response(body=generate_latest(registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info: what a router needs to know about this worker."""
    state = request.app[STATE]
    info = state.engine.info
    return _json(
        {
            "model_id": state.served_model_name,
            "served_model_name": state.served_model_name,
            "model_path": state.args.model,
            "tp_size": state.args.tensor_parallel_size,
            "dp_size": state.args.data_parallel_size,
            "block_size": state.args.block_size,
            "max_model_len": info.max_model_len,
            "max_num_seqs": state.args.max_num_seqs,
            "max_num_batched_tokens": state.args.max_num_batched_tokens,
            "num_kvcache_blocks": info.num_blocks,
            "kv_cache_dtype": info.kv_cache_dtype,
            "enable_prefix_caching": state.args.enable_prefix_caching,
            "enable_chunked_prefill": state.args.enable_chunked_prefill,
            "device": info.device,
            "dtype": info.dtype,
            # vLLM's --kv-events-config as this engine publishes it (a "*" host means this worker's host).
            "kv_events_config": advertised(state.args.kv_events) if state.args.kv_events.enabled else None,
        }
    )


async def health_generate(request: web.Request) -> web.Response:
    """GET /health_generate: generate one token, so a router knows the model really runs."""
    state = request.app[STATE]
    ids = state.engine.tokenizer.encode("ping")[:8] or [0]
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
    return _json(
        {
            "model_path": state.args.model,
            "tokenizer_path": state.args.model,
            "served_model_name": state.served_model_name,
            "is_generation": True,
            "max_model_len": state.engine.info.max_model_len,
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache: forget the prefix cache's free blocks (blocks in use keep theirs)."""
    flushed = request.app[STATE].engine.flush_prefix_cache()
    return _json({"status": "ok", "flushed_blocks": flushed})


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info: the tokenizer and chat template, so a router can tokenize prompts exactly as here."""
    return _json(request.app[STATE].engine.tokenizer.describe())


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
    # The embedded model answers to its real name, the one `atomesh up` and the docs send; `--model smollm2`
    # is only how it is asked for (requests naming --model are still served).
    served = args.served_model_name or (engine.model_id if args.model in SMOLLM2_NAMES else args.model)
    disagg = (
        Disaggregation(engine, args.kv_transfer, args.host, args.kv_transfer_timeout)
        if args.kv_transfer.kv_role
        else None
    )
    async_engine = AsyncLLMEngine(engine, disagg)
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    server_metrics = ServerMetrics(async_engine.stats, served)
    if disagg is not None:
        server_metrics.watch_transfers(disagg.snapshot)
    tracing = (
        EngineTracing(args.otlp_traces_endpoint, f"atomesh-engine-{args.kv_transfer.kv_role or 'colocated'}")
        if args.otlp_traces_endpoint
        else None
    )
    app[STATE] = ServerState(async_engine, args, served, server_metrics, disagg, tracing)
    if tracing is not None:

        async def flush_spans(app: web.Application) -> None:
            tracing.shutdown()  # the spans still batched go out before exit

        app.on_cleanup.append(flush_spans)

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        # The engine (and its KV relay) is up before the port opens: a router reads /kv_transfer_info at
        # registration.
        publisher = ZmqEventPublisher(args.kv_events, args.host) if args.kv_events.enabled else None
        if publisher is not None:
            async_engine.publish_kv_events(publisher.publish)
        await async_engine.start()
        yield
        await async_engine.stop()
        if publisher is not None:
            async_engine.publish_kv_events(None)
            publisher.close()

    app.cleanup_ctx.append(engine_loop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/kv_transfer_info", kv_transfer_info)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    tokenize_api.add_routes(app, engine.tokenizer, engine.max_model_len, lambda name: _check_model(app[STATE], name))
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
    await runner.setup()  # the KV relay's handshake and the KV event sockets bind here
    site = web.TCPSite(runner, args.host, args.server_port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise BindError(
            f"cannot listen on {args.host}:{args.server_port} (HTTP, --host/--server-port): {reason}"
        ) from exc
    log.info("server_listening model=%s url=http://%s:%d", args.model, args.host, args.server_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async_engine = app[STATE].engine
    if args.exit_on_engine_error:
        async_engine.on_death(lambda _: stop.set())
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("server_stopped")
    if async_engine.dead is not None and args.exit_on_engine_error:
        raise EngineExit(async_engine.dead)


class EngineExit(Exception):
    """The engine died and --exit-on-engine-error asked the process to end (status 1)."""


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
        "engine_ready model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
        engine.model_id,
        engine.device,
        engine.dtype,
        engine.num_blocks,
        args.block_size,
        engine.max_model_len,
    )
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve(args, engine))
        else:
            uvloop.run(serve(args, engine))
    except KeyboardInterrupt:
        pass
    except (BindError, RelayConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    except EngineExit as exc:
        print(f"error: {exc} (--exit-on-engine-error)", file=sys.stderr)
        raise SystemExit(1) from exc
    finally:
        engine.close()  # the other tensor-parallel ranks' processes


if __name__ == "__main__":
    main()
