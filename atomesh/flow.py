"""Flow control of one connection, both ways, for every `asyncio.Protocol` the gateway writes.

- **Writing**: the transport calls `pause_writing()` when its send buffer passes the high-water mark
  and `resume_writing()` when it falls below the low one. A coroutine that writes checks
  `write_paused` after each write and, when set, awaits `drain()`: one future, woken by
  `resume_writing()` or by the connection's loss (then `drain()` raises ConnectionResetError).
  Callback-driven writers (no coroutine to suspend) override `writing_resumed()` instead.
- **Reading**: `hold_reading()` stops the transport reading (the peer then waits on TCP) while what
  was read is not consumed yet; `release_reading()` resumes it. Both are idempotent.

The subclass sets `self.transport` in `connection_made` (None once it is closed or handed off) and
calls `connection_ended()` from `connection_lost`.
"""

from __future__ import annotations

import asyncio


class FlowControl(asyncio.Protocol):
    """Pause / resume / drain for writing, hold / release for reading, on one connection."""

    __slots__ = ("_drain_waiter", "_lost", "reading_paused", "transport", "write_paused")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.write_paused = False
        self.reading_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._lost = False

    # ------------------------------------------------------------------ writing
    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()
        self.writing_resumed()

    def writing_resumed(self) -> None:
        """Hook for writers driven by callbacks rather than `drain()`; does nothing by default."""

    async def drain(self) -> None:
        """Return once the transport takes more data; raise ConnectionResetError if the peer is gone."""
        if self._lost or self.transport is None:
            raise ConnectionResetError("the peer closed the connection")
        if not self.write_paused:
            return
        waiter = self._drain_waiter
        if waiter is None or waiter.done():
            waiter = self._drain_waiter = asyncio.get_running_loop().create_future()
        await waiter
        if self._lost:
            raise ConnectionResetError("the peer closed the connection")

    def connection_ended(self) -> None:
        """The connection is gone: a writer waiting in `drain()` wakes and fails."""
        self._lost = True
        self.write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ reading
    def hold_reading(self) -> None:
        """Stop reading from the peer until `release_reading()` (no-op when already held or closed)."""
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def release_reading(self) -> None:
        """Read from the peer again (no-op when not held or closed)."""
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None:
                self.transport.resume_reading()
