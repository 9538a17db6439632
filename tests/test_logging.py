"""Logs of a real `atomesh launch` process: JSON lines, request ids, lifecycle events once each."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from gwtest import MakeWorkers, free_port, wait_for

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON log the gateway may be writing right now (a last line without its
    newline is still being written, so it is left for the next read)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


async def test_json_logs_carry_request_ids_and_lifecycle_events(mock_workers: MakeWorkers, tmp_path: Path) -> None:
    stay, flaky, leaving = await mock_workers(3)
    port, metrics_port = free_port(), free_port()
    log_dir = tmp_path / "logs"
    proc = await asyncio.create_subprocess_exec(
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
        str(metrics_port),
        "--worker-urls",
        stay.url,
        flaky.url,
        leaving.url,
        "--policy",
        "round_robin",
        "--json-log",
        "--log-dir",
        str(log_dir),
        "--log-level",
        "debug",
        "--health-check-interval-secs",
        "0.2",
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        "--cb-failure-threshold",
        "2",
        "--cb-success-threshold",
        "1",
        "--cb-timeout-duration-secs",
        "0.3",
        "--retry-initial-backoff-ms",
        "1",
        "--worker-startup-check-interval",
        "0.1",
        "--shutdown-grace-period-secs",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    log_file = log_dir / "atomesh.log"

    def names() -> Counter[str]:
        return Counter(e.get("event") for e in read_events(log_file))

    try:

        async def until(event: str, count: int = 1, timeout: float = 15) -> None:
            await wait_for(lambda: names()[event] >= count or proc.returncode is not None, timeout, event)
            assert proc.returncode is None, f"gateway exited: {(await proc.stderr.read()).decode()[-2000:]}"  # type: ignore[union-attr]

        await until("gateway_ready")
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            # A request that fails upstream: its warning line carries the request id.
            flaky.behaviour.fail_status = 500
            for i in range(30):
                async with http.post(
                    base + "/v1/completions", json=COMPLETION, headers={"x-request-id": f"req-{i}"}
                ) as r:
                    await r.read()
                if names()["breaker_opened"]:
                    break
            await until("breaker_opened")
            flaky.behaviour.fail_status = None
            # The flaky worker fails its health checks, then recovers.
            flaky.behaviour.health_status = 503
            await until("worker_unhealthy")
            flaky.behaviour.health_status = 200
            await until("worker_healthy")
            # Half-open after the timeout; a success closes the breaker.
            deadline = time.monotonic() + 10
            while names()["breaker_closed"] == 0 and time.monotonic() < deadline:
                async with http.post(base + "/v1/completions", json=COMPLETION) as r:
                    await r.read()
                await asyncio.sleep(0.05)
            await until("breaker_closed")
            # Drain and remove a worker through the admin API.
            async with http.delete(base + "/workers/" + leaving.url.replace(":", "%3A").replace("/", "%2F")) as r:
                assert r.status == 202, await r.text()
            await until("worker_removed")
            # The access log never carries a credential, wherever the client put it.
            async with http.get(
                base + "/v1/models?api_key=sekrit-query",
                headers={"Authorization": "Bearer sekrit-header", "x-request-id": "models-1"},
            ) as r:
                assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    events = read_events(log_file)  # every line parsed as one JSON object
    assert events and all(isinstance(e, dict) and "timestamp" in e and "level" in e for e in events)
    counts = Counter(e["event"] for e in events)
    # Each lifecycle event happened once, and is logged exactly once.
    for event in (
        "breaker_opened",
        "worker_unhealthy",
        "worker_healthy",
        "breaker_closed",
        "worker_draining",
        "worker_removed",
        "shutdown_started",
        "shutdown_complete",
    ):
        assert counts[event] == 1, (event, counts)
    assert counts["worker_registered"] == 3
    registered = {e["worker"] for e in events if e["event"] == "worker_registered"}
    assert registered == {stay.url, flaky.url, leaving.url}
    # Lines logged while serving a request carry its id.
    failed = [e for e in events if e["event"] in ("request_failed", "retrying")]
    assert failed and all(e.get("request_id", "").startswith("req-") for e in failed), failed
    # One access log line per request, with its id, route, status, worker and timing.
    access = [e for e in events if e["event"] == "request"]
    served = [e for e in access if e["request_id"].startswith("req-")]
    assert served and all(
        e["method"] == "POST"
        and e["path"] == "/v1/completions"
        and e["latency_ms"] >= 0
        and e["worker"] in (stay.url, flaky.url, leaving.url)
        and e["bytes"] > 0
        for e in served
    ), served[:3]
    [models] = [e for e in access if e["request_id"] == "models-1"]
    assert models["path"] == "/v1/models" and models["status"] == 200
    assert "sekrit" not in log_file.read_text()
    # Lifecycle lines from background tasks carry no stale request id.
    assert all("request_id" not in e for e in events if e["event"] in ("worker_unhealthy", "worker_healthy"))


def test_setup_logging_renders_every_record_and_filters_by_level(tmp_path: Path) -> None:
    """Run in a fresh interpreter: structlog caches its configuration on first use."""
    import subprocess

    script = (
        "import logging, sys, structlog; from pathlib import Path; from atomesh.logs import setup_logging\n"
        "setup_logging(sys.argv[1], sys.argv[2] == 'json', Path(sys.argv[3]))\n"
        "log = structlog.get_logger('t')\n"
        "with structlog.contextvars.bound_contextvars(request_id='r-1'):\n"
        "    log.warning('slow_worker', worker='http://w:1')\n"
        "log.info('hidden_below_level')\n"
        "logging.getLogger('aiohttp.server').error('library says %s', 'boom')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('crashed')\n"
    )
    for mode in ("json", "console"):
        out = tmp_path / mode
        run = subprocess.run(
            [sys.executable, "-c", script, "warn", mode, str(out)], capture_output=True, text=True, timeout=30
        )
        assert run.returncode == 0, run.stderr
        text = (out / "atomesh.log").read_text()
        assert "hidden_below_level" not in text
        assert "slow_worker" in text and "boom" in text and "ZeroDivisionError" in text
        assert "slow_worker" in run.stderr and "boom" in run.stderr  # stderr gets the same records
        if mode == "json":
            lines = [json.loads(line) for line in text.splitlines()]
            assert [e["event"] for e in lines] == ["slow_worker", "library says boom", "crashed"]
            assert lines[0]["request_id"] == "r-1" and lines[0]["level"] == "warning"
            assert lines[1]["logger"] == "aiohttp.server" and lines[1]["level"] == "error"
            assert "ZeroDivisionError" in lines[2]["exception"]


def test_access_log_sampling_and_off() -> None:
    from structlog.testing import capture_logs

    from atomesh.api.middleware import HttpAccounting
    from atomesh.metrics import Metrics

    def lines(rate: float, statuses: list[int]) -> list[dict[str, Any]]:
        acc = HttpAccounting(["x-request-id"], Metrics([1.0]), 1024, access_log_sample_rate=rate)
        with capture_logs() as logs:
            for status in statuses:
                acc.end("POST", "/v1/completions", status, acc.begin("POST", "/v1/completions"), None, "r")
        return [e for e in logs if e["event"] == "request"]

    assert len(lines(1.0, [200] * 10)) == 10
    assert lines(0.0, [200, 500, 429]) == []  # off
    sampled = lines(0.01, [200] * 200 + [503, 400])
    assert [e["status"] for e in sampled][-2:] == [503, 400] and len(sampled) < 60  # errors always written


def test_batched_access_lines_read_as_structlog_renders_them(tmp_path: Path) -> None:
    """The access log is rendered off the request path, by its own code: each line, console or JSON, with
    or without context variables bound, reads as structlog renders the same event (the time aside), is
    redacted the same way, and is written within a moment when an event loop runs."""
    import subprocess

    script = (
        "import asyncio, sys, structlog; from pathlib import Path; from atomesh.logs import AccessLog, setup_logging\n"
        "setup_logging('info', sys.argv[1] == 'json', Path(sys.argv[2]))\n"
        "rows = [('r-1', 'POST', '/v1/completions', 200, 'http://w:1', 1.5, 291),\n"
        "        (None, None, '/x', 408, None, None, 0),\n"
        "        ('id with space', 'GET', \"/p'q=1\", 499, 'http://a:1,http://b:2', 0.0, 3),\n"
        "        ('Bearer sk-secret', 'POST', '/v1/chat/completions', 200, 'http://u:pw@w:1', 12.25, 7)]\n"
        "names = ('request_id', 'method', 'path', 'status', 'worker', 'latency_ms', 'bytes')\n"
        "slow = structlog.get_logger('atomesh.access')\n"
        "fast = AccessLog()\n"
        "assert fast.fast\n"
        "async def main() -> None:\n"
        "    for context in ({}, {'process': 3}):\n"
        "        structlog.contextvars.clear_contextvars()\n"
        "        structlog.contextvars.bind_contextvars(**context)\n"
        "        for r in rows:\n"
        "            slow.info('request', **dict(zip(names, r)))\n"
        "        for r in rows:\n"
        "            fast.write(*r)\n"
        "        await asyncio.sleep(0.3)  # written by the loop, not by flush()\n"
        "asyncio.run(main())\n"
    )
    for mode in ("json", "console"):
        out = tmp_path / mode
        run = subprocess.run([sys.executable, "-c", script, mode, str(out)], capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        lines = (out / "atomesh.log").read_text().splitlines()
        assert len(lines) == 16, lines
        assert "sk-secret" not in "".join(lines) and ":pw@" not in "".join(lines)
        for k in (0, 8):
            slow_lines, fast_lines = lines[k : k + 4], lines[k + 4 : k + 8]
            if mode == "json":
                for s, f in zip(slow_lines, fast_lines, strict=True):
                    sd, fd = json.loads(s), json.loads(f)
                    assert sd.pop("timestamp")[:10] == fd.pop("timestamp")[:10]
                    assert list(sd.items()) == list(fd.items())
            else:
                assert [s.split(" ", 1)[1] for s in slow_lines] == [f.split(" ", 1)[1] for f in fast_lines]
                days = [(s[:10], f[:10]) for s, f in zip(slow_lines, fast_lines, strict=True)]
                assert all(a == b for a, b in days)
