"""What an operator reads: a worker that cannot be reached says why in the log (once per change, not per probe),
a port that cannot be bound is named, and a broken stream leaves a log line and a count of what became of it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import openai
import pytest
import structlog
from gwtest import MakeGateway, MakeWorkers, base_url, free_port, wait_for

pytestmark = pytest.mark.timeout(60)


async def metric(http: aiohttp.ClientSession, gw: Any, sample: str) -> float:
    async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def test_a_wrong_worker_url_is_logged_with_its_cause_once(gateway: MakeGateway) -> None:
    # Not a worker: something that accepts connections and closes them at once, counting the probes.
    probes = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal probes
        probes += 1
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with structlog.testing.capture_logs() as logs:
            gw = await gateway(worker_urls=[], worker_startup_timeout_secs=30)
            async with aiohttp.ClientSession() as http:
                async with http.post(base_url(gw) + "/workers", json={"url": url}) as resp:
                    assert resp.status in (200, 201, 202)
            await wait_for(lambda: probes >= 5, 10, "several probes of the wrong URL")
    finally:
        server.close()
    lines = [e for e in logs if e["event"] == "worker_not_healthy_yet"]
    assert len(lines) == 1, lines  # once per change of reason, not once per probe
    assert lines[0]["worker"] == url and lines[0]["log_level"] == "warning" and lines[0]["reason"], lines[0]


def test_a_taken_port_is_named_by_the_gateway() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "atomesh",
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-port",
                str(free_port()),
            ],
            capture_output=True,
            text=True,
            timeout=45,
        )
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


async def test_migrations_are_logged_and_counted(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    # Every worker dies after 3 tokens: the 8-token answer takes two migrations.
    workers = await mock_workers(2, stream_chunks=8, die_after_chunks=3)
    gw = await gateway(worker_urls=[w.url for w in workers], migration_limit=3)
    c = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="none", max_retries=0, timeout=20)
    try:
        with structlog.testing.capture_logs() as logs:
            stream = await c.completions.create(model="mock-model", prompt="hello", stream=True, max_tokens=8)
            async for _ in stream:
                pass
            # A request that cannot be continued (seeded sampling) is counted as refused.
            with pytest.raises(openai.APIError):
                stream = await c.completions.create(
                    model="mock-model", prompt="hello", stream=True, max_tokens=8, seed=7, temperature=0.8
                )
                async for _ in stream:
                    pass
    finally:
        await c.close()
    moved = [e for e in logs if e["event"] == "stream_migrated"]
    assert [e["tokens_so_far"] for e in moved] == [3, 6]
    urls = {w.url for w in workers}
    assert all(e["from_worker"] in urls and e["to_worker"] in urls and e["request_id"] for e in moved)
    assert {e["request_id"] for e in moved} == {moved[0]["request_id"]}
    refused = [e for e in logs if e["event"] == "stream_not_migrated"]
    assert len(refused) == 1 and refused[0]["outcome"] == "refused" and "seed" in refused[0]["reason"]
    async with aiohttp.ClientSession() as http:
        assert await metric(http, gw, 'mesh_migrations_total{outcome="migrated"}') == 2
        assert await metric(http, gw, 'mesh_migrations_total{outcome="refused"}') == 1
