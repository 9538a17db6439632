"""Periodic health checks: a worker turns unhealthy after N failed checks and back after M passed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerState

log = structlog.get_logger("atomesh.workers")

Probe = Callable[[Worker], Awaitable[tuple[bool, str]]]
ResultHook = Callable[[Worker, bool], None]


class HealthChecker:
    """Owns the health-check task; probes every ready or unhealthy worker each interval."""

    def __init__(self, registry: WorkerRegistry, probe: Probe, *, interval: float, failure_threshold: int,
                 success_threshold: int, on_result: ResultHook | None = None) -> None:
        self.registry = registry
        self.probe = probe
        self.interval = interval
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.on_result = on_result
        self._streaks: dict[str, int] = {}  # worker id -> +passes / -failures in a row
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()

    async def check_all(self) -> None:
        workers = [w for w in self.registry if w.state in (WorkerState.READY, WorkerState.UNHEALTHY)]
        results = await asyncio.gather(*(self.probe(w) for w in workers))
        for worker, (ok, reason) in zip(workers, results, strict=True):
            self.record(worker, ok, reason)
        live = {w.id for w in self.registry}
        for wid in [k for k in self._streaks if k not in live]:
            del self._streaks[wid]

    def record(self, worker: Worker, ok: bool, reason: str = "") -> None:
        if self.on_result is not None:
            self.on_result(worker, ok)
        streak = self._streaks.get(worker.id, 0)
        streak = (max(streak, 0) + 1) if ok else (min(streak, 0) - 1)
        self._streaks[worker.id] = streak
        if worker.state is WorkerState.READY and -streak >= self.failure_threshold:
            self.registry.set_state(worker, WorkerState.UNHEALTHY)
            log.warning("worker_unhealthy", worker=worker.url, reason=reason, failures=-streak)
        elif worker.state is WorkerState.UNHEALTHY and streak >= self.success_threshold:
            self.registry.set_state(worker, WorkerState.READY)
            log.info("worker_healthy", worker=worker.url, successes=streak)
