"""The one upstream transport: the pooled keep-alive HTTP client, the response relay and retry timing.

Every call the gateway makes to a worker goes through `Upstream`, so timeouts, connection reuse
and the mapping of network failures to gateway errors are decided here once. Every answer a client
gets to an inference request goes through an `Exchange`, whichever door the request came in by.
"""

from __future__ import annotations

import random
import ssl
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol, cast

import orjson

from atomesh import splice
from atomesh.errors import GatewayError, UpstreamError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable, error_body
from atomesh.httpclient import (
    ClientPool,
    ConnectFailed,
    DeadlineExceeded,
    Disconnected,
    HTTPClientError,
    ProtocolViolation,
    Response,
    SpliceClient,
    SpliceMeter,
)
from atomesh.tracing import Trace, Tracing

# Lower-case, as the worker's headers are kept: each name is sent once, ours replacing the worker's.
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}
# Every call to a worker carries the gateway's instance id here; a request arriving with our own id
# came back to us (the gateway registered as its own worker) and is refused (508).
HOP_HEADER = "x-atomesh-gateway"


def upstream_error(err: HTTPClientError, url: str) -> UpstreamError:
    """The gateway error a client-side failure talking to `url` becomes."""
    if isinstance(err, DeadlineExceeded):
        return UpstreamTimeout(f"{url} did not answer in time: {err.message}")
    if isinstance(err, ConnectFailed):
        return UpstreamUnreachable(f"cannot connect to {url}: {err.message}")
    if isinstance(err, Disconnected):
        return UpstreamError(f"{url} closed the connection: {err.message}", code="upstream_disconnected")
    if isinstance(err, ProtocolViolation):
        return UpstreamError(f"{url} sent an invalid response: {err.message}", code="upstream_protocol_error")
    return UpstreamError(f"{url}: {err.message}")


class Credentialed(Protocol):
    """A worker, as far as calling it goes: its own key, if it has one."""

    @property
    def api_key(self) -> str | None: ...


class Upstream:
    """The pooled keep-alive client shared by every route, backend and background task."""

    def __init__(
        self,
        request_timeout_secs: float,
        connect_timeout_secs: float = 10.0,
        hop: str = "",
        ssl_context: ssl.SSLContext | None = None,
        pool_idle_timeout_secs: float = 60.0,
        tracing: Tracing | None = None,
    ) -> None:
        self.tracing = tracing if tracing is not None and tracing.on else None  # --enable-trace
        self.ssl_context = ssl_context  # for https:// workers (--ca-cert-paths, --client-cert-path)
        self.pool_idle_timeout = pool_idle_timeout_secs  # --upstream-pool-idle-timeout-secs
        self.request_timeout = request_timeout_secs
        self.connect_timeout = connect_timeout_secs
        self.hop = hop
        self._hop_headers = {HOP_HEADER: hop}  # what a call without headers of its own sends
        self._pool: ClientPool | None = None

    def headers_for(self, exchange: Exchange, worker: Credentialed) -> dict[str, str]:
        """Headers of a request forwarded to `worker`: JSON, our request id and hop mark, and credentials:
        the worker's own key when it has one, else the client's Authorization as it came (as SMG does)."""
        headers = {"Content-Type": "application/json", "x-request-id": exchange.request_id, HOP_HEADER: self.hop}
        if worker.api_key is not None:
            headers["Authorization"] = "Bearer " + worker.api_key
        else:
            auth = exchange.headers.get("authorization")
            if auth is not None:
                headers["Authorization"] = auth
        if self.tracing is not None:
            self.tracing.inject(headers, exchange)  # the current leg's span: the worker's spans go under it
        return headers

    def worker_headers(self, worker: Credentialed) -> Mapping[str, str]:
        """Headers of the gateway's own calls to `worker` (health, discovery, load, metrics): its key if any."""
        if worker.api_key is None:
            return self._hop_headers
        return {**self._hop_headers, "Authorization": "Bearer " + worker.api_key}

    async def start(self) -> None:
        # Admission control bounds concurrency; the pool only bounds what it keeps idle.
        self._pool = ClientPool(
            connect_timeout=self.connect_timeout,
            keepalive_timeout=self.pool_idle_timeout,
            ssl_context=self.ssl_context,
            splice=splice.load(),  # streams relayed by atomesh/splice.c where it builds
        )

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def request(
        self, method: str, url: str, *, data: bytes | bytearray | None = None, headers: Mapping[str, str] | None = None
    ) -> Awaitable[Response]:
        """Send a request (the request timeout bounds it whole); await it for the response, whose head is
        in. The caller must `release()` or `close()` the response, and map the HTTPClientError raised by
        the await or while reading with `upstream_error`. The request path's way to a worker: no context
        manager to enter and leave, and no coroutine of its own around the pool's."""
        if self._pool is None:
            raise RuntimeError("Upstream used before start()")
        headers = self._hop_headers if headers is None else headers
        return self._pool.request(method, url, headers=headers, body=data, timeout=self.request_timeout)

    def open(
        self,
        method: str,
        url: str,
        *,
        data: bytes | bytearray | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Opened:
        """`async with upstream.open(...) as resp:` sends a request and yields the response with its
        headers read; failures, inside the block too, become UpstreamError. The connection goes back
        to the pool if the block read the whole body, and is closed otherwise."""
        if self._pool is None:
            raise RuntimeError("Upstream used before start()")
        return Opened(
            self._pool,
            method,
            url,
            data,
            self._hop_headers if headers is None else headers,
            self.request_timeout if timeout is None else timeout,
        )

    async def call(
        self,
        method: str,
        url: str,
        *,
        data: bytes | bytearray | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes, str]:
        """A complete request: (status, body, content type)."""
        async with self.open(method, url, data=data, headers=headers, timeout=timeout) as resp:
            return resp.status, await resp.read(), resp.content_type

    async def get_json(self, url: str, timeout: float, headers: Mapping[str, str] | None = None) -> Any:
        """GET a JSON document; raises UpstreamError on any failure or non-2xx status."""
        status, body, ctype = await self.call("GET", url, headers=headers, timeout=timeout)
        if status >= 300:
            raise UpstreamStatus(status, body, ctype)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{url} did not return JSON", code="upstream_protocol_error") from None


class Opened:
    """One upstream request as an async context manager (a class: cheaper than a generator on the hot path)."""

    __slots__ = ("_data", "_headers", "_method", "_pool", "_resp", "_timeout", "url")

    def __init__(
        self,
        pool: ClientPool,
        method: str,
        url: str,
        data: bytes | bytearray | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._method = method
        self.url = url
        self._data = data
        self._headers = headers
        self._timeout = timeout
        self._resp: Response | None = None

    async def __aenter__(self) -> Response:
        try:
            self._resp = await self._pool.request(
                self._method, self.url, headers=self._headers, body=self._data, timeout=self._timeout
            )
        except HTTPClientError as e:
            raise upstream_error(e, self.url) from None
        return self._resp

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._resp is not None:
            self._resp.release()  # back to the pool only if its body was read to the end
        if isinstance(exc, HTTPClientError):
            raise upstream_error(exc, self.url) from None


# Called with each chunk relayed to the client (metrics read the stream without re-encoding it).
ChunkHook = Callable[[bytes], None]


class StreamFilter(Protocol):
    """Stands between a worker's stream and the client (mid-stream migration reads and rewrites it)."""

    def feed(self, data: bytes) -> bytes:
        """What the client gets of `data` (possibly nothing yet)."""
        ...

    def ended_stream(self) -> None:
        """The worker's stream ended; raises UpstreamError if the answer had not."""
        ...


class Exchange(ABC):
    """The client side of one inference request: where its answer goes, whichever server took it.

    A non-streamed answer goes out whole with `respond`; a stream with `start_stream`, `write`...,
    `end`. Once a stream has started (`committed`), nothing may be retried.
    """

    __slots__ = (
        "body",
        "committed",
        "headers",
        "meter",
        "on_chunk",
        "request_id",
        "sent",
        "status",
        "stream_filter",
        "trace",
        "workers",
    )

    # Whether `push` and `writable` are implemented: a stream is then relayed from the worker connection's
    # callbacks (no coroutine resumed per event), else through `write`.
    direct = False

    def __init__(self, request_id: str, headers: Mapping[str, str]) -> None:
        self.request_id = request_id
        self.headers = headers  # the client's request headers (look up with lower-case names)
        # Sees every chunk relayed to this client (the router's token meter) unless relay() is given another.
        self.on_chunk: ChunkHook | None = None
        # The meter whose `feed` is `on_chunk`, when it is one (a stream may then be relayed natively).
        self.meter: SpliceMeter | None = None
        self.status: int | None = None
        self.body: bytes | None = None  # a whole (non-streamed) answer, kept for the token meter
        self.committed = False
        self.workers: tuple[str, ...] = ()  # the worker(s) of the last placement (for the access log)
        self.sent = 0  # body bytes given to the client so far
        # Set by the router for a stream that may migrate: the stream then goes through it.
        self.stream_filter: StreamFilter | None = None
        self.trace: Trace | None = None  # with --enable-trace, a sampled request's spans

    @abstractmethod
    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """Send a whole (non-streamed) answer; sets `status` and `body`."""

    @abstractmethod
    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        """Send a streamed answer's head; sets `status` and `committed`."""

    @abstractmethod
    async def write(self, data: bytes) -> None:
        """Send one piece of a started stream (waits while the client is slow to read)."""

    @abstractmethod
    async def end(self) -> None:
        """End a started stream."""

    def push(self, data: bytes) -> bool:
        """Send one piece of a started stream from a callback, without waiting (exchanges with `direct` set);
        False when the client is slow to read: await `writable()` before pushing more."""
        raise NotImplementedError(f"{type(self).__name__} is not direct: relay() writes to it with write()")

    async def writable(self) -> None:
        """Return once the client takes more of the stream (exchanges with `direct` set)."""
        raise NotImplementedError(f"{type(self).__name__} is not direct: relay() writes to it with write()")

    def splice_fd(self) -> int:
        """The client's socket when a stream may be written to it directly now (`Response.splice`: a chunked
        HTTP/1.1 stream, nothing buffered, no trace), else -1. Such exchanges are a `SpliceClient` too."""
        return -1

    def respond_relayed(self, status: int, upstream: Mapping[str, str], body: bytes) -> None:
        """`respond` with a worker's answer: its headers as `response_headers` makes them."""
        self.respond(status, self.response_headers(upstream), body)

    def response_headers(self, upstream: Mapping[str, str]) -> dict[str, str]:
        """The worker's response headers (names lower-case, as the client gives them), less hop-by-hop
        ones, with our request id."""
        headers = {k: v for k, v in upstream.items() if k not in NOT_RELAYED}
        headers["x-request-id"] = self.request_id
        return headers


# Response headers that describe one hop, not the response (RFC 9110 §7.6.1), or that the server sets.
NOT_RELAYED = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "date",
        "server",
        "proxy-authenticate",
        "trailer",
        "upgrade",
        "x-request-id",
    }
)


def relay_now(exchange: Exchange, resp: Response) -> bool:
    """Answer with a whole (not streamed) answer whose body is all in already, as `relay` would, without a
    coroutine to run (a small answer usually arrives with its head); False: `relay` it."""
    if resp.status >= 400 or exchange.committed or resp.content_type == "text/event-stream":
        return False
    body = resp.read_now()
    if body is None:
        return False
    exchange.respond_relayed(resp.status, resp.headers, body)
    return True


async def relay(exchange: Exchange, resp: Response, on_chunk: ChunkHook | None = None) -> None:
    """Pass an upstream response to the client: whole if JSON, chunk by chunk if SSE.

    An error status raises UpstreamStatus (so the caller may retry); once streaming has started,
    an upstream failure raises UpstreamError and the caller ends the stream with an SSE error event
    (or continues it elsewhere). A stream already started by an earlier worker (a migrated stream) is
    continued, not started again.
    """
    if resp.status >= 400:
        raise UpstreamStatus(resp.status, await resp.read(), resp.content_type)
    if resp.content_type != "text/event-stream":
        if exchange.committed:
            raise UpstreamError(
                "the worker answered a continued stream with a whole answer",
                code="upstream_protocol_error",
                retryable=False,
            )
        body = resp.read_now()
        if body is None:
            body = await resp.read()
        exchange.respond_relayed(resp.status, resp.headers, body)
        return
    on_chunk = on_chunk or exchange.on_chunk
    filt = exchange.stream_filter
    if not exchange.committed:
        headers = exchange.response_headers(resp.headers)
        headers.update(SSE_HEADERS)
        await exchange.start_stream(resp.status, headers)
    try:
        if exchange.direct:
            if filt is None:
                meter = exchange.meter
                fd = -1 if on_chunk is not exchange.on_chunk or (on_chunk and meter is None) else exchange.splice_fd()
                if fd >= 0 and resp.can_splice():
                    await resp.splice(fd, cast(SpliceClient, exchange), meter if on_chunk is not None else None)
                else:
                    await resp.pipe(exchange.push, exchange.writable, on_chunk)
            else:
                await resp.pipe(_filtered(exchange, filt, on_chunk), exchange.writable)
        else:
            async for chunk in resp.chunks():
                if filt is not None:
                    chunk = filt.feed(chunk)
                    if not chunk:
                        continue
                if on_chunk is not None:
                    on_chunk(chunk)
                await exchange.write(chunk)
    except DeadlineExceeded:
        raise UpstreamTimeout("the worker's stream outlived the request timeout") from None
    except HTTPClientError as e:
        # The worker died mid-stream; the caller ends the client's stream with an error event.
        raise UpstreamError(f"worker stream broke: {e.message}", code="upstream_stream_broken") from None
    if filt is not None:
        filt.ended_stream()
    await exchange.end()


def _filtered(exchange: Exchange, filt: StreamFilter, on_chunk: ChunkHook | None) -> Callable[[bytes], bool]:
    """What a worker's stream goes through on its way to a direct exchange when a filter reads it (a stream
    that may migrate), called from the worker connection's parser callback: the filter, the meter, the
    client's socket."""
    push = exchange.push

    def sink(chunk: bytes) -> bool:
        chunk = filt.feed(chunk)
        if not chunk:
            return True
        if on_chunk is not None:
            on_chunk(chunk)
        return push(chunk)

    return sink


async def write_sse_error(exchange: Exchange, err: GatewayError) -> None:
    try:
        await exchange.write(b"data: " + error_body(err.message, err.type, err.code) + b"\n\ndata: [DONE]\n\n")
        await exchange.end()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too


def backoff_delays(
    initial_ms: int, max_ms: int, multiplier: float, jitter: float, rng: random.Random | None = None
) -> Iterator[float]:
    """Exponential backoff with +-`jitter` spread, in seconds, forever (the caller bounds it)."""
    rng = rng or random.Random()
    delay = float(initial_ms)
    while True:
        spread = delay * jitter
        yield max(0.0, min(float(max_ms), delay + rng.uniform(-spread, spread))) / 1000.0
        delay = min(float(max_ms), delay * multiplier)
