"""A client that leaves cancels its request on the worker, at any point: a real engine behind the gateway
must hold none of 20 requests (and none of their KV blocks) 1 s after their clients closed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator

import orjson
import pytest
from gwtest import EngineProcess, MakeGateway, base_url, free_port, require

pytestmark = pytest.mark.timeout(120)

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
CLIENTS = 20


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
    "2048",
    "--torch-threads",
    "1",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    proc = EngineProcess("disconnect", ENGINE)
    try:
        yield proc.wait_up()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[tuple[EngineProcess, EngineProcess]]:
    require("mooncake.engine", "P/D engines relay KV over Mooncake")
    # Prefill in small chunks (8 tokens a step), so that long prompts are still being prefilled when
    # their clients leave.
    pair = [
        EngineProcess(
            f"disconnect-{role}",
            [
                *ENGINE,
                *extra,
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_role": role,
                        "kv_connector": "mooncake",
                        "handshake_port": free_port(),
                        "memory_backend": "staged",
                        "staging_buffer_mb": 1,
                    }
                ),
            ],
        )
        for role, extra in (("kv_producer", ["--max-num-batched-tokens", "8"]), ("kv_consumer", []))
    ]
    try:
        for proc in pair:
            proc.wait_up()
        yield pair[0], pair[1]
    finally:
        for proc in pair:
            proc.stop()


def held(engine: EngineProcess) -> tuple[float, float, float]:
    """Requests running and waiting on the engine, and KV blocks in use."""
    return (
        engine.metric("atom:requests_running"),
        engine.metric("atom:requests_waiting"),
        engine.metric("atom:kv_cache_blocks_used"),
    )


async def wait_until(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def leave_mid_generation(url: str, engine: EngineProcess, stream: bool) -> None:
    """20 clients start long generations (running on ``engine``), then close their connections."""
    body = orjson.dumps(
        {
            "model": "tiny-random",
            "prompt": "the quick brown fox",
            "max_tokens": 900,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    host, port = url.removeprefix("http://").split(":")
    clients = []
    for _ in range(CLIENTS):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        clients.append((reader, writer))
    await wait_until(lambda: held(engine)[0] == CLIENTS, 30, "every request to run on the engine")
    if stream:  # each has its first bytes: it leaves in the middle of its stream
        for reader, _ in clients:
            assert (await asyncio.wait_for(reader.read(64), 10)).startswith(b"HTTP/1.1 200 ")
    for _, writer in clients:
        writer.close()
    await asyncio.sleep(1.0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_clients_that_leave_cancel_their_requests_on_the_engine(
    engine: EngineProcess, gateway: MakeGateway, stream: bool
) -> None:
    gw = await gateway(worker_urls=[engine.url], request_timeout_secs=120)
    await leave_mid_generation(base_url(gw), engine, stream)
    running, waiting, blocks = held(engine)
    assert (running, waiting) == (0, 0), f"{running:g} of {CLIENTS} still running 1 s after their clients left"
    assert blocks == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_clients_that_leave_cancel_the_decode_leg_of_pd(
    pd_pair: tuple[EngineProcess, EngineProcess], gateway: MakeGateway, stream: bool
) -> None:
    prefill, decode = pd_pair
    gw = await gateway(
        pd_disaggregation=True,
        backend="atom",
        prefill=[{"url": prefill.url}],
        decode=[decode.url],
        request_timeout_secs=120,
    )
    await leave_mid_generation(base_url(gw), decode, stream)
    running, waiting, blocks = held(decode)
    assert (running, waiting) == (0, 0), f"{running:g} of {CLIENTS} still decoding 1 s after their clients left"
    assert blocks == 0
    await wait_until(lambda: held(prefill) == (0, 0, 0), 5, "the prefill engine to hold nothing")


async def test_clients_that_leave_cancel_the_prefill_leg_of_pd(
    pd_pair: tuple[EngineProcess, EngineProcess], gateway: MakeGateway
) -> None:
    prefill, decode = pd_pair
    gw = await gateway(
        pd_disaggregation=True,
        backend="atom",
        prefill=[{"url": prefill.url}],
        decode=[decode.url],
        request_timeout_secs=120,
    )
    body = orjson.dumps({"model": "tiny-random", "prompt": "a" * 1500, "max_tokens": 4, "temperature": 0})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    host, port = base_url(gw).removeprefix("http://").split(":")
    writers = []
    for _ in range(CLIENTS):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        writers.append(writer)
    await wait_until(lambda: sum(held(prefill)[:2]) == CLIENTS, 30, "every prompt to be prefilling")
    for writer in writers:
        writer.close()
    await asyncio.sleep(1.0)
    running, waiting, _ = held(prefill)
    left = running + waiting
    assert left == 0, f"{left:g} of {CLIENTS} still prefilling 1 s after their clients left"
    assert held(decode)[:2] == (0, 0)
