"""The native stream relay (atomesh/splice.c): what the client gets and what the token meter counts are what
the Python relay gives for the same bytes, however the worker's writes are cut; and a gateway stream goes
through it, answering and counting as the Python relay does."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from atomesh import splice
from atomesh.metrics import Metrics, RequestMeter
from tests.gwtest import MakeGateway, MakeWorkers, base_url

pytestmark = pytest.mark.timeout(60)

SPLICE = splice.load()
EVENTS = (
    [b'data: {"choices":[{"text":""}]}\n\n']
    + [b'data: {"choices":[{"text":"t%d"}]}\n\n' % i for i in range(20)]
    + [b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":20}}\n\n', b"data: [DONE]\n\n"]
)


CHAT = (
    [
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":""}}]}\n\n',
        b'data: {"choices":[{"delta":{"content" : "a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n',
    ]
    + [b'data: {"choices":[{"delta":{"content":"c%d"}}]}\n\n' % i for i in range(12)]
    + [b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":14}}\n\ndata: [DONE]\n\n']
)


def chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x;ext=1\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\nx-trailer: 1\r\n\r\n"


def framed(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)


class Client:
    def __init__(self) -> None:
        self.sent = 0
        self.spilled: list[bytes] = []

    def spill(self, data: bytes) -> bool:
        self.spilled.append(data)
        return True


def run_splice(raw: bytes, cuts: list[int], meter: RequestMeter | None) -> tuple[Any, bytes]:
    """Feed `raw` to a Splice through a socket pair, cut at `cuts`; what the client's socket received."""
    assert SPLICE is not None, "the native relay did not build (cc and Python.h are needed)"
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    for s in (worker_in, worker_out, client_in, client_out):
        s.setblocking(False)
    stops: list[int] = []
    relay = SPLICE.Splice(
        os.dup(worker_out.fileno()),
        os.dup(client_in.fileno()),
        meter is not None,
        lambda: stops.append(1),
        Client().spill,
    )
    got = b""
    try:
        start = 0
        for end in [*cuts, len(raw)]:
            worker_in.send(raw[start:end])
            start = end
            relay.step()
            try:
                got += client_out.recv(1 << 20)
            except BlockingIOError:
                pass  # a read that ended inside a chunk's size line: nothing to relay yet
        assert stops == [1]
    finally:
        relay.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()
    if meter is not None and (counts := relay.counts()) is not None:
        meter.counted(*counts)
    return relay, got


@pytest.mark.parametrize("events", [EVENTS, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("seed", range(6))
def test_spliced_stream_reads_and_counts_as_the_python_relay(seed: int, events: list[bytes]) -> None:
    rng = random.Random(seed)
    raw = chunked(events)
    cuts = sorted(rng.sample(range(1, len(raw)), 12))
    spliced = RequestMeter(Metrics([1.0]), "completions", "m", True)
    relay, got = run_splice(raw, cuts, spliced)
    assert relay.state == splice.DONE and not relay.extra

    # The Python relay hands on each read's body pieces (the parser's on_body), framed one by one.
    pieces: list[bytes] = []
    start = 0
    for end in [*cuts, len(raw)]:
        pieces += _decoded_pieces(raw, start, end)
        start = end
    assert got == framed(pieces)
    assert relay.sent == sum(len(e) for e in events)
    python = RequestMeter(Metrics([1.0]), "completions", "m", True)
    for p in pieces:
        python.feed(p)
    for m in (spliced, python):
        m.finish()
    assert (spliced.events, spliced.usage_out, spliced.usage_in) == (python.events, python.usage_out, python.usage_in)
    assert spliced._end == python._end and spliced._tail == python._tail
    assert spliced.first_at is not None and spliced.last_at >= spliced.first_at


def _decoded_pieces(raw: bytes, start: int, end: int) -> list[bytes]:
    """The chunk data of raw[start:end], one piece per chunk it touches (what llhttp's on_body gives)."""
    out: list[bytes] = []
    at = 0
    while True:
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end].split(b";")[0], 16)
        if size == 0:
            return out
        data_at = line_end + 2
        lo, hi = max(start, data_at), min(end, data_at + size)
        if lo < hi:
            out.append(raw[lo:hi])
        at = data_at + size + 2


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        (b"5\r\nhello\r\n", splice.EOF),
        (b"zz\r\n", splice.PROTOCOL_ERROR),
        (b"5\r\nhelloXX", splice.PROTOCOL_ERROR),
        (b"0\r\n\r\nHTTP/1.1", splice.DONE),
    ],
)
def test_splice_stops_on_a_broken_body(raw: bytes, state: int) -> None:
    assert SPLICE is not None
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    relay = SPLICE.Splice(os.dup(worker_out.fileno()), os.dup(client_in.fileno()), False, lambda: None, Client().spill)
    try:
        worker_in.send(raw)
        if state == splice.EOF:
            worker_in.shutdown(socket.SHUT_WR)
        relay.step()
        if relay.state == splice.RUNNING:
            relay.step()  # the end of the stream, read on its own
        assert relay.state == state
        if state == splice.DONE:
            assert relay.extra  # bytes after the response: the connection is not reused
    finally:
        relay.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()


async def test_gateway_streams_through_the_native_relay_as_through_python(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [w] = await mock_workers(1, stream_chunks=6, chunk_interval_secs=0.02)
    gw = await gateway(worker_urls=[w.url])
    pool = gw.gateway.upstream._pool
    assert pool is not None and pool.splice is not None
    bodies, tokens = [], [0.0]
    async with aiohttp.ClientSession() as http:
        for native in (True, False):
            pool.splice = SPLICE if native else None
            async with http.post(
                base_url(gw) + "/v1/completions",
                json={"model": "mock-model", "prompt": "hi", "max_tokens": 6, "stream": True},
            ) as r:
                assert r.status == 200
                bodies.append(await r.read())
            async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as r:
                lines = (await r.text()).splitlines()
            out = [x for x in lines if x.startswith("mesh_router_tokens_total") and 'token_type="output"' in x]
            tokens.append(float(out[0].rsplit(" ", 1)[1]))
    assert [_events(b) for b in bodies] == [_events(bodies[1])] * 2 and bodies[0].endswith(b"data: [DONE]\n\n")
    assert tokens[1] - tokens[0] == tokens[2] - tokens[1] > 0


def _events(body: bytes) -> list[object]:
    """The stream's events, less what differs between two answers (their id and time)."""
    out: list[object] = []
    for line in body.split(b"\n\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            event.pop("id", None)
            event.pop("created", None)
            out.append(event)
        elif line:
            out.append(line)
    return out


def test_without_a_compiler_the_reason_is_given_and_a_cached_build_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = splice.build(tmp_path)
    assert built.module is not None, built.why_not
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    assert splice.build(tmp_path).module is not None  # built before: no compiler needed
    missing = splice.build(tmp_path / "empty")
    assert missing.module is None and "no C compiler" in missing.why_not


def test_the_relay_thread_relays_counts_and_reports_the_end() -> None:
    assert SPLICE is not None
    raw = chunked(CHAT)
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    for s in (worker_out, client_in):
        s.setblocking(False)
    relayer = SPLICE.Relayer()
    stops: list[int] = []
    relay = SPLICE.Splice(os.dup(worker_out.fileno()), os.dup(client_in.fileno()), True, lambda: stops.append(1), None)
    try:
        relayer.add(relay)
        assert relay.threaded
        got = b""
        for i in range(0, len(raw), 97):  # the thread reads as the bytes come
            worker_in.send(raw[i : i + 97])
        client_out.settimeout(10)
        while not got.endswith(b"data: [DONE]\n\n\r\n"):
            got += client_out.recv(1 << 16)
        deadline = time.monotonic() + 10
        while not stops and time.monotonic() < deadline:
            select.select([relayer.notify_fd], [], [], 1)
            relayer.collect()
        assert stops == [1] and relay.state == splice.DONE and not relay.threaded
        assert b"".join(_decoded_body(got)) == b"".join(CHAT)
        meter = RequestMeter(Metrics([1.0]), "chat", "m", True)
        meter.counted(*relay.counts())
        meter.finish()
        assert (meter.events, meter.usage_out) == (15, 14)  # the usage event is a JSON event too
    finally:
        relay.cancel()
        relay.close()
        relayer.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()


def test_a_splice_taken_back_from_the_thread_is_not_reported() -> None:
    assert SPLICE is not None
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    relayer = SPLICE.Relayer()
    stops: list[int] = []
    relay = SPLICE.Splice(os.dup(worker_out.fileno()), os.dup(client_in.fileno()), False, lambda: stops.append(1), None)
    try:
        relayer.add(relay)
        relay.cancel()  # as a cancelled request's coroutine does
        relay.close()
        worker_in.send(b"5\r\nhello\r\n")
        select.select([relayer.notify_fd], [], [], 5)
        relayer.collect()
        assert stops == [] and not relay.threaded
    finally:
        relayer.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()


def _decoded_body(framed_bytes: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(framed_bytes):
        end = framed_bytes.index(b"\r\n", at)
        size = int(framed_bytes[at:end], 16)
        out.append(framed_bytes[end + 2 : end + 2 + size])
        at = end + 2 + size + 2
    return out


def test_a_slow_client_moves_the_rest_of_the_stream_through_its_transport() -> None:
    assert SPLICE is not None
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    client_in.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    for s in (worker_in, worker_out, client_in):
        s.setblocking(False)
    relayer = SPLICE.Relayer()
    spilled: list[bytes] = []
    relay = SPLICE.Splice(
        os.dup(worker_out.fileno()),
        os.dup(client_in.fileno()),
        False,
        lambda: None,
        lambda d: spilled.append(d) is None,
    )
    body = [bytes([65 + i]) * 30000 for i in range(4)]
    raw = chunked(body)
    try:
        relayer.add(relay)
        worker_in.send(raw[:40000])  # more than the client's socket takes while it does not read
        deadline = time.monotonic() + 10
        while relay.threaded and time.monotonic() < deadline:
            select.select([relayer.notify_fd], [], [], 1)
            relayer.collect()
        assert relay.state == splice.PAUSED
        pending = relay.take_pending()  # the loop sends it through the client's transport
        relay.to_loop()
        sent_rest = 40000
        while relay.state == splice.RUNNING and sent_rest < len(raw):
            try:
                sent_rest += worker_in.send(raw[sent_rest : sent_rest + 65536])
            except BlockingIOError:
                pass
            relay.step()
        while relay.state == splice.RUNNING:
            relay.step()
        assert relay.state == splice.DONE
        direct = b""
        client_out.setblocking(False)
        while True:
            try:
                direct += client_out.recv(1 << 20)
            except BlockingIOError:
                break
        assert b"".join(_decoded_body(direct + pending + b"".join(spilled))) == b"".join(body)
    finally:
        relay.cancel()
        relay.close()
        relayer.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()


def test_a_stream_still_running_when_the_relay_thread_stops_is_released_by_its_request() -> None:
    assert SPLICE is not None
    worker_in, worker_out = socket.socketpair()
    client_in, client_out = socket.socketpair()
    relayer = SPLICE.Relayer()
    relay = SPLICE.Splice(os.dup(worker_out.fileno()), os.dup(client_in.fileno()), False, lambda: None, None)
    try:
        relayer.add(relay)
        relayer.close()  # the pool closed with the stream in flight
        assert relay.threaded and relay.state == splice.RUNNING
        relay.cancel()  # its request's coroutine, cancelled in turn
        assert not relay.threaded
    finally:
        relay.close()
        for s in (worker_in, worker_out, client_in, client_out):
            s.close()
