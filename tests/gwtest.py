"""Shared test helpers and fixtures: real gateways and mock workers on free loopback ports (imported by conftest)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self

import aiohttp
import pytest

from atomesh.app import GatewayServer
from atomesh.config import GatewayConfig
from atomesh.testing.mock_worker import MockBehaviour, MockWorker
from bench.gateway import procs

free_port = procs.free_port  # below the kernel's ephemeral range: see bench/gateway/procs.py


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


MakeWorkers = Callable[..., Awaitable[list[MockWorker]]]
MakeGateway = Callable[..., Awaitable[GatewayServer]]


@pytest.fixture
async def mock_workers() -> AsyncIterator[MakeWorkers]:
    """Factory: `await mock_workers(n, **behaviour)` starts n mock workers named w0, w1, ..."""
    created: list[MockWorker] = []

    async def make(n: int = 1, **behaviour: Any) -> list[MockWorker]:
        out = []
        for _ in range(n):
            w = MockWorker(name=f"w{len(created)}", behaviour=MockBehaviour(**behaviour))
            await w.start()
            created.append(w)
            out.append(w)
        return out

    yield make
    for w in created:
        await w.stop()


def require(module: str, why: str) -> None:
    """A tool `make install` puts in: a test that needs it fails when it is missing, it never skips (a skip
    would hide a broken promise)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is missing ({exc}): {why}; `make install` puts it in", pytrace=False)


def gateway_config(**settings: Any) -> GatewayConfig:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "prometheus_host": "127.0.0.1",
        "prometheus_port": free_port(),
        "worker_startup_check_interval": 0.1,
        "worker_startup_timeout_secs": 10,
        "policy": "round_robin",
        "retry_initial_backoff_ms": 5,
        "retry_max_backoff_ms": 50,
        "shutdown_grace_period_secs": 5,
    }
    base.update(settings)
    return GatewayConfig.model_validate(base)


@pytest.fixture
async def gateway() -> AsyncIterator[MakeGateway]:
    """Factory: `await gateway(worker_urls=[...], **settings)` starts an in-process gateway."""
    servers: list[GatewayServer] = []

    async def make(**settings: Any) -> GatewayServer:
        server = GatewayServer(gateway_config(**settings))
        servers.append(server)
        await server.start()
        return server

    yield make
    for s in servers:
        await s.close()


def base_url(server: GatewayServer) -> str:
    return f"http://127.0.0.1:{server.config.port}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


class WorkerProcess:
    """A mock worker in its own process, for tests that kill or freeze it."""

    def __init__(self, name: str, *args: str) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atomesh.testing.mock_worker", "--port", str(self.port), "--name", name, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def wait_up(self, timeout: float = 20) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"mock worker on {self.url} did not start")
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
async def worker_processes() -> AsyncIterator[Callable[..., Awaitable[WorkerProcess]]]:
    started: list[WorkerProcess] = []

    async def make(name: str, *args: str) -> WorkerProcess:
        wp = WorkerProcess(name, *args)
        started.append(wp)
        return await wp.wait_up()

    yield make
    for wp in started:
        wp.kill()


class EngineProcess:
    """An engine server (`python -m engine.openai_server ...`) in a process of its own, logging to /tmp."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/atomesh-test-{name}-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [*args, "--server-port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, env=env
        )

    def wait_up(self, timeout: float = 90) -> Self:
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
        """The sum of a metric's samples whose labels contain `labels`, from the engine's /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
            if labels in (m.group(1) or ""):
                total += float(m.group(2))
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
