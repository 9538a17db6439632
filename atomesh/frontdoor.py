"""The gateway's HTTP/1.x server: every client connection of the service and metrics ports.

One pipeline for every connection, whoever answers its requests:

- **Accepting** is the door's own loop over the listening sockets: out of file descriptors (EMFILE),
  it stops accepting for a moment (connections wait in the kernel's backlog, none is reset) and
  resumes by itself.
- **Parsing** is llhttp (httptools), strict, under fixed limits: request line and each header field
  at most 8,190 bytes (414 / 431), at most 100 headers and 64 KiB of head (431), a declared body
  over `--max-payload-size` refused from its head (413), anything that is not HTTP/1.0 or 1.1 (binary
  garbage, a TLS hello, HTTP/2, HTTP/0.9) answered 400 and closed.
- **Time**: each connection is in one phase at a time, each with its deadline: a request head must
  arrive within `--http-head-timeout-secs`, each piece of its body within `--http-body-timeout-secs`
  (408 and close after either), an idle keep-alive connection is closed after
  `--http-keepalive-timeout-secs`. One sweep per door enforces them.
- **Answering**: inference requests (`POST` to an inference route) are served here, through a
  `FrontExchange`: one socket write for a whole answer, chunked framing for a stream. Every other
  request, complete and checked, is passed to the aiohttp application on a private loopback port
  (the admin API, health, models, metrics), and its answer relayed.
- **Bodies** are kept as they arrive: the bytes of one read when the body fits in it (the usual case),
  else one buffer grown in place; never copied again on the way to a worker.
- Requests pipelined on one connection are answered in order. A client that closes its side (or only
  half-closes: the two cannot be told apart) is gone: its request is cancelled, upstream legs included.
- CONNECT and protocol upgrades are answered at once (501 / 400) and the connection closed; a request
  line without a version (HTTP/0.9) gets 400 as soon as the line ends.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import socket
import ssl
import sys
import termios
import time
from collections import deque
from collections.abc import Mapping
from email.utils import formatdate
from enum import IntEnum
from http import HTTPStatus
from typing import TYPE_CHECKING

import structlog
from httptools import HttpParserCallbackError, HttpParserError, HttpParserUpgrade, HttpRequestParser, parse_url

from atomesh.api.middleware import CLIENT_GONE, HttpAccounting, error_answer
from atomesh.api.openai import serve_inference
from atomesh.cors import Cors
from atomesh.errors import GatewayError, error_body
from atomesh.flow import FlowControl
from atomesh.logs import context_setter
from atomesh.request import Route
from atomesh.transport import NOT_RELAYED, Exchange, Upstream

if TYPE_CHECKING:
    from atomesh.gateway import Gateway

log = structlog.get_logger("atomesh.api")

HOT_ROUTES: dict[bytes, Route] = {r.value.encode(): r for r in Route}
MAX_LINE = 8190  # request line (URL) bytes, as aiohttp's default
MAX_FIELD = 8190  # bytes of one header name or value
MAX_HEADERS = 100
MAX_HEAD = 64 * 1024  # bytes of one request head
MAX_BUFFERED = 1 << 20  # pipelined request bytes held while a request is served; beyond this, reading pauses
MAX_QUEUED = 64  # pipelined requests held while one is served; beyond this, reading pauses
LINGER_SECS = 1.0  # after an error answer, how long the client's further bytes are read and dropped
ACCEPT_BATCH = 64  # connections accepted per readiness event of a listening socket
ACCEPT_BACKOFF = (0.05, 1.0)  # first and longest pause of accepting when out of file descriptors

# Response headers of one hop, never relayed from the aiohttp application.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "date",
        "server",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "expect",
        "host",
    }
)
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_JSON = "application/json"
PREFLIGHT = "cors_preflight"  # the route label of CORS preflights the door answers itself
# The size line of a chunk of n bytes, for the usual sizes of a streamed event (cheaper than formatting it).
_TABLED_CHUNK = 4096  # chunks shorter than this take their size line from the table
_CHUNK_HEADS = tuple(b"%x\r\n" % n for n in range(_TABLED_CHUNK))
_ERROR_TYPES = {
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    417: "invalid_request_error",
    431: "invalid_request_error",
}


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


def response_head(
    status: int, headers: Mapping[str, str], length: int | None, keep_alive: bool, chunked: bool = True
) -> bytes:
    """Status line and headers; `length` None means a streamed body (chunked unless told otherwise: then
    it ends with the connection)."""
    parts = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"]
    for k, v in headers.items():
        parts.append(f"{k}: {v}\r\n")
    if length is not None:
        parts.append(f"Content-Length: {length}\r\n")
    elif chunked:
        parts.append("Transfer-Encoding: chunked\r\n")
    parts.append(f"Date: {_Clock.date()}\r\n")
    if not keep_alive:
        parts.append("Connection: close\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1", "replace")


class Refused(Exception):
    """A request the door answers itself with an error status, then closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Phase(IntEnum):
    IDLE = 0  # between requests (keep-alive)
    HEAD = 1  # a request head is arriving
    BODY = 2  # a request body is arriving


class FrontExchange(Exchange):
    """An Exchange writing straight to the client's connection."""

    __slots__ = ("conn", "cors", "framed", "sse")

    def __init__(self, conn: FrontConnection, request_id: str, headers: Mapping[str, str], framed: bool) -> None:
        super().__init__(request_id, headers)
        self.conn = conn
        self.framed = framed  # chunked framing for streams (HTTP/1.1); HTTP/1.0 gets the raw bytes and a close
        self.sse = False  # the stream started is server-sent events (an error can be told in-band)
        cors = conn.door.cors
        self.cors = cors.headers(headers) if cors is not None else None  # added to the answer (an allowed origin)

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        if self.cors:
            headers = {**headers, **self.cors}
        self.status, self.body = status, body
        self.sent = len(body)
        self.conn.send(response_head(status, headers, len(body), self.conn.keep_alive) + body)

    def respond_relayed(self, status: int, upstream: Mapping[str, str], body: bytes) -> None:
        if self.cors:
            self.respond(status, self.response_headers(upstream), body)
            return
        # What respond(status, self.response_headers(upstream), body) sends, rendered in one pass.
        self.status, self.body = status, body
        self.sent = len(body)
        conn = self.conn
        parts = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"]
        for k, v in upstream.items():
            if k not in NOT_RELAYED:
                parts.append(f"{k}: {v}\r\n")
        parts.append(f"x-request-id: {self.request_id}\r\nContent-Length: {len(body)}\r\nDate: {_Clock.date()}\r\n")
        parts.append("\r\n" if conn.keep_alive else "Connection: close\r\n\r\n")
        conn.send("".join(parts).encode("latin-1", "replace") + body)

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        if self.cors:
            headers = {**headers, **self.cors}
        self.status = status
        self.committed = True
        ctype = headers.get("content-type")  # as relay() names it
        if ctype is None:
            ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        self.sse = ctype.startswith("text/event-stream")
        if not self.framed:
            self.conn.keep_alive = False  # the end of the body is the end of the connection
        self.conn.send(response_head(status, headers, None, self.conn.keep_alive, self.framed))

    async def write(self, data: bytes) -> None:
        if data:
            self.sent += len(data)
            conn = self.conn
            conn.send(b"%x\r\n%b\r\n" % (len(data), data) if self.framed else data)
            if conn.write_paused:
                await conn.drain_within(conn.door.body_timeout)

    direct = True

    def push(self, data: bytes) -> bool:
        n = len(data)
        if n:
            self.sent += n
            conn = self.conn
            transport = conn.transport  # conn.send, inlined: this runs once per streamed event
            if transport is not None:  # else the client is gone and the request is being cancelled
                if not self.framed:
                    transport.write(data)
                elif n < _TABLED_CHUNK:
                    transport.write(_CHUNK_HEADS[n] + data + b"\r\n")
                else:
                    transport.write(b"%x\r\n%b\r\n" % (n, data))
            return not conn.write_paused
        return True

    async def writable(self) -> None:
        conn = self.conn
        if conn.write_paused:
            await conn.drain_within(conn.door.body_timeout)

    def splice_fd(self) -> int:
        conn = self.conn
        transport = conn.transport
        if not self.framed or self.trace is not None or transport is None or conn.write_paused:
            return -1
        if transport.get_write_buffer_size() or transport.get_extra_info("ssl_object") is not None:
            return -1
        sock = transport.get_extra_info("socket")
        return -1 if sock is None else int(sock.fileno())

    def spill(self, data: bytes) -> bool:
        conn = self.conn
        conn.send(data)
        return not conn.write_paused

    def client_gone(self) -> None:
        transport = self.conn.transport
        if transport is not None:
            transport.abort()  # connection_lost follows: the request is cancelled

    async def end(self) -> None:
        if self.framed:
            self.conn.send(b"0\r\n\r\n")

    def cut(self, message: str) -> None:
        """End a started event stream now with an error event and [DONE] (the gateway is stopping)."""
        event = b"data: " + error_body(message, "server_error", "gateway_shutting_down") + b"\n\ndata: [DONE]\n\n"
        self.conn.send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event) if self.framed else event)


class _Request:
    """A complete request read from a connection; `refusal` set: answered with that error, then closed."""

    __slots__ = ("body", "headers", "http10", "keep_alive", "method", "refusal", "target")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: dict[str, str],
        body: bytes | bytearray,
        keep_alive: bool,
        http10: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        self.refusal: Refused | None = None


class FrontConnection(FlowControl):
    """One client connection: its parser, its phase and deadline, the requests read and the one served."""

    __slots__ = (
        "body",
        "cut",
        "deadline",
        "door",
        "head_bytes",
        "head_size",
        "headers",
        "keep_alive",
        "lingering",
        "parser",
        "phase",
        "queue",
        "queued_bytes",
        "task",
        "url",
        "url_open",
        "url_piece",
    )

    def __init__(self, door: FrontDoor) -> None:
        super().__init__()
        self.door = door
        self.parser = HttpRequestParser(self)
        self.phase = Phase.HEAD  # a new connection owes its first request head within the head timeout
        self.deadline = door.loop.time() + door.head_timeout
        self.url = b""
        self.url_piece = b""  # the target's bytes the current read delivered (HTTP/0.9 detection)
        self.url_open = False  # the last read ended inside the target
        self.headers: dict[str, str] = {}
        self.head_bytes = 0  # bytes received while a head was arriving (bounds what the parser buffers)
        self.head_size = 0  # bytes of the current head's target and headers
        self.body: bytes | bytearray = b""
        self.queue: deque[_Request] = deque()
        self.queued_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self.cut: str | None = None  # why the request being served is cancelled by the gateway itself
        self.keep_alive = True
        self.lingering = False  # refused: reading and discarding until closed

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self.door.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if self.phase is not Phase.BODY:
            self.head_bytes += len(data)
        self.url_piece = b""
        try:
            self.parser.feed_data(data)
        except HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, Refused):
                self.refuse(cause.status, cause.message)
            else:
                raise
            return
        except HttpParserUpgrade:
            # A protocol switch (WebSocket, h2c) or CONNECT is not offered. The parser completed that
            # request (the last queued): it is answered with an error in its turn, after the requests
            # pipelined before it, and the connection ends there. Nothing after it is read.
            self.hold_reading()
            if self.queue:
                req = self.queue[-1]
                req.keep_alive = False
                req.refusal = (
                    Refused(501, "CONNECT is not supported: the gateway is not a proxy")
                    if req.method == b"CONNECT"
                    else Refused(
                        400, f"protocol upgrades (Upgrade: {req.headers.get('upgrade', '')[:64]}) are not supported"
                    )
                )
                if self.task is None:
                    self._next()
            else:
                self.refuse(400, "protocol upgrades and CONNECT are not supported")
            return
        except HttpParserError as e:
            self.refuse(400, f"malformed HTTP/1.1 request: {e}")
            return
        if self.phase is Phase.HEAD and self.head_bytes > MAX_HEAD:
            self.refuse(431, f"request head is larger than {MAX_HEAD} bytes")
            return
        if self.phase is Phase.HEAD and self.url and not self.headers and self._versionless_line(data):
            self.refuse(400, "HTTP/0.9 is not served (the request line names no version); use HTTP/1.1")
            return
        if self.task is None:
            if self.queue:
                self._next()
        elif self.queued_bytes > MAX_BUFFERED or len(self.queue) >= MAX_QUEUED:
            self.hold_reading()

    def eof_received(self) -> bool:
        """The client closed its side: it is gone, whatever it was waiting for (hyper's default, as SMG).

        A client that merely half-closes cannot be told apart from one that closed and left, and
        keeping a request running for a client that left burns a whole generation on a worker. So the
        connection closes, which cancels the request being served (and its upstream legs)."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.connections.discard(self)
        self.transport = None
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop its request and close the upstream legs
        self.connection_ended()
        # The parser holds our callbacks and we hold it: a reference cycle that only the collector would
        # free. Nothing is parsed after this, so the parser goes now (reference counting frees both).
        del self.parser

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        if self.phase is Phase.IDLE:
            self.phase = Phase.HEAD
            self.deadline = self.door.loop.time() + self.door.head_timeout
        self.url = b""
        self.headers = {}
        self.head_size = 0
        self.body = b""

    def on_url(self, piece: bytes) -> None:
        self.url_piece = piece
        url = self.url = self.url + piece if self.url else piece
        self.head_size += len(piece)
        if len(url) > MAX_LINE:
            raise Refused(414, f"request target is longer than {MAX_LINE} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        n, v = len(name), len(value)
        if n > MAX_FIELD or v > MAX_FIELD:
            raise Refused(431, f"a request header is longer than {MAX_FIELD} bytes")
        headers = self.headers
        if len(headers) >= MAX_HEADERS:
            raise Refused(431, f"a request carries more than {MAX_HEADERS} headers")
        self.head_size += n + v + 4
        if self.head_size > MAX_HEAD:
            raise Refused(431, f"request head is larger than {MAX_HEAD} bytes")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in headers:
            if key == "host":
                raise Refused(400, "a request carries two Host headers")
            headers[key] += ", " + text
        else:
            headers[key] = text

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            raise Refused(400, f"HTTP/{version} is not served; use HTTP/1.1")
        self.head_bytes = 0
        headers = self.headers
        length = headers.get("content-length")
        door = self.door
        if length is not None and int(length) > door.max_payload:
            raise Refused(413, door.too_large)
        if (length is not None and length != "0") or "transfer-encoding" in headers:
            self.phase = Phase.BODY
            self.deadline = door.loop.time() + door.body_timeout
            expect = headers.get("expect")
            if expect is not None:
                if expect.lower() != "100-continue":
                    raise Refused(417, f"Expect: {expect} is not supported")
                if self.transport is not None:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, piece: bytes) -> None:
        body = self.body
        if not body:
            self.body = piece  # the whole body in one read: kept as it is
        else:
            if isinstance(body, bytes):
                body = self.body = bytearray(body)
            body += piece  # grows in place (large blocks are remapped, not copied)
        if len(self.body) > self.door.max_payload:
            raise Refused(413, self.door.too_large)
        self.deadline = self.door.loop.time() + self.door.body_timeout

    def on_message_complete(self) -> None:
        parser = self.parser
        req = _Request(
            parser.get_method(),
            self.url,
            self.headers,
            self.body,
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
        )
        self.queue.append(req)
        self.queued_bytes += len(req.body)
        self.phase = Phase.IDLE
        self.deadline = self.door.loop.time() + self.door.keepalive_timeout
        self.body = b""

    async def drain_within(self, timeout: float) -> None:
        """`drain()`, but a client that takes nothing of its answer for `timeout` seconds is cut off: a
        reader that stalls must not hold its request (and a worker's generation) with no deadline."""
        try:
            await asyncio.wait_for(self.drain(), timeout)
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()  # connection_lost follows: the request is cancelled
            raise ConnectionResetError(f"the client read nothing for {timeout:g}s") from None

    def _versionless_line(self, data: bytes) -> bool:
        """Whether the request line being read ended (CR or LF) right after its target: HTTP/0.9.

        llhttp would wait for a blank line to call it 0.9 (and a client of 0.9 never sends one)."""
        if self.parser.get_http_version() != "0.0":
            return False  # "HTTP/x.y" was read
        piece = self.url_piece
        if piece:
            end = data.rfind(piece) + len(piece)
            self.url_open = end == len(data)
            return data[end : end + 1] in (b"\r", b"\n")
        ended = self.url_open and data[:1] in (b"\r", b"\n")
        self.url_open = False
        return ended

    # ------------------------------------------------------------------ writing
    def send(self, data: bytes) -> None:
        if self.transport is not None:  # else the client is gone and the request is being cancelled
            self.transport.write(data)

    def refuse(self, status: int, message: str) -> None:
        """Answer an error the door found itself (the head or body at fault), then close."""
        transport = self.transport
        self.queue.clear()
        if transport is None or self.task is not None:
            # A request is being answered on this connection: its answer must not be cut in two.
            self.keep_alive = False
            self.hold_reading()
            return
        code = "request_timeout" if status == 408 else HTTPStatus(status).phrase.lower().replace(" ", "_")
        body = error_body(message, _ERROR_TYPES.get(status, "invalid_request_error"), code)
        headers = {"Content-Type": _JSON}
        rid = self.headers.get("x-request-id")
        if rid is not None:
            headers["x-request-id"] = rid
        transport.write(response_head(status, headers, len(body), False) + body)
        self.door.accounting.refused(status, rid, self.url, len(body))
        # Close gently: stop writing, and read (discarding) what the client still sends for a moment,
        # so that its further bytes do not make the kernel reset the connection before it has read this.
        self.lingering = True
        self.transport = None
        self.door.connections.discard(self)
        if transport.can_write_eof():
            transport.write_eof()
            self.door.loop.call_later(LINGER_SECS, transport.close)
        else:
            transport.close()

    # ------------------------------------------------------------------ requests
    def _next(self) -> None:
        req = self.queue.popleft()
        self.queued_bytes -= len(req.body)
        if req.refusal is not None:
            self.refuse(req.refusal.status, req.refusal.message)
            return
        self.keep_alive = req.keep_alive
        route = HOT_ROUTES.get(req.target) if req.method == b"POST" and self.door.hot else None
        loop = self.door.loop
        if route is not None:
            self.task = loop.create_task(self._serve(route, req))
        else:
            self.task = loop.create_task(self._relay(req))

    async def _serve(self, route: Route, req: _Request) -> None:
        door = self.door
        acc = door.accounting
        headers = req.headers
        rid = acc.request_id(headers)
        door.bind_request_id(rid)  # into this task's own copy of the context, for every log line it writes
        exchange = FrontExchange(self, rid, headers, not req.http10)
        path: str = route  # a StrEnum: its value
        started = acc.begin("POST", path)
        admission = "allowed"
        try:
            try:
                await serve_inference(door.gateway, route, req.body, exchange)
            except GatewayError as e:
                admission = acc.failed(e)
                self._answer_error(exchange, *error_answer(e))
            except asyncio.CancelledError:
                if self.cut is not None and exchange.committed and exchange.sse:
                    exchange.cut(self.cut)  # stopped by the gateway: the client learns why, in-band
                # The client went away: what it got (a started stream's status, else 499) is still counted.
                status = exchange.status if exchange.committed and exchange.status else CLIENT_GONE
                acc.end("POST", path, status, started, None, rid, exchange.workers, exchange.sent)
                # Not re-raised: a task that ends cancelled keeps the CancelledError, whose traceback holds
                # every frame of the request, and those frames hold the task (router locals): a cycle per
                # dropped request, left to the collector. Ending normally frees it all by reference counting.
                return
            except Exception:
                # A bug, not a user error: log it with its traceback (and request id), answer a plain 500.
                log.exception("request_crashed", method="POST", path=path)
                self._answer_error(
                    exchange, 500, error_body("internal gateway error", "internal_error", "internal_error")
                )
            acc.end("POST", path, exchange.status or 500, started, admission, rid, exchange.workers, exchange.sent)
        finally:
            self._done()

    async def _relay(self, req: _Request) -> None:
        """Any other request: answered by the aiohttp application behind the door (a CORS preflight
        here)."""
        cors = self.door.cors
        try:
            if cors is not None:
                allowed = cors.preflight(req.method, req.headers)
                if allowed is not None:
                    acc = self.door.accounting
                    started = acc.begin("OPTIONS", PREFLIGHT)
                    self.send(response_head(204, allowed, 0, self.keep_alive))
                    acc.end(
                        "OPTIONS",
                        PREFLIGHT,
                        204,
                        started,
                        None,
                        acc.request_id(req.headers),
                        target=req.target.decode("latin-1").partition("?")[0][:512],
                    )
                    return
            try:
                status, headers, body = await self.door.relay_request(req)
            except GatewayError as e:
                status, body = error_answer(e)
                headers = {"Content-Type": _JSON}
            if cors is not None:
                headers.update(cors.headers(req.headers))
            if req.method == b"HEAD":
                self.send(response_head(status, headers, int(headers.pop("content-length", 0) or 0), self.keep_alive))
            else:
                headers.pop("content-length", None)
                self.send(response_head(status, headers, len(body), self.keep_alive) + body)
        except asyncio.CancelledError:
            return  # the client is gone; not re-raised, for the reason given in _serve
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
        if self.queue:
            self._next()
            return
        loop = self.door.loop
        # The deadline of the phase the parser is in starts now (it was on hold while serving).
        door = self.door
        self.deadline = loop.time() + (
            door.keepalive_timeout
            if self.phase is Phase.IDLE
            else door.head_timeout
            if self.phase is Phase.HEAD
            else door.body_timeout
        )
        self.release_reading()

    def expire(self, now: float) -> None:
        """The sweep: end the connection if its phase's deadline passed (never while serving).

        Not while bytes wait unread in its socket: they arrived before this sweep, which may run before the
        loop polls the sockets (uvloop runs its timers first in each turn, so after a turn that took long,
        what came meanwhile is not read yet). The next poll reads them and the deadline moves on."""
        if self.task is not None or self.queue or self.transport is None or now < self.deadline:
            return
        if _unread(self.transport):
            return
        if self.phase is Phase.IDLE:
            self.transport.close()
            self.transport = None
            self.door.connections.discard(self)
        elif self.phase is Phase.HEAD and self.head_bytes == 0 and not self.headers and not self.url:
            self.transport.close()  # nothing of a request arrived: nobody to answer
            self.transport = None
            self.door.connections.discard(self)
        else:
            what = "request head" if self.phase is Phase.HEAD else "request body"
            timeout = self.door.head_timeout if self.phase is Phase.HEAD else self.door.body_timeout
            self.refuse(408, f"the {what} did not arrive within {timeout:g}s")


def _unread(transport: asyncio.Transport) -> int:
    """Bytes received on the transport's socket and not read yet (0 when that cannot be told)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except (OSError, ValueError):
        return 0


class Relay:
    """Passes a request the door does not serve itself to the aiohttp application on a loopback port."""

    def __init__(self, upstream: Upstream, port: int, timeout: float) -> None:
        self.upstream = upstream
        self.base = f"http://127.0.0.1:{port}"
        self.timeout = timeout

    async def __call__(self, req: _Request) -> tuple[int, dict[str, str], bytes]:
        target = req.target
        if not target.startswith(b"/"):  # absolute form: keep the path and query
            parts = parse_url(target)
            target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
        headers = {k: v for k, v in req.headers.items() if k not in _HOP_BY_HOP}
        body = req.body if req.body or req.method in (b"POST", b"PUT", b"PATCH") else None
        async with self.upstream.open(
            req.method.decode(), self.base + target.decode("latin-1"), data=body, headers=headers, timeout=self.timeout
        ) as resp:
            data = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k not in _HOP_BY_HOP or k == "content-length"}
            return resp.status, out, data


class _Listener:
    """One listening socket, accepted from the event loop; paused for a while when out of descriptors."""

    def __init__(self, door: FrontDoor, sock: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        self.door = door
        self.sock = sock
        self.ssl = ssl_context
        self.delay = ACCEPT_BACKOFF[0]
        self.paused: asyncio.TimerHandle | None = None
        self.closed = False

    def start(self) -> None:
        self.paused = None
        if not self.closed:
            self.door.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        self.closed = True
        if self.paused is not None:
            self.paused.cancel()
        else:
            self.door.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._back_off(e)
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that client gave up already
                raise
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.door.adopt(conn, self.ssl)
        self.delay = ACCEPT_BACKOFF[0]

    def _back_off(self, err: OSError) -> None:
        """Out of descriptors: leave new connections in the backlog until some are freed."""
        loop = self.door.loop
        loop.remove_reader(self.sock.fileno())
        log.warning(
            "accept_paused", reason=err.strerror, connections=len(self.door.connections), retry_in_secs=self.delay
        )
        self.paused = loop.call_later(self.delay, self.start)
        self.delay = min(self.delay * 2, ACCEPT_BACKOFF[1])


def _bind(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (as asyncio's create_server binds)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(1024)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class FrontDoor:
    """The listening sockets of one port, its connections and the sweep that times them out.

    With a `gateway`, inference requests are served here; everything else goes to `relay`.
    """

    def __init__(self, gateway: Gateway, accounting: HttpAccounting, *, hot: bool = True) -> None:
        cfg = gateway.config
        self.gateway = gateway
        self.accounting = accounting
        self.hot = hot
        self.max_payload = cfg.max_payload_size if hot else 1 << 20
        self.too_large = f"request body is larger than the {self.max_payload} bytes allowed (--max-payload-size)"
        self.head_timeout = cfg.http_head_timeout_secs
        self.body_timeout = cfg.http_body_timeout_secs
        self.keepalive_timeout = cfg.http_keepalive_timeout_secs
        self.relay: Relay | None = None  # set before listening
        self.bind_request_id = context_setter("request_id")
        self.cors = Cors(cfg.cors_allowed_origins) if cfg.cors_allowed_origins and hot else None
        self.connections: set[FrontConnection] = set()
        self.loop = asyncio.get_event_loop()
        self._listeners: list[_Listener] = []
        # The sweep is a timer callback, not a task: one call a round, no coroutine to resume (it runs every
        # second on every door, while the gateway serves).
        self._sweep_every = min(1.0, self.head_timeout / 4, self.body_timeout / 4, self.keepalive_timeout / 4)
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None, *, reuse_port: bool = False
    ) -> None:
        """Listen; `reuse_port` lets other gateway processes listen on the same port (atomesh.cluster)."""
        self.loop = asyncio.get_running_loop()
        for sock in _bind(host, port, reuse_port):
            listener = _Listener(self, sock, ssl_context)
            self._listeners.append(listener)
            listener.start()
        self.port = self._listeners[0].sock.getsockname()[1]
        if self._sweep_every > 0:
            self._sweep_timer = self.loop.call_at(self.loop.time() + self._sweep_every, self._sweep)

    def adopt(self, conn: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        """Serve an accepted socket (the TLS handshake, when any, is bounded by the head timeout)."""
        task = self.loop.create_task(self._adopt(conn, ssl_context))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _adopt(self, conn: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        try:
            if ssl_context is None:
                await self.loop.connect_accepted_socket(lambda: FrontConnection(self), conn)
            else:
                await self.loop.connect_accepted_socket(
                    lambda: FrontConnection(self), conn, ssl=ssl_context, ssl_handshake_timeout=self.head_timeout
                )
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
            conn.close()

    async def relay_request(self, req: _Request) -> tuple[int, dict[str, str], bytes]:
        assert self.relay is not None, "a relay is set before the door listens"
        return await self.relay(req)

    def _sweep(self) -> None:
        now = self.loop.time()
        self._sweep_timer = self.loop.call_at(now + self._sweep_every, self._sweep)  # first: a failing round
        for conn in list(self.connections):  # does not end the sweeps (the loop's handler logs its error)
            conn.expire(now)

    async def close(self) -> None:
        """Stop listening; close every connection (in-flight requests were drained before, or are cut)."""
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for task in list(self._handshakes):
            task.cancel()
        cut = []
        for conn in list(self.connections):
            if conn.task is not None:
                conn.cut = "the gateway is shutting down: --shutdown-grace-period-secs ended before this stream did"
                conn.task.cancel()
                cut.append(conn.task)
        if cut:  # each writes its stream's error event as it ends, before the connection closes
            await asyncio.wait(cut, timeout=1.0)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
