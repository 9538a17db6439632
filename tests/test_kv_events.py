"""KV cache events: vLLM's wire format, the global index, and the gateway's subscriber against the
engine's real ZMQ publisher (gaps, replay, re-sync, worker removal, restarts of either side)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gwtest import free_port, require, wait_for

from atomesh.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    KvEventHub,
    decode_batch,
    endpoint_of,
    parse_endpoint_flags,
)
from atomesh.kv.index import KvIndex, as_tokens, chain_keys
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState
from engine.block_manager import BlockManager
from engine.kv_events import (
    EventRecorder,
    KVEventsConfig,
    ZmqEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    parse_kv_events_config,
)
from engine.sequence import SamplingParams, Sequence

require("zmq", "make install puts it in")

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
FIXTURE = bytes.fromhex((FIXTURES / "kv_event_batch.msgpack.hex").read_text().strip())


def fixture_events() -> list[list[Any]]:
    """The fixture's batch, built with the engine's own event constructors."""
    return [
        all_blocks_cleared(),
        block_stored([11, 2**64 - 5], None, list(range(1, 9)), 4, "GPU"),
        block_stored([13], 2**64 - 5, [9, 10, 11, 12], 4, "GPU"),
        block_removed([13, 11], "GPU"),
    ]


# ---------------------------------------------------------------------------------------------- format
def test_engine_encoding_is_byte_identical_to_vllms_structs() -> None:
    """The fixture was written by msgspec from vLLM's documented struct definitions."""
    assert encode_batch(1764590000.25, fixture_events(), 0) == FIXTURE


def test_gateway_decodes_vllms_field_order() -> None:
    batch = decode_batch(FIXTURE)
    assert batch.ts == 1764590000.25 and batch.data_parallel_rank == 0
    cleared, first, second, removed = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert first == BlockStored([11, 2**64 - 5], None, list(range(1, 9)), 4, None, "GPU")
    assert second == BlockStored([13], 2**64 - 5, [9, 10, 11, 12], 4, None, "GPU")
    assert removed == BlockRemoved([13, 11], "GPU")


def test_round_trip_through_vllms_msgspec_structs() -> None:
    import msgspec
    import vllm_kv_events as vllm

    ours = encode_batch(1764590000.25, fixture_events(), 0)
    assert msgspec.msgpack.Decoder(type=vllm.KVEventBatch).decode(ours) == vllm.sample_batch()
    assert msgspec.msgpack.encode(vllm.sample_batch()) == FIXTURE


def test_map_encoded_events_and_extra_fields_are_read() -> None:
    import msgpack

    payload = msgpack.packb(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                ["BlockRemoved", [7], "GPU", 0],  # a newer release's trailing group_idx
            ],
        ]
    )
    stored, removed = decode_batch(payload).events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [b"\x01" * 32] and stored.block_size == 2
    assert removed == BlockRemoved([7], "GPU")


@pytest.mark.parametrize(
    "payload", [b"\xc1", b"\x90", b"\x92\xa1x\x90", b"\x92\x00\x91\x91\xa3Foo", b"\x92\x00\x91\x92\xabBlockStored\x90"]
)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_engine_config_is_vllms_json() -> None:
    cfg = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
    )
    assert cfg.enabled and cfg.replay_endpoint == "tcp://*:5558" and cfg.topic == "kv-events"
    assert not parse_kv_events_config("{}").enabled
    for bad, word in (
        ('{"publisher": "kafka"}', "publisher"),
        ('{"nope": 1}', "nope"),
        ('{"endpoint": "localhost:1"}', "endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
    ):
        with pytest.raises(ValueError, match=word):
            parse_kv_events_config(bad)


def test_endpoints_from_flag_label_and_server_info() -> None:
    w = Worker(url="http://10.0.0.7:8000")
    w.server_info = {
        "kv_events_config": {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv",
        }
    }
    ep = endpoint_of(w, {})
    assert ep is not None and (ep.pub, ep.replay, ep.topic) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv")
    flags = parse_endpoint_flags(["http://10.0.0.7:8000=tcp://*:6000,tcp://*:6001"])
    ep = endpoint_of(w, flags)
    assert ep is not None and (ep.pub, ep.replay) == ("tcp://10.0.0.7:6000", "tcp://10.0.0.7:6001")
    w2 = Worker(url="http://10.0.0.8:8000", labels={"kv_events_endpoint": "tcp://10.0.0.8:7000"})
    ep = endpoint_of(w2, {})
    assert ep is not None and ep.pub == "tcp://10.0.0.8:7000" and ep.replay is None
    assert endpoint_of(Worker(url="http://10.0.0.9:8000"), {}) is None
    with pytest.raises(ValueError, match="WORKER_URL"):
        parse_endpoint_flags(["tcp://x:1"])


# ---------------------------------------------------------------------------------------------- index
def test_keys_from_split_events_equal_keys_from_the_prompt() -> None:
    """Blocks stored over several events (chained by parent hash) get the keys a prompt computes."""
    idx = KvIndex()
    idx.add_worker("a", 4)
    tokens = list(range(100, 130))  # 7 full blocks of 4 + 2 tokens
    idx.stored("a", ["h0", "h1"], None, tokens[:8], 4)
    idx.stored("a", ["h2", "h3", "h4"], "h1", tokens[8:20], 4)
    idx.stored("a", ["h5", "h6"], "h4", tokens[20:28], 4)
    keys = chain_keys(as_tokens(tokens), 4)
    assert len(keys) == 7 and all(k in idx.holders for k in keys)
    assert idx.overlaps(keys, [idx.bit("a")]) == [7]
    other = chain_keys(as_tokens([*tokens[:10], 1, *tokens[11:]]), 4)  # differs in block 2
    assert idx.overlaps(other, [idx.bit("a")]) == [2]
    idx.removed("a", ["h5", "h6"])
    assert idx.overlaps(keys, [idx.bit("a")]) == [5]
    idx.stored("a", ["zz"], "unknown-parent", tokens[:4], 4)
    assert idx.stats.orphans == 1
    idx.cleared("a")
    assert idx.overlaps(keys, [idx.bit("a")]) == [0] and len(idx) == 0


def test_index_per_worker_bound_predictions_and_removal() -> None:
    idx = KvIndex(max_blocks_per_worker=3, predict_ttl=1.0)
    idx.add_worker("a", 2)
    idx.add_worker("b", 2)
    idx.stored("a", [1, 2, 3, 4, 5], None, list(range(10)), 2)
    assert idx.blocks_of("a") == 3 and idx.stats.trimmed == 2
    keys = chain_keys(as_tokens(list(range(50, 60))), 2)
    idx.predict("b", keys, now=100.0)
    assert idx.overlaps(keys, [idx.bit("a"), idx.bit("b")], now=100.5) == [0, 5]
    assert idx.overlaps(keys, [idx.bit("b")], now=101.5) == [0]  # expired
    bit_b = idx.bit("b")
    idx.remove_worker("a")
    assert not idx.follows("a") and all(m == m & bit_b for m in idx.holders.values())
    idx.add_worker("c", 2)
    assert idx.bit("c") not in (bit_b,)


def test_block_manager_events_follow_allocation_reuse_and_eviction() -> None:
    """The engine's events, applied to an index, always describe exactly the engine's hash index."""
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.events = EventRecorder(2, None)
    idx = KvIndex()
    idx.add_worker("e", 2)
    removed = 0

    def run(prompt: list[int]) -> None:
        nonlocal removed
        seq = Sequence(1, prompt, SamplingParams(max_tokens=1), 2)
        bm.allocate(seq)
        bm.mark_computed(seq, len(prompt))
        bm.deallocate(seq)
        for ev in decode_batch(encode_batch(0.0, bm.events.take())).events:  # type: ignore[union-attr]
            if isinstance(ev, BlockStored):
                idx.stored("e", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
            elif isinstance(ev, BlockRemoved):
                idx.removed("e", ev.block_hashes)
                removed += len(ev.block_hashes)
        held = {h for h, b in bm._hash_to_block.items()}
        assert set(idx._workers["e"].blocks) == held
        assert bm.stats().evicted == removed  # every removal here is an eviction (atom:prefix_cache_evicted_blocks)

    run([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks
    run([1, 2, 3, 4, 9, 9, 9])  # reuses 2, stores 1
    assert bm.stats().evicted == 0
    run([5, 5, 6, 6, 7, 7, 8])  # the pool of 6 must evict
    assert bm.stats().evicted > 0
    run([1, 2, 3, 4, 5, 6, 7])
    keys = chain_keys(as_tokens([1, 2, 3, 4, 5, 6, 7]), 2)
    assert idx.overlaps(keys, [idx.bit("e")]) == [
        len(bm._cached_prefix(Sequence(9, [1, 2, 3, 4, 5, 6, 7], SamplingParams(), 2)))
    ]


def test_blocks_are_reported_when_their_step_is_scheduled_and_withdrawn_if_never_written() -> None:
    """`announce` reports a step's blocks before the step runs; the index ends up as the engine's
    either way: written (no second report), abandoned (removed, unless another block holds the
    prefix), or evicted elsewhere while still being written (reported again once written)."""
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.events = EventRecorder(2, None)
    idx = KvIndex()
    idx.add_worker("e", 2)

    def apply() -> list[Any]:
        events = decode_batch(encode_batch(0.0, bm.events.take())).events  # type: ignore[union-attr]
        for ev in events:
            if isinstance(ev, BlockStored):
                idx.stored("e", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
            elif isinstance(ev, BlockRemoved):
                idx.removed("e", ev.block_hashes)
        return events

    def held() -> set[object]:
        return set(idx._workers["e"].blocks)

    def truth() -> set[object]:  # what the engine holds, plus what it is writing (unless evicted meanwhile)
        return set(bm._hash_to_block) | (set(bm._pending) - bm._voided)

    # Scheduled, then written: the blocks are known from the start of the step, reported once.
    a = Sequence(1, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 2)
    bm.allocate(a)
    bm.announce(a, 5)
    assert [type(e) for e in apply()] == [BlockStored] and len(held()) == 2
    bm.mark_computed(a, 5)
    assert apply() == [] and held() == truth()
    bm.deallocate(a)
    assert apply() == [] and held() == truth()

    # Scheduled in two chunks, then aborted after the first: the unwritten block is withdrawn.
    b = Sequence(2, [7, 7, 8, 8, 9], SamplingParams(max_tokens=1), 2)
    bm.allocate(b)
    bm.announce(b, 2)
    bm.mark_computed(b, 2)
    bm.announce(b, 4)
    apply()
    assert len(held()) == 4 and held() == truth()
    bm.deallocate(b)
    assert [type(e) for e in apply()] == [BlockRemoved] and held() == truth() and len(held()) == 3

    # Two sequences computing the same new prefix: one abandons it, the other's report stands.
    c, d = (Sequence(i, [3, 3, 4, 4, 1], SamplingParams(max_tokens=1), 2) for i in (3, 4))
    for s in (c, d):
        bm.allocate(s)
        bm.announce(s, 5)
    apply()
    assert held() == truth()
    bm.deallocate(c)
    assert not any(isinstance(ev, BlockRemoved) for ev in apply()) and held() == truth()
    bm.mark_computed(d, 5)
    bm.deallocate(d)
    apply()
    assert held() == truth() == set(bm._hash_to_block)

    # A prefix evicted while another sequence is still writing it: reported again once written.
    g, h = (Sequence(i, [8, 8, 9, 9, 1], SamplingParams(max_tokens=1), 2) for i in (5, 6))
    for s in (g, h):
        bm.allocate(s)
        bm.announce(s, 5)
    bm.mark_computed(g, 5)
    bm.deallocate(g)
    apply()
    assert held() == truth()
    filler = Sequence(7, [6] * 9, SamplingParams(max_tokens=1), 2)
    bm.allocate(filler)  # every free block, g's among them: its prefix leaves the hash index
    apply()
    assert bm._voided and held() == truth()
    bm.mark_computed(h, 5)
    apply()
    assert held() == truth() == set(bm._hash_to_block)
    bm.deallocate(h)
    bm.deallocate(filler)
    apply()
    assert held() == truth() == set(bm._hash_to_block) and not bm._announced and not bm._voided


# ---------------------------------------------------------------------------------------------- subscriber
class Publisher:
    """The engine's real publisher on free loopback ports, plus a way to lose a message on the PUB socket."""

    def __init__(self, replay: bool = True, buffer_steps: int = 100) -> None:
        self.pub_port, self.replay_port = free_port(), free_port()
        self.cfg = KVEventsConfig(
            True,
            "zmq",
            f"tcp://*:{self.pub_port}",
            f"tcp://*:{self.replay_port}" if replay else None,
            buffer_steps,
            topic="kv",
        )
        self.pub = ZmqEventPublisher(self.cfg)

    def send(self, events: list[list[Any]]) -> None:
        self.pub.publish(events)

    def lose(self, events: list[list[Any]]) -> None:
        """As if the subscriber missed this one (HWM, a reconnect): it is only in the replay buffer."""
        seq, self.pub._seq = self.pub._seq, self.pub._seq + 1
        self.pub._buffer.append((seq, encode_batch(time.time(), events)))

    def info(self) -> dict[str, Any]:
        return {
            "publisher": "zmq",
            "endpoint": self.cfg.endpoint,
            "replay_endpoint": self.cfg.replay_endpoint,
            "topic": "kv",
        }

    def close(self) -> None:
        self.pub.close()


def stored(tokens: list[int], first: int, parent: int | None = None) -> list[Any]:
    n = len(tokens) // 4
    return block_stored(list(range(first, first + n)), parent, tokens, 4, None)


async def follow(pub: Publisher, registry: WorkerRegistry | None = None) -> tuple[KvEventHub, Worker, KvIndex]:
    registry = registry if registry is not None else WorkerRegistry()
    index = KvIndex()
    # Generous: on a loaded machine a replay answer can take over half a second, and a replay cut short
    # leaves the index without the events the test asserts on (seen once in a full run).
    hub = KvEventHub(index, registry, (WorkerRole.REGULAR,), replay_timeout=5.0)
    w = Worker(url="http://127.0.0.1:1")
    w.server_info = {"block_size": 4, "kv_events_config": pub.info()}
    registry.add(w)
    hub.start()
    registry.set_state(w, WorkerState.READY)
    await asyncio.wait_for(hub.streams[w.url].ready.wait(), 5)
    return hub, w, index


def overlap(index: KvIndex, w: Worker, tokens: list[int]) -> int:
    return index.overlaps(chain_keys(as_tokens(tokens), 4), [index.bit(w.url)])[0]


async def settle(pub: Publisher, hub: KvEventHub, w: Worker) -> None:
    """Send a marker batch and wait until the hub applied it (PUB delivery is asynchronous; a
    subscriber that just connected misses what was sent before, so the marker is sent again)."""
    for _ in range(20):
        pub.send([block_removed([-1], None)])
        target = pub.pub._seq - 1
        try:
            await wait_for(lambda t=target: hub.streams[w.url].last_seq == t, 0.5, "the marker batch")
            return
        except AssertionError:
            continue
    raise AssertionError("the hub never applied a marker batch")


A = list(range(1000, 1016))  # 4 blocks
B = list(range(2000, 2012))  # 3 blocks


@pytest.mark.timeout(30)
async def test_catch_up_then_follow_live() -> None:
    pub = Publisher()
    try:
        pub.send([all_blocks_cleared(), stored(A, 1)])  # before the gateway subscribed: replayed
        await asyncio.sleep(0.1)
        hub, w, index = await follow(pub)
        assert overlap(index, w, A) == 4
        pub.send([stored(B, 10)])
        await settle(pub, hub, w)
        assert overlap(index, w, B) == 3
        pub.send([block_removed([3, 4], None)])
        await settle(pub, hub, w)
        assert overlap(index, w, A) == 2
        await hub.stop()
    finally:
        pub.close()


@pytest.mark.timeout(30)
async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    pub = Publisher()
    try:
        hub, w, index = await follow(pub)
        await settle(pub, hub, w)
        pub.lose([stored(A, 1)])
        pub.lose([block_removed([4], None)])
        pub.send([stored(B, 10)])
        await settle(pub, hub, w)
        stats = hub.streams[w.url]
        assert stats.gaps == 1 and stats.replayed >= 2 and stats.resyncs == 0
        assert overlap(index, w, A) == 3 and overlap(index, w, B) == 3
        await hub.stop()
    finally:
        pub.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("replay", [False, True])
async def test_an_unfillable_gap_resyncs(replay: bool) -> None:
    """No replay socket, or a buffer that no longer reaches back: stale entries go, new ones count."""
    pub = Publisher(replay=replay, buffer_steps=2)
    try:
        hub, w, index = await follow(pub)
        await settle(pub, hub, w)  # connected
        pub.send([stored(A, 1)])
        await settle(pub, hub, w)
        for _ in range(3):  # more than the buffer holds
            pub.lose([block_removed([1], None)])
        pub.send([stored(B, 10)])
        await settle(pub, hub, w)
        assert hub.streams[w.url].resyncs == 1
        assert overlap(index, w, A) == 0 and overlap(index, w, B) == 3
        await hub.stop()
    finally:
        pub.close()


@pytest.mark.timeout(30)
async def test_a_removed_worker_is_forgotten() -> None:
    pub = Publisher()
    registry = WorkerRegistry()
    try:
        hub, w, index = await follow(pub, registry)
        pub.send([stored(A, 1)])
        await settle(pub, hub, w)
        task = hub._tasks[w.url]
        registry.set_state(w, WorkerState.DRAINING)
        registry.set_state(w, WorkerState.REMOVED)
        await wait_for(task.done, 5, "the subscription to end")
        assert not index.follows(w.url) and len(index) == 0 and not hub.follows(w)
        await hub.stop()
    finally:
        pub.close()


@pytest.mark.timeout(30)
async def test_gateway_restarted_mid_stream_catches_up() -> None:
    """A new gateway (empty index) rebuilds the worker's state from the replay buffer, then follows."""
    pub = Publisher()
    try:
        hub, w, _index = await follow(pub)
        pub.send([stored(A, 1)])
        pub.send([stored(B, 10)])
        await settle(pub, hub, w)
        await hub.stop()  # the gateway goes down; the engine carries on
        pub.send([block_removed([12], None)])
        pub.send([stored([7] * 8, 20, parent=2)])  # two blocks after A's second
        hub2, w2, index2 = await follow(pub)
        assert overlap(index2, w2, A) == 4 and overlap(index2, w2, B) == 2
        assert overlap(index2, w2, A[:8] + [7] * 8) == 4
        pub.send([block_removed([1], None)])
        await settle(pub, hub2, w2)
        assert overlap(index2, w2, A) == 0
        await hub2.stop()
    finally:
        pub.close()


@pytest.mark.timeout(30)
async def test_restarted_engine_starts_clean() -> None:
    pub = Publisher()
    try:
        hub, w, index = await follow(pub)
        pub.send([stored(A, 1)])
        await settle(pub, hub, w)
        pub.close()
        await asyncio.sleep(0.2)
        pub.pub = ZmqEventPublisher(pub.cfg)  # same addresses, numbering from 0 again
        await asyncio.sleep(0.3)  # the SUB socket reconnects
        pub.send([all_blocks_cleared(), stored(B, 10)])
        await wait_for(lambda: overlap(index, w, B) == 3, 5, "the restarted engine's blocks")
        assert overlap(index, w, A) == 0 and hub.streams[w.url].restarts == 1
        await hub.stop()
    finally:
        pub.close()


def test_chain_keys_are_fast_enough_to_matter() -> None:
    """Not a speed check (benchmarks print those): keys for a long prompt are computed in one go."""
    toks = as_tokens(np.arange(8192) % 49152)
    assert len(chain_keys(toks, 16)) == 512


# ---------------------------------------------------------------------------------------------- policy, config
def _policy(**kw: Any) -> tuple[Any, list[Worker]]:
    from atomesh.config import GatewayConfig
    from atomesh.kv.tokens import PromptTokenizer
    from atomesh.policies import make_policy
    from engine.tokenizer import ByteTokenizer

    policy = make_policy("kv_aware", GatewayConfig.model_validate({"policy": "kv_aware", **kw}))
    policy.tokenizer = PromptTokenizer.from_info(ByteTokenizer().describe())
    ws = [Worker(url=f"http://10.0.0.{i}:8000") for i in range(3)]
    for w in ws:
        policy.index.add_worker(w.url, 4)
    return policy, ws


def _view(prompt: str) -> Any:
    from atomesh.request import RequestView, Route

    return RequestView(Route.COMPLETIONS, {"prompt": prompt}, b"", "r")


def test_kv_aware_follows_the_holder_unless_it_is_loaded() -> None:
    policy, ws = _policy()
    prompt = "a long shared prefix " * 8
    toks = list(prompt.encode())
    policy.index.stored(ws[1].url, list(range(len(toks) // 4)), None, toks[: len(toks) // 4 * 4], 4)
    decision = policy.select(ws, _view(prompt + "tail"))
    assert decision.worker is ws[1]
    policy.record(decision, _view(prompt + "tail"))
    ws[1].foreign_load = 12  # busy with other replicas' requests, each as our average placement's new blocks
    policy.load.mean_new = 40.0
    assert policy.select(ws, _view(prompt + "tail")).worker is not ws[1]


def test_kv_aware_falls_back_without_events_or_tokenizer() -> None:
    policy, ws = _policy()
    for w in ws:
        policy.index.remove_worker(w.url)
    policy.select(ws, _view("hello"))
    assert policy.fallbacks == 1 and policy.decisions == 0
    policy, ws = _policy()
    policy.tokenizer = None
    policy.select(ws, _view("hello"))
    assert policy.fallbacks == 1


def test_kv_aware_soft_choice_spreads_by_cost() -> None:
    policy, ws = _policy(kv_temperature=1.0)
    policy.picker._rng.seed(1)
    prompt = "x" * 64
    policy.index.stored(ws[0].url, list(range(16)), None, list(prompt.encode()), 4)
    picks = [policy.select(ws, _view(prompt)).worker for _ in range(300)]
    counts = [picks.count(w) for w in ws]
    assert counts[0] > counts[1] > 0 and counts[2] > 0


def _store(policy: Any, worker: Worker, text: str, live: bool = True) -> None:
    toks = list(text.encode())
    n = len(toks) // 4
    policy.index.stored(worker.url, [hash((worker.url, text, i)) for i in range(n)], None, toks[: n * 4], 4, live)


def test_kv_aware_spreads_new_prefixes_by_the_kv_traffic_the_events_show() -> None:
    """A prompt nobody holds goes where the KV traffic has been least lately: the worker whose events
    show much more is passed over; the others (within one average placement's new blocks of the
    least) share the new prefixes at random."""
    policy, ws = _policy()
    policy.load.mean_new = 20.0
    for i in range(6):  # worker 0 stored a lot lately; worker 1 a little; worker 2 nothing
        _store(policy, ws[0], f"conversation {i} " * 12)
    _store(policy, ws[1], "one conversation " * 4)
    picks = {policy.select(ws, _view(f"a new question {i} " * 4)).worker.url for i in range(20)}
    assert picks == {ws[1].url, ws[2].url}
    assert policy.index.demand(ws[0].url) > policy.index.demand(ws[1].url) > policy.index.demand(ws[2].url) == 0
    # Not new: a worker that holds the prompt's prefix is followed however busy its events say it is.
    long = "a long shared document " * 10
    _store(policy, ws[0], long)
    assert policy.select(ws, _view(long + "and a question")).worker is ws[0]


def test_kv_aware_a_common_preamble_does_not_make_a_prompt_old() -> None:
    """Workers that hold the first block of a preamble every prompt starts with are no better place
    for a new prompt than one that does not: an idle worker lacking it is not left out for good."""
    policy, ws = _policy()
    preamble = "<|sys|>"
    for w in ws[:2]:  # two 4-byte blocks of a prompt of about forty
        _store(policy, w, preamble + "x")
    for w in ws:
        w.in_flight = 0
    prompt = preamble + "a brand new question nobody has asked before, long enough: " + "q" * 100
    picks = {policy.select(ws, _view(prompt + str(i))).worker.url for i in range(12)}
    assert ws[2].url in picks  # its demand is the least: the cost's two blocks of preamble did not decide
    # Once a worker holds a real part of the prompt (cache_threshold, 0.3 of its blocks), the cost decides.
    _store(policy, ws[0], prompt[:80])
    assert policy.select(ws, _view(prompt + "!")).worker is ws[0]


def test_kv_aware_placements_count_in_demand_at_once() -> None:
    """A placement (this replica's, or a synced peer's) counts in the worker's traffic before its
    events arrive, so new prompts go elsewhere once it is a placement's worth ahead."""
    policy, ws = _policy()
    first = _view("a first new prompt " * 4)
    decision = policy.select(ws, first)
    policy.record(decision, first)
    busy = decision.worker
    assert policy.index.demand(busy.url) == pytest.approx(decision.new[busy.url], rel=1e-3)
    policy._peer_placed(busy.url, [1, 2, 3])  # a peer replica placed there too
    picks = {policy.select(ws, _view(f"another new prompt {i} " * 4)).worker for i in range(12)}
    assert busy not in picks


def test_kv_aware_demand_counts_live_events_only() -> None:
    """Replayed batches rebuild the index but are no news of current traffic (nor do they depend on
    the engine's and the gateway's clocks agreeing)."""
    from atomesh.kv.index import DEMAND_HALF_LIFE, as_tokens, chain_keys

    policy, ws = _policy()
    _store(policy, ws[0], "x" * 400, live=False)  # from the replay buffer
    _store(policy, ws[1], "y" * 40)  # live
    keys = chain_keys(as_tokens(list(b"x" * 400)), 4)
    assert policy.index.overlaps(keys, [policy.index.bit(ws[0].url)]) == [100]
    assert policy.index.demand(ws[0].url) == 0 and policy.index.demand(ws[1].url) == pytest.approx(10, rel=1e-3)
    later = __import__("time").monotonic() + DEMAND_HALF_LIFE
    assert policy.index.demand(ws[1].url, later) == pytest.approx(5, rel=0.01)


def test_kv_aware_flags_are_checked() -> None:
    from pydantic import ValidationError

    from atomesh.config import GatewayConfig
    from atomesh.gateway import _pool_policy

    with pytest.raises(ValidationError, match="WORKER_URL"):
        GatewayConfig.model_validate({"policy": "kv_aware", "kv_events_endpoints": ["tcp://h:1"]})
    from atomesh.policies import PolicyNotAvailable, make_policy

    with pytest.raises(PolicyNotAvailable, match="--tokenizer-path"):
        make_policy("kv_aware", GatewayConfig.model_validate({"policy": "kv_aware", "tokenizer_path": "/nonexistent"}))
    pd = GatewayConfig.model_validate(
        {"policy": "kv_aware", "pd_disaggregation": True, "prefill": [{"url": "http://p:1"}], "decode": ["http://d:1"]}
    )
    assert _pool_policy(pd, WorkerRole.PREFILL) == "kv_aware" and _pool_policy(pd, WorkerRole.DECODE) == "least_load"


def _evict_tail(policy: Any, worker: Worker, text: str, keep: int, live: bool = True) -> None:
    """``worker``'s events report the blocks of ``text`` (stored by _store) after the first ``keep`` removed."""
    n = len(text.encode()) // 4
    policy.index.removed(worker.url, [hash((worker.url, text, i)) for i in range(keep, n)], live)


def test_index_counts_live_evictions_and_remembers_lost_keys() -> None:
    """Removals from live events count as evictions (decayed like demand); their keys are remembered
    (bounded) until stored again; replays and a cleared worker count nothing."""
    from atomesh.kv.index import DEMAND_HALF_LIFE, LOST_PER_WORKER, as_tokens, chain_keys

    policy, ws = _policy()
    text = "a conversation that grows " * 4  # 26 blocks of 4
    keys = chain_keys(as_tokens(list(text.encode())), 4)
    _store(policy, ws[0], text)
    _evict_tail(policy, ws[0], text, 10)
    index = policy.index
    assert index.evictions(ws[0].url) == pytest.approx(len(keys) - 10, rel=1e-3)
    assert index.lost(ws[0].url, keys[10]) and index.lost(ws[0].url, keys[-1]) and not index.lost(ws[0].url, keys[9])
    assert index.evictions(ws[0].url, __import__("time").monotonic() + DEMAND_HALF_LIFE) == pytest.approx(8, rel=0.01)
    _store(policy, ws[0], text)  # stored again: no longer lost
    assert not index.lost(ws[0].url, keys[10])
    _store(policy, ws[1], text)
    _evict_tail(policy, ws[1], text, 0, live=False)  # from a replay buffer: no news of pressure
    assert index.evictions(ws[1].url) == 0 and index.lost(ws[1].url, keys[0])
    index.cleared(ws[1].url)  # a restarted engine: nothing it dropped is a loss
    assert not index.lost(ws[1].url, keys[0])
    for i in range(LOST_PER_WORKER // 100 + 2):  # bounded
        _store(policy, ws[2], f"{i:04d}" * 100)
        _evict_tail(policy, ws[2], f"{i:04d}" * 100, 0)
    assert len(index._workers[ws[2].url].lost) == LOST_PER_WORKER


def test_kv_aware_moves_a_prompt_its_holder_keeps_evicting() -> None:
    """A conversation whose holder has just evicted the part after what it still holds, on a worker
    evicting far faster than the others, goes to a calmer worker (as a new prompt would); under even
    pressure, or when the holder lost nothing of it, it stays."""
    policy, ws = _policy()
    conv = "turn one of a long chat, " * 6  # 37 blocks
    _store(policy, ws[0], conv)
    _evict_tail(policy, ws[0], conv, 20)  # the holder lost the last 17 blocks of it ...
    for i in range(3):  # ... and evicts a lot lately
        _store(policy, ws[0], f"other chat {i} " * 10)
        _evict_tail(policy, ws[0], f"other chat {i} " * 10, 0)
    view = _view(conv + "turn two")
    assert policy.select(ws, view).worker is not ws[0] and policy.reliefs == 1
    # Even pressure: worker 1 evicts as much; staying wins (the cost decides, the holder has 20 blocks).
    _store(policy, ws[1], "a busy chat " * 40)
    _evict_tail(policy, ws[1], "a busy chat " * 40, 0)
    _store(policy, ws[2], "a second busy chat " * 25)
    _evict_tail(policy, ws[2], "a second busy chat " * 25, 0)
    assert policy.select(ws, view).worker is ws[0] and policy.reliefs == 1
    # The holder lost none of this prompt (it never held more): stays, however hard it evicts.
    policy2, ws2 = _policy()
    _store(policy2, ws2[0], conv[:80])
    for i in range(3):
        _store(policy2, ws2[0], f"other chat {i} " * 10)
        _evict_tail(policy2, ws2[0], f"other chat {i} " * 10, 0)
    assert policy2.select(ws2, view).worker is ws2[0] and policy2.reliefs == 0
