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

from engine.llm_engine import RequestOutput
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

    def echo(self, prompt_ids: Sequence[int]) -> None:
        """Completions with echo: the prompt's text comes first."""
        self._echo = self.tokenizer.decode(prompt_ids)

    # -- accumulation ---------------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
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
            choice["logprobs"] = self._completion_logprobs(self.token_logprobs, self._echo) if self.logprobs else None
        choice["finish_reason"] = self._finish_reason()
        choice["stop_reason"] = self.stop_reason
        return choice

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
            choice["logprobs"] = self._completion_logprobs(out.logprobs, "") if self.logprobs else None
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

    def _completion_logprobs(self, lps: Sequence[TokenLogprob], before: str) -> dict[str, Any]:
        self._offset += len(before)
        tokens, offsets = [], []
        for lp in lps:
            token = self.tokenizer.token_text(lp.token_id)
            tokens.append(token)
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.tokenizer.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }


def _merge(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(a.content + b.content, [*a.calls, *b.calls])
