"""The engine loop is supervised: a fault in any phase of a step fails that step's requests only; a fatal one
(a CUDA error) kills the engine: its requests get 503 engine_dead, /health answers 503, and with
--exit-on-engine-error the server ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from engine.llm_engine import LLMEngine
from engine.openai_server import EngineExit, serve

StartServer = Callable[..., Awaitable[Any]]
WaitFor = Callable[..., Awaitable[None]]

pytestmark = pytest.mark.timeout(60)

BODY = {"prompt": "x", "max_tokens": 4, "temperature": 0}


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


def fail_once(obj: Any, name: str, monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    """Make ``obj.name`` raise ``exc`` on its first call, then behave as before."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)


def target(engine: LLMEngine, phase: str) -> tuple[Any, str]:
    """Where each phase of a step can be made to fail."""
    return {
        "schedule": (engine.scheduler, "schedule"),
        "prepare": (engine.runner, "prepare"),
        "execute": (engine.runner, "execute"),
        "postprocess": (engine, "postprocess"),
        "event_flush": (engine, "flush_kv_events"),
    }[phase]


@pytest.mark.parametrize("phase", ["schedule", "prepare", "execute", "postprocess", "event_flush"])
async def test_a_fault_in_any_phase_fails_that_step_only(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    server = await start_server()
    engine: LLMEngine = server.engine
    obj, name = target(engine, phase)
    fail_once(obj, name, monkeypatch, RuntimeError(f"injected {phase} fault"))
    status, err = await asyncio.wait_for(post(http, server.url + "/v1/completions", BODY), 20)
    assert status == 500, err
    assert err["error"]["code"] == "engine_error" and f"injected {phase} fault" in err["error"]["message"]
    assert f"({phase})" in err["error"]["message"]
    # The loop goes on: the next requests are served, and the failed one left no block behind.
    for _ in range(2):
        status, ok = await asyncio.wait_for(post(http, server.url + "/v1/completions", BODY), 20)
        assert status == 200 and ok["usage"]["completion_tokens"] == 4
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.scheduler.is_idle()


async def test_a_fault_in_one_step_spares_the_other_streams(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, wait_for: WaitFor
) -> None:
    """A prepare fault while another request is mid-generation: both are in the step, both fail; later ones run."""
    server = await start_server()
    engine: LLMEngine = server.engine
    long = asyncio.ensure_future(
        post(http, server.url + "/v1/completions", {**BODY, "max_tokens": 200, "ignore_eos": True})
    )
    await wait_for(lambda: engine.stats().running == 1, 10, "the long request to run")
    fail_once(engine.runner, "prepare", monkeypatch, RuntimeError("injected prepare fault"))
    status, err = await asyncio.wait_for(long, 20)
    assert status == 500 and "(prepare)" in err["error"]["message"]
    status, _ = await asyncio.wait_for(post(http, server.url + "/v1/completions", BODY), 20)
    assert status == 200
    assert engine.block_manager.num_free_blocks == engine.num_blocks


async def test_a_schedule_fault_that_recurs_fails_requests_instead_of_spinning(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await start_server()
    engine: LLMEngine = server.engine

    def broken() -> None:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    answers = await asyncio.wait_for(
        asyncio.gather(*(post(http, server.url + "/v1/completions", BODY) for _ in range(3))), 20
    )
    assert [s for s, _ in answers] == [500, 500, 500]
    assert engine.scheduler.is_idle() and engine.block_manager.num_free_blocks == engine.num_blocks


async def test_a_cuda_error_kills_the_engine(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await start_server()
    engine: LLMEngine = server.engine
    fail_once(
        engine.runner, "execute", monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered")
    )
    waiting = [asyncio.ensure_future(post(http, server.url + "/v1/completions", BODY)) for _ in range(3)]
    answers = await asyncio.wait_for(asyncio.gather(*waiting), 20)
    for status, err in answers:  # every request the engine held gets an error, none hangs
        assert status == 503 and err["error"]["code"] == "engine_dead", err
    assert "illegal memory access" in answers[0][1]["error"]["message"]
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503 and (await resp.json())["status"] == "dead"
    status, err = await post(http, server.url + "/v1/completions", BODY)  # refused at once, not queued
    assert status == 503 and err["error"]["code"] == "engine_dead"


async def test_exit_on_engine_error_ends_the_server(
    make_engine: Callable[..., LLMEngine],
    free_port: Callable[[], int],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    engine = make_engine(server_port=port, host="127.0.0.1", exit_on_engine_error=True)
    fail_once(engine.runner, "execute", monkeypatch, RuntimeError("CUDA error: device-side assert triggered"))
    server = asyncio.ensure_future(serve(engine.args, engine))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # the server binds once its app is set up
            try:
                status, err = await post(http, url + "/v1/completions", BODY)
                break
            except aiohttp.ClientConnectionError:
                assert asyncio.get_running_loop().time() < deadline, "the server never listened"
                await asyncio.sleep(0.05)
        assert status == 503 and err["error"]["code"] == "engine_dead"
        with pytest.raises(EngineExit, match="device-side assert"):
            await asyncio.wait_for(server, 20)
    finally:
        server.cancel()


async def test_a_dead_kv_agent_kills_the_engine(
    start_server: StartServer, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV agent writes to itself every few seconds; a healthy one keeps the engine serving, one that can no
    longer move data (twice in a row) leaves a P/D engine nothing to serve with: the engine is marked dead."""
    from engine import disagg
    from engine.args import KVTransferConfig
    from engine.kv_transfer.errors import TransferEngineError
    from engine.kv_transfer.mooncake import MooncakeAgent

    monkeypatch.setattr(disagg, "AGENT_PROBE_SECS", 0.05)
    probes = {"ok": 0}
    real_probe = MooncakeAgent.probe

    def counted(agent: MooncakeAgent) -> None:
        real_probe(agent)  # a real write through the agent's own listener and transport
        probes["ok"] += 1

    monkeypatch.setattr(MooncakeAgent, "probe", counted)
    config = KVTransferConfig(kv_role="kv_consumer", kv_connector="mooncake", handshake_port=0,
                              memory_backend="staged", staging_buffer_mb=1)  # fmt: skip
    server = await start_server(kv_transfer=config)
    deadline = asyncio.get_running_loop().time() + 20
    while probes["ok"] < 3:
        assert asyncio.get_running_loop().time() < deadline, "the agent was never probed"
        await asyncio.sleep(0.05)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200

    def dead(agent: MooncakeAgent) -> None:
        raise TransferEngineError(f"write of 1 entries (32 bytes) to {agent.rpc_address}", -1)

    monkeypatch.setattr(MooncakeAgent, "probe", dead)
    while True:
        async with http.get(server.url + "/health") as resp:
            if resp.status == 503:
                assert (await resp.json())["status"] == "dead"
                break
        assert asyncio.get_running_loop().time() < deadline + 20, "the engine never noticed its dead agent"
        await asyncio.sleep(0.05)
    status, err = await post(http, server.url + "/v1/completions", BODY)
    assert status == 503 and err["error"]["code"] == "engine_dead"
    assert "kv_agent" in err["error"]["message"]
