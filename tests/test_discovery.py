"""Kubernetes service discovery through the real `kubernetes_asyncio` client, against a loopback API
server that speaks list / watch (tests/kubeapi.py), with real gateways and mock engines as the pods.

Each pod has its own loopback address (127.0.0.N) and every engine listens on the same port, as pods
do behind `--service-discovery-port`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, base_url, free_port, gateway_config, require, wait_for
from kubeapi import KubeApiServer, flag, write_kubeconfig

from atomesh.app import GatewayServer
from atomesh.cli import normalize_argv
from atomesh.config import ConfigError, load_config
from atomesh.gateway import StartupError
from atomesh.testing.mock_worker import MockBehaviour, MockWorker
from atomesh.workers.discovery import DiscoverySettings, KubernetesDiscovery, Pod, wanted_worker
from atomesh.workers.worker import WorkerRole, WorkerState

require("kubernetes_asyncio", "make install puts it in")
pytestmark = pytest.mark.timeout(30)

COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}
NS = "llm"
ENGINE = {"app": "engine"}


class Engines:
    """Mock engines, one per pod IP, all on one port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.by_ip: dict[str, MockWorker] = {}

    async def start(self, ip: str, **behaviour: Any) -> MockWorker:
        w = MockWorker(name=ip, host=ip, port=self.port, behaviour=MockBehaviour(**behaviour))
        await w.start()
        self.by_ip[ip] = w
        return w

    def url(self, ip: str) -> str:
        return f"http://{ip}:{self.port}"

    async def stop(self) -> None:
        for w in self.by_ip.values():
            await w.stop()


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeApiServer]:
    api = await KubeApiServer().start()
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", api.url, api.token)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield api
    await api.stop()


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    e = Engines()
    yield e
    await e.stop()


def discovering(engines: Engines, **settings: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "service_discovery": True,
        "selector": ["app=engine"],
        "service_discovery_port": engines.port,
        "service_discovery_namespace": NS,
    }
    return {**base, **settings}


def discovery_of(gw: GatewayServer) -> KubernetesDiscovery:
    assert gw.gateway.discovery is not None
    return gw.gateway.discovery


def urls(gw: GatewayServer, state: WorkerState = WorkerState.READY) -> set[str]:
    return {w.url for w in gw.gateway.registry if w.state is state}


async def complete(http: aiohttp.ClientSession, gw: GatewayServer) -> str:
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-mock-worker"]


# ---------------------------------------------------------------------------- settings and flags
def pod(labels: dict[str, str], ip: str | None = "10.0.0.5", ready: bool = True, **meta: Any) -> Pod:
    obj = {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ns", "labels": labels, **meta},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
    p = Pod.from_json(obj)
    assert p is not None
    return p


def test_pods_map_to_workers_by_labels_readiness_and_annotations() -> None:
    regular = DiscoverySettings(
        selector={"app": "engine"}, prefill_selector={}, decode_selector={}, pd=False, port=8000
    )
    assert regular.server_selector() == "app=engine"
    w = wanted_worker(pod({"app": "engine", "x": "y"}), regular)
    assert w is not None and (w.url, w.role, w.pod) == ("http://10.0.0.5:8000", WorkerRole.REGULAR, "ns/p")
    assert wanted_worker(pod({"app": "other"}), regular) is None
    assert wanted_worker(pod(ENGINE, ready=False), regular) is None
    assert wanted_worker(pod(ENGINE, ip=None), regular) is None
    assert wanted_worker(pod(ENGINE, deletionTimestamp="2026-01-01T00:00:00Z"), regular) is None
    w6 = wanted_worker(pod(ENGINE, ip="fd00::5"), regular)
    assert w6 is not None and w6.url == "http://[fd00::5]:8000"
    kv = wanted_worker(pod(ENGINE, annotations={"atomesh.io/kv-events-endpoint": "tcp://*:5557,tcp://*:5558"}), regular)
    assert kv is not None and kv.kv_events == "tcp://*:5557,tcp://*:5558" and w.kv_events is None

    pd = DiscoverySettings(
        selector={},
        prefill_selector={"app": "llm", "role": "prefill"},
        decode_selector={"app": "llm", "role": "decode"},
        pd=True,
        port=8010,
        model_id_source=("label", "model"),
    )
    assert pd.server_selector() == "app=llm"  # the roles are told apart by the gateway
    p = wanted_worker(
        pod({"app": "llm", "role": "prefill", "model": "m1"}, annotations={"sglang.ai/bootstrap-port": "8998"}), pd
    )
    assert p is not None and (p.role, p.bootstrap_port, p.model_id) == (WorkerRole.PREFILL, 8998, "m1")
    d = wanted_worker(pod({"app": "llm", "role": "decode"}, annotations={"sglang.ai/bootstrap-port": "8998"}), pd)
    assert d is not None and (d.role, d.bootstrap_port, d.model_id) == (WorkerRole.DECODE, None, None)
    bad = wanted_worker(pod({"app": "llm", "role": "prefill"}, annotations={"sglang.ai/bootstrap-port": "x"}), pd)
    assert bad is not None and bad.bootstrap_port is None


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"selector": ["app=x"]}, "--selector needs --service-discovery"),
        ({"service_discovery_namespace": "llm"}, "--service-discovery-namespace needs --service-discovery"),
        ({"service_discovery": True}, "--service-discovery needs --selector"),
        ({"service_discovery": True, "selector": ["app"]}, "must be key=value"),
        ({"service_discovery": True, "selector": ["app!=x"]}, "must be key=value"),
        ({"service_discovery": True, "selector": ["app=x"], "prefill_selector": ["r=p"]}, "needs --pd-disaggregation"),
        ({"service_discovery": True, "pd_disaggregation": True}, "--prefill-selector and/or --decode-selector"),
        ({"service_discovery": True, "pd_disaggregation": True, "selector": ["a=b"]}, "--selector is for regular"),
        ({"service_discovery": True, "selector": ["a=b"], "model_id_from": "pod-name"}, "--model-id-from"),
        ({"service_discovery": True, "selector": ["a=b"], "service_discovery_namespace": "Bad_NS"}, "namespace"),
        ({"discovery_provider": "consul", "selector": ["a=b"]}, "--discovery-provider"),
    ],
)
def test_discovery_flags_are_checked(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(flags)
    assert message in str(e.value)


def test_smg_spellings_parse() -> None:
    from atomesh.cli import _launch_options

    assert any("--discovery-provider" in o.opts for o in _launch_options())
    assert normalize_argv(["--prefill-selector", "app=llm", "role=prefill", "--port", "1"]) == [
        "--prefill-selector",
        "app=llm",
        "--prefill-selector",
        "role=prefill",
        "--port",
        "1",
    ]
    cfg = load_config(
        {
            "discovery_provider": "kubernetes",
            "selector": ["app=engine,tier=gpu", "zone=a"],
            "model_id_from": "annotation:example.com/model",
        }
    )
    assert cfg.service_discovery and cfg.selector == ["app=engine", "tier=gpu", "zone=a"]


# ---------------------------------------------------------------------------- pods and workers
async def test_ready_pods_become_workers_and_leave_when_not_ready_or_deleted(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    for ip in ("127.0.0.11", "127.0.0.12", "127.0.0.13"):
        await engines.start(ip)
    kube.add_pod(NS, "engine-a", "127.0.0.11", ENGINE)
    kube.add_pod(NS, "engine-b", "127.0.0.12", ENGINE, ready=False)  # still loading
    kube.add_pod(NS, "engine-c", "127.0.0.13", ENGINE, phase="Pending")
    kube.add_pod(NS, "web", "127.0.0.14", {"app": "web"})
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: urls(gw) == {engines.url("127.0.0.11")}, what="pod a registered")
    assert await complete(http, gw) == "127.0.0.11"
    async with http.get(base_url(gw) + "/workers") as r:
        [listed] = (await r.json())["workers"]
    assert (listed["source"], listed["pod"], listed["worker_type"]) == ("kubernetes", f"{NS}/engine-a", "regular")

    kube.update_pod(NS, "engine-b", ready=True)
    await wait_for(lambda: len(urls(gw)) == 2, what="pod b registered once ready")

    kube.update_pod(NS, "engine-a", ready=False)
    await wait_for(lambda: urls(gw) == {engines.url("127.0.0.12")}, what="not-ready pod a drained")
    assert {await complete(http, gw) for _ in range(4)} == {"127.0.0.12"}

    kube.update_pod(NS, "engine-a", ready=True)
    kube.delete_pod(NS, "engine-b")
    await wait_for(lambda: urls(gw) == {engines.url("127.0.0.11")}, what="a back, deleted b gone")
    assert len(gw.gateway.registry) == 1


async def test_in_flight_requests_finish_when_their_pod_goes(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    slow = await engines.start("127.0.0.21", latency_secs=0.8)
    kube.add_pod(NS, "slow", "127.0.0.21", ENGINE)
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: len(urls(gw)) == 1, what="pod registered")
    request = asyncio.ensure_future(complete(http, gw))
    await wait_for(lambda: slow.active == 1, what="request on the pod")
    kube.update_pod(NS, "slow", deleting=True)  # terminating: drain now, not at the end of the grace period
    await wait_for(lambda: urls(gw, WorkerState.DRAINING) == {engines.url("127.0.0.21")}, what="draining")
    assert await request == "127.0.0.21"
    await wait_for(lambda: len(gw.gateway.registry) == 0, what="removed after its request finished")


async def test_relabelled_and_moved_pods(kube: KubeApiServer, engines: Engines, gateway: MakeGateway) -> None:
    for ip in ("127.0.0.31", "127.0.0.32"):
        await engines.start(ip)
    kube.add_pod(NS, "e", "127.0.0.31", ENGINE)
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: urls(gw) == {engines.url("127.0.0.31")}, what="registered")
    first = next(iter(gw.gateway.registry))

    kube.update_pod(NS, "e", labels={"app": "engine-canary"})  # the watch reports it as deleted
    await wait_for(lambda: len(gw.gateway.registry) == 0, what="relabelled pod dropped")
    kube.update_pod(NS, "e", labels=ENGINE)
    await wait_for(lambda: len(urls(gw)) == 1, what="relabelled back")
    assert next(iter(gw.gateway.registry)) is not first

    kube.update_pod(NS, "e", ip="127.0.0.32")
    await wait_for(lambda: urls(gw) == {engines.url("127.0.0.32")}, what="worker follows the new IP")
    assert len(gw.gateway.registry) == 1


async def test_pd_roles_bootstrap_port_and_model_id(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    await engines.start("127.0.0.41")
    await engines.start("127.0.0.42")
    llm = {"app": "llm", "model": "team-model"}
    kube.add_pod(
        NS, "prefill-0", "127.0.0.41", {**llm, "role": "prefill"}, annotations={"sglang.ai/bootstrap-port": "8998"}
    )
    kube.add_pod(NS, "decode-0", "127.0.0.42", {**llm, "role": "decode"})
    gw = await gateway(
        **discovering(
            engines,
            selector=[],
            pd_disaggregation=True,
            prefill_selector=["app=llm", "role=prefill"],
            decode_selector=["app=llm", "role=decode"],
            model_id_from="label:model",
        )
    )
    await wait_for(lambda: len(urls(gw)) == 2, what="prefill and decode registered")
    by_role = {w.role: w for w in gw.gateway.registry}
    assert by_role[WorkerRole.PREFILL].bootstrap_port == 8998
    assert by_role[WorkerRole.DECODE].bootstrap_port is None
    assert by_role[WorkerRole.DECODE].models == ("team-model", "mock-model")
    assert kube.list_requests()[0]["labelSelector"] == "app=llm"
    async with http.get(base_url(gw) + "/v1/models") as r:
        assert {m["id"] for m in (await r.json())["data"]} == {"team-model", "mock-model"}
    async with http.post(
        base_url(gw) + "/generate", json={"text": "hi", "model": "team-model", "sampling_params": {"max_new_tokens": 2}}
    ) as r:
        assert r.status == 200, await r.text()

    kube.update_pod(NS, "decode-0", labels={**llm, "role": "prefill"})  # the same pod changes role
    await wait_for(
        lambda: {w.role for w in gw.gateway.registry} == {WorkerRole.PREFILL} and len(urls(gw)) == 2,
        what="role change re-registers the pod",
    )


async def test_namespace_scoping(kube: KubeApiServer, engines: Engines, gateway: MakeGateway) -> None:
    await engines.start("127.0.0.51")
    await engines.start("127.0.0.52")
    kube.add_pod(NS, "mine", "127.0.0.51", ENGINE)
    kube.add_pod("other-team", "theirs", "127.0.0.52", ENGINE)
    gw = await gateway(**discovering(engines))
    # The bookmark goes to open watches only: wait for the gateway's (a loaded machine opens it late).
    await wait_for(lambda: len(urls(gw)) == 1 and len(kube._watches) == 1, what="own pod, watching")
    kube.add_pod("other-team", "theirs-2", "127.0.0.52", ENGINE)
    kube.add_pod(NS, "mine-2", "127.0.0.52", {"app": "web"})
    kube.bookmark()
    await wait_for(lambda: discovery_of(gw).resource_version == str(kube.rv), what="events seen")
    assert urls(gw) == {engines.url("127.0.0.51")}
    assert {path for path, _ in kube.requests} == {f"/api/v1/namespaces/{NS}/pods"}


async def test_all_namespaces_without_a_namespace(kube: KubeApiServer, engines: Engines, gateway: MakeGateway) -> None:
    await engines.start("127.0.0.53")
    kube.add_pod("team-b", "e", "127.0.0.53", ENGINE)
    gw = await gateway(**discovering(engines, service_discovery_namespace=None))
    await wait_for(lambda: len(urls(gw)) == 1, what="pod in another namespace")
    assert {path for path, _ in kube.requests} == {"/api/v1/pods"}
    assert next(iter(gw.gateway.registry)).pod == "team-b/e"


# ---------------------------------------------------------------------------- the API server misbehaving
async def test_watch_resumes_from_the_last_version_and_bookmark(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway
) -> None:
    for ip in ("127.0.0.61", "127.0.0.62"):
        await engines.start(ip)
    kube.add_pod(NS, "a", "127.0.0.61", ENGINE)
    gw = await gateway(**discovering(engines))
    d = discovery_of(gw)
    await wait_for(lambda: len(urls(gw)) == 1 and len(kube._watches) == 1, what="watching")
    kube.add_pod("elsewhere", "x", None, {})  # moves the version on without an event for us
    kube.bookmark()
    await wait_for(lambda: d.resource_version == str(kube.rv), what="bookmark seen")
    kube.drop_watches()
    kube.add_pod(NS, "b", "127.0.0.62", ENGINE)  # while the watch is down
    await wait_for(lambda: len(urls(gw)) == 2, what="event missed by the cut watch replayed")
    watches = kube.watch_requests()
    assert watches[-1]["resourceVersion"] == str(kube.rv - 1)  # the bookmark's version
    assert all(flag(w["allowWatchBookmarks"]) for w in watches)
    assert d.lists == 1  # resumed, never listed again


async def test_410_gone_lists_again_and_keeps_unchanged_workers(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway
) -> None:
    for ip in ("127.0.0.71", "127.0.0.72", "127.0.0.73"):
        await engines.start(ip)
    kube.add_pod(NS, "a", "127.0.0.71", ENGINE)
    kube.add_pod(NS, "b", "127.0.0.72", ENGINE)
    for i in range(7):
        kube.add_pod(NS, f"idle-{i}", None, ENGINE, ready=False, phase="Pending")
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: len(urls(gw)) == 2 and kube._watches, what="registered and watching")
    a = gw.gateway.registry.by_url(engines.url("127.0.0.71"))
    d = discovery_of(gw)
    d.settings = dataclasses.replace(d.settings, list_page_size=3)  # the relist comes in pages
    kube.drop_watches()
    kube.delete_pod(NS, "b")
    kube.add_pod(NS, "c", "127.0.0.73", ENGINE)
    kube.compact()  # the watch cannot resume: 410 Gone
    await wait_for(
        lambda: urls(gw) == {engines.url("127.0.0.71"), engines.url("127.0.0.73")}, what="state after the relist"
    )
    assert d.lists == 2 and len(d.pods) == 9
    assert [q.get("continue") is not None for q in kube.list_requests()] == [False, False, True, True]
    assert gw.gateway.registry.by_url(engines.url("127.0.0.71")) is a  # not re-registered


async def test_api_errors_back_off_and_keep_the_workers(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    await engines.start("127.0.0.81")
    await engines.start("127.0.0.82")
    kube.add_pod(NS, "a", "127.0.0.81", ENGINE)
    kube.fail_next = 2  # the first list fails: start-up does not wait for the API server
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: len(urls(gw)) == 1, what="registered after the errors")
    d = discovery_of(gw)
    assert d.errors == 2
    d.settings = dataclasses.replace(d.settings, max_backoff_secs=0.5)  # keep the test short
    kube.fail_next = 4
    kube.drop_watches()
    kube.add_pod(NS, "b", "127.0.0.82", ENGINE)
    await wait_for(lambda: kube.fail_next == 0, what="errors served")
    assert urls(gw) == {engines.url("127.0.0.81")}  # nothing dropped while the API server failed
    assert await complete(http, gw) == "127.0.0.81"
    await wait_for(lambda: len(urls(gw)) == 2, timeout=15, what="the change made during the errors")
    assert d.errors >= 6 and d.lists == 1  # the 500s, and the cut watch


async def test_api_server_restart_mid_watch_loses_no_request(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    for ip in ("127.0.0.91", "127.0.0.92"):
        await engines.start(ip, latency_secs=0.01)
    kube.add_pod(NS, "a", "127.0.0.91", ENGINE)
    kube.add_pod(NS, "b", "127.0.0.92", ENGINE)
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: len(urls(gw)) == 2 and kube._watches, what="registered and watching")
    workers = {w.id for w in gw.gateway.registry}
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
                await r.read()
                statuses.append(r.status)

    clients = [asyncio.ensure_future(client()) for _ in range(4)]
    await wait_for(lambda: len(statuses) > 20, what="traffic")
    await kube.stop()  # the API server goes away mid-watch ...
    await wait_for(lambda: discovery_of(gw).errors >= 2, what="reconnects failing")
    kube.add_pod("elsewhere", "x", None, {})
    kube.compact()  # ... and comes back with its history compacted past our version
    await kube.start()
    await wait_for(lambda: discovery_of(gw).lists == 2 and kube._watches, timeout=15, what="listed and watching")
    stop.set()
    await asyncio.gather(*clients)
    assert len(statuses) > 40 and set(statuses) == {200}
    assert {w.id for w in gw.gateway.registry} == workers


# ---------------------------------------------------------------------------- coexistence and start-up
async def test_discovered_and_api_workers_coexist(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    for ip in ("127.0.0.101", "127.0.0.102", "127.0.0.103"):
        await engines.start(ip)
    kube.add_pod(NS, "a", "127.0.0.101", ENGINE)
    gw = await gateway(**discovering(engines, worker_urls=[engines.url("127.0.0.103")]))
    async with http.post(base_url(gw) + "/workers", json={"url": engines.url("127.0.0.102")}) as r:
        assert r.status == 202
    await wait_for(lambda: len(urls(gw)) == 3, what="three workers")
    async with http.get(base_url(gw) + "/workers") as r:
        sources = {w["url"]: w["source"] for w in (await r.json())["workers"]}
    assert sources == {
        engines.url("127.0.0.101"): "kubernetes",
        engines.url("127.0.0.102"): "api",
        engines.url("127.0.0.103"): "command_line",
    }
    discovered = gw.gateway.registry.by_url(engines.url("127.0.0.101"))
    assert discovered is not None
    async with http.delete(base_url(gw) + f"/workers/{discovered.id}") as r:
        assert r.status == 409 and "Kubernetes" in (await r.json())["error"]["message"]

    kube.add_pod(NS, "same-as-api", "127.0.0.102", ENGINE)  # a pod at the URL an API worker holds
    kube.delete_pod(NS, "a")
    await wait_for(lambda: len(gw.gateway.registry) == 2, what="pod a gone")
    assert sources[engines.url("127.0.0.102")] == "api" and discovery_of(gw).owned() == {}
    api_worker = gw.gateway.registry.by_url(engines.url("127.0.0.102"))
    assert api_worker is not None
    async with http.delete(base_url(gw) + f"/workers/{api_worker.id}") as r:
        assert r.status == 202
    # Once the API worker is gone, the pod at its URL becomes a worker of discovery's.
    await wait_for(lambda: engines.url("127.0.0.102") in discovery_of(gw).owned(), what="pod takes the URL")


async def test_missing_credentials_stop_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nothing-here"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    server = GatewayServer(gateway_config(service_discovery=True, selector=["app=engine"]))
    try:
        with pytest.raises(StartupError, match="no Kubernetes credentials"):
            await server.start()
    finally:
        await server.close()


async def test_wrong_token_is_reported_and_retried(
    kube: KubeApiServer, engines: Engines, gateway: MakeGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "bad", kube.url, "wrong")))
    gw = await gateway(**discovering(engines))
    await wait_for(lambda: discovery_of(gw).errors >= 1, what="401")
    assert not discovery_of(gw).synced.is_set()
