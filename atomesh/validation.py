"""The OpenAI request shapes, checked at the gateway before a request is placed.

Types and ranges of the fields engines read (OpenAI's, plus the vLLM / SGLang sampling extensions);
unknown fields pass through untouched (the body is forwarded as it came, never re-encoded). Checks
are strict: `"max_tokens": "16"` is refused, as OpenAI does, rather than coerced. A request that
fails gets 400 without reaching a worker, so a client's mistake never costs a worker a request or a
breaker a failure.
"""

from __future__ import annotations

from typing import Annotated, Any, NotRequired

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from atomesh.errors import BadRequest
from atomesh.request import Route

_OPEN = ConfigDict(extra="allow", strict=True)

NonNegInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Probability = Annotated[float, Field(ge=0, le=1)]
Temperature = Annotated[float, Field(ge=0)]


# Union members are tried left to right and a list stops at its first bad element, so the check of a
# 100,000-token prompt costs one pass, never one failed pass per member.
_FAST = Field(fail_fast=True)
_IN_ORDER = Field(union_mode="left_to_right")
Tokens = Annotated[list[int], _FAST]
Texts = Annotated[str | Annotated[list[str], _FAST], _IN_ORDER]
TokenIds = Annotated[Tokens | Annotated[list[Tokens], _FAST], _IN_ORDER]
Prompt = Annotated[str | Tokens | Annotated[list[str], _FAST] | Annotated[list[Tokens], _FAST], _IN_ORDER]
Stop = Annotated[str | Annotated[list[str], _FAST], _IN_ORDER]

# What a field with several accepted shapes must be (named in the 400 when none fits).
_SHAPES_OF = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "text": "a string or a list of strings",
    "input_ids": "a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string, a list of content parts or null",
    "input": "a string or a list of input items",
}


class StreamOptions(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    include_usage: NotRequired[bool | None]


class _Sampling(TypedDict):
    """Fields every OpenAI-style route shares (all optional, all nullable as OpenAI allows)."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    model: NotRequired[str | None]
    stream: NotRequired[bool | None]
    stream_options: NotRequired[StreamOptions | None]
    max_tokens: NotRequired[NonNegInt | None]
    n: NotRequired[PositiveInt | None]
    best_of: NotRequired[PositiveInt | None]
    temperature: NotRequired[Temperature | None]
    top_p: NotRequired[Probability | None]
    top_k: NotRequired[Annotated[int, Field(ge=-1)] | None]
    min_p: NotRequired[Probability | None]
    presence_penalty: NotRequired[Penalty | None]
    frequency_penalty: NotRequired[Penalty | None]
    repetition_penalty: NotRequired[Annotated[float, Field(gt=0)] | None]
    seed: NotRequired[int | None]
    stop: NotRequired[Stop | None]
    stop_token_ids: NotRequired[Tokens | None]
    ignore_eos: NotRequired[bool | None]
    logit_bias: NotRequired[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None]
    top_logprobs: NotRequired[Annotated[int, Field(ge=0, le=20)] | None]
    user: NotRequired[str | None]


class Completion(_Sampling):
    prompt: Prompt
    logprobs: NotRequired[NonNegInt | None]
    echo: NotRequired[bool | None]
    suffix: NotRequired[str | None]


class ContentPart(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    type: str


class Message(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    role: Annotated[str, Field(min_length=1)]
    content: NotRequired[Annotated[str | list[ContentPart], _IN_ORDER] | None]
    name: NotRequired[str | None]


class Chat(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: NotRequired[bool | None]
    max_completion_tokens: NotRequired[NonNegInt | None]


class SamplingParams(TypedDict):
    """SGLang's `/generate` sampling parameters."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    max_new_tokens: NotRequired[NonNegInt | None]
    min_new_tokens: NotRequired[NonNegInt | None]
    n: NotRequired[PositiveInt | None]
    temperature: NotRequired[Temperature | None]
    top_p: NotRequired[Probability | None]
    top_k: NotRequired[Annotated[int, Field(ge=-1)] | None]
    min_p: NotRequired[Probability | None]
    presence_penalty: NotRequired[Penalty | None]
    frequency_penalty: NotRequired[Penalty | None]
    repetition_penalty: NotRequired[Annotated[float, Field(gt=0)] | None]
    stop: NotRequired[Stop | None]
    stop_token_ids: NotRequired[Tokens | None]
    ignore_eos: NotRequired[bool | None]


class Generate(TypedDict):
    __pydantic_config__ = _OPEN  # type: ignore[misc]
    model: NotRequired[str | None]
    text: NotRequired[Texts | None]
    input_ids: NotRequired[TokenIds | None]
    prompt: NotRequired[Prompt | None]
    sampling_params: NotRequired[SamplingParams | None]
    stream: NotRequired[bool | None]
    return_logprob: NotRequired[bool | None]


class Responses(TypedDict):
    """OpenAI's Responses API request (the fields whose type or range the gateway can check)."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    model: NotRequired[str | None]
    input: Annotated[str | list[Any], _IN_ORDER]
    instructions: NotRequired[str | None]
    stream: NotRequired[bool | None]
    max_output_tokens: NotRequired[PositiveInt | None]
    temperature: NotRequired[Temperature | None]
    top_p: NotRequired[Probability | None]
    previous_response_id: NotRequired[str | None]
    store: NotRequired[bool | None]
    user: NotRequired[str | None]


class Relayed(TypedDict):
    """The routes relayed as the worker reads them (embeddings, rerank, score, classify, tokenize,
    Anthropic messages): only the fields the gateway itself reads are checked."""

    __pydantic_config__ = _OPEN  # type: ignore[misc]
    model: NotRequired[str | None]
    stream: NotRequired[bool | None]


_ONE_PASS_MAX = 64 * 1024  # bytes of a body decoded and checked in one pass (pydantic copies its input)
_SHAPES: dict[Route, TypeAdapter[Any]] = {
    Route.COMPLETIONS: TypeAdapter(Completion),
    Route.CHAT: TypeAdapter(Chat),
    Route.GENERATE: TypeAdapter(Generate),
    Route.RESPONSES: TypeAdapter(Responses),
}
_RELAYED: TypeAdapter[Any] = TypeAdapter(Relayed)


def parse_request(route: Route, raw: bytes | bytearray) -> dict[str, Any]:
    """Decode an inference request body and check its shape; raises BadRequest (400) naming the first
    field at fault.

    A small body is decoded and checked in one pass. A large one is decoded by orjson, straight from
    the received buffer, and the decoded objects are checked in place: the body's big strings then
    exist twice (received and decoded), never three or four times.
    """
    shape = _SHAPES.get(route, _RELAYED)
    try:
        if len(raw) <= _ONE_PASS_MAX:
            body: dict[str, Any] = shape.validate_json(raw)
        else:
            try:
                decoded = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(decoded, dict):
                raise BadRequest("request body must be a JSON object", code="invalid_json")
            shape.validate_python(decoded)
            body = decoded
    except ValidationError as e:
        raise _bad_request(e) from None
    if route is Route.GENERATE and not any(body.get(k) is not None for k in ("text", "input_ids", "prompt")):
        raise BadRequest("'text' or 'input_ids' is required", code="missing_input")
    return body


def _bad_request(e: ValidationError) -> BadRequest:
    first = e.errors(include_url=False, include_input=False)[0]
    loc, kind, msg = first["loc"], first["type"], first["msg"]
    if kind == "json_invalid":
        if not msg or "EOF while parsing a value at line 1 column 0" in msg:
            return BadRequest("request body is empty; a JSON object is expected", code="invalid_json")
        return BadRequest(f"request body is not valid JSON: {msg}", code="invalid_json")
    if not loc:
        return BadRequest("request body must be a JSON object", code="invalid_json")
    # A union's members appear in the path as type names ("str", "list[int]"): name the field instead.
    path: list[str] = []
    for part in loc:
        if isinstance(part, str) and (part in _MEMBER_NAMES or "[" in part):
            field = next((p for p in reversed(path) if not p.isdigit()), "body")
            return BadRequest(
                f"{'.'.join(path)}: must be {_SHAPES_OF.get(field, 'of another type')}", code="invalid_value"
            )
        path.append(str(part))
    return BadRequest(f"{'.'.join(path)}: {msg}", code="invalid_value")


_MEMBER_NAMES = frozenset({"str", "int", "float", "bool", "none"})
