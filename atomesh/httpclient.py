"""A lean asyncio HTTP/1.1 client with a keep-alive pool, for the gateway's calls to workers.

aiohttp's client spends tens of microseconds of CPU per request on features the gateway never uses
(cookies, redirects, tracing, middlewares, multi-layer stream readers). Here one `asyncio.Protocol`
per connection feeds `httptools` directly, a request is one `transport.write`, a waiting coroutine
awaits one bare Future, and a request's deadline is one `loop.call_at` timer that aborts the connection.

State for the exchange in flight lives on the connection (`_Conn`): the parser's callbacks fill it and
wake the waiter; `Response` is a thin handle over it that hands the connection back to the pool.
A streamed body can also be handed on from the parser's own callback (`Response.pipe`): each piece
goes to its consumer as it is parsed, and the waiting coroutine wakes once, at the end, instead of
once per piece through every coroutine awaiting it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from atomesh import splice
from atomesh.flow import FlowControl
from atomesh.tasks import PeriodicTask

__all__ = [
    "ClientPool",
    "ConnectFailed",
    "DeadlineExceeded",
    "Disconnected",
    "HTTPClientError",
    "ProtocolViolation",
    "Response",
]

# Buffered unread body above which the socket stops being read (the worker then waits on TCP).
_HIGH_WATER = 1 << 20
_DEFAULT_PORTS = {"http": 80, "https": 443}
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})
_OWN_HEADERS = _FRAMING_HEADERS | {"host"}  # written by the client from the URL and body
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_SEPARATE_BODY = 64 * 1024  # a larger request body is written on its own, not joined to the head

_Key = tuple[str, str, int]  # (scheme, host, port): one idle list per key
# Takes one piece of a piped body; False when its consumer can take no more for now (see Response.pipe).
Sink = Callable[[bytes], bool]
# Sees each piece of a piped body before its sink takes it (a meter reading the stream on its way).
Tap = Callable[[bytes], None]


class HTTPClientError(Exception):
    """Base of every failure this client reports; `message` says what happened."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConnectFailed(HTTPClientError):
    """No connection could be opened (refused, unresolvable, unreachable, connect timeout, TLS)."""


class Disconnected(HTTPClientError):
    """The peer closed or reset the connection before the response was complete."""


class ProtocolViolation(HTTPClientError):
    """The peer sent something that is not valid HTTP/1.x."""


class DeadlineExceeded(HTTPClientError):
    """The request's timeout elapsed (while connecting, waiting for the head or reading the body)."""


class _Conn(FlowControl):
    """One connection, and the state of the exchange running on it (reset by `start`)."""

    __slots__ = (
        "_loop",
        "_parser",
        "_pool",
        "_waiter",
        "body_done",
        "buffered",
        "busy",
        "closed",
        "error",
        "got_data",
        "head_done",
        "head_read",
        "headers",
        "idle_since",
        "interim",
        "is_head",
        "keep_alive",
        "key",
        "pieces",
        "pooled",
        "sink",
        "sink_error",
        "status",
        "tap",
    )

    def __init__(self, pool: ClientPool, key: _Key) -> None:
        super().__init__()
        self._pool = pool
        self.key = key
        self._loop = asyncio.get_running_loop()
        self._parser = HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.busy = self.closed = self.pooled = False
        self.idle_since = 0.0
        self._reset(False)

    def _reset(self, is_head: bool) -> None:
        self.is_head = is_head
        self.head_done = self.body_done = self.got_data = self.keep_alive = self.interim = False
        self.error: HTTPClientError | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.sink: Sink | None = None  # set while Response.pipe waits: body pieces go there, not to `pieces`
        self.tap: Tap | None = None  # sees each piece before the sink (Response.pipe's `tap`)
        self.sink_error: Exception | None = None  # what the sink raised, for the coroutine to raise
        # The read that completed the head, while no read came after it (a native relay starts from what
        # follows the head in it: the parser's place in a chunked body is not readable), else None.
        self.head_read: bytes | None = None

    # --- driven by the pool and the response ---

    def start(self, data: bytes, tail: bytes | bytearray | None, is_head: bool) -> None:
        """Begin an exchange: reset its state and send the request (a large body as a second write,
        so that it is never copied into one buffer with the head)."""
        self._reset(is_head)
        self.busy = True
        assert self.transport is not None
        self.transport.write(data)
        if tail is not None:
            self.transport.write(tail)

    def wait(self) -> asyncio.Future[None]:
        """A future to await until the parser or the connection has news; callers re-check state after.

        A plain future rather than a coroutine: one object less per wait on the hot path.
        """
        self._waiter = waiter = self._loop.create_future()
        return waiter

    def take(self) -> list[bytes]:
        """All body pieces received so far; reading resumes if it was paused for them."""
        pieces = self.pieces
        self.pieces = []
        self.buffered = 0
        if self.reading_paused:
            self.release_reading()
        return pieces

    def fail(self, exc: HTTPClientError) -> None:
        """Record the exchange's first error and wake the waiter; the first cause wins."""
        if self.error is None:
            self.error = exc
        self._wake()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def expire(self, timeout: float) -> None:
        """The request's deadline timer: abort unless the response is already complete."""
        if self.busy and not self.body_done:
            self.fail(DeadlineExceeded(f"no complete response within {timeout:g}s"))
            self.abort()

    def reusable(self) -> bool:
        return self.body_done and self.keep_alive and self.error is None and not self.closed

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pool._conns.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection's framing can no longer be trusted
            self.abort()
            return
        self.got_data = True
        try:
            if self.head_done:
                self.head_read = None
                self._parser.feed_data(data)
            else:
                self._parser.feed_data(data)
                if self.head_done:
                    self.head_read = data
        except (HttpParserError, HttpParserUpgrade) as e:
            if not self.body_done:
                self.fail(ProtocolViolation(f"invalid HTTP response: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connection_ended()
        self._pool._forget(self)
        # The parser holds our callbacks and we hold it: break that cycle now that nothing more is parsed.
        del self._parser
        if not self.busy or self.body_done:
            return
        if self.head_done and exc is None and _FRAMING_HEADERS.isdisjoint(self.headers):
            self.body_done = True  # a body without length or chunking ends when the peer closes
            self._wake()
        elif exc is None:
            self.fail(Disconnected("connection closed by peer"))
        else:
            self.fail(Disconnected(f"connection lost: {exc}"))

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.body_done:  # a second response to one request: stop parsing, data_received closes
            raise ProtocolViolation("more than one response to a request")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self.headers.get(key)
        self.headers[key] = text if old is None else old + ", " + text

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): wait for the real one
            self.interim = True
            self.headers = {}
            return
        self.status = status
        self.head_done = True
        if self.is_head:  # the parser would wait for a body that never comes: end here, never reuse
            self.body_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            try:
                tap = self.tap
                if tap is not None:
                    tap(body)
                if sink(body):
                    return  # handed on; the waiting coroutine sleeps on
            except Exception as e:  # the consumer's failure: raised by the coroutine that set the sink
                self.sink_error = e
            self.sink = None  # the consumer is paused (or failed): later pieces wait in `pieces`
            self._wake()
            return
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.reading_paused:
            self.hold_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.body_done:
            return
        self.body_done = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()


def _after_head(data: bytes) -> bytes | None:
    """What follows the response head in `data`, the read that completed it, when the head began in that
    read too and no interim (1xx) answer came before it; else None (where the body began is not known)."""
    if not data.startswith(b"HTTP/1.") or data[9:10] == b"1":
        return None
    end = data.find(b"\r\n\r\n")
    return None if end < 0 else data[end + 4 :]


class SpliceClient(Protocol):
    """The client side of a spliced stream (`Response.splice`)."""

    sent: int  # body bytes given to the client (the splice adds its own)

    def spill(self, data: bytes) -> bool:
        """Send framed bytes through the client's transport (it was slow to take them); False: it is
        write-paused, `writable()` is awaited before more."""
        ...

    async def writable(self) -> None:
        """Return once the client takes more."""
        ...

    def client_gone(self) -> None:
        """Sending failed: close the client's connection (the request is then cancelled)."""
        ...


class SpliceMeter(Protocol):
    """A token meter a spliced stream reports to once, at its end, instead of feeding it every piece."""

    def counted(self, first_at: float | None, events: int, last_at: float, end: bytes, tail: bytes) -> None:
        """Take what the native relay read of the stream by the meter's own rules."""
        ...


class Response:
    """A response whose status and headers are in; the body is read with `read()` or `chunks()`."""

    __slots__ = ("_conn", "_pool", "_timer", "content_type", "headers", "status")

    def __init__(self, pool: ClientPool, conn: _Conn, timer: asyncio.TimerHandle) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self._timer = timer
        self.status = conn.status
        self.headers = conn.headers
        ctype = conn.headers.get("content-type")
        self.content_type = "" if ctype is None else ctype.partition(";")[0].strip().lower()

    def _open(self) -> _Conn:
        if self._conn is None:
            raise HTTPClientError("response already released")
        return self._conn

    def read_now(self) -> bytes | None:
        """The whole body if it is all in already (then the connection goes back to the pool), else None:
        `read()` it. A small answer usually arrives with its head: no coroutine to run for it."""
        conn = self._conn
        if conn is None or not conn.body_done or conn.error is not None:
            return None
        got = conn.take()
        self.release()
        return got[0] if len(got) == 1 else b"".join(got)

    async def read(self) -> bytes:
        """The whole body, de-chunked; the connection then goes back to the pool if it can."""
        conn = self._open()
        got: list[bytes] = []
        try:
            while True:
                if conn.pieces:
                    got += conn.take()
                if conn.body_done:
                    break
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            self.close()
            raise
        self.release()
        return got[0] if len(got) == 1 else b"".join(got)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each item is everything received since the previous one.

        The connection is released when the body ends; a caller that stops early must `close()`.
        """
        conn = self._open()
        try:
            while True:
                if conn.pieces:
                    pieces = conn.take()
                    yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                elif conn.body_done:
                    break
                elif conn.error is not None:
                    raise conn.error
                else:
                    await conn.wait()
        except BaseException:
            self.close()
            raise
        self.release()

    async def pipe(self, sink: Sink, writable: Callable[[], Awaitable[None]], tap: Tap | None = None) -> None:
        """Hand the body to `sink` piece by piece, from the connection's own parser callback; return when it
        has all been handed on (the connection then goes back to the pool) or raise the failure. `tap`, if
        given, sees each piece just before `sink` (one call from the parser instead of a wrapper around both).

        `sink` returns False when its consumer can take no more for now: `writable()` is awaited before the
        next piece, which waits in the connection's buffer meanwhile (reading pauses past the high-water
        mark). An exception raised by `sink` is raised here. Like `chunks()`, a caller that stops early
        (cancelled) leaves the connection closed.
        """
        conn = self._open()
        try:
            ready = True
            while True:
                if not ready:
                    await writable()
                    ready = True
                if conn.pieces:
                    pieces = conn.take()
                    piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                    if tap is not None:
                        tap(piece)
                    ready = sink(piece)
                    continue
                if conn.body_done:
                    break
                if conn.error is not None:
                    raise conn.error
                conn.sink, conn.tap = sink, tap
                try:
                    await conn.wait()
                finally:
                    ready = conn.sink is not None  # detached by on_body: the consumer paused or failed
                    conn.sink = conn.tap = None
                err = conn.sink_error
                if err is not None:
                    conn.sink_error = None
                    raise err
        except BaseException:
            self.close()
            raise
        self.release()

    def can_splice(self) -> bool:
        """Whether `splice` can take this body: a chunked body over plain TCP not read into yet, with the
        native relay built."""
        conn = self._conn
        return (
            conn is not None
            and conn.head_read is not None
            and not conn.body_done
            and conn.error is None
            and self._pool.splice is not None
            and conn.key[0] == "http"
            and conn.transport is not None
            and self.headers.get("transfer-encoding") == "chunked"
            and "content-length" not in self.headers
            and _after_head(conn.head_read) is not None
        )

    async def splice(self, client_fd: int, client: SpliceClient, meter: SpliceMeter | None) -> None:
        """Relay the chunked body to the client's socket (`client_fd`, written directly: its transport must
        have nothing buffered) in C, one call per read of the worker's socket, each piece framed as its own
        chunk; return when the body has all been relayed (the connection then goes back to the pool) or raise
        the failure, as `pipe` does. Check `can_splice()` first."""
        conn = self._open()
        transport = conn.transport
        kind = self._pool.splice
        raw = None if conn.head_read is None else _after_head(conn.head_read)
        assert transport is not None and kind is not None and raw is not None
        loop = conn._loop
        keep_alive = conn._parser.should_keep_alive()
        wfd = os.dup(transport.get_extra_info("socket").fileno())
        try:
            cfd = os.dup(client_fd)
        except OSError:
            os.close(wfd)
            raise
        conn.hold_reading()  # the worker's socket is read through `wfd` meanwhile
        conn.pieces, conn.buffered = [], 0  # the pieces parsed from `raw`: relayed anew

        def stopped() -> None:
            loop.remove_reader(wfd)
            conn._wake()

        relay = kind.Splice(wfd, cfd, meter is not None, stopped, client.spill)
        reading = threaded = False
        try:
            try:
                if raw:
                    relay.feed(raw)
                if relay.state == splice.RUNNING:
                    self._pool.relayer().add(relay)  # the relay thread reads the worker's socket from now on
                    threaded = True
                while True:
                    if conn.error is not None:
                        raise conn.error  # the deadline, or the connection aborted
                    if threaded and relay.threaded:
                        await conn.wait()  # the thread runs it until collect() reports its stop
                        continue
                    state = relay.state
                    if state == splice.RUNNING:
                        if not threaded and not reading:
                            loop.add_reader(wfd, relay.step)
                            reading = True
                        await conn.wait()
                    elif state == splice.PAUSED:
                        # The client is slow: what the thread could not send goes through its transport,
                        # and the rest of the stream is relayed from the event loop (`spill`), drained.
                        reading = threaded = False
                        pending = relay.take_pending()
                        if not pending or not client.spill(pending):
                            await client.writable()
                        relay.to_loop()
                    elif state == splice.CLIENT_ERROR:
                        # As when the client's transport fails a write: its connection closes, and its
                        # loss cancels this request; until then (or the deadline) nothing more is relayed.
                        reading = False
                        client.client_gone()
                        while conn.error is None:
                            await conn.wait()
                        raise conn.error
                    else:
                        reading = False
                        break
            finally:
                if threaded and relay.threaded:
                    relay.cancel()  # still the thread's (cancelled, or the deadline): taken back first
                elif reading and relay.state == splice.RUNNING:
                    loop.remove_reader(wfd)
                relay.close()
                client.sent += relay.sent
                if meter is not None:
                    counts = relay.counts()
                    if counts is not None:
                        meter.counted(*counts)
            if state != splice.DONE:
                raise self._splice_failure(relay)
        except BaseException:
            self.close()
            raise
        conn.body_done = True
        conn.keep_alive = keep_alive and not relay.extra
        conn._parser = HttpResponseParser(conn)  # the old one stopped inside this body
        conn.release_reading()
        self.release()

    def _splice_failure(self, relay: Any) -> BaseException:
        """What a splice that did not reach the body's end raises (as `pipe` would have, for the same cause)."""
        state = relay.state
        if state == splice.EOF:
            return Disconnected("connection closed by peer")
        if state == splice.READ_ERROR:
            return Disconnected(f"connection lost: {OSError(relay.err, os.strerror(relay.err))}")
        if state == splice.PROTOCOL_ERROR:
            return ProtocolViolation(f"invalid HTTP response: {relay.why}")
        error = relay.take_error()
        return error if error is not None else HTTPClientError(f"the native relay stopped in state {state}")

    def release(self) -> None:
        """Done with the response: pool the connection if the body is complete, else close it."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._timer.cancel()
            self._pool._release(conn)

    def close(self) -> None:
        """Abort: close the connection whatever its state."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._timer.cancel()
            conn.fail(HTTPClientError("response closed"))  # wakes a chunks() iterating in another task
            conn.abort()


class ClientPool:
    """Keep-alive connections per (scheme, host, port), reused most-recent first."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        keepalive_timeout: float = 60.0,
        max_idle_per_host: int = 256,
        ssl_context: ssl.SSLContext | None = None,
        splice: Any = None,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive_timeout
        self._max_idle = max_idle_per_host
        self._ssl = ssl_context
        self.splice = splice  # the native relay's module (atomesh.splice.load()), or None: `Response.splice` is off
        self._relayer: Any = None  # its relay thread, started with the first spliced stream
        self._idle: dict[_Key, list[_Conn]] = {}
        self._conns: set[_Conn] = set()  # every open connection, idle or busy, for close()
        self._origins: dict[str, tuple[_Key, str]] = {}  # "http://host:port" -> (key, Host header)
        # Closes connections idle longer than keepalive_timeout; started with the first pooled connection.
        self._sweeper = PeriodicTask("client-pool-sweep", min(keepalive_timeout / 2, 5.0), self._sweep)
        self._sweeping = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first request (one loop uses a pool)

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: bytes | bytearray | None = None,
        timeout: float,
    ) -> Response:
        """Send a request; return once the status line and headers are in.

        `timeout` bounds the whole exchange, until the response is released or closed. A request that
        finds a reused connection already closed by the peer (before any response byte) is sent again
        once on a new connection: the keep-alive race every pooled client has.
        """
        if self._closed:
            raise HTTPClientError("client closed")
        loop = self._loop
        if loop is None:  # looked up once: asyncio.get_running_loop() makes a getpid() system call each time
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key, target, host = self._route(url)
        data, tail = _encode(method, target, host, headers, body)
        conn = self._take_idle(key)
        retry = conn is not None
        if conn is None:
            conn = await self._connect(key, deadline)
        while True:
            timer = loop.call_at(deadline, conn.expire, timeout)
            try:
                conn.start(data, tail, method == "HEAD")
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except Disconnected:
                timer.cancel()
                conn.abort()
                if retry and not conn.got_data:
                    retry = False
                    conn = await self._connect(key, deadline)
                    continue
                raise
            except BaseException:
                timer.cancel()
                conn.abort()
                raise
            return Response(self, conn, timer)

    def relayer(self) -> Any:
        """The native relay's thread (one per pool), started on first use."""
        relayer = self._relayer
        if relayer is None:
            assert self.splice is not None and self._loop is not None
            relayer = self._relayer = self.splice.Relayer()
            self._loop.add_reader(relayer.notify_fd, relayer.collect)
        return relayer

    async def close(self) -> None:
        """Close every connection; requests still running fail, later ones are refused."""
        self._closed = True
        await self._sweeper.stop()
        relayer, self._relayer = self._relayer, None
        if relayer is not None and self._loop is not None:
            self._loop.remove_reader(relayer.notify_fd)
            relayer.close()
        self._idle.clear()
        for conn in list(self._conns):
            conn.pooled = False
            conn.fail(HTTPClientError("client closed"))
            conn.abort()
        await asyncio.sleep(0)  # let the transports report connection_lost

    # --- internals ---

    def _route(self, url: str) -> tuple[_Key, str, str]:
        """(pool key, request target, Host header) of `url`; origins are parsed once and cached."""
        slash = url.find("/", url.find("://") + 3)
        origin, target = (url, "/") if slash < 0 else (url[:slash], url[slash:])
        cached = self._origins.get(origin)
        if cached is None:
            parts = urlsplit(origin)
            port = _DEFAULT_PORTS.get(parts.scheme)
            if port is None or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            cached = (parts.scheme, parts.hostname, parts.port or port), parts.netloc.rpartition("@")[2]
            if len(self._origins) >= 1024:
                self._origins.clear()
            self._origins[origin] = cached
        return cached[0], target, cached[1]

    def _take_idle(self, key: _Key) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            conn.pooled = False
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: _Key, deadline: float) -> _Conn:
        """A new connection, within the connect timeout and what is left of the request's deadline.

        Connecting is the one step bounded by `wait_for`: it happens once per connection, not per request.
        """
        if self._closed:
            raise HTTPClientError("client closed")
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        ctx = None
        if scheme == "https":
            ctx = self._ssl = self._ssl or ssl.create_default_context()
        conn = _Conn(self, key)
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: conn, host, port, ssl=ctx), min(self._connect_timeout, left)
            )
        except TimeoutError:
            conn.abort()
            if left <= self._connect_timeout:
                raise DeadlineExceeded(f"deadline passed while connecting to {host}:{port}") from None
            raise ConnectFailed(f"connect timed out after {self._connect_timeout:g}s") from None
        except ssl.SSLError as e:
            raise ConnectFailed(f"TLS handshake failed: {e.reason or e}") from None
        except socket.gaierror as e:
            raise ConnectFailed(f"cannot resolve {host}: {e.strerror}") from None
        except OSError as e:
            if isinstance(e, ConnectionRefusedError) or e.errno == errno.ECONNREFUSED:
                raise ConnectFailed("connection refused") from None
            raise ConnectFailed(e.strerror or str(e)) from None
        except BaseException:
            conn.abort()  # cancelled: a connection made in the meantime must not leak
            raise
        if self._closed:  # close() ran while we were connecting
            conn.abort()
            raise HTTPClientError("client closed")
        return conn

    def _release(self, conn: _Conn) -> None:
        """Back to its idle list if it can carry another request, else closed."""
        conn.busy = False
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = []
        if self._closed or not conn.reusable() or len(idle) >= self._max_idle:
            conn.abort()
            return
        conn.take()  # drop what the caller left unread and resume reading if paused
        conn.pooled = True
        conn.idle_since = conn._loop.time()
        idle.append(conn)
        if not self._sweeping:
            self._sweeping = True
            self._sweeper.start()

    def _forget(self, conn: _Conn) -> None:
        """A connection closed: it leaves the open set and, if idle, its idle list."""
        self._conns.discard(conn)
        if conn.pooled:
            conn.pooled = False
            self._idle[conn.key].remove(conn)

    def _sweep(self) -> None:
        """Close connections idle longer than keepalive_timeout."""
        cutoff = asyncio.get_running_loop().time() - self._keepalive
        for idle in self._idle.values():
            stale = 0  # idle lists are oldest first
            while stale < len(idle) and idle[stale].idle_since <= cutoff:
                stale += 1
            for conn in idle[:stale]:
                conn.pooled = False
                conn.abort()
            del idle[:stale]


def _encode(
    method: str, target: str, host: str, headers: Mapping[str, str] | None, body: bytes | bytearray | None
) -> tuple[bytes, bytes | bytearray | None]:
    """The request as sent: head and body in one buffer, for a single write; a body over
    `_SEPARATE_BODY` bytes apart (the second item), never copied."""
    lines = [method, " ", target, " HTTP/1.1\r\nHost: ", host, "\r\n"]
    if headers:
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"CR or LF in request header {name!r}")
            if name.lower() in _OWN_HEADERS:
                raise ValueError(f"{name} is set by the client, not the caller")
            lines += (name, ": ", value, "\r\n")
    if body:
        lines += ("Content-Length: ", str(len(body)), "\r\n\r\n")
        if len(body) > _SEPARATE_BODY:
            return "".join(lines).encode("latin-1"), body
        return "".join(lines).encode("latin-1") + body, None
    lines.append("Content-Length: 0\r\n\r\n" if body is not None or method in _BODY_METHODS else "\r\n")
    return "".join(lines).encode("latin-1"), None
