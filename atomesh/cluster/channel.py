"""One end of a leader-follower pipe, read from the event loop."""

from __future__ import annotations

import asyncio
import multiprocessing.connection
from collections.abc import Callable

import structlog

from atomesh.cluster.messages import Message

log = structlog.get_logger("atomesh.cluster")

Conn = multiprocessing.connection.Connection


class Channel:
    """Sends and receives `Message`s (small pickles) over one end of a pipe, without blocking the loop.

    `on_message` gets every message as it arrives; `on_eof` is called once when the other end is gone.
    """

    def __init__(self, conn: Conn, on_message: Callable[[Message], None], on_eof: Callable[[], None]) -> None:
        self.conn = conn
        self._on_message = on_message
        self._on_eof = on_eof
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._readable)
        self.closed = False

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self._on_message(self.conn.recv())
        except (EOFError, OSError):
            self.close()
            self._on_eof()

    def send(self, message: Message) -> None:
        if not self.closed:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self.conn.fileno())
            self.conn.close()


def unexpected(message: object, side: str) -> None:
    """A message this side does not take: a bug in the other process, logged and dropped."""
    log.error("cluster_message_unexpected", side=side, message=type(message).__name__)
