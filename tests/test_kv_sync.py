"""kv_aware's replicas sharing their in-flight placements (atomesh/kv/sync.py), over real ZMQ sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from gwtest import free_port, wait_for
from pydantic import ValidationError

from atomesh.config import GatewayConfig
from atomesh.kv.sync import KvPeerSync
from atomesh.workers.worker import Worker

pytestmark = pytest.mark.timeout(30)
W = "http://10.0.0.1:8000"


async def _pair(**kw: Any) -> tuple[KvPeerSync, KvPeerSync]:
    a_addr, b_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    a, b = KvPeerSync(a_addr, [b_addr], **kw), KvPeerSync(b_addr, [a_addr], **kw)
    a.start()
    b.start()
    return a, b


async def test_a_placement_reaches_the_peer_with_its_load_and_keys() -> None:
    a, b = await _pair(interval=0.05)
    got: list[tuple[str, list[int], tuple[int, float]]] = []
    load = {W: (2, 12.0)}
    a.attach(lambda: load, lambda url, keys: None)
    b.attach(dict, lambda url, keys: got.append((url, keys, b.peer_load(W))))
    try:
        # PUB/SUB drops what is sent before the subscription is up: the periodic snapshot gets through.
        await wait_for(lambda: b.peer_load(W) == (2, 12.0), what="a's snapshot at b")
        a.placed(W, [7, 8, 9], (3, 15.0))
        # The placement's message counts it at once (the placement is charged after the policy records it).
        await wait_for(lambda: got == [(W, [7, 8, 9], (3, 15.0))], what="a's placement keys and load at b")
        load.clear()  # a's requests finished: the next snapshot says so
        await wait_for(lambda: b.peer_load(W) == (0, 0.0), what="a's load gone at b")
        assert a.peer_load(W) == (0, 0.0)  # b has nothing in flight
    finally:
        await a.stop()
        await b.stop()


def test_own_stale_and_malformed_messages_count_for_nothing() -> None:
    s = KvPeerSync(None, ["tcp://127.0.0.1:1"], stale_after=1.0)
    s.receive(msgpack.packb([s.id, {W: [5, 50.0]}, None, []]), now=100.0)  # its own, looped back
    assert s.peer_load(W, now=100.0) == (0, 0.0)
    s.receive(msgpack.packb([b"peer-one", {W: [1, 6.0]}, None, []]), now=100.0)
    s.receive(msgpack.packb([b"peer-two", {W: [2, 9.0]}, None, []]), now=100.5)
    assert s.peer_load(W, now=100.9) == (3, 15.0)
    assert s.peer_load(W, now=101.2) == (2, 9.0)  # peer-one went quiet: its load stops counting
    for bad in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb([b"x", {W: ["many", 1]}, None, []])):
        s.receive(bad, now=101.0)
    assert s.bad == 3 and s.peer_load(W, now=101.2) == (2, 9.0)


async def test_kv_aware_counts_the_peer_replicas_placements() -> None:
    """Two kv_aware replicas: what one places (load and a new prefix's blocks) and when it finishes the
    other sees at once, before any engine reports it."""
    from atomesh.kv.events import KvEventHub
    from atomesh.kv.tokens import PromptTokenizer
    from atomesh.policies import Given, make_policy
    from atomesh.request import RequestView, Route
    from atomesh.workers.registry import WorkerRegistry
    from engine.tokenizer import ByteTokenizer

    a_addr, b_addr = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ws = [Worker(url=f"http://10.0.0.{i}:8000") for i in range(3)]
    policies = []
    for bind, peer in ((a_addr, b_addr), (b_addr, a_addr)):
        cfg = GatewayConfig.model_validate({"policy": "kv_aware", "kv_sync_bind": bind, "kv_sync_peers": [peer]})
        p = make_policy("kv_aware", cfg)
        p.tokenizer = PromptTokenizer.from_info(ByteTokenizer().describe())
        registry = WorkerRegistry()
        for w in ws:
            registry.add(w)
            p.index.add_worker(w.url, 4)
        p.attach(Given(ws[0].role, registry, KvEventHub(p.index, registry, (ws[0].role,))))
        p.sync.start()
        policies.append(p)
    a, b = policies
    view = RequestView(Route.COMPLETIONS, {"prompt": "a brand new shared document " * 8}, b"", "r")
    try:
        await asyncio.sleep(0.3)  # the subscriptions connect
        decision = a.select(ws, view)
        a.record(decision, view)
        decision.worker.in_flight += 1  # as Placement.place does right after recording
        await wait_for(lambda: b.sync.peer_load(decision.worker.url)[0] == 1, what="a's placement at b")
        assert a.load.own(decision.worker) > 0
        assert b.load.active(decision.worker) == pytest.approx(a.load.own(decision.worker))
        assert b.select(ws, view).worker is decision.worker  # b follows a's new prefix
        # The request finishes: a tells b at once (its periodic snapshots stopped here, so nothing else can).
        await a.sync._ticker.stop()
        decision.worker.in_flight -= 1  # as Placement.release does before telling the policy
        a.released(decision.worker)
        await wait_for(lambda: b.sync.peer_load(decision.worker.url) == (0, 0.0), what="a's release at b")
    finally:
        for p in policies:
            await p.sync.stop()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_sync_peers": ["tcp://10.0.0.9:5600"]}, "need --policy kv_aware"),
        ({"policy": "kv_aware", "kv_sync_bind": "10.0.0.9:5600"}, "must be a ZMQ address"),
        ({"policy": "kv_aware", "kv_sync_peers": ["http://10.0.0.9:5600"]}, "must be a ZMQ address"),
        ({"policy": "kv_aware", "kv_sync_peers": ["tcp://10.0.0.9"]}, "--kv-sync-peers .* must be a ZMQ address"),
        ({"policy": "kv_aware", "kv_sync_bind": "tcp://*:5600", "processes": 2}, "one gateway process"),
    ],
)
def test_sync_flags_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatewayConfig.model_validate(settings)


async def test_the_gateways_processes_share_kv_aware_placements() -> None:
    """--processes N: each process's kv_aware placements (in-flight load, a new prefix's blocks) reach the
    others through the cluster's replication (atomesh.cluster.index, the batches pickled as the pipe does),
    so a process follows a prefix another just placed and the load poller counts the other's requests
    as this gateway's, not as foreign load."""
    import pickle

    from gwtest import gateway_config

    from atomesh.cluster.index import IndexSync
    from atomesh.gateway import Gateway
    from atomesh.kv.tokens import PromptTokenizer
    from atomesh.policies.kv_aware import KvAwarePolicy
    from atomesh.request import RequestView, Route
    from atomesh.workers.worker import WorkerRole, WorkerState
    from engine.tokenizer import ByteTokenizer

    urls = [f"http://10.0.0.{i}:8000" for i in range(3)]
    gws = [Gateway(gateway_config(worker_urls=urls, policy="kv_aware", processes=2)) for _ in range(2)]
    syncs: list[IndexSync] = []
    for gw in gws:
        policy = gw.placement.policies[WorkerRole.REGULAR]
        assert isinstance(policy, KvAwarePolicy)
        policy.tokenizer = PromptTokenizer.from_info(ByteTokenizer().describe())
        for url in urls:  # as the leader's worker list makes them, each publishing KV events
            gw.registry.set_state(gw.lifecycle.mirror(url, WorkerRole.REGULAR, None, None), WorkerState.READY)
            policy.index.add_worker(url, 4)
    for gw, other in ((gws[0], 1), (gws[1], 0)):  # each process's batches, through the pipe, to the other
        syncs.append(IndexSync(gw, lambda batch, o=other: syncs[o].apply(pickle.loads(pickle.dumps(batch)))))
    a, b = (gw.placement.policies[WorkerRole.REGULAR] for gw in gws)
    assert isinstance(a, KvAwarePolicy) and isinstance(b, KvAwarePolicy)
    for p in (a, b):
        p.sync.start()
    view = RequestView(Route.COMPLETIONS, {"prompt": "a brand new shared document " * 8}, b"", "r")
    try:
        plan = gws[0].placement.place(view)
        placed = plan.workers[0]
        await wait_for(lambda: b.sync.peer_load(placed.url)[0] == 1, what="the placement at the other process")
        there = gws[1].registry.by_url(placed.url)
        assert there is not None and there.in_flight == 0
        assert b.load.active(there) == pytest.approx(a.load.own(placed)) and b.load.active(there) > 0
        assert gws[1].load_poller is not None and gws[1].load_poller.elsewhere is not None
        assert gws[1].load_poller.elsewhere(there) == 1  # not foreign: the other process's request
        assert gws[1].placement.place(view).workers[0] is there  # b follows a's new prefix (predicted keys)
        gws[0].placement.release(plan)
        await wait_for(lambda: b.sync.peer_load(placed.url) == (0, 0.0), what="the release at the other process")
        assert syncs[0].replicas.keys() == {"regular/kv_placements", "regular/prefix_index"}
    finally:
        for p in (a, b):
            await p.sync.stop()


async def test_between_processes_an_idle_process_says_so_once() -> None:
    """Over the gateway's pipes (nothing is lost) a process repeats its snapshot every tick only while it
    has requests in flight; once idle it says so once and then keeps quiet."""
    sent: list[bytes] = []
    snapshot: dict[str, tuple[int, float]] = {}
    s = KvPeerSync(None, [], interval=0.02)
    s.attach(lambda: dict(snapshot), lambda url, keys: None)
    s.connect(sent.append)
    s.start()
    try:
        await asyncio.sleep(0.2)
        assert sent == []  # idle from the start: nothing to say
        snapshot[W] = (1, 4.0)
        await wait_for(lambda: len(sent) >= 3, what="ticks while busy")
        snapshot.clear()
        await wait_for(lambda: msgpack.unpackb(sent[-1])[1] == {}, what="the idle snapshot")
        count = len(sent)
        await asyncio.sleep(0.2)
        assert len(sent) == count
    finally:
        await s.stop()
