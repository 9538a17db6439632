"""A real Prometheus server scrapes a real gateway; the counters read back through its query API match the traffic."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, free_port

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}


class Prometheus:
    """A Prometheus server on a free loopback port, scraping the given targets every second."""

    def __init__(self, binary: str, workdir: Path, targets: list[str]) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        (workdir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: atomesh\n    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, http: aiohttp.ClientSession, timeout: float = 30) -> None:
        with self.log.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                async with http.get(self.url + "/-/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start: {self.log.read_text()[-2000:]}")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    async def query(self, http: aiohttp.ClientSession, promql: str) -> list[dict[str, Any]]:
        async with http.get(self.url + "/api/v1/query", params={"query": promql}) as r:
            body = await r.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def wait_value(self, http: aiohttp.ClientSession, promql: str, expected: float, timeout: float = 20) -> None:
        """Poll an instant query until its single value equals `expected`."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            result = await self.query(http, promql)
            last = [r["value"][1] for r in result]
            if len(result) == 1 and float(result[0]["value"][1]) == expected:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql}: expected {expected}, Prometheus has {last}")
            await asyncio.sleep(0.25)


@pytest.fixture
async def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the `prometheus` server is not installed: run `make sysdeps` (Debian package prometheus)")
    return binary


@pytest.fixture
async def prometheus(prometheus_binary: str, tmp_path: Path) -> AsyncIterator[list[Prometheus]]:
    started: list[Prometheus] = []
    yield started
    for p in started:
        await p.stop()


async def test_prometheus_reads_the_gateway_counters(
    mock_workers: MakeWorkers,
    gateway: MakeGateway,
    http: aiohttp.ClientSession,
    prometheus: list[Prometheus],
    prometheus_binary: str,
    tmp_path: Path,
) -> None:
    workers = await mock_workers(2, stream_chunks=4)
    gw = await gateway(worker_urls=[w.url for w in workers])
    prom = Prometheus(prometheus_binary, tmp_path, [f"127.0.0.1:{gw.config.prometheus_port}"])
    prometheus.append(prom)
    await prom.start(http)

    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
    for _ in range(2):
        async with http.post(base_url(gw) + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            await r.read()

    await prom.wait_value(http, 'sum(mesh_router_requests_total{endpoint="completions",streaming="false"})', 4)
    await prom.wait_value(http, 'sum(mesh_router_requests_total{endpoint="chat",streaming="true"})', 2)
    await prom.wait_value(http, 'sum(mesh_router_ttft_seconds_count{endpoint="chat",model="mock-model"})', 2)
    await prom.wait_value(http, 'sum(mesh_router_tokens_total{token_type="output"})', 4 * 3 + 2 * 4)
    for w in workers:
        await prom.wait_value(http, f'sum(mesh_worker_selection_total{{worker="{w.url}"}})', 3)
        await prom.wait_value(http, f'mesh_worker_health{{worker="{w.url}"}}', 1)
    await prom.wait_value(http, 'sum(mesh_http_responses_total{path="/v1/completions",status_code="200"})', 4)
    await prom.wait_value(http, 'up{job="atomesh"}', 1)
