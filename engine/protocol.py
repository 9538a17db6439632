"""The engine's HTTP request bodies: every field typed, ranged and checked before anything is scheduled.

Types are strict, as OpenAI's: a boolean is not an integer, a string is not a boolean, ``"16"`` is
not 16. Unknown fields are ignored (OpenAI's behaviour; clients send their own extras), but a field
this engine knows and does not implement is refused by name whenever it asks for something other
than its default: nothing a client sets is silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError
from engine.sequence import SamplingParams

STRICT = ConfigDict(extra="ignore", strict=True)

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's top_logprobs maximum
MAX_N = 16  # sequences per request (n, best_of)
MAX_LOGIT_BIAS = 1024  # entries per request

# Fields vLLM or OpenAI define that this engine does not implement, and the value that asks for nothing
# (accepted). Any other value is refused with the field's name.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "logits_processors": (),
    "prompt_embeds": (),
    "guided_whitespace_pattern": (),
    "guided_decoding_backend": ("xgrammar", "auto"),
    "functions": (),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "mm_processor_kwargs": (),
    "documents": (),
    "chat_template": (),
}


def _refuse_unsupported(data: dict[str, Any]) -> None:
    for name, accepted in UNSUPPORTED.items():
        value = data.get(name)
        if value is None or any(value == a and type(value) is type(a) for a in accepted):
            continue
        raise InvalidRequestError(f"{name} is not supported by this engine (got {orjson.dumps(value).decode()[:80]})")


# -- pieces -----------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = STRICT
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk (refused: not implemented)


class JsonSchema(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (the newer spelling of the ``guided_*`` fields)."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    """A tool's function: name, description, JSON-schema parameters."""

    model_config = STRICT
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``."""

    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match: a kind (json_schema, json_object, regex, choice, grammar) and its text."""

    kind: str
    source: str

    @property
    def cache_key(self) -> tuple[str, str]:
        return self.kind, self.source


Prob = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0)]
# Sampling fields the OpenAI bodies and /generate's sampling_params share.
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
StopStrings = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=64)]


class SamplingKnobs(BaseModel):
    """The sampling fields the OpenAI bodies and SGLang's ``sampling_params`` spell alike."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Prob | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None


class SamplingBody(SamplingKnobs):
    """Fields common to completions and chat completions (OpenAI's, plus vLLM's sampling extras)."""

    model_config = STRICT

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stop: StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None  # OpenAI: for abuse monitoring; no effect on the output
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None  # vLLM's: lower first (needs
    # --scheduling-policy priority; any other value than 0 is refused under fcfs, as vLLM does)
    kv_transfer_params: dict[str, Any] | None = None
    data_parallel_rank: int | None = None

    # -- checks shared by both endpoints --------------------------------------------------------------

    def check(self) -> None:
        """Refuse combinations this engine does not do, naming the fields."""
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequestError("stream_options is only allowed with stream: true")
            if self.stream_options.continuous_usage_stats:
                raise InvalidRequestError("stream_options.continuous_usage_stats is not supported by this engine")
        if (isinstance(self.stop, list) and any(not s for s in self.stop)) or self.stop == "":
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
        if self.data_parallel_rank not in (None, 0):
            raise InvalidRequestError(f"data_parallel_rank {self.data_parallel_rank}: this engine has dp_size 1")
        kv = self.kv_transfer_params or {}
        if kv.get("do_remote_decode") and kv.get("do_remote_prefill"):
            raise InvalidRequestError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        if kv.get("do_remote_decode") and self.stream:
            raise InvalidRequestError("kv_transfer_params: a prefill for remote decode must have stream=false")
        if kv.get("do_remote_decode") and self.num_sequences > 1:
            raise InvalidRequestError(
                "kv_transfer_params: a prefill for remote decode computes one sequence (n=1, "
                "no best_of); the decode engine forks the others from the transferred KV"
            )
        self.grammar()  # refuses conflicting or malformed structured-output requests

    @property
    def num_sequences(self) -> int:
        """How many sequences the request generates (n, or best_of where larger)."""
        return self.n or 1

    def token_limit(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives per sampled token (None: no logprobs at all)."""
        return None

    def grammar(self) -> GrammarSpec | None:
        """The structured-output constraint the request asks for (at most one may be given)."""
        specs: list[tuple[str, GrammarSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs.append(("response_format", GrammarSpec("json_object", "")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format: json_schema.schema is required for type json_schema")
            specs.append(("response_format", GrammarSpec("json_schema", _dumps(rf.json_schema.schema_))))
        if self.guided_json is not None:
            specs.append(("guided_json", _json_spec(self.guided_json, "guided_json")))
        if self.guided_regex is not None:
            specs.append(("guided_regex", _regex_spec(self.guided_regex, "guided_regex")))
        if self.guided_choice is not None:
            specs.append(("guided_choice", GrammarSpec("choice", _dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            specs.append(("guided_grammar", GrammarSpec("grammar", self.guided_grammar)))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                specs.append(("structured_outputs.json", _json_spec(so.json_, "structured_outputs.json")))
            if so.regex is not None:
                specs.append(("structured_outputs.regex", _regex_spec(so.regex, "structured_outputs.regex")))
            if so.choice is not None:
                specs.append(("structured_outputs.choice", GrammarSpec("choice", _dumps(so.choice))))
            if so.grammar is not None:
                specs.append(("structured_outputs.grammar", GrammarSpec("grammar", so.grammar)))
            if so.json_object:
                specs.append(("structured_outputs.json_object", GrammarSpec("json_object", "")))
        if len(specs) > 1:
            raise InvalidRequestError(
                "only one structured-output constraint per request; got " + ", ".join(name for name, _ in specs)
            )
        return specs[0][1] if specs else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (``max_tokens`` already resolved)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias: list[tuple[int, float]] = []
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"\d{1,9}", key):
                raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key!r}")
            bias.append((int(key), value))
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(bias),
            logprobs=self.top_logprobs_wanted(),
            prompt_logprobs=self.prompt_logprobs,
            priority=self.priority or 0,
        )


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _json_spec(value: dict[str, Any] | str, field: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequestError(f"{field}: not a JSON schema: {exc}") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field}: a JSON schema must be an object")
    return GrammarSpec("json_schema", _dumps(value))


def _regex_spec(value: str, field: str) -> GrammarSpec:
    if not value:
        raise InvalidRequestError(f"{field}: the regular expression is empty")
    return GrammarSpec("regex", value)


class CompletionBody(SamplingBody):
    """POST /v1/completions."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported: this model has no fill-in-the-middle mode")
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise InvalidRequestError(f"best_of ({self.best_of}) must be at least n ({self.n or 1})")
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            raise InvalidRequestError("best_of > n cannot be streamed (the best are known only at the end)")
        if self.echo and (self.kv_transfer_params or {}).get("do_remote_decode"):
            raise InvalidRequestError(
                "echo: a prefill for remote decode answers nothing but kv_transfer_params; the "
                "decode engine echoes the prompt"
            )

    @property
    def num_sequences(self) -> int:
        return max(self.n or 1, self.best_of or 1)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message; ``content`` may be a string or OpenAI text parts."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(f"message content of type {part.type!r} is not supported")
            parts.append(part.text or "")
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's conventions)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            calls = []
            for call in self.tool_calls:
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates want a mapping
                    try:
                        fn["arguments"] = orjson.loads(args)
                    except orjson.JSONDecodeError:
                        pass
                calls.append({**call, "function": fn})
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(SamplingBody):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's template switches: `continue_final_message` leaves the last message open for the model to
    # continue (a gateway resuming a stream on another engine sends it with add_generation_prompt false);
    # add_generation_prompt (the assistant's turn opener) defaults to the opposite.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = None  # vLLM: prepend the last message to the answer
    best_of: int | None = None  # vLLM's chat accepted it once; only completions rank sequences here

    def check(self) -> None:
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of is only supported for completions by this engine")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs: true")
        if self.echo:
            raise InvalidRequestError("echo is not supported for chat completions by this engine")
        self.template_switches()
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice: required needs tools")
        if self.tools_forced() and self.grammar_of_body() is not None:
            raise InvalidRequestError(
                "tool_choice required / a named function cannot be combined with response_format or guided decoding"
            )
        super().check()  # last: it builds the grammar, which needs the tools checked

    def template_switches(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message); both true is refused, as vLLM does."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        return add, self.continue_final_message

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tools_active(self) -> list[Tool]:
        """The tools the model may call (none when tool_choice is none)."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def tools_forced(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def grammar_of_body(self) -> GrammarSpec | None:
        return SamplingBody.grammar(self)

    def grammar(self) -> GrammarSpec | None:
        if self.tools_forced():
            from engine.tools import forced_call_schema

            named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            parallel = self.parallel_tool_calls is not False
            return GrammarSpec("json_schema", _dumps(forced_call_schema(self.tools or [], named, parallel)))
        return self.grammar_of_body()


class GenerateSampling(SamplingKnobs):
    """SGLang's ``sampling_params`` of POST /generate (the fields this engine implements; others refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: Annotated[int, Field(ge=1)] | None = 128
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None
    stop: StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None


class GenerateBody(BaseModel):
    """POST /generate (SGLang's native route): one prompt as ``text`` or ``input_ids``."""

    model_config = STRICT

    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool | None = None
    # A P/D prefill leg may also carry OpenAI's field (atomesh sets both).
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def as_completion(self) -> CompletionBody:
        """The same request as a /v1/completions body (one path through the engine)."""
        prompt: Any = self.text if self.text is not None else self.input_ids
        if prompt is None:
            raise InvalidRequestError("'text' or 'input_ids' is required")
        sp = self.sampling_params
        body = CompletionBody(
            model=self.model, prompt=prompt, stream=self.stream, kv_transfer_params=self.kv_transfer_params,
            max_tokens=self.max_tokens if self.max_tokens is not None else sp.max_new_tokens,
            min_tokens=sp.min_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            min_p=sp.min_p, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos, seed=sp.seed,
            guided_json=sp.json_schema, guided_regex=sp.regex)  # fmt: skip
        body.check()
        return body


_Model = TypeVar("_Model", bound=BaseModel)


def parse_body(raw: bytes, model: type[SamplingBody]) -> Any:
    """Decode and validate a request body; raises InvalidRequestError naming the first field at fault."""
    data = json_object(raw)
    _refuse_unsupported(data)
    body = validated(model, data)
    body.check()
    return body


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body's JSON object, or InvalidRequestError saying why not."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return data


def validated(model: type[_Model], data: dict[str, Any]) -> _Model:
    """``data`` as ``model``, or InvalidRequestError naming the first field at fault, with what ``_telling`` picks of
    that field's errors."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        field = errors[0]["loc"][:1]
        error = max((e for e in errors if e["loc"][:1] == field), key=_telling)
        where = ".".join(str(p) for p in error["loc"] if not _is_member_name(p)) or "body"
        raise InvalidRequestError(f"{where}: {error['msg']}") from exc


def _telling(error: Any) -> tuple[bool, int]:
    """How much an error says, among a field's (``max`` keeps the first of equals). A field of several types (``stop``:
    a string or a list of them) has an error for each: one that is not about the value's type (a list too long, a
    token id below 0) is from the type the value has; else the deepest (an item of a list) is from a type whose
    container it fits."""
    about_the_value = not error["type"].endswith("_type")
    return about_the_value, sum(not _is_member_name(p) for p in error["loc"])


def _is_member_name(part: Any) -> bool:
    # Union members show in an error's path as type names ("str", "list[int]", "constrained-int").
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part or "-" in part)
