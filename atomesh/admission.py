"""Admission control: a bounded number of requests run, a bounded queue waits (in arrival order, or by
priority class with aging), a token bucket paces.

A permit is held from admission until the request's last byte is sent.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from atomesh.errors import ServiceUnavailable, TooManyRequests
from atomesh.tenancy import ClassSettings, PriorityClass

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


class FifoQueue:
    """Waiters in arrival order (the default admission queue)."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self._waiters: deque[asyncio.Future[None]] = deque()

    def usable(self, cls: PriorityClass, limit: int, aged: bool = False) -> int:
        return limit

    def __len__(self) -> int:
        return len(self._waiters)

    def push(self, fut: asyncio.Future[None], cls: PriorityClass, priority: int) -> float:
        """Queue a waiter; returns how long it may wait. Raises TooManyRequests when full."""
        if len(self._waiters) >= self.size:
            raise TooManyRequests("the gateway is at capacity and its queue is full; retry later", code="queue_full")
        self._waiters.append(fut)
        return self.timeout

    def head(self) -> asyncio.Future[None] | None:
        return self._waiters[0] if self._waiters else None

    def remove(self, fut: asyncio.Future[None]) -> None:
        if self._waiters and self._waiters[0] is fut:
            self._waiters.popleft()
        elif fut in self._waiters:
            self._waiters.remove(fut)

    def replace(self, old: asyncio.Future[None], new: asyncio.Future[None]) -> None:
        self._waiters[self._waiters.index(old)] = new


@dataclass(slots=True)
class _Ticket:
    fut: asyncio.Future[None]
    cls: PriorityClass
    priority: int
    seq: int
    starve_at: float  # from then on it goes before every class (aging: nothing starves)


class PriorityQueue:
    """`--priority-scheduler-enabled`: the highest class first, then the lowest body `priority`, then
    arrival; a waiter older than its class's starvation threshold goes first (oldest of those first).
    Each class has its own bound and timeout."""

    def __init__(self, classes: Mapping[PriorityClass, ClassSettings], limit: int | None) -> None:
        self.classes = classes
        self._tickets: list[_Ticket] = []
        self._seq = 0
        self.queued = dict.fromkeys(PriorityClass, 0)
        # Slots each class may fill: all but those the classes above it reserve, leaving it one at least.
        self._usable = {
            c: max(1, (limit or 0) - sum(classes[k].reserved(limit or 0) for k in PriorityClass if k > c))
            for c in PriorityClass
        }

    def usable(self, cls: PriorityClass, limit: int, aged: bool = False) -> int:
        """How many running requests still let a `cls` request in (an aged one: every slot)."""
        return limit if aged else min(limit, self._usable[cls])

    def head_ticket(self) -> _Ticket | None:
        if not self._tickets:
            return None
        now = time.monotonic()
        return min(
            self._tickets, key=lambda t: (0, t.seq, 0, 0) if now >= t.starve_at else (1, -t.cls, t.priority, t.seq)
        )

    def __len__(self) -> int:
        return len(self._tickets)

    def push(self, fut: asyncio.Future[None], cls: PriorityClass, priority: int) -> float:
        settings = self.classes[cls]
        if self.queued[cls] >= settings.queue_size:
            raise TooManyRequests(
                f"the gateway is at capacity and the {cls.name.lower()} class's queue is full; retry later",
                code="queue_full",
            )
        self._seq += 1
        self._tickets.append(
            _Ticket(fut, cls, priority, self._seq, time.monotonic() + settings.starvation_threshold_secs)
        )
        self.queued[cls] += 1
        return settings.queue_timeout_secs

    def head(self) -> asyncio.Future[None] | None:
        ticket = self.head_ticket()
        return None if ticket is None else ticket.fut

    def remove(self, fut: asyncio.Future[None]) -> None:
        for i, t in enumerate(self._tickets):
            if t.fut is fut:
                del self._tickets[i]
                self.queued[t.cls] -= 1
                return

    def replace(self, old: asyncio.Future[None], new: asyncio.Future[None]) -> None:
        for t in self._tickets:
            if t.fut is old:
                t.fut = new
                return


class Admission:
    """Concurrency limit + a bounded wait queue (FIFO, or by priority class) + optional token bucket."""

    def __init__(
        self,
        max_concurrent: int,
        queue_size: int,
        queue_timeout: float,
        rate: float | None,
        burst: float | None = None,
        classes: Mapping[PriorityClass, ClassSettings] | None = None,
    ) -> None:
        self.limit = max_concurrent if max_concurrent > 0 else None
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        if burst is None:
            burst = float(max_concurrent if max_concurrent > 0 else rate or 1)
        self.bucket = TokenBucket(rate, burst) if rate else None
        self.running = 0
        self.running_by_class = [0] * len(PriorityClass)  # reservations count the classes at or below
        self._queue: FifoQueue | PriorityQueue = (
            FifoQueue(queue_size, queue_timeout) if classes is None else PriorityQueue(classes, self.limit)
        )

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def permit(self, cls: PriorityClass = PriorityClass.DEFAULT, priority: int = 0) -> Permit:
        """`async with admission.permit():` holds one slot for the body's duration."""
        return Permit(self, cls, priority)

    async def _acquire(self, cls: PriorityClass, priority: int) -> None:
        queue = self._queue
        if not len(queue) and self._free_now(cls):
            self._take(cls)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timeout = queue.push(fut, cls, priority)
        deadline = time.monotonic() + timeout
        try:
            while True:
                # First at once: a waiter that went to the head of a priority queue on arriving takes
                # a slot left free while the one it overtook was being woken.
                if queue.head() is fut and self._free_now(cls, aged=self._aged(fut)):
                    queue.remove(fut)
                    self._take(cls)
                    self._wake_next()
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceUnavailable(f"waited {timeout:g}s in the admission queue", code="queue_timeout")
                # Wake on a released slot, or when the token bucket refills.
                poll = remaining if self.bucket is None else min(remaining, max(self.bucket.wait_time(), 0.001))
                try:
                    await asyncio.wait_for(asyncio.shield(fut), poll)
                except TimeoutError:
                    pass
                if fut.done():
                    new: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    queue.replace(fut, new)
                    fut = new
        except BaseException:
            queue.remove(fut)
            self._wake_next()
            raise

    def _aged(self, fut: asyncio.Future[None]) -> bool:
        queue = self._queue
        if not isinstance(queue, PriorityQueue):
            return False
        ticket = queue.head_ticket()
        return ticket is not None and ticket.fut is fut and time.monotonic() >= ticket.starve_at

    def _free_now(self, cls: PriorityClass = PriorityClass.DEFAULT, aged: bool = False) -> bool:
        limit = self.limit
        if limit is not None and (
            self.running >= limit or (sum(self.running_by_class[: cls + 1]) >= self._queue.usable(cls, limit, aged))
        ):
            return False
        return self.bucket is None or self.bucket.take()

    def _take(self, cls: PriorityClass) -> None:
        self.running += 1
        self.running_by_class[cls] += 1

    def _release(self, cls: PriorityClass) -> None:
        self.running -= 1
        self.running_by_class[cls] -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        head = self._queue.head()
        if head is not None and not head.done():
            head.set_result(None)


class Permit:
    """One admission slot as an async context manager (a class: cheaper than a generator-based one)."""

    __slots__ = ("_admission", "_cls", "_priority")

    def __init__(self, admission: Admission, cls: PriorityClass, priority: int) -> None:
        self._admission = admission
        self._cls = cls
        self._priority = priority

    def take_now(self) -> bool:
        """Hold the slot at once if one is free and nobody waits (then `release()` it); False: await
        `__aenter__`. The request path's way in: no coroutine to run when there is no wait."""
        a = self._admission
        if a.limit is None and a.bucket is None:
            a._take(self._cls)  # unlimited: nothing to wait for
            return True
        if not len(a._queue) and a._free_now(self._cls):
            a._take(self._cls)
            return True
        return False

    def release(self) -> None:
        """Give the slot back (a permit taken with `take_now` or entered)."""
        self._admission._release(self._cls)

    async def __aenter__(self) -> None:
        if not self.take_now():
            await self._admission._acquire(self._cls, self._priority)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._admission._release(self._cls)
