"""Mid-stream migration with real engines: an engine process killed in the middle of a greedy stream, the
gateway continues it on another engine, and the client reads the same text the uninterrupted stream gives."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from conftest import DEVICE, StartServer
from gwtest import MakeGateway, base_url, free_port

from engine.models.loader import LoadedModel

MESSAGES = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 16


@pytest.fixture
def doomed_engine() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A SmolLM2 engine process that the test kills."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.openai_server",
            "--model",
            "smollm2",
            "--device",
            DEVICE,
            "--host",
            "127.0.0.1",
            "--server-port",
            str(port),
            "--num-kvcache-blocks",
            "64",
            "--max-model-len",
            "512",
            "--torch-threads",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the SmolLM2 engine process did not start")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(300)
async def test_killed_engine_stream_continues_on_another_engine_unchanged(
    doomed_engine: tuple[str, subprocess.Popen[bytes]],
    start_server: StartServer,
    smollm2_model: LoadedModel,
    gateway: MakeGateway,
) -> None:
    doomed_url, doomed = doomed_engine
    survivor = await start_server(smollm2_model, model="smollm2", num_kvcache_blocks=64, max_model_len=512)
    greedy = {"model": "smollm2", "temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS}
    async with aiohttp.ClientSession() as http:
        async with http.post(survivor.url + "/v1/chat/completions", json={**greedy, "messages": MESSAGES}) as r:
            reference = await r.json()
    expected = reference["choices"][0]["message"]["content"]

    # Round robin sends the first request to the first worker: the engine that dies.
    gw = await gateway(worker_urls=[doomed_url, survivor.url], migration_limit=1, request_timeout_secs=120)
    client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="none", max_retries=0, timeout=120)
    pieces: list[str] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            # The name the engines serve the embedded model under (`--model smollm2` asks for it).
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,
            stream=True,
            temperature=0,
            max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == 4:
                    doomed.kill()  # mid-answer, the way a crash comes
                    await asyncio.get_running_loop().run_in_executor(None, doomed.wait)
            if chunk.usage is not None:
                usage = chunk.usage
    finally:
        await client.close()
    assert doomed.poll() is not None, "the engine should have died mid-stream"
    assert "".join(pieces) == expected
    assert usage is not None
    assert usage.prompt_tokens == reference["usage"]["prompt_tokens"]
    assert usage.completion_tokens == reference["usage"]["completion_tokens"] == MAX_TOKENS
    # The survivor was chosen once through the gateway: for the continuation.
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as r:
            metrics = await r.text()
    chosen = [
        line
        for line in metrics.splitlines()
        if line.startswith("mesh_worker_selection_total{") and f'worker="{survivor.url}"' in line
    ]
    assert chosen and float(chosen[0].rsplit(" ", 1)[1]) == 1
