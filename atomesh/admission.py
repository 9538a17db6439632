"""Admission control: a bounded number of requests run, a bounded queue waits, a token bucket paces.

A permit is held from admission until the request's last byte is sent.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import deque
from types import TracebackType

from atomesh.errors import ServiceUnavailable, TooManyRequests

# Descriptors kept aside from the derived limit (listening sockets, logs, health checks, the pool's idle ones).
RESERVED_FDS = 256


def host_concurrency_limit() -> int:
    """`--max-concurrent-requests -1`: what this host can hold at once. Raises the soft open-file limit to
    the hard one, then allows a third of it (each request holds a client connection and up to two worker
    connections), less a reserve; at least 1."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit the process was given
    return max(1, (soft - RESERVED_FDS) // 3)


class TokenBucket:
    """Refills `rate` tokens a second up to `capacity`; each admitted request takes one."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, capacity)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_time(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)


class Admission:
    """Concurrency limit + FIFO wait queue + optional token bucket; all bounded."""

    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout: float,
                 rate: float | None, burst: float | None = None) -> None:
        self.limit = max_concurrent if max_concurrent > 0 else None
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        if burst is None:
            burst = float(max_concurrent if max_concurrent > 0 else rate or 1)
        self.bucket = TokenBucket(rate, burst) if rate else None
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def permit(self) -> Permit:
        """`async with admission.permit():` holds one slot for the body's duration."""
        return Permit(self)

    def enter_now(self) -> bool:
        """Take a slot if one is free now, nobody waiting before us (then `leave()` it); False: `enter()`.

        The request path's way in: no context manager, no coroutine when a slot is free (the usual case)."""
        if self.limit is None and self.bucket is None:
            self.running += 1  # unlimited: nothing to wait for
            return True
        if not self._waiters and self._free_now():
            self.running += 1
            return True
        return False

    async def enter(self) -> None:
        """Wait in the queue for a slot (then `leave()` it); raises when the queue is full or the wait too long."""
        await self._acquire()

    def leave(self) -> None:
        """Give back a slot taken with `enter_now()` or `enter()`."""
        self._release()

    async def _acquire(self) -> None:
        if not self._waiters and self._free_now():
            self.running += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise TooManyRequests("the gateway is at capacity and its queue is full; retry later",
                                  code="queue_full")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        deadline = time.monotonic() + self.queue_timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceUnavailable(f"waited {self.queue_timeout:g}s in the admission queue",
                                             code="queue_timeout")
                # Wake on a released slot, or when the token bucket refills.
                poll = remaining if self.bucket is None else min(remaining, max(self.bucket.wait_time(), 0.001))
                try:
                    await asyncio.wait_for(asyncio.shield(fut), poll)
                except TimeoutError:
                    pass
                if self._waiters and self._waiters[0] is fut and self._free_now():
                    self._waiters.popleft()
                    self.running += 1
                    self._wake_next()
                    return
                if fut.done():
                    fut = self._rearm(fut)
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            self._wake_next()
            raise

    def _rearm(self, old: asyncio.Future[None]) -> asyncio.Future[None]:
        new: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        idx = self._waiters.index(old)
        self._waiters[idx] = new
        return new

    def _free_now(self) -> bool:
        if self.limit is not None and self.running >= self.limit:
            return False
        return self.bucket is None or self.bucket.take()

    def _release(self) -> None:
        self.running -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)


class Permit:
    """One admission slot as an async context manager (a class: cheaper than a generator-based one)."""

    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def __aenter__(self) -> None:
        a = self._admission
        if a.limit is None and a.bucket is None:
            a.running += 1  # unlimited: nothing to wait for
            return
        await a._acquire()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._admission._release()
