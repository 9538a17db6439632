"""Streams that clients drop leave nothing for the garbage collector: every object of a dropped request is
freed by reference counting at once. (The gateway's tuned collector runs its full collections rarely, so a
cycle per dropped stream grew the process by tens of MB over tens of thousands of drops; issue #31.)

Run in a process of its own on uvloop, as `atomesh launch` serves: the count is of the whole process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import asyncio, gc, sys, time
import orjson, uvloop
sys.path.insert(0, %(tests)r)
from gwtest import gateway_config
from atomesh.app import GatewayServer
from atomesh.testing.mock_worker import MockBehaviour, MockWorker

DROPS = %(drops)d

async def main() -> None:
    worker = await MockWorker(behaviour=MockBehaviour(stream_chunks=50, chunk_interval_secs=0.01)).start()
    gw = GatewayServer(gateway_config(worker_urls=[worker.url], log_level="warn"))
    await gw.start()
    asked = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in %(path)r else {"prompt": "hi"}
    body = orjson.dumps({"model": "mock-model", "max_tokens": 50, "stream": True, **asked})
    request = (b"POST %(path)s HTTP/1.1\\r\\nHost: gw\\r\\nContent-Type: application/json\\r\\n"
               b"Content-Length: %%d\\r\\n\\r\\n%%b" %% (len(body), body))

    async def drop() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.config.port)
        writer.write(request)
        await reader.readuntil(b"data: ")  # the stream is under way
        writer.close()

    for _ in range(3):  # warm up: first-use caches are not garbage
        await drop()
    await asyncio.sleep(0.3)
    gc.collect()
    for start in range(0, DROPS, 25):
        await asyncio.gather(*(drop() for _ in range(25)))
    deadline = time.monotonic() + 10
    while worker.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    print("unreachable", gc.collect(), flush=True)
    await gw.close()
    await worker.stop()

uvloop.run(main())
"""


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_dropped_streams_leave_no_reference_cycles(path: str) -> None:
    drops = 200
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT % {"tests": str(TESTS), "drops": drops, "path": path}],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("unreachable ")]
    unreachable = int(line.split()[1])
    # Before the fix: about 28 objects per dropped stream (the request's frames, its task, both parsers).
    assert unreachable < drops // 10, f"{unreachable} objects in reference cycles after {drops} dropped streams"
