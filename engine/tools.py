"""Tool calls: the schemas that force them, and parsers that turn model output into OpenAI ``tool_calls``.

``--tool-call-parser`` picks how free-form output is read (vLLM's flag): ``hermes`` reads JSON objects
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` tags, the format
Hermes, Qwen and SmolLM2 models are trained on. ``tool_choice: required`` or a named function
instead constrain the output through the grammar engine, so it always is a valid call.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:
    from engine.protocol import Tool

TOOL_CALL_PARSERS = ("hermes",)

# What a model without tools in its chat template is told about them (Hermes' system prompt, shortened).
HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "The functions available are listed in <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}'
    "\n</tool_call>"
)


def forced_call_schema(tools: Sequence[Tool], named: str | None, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of the output when a call is forced: a named function's arguments, or (required)
    a non-empty list of ``{"name", "parameters"}`` objects, one shape per tool (as vLLM does); one call
    at most without ``parallel``."""
    if named is not None:
        tool = next(t for t in tools if t.function.name == named)
        return tool.function.parameters or {"type": "object"}
    shapes = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "parameters": t.function.parameters or {"type": "object"}},
               "required": ["name", "parameters"]} for t in tools]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tools_for_template(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def hermes_system_prompt(tools: Sequence[Tool]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(orjson.dumps(t).decode() for t in tools_for_template(tools)))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: OpenAI's ``tool_calls`` entry."""

    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass(slots=True)
class ParsedDelta:
    """What a piece of output adds: plain text for ``content`` and finished tool calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """Reads a model's output as it streams; ``feed`` returns what can be said so far."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks; text outside them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls = 0
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (later calls are dropped, as vLLM)

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = _partial_tail(self._buffer, self.OPEN)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(self.OPEN) :]
                self._in_call = True
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                return out
            call = self._parse(self._buffer[:end])
            self._buffer = self._buffer[end + len(self.CLOSE) :]
            self._in_call = False
            if call is not None:
                if self.max_calls is None or self.calls <= self.max_calls:
                    out.calls.append(call)
            else:  # not a call after all: give the text back as content
                out.content += self.OPEN + self._buffer[:end] + self.CLOSE

    def finish(self) -> ParsedDelta:
        rest = self._buffer
        self._buffer = ""
        if self._in_call:
            self._in_call = False
            call = self._parse(rest)  # a call cut short by the token limit is kept if it parses
            if call is None:
                return ParsedDelta(content=self.OPEN + rest)
            return ParsedDelta(calls=[call] if self.max_calls is None or self.calls <= self.max_calls else [])
        return ParsedDelta(content=rest)

    def _parse(self, raw: str) -> ToolCall | None:
        try:
            obj = orjson.loads(raw.strip())
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        self.calls += 1
        return ToolCall(obj["name"], args if isinstance(args, str) else orjson.dumps(args).decode())


class ForcedParser:
    """The output of a forced call (a grammar made it valid JSON): parsed whole at the end."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self._text: list[str] = []

    def feed(self, text: str) -> ParsedDelta:
        self._text.append(text)
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        raw = "".join(self._text)
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return ParsedDelta(content=raw)  # cut short by max_tokens: no valid call to report
        if self.named is not None:
            return ParsedDelta(calls=[ToolCall(self.named, orjson.dumps(obj).decode())])
        return ParsedDelta(calls=[ToolCall(c["name"], orjson.dumps(c["parameters"]).decode()) for c in obj])


def make_parser(name: str, parallel: bool = True) -> ToolParser:
    if name == "hermes":
        return HermesParser(None if parallel else 1)
    raise ValueError(f"--tool-call-parser {name!r}: one of {', '.join(TOOL_CALL_PARSERS)}")


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that could grow into ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
