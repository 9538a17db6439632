"""`--processes N`: several gateway processes on one port, one worker registry, whole metrics.

The gateway runs as a real `atomesh launch --processes 2` (a leader and a follower); the workers are
in-process mock workers, so the test can see which process sent each request (the request id's
per-process prefix) and hold requests in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gwtest import MakeWorkers, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}
Launch = Callable[..., Any]


class Gateway:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, mport: int, log: Path, scheme: str) -> None:
        self.proc, self.port, self.mport, self.log = proc, port, mport, log
        self.url = f"{scheme}://127.0.0.1:{port}"

    def children(self) -> list[int]:
        """The follower processes (not multiprocessing's resource tracker)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        pids = [int(p) for p in path.read_text().split()] if path.exists() else []
        return [p for p in pids if b"resource_tracker" not in _cmdline(p)]

    async def metrics(self, http: aiohttp.ClientSession) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with http.get(f"http://127.0.0.1:{self.mport}/metrics") as r:
            text = await r.text()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@pytest.fixture
async def launch(tmp_path: Path) -> AsyncIterator[Launch]:
    started: list[Gateway] = []

    async def start(*args: str, scheme: str = "http", ssl: Any = None) -> Gateway:
        port, mport = free_port(), free_port()
        log = tmp_path / f"gateway-{len(started)}.log"
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
                "round_robin",
                *args,
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        gw = Gateway(proc, port, mport, log, scheme)
        started.append(gw)
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                assert proc.poll() is None, log.read_text()
                try:
                    async with http.get(gw.url + "/readiness", ssl=ssl) as r:
                        if r.status == 200 and "processes_started" in log.read_text():
                            return gw
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("gateway never became ready:\n" + log.read_text())

    yield start
    for gw in started:
        if gw.proc.poll() is None:
            gw.proc.kill()
            gw.proc.wait()


def fresh() -> aiohttp.ClientSession:
    """A client that opens a new connection per request, so the kernel spreads them over the processes."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=30)
    )


async def completions(url: str, n: int) -> list[str]:
    """Send n completions, 8 at a time; return the request ids (their first 16 characters name the process)."""
    ids: list[str] = []
    async with fresh() as http:

        async def one() -> None:
            async with http.post(url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["text"] == "tok0 tok1 tok2"
                ids.append(r.headers["x-request-id"])

        for start in range(0, n, 8):
            await asyncio.gather(*(one() for _ in range(min(8, n - start))))
    return ids


def processes(ids: list[str]) -> set[str]:
    return {i[:16] for i in ids}


async def test_processes_share_the_port_and_the_metrics_stay_whole(mock_workers: MakeWorkers, launch: Launch) -> None:
    workers = await mock_workers(2)
    gw = await launch("--worker-urls", *(w.url for w in workers))
    assert len(gw.children()) == 1  # the follower
    ids = await completions(gw.url, 80)
    assert len(processes(ids)) == 2, "both processes served requests"
    assert sum(len(w.received) for w in workers) == 80
    async with aiohttp.ClientSession() as http:
        m = await gw.metrics(http)
    # Request-path series add up over the processes; registry series are the leader's alone.
    assert total(m, "mesh_router_requests_total", endpoint="completions") == 80
    assert total(m, "mesh_http_responses_total", path="/v1/completions", status_code="200") == 80
    assert total(m, "mesh_router_request_duration_seconds_count") == 80
    assert total(m, "mesh_worker_selection_total") == 80
    assert total(m, "mesh_worker_pool_size", worker_type="regular", state="ready") == 2
    assert total(m, "mesh_worker_health") == 2


async def test_admin_changes_reach_every_process(mock_workers: MakeWorkers, launch: Launch) -> None:
    first, added = await mock_workers(2)
    gw = await launch("--worker-urls", first.url)
    async with fresh() as http:
        # Admin calls land on either process; the follower passes them to the leader.
        for _ in range(4):
            async with http.get(gw.url + "/workers") as r:
                assert r.status == 200 and len((await r.json())["workers"]) == 1
        async with http.post(gw.url + "/workers", json={"url": added.url}) as r:
            assert r.status == 202, await r.text()

        async def ready() -> bool:
            async with http.get(gw.url + "/workers") as r:
                return sum(w["state"] == "ready" for w in (await r.json())["workers"]) == 2

        for _ in range(100):
            if await ready():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # the leader's change reaches the follower
        await completions(gw.url, 60)
        assert len(processes([r["headers"]["x-request-id"] for r in added.received])) == 2
        async with http.delete(gw.url + "/workers/" + added.url.replace(":", "%3A").replace("/", "%2F")) as r:
            assert r.status in (200, 202), await r.text()
        await asyncio.sleep(0.5)
        before = len(added.received)
        await completions(gw.url, 40)
        assert len(added.received) == before, "no process routes to a removed worker"


async def test_a_worker_is_removed_only_when_no_process_has_a_request_on_it(
    mock_workers: MakeWorkers, launch: Launch
) -> None:
    [slow] = await mock_workers(1, stream_chunks=20, chunk_interval_secs=0.1)
    [spare] = await mock_workers(1)
    gw = await launch("--worker-urls", slow.url, spare.url, "--policy", "round_robin")
    body = {**COMPLETION, "max_tokens": 20, "stream": True}
    results: list[bytes] = []
    async with fresh() as http:

        async def stream() -> None:
            async with http.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                results.append(await r.read())

        streams = [asyncio.ensure_future(stream()) for _ in range(16)]
        # Both processes' streams on the slow worker (the kernel spreads the 16 connections; on a loaded machine
        # one process's may reach the worker later than the other's first few did).
        await wait_for(
            lambda: slow.active >= 4 and len(processes([r["headers"]["x-request-id"] for r in slow.received])) == 2,
            what="streams of both processes on the slow worker",
        )
        async with http.delete(gw.url + "/workers/" + slow.url.replace(":", "%3A").replace("/", "%2F")) as r:
            assert r.status in (200, 202)

        async def states() -> dict[str, str]:
            async with http.get(gw.url + "/workers") as r:
                return {w["url"]: w["state"] for w in (await r.json())["workers"]}

        await asyncio.sleep(0.5)
        assert slow.active > 0 and (await states())[slow.url] == "draining"
        await asyncio.gather(*streams)
        assert len(results) == 16 and all(b.rstrip().endswith(b"data: [DONE]") for b in results)
        assert slow.active == 0
        for _ in range(50):
            if slow.url not in await states():
                break
            await asyncio.sleep(0.1)
        assert await states() == {spare.url: "ready"}


async def test_a_dead_follower_is_restarted_and_sigterm_stops_every_process(
    mock_workers: MakeWorkers, launch: Launch
) -> None:
    workers = await mock_workers(1)
    gw = await launch("--worker-urls", workers[0].url)
    [follower] = gw.children()
    os.kill(follower, signal.SIGKILL)
    await wait_for(lambda: len(gw.children()) == 1 and gw.children()[0] != follower, timeout=20, what="a new follower")
    # The new follower says it is ready once it listens with the worker list in.
    await wait_for(lambda: gw.log.read_text().count("process_ready") == 2, timeout=20, what="restarted follower ready")
    ids = await completions(gw.url, 40)
    assert len(processes(ids)) == 2
    [new] = gw.children()
    gw.proc.send_signal(signal.SIGTERM)
    assert await asyncio.get_running_loop().run_in_executor(None, gw.proc.wait, 30) == 0
    assert not Path(f"/proc/{new}").exists() or "zombie" in Path(f"/proc/{new}/status").read_text().lower()
    assert "shutdown_complete" in gw.log.read_text()


async def test_cache_aware_learns_from_every_process(mock_workers: MakeWorkers, launch: Launch) -> None:
    workers = await mock_workers(4)
    gw = await launch("--worker-urls", *(w.url for w in workers), "--policy", "cache_aware")
    prefixes = [f"system prompt {i}: " + "you are a careful assistant. " * 40 for i in range(8)]
    served: dict[int, list[str]] = {i: [] for i in range(len(prefixes))}
    ids = []
    async with fresh() as http:
        for turn in range(6):
            for i, prefix in enumerate(prefixes):
                body = {"model": "mock-model", "prompt": prefix + f"question {turn}", "max_tokens": 2}
                async with http.post(gw.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    served[i].append(r.headers["x-mock-worker"])
                    ids.append(r.headers["x-request-id"])
                await asyncio.sleep(0.01)  # a placement reaches the other process's index in well under this
    assert len(processes(ids)) == 2, "both processes placed requests"
    # Each prefix stays on the worker that first got it, whichever process placed the later turns.
    assert all(len(set(names)) == 1 for names in served.values()), served
    assert len({names[0] for names in served.values()}) == 4, "new prefixes spread over the workers"
    async with aiohttp.ClientSession() as http:
        m = await gw.metrics(http)
    assert total(m, "mesh_cache_aware_hits_total") == 8 * 5
    assert total(m, "mesh_cache_aware_misses_total") == 8


def test_metrics_of_processes_add_up() -> None:
    from atomesh.metrics import Metrics

    leader, follower = Metrics([0.1, 1.0]), Metrics([0.1, 1.0])
    for m, n in ((leader, 2), (follower, 3)):
        for _ in range(n):
            m.router_requests.labels("completions", "m", "false", "regular").inc()
            m.router_duration.labels("completions", "m", "false").observe(0.5)
        m.pool_size.labels("regular", "ready").set(2)
    text = leader.render([follower.export()]).body
    assert isinstance(text, bytes)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }
    assert total(samples, "mesh_router_requests_total") == 5
    assert total(samples, "mesh_router_request_duration_seconds_count") == 5
    assert total(samples, "mesh_router_request_duration_seconds_bucket", le="1.0") == 5
    assert total(samples, "mesh_router_request_duration_seconds_bucket", le="0.1") == 0
    assert total(samples, "mesh_worker_pool_size") == 2  # the leader's, not the sum


async def test_tls_with_several_processes(mock_workers: MakeWorkers, launch: Launch, tmp_path: Path) -> None:
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    [w] = await mock_workers(1)
    gw = await launch(
        "--worker-urls",
        w.url,
        "--tls-cert-path",
        str(cert),
        "--tls-key-path",
        str(key),
        scheme="https",
        ssl=ssl.create_default_context(cafile=str(cert)),
    )
    ctx = ssl.create_default_context(cafile=str(cert))
    ids = []
    async with fresh() as http:
        for _ in range(24):
            async with http.post(gw.url + "/v1/completions", json=COMPLETION, ssl=ctx) as r:
                assert r.status == 200
                ids.append(r.headers["x-request-id"])
            # Other routes: served by the leader, spliced there by the follower when it took the connection.
            async with http.get(gw.url + "/workers", ssl=ctx) as r:
                assert r.status == 200 and (await r.json())["workers"][0]["url"] == w.url
    assert len(processes(ids)) == 2


async def test_a_worker_refusing_connections_is_out_of_every_process(mock_workers: MakeWorkers, launch: Launch) -> None:
    dead, alive = await mock_workers(2)
    gw = await launch("--worker-urls", dead.url, alive.url, "--health-check-interval-secs", "60")
    await dead.stop()
    ids = await completions(gw.url, 40)
    assert len(processes(ids)) == 2 and len(alive.received) == 40
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/workers") as r:
            states = {w["url"]: w["state"] for w in (await r.json())["workers"]}
        assert states[dead.url] == "unhealthy"  # the leader's registry, though a follower may have met it first
        m = await gw.metrics(http)
    # Only the requests already on their way to it when it first refused paid a retry (without taking it out,
    # every other request would: about 20).
    assert total(m, "mesh_worker_retries_total") < 10
