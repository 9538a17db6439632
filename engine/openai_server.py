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
from engine.sequence import SamplingParams, TokenLogprob
from engine.sequence import Sequence as EngineSequence
from engine.structured import GrammarCompiler
from engine.tools import ForcedParser, ToolParser, hermes_system_prompt, make_parser, tools_for_template
from engine.tracing import EngineTracing

log = logging.getLogger("engine.server")

MAX_STOP_STRINGS = 16


# -- the app ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the handlers share: the engine, names, settings and metrics."""

    engine: AsyncLLMEngine
    args: EngineArgs
    served_model_name: str
    metrics: ServerMetrics
    disagg: Disaggregation | None = None
    tracing: EngineTracing | None = None  # --otlp-traces-endpoint
    _grammars: list[GrammarCompiler] = field(default_factory=list)  # built on first use (holds one)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (made at the first constrained request)."""
        if not self._grammars:
            info = self.engine.info
            self._grammars.append(GrammarCompiler(self.engine.tokenizer, info.vocab_size, info.eos_token_ids))
        return self._grammars[0]

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
    if body.echo and body.kv_role_needed == "kv_producer":
        raise InvalidRequestError("echo: a prefill for remote decode answers nothing but kv_transfer_params; the "
                                  "decode engine echoes the prompt")
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
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from exc
    ids = tokenizer.encode(text)
    if body.tools_forced():
        forced = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        parsers: Callable[[], ToolParser] | None = lambda: ForcedParser(forced)  # noqa: E731
    elif tools:
        parser_name = state.args.tool_call_parser
        if parser_name is None or not state.args.enable_auto_tool_choice:
            raise InvalidRequestError('tool_choice "auto" needs the engine started with --enable-auto-tool-choice '
                                      "and --tool-call-parser (as vLLM); or send tool_choice required, a named "
                                      "function, or none")
        parallel = body.parallel_tool_calls is not False
        parsers = lambda: make_parser(parser_name, parallel)  # noqa: E731
    else:
        parsers = None
    named = isinstance(body.tool_choice, NamedToolChoice) and body.tools_forced()
    return ids, ChatExtras(parsers, named)


async def _generate(request: web.Request, state: ServerState, body: SamplingBody, ids: list[int],
                    chat: ChatExtras | None, native: bool = False,
                    shape: ResponseShape | None = None) -> web.StreamResponse:  # fmt: skip
    """Validate everything against this model, then run the request's sequences and answer (in the
    Responses API's shape with `shape`)."""
    arrived = time.monotonic()
    engine = state.engine
    role = body.kv_role_needed
    disagg = state.disagg_for(role) if role is not None else None
    limit = body.token_limit()
    params = body.sampling_params(limit or 1)
    if params.priority and state.args.scheduling_policy != "priority":
        raise InvalidRequestError(f"priority {params.priority}: this engine schedules first come, first served; "
                                  "start it with --scheduling-policy priority (as vLLM)")
    if role == "kv_producer":
        # The gateway sends the prefill leg max_tokens 1: min_tokens only bans EOS for that first token here.
        params = replace(params, min_tokens=min(params.min_tokens, 1))
        decode_limit = (body.kv_transfer_params or {}).get("decode_max_tokens")
        if isinstance(decode_limit, int) and not isinstance(decode_limit, bool):
            engine.check_request(len(ids), replace(params, max_tokens=decode_limit), True)  # refuse before prefill
    params = engine.check_request(len(ids), params, limit is not None)  # context length, ids: before anything runs
    show_logprobs = params.logprobs is not None
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    if echo and params.logprobs is not None:  # echo with logprobs scores the prompt's tokens too (OpenAI)
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
    if _best_of(body) is not None and params.logprobs is None:
        params = replace(params, logprobs=0)  # best_of ranks its sequences by cumulative logprob
    spec = body.grammar()
    grammar: Any = None
    if spec is not None:  # compiled off the event loop (and cached): other requests keep streaming
        compiler = state.grammar_compiler()
        grammar = await asyncio.get_running_loop().run_in_executor(None, compiler.compile, spec)
    n = body.num_sequences
    if role == "kv_consumer":
        assert disagg is not None
        kv = disagg.parse(body.kv_transfer_params or {})
        first_logprob = _first_logprob(body.kv_transfer_params or {}, params)
        scored = _prompt_logprobs(body.kv_transfer_params or {}, params)
        seq = await state.engine.reserve(ids, params, True)  # raises before any byte is sent
        seq.prompt_logprobs = scored  # the prefill engine scored the prompt; forks copy them
        if grammar is not None:
            seq.grammar = state.grammar_compiler().state_of(grammar)
        await disagg.pull(seq, kv)  # gives the blocks back itself if the transfer fails
        pulled = time.monotonic()
        state.metrics.kv_pull.observe(pulled - arrived)
        # n > 1 (or best_of): the other samples fork from the transferred prompt KV before the first
        # sequence continues (it may finish at once and free it); each samples its own first token.
        forks = [state.engine.fork_prefilled(
            seq, i, state.grammar_compiler().state_of(grammar) if grammar is not None else None)
            for i in range(1, n)]  # fmt: skip
        handles = [state.engine.submit_prefilled(seq, kv.first_token_id, first_logprob), *forks]
    else:
        handles = []
        try:
            for i in range(n):
                matcher = state.grammar_compiler().state_of(grammar) if grammar is not None else None
                if i == 0:
                    handles.append(state.engine.submit(ids, params, True, hold_kv=role == "kv_producer",
                                                       grammar=matcher))  # fmt: skip
                else:  # the other samples share its prompt's KV blocks once computed
                    handles.append(state.engine.submit_fork(handles[0], i, matcher))
        except BaseException:
            for h in handles:
                state.engine.abort(h.seq_id)
            raise
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
    offered = False
    first_at: list[float] = []  # when the first token went out (tracing)
    try:
        outputs = _merged([_timed(state.engine.stream(h), state.metrics, arrived, h.seq, first_at)
                           for h in handles])
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
        if role == "kv_producer":
            assert disagg is not None
            seq = handles[0].seq
            kv_params = disagg.offer(seq, lambda: state.engine.release(seq))
            if seq.logprobs:
                kv_params["first_token_logprob"] = _logprob_dict(seq.logprobs[0])
            if params.prompt_logprobs is not None:  # the decode engine reports them as its own
                kv_params["prompt_logprobs"] = [_logprob_dict(lp) for lp in seq.prompt_logprobs]
            answer["kv_transfer_params"] = kv_params
            offered = True
        return _json(answer)
    finally:
        # Whatever ended the handler (done, client gone, write error), the request's blocks go now,
        # not when the generators above are garbage-collected.
        for h in handles:
            state.engine.abort(h.seq_id)
        if role == "kv_producer" and not offered:
            state.engine.release(handles[0].seq)  # held blocks nobody will pull
        if state.tracing is not None:
            _trace(state.tracing, request, handles[0].seq, role, arrived, pulled if role == "kv_consumer" else None,
                   first_at[0] if first_at else None, len(ids), n)


def _meta_info(request_id: str, out: RequestOutput) -> dict[str, Any]:
    """SGLang's `meta_info` of a /generate answer."""
    return {"id": request_id, "finish_reason": {"type": out.finish_reason} if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens}


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


async def _stream_response(request: web.Request, shape: ResponseShape,
                           outputs: AsyncIterator[tuple[int, RequestOutput]], choice: Choice) -> web.StreamResponse:
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


def _logprob_dict(lp: TokenLogprob) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


def _prompt_logprobs(kv: dict[str, Any], params: SamplingParams) -> list[TokenLogprob]:
    """The prompt's scores the prefill engine computed (prompt_logprobs, or echo with logprobs, in P/D)."""
    if params.prompt_logprobs is None:
        return []
    raw = kv.get("prompt_logprobs")
    if not isinstance(raw, list):
        raise InvalidRequestError("prompt_logprobs in P/D need kv_transfer_params.prompt_logprobs from the prefill "
                                  "engine (was its request sent with prompt_logprobs?)")
    try:
        return [TokenLogprob(int(r["token_id"]), float(r["logprob"]), int(r["rank"]),
                             tuple((int(t), float(v)) for t, v in r["top"])[: params.prompt_logprobs])
                for r in raw]  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"kv_transfer_params.prompt_logprobs: {exc}") from exc


def _first_logprob(kv: dict[str, Any], params: SamplingParams) -> TokenLogprob | None:
    """The prefill engine's logprob of the first token, which the decode side reports as its own."""
    if params.logprobs is None:
        return None
    raw = kv.get("first_token_logprob")
    if not isinstance(raw, dict):
        raise InvalidRequestError("logprobs in P/D need kv_transfer_params.first_token_logprob from the prefill "
                                  "engine (was its request sent with logprobs?)")
    try:
        top = tuple((int(t), float(v)) for t, v in raw["top"])[: params.logprobs]
        return TokenLogprob(int(raw["token_id"]), float(raw["logprob"]), int(raw["rank"]), top)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"kv_transfer_params.first_token_logprob: {exc}") from exc


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


def _trace(tracing: EngineTracing, request: web.Request, seq: EngineSequence, role: str | None, arrived: float,
           pulled: float | None, first: float | None, prompt_tokens: int, n: int) -> None:
    """The request's spans, from the times noted along the way."""
    end = time.monotonic()
    phases: list[tuple[str, float, float]] = []
    if pulled is not None:
        phases.append(("kv_transfer", arrived, pulled))
    elif seq.admitted_at is not None:
        phases.append(("queue", arrived, seq.admitted_at))
        if first is not None:
            phases.append(("prefill", seq.admitted_at, first))
    if role != "kv_producer":
        start = pulled if pulled is not None else first
        if start is not None:
            phases.append(("decode", start, end))
    tracing.emit(request.headers, arrived, end, phases, {
        "atomesh.kv_role": role or "colocated", "gen_ai.usage.input_tokens": prompt_tokens, "atomesh.n": n,
        "http.route": request.path})


async def _timed(
    outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics, arrived: float, seq: EngineSequence,
    first_at: list[float] | None = None,
) -> AsyncIterator[RequestOutput]:
    first = True
    async for out in outputs:
        if first:
            if first_at is not None and not first_at:
                first_at.append(time.monotonic())
            metrics.ttft.observe(time.monotonic() - arrived)
            # A sequence whose KV came from a transfer is never admitted for prefill: no queue time.
            if seq.admitted_at is not None:
                metrics.queue.observe(max(seq.admitted_at - arrived, 0.0))
            first = False
        if out.finished and out.error is None:
            metrics.e2e.observe(time.monotonic() - arrived)
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
    return _json({"model_path": state.args.model, "tokenizer_path": state.args.model,
                  "served_model_name": state.served_model_name, "is_generation": True,
                  "max_model_len": state.engine.info.max_model_len})


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
    async_engine = AsyncLLMEngine(engine)
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    disagg = (Disaggregation(engine, args.kv_transfer, args.host, args.kv_transfer_timeout)
              if args.kv_transfer.kv_role else None)
    server_metrics = ServerMetrics(async_engine.stats, served)
    if disagg is not None:
        server_metrics.watch_transfers(disagg.snapshot)
        disagg.on_agent_dead = lambda exc: async_engine.die("kv_agent", exc)
    tracing = (EngineTracing(args.otlp_traces_endpoint, f"atomesh-engine-{args.kv_transfer.kv_role or 'colocated'}")
               if args.otlp_traces_endpoint else None)
    app[STATE] = ServerState(async_engine, args, served, server_metrics, disagg, tracing)
    if tracing is not None:
        async def flush_spans(app: web.Application) -> None:
            tracing.shutdown()  # the spans still batched go out before exit

        app.on_cleanup.append(flush_spans)

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        # The KV relay is up before the port opens: a router reads /kv_transfer_info at registration.
        if disagg is not None:
            await disagg.start()
        publisher = ZmqEventPublisher(args.kv_events, args.host) if args.kv_events.enabled else None
        if publisher is not None:
            async_engine.publish_kv_events(publisher.publish)
        await async_engine.start()
        yield
        await async_engine.stop()
        if publisher is not None:
            async_engine.publish_kv_events(None)
            publisher.close()
        if disagg is not None:
            await disagg.stop()

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
    tokenize_api.add_routes(app, engine.tokenizer, engine.max_model_len,
                            lambda name: _check_model(app[STATE], name))
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
        raise BindError(f"cannot listen on {args.host}:{args.server_port} (HTTP, --host/--server-port): "
                        f"{reason}") from exc
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


if __name__ == "__main__":
    main()
