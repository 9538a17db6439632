"""The OpenAI server over real HTTP on loopback: shapes, streaming, stop strings, seeds, errors, aborts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from engine.models.loader import LoadedModel

StartServer = Callable[..., Awaitable[Any]]
WaitFor = Callable[..., Awaitable[None]]


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def sse(http: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    """The decoded ``data:`` events of a streamed response, ``[DONE]`` as the string itself."""
    events: list[Any] = []
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_completion_shape_and_usage(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    status, body = await post(
        http, server.url + "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "tiny-random"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str) and choice["index"] == 0
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == 13


async def test_openai_client_completions_chat_and_streams(start_server: StartServer) -> None:
    server = await start_server()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-random"]
        extra = {"ignore_eos": True}
        done = await client.completions.create(
            model="tiny-random", prompt="Once", max_tokens=12, temperature=0, extra_body=extra
        )
        assert done.usage is not None and done.usage.completion_tokens == 12
        stream = await client.completions.create(
            model="tiny-random", prompt="Once", max_tokens=12, temperature=0, stream=True, extra_body=extra
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces) == done.choices[0].text

        messages: Any = [{"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(
            model="tiny-random", messages=messages, max_completion_tokens=10, temperature=0, extra_body=extra
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason == "length"
        chat_stream = await client.chat.completions.create(
            model="tiny-random",
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        deltas, usage, reasons = [], None, []
        async for c in chat_stream:
            if c.usage is not None:
                usage = c.usage
            for ch in c.choices:
                deltas.append(ch.delta.content or "")
                reasons.append(ch.finish_reason)
        assert "".join(deltas) == chat.choices[0].message.content
        assert reasons[-1] == "length" and usage is not None and usage.completion_tokens == 10
    finally:
        await client.close()


async def test_stop_strings_cut_the_text_streamed_or_not(
    start_server: StartServer, http: aiohttp.ClientSession
) -> None:
    server = await start_server()
    base = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    _, full = await post(http, server.url + "/v1/completions", base)
    text = full["choices"][0]["text"]
    stop = text[12:15]
    cut = text[: text.index(stop)]
    status, body = await post(http, server.url + "/v1/completions", {**base, "stop": [stop, "never-there"]})
    assert status == 200
    assert body["choices"][0]["text"] == cut and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 40
    events = await sse(http, server.url + "/v1/completions", {**base, "stop": stop})
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    # Concatenated deltas equal the cut text: no partial stop string was ever sent.
    assert "".join(c["text"] for c in chunks) == cut
    assert chunks[-1]["finish_reason"] == "stop"


async def test_seed_makes_sampling_reproducible(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    body = {"prompt": "Roll the dice", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 7}
    _, a = await post(http, server.url + "/v1/completions", body)
    _, b = await post(http, server.url + "/v1/completions", body)
    _, c = await post(http, server.url + "/v1/completions", {**body, "seed": 8})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["text"] != c["choices"][0]["text"]


async def test_concurrent_requests_match_sequential(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    prompts = [f"prompt number {i}: " + "x" * i for i in range(8)]

    async def one(p: str) -> str:
        _, body = await post(
            http, server.url + "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        )
        return str(body["choices"][0]["text"])

    together = await asyncio.gather(*(one(p) for p in prompts))
    alone = [await one(p) for p in prompts]
    assert together == alone


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"prompt": "x", "model": "other"}, 404, "model_not_found"),
        ({"prompt": "x", "max_tokens": 0}, 400, "invalid_request"),
        ({"prompt": "x", "max_tokens": -1}, 400, "invalid_request"),
        ({"prompt": "x", "max_tokens": True}, 400, "invalid_request"),  # a boolean is not an integer
        ({"prompt": "x", "stream": "yes"}, 400, "invalid_request"),  # a string is not a boolean
        ({"prompt": "x", "temperature": "0.5"}, 400, "invalid_request"),
        ({"prompt": "x", "logprobs": 21}, 400, "invalid_request"),
        ({"prompt": "x", "logprobs": True}, 400, "invalid_request"),
        ({"prompt": "x", "n": 2, "best_of": 1}, 400, "invalid_request"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "invalid_request"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, 400, "invalid_request"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, 400, "invalid_request"),
        ({"prompt": "x", "stop_token_ids": [99999]}, 400, "invalid_request"),
        ({"prompt": "x", "suffix": "tail"}, 400, "invalid_request"),
        ({"prompt": "x", "use_beam_search": True}, 400, "invalid_request"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "invalid_request"),
        ({"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, 400, "invalid_request"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_request"),
        ({"prompt": "y" * 300}, 400, "context_length_exceeded"),
        ({"prompt": "x", "max_tokens": 290}, 400, "context_length_exceeded"),
        ({"prompt": "x" * 100, "max_tokens": 100}, 400, "kv_cache_too_small"),
        ({"prompt": ["a", "b"]}, 400, "invalid_request"),
        ({"max_tokens": 3}, 400, "invalid_request"),
    ],
)
async def test_errors_are_openai_shaped(
    start_server: StartServer, http: aiohttp.ClientSession, body: Any, status: int, code: str
) -> None:
    server = await start_server(num_kvcache_blocks=8, block_size=16, max_model_len=256)
    got_status, got = await post(http, server.url + "/v1/completions", body)
    assert got_status == status
    assert got["error"]["code"] == code and got["error"]["message"] and got["error"]["type"]


async def test_bad_json_and_unknown_path(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    async with http.post(server.url + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with http.get(server.url + "/nope") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()


async def test_full_waiting_queue_answers_503(
    start_server: StartServer, http: aiohttp.ClientSession, wait_for: WaitFor
) -> None:
    server = await start_server(max_num_seqs=1, max_waiting_requests=1)
    sched = server.engine.scheduler
    long = {"prompt": "busy", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    first = asyncio.create_task(post(http, server.url + "/v1/completions", long))
    await wait_for(lambda: len(sched.running) == 1, 10, "first request running")
    second = asyncio.create_task(post(http, server.url + "/v1/completions", {**long, "max_tokens": 2}))
    await wait_for(lambda: len(sched.waiting) == 1, 10, "second request waiting")
    status, body = await post(http, server.url + "/v1/completions", long)
    assert status == 503 and body["error"]["code"] == "queue_full"
    assert (await first)[0] == 200 and (await second)[0] == 200


async def test_client_disconnect_frees_blocks(start_server: StartServer, wait_for: WaitFor) -> None:
    server = await start_server()
    engine = server.engine
    initial = engine.block_manager.num_free_blocks
    body = {"prompt": "stream forever", "max_tokens": 800, "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            await resp.content.readline()  # the first event arrived: the request is running
            assert engine.block_manager.num_free_blocks < initial
    # The session is closed mid-stream; the server notices and frees everything.
    await wait_for(lambda: engine.scheduler.is_idle(), 10, "stream aborted")
    assert engine.block_manager.num_free_blocks == initial
    assert engine.stats().generation_tokens < 800

    # Non-streaming too: the client gives up waiting, the handler is cancelled.
    # (A short deadline: on a GPU with CUDA graphs the tiny model writes 800 tokens in a quarter second.)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.05)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(server.url + "/v1/completions", json={**body, "stream": False}) as resp:
                await resp.read()
    await wait_for(lambda: engine.scheduler.is_idle(), 10, "request aborted")
    assert engine.block_manager.num_free_blocks == initial


async def test_info_endpoints_and_metrics(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server(served_model_name="tiny")
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    async with http.get(server.url + "/server_info") as resp:
        info = await resp.json()
    assert info["model_id"] == "tiny" and info["served_model_name"] == "tiny"
    assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["block_size"] == 16
    assert info["max_model_len"] == 1024 and info["num_kvcache_blocks"] == 256
    async with http.get(server.url + "/kv_transfer_info") as resp:
        assert await resp.json() == {
            "tp_size": 1,
            "dp_size": 1,
            "kv_role": None,
            "handshake_port": 6301,
            "sparse_attention": False,
        }
    async with http.get(server.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "tiny"
    prompt = "a shared prefix that is longer than one block of sixteen tokens, twice over"
    for _ in range(2):
        status, _ = await post(
            http, server.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        )
        assert status == 200
    async with http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    values = {
        line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    for name in (
        "atom:kv_cache_usage_ratio",
        "atom:requests_running",
        "atom:requests_waiting",
        "atom:prefix_cache_hit_ratio",
        "atom:generation_tokens_total",
        "atom:prompt_tokens_total",
        "atom:time_to_first_token_seconds_count",
        "atom:request_queue_time_seconds_count",
    ):
        assert name in values, name
    assert values["atom:prefix_cache_hit_ratio"] > 0
    assert values["atom:generation_tokens_total"] == 4
    assert values["atom:requests_finished_total"] == 2
    assert values["atom:request_queue_time_seconds_count"] == 2  # both prompts were admitted here


@pytest.mark.timeout(180)
async def test_smollm2_chat_over_http(start_server: StartServer, smollm2_model: LoadedModel) -> None:
    server = await start_server(smollm2_model, model="smollm2", num_kvcache_blocks=64, max_model_len=512)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        chat = await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    finally:
        await client.close()
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.usage is not None and chat.usage.prompt_tokens > 20


async def test_a_failed_step_fails_its_requests_only(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await start_server()
    runner = server.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(step: Any) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(step)

    monkeypatch.setattr(runner, "execute", flaky)
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0}
    status, err = await post(http, server.url + "/v1/completions", body)
    assert status == 500 and err["error"]["code"] == "engine_error" and "injected fault" in err["error"]["message"]
    status, ok = await post(http, server.url + "/v1/completions", body)
    assert status == 200 and ok["usage"]["completion_tokens"] == 4
    assert server.engine.block_manager.num_free_blocks == server.engine.num_blocks


async def test_sglang_routes_generate_health_generate_model_info_flush(
    start_server: StartServer, http: aiohttp.ClientSession
) -> None:
    """The routes a gateway lists besides OpenAI's: answered by the engine, not 404."""
    server = await start_server(served_model_name="tiny")
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    status, out = await post(http, server.url + "/generate", body)
    assert status == 200, out
    assert isinstance(out["text"], str) and out["meta_info"]["completion_tokens"] == 4
    assert out["meta_info"]["finish_reason"] == {"type": "length"} and out["meta_info"]["prompt_tokens"] == 5
    events = await sse(http, server.url + "/generate", body)
    assert events[-1] == "[DONE]" and events[-2]["text"] == out["text"]  # cumulative, as SGLang streams
    status, out = await post(http, server.url + "/generate", {**body, "sampling_params": {"max_new_tokens": -1}})
    assert status == 400 and "max_new_tokens" in out["error"]["message"]
    status, out = await post(http, server.url + "/generate", {"sampling_params": {}})
    assert status == 400 and "input_ids" in out["error"]["message"]
    async with http.get(server.url + "/health_generate") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    async with http.get(server.url + "/get_model_info") as resp:
        info = await resp.json()
        assert info["model_path"] == "tiny-random" and info["is_generation"] is True
    blocks = server.engine.block_manager
    prompt = "a shared prefix that is longer than one block of sixteen tokens, twice over"
    status, _ = await post(http, server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 200 and blocks.stats().cached > 0
    async with http.post(server.url + "/flush_cache") as resp:
        flushed = await resp.json()
        assert resp.status == 200 and flushed["flushed_blocks"] > 0
    assert blocks.stats().cached == 0


async def test_tokenize_detokenize_and_refused_pooling_routes(
    start_server: StartServer, http: aiohttp.ClientSession
) -> None:
    server = await start_server(served_model_name="tiny")
    status, body = await post(http, server.url + "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 1024
    assert body["token_strs"] is None
    ids = body["tokens"]
    status, body = await post(http, server.url + "/v1/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": "Hello world"}
    # The ids the engine computes for a prompt: a completion's usage counts the same.
    status, done = await post(http, server.url + "/v1/completions", {"prompt": "Hello world", "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(ids)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, body = await post(http, server.url + "/v1/tokenize", chat)
    status2, done = await post(http, server.url + "/v1/chat/completions", {**chat, "max_tokens": 1})
    assert status == status2 == 200 and body["count"] == done["usage"]["prompt_tokens"]
    for path, body_ in (
        ("/tokenize", {"model": "other", "prompt": "x"}),
        ("/tokenize", {"prompt": 3}),
        ("/detokenize", {"tokens": [10**9]}),
    ):
        status, err = await post(http, server.url + path, body_)
        assert status in (400, 404) and err["error"]["message"], (path, err)
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score", "/v1/classify"):
        status, err = await post(http, server.url + path, {"model": "tiny", "input": "x"})
        assert status == 400 and f"{path} is not served" in err["error"]["message"], err
        assert "causal language model" in err["error"]["message"]


async def test_priority_needs_the_priority_scheduling_policy(
    start_server: StartServer, http: aiohttp.ClientSession
) -> None:
    fcfs = await start_server()
    body = {"prompt": "Hello", "max_tokens": 2, "priority": 3}
    status, err = await post(http, fcfs.url + "/v1/completions", body)
    assert status == 400 and "--scheduling-policy priority" in err["error"]["message"]
    status, _ = await post(http, fcfs.url + "/v1/completions", {**body, "priority": 0})
    assert status == 200
    prio = await start_server(scheduling_policy="priority")
    status, _ = await post(http, prio.url + "/v1/completions", body)
    assert status == 200
