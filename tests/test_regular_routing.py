"""Regular mode end to end: a real gateway in front of real mock workers on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import openai
import orjson
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, wait_for

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_round_robin_spreads_non_streaming_completions(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers])
    seen = Counter()
    for _ in range(6):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
            body = await r.json()
            assert body["choices"][0]["text"] == "tok0 tok1 tok2"
            seen[r.headers["x-mock-worker"]] += 1
    assert seen == {"w0": 3, "w1": 3}
    # The body reached the worker untouched.
    assert workers[0].received[0]["body"] == COMPLETION


@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", CHAT), ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})],
)
async def test_chat_and_generate_are_proxied(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession, path: str, body: dict
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(base_url(gw) + path, json=body) as r:
        assert r.status == 200, await r.text()
    assert w.received[-1]["path"] == path


async def test_stream_is_relayed_as_it_arrives(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, stream_chunks=5, chunk_interval_secs=0.3)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "max_tokens": 5, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        # The first event reached us while the worker was still producing the rest: not buffered.
        assert w.active == 1
        rest = await r.content.read()
    events = [line for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 6


async def test_request_id_is_taken_echoed_and_sent_upstream(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(
        base_url(gw) + "/v1/completions", json=COMPLETION, headers={"X-Correlation-ID": "abc-123"}
    ) as r:
        assert r.headers["x-request-id"] == "abc-123"
    assert w.received[-1]["headers"]["x-request-id"] == "abc-123"
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        generated = r.headers["x-request-id"]
    assert len(generated) >= 16
    assert w.received[-1]["headers"]["x-request-id"] == generated


def _assert_openai_error(body: bytes) -> dict:
    err = orjson.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["message"]
    return err


async def test_client_errors_are_openai_shaped(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], max_payload_size=1000)
    url = base_url(gw)
    async with http.post(url + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert _assert_openai_error(await r.read())["code"] == "invalid_json"
        assert r.headers["x-request-id"]
    async with http.post(url + "/v1/chat/completions", json={"model": "m"}) as r:
        assert r.status == 400
        _assert_openai_error(await r.read())
    async with http.post(url + "/v1/completions", json={"prompt": "x" * 5000}) as r:
        assert r.status == 413
        assert "1000 bytes" in _assert_openai_error(await r.read())["message"]
    async with http.get(url + "/v1/nope") as r:
        assert r.status == 404
        _assert_openai_error(await r.read())
    # Nothing of that reached the worker.
    assert len(w.received) == 0


async def test_no_healthy_worker_is_503(gateway: MakeGateway, http: aiohttp.ClientSession) -> None:
    gw = await gateway()
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 503
        assert _assert_openai_error(await r.read())["code"] == "no_available_workers"


async def test_refused_connection_is_502(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], disable_retries=True, disable_health_check=True)
    await w.stop()
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 502
        _assert_openai_error(await r.read())


async def test_reset_connection_is_502(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, drop_connection=True)
    gw = await gateway(worker_urls=[w.url], disable_retries=True)
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 502
        assert _assert_openai_error(await r.read())["type"] == "upstream_error"


async def test_upstream_timeout_is_504(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, hang=True)
    gw = await gateway(worker_urls=[w.url], request_timeout_secs=0.5, disable_retries=True)
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 504
        assert _assert_openai_error(await r.read())["code"] == "upstream_timeout"
    # The gateway gave up on the worker's request too.
    await wait_for(lambda: w.active == 0, what="the hung upstream request to be closed")


async def test_upstream_error_status_is_passed_through(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, fail_status=400)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 400
        assert "mock failure" in _assert_openai_error(await r.read())["message"]


async def test_client_disconnect_mid_stream_closes_upstream(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1, stream_chunks=50, chunk_interval_secs=0.1)
    gw = await gateway(worker_urls=[w.url])
    async with aiohttp.ClientSession() as session:
        r = await session.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "max_tokens": 50, "stream": True})
        await r.content.readline()
        assert w.active == 1
        r.close()  # the client goes away mid-stream
    await wait_for(lambda: w.active == 0, what="the upstream stream to be closed")
    assert w.cancelled == 1
    await wait_for(lambda: gw.gateway.active_requests == 0, what="the gateway to forget the request")
    assert all(x.in_flight == 0 for x in gw.gateway.registry)


async def test_info_and_health_routes(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers])
    url = base_url(gw)
    for path in ("/health", "/liveness", "/readiness"):
        async with http.get(url + path) as r:
            assert r.status == 200, path
    async with http.get(url + "/v1/models") as r:
        models = await r.json()
    assert [m["id"] for m in models["data"]] == ["mock-model"]
    async with http.get(url + "/get_server_info") as r:
        info = await r.json()
    assert info["mode"] == "regular"
    assert {w["url"] for w in info["workers"]} == {w.url for w in workers}


async def test_readiness_is_503_without_workers(gateway: MakeGateway, http: aiohttp.ClientSession) -> None:
    gw = await gateway()
    async with http.get(base_url(gw) + "/readiness") as r:
        assert r.status == 503
    async with http.get(base_url(gw) + "/liveness") as r:
        assert r.status == 200


async def test_openai_client_against_the_gateway(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers])
    client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key="unused", max_retries=0)
    try:
        c = await client.completions.create(model="mock-model", prompt="hello", max_tokens=2)
        assert c.choices[0].text == "tok0 tok1"
        chat = await client.chat.completions.create(
            model="mock-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices[0].message.content == "tok0 tok1 tok2"
        pieces = []
        stream = await client.chat.completions.create(
            model="mock-model", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
        assert "".join(pieces) == "tok0 tok1 tok2 "
        text = []
        async for chunk in await client.completions.create(model="mock-model", prompt="x", max_tokens=2, stream=True):
            text.append(chunk.choices[0].text)
        assert "".join(text) == "tok0 tok1 "
    finally:
        await client.close()


async def test_concurrent_requests_all_complete(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(3, latency_secs=0.05)
    gw = await gateway(worker_urls=[w.url for w in workers])

    async def one(i: int) -> int:
        async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": i % 2 == 0}) as r:
            await r.read()
            return r.status

    statuses = await asyncio.gather(*(one(i) for i in range(60)))
    assert statuses == [200] * 60
    assert sum(w.served for w in workers) == 60
    assert all(w.in_flight == 0 for w in gw.gateway.registry)


async def test_unknown_model_is_404(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "model": "gpt-99"}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and "mock-model" in err["message"]
    assert len(w.received) == 0


async def test_tls_serves_https(mock_workers: MakeWorkers, gateway: MakeGateway, tmp_path) -> None:
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], tls_cert_path=str(cert), tls_key_path=str(key))
    ctx = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession() as s:
        https = f"https://127.0.0.1:{gw.config.port}"
        async with s.post(https + "/v1/completions", json=COMPLETION, ssl=ctx) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "tok0 tok1 tok2"
        # On the same TLS connection: a route relayed to aiohttp, then inference again.
        async with s.get(https + "/health", ssl=ctx) as r:
            assert r.status == 200
        async with s.post(https + "/v1/completions", json={**COMPLETION, "stream": True}, ssl=ctx) as r:
            assert r.status == 200 and (await r.read()).rstrip().endswith(b"data: [DONE]")
        assert len(gw.door.connections) == 1  # one connection served all three
        with pytest.raises(aiohttp.ClientError):  # plain HTTP is not served on a TLS port
            async with s.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
                await r.read()
