"""atomesh.httpclient against real sockets: scripted raw-byte servers on 127.0.0.1.

Each scenario runs on asyncio's own loop and on uvloop (the gateway's), since flow control, EOF and
error reporting differ between the two transports.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from atomesh.httpclient import (
    ClientPool,
    ConnectFailed,
    DeadlineExceeded,
    Disconnected,
    HTTPClientError,
    ProtocolViolation,
)

pytestmark = pytest.mark.timeout(30)

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def on_both_loops(scenario: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """Turn an async scenario into a test run once per event loop implementation."""

    @pytest.mark.parametrize("loop", list(LOOPS))
    def test(loop: str) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(scenario())

    test.__name__ = test.__qualname__ = scenario.__name__
    test.__doc__ = scenario.__doc__
    return test


class Req:
    """One request as the server read it, with the means to answer it."""

    def __init__(
        self, conn: int, nth: int, head: bytes, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.conn, self.nth, self.head, self.body = conn, nth, head, body
        self.reader, self.writer = reader, writer


Answer = Callable[[Req], Awaitable[bool]]  # writes the response; False closes the connection


class Server:
    """An HTTP/1.1 server whose every answer is scripted byte for byte; counts its connections."""

    def __init__(self, answer: Answer, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.ssl_ctx = ssl_ctx
        self.accepted = 0
        self.open = 0
        self.requests: list[Req] = []

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl_ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    def url(self, path: str = "/x") -> str:
        return f"{'https' if self.ssl_ctx else 'http'}://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        conn, nth = self.accepted, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                nth += 1
                req = Req(conn, nth, head, await reader.readexactly(length), reader, writer)
                self.requests.append(req)
                if not await self.answer(req):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


def fixed(raw: bytes, keep: bool = True) -> Answer:
    async def answer(req: Req) -> bool:
        req.writer.write(raw)
        return keep

    return answer


async def stall(req: Req) -> bool:
    """Never answer; notice when the client goes away."""
    await req.reader.read()
    return False


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def idle_count(pool: ClientPool) -> int:
    return sum(len(idle) for idle in pool._idle.values())


async def assert_clean(pool: ClientPool, server: Server) -> None:
    """No connection left open on either side."""
    await eventually(lambda: not pool._conns and server.open == 0)
    assert idle_count(pool) == 0


@on_both_loops
async def test_get_and_post_with_content_length() -> None:
    async def echo(req: Req) -> bool:
        body = req.head.split(b" ")[0] + b":" + req.body
        req.writer.write(ok(body, b"Content-Type: Application/JSON; charset=utf-8\r\nX-A: 1\r\nx-a: 2\r\n"))
        return True

    async with Server(echo) as server:
        pool = ClientPool()
        resp = await pool.request("GET", server.url("/a?b=c"), headers={"X-Id": "7"}, timeout=5)
        assert (resp.status, resp.content_type, resp.headers["x-a"]) == (200, "application/json", "1, 2")
        assert await resp.read() == b"GET:"
        resp = await pool.request("POST", server.url(), body=b'{"a":1}', timeout=5)
        assert await resp.read() == b'POST:{"a":1}'
        resp = await pool.request("POST", server.url(), timeout=5)
        assert await resp.read() == b"POST:"
        first, post, empty_post = (r.head for r in server.requests)
        assert first.startswith(b"GET /a?b=c HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.port)
        assert b"X-Id: 7\r\n" in first and b"content-length" not in first.lower()
        assert b"Content-Length: 7\r\n" in post and b"Content-Length: 0\r\n" in empty_post
        assert server.accepted == 1
        await pool.close()


@on_both_loops
async def test_chunked_body_arrives_in_pieces() -> None:
    async def answer(req: Req) -> bool:
        req.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            req.writer.write(chunk(piece))
            await req.writer.drain()
            await asyncio.sleep(0.05)
        req.writer.write(b"0\r\n\r\n")
        return True

    async with Server(answer) as server:
        pool = ClientPool()
        resp = await pool.request("POST", server.url(), body=b"{}", timeout=5)
        assert resp.content_type == "text/event-stream"
        got = [piece async for piece in resp.chunks()]
        assert len(got) == 3 and all(got)
        assert b"".join(got) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert idle_count(pool) == 1  # released by the end of the iteration
        resp = await pool.request("POST", server.url(), body=b"{}", timeout=5)
        assert await resp.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert server.accepted == 1
        await pool.close()


@on_both_loops
async def test_piped_body_pauses_resumes_and_fails_as_its_sink_says() -> None:
    """`Response.pipe` hands pieces to the sink from the parser's callback, in order; a sink that says
    False is waited for (`writable`) before the next piece; a sink that raises ends the pipe with that
    error and the connection is not reused."""
    pieces = [b"data: %d\n\n" % i for i in range(6)]

    async def answer(req: Req) -> bool:
        req.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            req.writer.write(chunk(piece))
            await req.writer.drain()
            await asyncio.sleep(0.02)
        req.writer.write(b"0\r\n\r\n")
        return True

    async with Server(answer) as server:
        pool = ClientPool()
        got: list[bytes] = []
        waits = 0

        def slow_sink(data: bytes) -> bool:
            got.append(data)
            return len(got) % 2 == 0  # every other piece: "no more for now"

        async def writable() -> None:
            nonlocal waits
            waits += 1
            await asyncio.sleep(0.05)  # the next pieces wait in the connection's buffer meanwhile

        resp = await pool.request("POST", server.url(), body=b"{}", timeout=5)
        await resp.pipe(slow_sink, writable)
        assert b"".join(got) == b"".join(pieces) and waits >= 2
        assert idle_count(pool) == 1  # whole: back to the pool

        def failing_sink(data: bytes) -> bool:
            if data.startswith(b"data: 2"):
                raise ValueError("the consumer broke")
            return True

        resp = await pool.request("POST", server.url(), body=b"{}", timeout=5)
        with pytest.raises(ValueError, match="the consumer broke"):
            await resp.pipe(failing_sink, writable)
        assert idle_count(pool) == 0  # cut short: closed, not pooled
        await pool.close()


@on_both_loops
async def test_body_read_until_close() -> None:
    async with Server(fixed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", keep=False)) as server:
        pool = ClientPool()
        for _ in range(2):
            resp = await pool.request("GET", server.url(), timeout=5)
            assert await resp.read() == b"all of it"
        assert server.accepted == 2
        await assert_clean(pool, server)


@on_both_loops
async def test_connection_close_is_not_reused() -> None:
    async with Server(fixed(ok(b"x", b"Connection: close\r\n"))) as server:
        pool = ClientPool()
        for _ in range(2):
            assert await (await pool.request("GET", server.url(), timeout=5)).read() == b"x"
        assert server.accepted == 2
        await assert_clean(pool, server)


@on_both_loops
async def test_http10_without_keepalive_is_not_reused() -> None:
    async with Server(fixed(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx")) as server:
        pool = ClientPool()
        for _ in range(2):
            assert await (await pool.request("GET", server.url(), timeout=5)).read() == b"x"
        assert server.accepted == 2
        await pool.close()


@on_both_loops
async def test_no_body_statuses_and_interim_responses() -> None:
    async def answer(req: Req) -> bool:
        if req.conn == 1 and req.nth == 1:
            req.writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
            await req.writer.drain()
            await asyncio.sleep(0.02)
            req.writer.write(ok(b"final"))
        elif req.head.startswith(b"HEAD"):
            req.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        else:
            req.writer.write(b"HTTP/1.1 204 No Content\r\nX-N: 1\r\n\r\n")
        return True

    async with Server(answer) as server:
        pool = ClientPool()
        resp = await pool.request("POST", server.url(), body=b"q", timeout=5)
        assert resp.status == 200 and "link" not in resp.headers
        assert await resp.read() == b"final"
        for _ in range(2):
            resp = await pool.request("DELETE", server.url(), timeout=5)
            assert (resp.status, await resp.read()) == (204, b"")
        assert server.accepted == 1
        resp = await pool.request("HEAD", server.url(), timeout=5)
        assert (resp.status, resp.headers["content-length"], await resp.read()) == (200, "5", b"")
        resp = await pool.request("DELETE", server.url(), timeout=5)  # HEAD's connection is not reused
        assert (resp.status, server.accepted) == (204, 2)
        resp.release()
        await pool.close()


@on_both_loops
async def test_stale_pooled_connection_is_retried_once_on_a_new_one() -> None:
    async def answer(req: Req) -> bool:
        if req.conn == 1 and req.nth == 2:
            return False  # the server timed the connection out just as the request came
        req.writer.write(ok(b"fine"))
        return True

    async with Server(answer) as server:
        pool = ClientPool()
        for _ in range(2):
            assert await (await pool.request("POST", server.url(), body=b"1", timeout=5)).read() == b"fine"
        assert server.accepted == 2 and len(server.requests) == 3
        await pool.close()


@on_both_loops
async def test_fresh_connection_closed_before_answer_is_not_retried() -> None:
    async def hang_up(req: Req) -> bool:
        return False

    async with Server(hang_up) as server:
        pool = ClientPool()
        with pytest.raises(Disconnected):
            await pool.request("GET", server.url(), timeout=5)
        assert server.accepted == 1
        await assert_clean(pool, server)


@on_both_loops
async def test_server_dying_mid_body_is_disconnected() -> None:
    async with Server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", keep=False)) as server:
        pool = ClientPool()
        resp = await pool.request("GET", server.url(), timeout=5)
        with pytest.raises(Disconnected):
            await resp.read()
        chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"one")
        server.answer = fixed(chunked, keep=False)
        resp = await pool.request("GET", server.url(), timeout=5)
        got = []
        with pytest.raises(Disconnected):
            async for piece in resp.chunks():
                got.append(piece)
        assert got == [b"one"]
        await assert_clean(pool, server)


@on_both_loops
async def test_refused_port_is_connect_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pool = ClientPool()
    with pytest.raises(ConnectFailed, match="connection refused"):
        await pool.request("GET", f"http://127.0.0.1:{port}/", timeout=5)
    assert not pool._conns


@on_both_loops
async def test_deadline_while_waiting_for_the_head() -> None:
    async with Server(stall) as server:
        pool = ClientPool()
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await pool.request("GET", server.url(), timeout=0.2)
        assert 0.15 < time.monotonic() - started < 2
        await assert_clean(pool, server)


@on_both_loops
async def test_deadline_while_reading_the_body() -> None:
    async def slow(req: Req) -> bool:
        req.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"first"))
        return await stall(req)

    async with Server(slow) as server:
        pool = ClientPool()
        resp = await pool.request("GET", server.url(), timeout=0.3)
        with pytest.raises(DeadlineExceeded):
            await resp.read()
        await assert_clean(pool, server)
        resp = await pool.request("GET", server.url(), timeout=0.3)
        got = []
        with pytest.raises(DeadlineExceeded):
            async for piece in resp.chunks():
                got.append(piece)
        assert got == [b"first"]
        await assert_clean(pool, server)


@on_both_loops
async def test_connect_timeout() -> None:
    # A listener that never accepts, its queue filled: the kernel drops further SYNs, so connect hangs.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        try:
            pool = ClientPool(connect_timeout=0.2)
            with pytest.raises(ConnectFailed, match=r"^connect timed out after 0.2s$"):
                await pool.request("GET", url, timeout=5)
            with pytest.raises(DeadlineExceeded):
                await pool.request("GET", url, timeout=0.1)
            assert not pool._conns
        finally:
            for filler in fillers:
                filler.close()


@on_both_loops
async def test_cancelled_request_and_read_leave_nothing_behind() -> None:
    async def head_then_stall(req: Req) -> bool:
        if req.nth == 1 and req.conn == 2:
            req.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        return await stall(req)

    async with Server(head_then_stall) as server:
        pool = ClientPool()
        task = asyncio.create_task(pool.request("GET", server.url(), timeout=5))
        await eventually(lambda: len(server.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_clean(pool, server)
        resp = await pool.request("GET", server.url(), timeout=5)
        reading = asyncio.create_task(resp.read())
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await assert_clean(pool, server)
        assert len(asyncio.all_tasks()) == 1  # no timer or helper task survives


@on_both_loops
async def test_malformed_response_is_protocol_violation() -> None:
    async with Server(fixed(b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n")) as server:
        pool = ClientPool()
        with pytest.raises(ProtocolViolation):
            await pool.request("GET", server.url(), timeout=5)
        server.answer = fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nbad\r\n")
        resp = await pool.request("GET", server.url(), timeout=5)
        with pytest.raises(ProtocolViolation):
            await resp.read()
        await assert_clean(pool, server)


@on_both_loops
async def test_idle_connections_are_swept_after_keepalive_timeout() -> None:
    async with Server(fixed(ok(b"x"))) as server:
        pool = ClientPool(keepalive_timeout=0.2)
        assert await (await pool.request("GET", server.url(), timeout=5)).read() == b"x"
        assert idle_count(pool) == 1 and server.open == 1
        await assert_clean(pool, server)
        await pool.close()


@on_both_loops
async def test_idle_list_is_bounded_per_host() -> None:
    async def slow_ok(req: Req) -> bool:
        await asyncio.sleep(0.05)
        req.writer.write(ok(b"x"))
        return True

    async with Server(slow_ok) as server:
        pool = ClientPool(max_idle_per_host=2)
        responses = await asyncio.gather(*(pool.request("GET", server.url(), timeout=5) for _ in range(5)))
        assert server.accepted == 5
        for resp in responses:
            assert await resp.read() == b"x"
        assert idle_count(pool) == 2
        await eventually(lambda: server.open == 2 and len(pool._conns) == 2)
        await pool.close()
        await assert_clean(pool, server)


@on_both_loops
async def test_peer_closing_an_idle_connection_drops_it_from_the_pool() -> None:
    async with Server(fixed(ok(b"bye"), keep=False)) as server:
        pool = ClientPool()
        assert await (await pool.request("GET", server.url(), timeout=5)).read() == b"bye"
        await assert_clean(pool, server)


@on_both_loops
async def test_unread_big_body_pauses_reading_and_arrives_intact() -> None:
    payload = bytes(range(256)) * (4 * 4096)  # 4 MiB

    async with Server(fixed(ok(payload))) as server:
        pool = ClientPool()
        resp = await pool.request("GET", server.url(), timeout=10)
        conn = resp._conn
        assert conn is not None
        got = bytearray()
        most_buffered = 0
        async for piece in resp.chunks():
            got += piece
            await asyncio.sleep(0.02)  # a slow consumer
            most_buffered = max(most_buffered, conn.buffered)
        assert got == payload
        assert 1 << 20 < most_buffered < 3 << 19  # it hit the high-water mark and stopped there
        assert idle_count(pool) == 1
        assert await (await pool.request("GET", server.url(), timeout=10)).read() == payload
        await pool.close()


@on_both_loops
async def test_release_close_and_pool_close() -> None:
    async with Server(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")) as server:
        pool = ClientPool()
        resp = await pool.request("GET", server.url(), timeout=5)
        resp.release()  # body incomplete: the connection cannot be reused
        resp.release()
        resp.close()
        with pytest.raises(HTTPClientError, match="released"):
            await resp.read()
        await assert_clean(pool, server)
        with pytest.raises(ValueError):
            await pool.request("GET", server.url(), headers={"X": "a\r\nInjected: 1"}, timeout=5)
        with pytest.raises(ValueError):
            await pool.request("GET", server.url(), headers={"Content-Length": "3"}, timeout=5)
        resp = await pool.request("GET", server.url(), timeout=5)
        await pool.close()
        with pytest.raises(HTTPClientError):
            await resp.read()
        with pytest.raises(HTTPClientError, match="client closed"):
            await pool.request("GET", server.url(), timeout=5)
        await assert_clean(pool, server)


def test_url_routing_is_parsed_once_per_origin() -> None:
    pool = ClientPool()
    assert pool._route("http://[::1]:8000/v1/x?y=1") == (("http", "::1", 8000), "/v1/x?y=1", "[::1]:8000")
    assert pool._route("https://example.com") == (("https", "example.com", 443), "/", "example.com")
    assert pool._route("http://user@h/") == (("http", "h", 80), "/", "h")
    assert set(pool._origins) == {"http://[::1]:8000", "https://example.com", "http://user@h"}
    for bad in ("ftp://h/", "localhost:80/x", "http:///x"):
        with pytest.raises(ValueError):
            pool._route(bad)


def _self_signed(tmp: Path) -> tuple[Path, Path] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_https_with_a_private_ca(tmp_path: Path) -> None:
    pair = _self_signed(tmp_path)
    if pair is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = pair
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    async with Server(fixed(ok(b"secret")), ssl_ctx=server_ctx) as server:
        pool = ClientPool(ssl_context=ssl.create_default_context(cafile=str(cert)))
        for _ in range(2):
            assert await (await pool.request("GET", server.url(), timeout=5)).read() == b"secret"
        assert server.accepted == 1
        await pool.close()
        untrusting = ClientPool()
        with pytest.raises(ConnectFailed, match="TLS"):
            await untrusting.request("GET", server.url(), timeout=5)
