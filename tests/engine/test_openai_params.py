"""The OpenAI / vLLM request parameters over real HTTP with the openai client: logprobs, penalties,
logit_bias, min_tokens, stop_token_ids, edge values, structured output, tools, n and best_of, echo.

Two servers for the whole module (each in its own thread and event loop): the tiny random model
for the mechanics, SmolLM2 where the answer must make sense (logprobs against transformers,
outputs that parse against a schema).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import torch
from aiohttp import web
from gwtest import free_port, require

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import LoadedModel
from engine.openai_server import create_app
from engine.sequence import SamplingParams, SequenceStatus
from engine.tools import HermesParser

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")

require("xgrammar", "make install puts it in")


class ThreadServer:
    """An engine server on a free loopback port, run by its own event loop in a thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.port = free_port()
        self.engine = engine
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the engine server did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._runner = web.AppRunner(create_app(self.engine, self.engine.args), handler_cancellation=True)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def _serve(loaded: LoadedModel, model: str, **overrides: Any) -> ThreadServer:
    args = EngineArgs(model=model, device=DEVICE, dtype="float32", num_kvcache_blocks=128, max_model_len=512,
                      host="127.0.0.1", cudagraph_capture_sizes=(1, 2, 4, 8), tool_call_parser="hermes",
                      enable_auto_tool_choice=True, **overrides)  # fmt: skip
    return ThreadServer(LLMEngine(args, loaded=loaded))


@pytest.fixture(scope="module")
def tiny(tiny_model: LoadedModel) -> Iterator[ThreadServer]:
    server = _serve(tiny_model, "tiny-random")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smol(smollm2_model: LoadedModel) -> Iterator[ThreadServer]:
    server = _serve(smollm2_model, "smollm2")
    yield server
    server.stop()


GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _chunks(stream: Any) -> list[Any]:
    return list(stream)


# -- logprobs ------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_logprobs_equal_transformers_log_softmax(
    smol: ThreadServer, smollm2_model: LoadedModel, smollm2_reference: torch.nn.Module
) -> None:
    require("transformers", "make install puts it in")
    client = smol.client()
    prompt = "The capital of France is"
    done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, logprobs=3, **GREEDY)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens or []) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(4)]

    tok = smollm2_model.tokenizer
    ids = tok.encode(prompt)
    completion = [tok.encode(t)[0] for t in lp.tokens or []]  # each token's own text is that one token
    with torch.inference_mode():
        logits = smollm2_reference(torch.tensor([ids + completion], device=DEVICE)).logits[0].float()
    want = logits.log_softmax(-1)[len(ids) - 1 : len(ids) + len(completion) - 1]
    for i, token in enumerate(completion):
        assert lp.token_logprobs[i] == pytest.approx(want[i, token].item(), abs=1e-3)
        best = want[i].topk(3)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(best.values.tolist(), abs=1e-3)

    # Streamed, and in chat's shape: the same numbers.
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=4, logprobs=3, stream=True, **GREEDY
        )
        if c.choices
    ]
    flat = [v for c in streamed if c is not None for v in (c.token_logprobs or [])]
    assert flat == pytest.approx(lp.token_logprobs, abs=1e-5)

    messages: Any = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=3, logprobs=True,
                                          top_logprobs=2, **GREEDY)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    chat_stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=3, logprobs=True,
                                                 top_logprobs=2, stream=True, **GREEDY)  # fmt: skip
    got = [e.logprob for c in chat_stream for ch in c.choices if ch.logprobs and ch.logprobs.content
           for e in ch.logprobs.content]  # fmt: skip
    assert got == pytest.approx([c.logprob for c in content], abs=1e-5)


def test_logprobs_zero_and_sampled_logprobs_follow_the_temperature(tiny: ThreadServer) -> None:
    client = tiny.client()
    zero = client.completions.create(model="tiny-random", prompt="abc", max_tokens=3, logprobs=0, **GREEDY)
    lp = zero.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 3 and lp.top_logprobs == [{}, {}, {}]
    # The logprobs of a sampled request are those of the distribution it sampled from (after temperature).
    hot = client.completions.create(model="tiny-random", prompt="abc", max_tokens=3, logprobs=1, temperature=0.5,
                                    seed=3, extra_body={"top_k": 1, "ignore_eos": True})  # fmt: skip
    cold = client.completions.create(model="tiny-random", prompt="abc", max_tokens=3, logprobs=1, **GREEDY)
    assert hot.choices[0].text == cold.choices[0].text  # top_k 1: the greedy tokens
    hot_lp, cold_lp = hot.choices[0].logprobs.token_logprobs, cold.choices[0].logprobs.token_logprobs  # type: ignore
    assert all(h > c for h, c in zip(hot_lp, cold_lp, strict=True))  # sharper: the top token more likely


# -- penalties, logit_bias, min_tokens, stop_token_ids -------------------------------------------------


def _text(client: openai.OpenAI, **extra: Any) -> Any:
    body = {"ignore_eos": True, **extra.pop("extra_body", {})}
    return client.completions.create(model="tiny-random", prompt="hello hello", max_tokens=extra.pop("max_tokens", 12),
                                     temperature=0, extra_body=body, **extra).choices[0]  # fmt: skip


def test_logit_bias_and_penalties_change_greedy_output(tiny: ThreadServer) -> None:
    client = tiny.client()
    base = _text(client, logprobs=0)
    # A +100 bias on one token makes it every token.
    forced = _text(client, logit_bias={"65": 100}, max_tokens=5)
    assert forced.text == "AAAAA"
    # Frequency / presence penalties and a repetition penalty push repeated tokens down: the output changes
    # and repeats less.
    ids = base.logprobs.tokens  # type: ignore[union-attr]
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 3.0}}):
        penalized = _text(client, **extra)
        assert penalized.text != base.text, extra
    assert len(set(_text(client, frequency_penalty=2.0).text)) >= len(set(ids or []))


def test_min_tokens_and_stop_token_ids(tiny: ThreadServer) -> None:
    client = tiny.client()
    first = _text(client, max_tokens=1, logprobs=0)
    stop_id = tiny.engine.tokenizer.encode(first.text)[0]
    stopped = _text(client, extra_body={"stop_token_ids": [stop_id], "ignore_eos": False})
    assert stopped.finish_reason == "stop" and stopped.text == "" and stopped.model_extra["stop_reason"] == stop_id
    held = _text(client, max_tokens=8, extra_body={"stop_token_ids": [stop_id], "min_tokens": 3, "ignore_eos": False})
    assert held.text != "" and held.model_extra["stop_reason"] in (stop_id, None)
    done = client.completions.create(model="tiny-random", prompt="hello hello", max_tokens=8, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": 3})  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens >= 3


# -- edge values -----------------------------------------------------------------------------------------


def test_a_temperature_that_underflows_is_greedy(tiny: ThreadServer) -> None:
    client = tiny.client()
    greedy = _text(client)
    tiny_t = client.completions.create(model="tiny-random", prompt="hello hello", max_tokens=12, temperature=1e-39,
                                       extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
    assert tiny_t.text == greedy.text


def test_streamed_chunks_carry_usage_null_until_the_usage_chunk(tiny: ThreadServer) -> None:
    import urllib.request

    body = {"model": "tiny-random", "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(tiny.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n\n") if line.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


# -- structured output ------------------------------------------------------------------------------------

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_always_parses(smol: ThreadServer, stream: bool) -> None:
    client = smol.client()
    messages: Any = [{"role": "user", "content": "Describe Paris as JSON."}]
    for schema in SCHEMAS:
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        if stream:
            parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=60, temperature=0, response_format=fmt, stream=True)
                if c.choices]  # fmt: skip
            text = "".join(parts)
        else:
            text = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                                  response_format=fmt).choices[0].message.content or ""  # fmt: skip
        jsonschema.validate(json.loads(text), schema)
    # A seeded sampled request too.
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS[0]}}
    sampled = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0.8,
                                             seed=1, response_format=fmt).choices[0]  # fmt: skip
    jsonschema.validate(json.loads(sampled.message.content or ""), SCHEMAS[0])
    # Any JSON object.
    obj = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=100, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]  # fmt: skip
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content or ""), dict)


def test_guided_regex_and_choice(tiny: ThreadServer) -> None:
    client = tiny.client()
    out = client.completions.create(model="tiny-random", prompt="x", max_tokens=20, temperature=1.0, seed=5,
                                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}).choices[0]  # fmt: skip
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.text) and out.finish_reason == "stop"
    picks = {client.completions.create(model="tiny-random", prompt="x", max_tokens=10, temperature=1.0, seed=s,
                                       extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
             for s in range(4)}  # fmt: skip
    assert picks <= {"yes", "no"}
    with pytest.raises(openai.BadRequestError, match="json schema"):
        client.completions.create(model="tiny-random", prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "nonsense-type"}})  # fmt: skip


# -- tools -----------------------------------------------------------------------------------------------

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.timeout(300)
def test_tool_calls_named_required_and_auto(smol: ThreadServer) -> None:
    client = smol.client()
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    named = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER, TIME], max_tokens=40, temperature=0, tool_choice=choice
    )
    call = named.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME],
                                              max_tokens=60, temperature=0, tool_choice="required")  # fmt: skip
    assert required.choices[0].finish_reason == "tool_calls"
    assert {c.function.name for c in required.choices[0].message.tool_calls or []} <= {"get_weather", "get_time"}
    # auto: free-form output read by the hermes parser (the output is steered into a call by a regex here,
    # so that the test does not depend on what a 135M model decides), streamed and not.
    steer = {"guided_regex": r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'}
    auto = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=40,
                                          temperature=0, extra_body=steer)  # fmt: skip
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.content is None
    assert auto.choices[0].message.tool_calls[0].function.arguments == '{"city":"Paris"}'  # type: ignore[index]
    deltas = [d for c in client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                                        max_tokens=40, temperature=0, stream=True, extra_body=steer)
              for ch in c.choices for d in (ch.delta.tool_calls or [])]  # fmt: skip
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [  # type: ignore[union-attr]
        (0, "get_weather", '{"city":"Paris"}')
    ]


def test_hermes_parser_streams_across_split_tags() -> None:
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and <tool_c'
    parser = HermesParser()
    content, calls = "", []
    for i in range(0, len(text), 3):
        d = parser.feed(text[i : i + 3])
        content += d.content
        calls += d.calls
    end = parser.finish()
    assert content + end.content == "Sure.  and <tool_c"
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x":1}')]
    # parallel_tool_calls false: the first call only.
    single = HermesParser(max_calls=1)
    two = single.feed(text[:65] + text[:65]).calls + single.finish().calls
    assert [c.name for c in two] == ["f"]


# -- n, best_of, echo -------------------------------------------------------------------------------------


def test_n_and_best_of(tiny: ThreadServer) -> None:
    client = tiny.client()
    out = client.completions.create(model="tiny-random", prompt="many", max_tokens=6, n=3, temperature=1.0, seed=4,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage is not None and out.usage.completion_tokens == 18 and out.usage.prompt_tokens == 4
    again = client.completions.create(model="tiny-random", prompt="many", max_tokens=6, n=3, temperature=1.0, seed=4,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny-random", prompt="many", max_tokens=6, n=3, temperature=1.0,
                                           seed=4, stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in out.choices}
    best = client.completions.create(model="tiny-random", prompt="many", max_tokens=6, n=1, best_of=3,
                                     temperature=1.0, seed=4, extra_body={"ignore_eos": True})  # fmt: skip
    assert len(best.choices) == 1 and best.usage is not None and best.usage.completion_tokens == 18
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.num_blocks


def test_echo(tiny: ThreadServer) -> None:
    client = tiny.client()
    plain = client.completions.create(model="tiny-random", prompt="echo me", max_tokens=4, **GREEDY).choices[0]
    echoed = client.completions.create(model="tiny-random", prompt="echo me", max_tokens=4, echo=True,
                                       **GREEDY).choices[0]  # fmt: skip
    assert echoed.text == "echo me" + plain.text


def test_forked_samples_share_the_prompt_blocks(make_engine: Any) -> None:
    engine = make_engine(num_kvcache_blocks=32, block_size=16)
    prompt = list(range(1, 41))  # 40 tokens: two full blocks, one partial
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=5, ignore_eos=True)
    parent = engine.add_request(prompt, engine.check_request(len(prompt), params, True))
    forks = [engine.add_fork(parent, i) for i in (1, 2)]
    engine.step()  # the parent's prefill; the forks join the waiting queue holding its full blocks
    assert all(f.block_table == parent.block_table[:2] for f in forks)
    assert engine.block_manager.num_free_blocks == 32 - 3
    while any(s.status is not SequenceStatus.FINISHED for s in [parent, *forks]):
        engine.step()
    assert engine.block_manager.num_free_blocks == 32
    # A fork draws what an independent sequence of the same stream draws.
    alone = engine.add_request(prompt, engine.check_request(len(prompt), params, True), stream_index=2)
    while alone.status is not SequenceStatus.FINISHED:
        engine.step()
    assert alone.completion_ids == forks[1].completion_ids != parent.completion_ids


def test_echo_with_logprobs_and_prompt_logprobs(tiny: ThreadServer) -> None:
    client = tiny.client()
    prompt = "score this prompt"
    out = client.completions.create(
        model="tiny-random",
        prompt=prompt,
        max_tokens=3,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 1, "ignore_eos": True},
        temperature=0,
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and choice.text.startswith(prompt)
    n = len(prompt)  # the tiny model's tokenizer: one token per byte
    assert len(lp.tokens or []) == n + 3 and "".join(lp.tokens or []) == choice.text
    assert (lp.token_logprobs or [])[0] is None and all(v is not None for v in (lp.token_logprobs or [])[1:])
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n
    # vLLM's entry holds the prompt's own token: the same logprob as the echoed one.
    for i in range(1, n):
        own = vllm[i][str(ord(prompt[i]))]
        assert own["logprob"] == pytest.approx((lp.token_logprobs or [])[i]) and own["decoded_token"] == prompt[i]
    # The same numbers without the prefix cache's help (a second identical request) and streamed.
    again = client.completions.create(
        model="tiny-random",
        prompt=prompt,
        max_tokens=3,
        echo=True,
        logprobs=2,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    flat = [v for c in again for ch in c.choices for v in ((ch.logprobs.token_logprobs or []) if ch.logprobs else [])]
    assert flat == pytest.approx(lp.token_logprobs)


def test_continue_final_message_and_add_generation_prompt(tiny: ThreadServer) -> None:
    client = tiny.client()
    tok = tiny.engine.tokenizer
    messages: Any = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    cont = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})  # fmt: skip
    # The final message is left open: the prompt ends with its text, no end-of-turn after it.
    open_prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"
    assert cont.usage is not None and cont.usage.prompt_tokens == len(tok.encode(open_prompt))
    closed = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"add_generation_prompt": False})  # fmt: skip
    assert closed.usage is not None and closed.usage.prompt_tokens == len(tok.encode(open_prompt + "<|im_end|>\n"))
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": True})  # fmt: skip


@pytest.mark.parametrize(("extra", "names"), [
    ({"logprobs": 1}, "logprobs"),  # chat's logprobs is a boolean
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"best_of": 2}, "best_of"),
    ({"echo": True}, "echo"),
    ({"n": 17}, "n"),
    ({"stream": 1}, "stream"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    # A field of several types: the error of the type the value has, not the first type's.
    ({"stop": ["x"] * 17}, "stop: List should have at most 16 items"),
    ({"stop": ["a", 3]}, "stop.1: Input should be a valid string"),
])  # fmt: skip
def test_chat_refusals_name_the_field(tiny: ThreadServer, extra: dict[str, Any], names: str) -> None:
    import urllib.error
    import urllib.request

    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    req = urllib.request.Request(tiny.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    message = json.loads(err.value.read())["error"]["message"]
    assert names in message, message


@pytest.mark.parametrize(("prompt", "message"), [
    ([-1], "prompt.0: Input should be greater than or equal to 0"),
    ([7, 1.5], "prompt.1: Input should be a valid integer"),
    ([[1, 2], "mixed"], "prompt.0: Input should be a valid integer"),
    (None, "prompt: Input should be a valid string"),
])  # fmt: skip
def test_a_prompt_of_several_types_is_refused_for_what_is_wrong_with_it(prompt: Any, message: str) -> None:
    from engine.errors import InvalidRequestError
    from engine.protocol import CompletionBody, validated

    with pytest.raises(InvalidRequestError) as err:
        validated(CompletionBody, {"model": "m", "prompt": prompt})
    assert str(err.value) == message


def test_a_seeded_draw_does_not_depend_on_the_batch_path() -> None:
    from engine.sampler import Sampler, SampleRow, seed_key

    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(frozenset({0}), 0)
    rows = [SampleRow(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=s), seed_key(s, 0, 0)) for s in (1, 2)]
    alone = sampler.sample(logits[:2], rows).tokens  # every row has a top-k: the top-k columns only
    # Batched with a row without top-k, the same rows go through a full sort: the same draws.
    other = SampleRow(SamplingParams(temperature=0.7, top_p=0.5, seed=3), seed_key(3, 0, 0))
    assert sampler.sample(logits, [*rows, other]).tokens[:2] == alone
    # top_k 1 is the argmax, whatever the temperature, and whatever the other rows ask: batched with a plain sampled
    # row (no top-k, no top-p) too, which once left every row uncut.
    one = [SampleRow(SamplingParams(temperature=5.0, top_k=1, seed=s), seed_key(s, 0, 0)) for s in (1, 2)]
    assert sampler.sample(logits[:2], one).tokens == logits[:2].argmax(-1).tolist()
    for s in range(8):
        plain = SampleRow(SamplingParams(temperature=1.0, seed=s), seed_key(s, 0, 0))
        assert sampler.sample(logits, [*one, plain]).tokens[:2] == logits[:2].argmax(-1).tolist()


def test_generate_route_takes_the_same_sampling_features(tiny: ThreadServer) -> None:
    import re
    import urllib.error
    import urllib.request

    def post(body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(tiny.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, out = post({"text": "x", "sampling_params": {"regex": "[0-9]{4}", "max_new_tokens": 8, "seed": 2}})
    assert status == 200 and re.fullmatch("[0-9]{4}", out["text"]), out
    status, out = post({"text": "x", "sampling_params": {"max_new_tokens": True}})
    assert status == 400 and "max_new_tokens" in out["error"]["message"]
    status, out = post({"text": "x", "sampling_params": {"n": 2}})
    assert status == 400 and "n" in out["error"]["message"]
