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


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_sync_peers": ["tcp://10.0.0.9:5600"]}, "need --policy kv_aware"),
    ({"policy": "kv_aware", "kv_sync_bind": "10.0.0.9:5600"}, "must be a ZMQ address"),
    ({"policy": "kv_aware", "kv_sync_peers": ["http://10.0.0.9:5600"]}, "must be a ZMQ address"),
    ({"policy": "kv_aware", "kv_sync_peers": ["tcp://10.0.0.9"]}, "--kv-sync-peers .* must be a ZMQ address"),
    ({"policy": "kv_aware", "kv_sync_bind": "tcp://*:5600", "processes": 2}, "one gateway process"),
])
def test_sync_flags_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GatewayConfig.model_validate(settings)
