"""Background work with one owner: `PeriodicTask` runs a round every interval until its owner stops it.

Every periodic job of the gateway (health probes, load polling, cache-index eviction, connection
sweeps, the leader's heartbeat) is one of these, so they all start, stop and fail the same way:

- the owner calls `start()` once and `await stop()` once (cancels the task and waits for it to end);
- rounds run at a fixed rate (a round that overruns its interval is followed at once by the next,
  never by a burst of catch-up rounds);
- an exception in a round is logged with its traceback and the task goes on, waiting longer after
  each failed round in a row (doubling up to `max_backoff`), so a persistent fault neither ends the
  job silently nor floods the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("atomesh.tasks")

# A round is a plain function or a coroutine function; its return value is ignored.
Round = Callable[[], Awaitable[object] | object]


class PeriodicTask:
    """Runs `round_` every `interval` seconds in one asyncio task that this object owns."""

    __slots__ = ("_task", "failures", "first_delay", "interval", "max_backoff", "name", "round")

    def __init__(
        self, name: str, interval: float, round_: Round, *, first_delay: float | None = None, max_backoff: float = 30.0
    ) -> None:
        if interval <= 0:
            raise ValueError(f"{name}: the interval must be positive, not {interval!r}")
        self.name = name
        self.interval = interval
        self.round = round_
        # Seconds before the first round (default: one interval; 0 runs one at once).
        self.first_delay = interval if first_delay is None else first_delay
        # Longest wait after failed rounds (never shorter than the interval itself).
        self.max_backoff = max(max_backoff, interval)
        self.failures = 0  # failed rounds in a row
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the task (a no-op while it runs); needs a running event loop."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    def cancel(self) -> None:
        """Ask the task to end (at its next await); `stop()` also waits for it."""
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended. Safe to call more than once, or never started."""
        task, self._task = self._task, None
        if task is None:
            return
        # Cancelled again until it ends: on Python 3.11 `asyncio.wait_for` swallows a cancellation that
        # arrives as its inner await completes, and the loop would then go on (a teardown that hung
        # once under load, with a 0.2 s health loop still turning).
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def delay_after_failure(self) -> float:
        """The wait before the next round after `failures` failed rounds in a row (doubling, capped)."""
        return float(min(self.interval * 2 ** min(self.failures, 32), self.max_backoff))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.first_delay
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                result = self.round()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self.failures += 1
                delay = self.delay_after_failure()
                log.exception(
                    "periodic_round_failed", task=self.name, failures=self.failures, retry_in_secs=round(delay, 3)
                )
                next_at = loop.time() + delay
                continue
            self.failures = 0
            next_at = max(next_at + self.interval, loop.time())
