"""The one upstream transport: a pooled keep-alive HTTP client, the response relay and retry timing.

Every call the gateway makes to a worker goes through `Upstream`, so timeouts, connection reuse
and the mapping of network failures to gateway errors are decided here once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from atomesh.errors import GatewayError, UpstreamError, UpstreamStatus, UpstreamTimeout, error_body

JSON_HEADERS = {"Content-Type": "application/json"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Upstream:
    """A pooled aiohttp client shared by every route, backend and background task."""

    def __init__(self, request_timeout_secs: float, connect_timeout_secs: float = 10.0) -> None:
        self.request_timeout = request_timeout_secs
        self.connect_timeout = connect_timeout_secs
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # admission control bounds concurrency, not the pool
            keepalive_timeout=60,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream used before start()")
        return self._session

    @asynccontextmanager
    async def open(
        self, method: str, url: str, *, data: bytes | None = None,
        headers: Mapping[str, str] | None = None, timeout: float | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request and yield the response with its headers read; map failures to errors.

        The response is closed (not returned to the pool half-read) if the caller leaves early.
        """
        total = self.request_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(total):
                resp = await self.session.request(method, url, data=data, headers=headers)
                try:
                    yield resp
                except BaseException:
                    resp.close()
                    raise
                else:
                    resp.release()
        except TimeoutError:
            raise UpstreamTimeout(f"{url} did not answer within {total:g}s") from None
        except aiohttp.ClientConnectorError as e:
            raise UpstreamError(f"cannot connect to {url}: {e.strerror or e}") from None
        except aiohttp.ServerDisconnectedError:
            raise UpstreamError(f"{url} closed the connection", code="upstream_disconnected") from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
            raise UpstreamError(f"{url} broke the connection: {e}", code="upstream_disconnected") from None
        except aiohttp.ClientResponseError as e:
            raise UpstreamError(f"{url} sent an invalid response: {e.message}",
                                code="upstream_protocol_error") from None

    async def call(
        self, method: str, url: str, *, data: bytes | None = None,
        headers: Mapping[str, str] | None = None, timeout: float | None = None,
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


# Called with each chunk relayed to the client (metrics read the stream without re-encoding it).
ChunkHook = Callable[[bytes], None]


@dataclass(slots=True)
class Exchange:
    """The client side of one request: where the response goes and whether it has started."""

    request: web.Request
    request_id: str
    # Set once the response headers went to the client: from then on nothing may be retried.
    stream: web.StreamResponse | None = None
    # Sees every chunk relayed to this client (the router's token meter) unless relay() is given another.
    on_chunk: ChunkHook | None = None

    @property
    def committed(self) -> bool:
        return self.stream is not None

    def response_headers(self, upstream: Mapping[str, str]) -> dict[str, str]:
        """The worker's response headers, less hop-by-hop ones, with our request id."""
        headers = {k: v for k, v in upstream.items() if k.lower() not in _NOT_RELAYED}
        headers["x-request-id"] = self.request_id
        return headers


# Response headers that describe one hop, not the response (RFC 9110 §7.6.1), or that aiohttp sets.
_NOT_RELAYED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "proxy-authenticate", "trailer", "upgrade", "x-request-id"})


async def relay(
    exchange: Exchange, resp: aiohttp.ClientResponse, on_chunk: ChunkHook | None = None,
) -> web.StreamResponse:
    """Pass an upstream response to the client: whole if JSON, chunk by chunk if SSE.

    An error status raises UpstreamStatus (so the caller may retry); once streaming has started,
    an upstream failure ends the stream with an SSE error event instead.
    """
    if resp.status >= 400:
        raise UpstreamStatus(resp.status, await resp.read(), resp.content_type)
    if resp.content_type != "text/event-stream":
        body = await resp.read()
        return web.Response(body=body, status=resp.status, headers=exchange.response_headers(resp.headers))
    on_chunk = on_chunk or exchange.on_chunk
    out = web.StreamResponse(status=resp.status, headers=exchange.response_headers({**resp.headers, **SSE_HEADERS}))
    await out.prepare(exchange.request)
    exchange.stream = out
    try:
        async for chunk in resp.content.iter_any():
            if on_chunk is not None:
                on_chunk(chunk)
            await out.write(chunk)
    except aiohttp.ClientError as e:
        # The worker died mid-stream; the caller ends the client's stream with an error event.
        raise UpstreamError(f"worker stream broke: {e or type(e).__name__}",
                            code="upstream_stream_broken") from None
    await out.write_eof()
    return out


async def write_sse_error(out: web.StreamResponse, err: GatewayError) -> None:
    try:
        await out.write(b"data: " + error_body(err.message, err.type, err.code) + b"\n\ndata: [DONE]\n\n")
        await out.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too


def upstream_headers(exchange: Exchange) -> dict[str, str]:
    """Headers sent with a request to a worker: JSON, our request id, the caller's credentials."""
    headers = {"Content-Type": "application/json", "x-request-id": exchange.request_id}
    auth = exchange.request.headers.get("Authorization")
    if auth is not None:
        headers["Authorization"] = auth
    return headers


def backoff_delays(initial_ms: int, max_ms: int, multiplier: float, jitter: float,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff with +-`jitter` spread, in seconds, forever (the caller bounds it)."""
    rng = rng or random.Random()
    delay = float(initial_ms)
    while True:
        spread = delay * jitter
        yield max(0.0, min(float(max_ms), delay + rng.uniform(-spread, spread))) / 1000.0
        delay = min(float(max_ms), delay * multiplier)
