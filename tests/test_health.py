"""Health probes per worker: a frozen worker changes no other worker's detection time; a worker that
never becomes healthy says why while pending and fails after the start-up timeout."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest
import structlog
from gwtest import MakeGateway, base_url, free_port, wait_for

from atomesh.workers.health import HealthChecker
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerState


@pytest.mark.timeout(60)
async def test_frozen_worker_does_not_delay_detecting_another(worker_processes, gateway: MakeGateway) -> None:
    frozen, killed, fine = [await worker_processes(f"p{i}") for i in range(3)]
    gw = await gateway(
        worker_urls=[frozen.url, killed.url, fine.url],
        health_check_interval_secs=0.2,
        health_check_timeout_secs=3,
        health_failure_threshold=2,
        disable_retries=True,
    )
    reg = gw.gateway.registry
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(0.5)  # the frozen worker's probes are now waiting out their 3 s timeout
        killed.kill()
        t0 = time.monotonic()
        await wait_for(
            lambda: reg.by_url(killed.url).state is WorkerState.UNHEALTHY,
            10,  # type: ignore[union-attr]
            "the killed worker to turn unhealthy",
        )
        detected = time.monotonic() - t0
        # Two failed probes 0.2 s apart (a refused connection fails at once); a round that waited for the
        # slowest probe would take at least the frozen worker's 3 s timeout.
        assert detected < 1.5, detected
        assert reg.by_url(fine.url).state is WorkerState.READY  # type: ignore[union-attr]
        await wait_for(
            lambda: reg.by_url(frozen.url).state is WorkerState.UNHEALTHY,
            15,  # type: ignore[union-attr]
            "the frozen worker to turn unhealthy",
        )
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    await wait_for(
        lambda: reg.by_url(frozen.url).state is WorkerState.READY,
        15,  # type: ignore[union-attr]
        "the thawed worker to recover",
    )


@pytest.mark.timeout(60)
async def test_pending_worker_shows_why_and_fails_after_startup_timeout(
    gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw = await gateway(worker_startup_timeout_secs=1.5, worker_startup_check_interval=0.1)
    url = base_url(gw)
    # One URL that refuses connections, one that accepts and never answers (a probe must time out).
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    silent_url = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    ids = []
    for target in (f"http://127.0.0.1:{free_port()}", silent_url):
        async with http.post(url + "/workers", json={"url": target}) as r:
            ids.append((await r.json())["worker_id"])

    async def info(wid: str) -> dict:  # type: ignore[type-arg]
        async with http.get(url + "/workers/" + wid) as r:
            return await r.json()  # type: ignore[no-any-return]

    first = await info(ids[0])
    deadline = time.monotonic() + 1
    while first["error"] is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        first = await info(ids[0])
    assert first["state"] == "pending" and "cannot connect" in first["error"], first
    t0 = time.monotonic()
    for wid in ids:
        while (state := await info(wid))["state"] == "pending":
            assert time.monotonic() - t0 < 5, state
            await asyncio.sleep(0.05)
        assert state["state"] == "failed" and "did not become healthy within 1.5s" in state["error"], state
    silent.close()


@pytest.mark.timeout(30)
async def test_a_probe_that_raises_does_not_end_health_checking() -> None:
    registry = WorkerRegistry()
    worker = Worker(url="http://127.0.0.1:1")
    registry.add(worker)
    registry.set_state(worker, WorkerState.READY)
    calls = []

    async def probe(w: Worker) -> tuple[bool, str]:
        calls.append(w)
        if len(calls) == 1:
            raise RuntimeError("a bug in one round")
        return False, "down"

    checker = HealthChecker(registry, probe, interval=0.01, failure_threshold=2, success_threshold=1)
    with structlog.testing.capture_logs() as logs:
        checker.start()
        await wait_for(lambda: worker.state is WorkerState.UNHEALTHY, what="the worker marked unhealthy")
        await checker.stop()
    assert any(e["event"] == "periodic_round_failed" and e["task"] == f"health {worker.url}" for e in logs)
