"""The HTTP pipeline at its edges, on raw sockets: limits, timeouts, non-HTTP bytes, upgrades, closes.

Every case runs against inference routes (served by the front door itself) and other routes (relayed
to aiohttp) alike: one parser, one set of limits, one set of timeouts for every connection.
"""

from __future__ import annotations

import asyncio
import socket
import time

import orjson
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

pytestmark = pytest.mark.timeout(60)

BODY = orjson.dumps({"model": "mock-model", "prompt": "hello", "max_tokens": 3})


def post(extra: str = "", body: bytes = BODY, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def get(extra: str = "", path: str = "/health") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: gw\r\n{extra}\r\n".encode()


async def exchange(url: str, data: bytes, *, timeout: float = 10) -> tuple[int | None, bytes, float]:
    """Send `data`, read until the gateway closes: (status of the first answer, everything, seconds)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(data)
    try:
        got = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return status, got, time.monotonic() - t0


@pytest.fixture
async def gw_url(mock_workers: MakeWorkers, gateway: MakeGateway) -> str:
    [w] = await mock_workers(1)
    gw = await gateway(
        worker_urls=[w.url],
        max_payload_size=10_000,
        http_head_timeout_secs=0.6,
        http_body_timeout_secs=0.6,
        http_keepalive_timeout_secs=0.6,
    )
    return base_url(gw)


@pytest.mark.parametrize("make", [post, get], ids=["inference", "relayed"])
async def test_header_limits_are_the_same_on_every_route(gw_url: str, make) -> None:  # type: ignore[no-untyped-def]
    ok = make(f"X-Big: {'a' * 8190}\r\nConnection: close\r\n")
    status, _, _ = await exchange(gw_url, ok)
    assert status == 200
    for extra, want in [
        (f"X-Big: {'a' * 8191}\r\n", 431),
        (f"X-{'n' * 8190}: v\r\n", 431),
        ("".join(f"X-H{i}: v\r\n" for i in range(101)), 431),
        ("".join(f"X-H{i}: {'v' * 8000}\r\n" for i in range(9)), 431),
    ]:
        status, got, _ = await exchange(gw_url, make(extra))
        assert status == want, got[:200]
        assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    long_target = "/v1/completions?" + "q" * 8200
    status, _, _ = await exchange(gw_url, get(path=long_target))
    assert status == 414


@pytest.mark.parametrize(
    "data",
    [
        bytes(range(256)),  # binary garbage
        bytes.fromhex("16030100f5010000f10303") + b"\x00" * 64,  # a TLS ClientHello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 prior knowledge
        b"GET /health\r\n\r\n",  # HTTP/0.9
        b"GET /health HTTP/1.1\nHost: gw\n\n",  # bare LF
        b"GET /health HTTP/3.0\r\nHost: gw\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    ],
    ids=["garbage", "tls", "h2", "http0.9", "bare-lf", "http3", "cl-and-te", "two-hosts"],
)
async def test_non_http1_gets_400_and_close_at_once(gw_url: str, data: bytes) -> None:
    status, _, took = await exchange(gw_url, data)
    assert status == 400 and took < 0.5


@pytest.mark.parametrize("path", ["/v1/completions", "/workers"])
async def test_oversized_length_is_413_from_the_head(gw_url: str, path: str) -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: 99999999\r\n\r\n".encode()
    status, got, took = await exchange(gw_url, head)  # no body sent at all
    assert status == 413 and took < 0.5 and b"Connection: close" in got


@pytest.mark.parametrize(
    "data,why",
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Le", "head"),
        (b"GET /health HTTP/1.1\r\nHost: gw\r\n", "head"),
        (b'POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{"model"', "body"),
        (b"POST /workers HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "body"),
    ],
    ids=["inference-head", "relayed-head", "short-body", "endless-chunks"],
)
async def test_slow_heads_and_bodies_get_408(gw_url: str, data: bytes, why: str) -> None:
    status, got, took = await exchange(gw_url, data)
    assert status == 408 and why.encode() in got and 0.5 < took < 3


async def test_connections_are_timed_out_whoever_answers(gw_url: str) -> None:
    # A new connection that sends nothing, and an idle one after a relayed answer, are closed.
    _, got, took = await exchange(gw_url, b"")
    assert got == b"" and took < 3
    status, got, took = await exchange(gw_url, get())
    assert status == 200 and 0.5 < took < 3


async def test_a_client_that_closes_cancels_its_request(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    """A client's close is seen while its request is served (whole, no byte sent yet): the worker's request
    is cancelled at once, as SMG (hyper) does; a half-close counts as leaving."""
    [w] = await mock_workers(1, latency_secs=30)
    gw = await gateway(worker_urls=[w.url])
    host, port = base_url(gw).removeprefix("http://").split(":")
    writers = []
    for _ in range(5):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(post())
        writers.append(writer)
    await wait_for(lambda: w.active == 5, 10, "the requests to reach the worker")
    for writer in writers:
        writer.close()  # FIN, no byte of the answer received
    await wait_for(lambda: w.active == 0, 2, "the worker's requests to be cancelled")
    assert w.cancelled == 5


async def test_expect_continue_and_chunked_upload(gw_url: str) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%b\r\n" % (len(BODY[i : i + 5]), BODY[i : i + 5]) for i in range(0, len(BODY), 5))
    status, got, _ = await exchange(gw_url, head + body + b"0\r\n\r\n")
    assert status == 100 and b"HTTP/1.1 200 OK" in got and b"tok0 tok1 tok2" in got
    status, got, _ = await exchange(gw_url, post("Expect: something-else\r\n"))
    assert status == 417
    # A chunked body over --max-payload-size: 413 as soon as it passes the limit.
    big = b"%x\r\n%b\r\n" % (20_000, b"x" * 20_000)
    status, _, _ = await exchange(
        gw_url, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" + big
    )
    assert status == 413


async def test_http10_stream_ends_with_the_connection(gw_url: str) -> None:
    stream = orjson.dumps({"model": "mock-model", "prompt": "hi", "max_tokens": 2, "stream": True})
    data = (f"POST /v1/completions HTTP/1.0\r\nContent-Length: {len(stream)}\r\n\r\n").encode() + stream
    status, got, _ = await exchange(gw_url, data)
    head, body = got.split(b"\r\n\r\n", 1)
    assert status == 200 and b"chunked" not in head.lower() and body.rstrip().endswith(b"data: [DONE]")


UPGRADES = [
    get(
        "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n"
    ),
    post("Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"),
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
]


@pytest.mark.parametrize(
    "data,want", list(zip(UPGRADES, [400, 400, 501], strict=True)), ids=["websocket", "h2c", "connect"]
)
@pytest.mark.parametrize("port", ["service", "metrics"])
async def test_upgrades_and_connect_are_answered_at_once_and_closed(
    mock_workers: MakeWorkers, gateway: MakeGateway, data: bytes, want: int, port: str
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    url = base_url(gw) if port == "service" else f"http://127.0.0.1:{gw.config.prometheus_port}"
    status, got, took = await exchange(url, data, timeout=5)  # reads until the gateway closes
    assert status == want and took < 1, got[:300]
    assert b"Connection: close" in got
    message = orjson.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert ("CONNECT" in message) if want == 501 else ("upgrade" in message)
    if port == "service":
        assert not w.received  # never relayed to a worker


async def test_an_upgrade_after_pipelined_requests_is_answered_in_turn(gw_url: str) -> None:
    status, got, took = await exchange(gw_url, get() + post() + UPGRADES[0], timeout=5)
    assert status == 200 and took < 1
    assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b"HTTP/1.1 400 Bad Request") == 1
    assert got.rstrip().endswith(b"}")  # the 400 is the last answer, then the close


@pytest.mark.parametrize(
    "pieces",
    [[b"GET /health\r\n"], [b"GET /health\n"], [b"GET /heal", b"th\r\n"], [b"GET /health", b"\r\n"]],
    ids=["crlf", "lf", "split-target", "split-eol"],
)
async def test_http09_request_line_gets_400_at_once(gw_url: str, pieces: list[bytes]) -> None:
    """A 0.9 client never sends a blank line: the versionless request line alone is refused."""
    host, port = gw_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    try:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        got = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert got.startswith(b"HTTP/1.1 400 ") and b"HTTP/0.9" in got and time.monotonic() - t0 < 0.5


async def test_request_targets_that_look_like_09_are_still_served(gw_url: str) -> None:
    # A request line split right after its target, then its version: HTTP/1.1, served.
    host, port = gw_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for piece in (b"GET /health", b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        got = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert got.startswith(b"HTTP/1.1 200 ")


async def test_a_client_that_stops_reading_its_stream_is_cut_off(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    """Writing has a deadline too: a client that takes nothing of its answer for the body timeout is cut
    off, and its request on the worker is cancelled (it no longer holds a generation forever)."""
    [w] = await mock_workers(1, stream_chunks=1_000_000)
    gw = await gateway(worker_urls=[w.url], http_body_timeout_secs=0.6)
    host, port = base_url(gw).removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    body = orjson.dumps({"model": "mock-model", "prompt": "hello", "max_tokens": 1_000_000, "stream": True})
    await asyncio.get_running_loop().sock_sendall(sock, post(body=body))
    try:
        await wait_for(lambda: w.active == 1, 5, "the stream to start")
        await wait_for(lambda: w.active == 0, 10, "the stalled stream to be cut off")
        assert w.cancelled == 1
    finally:
        sock.close()


async def test_a_slow_reader_gets_its_whole_stream_in_order(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    """A client that reads slowly makes the gateway pause (its send buffer fills, the worker's stream waits
    in the gateway's buffer and then on TCP) and resume: every event arrives once, in order."""
    n = 8_000
    [w] = await mock_workers(1, stream_chunks=n)
    gw = await gateway(worker_urls=[w.url])
    host, port = base_url(gw).removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    body = orjson.dumps({"model": "mock-model", "prompt": "hello", "max_tokens": n, "stream": True})
    await loop.sock_sendall(sock, post(body=body, extra="Connection: close\r\n"))
    got = bytearray()
    try:
        while True:
            piece = await asyncio.wait_for(loop.sock_recv(sock, 2048), 20)
            if not piece:
                break
            got += piece
            if len(got) < 150_000:
                await asyncio.sleep(0.001)  # slow at first: the gateway's writes pause several times
    finally:
        sock.close()
    head, _, chunked = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head.lower()
    text = bytearray()
    while True:  # de-chunk
        size_line, _, rest = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        text += rest[:size]
        chunked = rest[size + 2 :]
    words = [orjson.loads(e[6:])["choices"][0]["text"] for e in bytes(text).split(b"\n\n") if e.startswith(b"data: {")]
    assert words == [f"tok{i} " for i in range(n)]
    assert text.endswith(b"data: [DONE]\n\n")
