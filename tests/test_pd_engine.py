"""P/D end to end with real engines: the gateway's atom relay, a prefill and a decode engine, a real
Mooncake transfer on loopback; generations must equal a single colocated engine token for token.
Plus the faults of the relay, each checked for leaked KV blocks.

The pairs use the staged memory backend (forced); one dense pair uses the direct one. On a GPU:
ENGINE_TEST_DEVICE=cuda (and ENGINE_TEST_DTYPE, e.g. bfloat16, for the engines' --dtype); the
direct pair is skipped there unless the CUDA build of Mooncake is installed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gwtest import EngineProcess, MakeGateway, base_url, free_port, require

require("mooncake.engine", "P/D engines relay KV over Mooncake")

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
ENGINE = [
    sys.executable,
    "-m",
    "engine.openai_server",
    "--model",
    "tiny-random",
    "--device",
    DEVICE,
    "--host",
    "127.0.0.1",
    "--num-kvcache-blocks",
    "512",
    "--torch-threads",
    "1",
]
if os.environ.get("ENGINE_TEST_DTYPE"):
    ENGINE += ["--dtype", os.environ["ENGINE_TEST_DTYPE"]]
PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog " * 6,  # several KV blocks
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 8,
]


class Engine(EngineProcess):
    """One engine process on free loopback ports, a P/D role's KV transfer config when given one."""

    def __init__(
        self, name: str, role: str | None, *extra: str, backend: str = "staged", protocol: str | None = "tcp"
    ) -> None:
        args = [*ENGINE, *extra]
        if role is not None:
            cfg: dict[str, Any] = {
                "kv_role": role,
                "kv_connector": "mooncake",
                "handshake_port": free_port(),
                "memory_backend": backend,
                "staging_buffer_mb": 1,
            }  # 4 slots of 256 KiB
            if protocol is not None:  # tcp here: engines of one host would copy over ipc (tests/test_pd_ipc.py)
                cfg["protocol"] = protocol
            args += ["--kv-transfer-config", json.dumps(cfg)]
        super().__init__(name, args, env={**os.environ, "MC_TRANSFER_TIMEOUT": "5"})

    def blocks_used(self) -> float:
        return self.metric("atom:kv_cache_blocks_used")


def post(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_until(pred: Any, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _direct_runs_here() -> bool:
    """The direct backend on CUDA needs the CUDA build of Mooncake."""
    from engine.kv_transfer.backend import MooncakeWheel, installed_wheel

    return DEVICE != "cuda" or installed_wheel() is MooncakeWheel.CUDA


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """Dense and sparse prefill / decode / colocated engines (staged), and a direct dense pair, started together."""
    sparse = ("--sparse-attention", "on", "--sparse-topk-blocks", "2")
    specs = {
        "prefill": ("kv_producer",),
        "decode": ("kv_consumer",),
        "single": (None,),
        "sparse-prefill": ("kv_producer", *sparse),
        "sparse-decode": ("kv_consumer", *sparse),
        "sparse-single": (None, *sparse),
    }
    started = {name: Engine(name, spec[0], *spec[1:]) for name, spec in specs.items()}
    if _direct_runs_here():
        started |= {
            name: Engine(name, role, backend="direct")
            for name, role in (("direct-prefill", "kv_producer"), ("direct-decode", "kv_consumer"))
        }
    try:
        for e in started.values():
            e.wait_up()
        yield started
    finally:
        for e in started.values():
            e.stop()


def _greedy(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


async def same_as_colocated(s: aiohttp.ClientSession, single_url: str, url: str, prompts: list[str]) -> None:
    """Each prompt, greedy, streamed (with usage) and not, gives at ``url`` what the colocated engine gives."""
    for prompt in prompts:
        for stream in (False, True):
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            want = await _complete(s, single_url, _greedy(prompt, **extra))
            assert await _complete(s, url, _greedy(prompt, **extra)) == want, (prompt[:20], stream)


async def _complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, int]:
    """(text, completion tokens) of a completion, streamed or not."""
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            data = await r.json()
            return data["choices"][0]["text"], data["usage"]["completion_tokens"]
        text, tokens = [], 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text.append(event["choices"][0]["text"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return "".join(text), tokens


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["dense", "sparse", "direct"])
async def test_pd_generations_equal_a_colocated_engine(
    kind: str, engines: dict[str, Engine], gateway: MakeGateway
) -> None:
    if kind == "direct" and "direct-prefill" not in engines:
        pytest.skip("the direct memory backend on CUDA needs the CUDA build of Mooncake")
    pre = {"dense": "", "sparse": "sparse-", "direct": "direct-"}[kind]
    p, d = engines[pre + "prefill"], engines[pre + "decode"]
    single = engines["sparse-single" if kind == "sparse" else "single"]
    info = json.loads(urllib.request.urlopen(d.url + "/kv_transfer_info", timeout=5).read())
    assert info["memory_backend"] == ("direct" if kind == "direct" else "staged")
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=60
    )
    async with aiohttp.ClientSession() as s:
        for prompt in PROMPTS:
            for stream in (False, True):
                extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
                want = await _complete(s, single.url, _greedy(prompt, **extra))
                got = await _complete(s, base_url(gw), _greedy(prompt, **extra))
                assert got == want, (prompt[:20], stream)
                assert got[1] == 16
        # Chat goes through the same relay.
        chat = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        answers = []
        for url in (single.url, base_url(gw)):
            async with s.post(url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200
                answers.append((await r.json())["choices"][0]["message"]["content"])
        assert answers[0] == answers[1]
    assert d.metric("atom:kv_transfer_pulled_total") >= 7
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(180)
async def test_sixteen_concurrent_requests_complete(engines: dict[str, Engine], gateway: MakeGateway) -> None:
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=90
    )
    prompts = [f"request number {i} " + PROMPTS[i % 3] for i in range(16)]
    async with aiohttp.ClientSession() as s:
        want = [await _complete(s, single.url, _greedy(q, stream=i % 2 == 0)) for i, q in enumerate(prompts)]
        got = await asyncio.gather(
            *(_complete(s, base_url(gw), _greedy(q, stream=i % 2 == 0)) for i, q in enumerate(prompts))
        )
    assert list(got) == want
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(120)
async def test_sglang_routes_through_the_pd_gateway(engines: dict[str, Engine], gateway: MakeGateway) -> None:
    """/generate goes through the relay as the engine's native route; /health_generate and /get_model_info
    are answered (the routes the gateway lists, none of them a 404 in the demo)."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=60
    )
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        answers = []
        for url in (single.url, base_url(gw)):
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                answers.append((await r.json())["text"])
        assert answers[0] == answers[1]
        for path in ("/health_generate", "/get_model_info"):
            async with s.get(base_url(gw) + path) as r:
                assert r.status == 200, (path, await r.text())
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


# ---------------------------------------------------------------------------- faults
def _prefill(p: Engine, prompt: str = PROMPTS[1]) -> dict[str, Any]:
    status, body = post(
        p.url + "/v1/completions",
        _greedy(
            prompt,
            max_tokens=1,
            stream=False,
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        ),
    )
    assert status == 200, body
    return body["kv_transfer_params"]


def _decode(d: Engine, params: dict[str, Any], prompt: str = PROMPTS[1]) -> tuple[int, dict[str, Any]]:
    return post(d.url + "/v1/completions", _greedy(prompt, kv_transfer_params=params))


@pytest.mark.timeout(120)
def test_prefill_frees_blocks_when_decode_never_comes() -> None:
    p = Engine("short-timeout-prefill", "kv_producer", "--kv-transfer-timeout", "2").wait_up()
    try:
        _prefill(p)
        assert p.blocks_used() > 0  # pinned for decode
        wait_until(lambda: p.blocks_used() == 0, timeout=15, what="the expired transfer to free its blocks")
        assert p.metric("atom:kv_transfer_released_total", 'reason="expired"') == 1
    finally:
        p.stop()


@pytest.mark.timeout(60)
def test_unknown_and_consumed_transfer_ids_are_refused(engines: dict[str, Engine]) -> None:
    p, d = engines["prefill"], engines["decode"]
    params = _prefill(p)
    status, body = _decode(d, {**params, "transfer_id": "no-such-transfer"})
    assert status == 502 and "unknown" in body["error"]["message"].lower(), body
    status, _ = _decode(d, params)
    assert status == 200
    status, body = _decode(d, params)  # the same transfer a second time
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed", body
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(60)
def test_a_transfer_error_fails_cleanly(engines: dict[str, Engine]) -> None:
    p, d, mismatched = engines["prefill"], engines["decode"], engines["sparse-decode"]
    params = _prefill(p)
    # A decode engine whose cache layout differs (it has indexer-key regions): the producer refuses.
    status, body = _decode(mismatched, params)
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed", body
    assert "region" in body["error"]["message"], body
    # A block count that does not fit the prompt: refused before any transfer.
    status, body = _decode(d, {**params, "remote_block_ids": params["remote_block_ids"][:1]})
    assert status == 400 and "blocks" in body["error"]["message"], body
    status, body = _decode(d, {"do_remote_prefill": True, "remote_block_ids": [1]})
    assert status == 400 and body["error"]["code"] == "invalid_kv_transfer_params", body
    wait_until(lambda: d.blocks_used() == 0 and mismatched.blocks_used() == 0, what="decode pools to be idle")
    wait_until(lambda: p.blocks_used() == 0, timeout=15, what="prefill's block pool to be idle")


@pytest.mark.timeout(120)
def test_prefill_dying_after_answering_fails_decode_clearly(engines: dict[str, Engine]) -> None:
    d = engines["decode"]
    doomed = Engine("doomed-prefill", "kv_producer").wait_up()
    try:
        params = _prefill(doomed)
    finally:
        doomed.stop()  # SIGKILL after it answered
    started = time.monotonic()
    status, body = _decode(d, params)
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed", body
    assert time.monotonic() - started < 15
    wait_until(lambda: d.blocks_used() == 0, what="decode's block pool to be idle")


@pytest.mark.timeout(120)
async def test_several_pulls_in_flight_some_failing_leave_no_blocks(engines: dict[str, Engine]) -> None:
    """Eight decode requests at once: four pull from a live prefill engine, four from one killed after it
    answered. The four good ones equal the colocated engine, the others fail 502; every pool goes idle."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    doomed = Engine("doomed-prefill-2", "kv_producer").wait_up()
    prompts = [f"pull {i} " + PROMPTS[i % 3] for i in range(8)]
    try:
        params = [_prefill(doomed if i % 2 else p, q) for i, q in enumerate(prompts)]
    finally:
        doomed.stop()
    info = json.loads(urllib.request.urlopen(d.url + "/kv_transfer_info", timeout=10).read())
    assert info["max_inflight_pulls"] == 8 and info["pulls_in_flight"] == 0
    async with aiohttp.ClientSession() as s:
        want = [await _complete(s, single.url, _greedy(q)) for q in prompts[::2]]

        async def decode(i: int) -> tuple[int, Any]:
            body = _greedy(prompts[i], kv_transfer_params=params[i])
            async with s.post(d.url + "/v1/completions", json=body) as r:
                data = await r.json()
                return r.status, data

        answers = await asyncio.gather(*(decode(i) for i in range(8)))
    for i, (status, data) in enumerate(answers):
        if i % 2:
            assert status == 502 and data["error"]["code"] == "kv_transfer_failed", data
        else:
            assert status == 200, data
            assert (data["choices"][0]["text"], data["usage"]["completion_tokens"]) == want[i // 2]
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
    exported = urllib.request.urlopen(d.url + "/metrics", timeout=10).read().decode()
    assert "atom:kv_transfer_pulls_in_flight 0.0" in exported and "atom:kv_transfer_pulls_waiting 0.0" in exported


@pytest.mark.timeout(120)
def test_prefill_and_decode_on_two_gpus_equal_a_colocated_engine(engines: dict[str, Engine]) -> None:
    """CUDA with two GPUs or more: the prefill engine on cuda:0, the decode engine on cuda:1 (staged)."""
    import torch

    if DEVICE != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs ENGINE_TEST_DEVICE=cuda and two GPUs")
    p = Engine("gpu0-prefill", "kv_producer", "--device", "cuda:0")
    d = Engine("gpu1-decode", "kv_consumer", "--device", "cuda:1")
    try:
        p.wait_up()
        d.wait_up()
        for prompt in PROMPTS:
            status, want = post(engines["single"].url + "/v1/completions", _greedy(prompt))
            assert status == 200, want
            status, got = _decode(d, _prefill(p, prompt), prompt)
            assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"], got
        wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
    finally:
        p.stop()
        d.stop()


@pytest.mark.timeout(60)
def test_a_memory_backend_mismatch_fails_cleanly(engines: dict[str, Engine]) -> None:
    if "direct-prefill" not in engines:
        pytest.skip("the direct memory backend on CUDA needs the CUDA build of Mooncake")
    p, d = engines["prefill"], engines["direct-decode"]
    status, body = _decode(d, _prefill(p))
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed", body
    assert "memory_backend" in body["error"]["message"], body
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(60)
def test_engines_refuse_requests_for_the_other_role(engines: dict[str, Engine]) -> None:
    status, body = post(
        engines["decode"].url + "/v1/completions",
        _greedy("x", max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 400 and "kv_producer" in body["error"]["message"]
    status, body = post(
        engines["single"].url + "/v1/completions", _greedy("x", kv_transfer_params={"do_remote_prefill": True})
    )
    assert status == 400 and "kv_consumer" in body["error"]["message"]


async def _answer(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Any:
    """(text, logprobs, finish reasons) of an answer, streamed or not, in one comparable shape."""
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            data = await r.json()
            events = [data]
        else:
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
    text, logprobs, reasons = [], [], []
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            text.append(c.get("text") or (c.get("message") or c.get("delta") or {}).get("content") or "")
            lp = c.get("logprobs") or {}
            logprobs += lp.get("token_logprobs") or [(t["logprob"], [x["logprob"] for x in t["top_logprobs"]])
                                                     for t in lp.get("content") or []]  # fmt: skip
            reasons.append(c.get("finish_reason"))
    return "".join(text), logprobs, [r for r in reasons if r]


def _numbers(value: Any) -> list[float]:
    """Every number in a nest of lists and tuples, in order."""
    if isinstance(value, list | tuple):
        return [x for v in value for x in _numbers(v)]
    return [value]


@pytest.mark.timeout(180)
async def test_pd_seeded_sampling_and_logprobs_equal_a_colocated_engine(
    engines: dict[str, Engine], gateway: MakeGateway
) -> None:
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=60
    )
    regular = await gateway(worker_urls=[single.url], backend="atom")
    sampled = {"model": "tiny-random", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 11,
               "frequency_penalty": 0.5, "ignore_eos": True}  # fmt: skip
    cases = [
        ("/v1/completions", {**sampled, "prompt": PROMPTS[1], "logprobs": 2}),
        ("/v1/completions", {**sampled, "prompt": PROMPTS[0], "guided_regex": "[a-z]{3}-[0-9]{4}"}),
        (
            "/v1/chat/completions",
            {**sampled, "messages": [{"role": "user", "content": PROMPTS[2]}], "logprobs": True, "top_logprobs": 1},
        ),
    ]
    async with aiohttp.ClientSession() as s:
        for path, body in cases:
            for stream in (False, True):
                b = {**body, "stream": stream}
                want = await _answer(s, single.url, path, b)
                got = await _answer(s, base_url(gw), path, b)
                # Relayed unchanged in regular mode too. (Texts are equal; logprobs to the last bits, which
                # a prefix-cache hit may move.)
                relayed = await _answer(s, base_url(regular), path, b)
                for other in (got, relayed):
                    assert (other[0], other[2]) == (want[0], want[2]), (path, stream)
                    assert _numbers(other[1]) == pytest.approx(_numbers(want[1]), abs=1e-4), (path, stream)
                assert got[0] and (got[1] or "guided_regex" in body)
        # A request that cannot fit the context is refused before the prefill runs or pins anything.
        async with s.post(
            base_url(gw) + "/v1/completions", json={**sampled, "prompt": PROMPTS[1], "max_tokens": 100_000}
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        assert p.blocks_used() == 0
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(180)
async def test_a_decode_engine_killed_mid_stream_is_replaced_by_a_new_pair(
    engines: dict[str, Engine], gateway: MakeGateway
) -> None:
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    doomed = Engine("doomed-decode", "kv_consumer").wait_up()
    try:
        gw = await gateway(
            pd_disaggregation=True,
            backend="atom",
            prefill=[{"url": p.url}],
            decode=[doomed.url, d.url],
            request_timeout_secs=90,
            migration_limit=1,
        )
        body = _greedy(PROMPTS[0], max_tokens=400, stream=True, stream_options={"include_usage": True})
        pulled = d.metric("atom:kv_transfer_pulled_total")
        async with aiohttp.ClientSession() as s:
            want, _ = await _complete(s, single.url, body)
            pieces: list[str] = []
            usage: dict[str, Any] | None = None
            # Round robin gives the first pair the first decode worker: the one that dies.
            async with s.post(base_url(gw) + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    if event["choices"]:
                        pieces.append(event["choices"][0]["text"])
                        if len(pieces) == 4:
                            doomed.proc.kill()
                    usage = event.get("usage") or usage
        assert doomed.proc.poll() is not None
        # Greedy, the text before the kill is the colocated engine's; the rest came from a new pair (the
        # byte-level test model's text is not always valid UTF-8, so its continuation is checked for shape only).
        assert want.startswith("".join(pieces[:4]))
        assert usage is not None and usage["completion_tokens"] >= 400
        assert d.metric("atom:kv_transfer_pulled_total") >= pulled + 1  # the surviving decode took over
        wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
    finally:
        doomed.stop()


@pytest.mark.timeout(180)
async def test_n_best_of_and_echo_work_in_pd_as_colocated(engines: dict[str, Engine], gateway: MakeGateway) -> None:
    """One prefill; the decode engine forks the other samples from the transferred KV (each draws its own
    first token), so the choices equal a colocated engine's, as what a user sends works in both modes."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=60
    )
    sampled = {"model": "tiny-random", "max_tokens": 6, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    cases = [
        ("/v1/completions", {**sampled, "prompt": PROMPTS[1], "n": 3}),
        ("/v1/completions", {**sampled, "prompt": PROMPTS[2], "n": 2, "best_of": 4}),
        ("/v1/completions", {**sampled, "prompt": PROMPTS[0], "echo": True}),
        ("/v1/completions", {**sampled, "prompt": PROMPTS[0], "n": 2, "max_tokens": 1}),
        ("/v1/chat/completions", {**sampled, "messages": [{"role": "user", "content": PROMPTS[1]}], "n": 2}),
    ]
    pulled = d.metric("atom:kv_transfer_pulled_total")
    async with aiohttp.ClientSession() as s:
        for path, body in cases:
            answers = []
            for url in (single.url, base_url(gw)):
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200, (path, body, await r.text())
                    answers.append(
                        sorted(
                            json.dumps(c.get("text", c.get("message")), sort_keys=True)
                            for c in (await r.json())["choices"]
                        )
                    )
            assert answers[0] == answers[1] and len(answers[0]) == body.get("n", 1), (path, body)
        stream = {**cases[0][1], "stream": True}
        texts: dict[int, str] = {}
        async with s.post(base_url(gw) + "/v1/completions", json=stream) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert sorted(texts) == [0, 1, 2] and all(texts.values())
        # The prompt is scored on the prefill engine; the decode engine reports the scores as its own.
        scored = [
            ("/v1/completions", {**sampled, "prompt": PROMPTS[1], "echo": True, "logprobs": 2, "n": 2}),
            ("/v1/completions", {**sampled, "prompt": PROMPTS[2], "prompt_logprobs": 1}),
            (
                "/v1/chat/completions",
                {**sampled, "messages": [{"role": "user", "content": PROMPTS[0]}], "prompt_logprobs": 2},
            ),
        ]
        for path, body in scored:
            got = []
            for url in (single.url, base_url(gw)):
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200, (path, body, await r.text())
                    got.append(await r.json())
            want, pd = (_scores(g) for g in got)
            assert pd[0] == want[0] and pd[1] == pytest.approx(want[1], abs=1e-4), (path, body)
            assert len(want[1]) > 10
    assert d.metric("atom:kv_transfer_pulled_total") - pulled == len(cases) + 4  # one prefill per request
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


def _scores(answer: dict[str, Any]) -> tuple[list[str], list[float]]:
    """An answer's texts and, in order, every number of its logprobs and prompt_logprobs (ids, ranks, scores)."""
    texts: list[str] = []
    numbers: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                walk(value[k])
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            numbers.append(value)
        elif isinstance(value, str):
            texts.append(value)

    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        texts.append(json.dumps(c.get("text", c.get("message")), sort_keys=True))
        walk(c.get("logprobs"))
        walk(c.get("prompt_logprobs"))
    walk(answer.get("prompt_logprobs"))
    return texts, numbers


async def _respond(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses answer; streamed, the response its last event carries, with the events' types and the
    text of their deltas."""
    async with session.post(url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            return dict(await r.json())
        events: list[dict[str, Any]] = []
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    final["event_types"] = [e["type"] for e in events]
    final["deltas"] = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return dict(final)


@pytest.mark.timeout(180)
async def test_responses_api_works_in_pd_as_colocated(engines: dict[str, Engine], gateway: MakeGateway) -> None:
    """/v1/responses through the atom relay, whole and streamed: prefill computes the first token (one output
    token), decode pulls the KV and continues; the answer equals a colocated engine's."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(
        pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url], request_timeout_secs=60
    )
    body = {
        "model": "tiny-random",
        "instructions": "Answer briefly.",
        "temperature": 0,
        "max_output_tokens": 12,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": PROMPTS[1]}]}],
    }
    pulled = d.metric("atom:kv_transfer_pulled_total")
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            want, got = [await _respond(s, url, {**body, "stream": stream}) for url in (single.url, base_url(gw))]
            text = got["output"][0]["content"][0]["text"]
            assert text == want["output"][0]["content"][0]["text"] and text, (stream, got)
            assert got["object"] == "response" and got["id"].startswith("resp_") and got["store"] is False
            assert got["usage"]["output_tokens"] == want["usage"]["output_tokens"] > 1
            assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"]
            assert got["status"] == want["status"] and got["instructions"] == "Answer briefly."
            if stream:
                assert got["deltas"] == text
                assert got["event_types"][:4] == [
                    "response.created",
                    "response.in_progress",
                    "response.output_item.added",
                    "response.content_part.added",
                ]
                assert got["event_types"][-1] == f"response.{got['status']}"
        # What a stateless engine cannot do is refused by name, through the gateway as directly.
        async with s.post(base_url(gw) + "/v1/responses", json={**body, "previous_response_id": "resp_1"}) as r:
            assert r.status == 400 and "previous_response_id" in (await r.json())["error"]["message"]
    assert d.metric("atom:kv_transfer_pulled_total") - pulled == 2  # one pull per request
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
