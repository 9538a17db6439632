"""Mid-stream migration (`--migration-limit`, as Dynamo's): a stream whose worker dies goes on elsewhere.

The client has part of the answer; another worker is asked to continue it from the prompt plus the
text already sent (chat: the messages plus an assistant message holding that text, with vLLM's
`continue_final_message: true` and `add_generation_prompt: false`; completions: the prompt followed
by the text), with `max_tokens` lowered by the tokens already sent. Its events are rewritten to look
like the first worker's (same `id`, `created`, `model`, no second role event) and its final `usage`
counts the original prompt and every generated token, so the client reads one uninterrupted stream.

A stream can only be continued if the continuation is the same answer the first worker would have
given; `refusal` says when it is not.
"""

from __future__ import annotations

from typing import Any

import orjson

from atomesh.errors import UpstreamError
from atomesh.request import RequestView, Route

# Fields of guided / structured decoding (OpenAI, vLLM, SGLang): the grammar's state would restart at the
# continuation's first token, so the whole answer would no longer follow it.
_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "json_schema",
)


def refusal(view: RequestView) -> str | None:
    """Why a streamed request cannot be continued on another worker once it started, or None if it can."""
    body = view.body
    if view.route is not Route.COMPLETIONS and view.route is not Route.CHAT:
        return f"{view.route.value} streams are not migrated (only /v1/completions and /v1/chat/completions)"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1 (several choices)"
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs were asked for"
    if body.get("echo"):
        return "echo was asked for"
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        return "tools / function calls"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(body.get(k) for k in _GUIDED):
        return "structured output (response_format / guided decoding)"
    temperature = body.get("temperature", 1.0)
    if body.get("seed") is not None and temperature != 0:
        return "a seeded sampled request (seed with temperature > 0): another worker cannot repeat its draws"
    if view.route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "the prompt is not one string (token ids or a batch)"
        if body.get("suffix"):
            return "suffix was given"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        last = messages[-1]
        if body.get("continue_final_message") and not (isinstance(last, dict) and isinstance(last.get("content"), str)):
            return "continue_final_message with a final message that is not plain text"
    return None


class MigrationRefused(UpstreamError):
    """A broken stream that could not be continued: the reason is the SSE error event the client gets."""

    code = "migration_not_possible"


class StreamTracker:
    """Reads a migratable stream as it is relayed (the Exchange's stream filter).

    Passes on only whole SSE events (a half event is never sent, so a break never leaves the client
    with one), keeps the text and the number of tokens the client has, and rewrites a continuation's
    events so that they read as the first worker's.
    """

    __slots__ = (
        "_buf",
        "_ident",
        "attempt_tokens",
        "done",
        "errored",
        "finished",
        "migrations",
        "parts",
        "probing",
        "tokens",
        "tokens_before",
        "usage_sent",
        "view",
    )

    def __init__(self, view: RequestView) -> None:
        self.view = view  # the client's request, as it came
        self.migrations = 0
        self.parts: list[str] = []  # text the client has, in order
        self.tokens = 0  # tokens the client has, all attempts
        self.tokens_before = 0  # of those, the ones sent before the current attempt started
        self.attempt_tokens = 0
        self.finished = False  # a finish_reason went out
        self.done = False  # `data: [DONE]` went out
        self.errored = False  # the worker sent an error event
        self.usage_sent = False  # the final usage event went out
        # The answer is complete but its usage event was lost with the worker: the current attempt only
        # asks another worker for the prompt's token count (see usage_probe).
        self.probing = False
        self._ident: dict[str, Any] = {}  # id, created, model, system_fingerprint of the first worker's events
        self._buf = bytearray()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def wants_usage(self) -> bool:
        """The client asked for a final usage event and has not had it."""
        options = self.view.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True and not self.usage_sent

    @property
    def ended(self) -> bool:
        """The client has the end of the answer (nothing to continue)."""
        return self.finished or self.done or self.errored

    def start_attempt(self) -> None:
        self._buf.clear()
        self.tokens_before = self.tokens
        self.attempt_tokens = 0

    # ------------------------------------------------------------------ the stream filter
    def feed(self, data: bytes) -> bytes:
        """The whole events that `data` completes, as the client must get them."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        while True:
            end = buf.find(b"\n\n")
            crlf = buf.find(b"\r\n\r\n")
            if crlf >= 0 and (end < 0 or crlf < end):
                end, sep = crlf, 4
            elif end >= 0:
                sep = 2
            else:
                break
            event = bytes(buf[: end + sep])
            del buf[: end + sep]
            sent = self._event(event)
            if sent:
                out.append(sent)
        return b"".join(out)

    def ended_stream(self) -> None:
        """The worker's stream ended: fine if the answer did, a break (to be continued) if not."""
        if not self.ended:
            raise UpstreamError("the worker's stream ended before the answer did", code="upstream_stream_broken")

    def _event(self, raw: bytes) -> bytes:
        data = b""
        for line in raw.splitlines():
            if line.startswith(b"data:"):
                data = line[5:].strip()
                break
        if data == b"[DONE]":
            self.done = True
            return raw
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return raw  # a comment or keep-alive: passed on as it came
        if not isinstance(obj, dict):
            return raw
        if self.probing:
            return self._probed(obj)
        if "error" in obj:
            self.errored = True
            return raw
        first = self.migrations == 0
        if first and not self._ident:
            self._ident = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint") if k in obj}
        carries = self._track(obj)
        if first:
            return raw
        if not carries:
            return b""  # the continuation's role event, keep-alives: the client had them from the first worker
        obj.update(self._ident)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self._usage(usage)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _probed(self, obj: dict[str, Any]) -> bytes:
        """An event of the usage probe: only its usage goes out, counting none of its own tokens."""
        usage = obj.get("usage")
        if obj.get("choices") or not isinstance(usage, dict):
            return b""
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int):
            return b""
        prompt = max(0, prompt - self.tokens_before)
        self.usage_sent = True
        counted = {
            **usage,
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
        }
        return b"data: " + orjson.dumps({**obj, **self._ident, "usage": counted}) + b"\n\n"

    def _track(self, obj: dict[str, Any]) -> bool:
        """Take the text, token count and end of one event; True if it carries anything for the client."""
        carries = False
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if isinstance(text, str) and text:
                    self.parts.append(text)
                    self.attempt_tokens += 1
                    carries = True
                if choice.get("finish_reason") is not None:
                    self.finished = True
                    carries = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            carries = True
            if not choices:
                self.usage_sent = True
            out = usage.get("completion_tokens")
            if isinstance(out, int) and choices:  # counts streamed with every event (continuous usage stats)
                self.attempt_tokens = out
        self.tokens = self.tokens_before + self.attempt_tokens
        return carries

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage in terms of the original request: its prompt held the text already sent."""
        prompt, out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(out, int):
            return usage
        prompt = max(0, prompt - self.tokens_before)
        out += self.tokens_before
        return {**usage, "prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    # ------------------------------------------------------------------ the continuation
    def remaining(self) -> int | None:
        """Tokens the continuation may still generate (None: the client set no limit)."""
        body = self.view.body
        for key in ("max_completion_tokens", "max_tokens"):
            limit = body.get(key)
            if isinstance(limit, int) and not isinstance(limit, bool):
                return limit - self.tokens
        return None

    def continuation(self) -> RequestView:
        """The request that makes another worker continue the answer from where the client is."""
        view = self.view
        body = dict(view.body)
        text = self.text
        if view.route is Route.CHAT:
            messages = list(body["messages"])
            last = messages[-1]
            if body.get("continue_final_message") and isinstance(last, dict):
                messages[-1] = {**last, "content": last["content"] + text}
            else:
                messages.append({"role": "assistant", "content": text})
            body["messages"] = messages
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            prompt = body["prompt"]
            body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            limit = body.get(key)
            if isinstance(limit, int) and not isinstance(limit, bool):
                body[key] = max(0 if key == "min_tokens" else 1, limit - self.tokens)
        return RequestView(
            route=view.route,
            body=body,
            raw=orjson.dumps(body),
            request_id=view.request_id,
            routing_key=view.routing_key,
        )

    def usage_probe(self) -> RequestView:
        """The request that recovers the usage of an answer completed just before its worker died: the
        continuation asked for one token, whose prompt count, less the tokens sent, is the original's."""
        self.probing = True
        view = self.continuation()
        body = view.body
        for key in ("max_tokens", "max_completion_tokens"):
            body.pop(key, None)
        body.pop("min_tokens", None)
        body["max_tokens"] = 1
        return RequestView(
            route=view.route,
            body=body,
            raw=orjson.dumps(body),
            request_id=view.request_id,
            routing_key=view.routing_key,
        )

    def closing_events(self) -> bytes:
        """The end of a stream whose token limit was reached just as its worker died."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.view.route is Route.CHAT:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        event = {**self._ident, "choices": [choice]}
        self.finished = True
        return b"data: " + orjson.dumps(event) + b"\n\n"
