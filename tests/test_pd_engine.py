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
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, base_url, free_port

pytest.importorskip("mooncake.engine", reason="P/D engines relay KV over Mooncake (make install puts it in)")

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
ENGINE = [sys.executable, "-m", "engine.openai_server", "--model", "tiny-random", "--device", DEVICE,
          "--host", "127.0.0.1", "--num-kvcache-blocks", "512", "--torch-threads", "1"]
if os.environ.get("ENGINE_TEST_DTYPE"):
    ENGINE += ["--dtype", os.environ["ENGINE_TEST_DTYPE"]]
PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog " * 6,  # several KV blocks
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 8,
]


class Engine:
    """One engine process on free loopback ports."""

    def __init__(self, name: str, role: str | None, *extra: str, backend: str = "staged") -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [*ENGINE, "--server-port", str(self.port), *extra]
        if role is not None:
            cfg = {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(),
                   "memory_backend": backend, "staging_buffer_mb": 1}  # the smallest: 4 slots of 256 KiB
            args += ["--kv-transfer-config", json.dumps(cfg)]
        self.log = open(f"/tmp/atomesh-test-{name}-{self.port}.log", "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "MC_TRANSFER_TIMEOUT": "5"})

    def wait_up(self, timeout: float = 90) -> Engine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine {self.name} exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"engine {self.name} did not start; see {self.log.name}")

    def metric(self, name: str, labels: str = "") -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
            if labels in (m.group(1) or ""):
                total += float(m.group(2))
        return total

    def blocks_used(self) -> float:
        return self.metric("atom:kv_cache_blocks_used")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


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
        started |= {name: Engine(name, role, backend="direct")
                    for name, role in (("direct-prefill", "kv_producer"), ("direct-decode", "kv_consumer"))}
    try:
        for e in started.values():
            e.wait_up()
        yield started
    finally:
        for e in started.values():
            e.stop()


def _greedy(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


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
async def test_pd_generations_equal_a_colocated_engine(kind: str, engines: dict[str, Engine],
                                                       gateway: MakeGateway) -> None:
    if kind == "direct" and "direct-prefill" not in engines:
        pytest.skip("the direct memory backend on CUDA needs the CUDA build of Mooncake")
    pre = {"dense": "", "sparse": "sparse-", "direct": "direct-"}[kind]
    p, d = engines[pre + "prefill"], engines[pre + "decode"]
    single = engines["sparse-single" if kind == "sparse" else "single"]
    info = json.loads(urllib.request.urlopen(d.url + "/kv_transfer_info", timeout=5).read())
    assert info["memory_backend"] == ("direct" if kind == "direct" else "staged")
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                       request_timeout_secs=60)
    async with aiohttp.ClientSession() as s:
        for prompt in PROMPTS:
            for stream in (False, True):
                extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
                want = await _complete(s, single.url, _greedy(prompt, **extra))
                got = await _complete(s, base_url(gw), _greedy(prompt, **extra))
                assert got == want, (prompt[:20], stream)
                assert got[1] == 16
        # Chat goes through the same relay.
        chat = {"model": "tiny-random", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
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
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                       request_timeout_secs=90)
    prompts = [f"request number {i} " + PROMPTS[i % 3] for i in range(16)]
    async with aiohttp.ClientSession() as s:
        want = [await _complete(s, single.url, _greedy(q, stream=i % 2 == 0)) for i, q in enumerate(prompts)]
        got = await asyncio.gather(*(_complete(s, base_url(gw), _greedy(q, stream=i % 2 == 0))
                                     for i, q in enumerate(prompts)))
    assert list(got) == want
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(120)
async def test_sglang_routes_through_the_pd_gateway(engines: dict[str, Engine], gateway: MakeGateway) -> None:
    """/generate goes through the relay as the engine's native route; /health_generate and /get_model_info
    are answered (the routes the gateway lists, none of them a 404 in the demo)."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                       request_timeout_secs=60)
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
    status, body = post(p.url + "/v1/completions", _greedy(prompt, max_tokens=1, stream=False,
                                                           kv_transfer_params={"do_remote_decode": True,
                                                                               "do_remote_prefill": False}))
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
    status, body = post(engines["decode"].url + "/v1/completions",
                        _greedy("x", max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 400 and "kv_producer" in body["error"]["message"]
    status, body = post(engines["single"].url + "/v1/completions",
                        _greedy("x", kv_transfer_params={"do_remote_prefill": True}))
    assert status == 400 and "kv_consumer" in body["error"]["message"]
