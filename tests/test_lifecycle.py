"""Worker lifecycle: runtime registration, health, breaker, retries, admission, drain, shutdown."""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from urllib.parse import quote

import aiohttp
import openai
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

from atomesh.config import BackendKind
from atomesh.placement import Placement
from atomesh.policies.round_robin import RoundRobinPolicy
from atomesh.request import RequestView, Route
from atomesh.transport import Upstream, backoff_delays
from atomesh.workers.breaker import BreakerSettings, BreakerState, CircuitBreaker
from atomesh.workers.lifecycle import Lifecycle
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import IllegalTransition, Worker, WorkerRole, WorkerState, check_transition

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}


# ---------------------------------------------------------------------------- units
def test_state_machine_refuses_illegal_transitions() -> None:
    check_transition(WorkerState.PENDING, WorkerState.READY)
    check_transition(WorkerState.READY, WorkerState.UNHEALTHY)
    check_transition(WorkerState.UNHEALTHY, WorkerState.READY)
    check_transition(WorkerState.READY, WorkerState.DRAINING)
    check_transition(WorkerState.DRAINING, WorkerState.REMOVED)
    for old, new in [
        (WorkerState.REMOVED, WorkerState.READY),
        (WorkerState.DRAINING, WorkerState.READY),
        (WorkerState.PENDING, WorkerState.UNHEALTHY),
        (WorkerState.FAILED, WorkerState.READY),
    ]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)


def test_breaker_opens_half_opens_and_closes() -> None:
    now = [0.0]
    seen = []
    b = CircuitBreaker(
        BreakerSettings(failure_threshold=3, success_threshold=2, timeout_secs=10, window_secs=100),
        on_transition=lambda o, n: seen.append(n),
        clock=lambda: now[0],
    )
    b.record(False)
    b.record(False)
    b.record(True)  # a success resets the consecutive count
    b.record(False)
    b.record(False)
    assert b.state is BreakerState.CLOSED and b.admit()
    b.record(False)
    assert b.state is BreakerState.OPEN and b.is_open and not b.admit()
    now[0] = 10.5
    # The query changes nothing; admit() is what moves an expired open breaker to half-open.
    assert not b.is_open and b.state is BreakerState.OPEN
    assert b.admit() and b.state is BreakerState.HALF_OPEN
    b.record(False)  # any failure while half-open reopens
    assert b.state is BreakerState.OPEN
    now[0] = 21
    assert b.admit()
    b.record(True)
    b.record(True)
    assert b.state is BreakerState.CLOSED
    assert seen == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    delays = backoff_delays(100, 1000, 2.0, 0.2, random.Random(1))
    got = [next(delays) for _ in range(8)]
    assert 0.08 <= got[0] <= 0.12
    assert 0.16 <= got[1] <= 0.24
    assert all(d <= 1.0 for d in got)
    assert got[-1] >= 0.8


VIEW = RequestView(Route.COMPLETIONS, {"prompt": "hi"}, b"", "r")


async def test_a_drain_ends_when_its_last_request_does_not_on_a_timer() -> None:
    """The drain job wakes on the release of the worker's last request (and on other processes'
    reports), so the worker is removed within a few event-loop turns, with no polling interval."""
    registry = WorkerRegistry()
    lifecycle = Lifecycle(
        registry,
        Upstream(5.0),
        backend=BackendKind.SGLANG,
        breaker=BreakerSettings(),
        startup_timeout=1,
        check_interval=1,
        probe_timeout=1,
        health_endpoint="/health",
    )
    placement = Placement(registry, {WorkerRole.REGULAR: RoundRobinPolicy()}, pd=False)
    worker = Worker(url="http://127.0.0.1:1")
    registry.add(worker)
    registry.set_state(worker, WorkerState.READY)
    first, second = placement.place(VIEW), placement.place(VIEW)
    worker.remote_in_flight = 1  # another gateway process has one too
    job = lifecycle.remove(worker, grace=None)
    assert job is not None and worker.state is WorkerState.DRAINING
    second_job = lifecycle.remove(worker, grace=None)  # a second DELETE waits on the same drain
    for plan in (first, second):
        placement.release(plan)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not job.done()
    worker.remote_in_flight = 0
    assert worker.on_release is not None
    worker.on_release(worker)  # what atomesh.cluster.leader does when the last report comes in
    for _ in range(5):
        await asyncio.sleep(0)
    assert job.done() and second_job is not None and second_job.done()
    assert worker.state is WorkerState.REMOVED and worker.on_release is None
    await lifecycle.stop()


# ---------------------------------------------------------------------------- admin API
async def test_runtime_registration_and_admin_errors(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    gw = await gateway(worker_urls=[a.url], api_key="sekret", worker_startup_timeout_secs=1)
    url = base_url(gw)
    auth = {"Authorization": "Bearer sekret"}
    async with http.post(url + "/workers", json={"url": b.url}) as r:
        assert r.status == 401
    async with http.post(url + "/workers", json={"url": b.url, "worker_type": "regular"}, headers=auth) as r:
        assert r.status == 202
        wid = (await r.json())["worker_id"]

    async def state(key: str) -> dict:
        async with http.get(url + "/workers/" + key, headers=auth) as r:
            assert r.status == 200
            return await r.json()

    for _ in range(200):
        if (await state(wid))["is_healthy"]:
            break
        await asyncio.sleep(0.02)
    assert (await state(quote(b.url, safe="")))["id"] == wid
    seen = Counter()
    for _ in range(4):
        async with http.post(url + "/v1/completions", json=COMPLETION, headers=auth) as r:
            seen[r.headers["x-mock-worker"]] += 1
    assert seen == {"w0": 2, "w1": 2}

    bad = [
        ({"url": "ftp://x"}, 400),
        ({"url": "not a url"}, 400),
        ({"url": b.url}, 409),
        ({"url": "http://127.0.0.1:9", "worker_type": "prefill"}, 400),
        ({}, 400),
    ]
    for body, status in bad:
        async with http.post(url + "/workers", json=body, headers=auth) as r:
            assert r.status == status, body
            assert "message" in (await r.json())["error"]
    async with http.get(url + "/workers/nope", headers=auth) as r:
        assert r.status == 404
    async with http.put(url + "/workers/" + wid, json={"labels": {"zone": "a"}}, headers=auth) as r:
        assert (await r.json())["labels"] == {"zone": "a"}
    async with http.get(url + "/workers", headers=auth) as r:
        listed = await r.json()
    assert len(listed["workers"]) == 2

    # An unreachable worker ends as a failed registration, visible in GET, and gets no traffic.
    async with http.post(url + "/workers", json={"url": "http://127.0.0.1:9"}, headers=auth) as r:
        dead = (await r.json())["worker_id"]
    for _ in range(200):
        if (await state(dead))["state"] == "failed":
            break
        await asyncio.sleep(0.05)
    info = await state(dead)
    assert info["state"] == "failed" and "did not become healthy" in info["error"]


async def test_delete_drains_in_flight_streams(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2, stream_chunks=10, chunk_interval_secs=0.05)
    gw = await gateway(worker_urls=[a.url, b.url])
    url = base_url(gw)
    # Start a stream on a, remove a while it runs.
    resp = await http.post(url + "/v1/completions", json={**COMPLETION, "max_tokens": 10, "stream": True})
    assert resp.headers["x-mock-worker"] == "w0"
    await resp.content.readline()
    async with http.delete(url + "/workers/" + quote(a.url, safe="")) as r:
        assert r.status == 202
    worker_a = gw.gateway.registry.by_url(a.url)
    assert worker_a is not None and worker_a.state is WorkerState.DRAINING
    for _ in range(4):  # new requests avoid the draining worker
        async with http.post(url + "/v1/completions", json=COMPLETION) as r:
            assert r.headers["x-mock-worker"] == "w1"
    rest = await resp.content.read()
    assert rest.rstrip().endswith(b"data: [DONE]")  # the in-flight stream finished whole
    await wait_for(lambda: gw.gateway.registry.by_url(a.url) is None, what="the drained worker to be removed")


# ---------------------------------------------------------------------------- health and breaker
async def test_health_thresholds_take_a_worker_out_and_back(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    gw = await gateway(
        worker_urls=[a.url, b.url],
        health_check_interval_secs=0.05,
        health_failure_threshold=3,
        health_success_threshold=2,
    )
    worker_a = gw.gateway.registry.by_url(a.url)
    assert worker_a is not None
    a.behaviour.health_status = 503
    await wait_for(lambda: worker_a.state is WorkerState.UNHEALTHY, what="a to turn unhealthy")
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.headers["x-mock-worker"] == "w1"
    a.behaviour.health_status = 200
    await wait_for(lambda: worker_a.state is WorkerState.READY, what="a to recover")


async def test_disable_health_check_keeps_workers(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [a] = await mock_workers(1)
    gw = await gateway(
        worker_urls=[a.url], health_check_interval_secs=0.05, health_failure_threshold=1, disable_health_check=True
    )
    a.behaviour.health_status = 503
    await asyncio.sleep(0.3)
    assert gw.gateway.registry.by_url(a.url).state is WorkerState.READY  # type: ignore[union-attr]


async def test_breaker_opens_and_is_visible(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    a.behaviour.fail_status = 500
    gw = await gateway(
        worker_urls=[a.url, b.url], disable_retries=True, cb_failure_threshold=2, cb_timeout_duration_secs=60
    )
    url = base_url(gw)
    statuses = []
    for _ in range(6):
        async with http.post(url + "/v1/completions", json=COMPLETION) as r:
            statuses.append((r.status, r.headers.get("x-mock-worker")))
    assert [s for s, _ in statuses].count(500) == 2  # after two failures a is skipped
    assert statuses[-2:] == [(200, "w1"), (200, "w1")]
    async with http.get(url + "/workers") as r:
        states = {w["url"]: w["circuit_breaker"]["state"] for w in (await r.json())["workers"]}
    assert states == {a.url: "open", b.url: "closed"}


# ---------------------------------------------------------------------------- retries
async def test_retry_goes_to_another_worker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2)
    a.behaviour.fail_status = 503
    gw = await gateway(worker_urls=[a.url, b.url], retry_max_retries=3)
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
            assert r.headers["x-mock-worker"] == "w1"


async def test_retries_are_bounded(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [a] = await mock_workers(1, fail_status=502)
    gw = await gateway(worker_urls=[a.url], retry_max_retries=2, cb_failure_threshold=100)
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 502
    assert len(a.received) == 3  # the first attempt and two retries


async def test_no_retry_after_the_first_byte(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(2, stream_chunks=5, die_after_chunks=2)
    b.behaviour.die_after_chunks = None
    gw = await gateway(worker_urls=[a.url, b.url], retry_max_retries=3)
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 5}) as r:
        assert r.status == 200 and r.headers["x-mock-worker"] == "w0"
        body = await r.read()
    assert b'"error"' in body and body.rstrip().endswith(b"data: [DONE]")
    assert len(b.received) == 0
    assert all(w.in_flight == 0 for w in gw.gateway.registry)


# ---------------------------------------------------------------------------- admission
async def test_admission_queue_full_429_and_timeout_503(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [a] = await mock_workers(1, stream_chunks=6, chunk_interval_secs=0.1)
    gw = await gateway(worker_urls=[a.url], max_concurrent_requests=1, queue_size=1, queue_timeout_secs=0.2)
    url = base_url(gw)
    first = await http.post(url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 6})
    await first.content.readline()  # the permit is held while the stream runs
    queued = asyncio.ensure_future(http.post(url + "/v1/completions", json=COMPLETION))
    await wait_for(lambda: gw.gateway.admission.waiting == 1, what="a queued request")
    async with http.post(url + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 429
        assert (await r.json())["error"]["code"] == "queue_full"
    r2 = await queued
    assert r2.status == 503 and (await r2.json())["error"]["code"] == "queue_timeout"
    await first.read()
    async with http.post(url + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 200  # the permit came back after the last byte


async def test_rate_limit_tokens_per_second(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [a] = await mock_workers(1)
    gw = await gateway(worker_urls=[a.url], rate_limit_tokens_per_second=1, queue_size=0)
    statuses = []
    for _ in range(3):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            statuses.append(r.status)
    assert statuses[0] == 200 and 429 in statuses


# ---------------------------------------------------------------------------- shutdown
async def test_graceful_shutdown_finishes_in_flight(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [a] = await mock_workers(1, stream_chunks=8, chunk_interval_secs=0.05)
    gw = await gateway(worker_urls=[a.url])
    url = base_url(gw)
    stream = await http.post(url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 8})
    await stream.content.readline()
    shutting = asyncio.ensure_future(gw.shutdown())
    await wait_for(lambda: gw.gateway.shutting_down, what="shutdown to start")
    async with http.post(url + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 503
    body = await stream.content.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    await asyncio.wait_for(shutting, 10)


async def test_a_stream_cut_at_the_end_of_the_grace_period_gets_an_error_event(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [a] = await mock_workers(1, stream_chunks=200, chunk_interval_secs=0.05)
    gw = await gateway(worker_urls=[a.url], shutdown_grace_period_secs=0.3)
    c = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="none", max_retries=0, timeout=20)
    try:
        stream = await c.completions.create(model="mock-model", prompt="hello", stream=True, max_tokens=200)
        got = [await stream.__anext__()]  # under way
        shutting = asyncio.ensure_future(gw.shutdown())
        with pytest.raises(openai.APIError, match="shutting down"):
            async for chunk in stream:
                got.append(chunk)
        await asyncio.wait_for(shutting, 10)
    finally:
        await c.close()
    assert 1 <= len(got) < 200


# ---------------------------------------------------------------------------- real processes
async def _load(url: str, n: int, concurrency: int, stream: bool = False) -> list[int]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one() -> int:
            async with sem:
                async with s.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}) as r:
                    await r.read()
                    return r.status

        return list(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.timeout(90)
async def test_worker_killed_under_load_fails_no_request(worker_processes, gateway: MakeGateway) -> None:
    procs = [await worker_processes(f"p{i}", "--latency-secs", "0.02") for i in range(3)]
    gw = await gateway(worker_urls=[p.url for p in procs], retry_max_retries=5, health_check_interval_secs=0.2)
    load = asyncio.ensure_future(_load(base_url(gw), 300, 16))
    await wait_for(lambda: sum(w.in_flight for w in gw.gateway.registry) > 0, what="load to start")
    await asyncio.sleep(0.2)
    procs[0].kill()
    statuses = await asyncio.wait_for(load, 60)
    assert statuses == [200] * 300
    assert all(w.in_flight == 0 for w in gw.gateway.registry)


@pytest.mark.timeout(90)
async def test_frozen_worker_is_detected_by_timeouts(worker_processes, gateway: MakeGateway) -> None:
    procs = [await worker_processes(f"p{i}") for i in range(2)]
    gw = await gateway(
        worker_urls=[p.url for p in procs],
        request_timeout_secs=1.0,
        health_check_interval_secs=0.2,
        health_check_timeout_secs=0.3,
        health_failure_threshold=2,
    )
    procs[0].proc.send_signal(signal.SIGSTOP)
    try:
        statuses = await asyncio.wait_for(_load(base_url(gw), 20, 4), 60)
        assert statuses == [200] * 20
        frozen = gw.gateway.registry.by_url(procs[0].url)
        await wait_for(lambda: frozen.state is WorkerState.UNHEALTHY, what="the frozen worker to turn unhealthy")
    finally:
        procs[0].proc.send_signal(signal.SIGCONT)


@pytest.mark.timeout(90)
async def test_add_and_remove_under_load_loses_nothing(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b, c = await mock_workers(3, latency_secs=0.01, stream_chunks=4, chunk_interval_secs=0.01)
    gw = await gateway(worker_urls=[a.url, b.url])
    url = base_url(gw)
    load = asyncio.ensure_future(_load(url, 300, 16, stream=True))
    await asyncio.sleep(0.3)
    async with http.post(url + "/workers", json={"url": c.url}) as r:
        assert r.status == 202
    async with http.delete(url + "/workers/" + quote(a.url, safe="")) as r:
        assert r.status == 202
    statuses = await asyncio.wait_for(load, 60)
    assert statuses == [200] * 300
    assert c.served > 0
    await wait_for(lambda: gw.gateway.registry.by_url(a.url) is None, what="a to be removed")
