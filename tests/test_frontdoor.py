"""The front door: every client connection; inference served itself, every other request relayed to aiohttp.

Raw sockets on loopback, so the bytes on the wire are what is checked: framing, pipelining, keep-alive,
relayed routes on the same connection, and malformed requests refused rather than guessed.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

BODY = orjson.dumps({"model": "mock-model", "prompt": "hello", "max_tokens": 3})


def post(path: str = "/v1/completions", body: bytes = BODY, extra: str = "", version: str = "HTTP/1.1") -> bytes:
    return (
        f"POST {path} {version}\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, lower-cased headers, de-chunked body."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if status < 200:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


async def connect(gw_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw_url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


@pytest.mark.timeout(30)
async def test_keep_alive_and_pipelined_requests_answered_in_order(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers])
    reader, writer = await connect(base_url(gw))
    # Three requests in one write (pipelined), the last one streamed.
    stream = orjson.dumps({"model": "mock-model", "prompt": "hi", "max_tokens": 3, "stream": True})
    writer.write(post() + post("/generate", orjson.dumps({"text": "hi"})) + post(body=stream))
    answers = [await read_response(reader) for _ in range(3)]
    assert [a[0] for a in answers] == [200, 200, 200]
    assert orjson.loads(answers[0][2])["choices"][0]["text"] == "tok0 tok1 tok2"
    assert answers[0][1]["content-type"] == "application/json"
    assert answers[0][1]["x-request-id"] and "date" in answers[0][1]
    assert answers[2][1]["content-type"].startswith("text/event-stream")
    assert answers[2][2].endswith(b"data: [DONE]\n\n")
    # Still the same connection: one more request on it.
    writer.write(post())
    assert (await read_response(reader))[0] == 200
    writer.close()


@pytest.mark.timeout(30)
async def test_body_arriving_in_pieces_and_connection_close(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    reader, writer = await connect(base_url(gw))
    data = post(extra="Connection: close\r\n")
    for i in range(0, len(data), 7):
        writer.write(data[i : i + 7])
        await writer.drain()
        await asyncio.sleep(0.005)
    status, headers, _body = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await reader.read() == b""  # the gateway closed the connection
    assert w.received[-1]["body"]["prompt"] == "hello"


@pytest.mark.timeout(30)
async def test_other_routes_are_relayed_on_the_same_connection(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    reader, writer = await connect(base_url(gw))
    writer.write(post())  # front door
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")  # relayed to aiohttp...
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body) == {"status": "ok"}
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    status_line = await reader.readline()
    assert b" 200 " in status_line
    while await reader.readline() != b"\r\n":
        pass
    writer.write(post(extra="x-request-id: after-relay\r\n"))  # ...and the door still serves inference
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["x-request-id"] == "after-relay"
    assert orjson.loads(body)["choices"][0]["text"] == "tok0 tok1 tok2"
    stream = orjson.dumps({"model": "mock-model", "prompt": "hi", "max_tokens": 2, "stream": True})
    writer.write(post(body=stream))
    status, _, body = await read_response(reader)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    writer.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "request_bytes",
    [
        # A chunked upload, HTTP/1.0, and Expect: 100-continue.
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY),
        post(version="HTTP/1.0"),
        post(extra="Expect: 100-continue\r\n"),
    ],
    ids=["chunked-upload", "http-1.0", "expect-continue"],
)
async def test_uncommon_requests_are_served(
    mock_workers: MakeWorkers, gateway: MakeGateway, request_bytes: bytes
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    reader, writer = await connect(base_url(gw))
    writer.write(request_bytes)
    status, _, body = await read_response(reader)
    if status == 100:  # the interim answer to Expect, then the real one
        status, _, body = await read_response(reader)
    assert status == 200, body
    assert orjson.loads(body)["choices"][0]["text"] == "tok0 tok1 tok2"
    writer.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nx-request-id: a\nb\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length : 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: -2\r\n\r\n{}",
    ],
    ids=["bare-lf", "space-before-colon", "two-lengths", "negative-length"],
)
async def test_malformed_heads_are_refused_not_guessed(
    mock_workers: MakeWorkers, gateway: MakeGateway, head: bytes
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    reader, writer = await connect(base_url(gw))
    writer.write(head)
    status, _, _ = await read_response(reader)
    assert status == 400
    assert not w.received
    writer.close()


@pytest.mark.timeout(30)
async def test_errors_are_openai_shaped_and_too_large_is_413(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], max_payload_size=1000)
    reader, writer = await connect(base_url(gw))
    writer.write(post(body=b"{not json", extra="x-request-id: bad-1\r\n"))
    status, headers, body = await read_response(reader)
    assert status == 400 and headers["x-request-id"] == "bad-1"
    assert orjson.loads(body)["error"]["code"] == "invalid_json"
    writer.write(post(body=orjson.dumps({"model": "mock-model", "prompt": "x" * 2000})))
    status, _, body = await read_response(reader)
    assert status == 413 and orjson.loads(body)["error"]["type"] == "invalid_request_error"
    writer.close()
    # The worker saw none of it, and the books are balanced.
    assert not w.received
    async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as r:
        text = await r.text()
    assert 'mesh_http_responses_total{path="/v1/completions",status_code="400"} 1.0' in text
    assert "mesh_http_connections_active 0.0" in text


@pytest.mark.timeout(30)
async def test_idle_keep_alive_connections_are_closed(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], http_keepalive_timeout_secs=0.3)
    reader, writer = await connect(base_url(gw))
    writer.write(post())
    assert (await read_response(reader))[0] == 200
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sweep
    await wait_for(lambda: not gw.door.connections, what="connection forgotten")


@pytest.mark.timeout(30)
async def test_client_gone_mid_request_cancels_and_frees_everything(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [w] = await mock_workers(1, stream_chunks=50, chunk_interval_secs=0.1)
    gw = await gateway(worker_urls=[w.url])
    reader, writer = await connect(base_url(gw))
    stream = orjson.dumps({"model": "mock-model", "prompt": "hi", "max_tokens": 50, "stream": True})
    writer.write(post(body=stream))
    await reader.readline()  # the status line: the stream started
    writer.transport.abort()
    await wait_for(lambda: w.active == 0, what="upstream leg closed")
    await wait_for(lambda: gw.gateway.active_requests == 0, what="request finished")
    assert all(x.in_flight == 0 for x in gw.gateway.registry)
