"""Prefill/decode disaggregation: the atom, sglang and vllm protocols against protocol-checking mocks."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, gateway_config, wait_for

from atomesh.app import GatewayServer
from atomesh.gateway import StartupError
from atomesh.testing.mock_worker import MockWorker

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}
CHAT = {
    "model": "mock-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "stream_options": {"include_usage": True},
}
BACKENDS = ["atom", "sglang", "vllm"]
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


async def pd_workers(
    mock_workers: MakeWorkers, backend: str, role: str, n: int = 1, **behaviour: Any
) -> list[MockWorker]:
    return await mock_workers(n, pd_backend=backend, pd_role=role, kv_role=KV_ROLE[role], **behaviour)


async def pd_setup(
    mock_workers: MakeWorkers,
    gateway: MakeGateway,
    backend: str,
    n_prefill: int = 1,
    n_decode: int = 1,
    prefill: dict | None = None,
    decode: dict | None = None,
    **settings: Any,
) -> tuple[GatewayServer, list[MockWorker], list[MockWorker]]:
    ps = await pd_workers(mock_workers, backend, "prefill", n_prefill, **(prefill or {}))
    ds = await pd_workers(mock_workers, backend, "decode", n_decode, **(decode or {}))
    gw = await gateway(
        pd_disaggregation=True,
        backend=backend,
        prefill=[{"url": p.url, "bootstrap_port": 8998 + i} for i, p in enumerate(ps)],
        decode=[d.url for d in ds],
        **settings,
    )
    return gw, ps, ds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stream", [False, True])
async def test_pd_round_trip(
    backend: str, stream: bool, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, [p], [d] = await pd_setup(mock_workers, gateway, backend)
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        async with http.post(base_url(gw) + path, json={**body, "stream": stream}) as r:
            text = await r.text()
            assert r.status == 200, text
            assert r.headers["x-mock-worker"] == d.name  # the client gets decode's reply
            if stream:
                assert text.rstrip().endswith("data: [DONE]")
        assert p.received[-1]["path"] == d.received[-1]["path"] == path
    # The mocks refuse (400) anything their protocol does not allow, so 200s mean the legs were right.
    assert len(p.received) == len(d.received) == 2
    await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.registry), what="load counters to return to 0")


async def test_atom_decode_gets_what_prefill_returned(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, [p], [d] = await pd_setup(mock_workers, gateway, "atom")
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        await r.read()
    sent = p.received[-1]["body"]
    assert sent["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "early_offer": True,
        "decode_max_tokens": 3,
    }
    assert (sent["max_tokens"], sent["stream"]) == (1, False)
    got = d.received[-1]["body"]
    assert got["stream"] is True and got["max_tokens"] == 3  # the client's own request
    params = got["kv_transfer_params"]
    assert params["transfer_id"] == "mock" and params["first_token_id"] == 7 and params["do_remote_prefill"]
    assert (params["remote_dp_size"], params["remote_tp_size"], params["remote_dp_rank"]) == (1, 1, 0)
    # Both legs carry the same request id.
    assert p.received[-1]["headers"]["x-request-id"] == d.received[-1]["headers"]["x-request-id"]


async def test_sglang_bootstrap_fields_and_batches(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, [p], [d] = await pd_setup(mock_workers, gateway, "sglang")
    async with http.post(base_url(gw) + "/generate", json={"text": "hi", "sampling_params": {}}) as r:
        assert r.status == 200
    pb, db = p.received[-1]["body"], d.received[-1]["body"]
    assert pb["bootstrap_room"] == db["bootstrap_room"]
    assert (pb["bootstrap_host"], pb["bootstrap_port"]) == ("127.0.0.1", 8998)
    async with http.post(base_url(gw) + "/generate", json={"text": ["a", "b", "c"], "sampling_params": {}}) as r:
        assert r.status == 200
    pb, db = p.received[-1]["body"], d.received[-1]["body"]
    assert len(pb["bootstrap_room"]) == 3 and pb["bootstrap_room"] == db["bootstrap_room"]
    assert pb["bootstrap_host"] == ["127.0.0.1"] * 3 and pb["bootstrap_port"] == [8998] * 3


async def test_atom_registration_checks_kv_role(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [p] = await pd_workers(mock_workers, "atom", "prefill")
    [d] = await pd_workers(mock_workers, "atom", "decode")
    [wrong] = await mock_workers(1, kv_role="kv_consumer")
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url])
    async with http.post(base_url(gw) + "/workers", json={"url": wrong.url, "worker_type": "prefill"}) as r:
        wid = (await r.json())["worker_id"]
    await wait_for(lambda: gw.gateway.registry.get(wid).state.value == "failed", what="registration to fail")
    async with http.get(base_url(gw) + "/workers/" + wid) as r:
        info = await r.json()
    assert "kv_role 'kv_consumer'" in info["error"] and "kv_producer" in info["error"]
    # Start-up with only a misconfigured prefill worker stops with that reason.
    server = GatewayServer(
        gateway_config(pd_disaggregation=True, backend="atom", prefill=[{"url": wrong.url}], decode=[d.url])
    )
    with pytest.raises(StartupError, match="kv_role"):
        await server.start()
    await server.close()


@pytest.mark.parametrize("backend", ["atom", "vllm"])
async def test_missing_kv_params_is_502_and_decode_is_never_called(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, [d] = await pd_setup(mock_workers, gateway, backend, prefill={"omit_kv_params": True})
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "prefill_missing_kv_transfer_params"
    assert len(d.received) == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_prefill_error_stops_the_decode_leg(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, [d] = await pd_setup(
        mock_workers, gateway, backend, prefill={"fail_status": 500}, decode={"latency_secs": 5}, disable_retries=True
    )
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 500
        assert "mock failure" in (await r.json())["error"]["message"]
    if backend == "sglang":
        await wait_for(lambda: d.active == 0, timeout=3, what="the decode leg to be cancelled")
        assert d.cancelled == 1
    else:
        assert len(d.received) == 0
    await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.registry), what="load counters to return to 0")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_decode_failure_before_first_byte_replans(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, [d0, d1] = await pd_setup(mock_workers, gateway, backend, n_decode=2, retry_max_retries=2)
    d0.behaviour.fail_status = 503
    for _ in range(4):
        async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["x-mock-worker"] == d1.name


@pytest.mark.parametrize("backend", BACKENDS)
async def test_decode_dying_mid_stream_ends_the_stream(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, _ = await pd_setup(mock_workers, gateway, backend, decode={"stream_chunks": 6, "die_after_chunks": 2})
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "max_tokens": 6, "stream": True}) as r:
        body = await asyncio.wait_for(r.read(), 10)
    assert b'"error"' in body and body.rstrip().endswith(b"data: [DONE]")
    await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.registry), what="load counters to return to 0")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_client_disconnect_closes_both_legs(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    gw, [p], [d] = await pd_setup(
        mock_workers, gateway, backend, decode={"stream_chunks": 100, "chunk_interval_secs": 0.05}
    )
    async with aiohttp.ClientSession() as s:
        r = await s.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "max_tokens": 100, "stream": True})
        await r.content.readline()
        r.close()
    await wait_for(lambda: d.active == 0 and p.active == 0, what="both legs to close")
    assert d.cancelled == 1
    await wait_for(lambda: all(w.in_flight == 0 for w in gw.gateway.registry), what="load counters to return to 0")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_hung_decode_is_bounded_by_request_timeout(
    backend: str, mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, [d] = await pd_setup(
        mock_workers, gateway, backend, decode={"hang": True}, request_timeout_secs=0.5, disable_retries=True
    )
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 504
    await wait_for(lambda: d.active == 0, what="the hung decode leg to be closed")


async def test_readiness_needs_both_pools(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [p] = await pd_workers(mock_workers, "sglang", "prefill")
    [d] = await pd_workers(mock_workers, "sglang", "decode")
    gw = await gateway(pd_disaggregation=True, prefill=[{"url": p.url, "bootstrap_port": None}])
    async with http.get(base_url(gw) + "/readiness") as r:
        assert r.status == 503
        assert (await r.json())["healthy_workers"] == {"prefill": 1, "decode": 0}
    async with http.post(base_url(gw) + "/workers", json={"url": d.url, "worker_type": "decode"}) as r:
        assert r.status == 202
    async with http.post(base_url(gw) + "/workers", json={"url": d.url, "worker_type": "regular"}) as r:
        assert r.status == 400  # regular workers have no place in P/D mode
    await wait_for(lambda: gw.gateway.registry.healthy_count(gw.gateway.roles[1]) == 1, what="decode to register")
    async with http.get(base_url(gw) + "/readiness") as r:
        assert r.status == 200
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 200


async def test_runtime_prefill_registration_carries_bootstrap_port(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [d] = await pd_workers(mock_workers, "sglang", "decode")
    [p] = await pd_workers(mock_workers, "sglang", "prefill")
    gw = await gateway(pd_disaggregation=True, decode=[d.url])
    async with http.post(
        base_url(gw) + "/workers", json={"url": p.url, "worker_type": "prefill", "bootstrap_port": 9100}
    ) as r:
        wid = (await r.json())["worker_id"]
    await wait_for(lambda: gw.gateway.registry.get(wid).is_healthy, what="prefill to register")
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 200
    assert p.received[-1]["body"]["bootstrap_port"] == 9100


def test_prefill_and_decode_policies_apply_to_their_pools() -> None:
    cfg = gateway_config(
        pd_disaggregation=True,
        policy="random",
        prefill_policy="round_robin",
        prefill=[{"url": "http://p:1"}],
        decode=["http://d:1", "http://d:2"],
    )
    assert (cfg.policy_for("prefill"), cfg.policy_for("decode")) == ("round_robin", "random")


async def test_pd_stage_metrics_and_kv_transfer_failures(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    gw, _, [d] = await pd_setup(mock_workers, gateway, "atom", disable_retries=True)
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        await r.read()
    d.behaviour.fail_status, d.behaviour.fail_code = 500, "kv_transfer_timeout"
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 500
    metrics = gw.gateway.metrics.registry
    assert (
        metrics.get_sample_value("mesh_pd_prefill_duration_seconds_count", {"runtime": "atom", "model": "mock-model"})
        == 2
    )
    assert (
        metrics.get_sample_value("mesh_pd_decode_duration_seconds_count", {"runtime": "atom", "model": "mock-model"})
        == 1
    )
    assert (
        metrics.get_sample_value(
            "mesh_pd_kv_transfer_failures_total", {"runtime": "atom", "reason": "kv_transfer_timeout"}
        )
        == 1
    )
