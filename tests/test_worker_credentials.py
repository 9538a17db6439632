"""Workers with keys of their own (POST /workers `api_key`): the gateway sends that key on every call to the
worker (inference, health checks, discovery, loads, metrics, flush) instead of the client's Authorization; a
worker without one gets the client's Authorization as it came (SMG's behaviour); the key is never shown."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import structlog
from gwtest import MakeGateway, MakeWorkers, base_url, free_port, require, wait_for

from atomesh.testing.mock_worker import MockBehaviour, MockWorker

pytestmark = pytest.mark.timeout(60)

CLIENT_KEY = "client-key-1"
WORKER_KEY = "worker-key-2"


async def add(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(
        base_url(gw) + "/workers", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
    ) as resp:
        return resp.status, await resp.json()


async def test_a_worker_with_its_own_key_gets_that_key_on_every_call(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [w] = await mock_workers(1, api_key=WORKER_KEY)
    gw = await gateway(worker_urls=[], api_key=CLIENT_KEY, health_check_interval_secs=0.2)
    async with aiohttp.ClientSession() as http:
        status, body = await add(http, gw, {"url": w.url, "api_key": WORKER_KEY})
        assert status == 202, body
        worker = gw.gateway.registry.by_url(w.url)
        assert worker is not None
        await wait_for(lambda: worker.is_healthy, 10, "the worker to pass its (keyed) health checks")
        client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key=CLIENT_KEY, max_retries=0)
        try:
            done = await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)
            assert done.choices[0].text
            stream = await client.chat.completions.create(
                model="mock-model", stream=True, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
            assert [c async for c in stream]
        finally:
            await client.close()
        headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
        async with http.post(base_url(gw) + "/flush_cache", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(base_url(gw) + "/workers", headers=headers) as resp:
            listed = await resp.text()
        assert WORKER_KEY not in listed and '"has_api_key":true' in listed.replace(" ", "")
        await wait_for(lambda: sum(1 for p, _ in w.authorizations if p == "/health") >= 3, 10, "health checks")
    paths = {p for p, _ in w.authorizations}
    assert {
        "/health",
        "/v1/models",
        "/server_info",
        "/v1/completions",
        "/v1/chat/completions",
        "/flush_cache",
    } <= paths, paths
    # Every call the gateway made carried the worker's key, none the client's.
    assert {a for _, a in w.authorizations} == {f"Bearer {WORKER_KEY}"}, set(w.authorizations)


async def test_a_worker_without_a_key_gets_the_clients_authorization(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], api_key=CLIENT_KEY)
    client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key=CLIENT_KEY, max_retries=0)
    try:
        await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)
    finally:
        await client.close()
    assert w.received[-1]["headers"]["authorization"] == f"Bearer {CLIENT_KEY}"


async def test_a_keyed_worker_registered_without_its_key_says_why(
    mock_workers: MakeWorkers, gateway: MakeGateway
) -> None:
    [w] = await mock_workers(1, api_key=WORKER_KEY)
    gw = await gateway(worker_urls=[], api_key=CLIENT_KEY, worker_startup_timeout_secs=30)
    async with aiohttp.ClientSession() as http:
        status, _ = await add(http, gw, {"url": w.url})
        assert status == 202
        worker = gw.gateway.registry.by_url(w.url)
        assert worker is not None
        await wait_for(lambda: worker.error is not None and "401" in worker.error, 10, "the 401 to show")
        assert not worker.is_healthy


@pytest.mark.parametrize("key", ["", "has space", "x" * 5000, "tab\there"])
async def test_bad_worker_keys_are_refused(mock_workers: MakeWorkers, gateway: MakeGateway, key: str) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[])
    async with aiohttp.ClientSession() as http:
        status, body = await add(http, gw, {"url": w.url, "api_key": key})
    assert status == 400 and "api_key" in body["error"]["message"]
    assert gw.gateway.registry.by_url(w.url) is None


async def test_discovered_pods_get_their_key_from_a_secret(
    mock_workers: MakeWorkers, gateway: MakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("kubernetes_asyncio", "make install puts it in")
    from kubeapi import KubeApiServer, write_kubeconfig

    kube = await KubeApiServer().start()
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", kube.url, kube.token)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    port = free_port()
    keyed = MockWorker(name="keyed", host="127.0.0.31", port=port, behaviour=MockBehaviour(api_key=WORKER_KEY))
    missing = MockWorker(name="missing", host="127.0.0.32", port=port, behaviour=MockBehaviour(api_key="other"))
    await keyed.start()
    await missing.start()
    try:
        kube.secrets[("llm", "engine-keys")] = {"key": base64.b64encode(WORKER_KEY.encode()).decode()}
        annotation = {"atomesh.io/api-key-secret": "engine-keys/key"}
        kube.add_pod("llm", "keyed", "127.0.0.31", {"app": "engine"}, annotations=annotation)
        kube.add_pod(
            "llm",
            "missing",
            "127.0.0.32",
            {"app": "engine"},
            annotations={"atomesh.io/api-key-secret": "no-such-secret/key"},
        )
        with structlog.testing.capture_logs() as logs:
            gw = await gateway(
                service_discovery=True,
                selector=["app=engine"],
                service_discovery_port=port,
                service_discovery_namespace="llm",
                api_key=CLIENT_KEY,
            )
            await wait_for(
                lambda: {w.url for w in gw.gateway.registry if w.is_healthy} == {keyed.url},
                10,
                "the keyed pod to be served",
            )
            await wait_for(
                lambda: any(e["event"] == "discovery_secret_unreadable" for e in logs),
                10,
                "the unreadable secret in the log",
            )
        client = openai.AsyncOpenAI(base_url=base_url(gw) + "/v1", api_key=CLIENT_KEY, max_retries=0)
        try:
            await client.completions.create(model="mock-model", prompt="hi", max_tokens=2)
        finally:
            await client.close()
        assert {a for _, a in keyed.authorizations} == {f"Bearer {WORKER_KEY}"}
        assert gw.gateway.registry.by_url(missing.url) is None  # not added without the key it needs
        [line] = [e for e in logs if e["event"] == "discovery_secret_unreadable"]
        assert line["secret"] == "llm/no-such-secret" and "not found" in line["error"]
        assert WORKER_KEY not in str(logs)
    finally:
        await keyed.stop()
        await missing.stop()
        await kube.stop()
