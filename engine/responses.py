"""OpenAI response shapes: one Choice per generated sequence, whole or as streamed deltas.

A Choice gathers its sequence's text, logprobs and finish reason, and (chat with tools) reads the
text through a tool-call parser. The same object renders the non-streamed ``choices[i]`` and each
streamed chunk's choice, so both paths say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from engine.async_engine import RequestOutput
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
