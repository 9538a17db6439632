"""Fast failover and mid-stream migration: requests leave a worker declared dead at once, and streams
whose worker dies go on elsewhere (`--migration-limit`), as the client sees it through the openai client."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import openai
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

from atomesh.migration import StreamTracker, refusal
from atomesh.request import RequestView, Route
from atomesh.workers.breaker import BreakerState
from atomesh.workers.worker import WorkerState

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}
WORDS = "".join(f"tok{i} " for i in range(8))  # what a mock with stream_chunks=8 answers, uninterrupted


def client(gw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="none", max_retries=0, timeout=20)


async def _stream_text(c: openai.AsyncOpenAI, chat: bool, **extra: Any) -> tuple[str, list[Any]]:
    """The streamed text and every chunk, via the openai client."""
    chunks: list[Any] = []
    if chat:
        stream = await c.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hi"}], stream=True, **extra
        )
    else:
        stream = await c.completions.create(model="mock-model", prompt="hello", stream=True, **extra)
    async for chunk in stream:
        chunks.append(chunk)
    pieces = []
    for ch in chunks:
        if ch.choices:
            pieces.append((ch.choices[0].delta.content if chat else ch.choices[0].text) or "")
    return "".join(pieces), chunks


# ---------------------------------------------------------------------------- failover before the first byte
@pytest.mark.timeout(60)
async def test_frozen_worker_requests_go_elsewhere_once_it_is_declared_dead(
    worker_processes, gateway: MakeGateway
) -> None:
    frozen, alive = [await worker_processes(f"p{i}") for i in range(2)]
    gw = await gateway(
        worker_urls=[frozen.url, alive.url],
        request_timeout_secs=60,
        health_check_interval_secs=0.2,
        health_check_timeout_secs=0.3,
        health_failure_threshold=2,
    )
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

            async def one(stream: bool) -> tuple[int, str, float]:
                started = time.monotonic()
                async with s.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": stream}) as r:
                    await r.read()
                    return r.status, r.headers.get("x-mock-worker", ""), time.monotonic() - started

            results = await asyncio.wait_for(asyncio.gather(*(one(i % 2 == 0) for i in range(8))), 30)
        # Round robin put half of them on the frozen worker; none waited for the 60 s request timeout.
        assert [r[0] for r in results] == [200] * 8
        assert {r[1] for r in results} == {"p1"}
        assert max(r[2] for r in results) < 10
        worker = gw.gateway.registry.by_url(frozen.url)
        assert worker is not None and worker.state is WorkerState.UNHEALTHY
    finally:
        frozen.proc.send_signal(signal.SIGCONT)


async def test_breaker_opening_moves_the_requests_waiting_on_that_worker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    gw = await gateway(
        worker_urls=[a.url, b.url], cb_failure_threshold=2, disable_health_check=True, request_timeout_secs=60
    )
    url = base_url(gw) + "/v1/completions"
    a.behaviour.hang = True

    async def one(stream: bool = False) -> tuple[int, str]:
        async with http.post(url, json={**COMPLETION, "stream": stream}) as r:
            await r.read()
            return r.status, r.headers.get("x-mock-worker", "")

    waiting = [asyncio.ensure_future(one(stream=i == 0)) for i in range(4)]
    await wait_for(lambda: a.active == 2, what="two requests hanging on a")
    a.behaviour.hang = False
    a.behaviour.fail_status = 500  # the next requests a gets fail: two of them open its breaker
    others = await asyncio.gather(*(one() for _ in range(4)))
    assert others == [(200, "w1")] * 4
    worker = gw.gateway.registry.by_url(a.url)
    assert worker is not None and worker.breaker.state is BreakerState.OPEN
    # The two requests that hung on a were re-placed on b when its breaker opened (not at the request timeout).
    assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [(200, "w1")] * 4
    async with http.get(base_url(gw) + "/workers/" + quote(a.url, safe="")) as r:
        assert (await r.json())["circuit_breaker"]["state"] == "open"


async def test_worker_refusing_connections_is_out_at_once(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    gw = await gateway(worker_urls=[a.url, b.url], health_check_interval_secs=60)
    await a.stop()  # connections to it are refused from now on
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200 and r.headers["x-mock-worker"] == "w1"
    async with http.get(base_url(gw) + "/workers") as r:
        listed = {w["url"]: w for w in (await r.json())["workers"]}
    assert listed[a.url]["state"] == "unhealthy" and listed[a.url]["is_healthy"] is False
    # Only the first request paid a retry: the worker was out of rotation after the first refusal.
    async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as r:
        metrics = await r.text()
    retried = [line for line in metrics.splitlines() if line.startswith("mesh_worker_retries_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in retried) == 1


# ---------------------------------------------------------------------------- mid-stream migration
def test_refusal_rules() -> None:
    def view(route: Route, **body: Any) -> RequestView:
        return RequestView(route=route, body=body, raw=b"", request_id="r")

    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert refusal(view(Route.CHAT, **chat)) is None
    assert refusal(view(Route.COMPLETIONS, prompt=["one string"])) is None
    assert refusal(view(Route.CHAT, **chat, temperature=0, seed=3)) is None  # greedy: the seed changes nothing
    assert "n > 1" in (refusal(view(Route.CHAT, **chat, n=2)) or "")
    assert "seed" in (refusal(view(Route.CHAT, **chat, seed=3)) or "")
    assert "logprobs" in (refusal(view(Route.CHAT, **chat, logprobs=True)) or "")
    assert "tools" in (refusal(view(Route.CHAT, **chat, tools=[{"type": "function"}])) or "")
    assert "structured" in (refusal(view(Route.CHAT, **chat, response_format={"type": "json_object"})) or "")
    assert "token ids" in (refusal(view(Route.COMPLETIONS, prompt=[1, 2, 3])) or "")
    assert "/generate" in (refusal(view(Route.GENERATE, text="x")) or "")


def test_tracker_passes_only_whole_events_and_builds_the_continuation() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}
    t = StreamTracker(RequestView(route=Route.CHAT, body=body, raw=b"", request_id="r"))
    t.start_attempt()
    event = b'data: {"id":"a","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    assert t.feed(event[:20]) == b""  # half an event is held back
    assert t.feed(event[20:] + event[:5]) == event
    assert (t.text, t.tokens, t.ended) == ("Hel", 1, False)
    cont = t.continuation()
    assert cont.body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert cont.body["continue_final_message"] is True and cont.body["add_generation_prompt"] is False
    assert cont.body["max_tokens"] == 9 and body["max_tokens"] == 10  # the client's body is left as it was
    t.migrations = 1
    t.start_attempt()
    role = (
        b'data: {"id":"b","created":2,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    )
    assert t.feed(role) == b""  # the client had its role event from the first worker
    usage = (
        b'data: {"id":"b","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    )
    out = t.feed(usage)
    assert b'"id":"a"' in out and b'"created":1' in out
    assert b'"prompt_tokens":8' in out and b'"completion_tokens":3' in out and b'"total_tokens":11' in out


def test_continuations_of_a_client_prefill_and_of_a_completion() -> None:
    chat = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_completion_tokens": 5,
    }
    t = StreamTracker(RequestView(route=Route.CHAT, body=chat, raw=b"", request_id="r"))
    t.start_attempt()
    t.feed(b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"yes"}}]}\n\n')
    cont = t.continuation().body
    assert cont["messages"][-1]["content"] == "Sure: yes" and len(cont["messages"]) == 2  # appended, not added
    assert cont["max_completion_tokens"] == 4
    t = StreamTracker(
        RequestView(
            route=Route.COMPLETIONS,
            body={"prompt": ["Once"], "max_tokens": 2, "min_tokens": 2},
            raw=b"",
            request_id="r",
        )
    )
    t.start_attempt()
    t.feed(b'data: {"id":"a","choices":[{"index":0,"text":" upon"}]}\n\n')
    assert t.continuation().body == {"prompt": "Once upon", "max_tokens": 1, "min_tokens": 1}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_stream_migrates_with_text_and_usage_intact(
    chat: bool, mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    # Every worker dies after 3 tokens: the 8-token answer needs two migrations, whichever worker starts.
    workers = await mock_workers(2, stream_chunks=8, die_after_chunks=3)
    gw = await gateway(worker_urls=[w.url for w in workers], migration_limit=3)
    c = client(gw)
    try:
        text, chunks = await _stream_text(c, chat, max_tokens=8, stream_options={"include_usage": True})
    finally:
        await c.close()
    assert text == WORDS
    assert {ch.id for ch in chunks} == {chunks[0].id} and {ch.created for ch in chunks} == {chunks[0].created}
    if chat:
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.role) == 1
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == 3 and usage[0].completion_tokens == 8
    assert usage[0].total_tokens == 11
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    # The continuations asked for what was left.
    asked = [r["body"].get("max_tokens") for w in workers for r in w.received]
    assert sorted(asked) == [2, 5, 8]


async def test_usage_lost_with_the_worker_is_recovered(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    # Each worker dies right after the last token, before its usage event.
    workers = await mock_workers(2, stream_chunks=4, die_after_chunks=4)
    gw = await gateway(worker_urls=[w.url for w in workers], migration_limit=1)
    c = client(gw)
    try:
        text, chunks = await _stream_text(c, True, max_tokens=4, stream_options={"include_usage": True})
    finally:
        await c.close()
    assert text == "tok0 tok1 tok2 tok3 "
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and (usage[0].prompt_tokens, usage[0].completion_tokens) == (3, 4)
    assert {ch.id for ch in chunks} == {chunks[0].id}
    # The second worker was asked for one token: only its prompt count was used.
    assert sorted(r["body"]["max_tokens"] for w in workers for r in w.received) == [1, 4]


@pytest.mark.parametrize("limit", [0, 1])
async def test_migration_limit_is_honoured(limit: int, mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    workers = await mock_workers(2, stream_chunks=8, die_after_chunks=3)
    gw = await gateway(worker_urls=[w.url for w in workers], migration_limit=limit)
    c = client(gw)
    try:
        with pytest.raises(openai.APIError) as err:
            await _stream_text(c, True, max_tokens=8)
    finally:
        await c.close()
    if limit:
        assert "--migration-limit 1 reached" in str(err.value)
    else:
        assert "stream broke" in str(err.value)
    assert sum(len(w.received) for w in workers) == limit + 1


async def test_request_that_cannot_migrate_gets_a_clear_error(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    workers = await mock_workers(2, stream_chunks=8, die_after_chunks=3)
    gw = await gateway(worker_urls=[w.url for w in workers], migration_limit=3)
    c = client(gw)
    try:
        with pytest.raises(openai.APIError) as err:
            await _stream_text(c, True, max_tokens=8, seed=7, temperature=0.8)
    finally:
        await c.close()
    assert "not migrated" in str(err.value) and "seed" in str(err.value)


async def test_stream_on_a_frozen_worker_migrates_when_it_is_declared_dead(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2, stream_chunks=8, chunk_interval_secs=0.05)
    gw = await gateway(
        worker_urls=[a.url, b.url],
        migration_limit=1,
        request_timeout_secs=60,
        health_check_interval_secs=0.2,
        health_check_timeout_secs=0.3,
        health_failure_threshold=2,
    )
    async with http.post(
        base_url(gw) + "/v1/chat/completions",
        json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
    ) as r:
        first = r.headers["x-mock-worker"]
        stuck = a if first == "w0" else b
        got = b""
        while got.count(b"tok") < 2:
            got += await r.content.readany()
        # The worker stops mid-answer and fails its health checks, as a frozen process would.
        stuck.behaviour.chunk_interval_secs = 3600
        stuck.behaviour.health_status = 503
        got += await asyncio.wait_for(r.content.read(), 15)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in _events(got) if e.get("choices"))
    assert text == WORDS
    worker = gw.gateway.registry.by_url(stuck.url)
    assert worker is not None and worker.state is WorkerState.UNHEALTHY


def _events(raw: bytes) -> list[dict[str, Any]]:
    import orjson

    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {"):
            out.append(orjson.loads(block[6:]))
    return out


@pytest.mark.parametrize("backend", ["atom", "sglang", "vllm"])
async def test_pd_stream_migrates_with_a_new_pair(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [p] = await mock_workers(1, pd_backend=backend, pd_role="prefill", kv_role="kv_producer")
    ds = await mock_workers(
        2, pd_backend=backend, pd_role="decode", kv_role="kv_consumer", stream_chunks=8, die_after_chunks=3
    )
    gw = await gateway(
        pd_disaggregation=True,
        backend=backend,
        prefill=[{"url": p.url, "bootstrap_port": 8998}],
        decode=[d.url for d in ds],
        migration_limit=3,
    )
    c = client(gw)
    try:
        text, _ = await _stream_text(c, True, max_tokens=8)
    finally:
        await c.close()
    assert text == WORDS
    # Each continuation was prefilled again (the mocks refuse any leg their protocol does not allow).
    assert len(p.received) == 3
    assert p.received[-1]["body"]["continue_final_message"] is True


async def test_continuation_stuck_on_a_worker_declared_dead_is_retried(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    first, spare, stuck = await mock_workers(3, stream_chunks=8)
    first.behaviour.die_after_chunks = 3
    stuck.behaviour.hang = True  # round robin sends it the continuation, which then waits
    gw = await gateway(
        worker_urls=[first.url, spare.url, stuck.url],
        migration_limit=1,
        request_timeout_secs=60,
        health_check_interval_secs=0.2,
        health_check_timeout_secs=0.3,
        health_failure_threshold=2,
    )
    c = client(gw)
    try:
        reading = asyncio.ensure_future(_stream_text(c, True, max_tokens=8))
        await wait_for(lambda: stuck.active == 1, what="the continuation to reach the stuck worker")
        stuck.behaviour.health_status = 503
        text, _ = await asyncio.wait_for(reading, 15)
    finally:
        await c.close()
    # The continuation had sent nothing: it was placed again (a retry), not refused for the migration limit.
    assert text == WORDS
    assert [len(w.received) for w in (first, spare, stuck)] == [1, 1, 1]
