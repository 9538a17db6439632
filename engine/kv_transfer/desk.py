"""A TCP server on a thread of its own: the producer's ipc read desk.

A prefill engine's event loop is busy with its steps and its streams; a decode engine pulling over
``ipc`` needs one short answer from the producer (the blocks are claimed for it) and should not queue
behind that loop for it. ``Desk`` serves such connections from its own thread and event loop; the
handler it runs touches only state that is safe to share (the producer guards its transfer table
with a lock and hands the release of blocks back to the engine's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Desk:
    """Serves ``handler`` on ``host:port`` (0: any free port) from a daemon thread; ``close`` stops it."""

    def __init__(self, handler: Handler, host: str, port: int = 0, name: str = "kv-read-desk") -> None:
        self._handler = handler
        self._host = host
        self._asked_port = port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind and start serving; raises OSError when the port cannot be bound."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"the KV read desk did not start within {timeout_s:g} s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._serve, self._host, self._asked_port))
                self.port = self._server.sockets[0].getsockname()[1]
            except OSError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
        finally:
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handler(reader, writer)
        except Exception:  # a handler bug must not end the desk
            log.exception("kv_read_desk_handler_failed")
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving: connections in flight are cancelled (their handlers' cleanup runs), the thread ends."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # already closing
                loop.call_soon_threadsafe(loop.stop)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
