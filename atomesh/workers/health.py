"""Periodic health checks: a worker turns unhealthy after N failed checks and back after M passed.

Each worker is probed by a task of its own, on its own schedule, each probe bounded by the probe
timeout: a frozen worker's probes wait out their timeout without delaying anyone else's, so every
worker's detection time is its own (interval x failure threshold, plus one timeout at most).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import structlog

from atomesh.tasks import PeriodicTask
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerState

log = structlog.get_logger("atomesh.workers")

Probe = Callable[[Worker], Awaitable[tuple[bool, str]]]
ResultHook = Callable[[Worker, bool], None]
# Called when a worker turns unhealthy (after the state change): requests on it can be re-placed.
UnhealthyHook = Callable[[Worker], None]

_PROBED = (WorkerState.READY, WorkerState.UNHEALTHY)


class HealthChecker:
    """Owns one probing task per ready or unhealthy worker, started and stopped with its state."""

    def __init__(
        self,
        registry: WorkerRegistry,
        probe: Probe,
        *,
        interval: float,
        failure_threshold: int,
        success_threshold: int,
        on_result: ResultHook | None = None,
        on_unhealthy: UnhealthyHook | None = None,
    ) -> None:
        self.registry = registry
        self.probe = probe
        self.interval = interval
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.on_result = on_result
        self.on_unhealthy = on_unhealthy
        self._streaks: dict[str, int] = {}  # worker id -> +passes / -failures in a row
        self._tasks: dict[str, PeriodicTask] = {}  # worker id -> its probing task
        self._ending: set[PeriodicTask] = set()  # cancelled with their worker's state, awaited by stop()
        self._running = False
        registry.subscribe(self._on_state)

    def start(self) -> None:
        self._running = True
        for w in self.registry:
            if w.state in _PROBED:
                self._watch(w)

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *self._ending]
        self._tasks.clear()
        self._ending.clear()
        await asyncio.gather(*(t.stop() for t in tasks))

    def _on_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if not self._running:
            return
        if new in _PROBED:
            if new is WorkerState.UNHEALTHY:
                # Taken out by other evidence (a refused connection) or by us: it must pass checks to return.
                self._streaks[worker.id] = min(self._streaks.get(worker.id, 0), 0)
            self._watch(worker)
        else:
            task = self._tasks.pop(worker.id, None)
            if task is not None:
                task.cancel()  # a state callback cannot await: stop() does, if it has not ended by then
                self._ending = {t for t in self._ending if t.running}
                self._ending.add(task)
            self._streaks.pop(worker.id, None)

    def _watch(self, worker: Worker) -> None:
        if worker.id not in self._tasks:

            async def probe_once() -> None:
                if worker.state in _PROBED:
                    ok, reason = await self.probe(worker)
                    self.record(worker, ok, reason)

            # Start each worker at a random point of the interval, so probes do not come in waves.
            task = PeriodicTask(
                f"health {worker.url}",
                self.interval,
                probe_once,
                first_delay=self.interval * (0.5 + random.random() / 2),
            )
            self._tasks[worker.id] = task
            task.start()

    def record(self, worker: Worker, ok: bool, reason: str = "") -> None:
        if worker.state not in _PROBED:
            return
        if self.on_result is not None:
            self.on_result(worker, ok)
        streak = self._streaks.get(worker.id, 0)
        streak = (max(streak, 0) + 1) if ok else (min(streak, 0) - 1)
        self._streaks[worker.id] = streak
        if worker.state is WorkerState.READY and -streak >= self.failure_threshold:
            self.registry.set_state(worker, WorkerState.UNHEALTHY)
            log.warning("worker_unhealthy", worker=worker.url, reason=reason, failures=-streak)
            if self.on_unhealthy is not None:
                self.on_unhealthy(worker)
        elif worker.state is WorkerState.UNHEALTHY and streak >= self.success_threshold:
            self.registry.set_state(worker, WorkerState.READY)
            log.info("worker_healthy", worker=worker.url, successes=streak)
