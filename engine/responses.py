"""OpenAI response shapes: one Choice per generated sequence, whole or as streamed deltas; and the
Responses API (`/v1/responses`), answered through the same chat machinery.

A Choice gathers its sequence's text, logprobs and finish reason, and (chat with tools) reads the
text through a tool-call parser. The same object renders the non-streamed ``choices[i]`` and each
streamed chunk's choice, so both paths say the same thing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, Field

from engine.async_engine import RequestOutput
from engine.errors import InvalidRequestError
from engine.protocol import STRICT, ChatBody, ChatMessage, validated
from engine.sequence import TokenLogprob
from engine.tokenizer import Tokenizer
from engine.tools import ParsedDelta, ToolCall, ToolParser


@dataclass(frozen=True, slots=True)
class Head:
    """The fields every response body and chunk of one request share."""

    request_id: str
    created: int
    model: str
    chat: bool

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage}  # fmt: skip

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": choices, **extra}  # fmt: skip
        return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True, slots=True)
class ChatExtras:
    """How a chat request's output is read: a tool-call parser factory, and whether a named call is forced."""

    parser: Callable[[], ToolParser] | None
    named: bool


class Choice:
    """One sequence's answer."""

    def __init__(self, index: int, tokenizer: Tokenizer, chat: bool, logprobs: bool,
                 parser: ToolParser | None = None, named_call: bool = False) -> None:  # fmt: skip
        self.index = index
        self.tokenizer = tokenizer
        self.chat = chat
        self.logprobs = logprobs
        self.parser = parser
        self.named_call = named_call
        self.text: list[str] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.calls: list[ToolCall] = []
        self._offset = 0  # completions' text_offset: characters before the next token
        self._echo = ""
        self._echo_ids: Sequence[int] = ()
        self.prompt_ids: Sequence[int] = ()
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self.show_prompt_logprobs = False  # vLLM's prompt_logprobs field

    def echo(self, prompt_ids: Sequence[int]) -> None:
        """Completions with echo: the prompt's text (and, with logprobs, its tokens' logprobs) comes first."""
        self._echo = self.tokenizer.decode(prompt_ids)
        self._echo_ids = prompt_ids

    def want_prompt_logprobs(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = prompt_ids
        self.show_prompt_logprobs = True

    # -- accumulation ---------------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.text)
        self.token_logprobs.extend(out.logprobs)
        self.cumulative_logprob += sum(lp.logprob for lp in out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    def final(self) -> dict[str, Any]:
        """The non-streamed ``choices[i]``."""
        text = self._echo + "".join(self.text)
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            content: str | None = text
            if self.parser is not None:
                parsed = _merge(self.parser.feed(text), self.parser.finish())
                self.calls = parsed.calls
                content = parsed.content if parsed.content or not parsed.calls else None
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.calls:
                message["tool_calls"] = [c.to_dict() for c in self.calls]
            choice["message"] = message
            choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in self.token_logprobs]} \
                if self.logprobs else None  # fmt: skip
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(self.token_logprobs, True) if self.logprobs else None
            if self.show_prompt_logprobs:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs()
        choice["finish_reason"] = self._finish_reason()
        choice["stop_reason"] = self.stop_reason
        return choice

    def vllm_prompt_logprobs(self) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token {id: {logprob, rank, decoded_token}}
        holding the prompt's own token and the top alternatives."""
        out: list[dict[str, Any] | None] = [None]
        for lp in self.prompt_logprobs:
            entry = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": self.tokenizer.token_text(t)}
                     for i, (t, v) in enumerate(lp.top)}  # fmt: skip
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                       "decoded_token": self.tokenizer.token_text(lp.token_id)}  # fmt: skip
            out.append(entry)
        return out

    def _finish_reason(self) -> str | None:
        if self.calls and not self.named_call and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    # -- streaming ------------------------------------------------------------------------------------

    def opening(self) -> dict[str, Any] | None:
        """The first chunk's choice (chat: the assistant role)."""
        if not self.chat:
            return None
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def delta(self, out: RequestOutput) -> dict[str, Any] | None:
        """A streamed chunk's choice for ``out`` (None when it adds nothing a client would see)."""
        self.add(out)
        text = out.text
        echoed = bool(self._echo)
        if self._echo:
            text, self._echo = self._echo + text, ""
        calls: list[ToolCall] = []
        if self.parser is not None:
            parsed = self.parser.feed(text)
            if out.finished:
                parsed = _merge(parsed, self.parser.finish())
            text, calls = parsed.content, parsed.calls
        if not text and not calls and not out.finished and not (self.logprobs and out.logprobs):
            return None
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                first = len(self.calls)
                self.calls.extend(calls)
                delta["tool_calls"] = [c.to_dict(index=first + k) for k, c in enumerate(calls)]
            choice["delta"] = delta
            choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in out.logprobs]} \
                if self.logprobs else None  # fmt: skip
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(out.logprobs, echoed) if self.logprobs else None
        if self.show_prompt_logprobs and out.prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs()
        choice["finish_reason"] = self._finish_reason() if out.finished else None
        if out.finished:
            choice["stop_reason"] = self.stop_reason
        return choice

    # -- logprob shapes -------------------------------------------------------------------------------

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        token = self.tokenizer.token_text(lp.token_id)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := self.tokenizer.token_text(tid)), "logprob": v,
                                  "bytes": list(t.encode())} for tid, v in lp.top]}  # fmt: skip

    def _completion_logprobs(self, lps: Sequence[TokenLogprob], with_echo: bool) -> dict[str, Any]:
        """OpenAI's completions logprobs; with echo, the prompt's tokens first (the first has no logprob)."""
        tokens: list[str] = []
        offsets: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if with_echo and self._echo_ids:
            scored = {i + 1: lp for i, lp in enumerate(self.prompt_logprobs)}
            for i, token_id in enumerate(self._echo_ids):
                lp = scored.get(i)
                values.append(lp.logprob if lp is not None else None)
                tops.append({self.tokenizer.token_text(t): v for t, v in lp.top} if lp is not None else None)
                self._add_token(self.tokenizer.token_text(token_id), tokens, offsets)
        for lp in lps:
            values.append(lp.logprob)
            tops.append({self.tokenizer.token_text(t): v for t, v in lp.top})
            self._add_token(self.tokenizer.token_text(lp.token_id), tokens, offsets)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _add_token(self, token: str, tokens: list[str], offsets: list[int]) -> None:
        tokens.append(token)
        offsets.append(self._offset)
        self._offset += len(token)


def _merge(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(a.content + b.content, [*a.calls, *b.calls])


# -- OpenAI's Responses API (POST /v1/responses) ----------------------------------------------------
#
# Stateless: a response is generated from its `input` (and `instructions`) as a chat completion is from
# its messages, and answered in the Responses shape; nothing is stored, so what needs a stored response
# (`previous_response_id`, `store: true`, `background`) is refused by name, as are tools and non-text
# input or output formats.


class InputPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class InputMessage(BaseModel):
    """One item of `input`: a message (`type` "message" or left out) with text content."""

    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]

    def for_chat(self) -> ChatMessage:
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        texts = []
        for part in self.content:
            if part.type not in ("input_text", "output_text", "text"):
                raise InvalidRequestError(
                    f"input content of type {part.type!r} is not supported by this engine (text only)"
                )
            texts.append(part.text or "")
        return ChatMessage(role=self.role, content="".join(texts))


class ResponsesBody(BaseModel):
    """POST /v1/responses: the fields this engine implements; others that ask for something are refused."""

    model_config = STRICT

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse, by name, what a stateless text-only engine cannot do."""
        refused = {
            "previous_response_id": self.previous_response_id is not None,
            "store": self.store is True,
            "background": self.background is True,
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "reasoning": bool(self.reasoning),
            "include": bool(self.include),
            "truncation": self.truncation == "auto",
            "top_logprobs": bool(self.top_logprobs),
        }
        for name, asked in refused.items():
            if asked:
                why = (
                    "this engine stores no responses"
                    if name in ("previous_response_id", "store", "background")
                    else "this engine answers text only"
                )
                raise InvalidRequestError(f"{name} is not supported by /v1/responses here ({why})")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise InvalidRequestError('text.format: only {"type": "text"} is supported by this engine')

    def as_chat(self) -> ChatBody:
        """The same request as a chat completion (one path through the engine)."""
        self.check()
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            for i, item in enumerate(self.input):
                if item.get("type", "message") != "message":
                    raise InvalidRequestError(
                        f"input[{i}]: items of type {item.get('type')!r} are not supported "
                        "by this engine (messages only)"
                    )
                messages.append(validated(InputMessage, item).for_chat())
        body = ChatBody(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            user=self.user,
            priority=self.priority,
            kv_transfer_params=self.kv_transfer_params,
        )
        body.check()
        return body


class ResponseShape:
    """One response's object and its streamed events, from the chat machinery's output."""

    def __init__(self, body: ResponsesBody, response_id: str, model: str) -> None:
        self.id = response_id
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.request = body
        self._sequence = 0

    def response(
        self, status: str, text: str | None, usage: dict[str, Any] | None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        """The response object (`text` None: no output yet)."""
        r = self.request
        output = [] if text is None else [self._message(text, "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto", "tools": [],
            "top_p": r.top_p if r.top_p is not None else 1.0, "truncation": "disabled", "usage": usage,
            "user": r.user, "metadata": r.metadata or {},
        }  # fmt: skip

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def from_chat(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The whole response, from the chat completion the engine made of the request."""
        choice = answer["choices"][0]
        finish = choice.get("finish_reason")
        return self.response(
            "incomplete" if finish == "length" else "completed",
            choice["message"]["content"] or "",
            usage_of(answer["usage"]),
            finish,
        )

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    async def stream(self, resp: Any, outputs: AsyncIterator[tuple[int, RequestOutput]], choice: Choice) -> None:
        """Write the Responses API's events to the prepared `resp`: created, the message's text deltas, and
        completed (incomplete when the token limit cut it; an error event when the engine failed)."""
        await resp.write(self.event("response.created", response=self.response("in_progress", None, None)))
        await resp.write(self.event("response.in_progress", response=self.response("in_progress", None, None)))
        await resp.write(
            self.event("response.output_item.added", output_index=0, item=self._message("", "in_progress"))
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        await resp.write(
            self.event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            )
        )
        last: RequestOutput | None = None
        async for _, out in outputs:
            if out.error is not None:
                err = out.error.body()["error"]
                await resp.write(self.event("error", code=err.get("code"), message=err.get("message"), param=None))
                return
            last = out
            delta = choice.delta(out)
            text = (delta or {}).get("delta", {}).get("content")
            if text:
                await resp.write(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
                )
        text = "".join(choice.text)
        await resp.write(
            self.event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            )
        )
        await resp.write(
            self.event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part={**part, "text": text},
            )
        )
        await resp.write(self.event("response.output_item.done", output_index=0, item=self._message(text, "completed")))
        finish = last.finish_reason if last is not None else None
        usage = usage_of(_chat_usage(last)) if last is not None else None
        status = "incomplete" if finish == "length" else "completed"
        await resp.write(self.event(f"response.{status}", response=self.response(status, text, usage, finish)))


def _chat_usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def usage_of(chat: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's usage from a chat completion's."""
    inp, out = chat["prompt_tokens"], chat["completion_tokens"]
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]
            ["cached_tokens"]}, "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inp + out}  # fmt: skip
