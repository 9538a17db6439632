"""Engine load poller: reads each ready worker's queue depth into `Worker.engine_load`.

Our own in-flight count only sees requests sent through this gateway; an engine shared with other
clients (or another gateway replica) is busier than that. Every `interval` seconds one task scrapes
each ready worker's Prometheus `/metrics` and sums the running and waiting request gauges of the
engine families we know (ATOM, SGLang, vLLM). A worker that does not answer within `timeout`, or
exports none of those gauges, gets `engine_load = None`, so policies fall back to in-flight counts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import aiohttp
import structlog

from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole

log = structlog.get_logger("atomesh.load")

# Gauge names whose sum is an engine's load (running + queued requests).
LOAD_GAUGES = frozenset({
    "atom:requests_running", "atom:requests_waiting",
    "sglang:num_running_reqs", "sglang:num_queue_reqs",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
})


def parse_load(text: str, names: Iterable[str] = LOAD_GAUGES) -> int | None:
    """Sum the load gauges in a Prometheus text exposition (all label sets); None if none is there."""
    wanted = frozenset(names)
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < name_end:
                name_end = i
        if line[:name_end] not in wanted:
            continue
        rest = line[line.rfind("}") + 1:] if line[name_end:name_end + 1] == "{" else line[name_end:]
        try:
            total += float(rest.split()[0])  # `value [timestamp]`
        except (ValueError, IndexError):
            continue
        found = True
    return int(total) if found else None


class LoadPoller:
    """Owns one task that polls every ready worker's engine load."""

    def __init__(self, registry: WorkerRegistry, interval: float = 1.0, timeout: float = 0.5,
                 path: str = "/metrics") -> None:
        self.registry = registry
        self.interval = interval
        self.timeout = timeout
        self.path = path
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="load-poller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def poll_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        workers = [w for role in WorkerRole for w in self.registry.ready(role)]
        await asyncio.gather(*(self._poll(w) for w in workers))

    async def _poll(self, worker: Worker) -> None:
        assert self._session is not None
        try:
            async with self._session.get(worker.url + self.path) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            text = ""
        worker.engine_load = parse_load(text) if text else None

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # one bad round must not end polling
                log.warning("load_poll_failed", error=str(e))
            await asyncio.sleep(self.interval)
