"""What a user meets past the first requests: headers, cache flushes, the Responses API, error and
disconnect accounting, the metrics port's address."""

from __future__ import annotations

import asyncio

import aiohttp
from gwtest import MakeGateway, MakeWorkers, base_url, free_port, wait_for
from test_metrics import scrape, value

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}


async def test_streamed_answers_carry_each_header_once(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    [p] = await mock_workers(1, pd_backend="atom", pd_role="prefill", kv_role="kv_producer")
    [d] = await mock_workers(1, pd_backend="atom", pd_role="decode", kv_role="kv_consumer")
    pd = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url])
    for server in (gw, pd):
        async with http.post(base_url(server) + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            await r.read()
            for name in ("Content-Type", "Cache-Control", "x-request-id"):
                assert len(r.headers.getall(name)) == 1, (name, list(r.headers.items()))
            assert r.headers["Content-Type"] == "text/event-stream"


async def test_flush_cache_tells_unsupported_from_failed(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2, missing_routes=["/flush_cache"])
    gw = await gateway(worker_urls=[w.url for w in workers])
    async with http.post(base_url(gw) + "/flush_cache") as r:
        body = await r.json()
        assert r.status == 501 and body["status"] == "unsupported", body
        assert "flush_cache" in body["message"]
    workers[0].behaviour.missing_routes = []
    async with http.post(base_url(gw) + "/flush_cache") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"  # one flushed, one has no cache to flush
    await workers[1].stop()  # unreachable: a real failure
    async with http.post(base_url(gw) + "/flush_cache") as r:
        assert r.status == 502 and (await r.json())["status"] == "partial"


async def test_responses_api_is_relayed_and_split_in_pd_by_the_atom_backend_only(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url])
    body = {"model": "mock-model", "input": "Say hi", "max_output_tokens": 2}
    async with http.post(base_url(gw) + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
    assert w.received[-1]["path"] == "/v1/responses" and w.received[-1]["body"]["input"] == "Say hi"
    async with http.post(base_url(gw) + "/v1/responses", json={**body, "max_output_tokens": -1}) as r:
        assert r.status == 400 and "max_output_tokens" in (await r.json())["error"]["message"]
    async with http.post(base_url(gw) + "/v1/responses", json={"model": "mock-model"}) as r:
        assert r.status == 400 and "input" in (await r.json())["error"]["message"]
    # A worker without the route: its 404 reaches the client as it was.
    w.behaviour.missing_routes = ["/v1/responses"]
    async with http.post(base_url(gw) + "/v1/responses", json=body) as r:
        assert r.status == 404
    [p] = await mock_workers(1, kv_role="kv_producer")
    [d] = await mock_workers(1, kv_role="kv_consumer")
    # P/D with the atom backend: tests/test_pd_engine.py runs it through real engines. Other backends'
    # engines take no kv_transfer_params on the route: 501, naming why.
    pd = await gateway(pd_disaggregation=True, backend="vllm", prefill=[{"url": p.url}], decode=[d.url])
    async with http.post(base_url(pd) + "/v1/responses", json=body) as r:
        err = (await r.json())["error"]
        assert r.status == 501 and err["code"] == "route_not_served" and "--backend atom" in err["message"]


async def test_gateway_refusals_count_as_request_errors(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, latency_secs=0.3)
    gw = await gateway(worker_urls=[w.url], max_concurrent_requests=1, queue_size=0)
    url = base_url(gw) + "/v1/completions"
    async with http.post(url, json={**COMPLETION, "max_tokens": -1}) as r:
        assert r.status == 400
    async with http.post(url, json={**COMPLETION, "model": "no-such-model"}) as r:
        assert r.status == 404
    slow = asyncio.ensure_future(http.post(url, json=COMPLETION))
    await wait_for(lambda: w.active == 1, what="the first request on the worker")
    async with http.post(url, json={"prompt": "no model named", "max_tokens": 1}) as r:
        assert r.status == 429
    (await slow).release()
    text = await scrape(http, gw)
    errors = "mesh_router_request_errors_total"
    assert value(text, errors, endpoint="completions", error_type="invalid_value") == 1
    assert value(text, errors, error_type="model_not_found") == 1
    # A request naming no model is the one model the workers serve, and counts under its name.
    assert value(text, errors, error_type="queue_full", model="mock-model") == 1
    assert not [k for k in text.splitlines() if 'model=""' in k], "no empty model label"


async def test_a_stream_broken_after_its_first_byte_counts_as_an_error(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, stream_chunks=6, die_after_chunks=2)
    gw = await gateway(worker_urls=[w.url])
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status == 200
        assert b'"error"' in await r.read()  # ended in-band
    text = await scrape(http, gw)
    assert value(text, "mesh_router_request_errors_total", error_type="upstream_stream_broken") == 1


async def test_disconnected_streams_are_counted_as_responses(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, stream_chunks=50, chunk_interval_secs=0.05)
    gw = await gateway(worker_urls=[w.url])
    n = 8
    for _ in range(n):
        async with http.post(
            base_url(gw) + "/v1/completions", json={**COMPLETION, "max_tokens": 50, "stream": True}
        ) as r:
            assert r.status == 200
            await r.content.readany()  # then the client goes away mid-stream
    await wait_for(lambda: w.active == 0 and not gw.gateway.active_requests, what="the streams to be cut")
    text = await scrape(http, gw)
    path = "/v1/completions"
    assert value(text, "mesh_http_requests_total", path=path) == n
    assert value(text, "mesh_http_responses_total", path=path) == n
    assert value(text, "mesh_http_connections_active") == 0


async def test_cache_aware_hit_ratio_with_one_worker(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], policy="cache_aware")
    prompt = "a long shared system prompt that the cache-aware index should remember " * 8
    for _ in range(3):
        async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "prompt": prompt}) as r:
            assert r.status == 200
    text = await scrape(http, gw)
    assert value(text, "mesh_cache_aware_misses_total", worker_type="regular") == 1
    assert value(text, "mesh_cache_aware_hits_total", worker_type="regular") == 2


async def test_metrics_port_follows_host_unless_given(mock_workers: MakeWorkers, gateway: MakeGateway) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], prometheus_host=None, prometheus_port=free_port())
    [listener] = gw.metrics_door._listeners
    assert listener.sock.getsockname()[0] == "127.0.0.1"


RELAYED = {
    "/v1/embeddings": {"input": "hi"},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/rerank": {"query": "q", "documents": ["a"]},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/v1/classify": {"input": ["a"]},
    "/v1/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}


async def test_smg_relayed_routes_reach_the_worker_of_their_model(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    a, b = await mock_workers(1, models=["model-a"]), await mock_workers(1, models=["model-b"])
    gw = await gateway(worker_urls=[a[0].url, b[0].url])
    for path, body in RELAYED.items():
        async with http.post(base_url(gw) + path, json={**body, "model": "model-b"}) as r:
            assert r.status == 200 and (await r.json())["model"] == "model-b", (path, await r.text())
        assert b[0].received[-1]["path"] == path and b[0].received[-1]["body"] == {**body, "model": "model-b"}
    assert not [x for x in a[0].received if x["path"] in RELAYED]
    # Anthropic's Messages API streamed: its events arrive as the worker sent them.
    async with http.post(
        base_url(gw) + "/v1/messages", json={**RELAYED["/v1/messages"], "model": "model-a", "stream": True}
    ) as r:
        text = await r.text()
    assert r.status == 200 and text.count("event: ") == 3 and "event: message_stop" in text
    metrics = await scrape(http, gw)
    assert value(metrics, "mesh_router_requests_total", endpoint="messages", model="model-a", streaming="true") == 1
    assert value(metrics, "mesh_router_requests_total", endpoint="rerank", model="model-b") == 2
    # P/D mode: a 501 naming why.
    [p] = await mock_workers(1, kv_role="kv_producer")
    [d] = await mock_workers(1, kv_role="kv_consumer")
    pd = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url])
    for path, body in RELAYED.items():
        async with http.post(base_url(pd) + path, json={**body, "model": "mock-model"}) as r:
            err = (await r.json())["error"]
            assert r.status == 501 and f"POST {path} is relayed in regular mode only" in err["message"], err
