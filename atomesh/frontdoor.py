"""The gateway's HTTP/1.1 front door: inference requests on a purpose-built protocol, the rest on aiohttp.

Nearly all of a gateway's traffic is one shape: `POST` to an inference route, a JSON body with a
`Content-Length`, keep-alive. The front door parses exactly that shape itself and answers it through
a `FrontExchange` (one socket write for a whole answer, chunked framing for a stream), which costs a
fraction of aiohttp's request and response machinery. Anything else that arrives on a connection
(another route, a chunked or `Expect`-ing upload, HTTP/1.0, an oversized or malformed head) hands the
connection to aiohttp's protocol, with every byte not yet consumed, and aiohttp serves it from then
on: every other route, and every corner of HTTP, stays aiohttp's (docs/design.md).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

import structlog

from atomesh.api.middleware import HttpAccounting, error_answer
from atomesh.api.openai import serve_inference
from atomesh.errors import GatewayError, error_body
from atomesh.request import Route
from atomesh.transport import Exchange

if TYPE_CHECKING:
    from atomesh.gateway import Gateway

log = structlog.get_logger("atomesh.api")

HOT_ROUTES: dict[bytes, Route] = {r.value.encode(): r for r in Route}
MAX_HEAD = 64 * 1024  # a longer head goes to aiohttp, which refuses it properly
MAX_BUFFERED = 1 << 20  # pipelined bytes held while a request is served; beyond this, reading pauses
KEEPALIVE_SECS = 75.0  # an idle keep-alive connection is closed after this (aiohttp's default too)
SWEEP_SECS = 5.0

# Control characters no header may carry; a bare CR or LF could split a header we echo back.
_BAD_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_JSON = "application/json"


class _Clock:
    """The `Date` header, formatted once a second."""

    second = 0
    value = ""

    @classmethod
    def date(cls) -> str:
        now = int(time.time())
        if now != cls.second:
            cls.second, cls.value = now, formatdate(now, usegmt=True)
        return cls.value


def response_head(status: int, headers: Mapping[str, str], length: int | None, keep_alive: bool) -> bytes:
    """Status line and headers; `length` None means a chunked body."""
    parts = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"]
    for k, v in headers.items():
        parts.append(f"{k}: {v}\r\n")
    parts.append(f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n")
    parts.append(f"Date: {_Clock.date()}\r\n")
    if not keep_alive:
        parts.append("Connection: close\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1", "replace")


class FrontExchange(Exchange):
    """An Exchange writing straight to the client's connection."""

    __slots__ = ("conn",)

    def __init__(self, conn: FrontConnection, request_id: str, headers: Mapping[str, str]) -> None:
        super().__init__(request_id, headers)
        self.conn = conn

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status, self.body = status, body
        self.conn.send(response_head(status, headers, len(body), self.conn.keep_alive) + body)

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.committed = True
        self.conn.send(response_head(status, headers, None, self.conn.keep_alive))

    async def write(self, data: bytes) -> None:
        if data:
            conn = self.conn
            conn.send(b"%x\r\n%b\r\n" % (len(data), data))
            if conn.write_paused:
                await conn.drain()

    async def end(self) -> None:
        self.conn.send(b"0\r\n\r\n")


# A parsed request head waiting for its body: route, headers, where the body starts and ends, keep-alive.
_Head = tuple[Route, dict[str, str], int, int, bool]


class FrontConnection(asyncio.Protocol):
    """One client connection, until it is closed or handed to aiohttp."""

    __slots__ = ("_drain", "buf", "door", "idle_since", "keep_alive", "pending", "reading_paused", "task",
                 "transport", "write_paused")

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.transport: asyncio.Transport | None = None
        self.buf: bytes | bytearray = b""
        self.pending: _Head | None = None
        self.task: asyncio.Task[None] | None = None
        self.keep_alive = True
        self.idle_since = 0.0
        self.reading_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self.idle_since = self.door.loop.time()
        self.door.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            self.buf = data
        else:
            if isinstance(self.buf, bytes):
                self.buf = bytearray(self.buf)
            self.buf += data
        if self.task is None:
            self._next()
        elif len(self.buf) > MAX_BUFFERED and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.connections.discard(self)
        self.transport = None
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop its request and close the upstream legs
        self._wake_writer()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # ------------------------------------------------------------------ writing
    def send(self, data: bytes) -> None:
        if self.transport is not None:  # else the client is gone and the request is being cancelled
            self.transport.write(data)

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        self._drain = self.door.loop.create_future()
        await self._drain

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ------------------------------------------------------------------ requests
    def _next(self) -> None:
        """Start the next complete request in the buffer, or hand the connection to aiohttp."""
        buf = self.buf
        head = self.pending
        if head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._hand_off()
                return
            head = self._parse(buf, end)
            if head is None:
                self._hand_off()
                return
            self.pending = head
        route, headers, start, stop, keep_alive = head
        if len(buf) < stop:
            return
        body = bytes(buf[start:stop])
        self.buf = buf[stop:] if len(buf) > stop else b""
        self.pending = None
        self.keep_alive = keep_alive
        self.task = self.door.loop.create_task(self._serve(route, headers, body))

    def _parse(self, buf: bytes | bytearray, end: int) -> _Head | None:
        """The head of a plain inference request; None for anything the front door leaves to aiohttp."""
        line_end = buf.find(b"\r\n")
        parts = bytes(buf[:line_end]).split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
            return None
        route = HOT_ROUTES.get(parts[1])
        if route is None:
            return None
        block = bytes(buf[line_end + 2:end])
        if _BAD_HEAD.search(block):
            return None
        headers: dict[str, str] = {}
        for line in block.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep or not name or b" " in name or b"\t" in name:
                return None
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            if key in headers:
                if key == "content-length" or key == "host":
                    return None
                headers[key] += ", " + text
            else:
                headers[key] = text
        if "transfer-encoding" in headers or "expect" in headers or "upgrade" in headers:
            return None
        length = headers.get("content-length")
        if length is None or not (length.isascii() and length.isdigit()) or len(length) > 12:
            return None
        size = int(length)
        if size > self.door.accounting.max_payload:
            return None  # aiohttp answers 413 with the usual message
        connection = headers.get("connection")
        keep_alive = connection is None or "close" not in connection.lower()
        return route, headers, end + 4, end + 4 + size, keep_alive

    async def _serve(self, route: Route, headers: dict[str, str], body: bytes) -> None:
        door = self.door
        acc = door.accounting
        rid = acc.request_id(headers)
        structlog.contextvars.bind_contextvars(request_id=rid)  # this task's own copy of the context
        exchange = FrontExchange(self, rid, headers)
        path: str = route  # a StrEnum: its value
        started = acc.begin("POST", path)
        admission = "allowed"
        try:
            try:
                await serve_inference(door.gateway, route, body, exchange)
            except GatewayError as e:
                admission = acc.failed(e)
                self._answer_error(exchange, *error_answer(e))
            except asyncio.CancelledError:
                acc.metrics.http_active.dec()  # the client went away: no response to count
                raise
            except Exception:
                # A bug, not a user error: log it with its traceback (and request id), answer a plain 500.
                log.exception("request_crashed", method="POST", path=path)
                self._answer_error(exchange, 500, error_body("internal gateway error", "internal_error",
                                                             "internal_error"))
            acc.end("POST", path, exchange.status or 500, started, admission)
        finally:
            self._done()

    def _answer_error(self, exchange: FrontExchange, status: int, body: bytes) -> None:
        if exchange.committed:
            self.keep_alive = False  # a broken stream cannot be framed further: end the connection
            return
        exchange.respond(status, {"Content-Type": _JSON, "x-request-id": exchange.request_id}, body)

    def _done(self) -> None:
        self.task = None
        transport = self.transport
        if transport is None:
            return
        if not self.keep_alive:
            transport.close()
            return
        self.idle_since = self.door.loop.time()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        if self.buf:
            self._next()

    def _hand_off(self) -> None:
        """From now on aiohttp serves this connection, starting with the bytes not consumed yet."""
        transport = self.transport
        if transport is None:
            return
        self.door.connections.discard(self)
        self.transport = None
        proto = self.door.fallback()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        if self.reading_paused:
            transport.resume_reading()
        data, self.buf = bytes(self.buf), b""
        if data:
            proto.data_received(data)

    def close_if_idle(self, idle_before: float) -> None:
        if self.task is None and self.transport is not None and self.idle_since < idle_before:
            self.transport.close()


class FrontDoor:
    """The listening socket, its connections and their keep-alive sweep."""

    def __init__(self, gateway: Gateway, accounting: HttpAccounting,
                 fallback: Callable[[], asyncio.Protocol]) -> None:
        self.gateway = gateway
        self.accounting = accounting
        self.fallback = fallback  # makes aiohttp's protocol for a connection handed over
        self.connections: set[FrontConnection] = set()
        self.loop = asyncio.get_event_loop()
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None, *,
                    reuse_port: bool = False) -> None:
        """Listen; `reuse_port` lets other gateway processes listen on the same port (atomesh.cluster)."""
        self.loop = asyncio.get_running_loop()
        self._servers.append(await self.loop.create_server(
            lambda: FrontConnection(self), host, port, ssl=ssl_context, reuse_address=True,
            reuse_port=reuse_port or None, backlog=1024))
        self._sweeper = self.loop.create_task(self._sweep())

    async def listen_private(self) -> int:
        """Also listen on a loopback port of the kernel's choosing (for follower processes); returns it."""
        server = await self.loop.create_server(lambda: FrontConnection(self), "127.0.0.1", 0, backlog=1024)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECS)
            idle_before = self.loop.time() - KEEPALIVE_SECS
            for conn in list(self.connections):
                conn.close_if_idle(idle_before)

    async def close(self) -> None:
        """Stop listening; close every connection (in-flight requests were drained before, or are cut)."""
        for server in self._servers:
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
