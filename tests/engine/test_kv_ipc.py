"""The intra-host KV path (protocol ipc): decode maps the producer's pools and copies the blocks itself.

On CPU the pools are shared memory opened through ``/proc/<pid>/fd`` (the same handshake and copy
as CUDA IPC on a GPU). The producer and consumer of most tests live in this process (their caches
are separate tensors; the consumer maps the producer's through the file descriptor, as another
process would); one test puts the producer in its own process and kills it while its pools are
mapped. Every test checks the release reasons and that nothing stays pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import torch
from gwtest import require

os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

from engine.kv_transfer import KVConsumer, KVProducer, KVTransferError, MooncakeAgent, ReleaseReason, wire
from engine.kv_transfer.ipc import (
    HostIdentity,
    IpcMode,
    IpcPeers,
    IpcUnavailable,
    PeerPools,
    PoolExport,
    _check_shm_room,
)
from engine.kv_transfer.layout import region_views, view_region
from engine.kv_transfer.wire import MessageType

require("mooncake.engine", "the KV transfer tests run real Mooncake agents")

pytestmark = pytest.mark.timeout(120)

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 64, 4, 2, 8


@dataclass
class Caches:
    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]

    @property
    def views(self) -> list[torch.Tensor]:
        return region_views(self.kv, self.indexer)

    def block(self, region: int, block_id: int) -> bytes:
        return self.views[region][block_id].numpy().tobytes()


def _caches(fill: bool) -> Caches:
    g = torch.Generator().manual_seed(7)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kv = [torch.randn(shape, generator=g) if fill else torch.zeros(shape) for _ in range(LAYERS)]
    indexer = [torch.randn(NUM_BLOCKS, HEAD_DIM, generator=g) if fill else torch.zeros(NUM_BLOCKS, HEAD_DIM)
               for _ in range(LAYERS)]  # fmt: skip
    return Caches(kv, indexer)


@dataclass
class Releases:
    calls: list[tuple[str, ReleaseReason]] = field(default_factory=list)

    def callback(self, tag: str) -> Callable[[ReleaseReason], None]:
        return lambda reason: self.calls.append((tag, reason))

    def reasons(self, tag: str) -> list[ReleaseReason]:
        return [r for t, r in self.calls if t == tag]


@dataclass
class Pair:
    """A producer exporting its pools and a decode side (caches, an agent that registered nothing)."""

    prefill: Caches
    decode: Caches
    producer: KVProducer
    agent: MooncakeAgent  # decode's: with nothing registered, a pull through Mooncake could not land

    def consumer(self, mode: IpcMode = IpcMode.AUTO, **kw: object) -> KVConsumer:
        views = self.decode.views
        return KVConsumer(self.agent, [view_region(v) for v in views], ipc=IpcPeers(views, mode), **kw)  # type: ignore[arg-type]


async def _producer(prefill: Caches, agent: MooncakeAgent, *, host: HostIdentity | None = None,
                    ipc_only: bool = False, port: int = 0, timeout_s: float = 10.0) -> KVProducer:  # fmt: skip
    views = prefill.views
    export = PoolExport(views, host=host)
    regions = [view_region(v) for v in views]  # after the export moved the caches into shared memory
    producer = KVProducer(agent, regions, host="127.0.0.1", handshake_port=port, bind_host="127.0.0.1",
                          timeout_s=timeout_s, ipc=export, ipc_only=ipc_only)  # fmt: skip
    await producer.start()
    return producer


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    prefill, decode = _caches(fill=True), _caches(fill=False)
    p_agent, d_agent = MooncakeAgent("127.0.0.1"), MooncakeAgent("127.0.0.1")
    producer = await _producer(prefill, p_agent)
    try:
        yield Pair(prefill, decode, producer, d_agent)
    finally:
        await producer.close()
        p_agent.close()
        d_agent.close()


async def _settled(producer: KVProducer) -> None:
    """Wait until the producer released every transfer (an ipc pull's release follows its last word, ipc_done)."""
    deadline = time.monotonic() + 5
    while producer.pending_count:
        assert time.monotonic() < deadline, f"{producer.pending_count} transfers still pending"
        await asyncio.sleep(0.01)


def _assert_copied(pair: Pair, src: list[int], dst: list[int]) -> None:
    for r in range(len(pair.prefill.views)):
        for s, d in zip(src, dst, strict=True):
            assert pair.decode.block(r, d) == pair.prefill.block(r, s), f"region {r}: block {s} -> {d} differs"
    zero = bytes(len(pair.decode.block(0, 0)))
    assert all(pair.decode.block(0, b) == zero for b in set(range(NUM_BLOCKS)) - set(dst)), "a stray block written"


@pytest.mark.parametrize("ids", [
    (list(range(8)), list(range(8))),  # contiguous: slice copies
    ([3, 9, 1, 40, 22, 63, 0, 17], [5, 60, 2, 33, 8, 11, 47, 30]),  # scattered: gather / scatter
])  # fmt: skip
async def test_an_ipc_pull_copies_kv_and_indexer_blocks_byte_for_byte(
    pair: Pair, ids: tuple[list[int], list[int]]
) -> None:
    src, dst = ids
    releases = Releases()
    params = pair.producer.offer(src, 42, releases.callback("t"))
    consumer = pair.consumer()
    assert consumer.dst_may_be_written_if_cancelled(params)  # not yet known to be mapped: a Mooncake write could be
    await consumer.pull(params, dst)
    assert not consumer.dst_may_be_written_if_cancelled(params)  # mapped: a cancelled pull waits for its own copy
    _assert_copied(pair, src, dst)
    await _settled(pair.producer)
    assert releases.reasons("t") == [ReleaseReason.WRITTEN] and pair.producer.pending_count == 0
    assert consumer._ipc is not None and consumer._ipc.peers() == {f"127.0.0.1:{pair.producer.port}": "ipc"}
    assert pair.producer.stats().bytes_written == len(src) * sum(v.shape[1] for v in pair.prefill.views)


async def test_skipped_blocks_and_sixteen_concurrent_pulls(pair: Pair) -> None:
    releases = Releases()
    consumer = pair.consumer(max_inflight=4)
    jobs = []
    for i in range(16):
        src, dst = [i * 3, i * 3 + 1, 63 - i], [i * 4, i * 4 + 1, i * 4 + 2]
        jobs.append((src, dst, pair.producer.offer(src, 1, releases.callback(str(i)))))
    await asyncio.gather(*(consumer.pull(p, dst) for _, dst, p in jobs))
    await _settled(pair.producer)
    for i, (src, dst, _) in enumerate(jobs):
        assert releases.reasons(str(i)) == [ReleaseReason.WRITTEN]
        for r in range(len(pair.prefill.views)):
            assert all(pair.decode.block(r, d) == pair.prefill.block(r, s) for s, d in zip(src, dst, strict=True))
    assert consumer.in_flight == 0 and pair.producer.pending_count == 0
    params = pair.producer.offer([1, 2], 1, releases.callback("skip"))
    for t in pair.decode.kv + pair.decode.indexer:
        t.zero_()
    await consumer.pull(params, [-1, 50])  # decode already holds the first block
    assert pair.decode.block(0, 50) == pair.prefill.block(0, 2)
    assert all(pair.decode.block(0, b) == bytes(len(pair.decode.block(0, 0))) for b in range(50))


async def test_forced_ipc_refuses_a_producer_on_another_host_and_auto_falls_back() -> None:
    prefill, decode = _caches(fill=True), _caches(fill=False)
    p_agent, d_agent = MooncakeAgent("127.0.0.1"), MooncakeAgent("127.0.0.1")
    elsewhere = HostIdentity("another-boot-id", "elsewhere")
    producer = await _producer(prefill, p_agent, host=elsewhere)
    p_agent.register(producer._regions)
    d_views = decode.views
    d_regions = [view_region(v) for v in d_views]
    d_agent.register(d_regions)
    try:
        releases = Releases()
        params = producer.offer([4, 5], 1, releases.callback("t"))
        forced = KVConsumer(d_agent, d_regions, ipc=IpcPeers(d_views, IpcMode.FORCED))
        with pytest.raises(KVTransferError, match=r"protocol 'ipc'.*'elsewhere'") as err:
            await forced.pull(params, [6, 7])
        assert err.value.reason == "ipc_unavailable" and not err.value.dst_may_be_written
        assert not forced.dst_may_be_written_if_cancelled(params)  # every pull it makes is its own ipc copy
        assert releases.calls == [] and producer.pending_count == 1  # refused before it was consumed
        auto = IpcPeers(d_views, IpcMode.AUTO)
        fallback = KVConsumer(d_agent, d_regions, ipc=auto)
        await fallback.pull(params, [6, 7])  # through Mooncake
        assert auto.peers() == {f"127.0.0.1:{producer.port}": "mooncake"}
        assert fallback.dst_may_be_written_if_cancelled(params)  # the producer writes the blocks directly
        assert releases.reasons("t") == [ReleaseReason.WRITTEN]
        assert decode.block(3, 7) == prefill.block(3, 5)
    finally:
        await producer.close()
        p_agent.close()
        d_agent.close()


async def test_a_producer_forced_to_ipc_refuses_a_mooncake_pull_and_frees_its_blocks() -> None:
    prefill, decode = _caches(fill=True), _caches(fill=False)
    p_agent, d_agent = MooncakeAgent("127.0.0.1"), MooncakeAgent("127.0.0.1")
    producer = await _producer(prefill, p_agent, ipc_only=True)
    try:
        releases = Releases()
        params = producer.offer([1], 1, releases.callback("t"))
        with pytest.raises(KVTransferError, match="protocol is 'ipc'") as err:
            await KVConsumer(d_agent, [view_region(v) for v in decode.views]).pull(params, [1])
        assert err.value.reason == "ipc_unavailable"
        assert releases.reasons("t") == [ReleaseReason.REFUSED] and producer.pending_count == 0
    finally:
        await producer.close()
        p_agent.close()
        d_agent.close()


async def test_a_restarted_producer_is_mapped_again(pair: Pair) -> None:
    consumer = pair.consumer(IpcMode.FORCED)
    releases = Releases()
    await consumer.pull(pair.producer.offer([1], 1, releases.callback("a")), [1])
    port = pair.producer.port
    await pair.producer.close()
    fresh = _caches(fill=True)
    fresh.kv[0].add_(1.0)  # other bytes than the first producer's
    agent = MooncakeAgent("127.0.0.1")
    again = await _producer(fresh, agent, port=port)
    try:
        await consumer.pull(again.offer([2], 1, releases.callback("b")), [3])  # ipc_stale, remapped, pulled
        assert pair.decode.block(0, 3) == fresh.block(0, 2)
        await _settled(again)
        assert releases.reasons("b") == [ReleaseReason.WRITTEN]
    finally:
        await again.close()
        agent.close()


async def test_a_consumer_hanging_up_after_ipc_read_frees_the_producer_blocks(pair: Pair) -> None:
    releases = Releases()
    params = pair.producer.offer([1, 2], 1, releases.callback("t"))
    pool = pair.producer._ipc.pool_id if pair.producer._ipc else ""
    reader, writer = await asyncio.open_connection("127.0.0.1", pair.producer.read_port)
    await wire.send(writer, MessageType.WRITE_REQUEST, transfer_id=params.transfer_id, rpc=pair.agent.rpc_address,
                    block_ids=[3, 4], regions=[view_region(v).to_wire() for v in pair.decode.views], nonce="n",
                    ipc_pool=pool)  # fmt: skip
    assert (await wire.recv(reader)) == {"v": wire.VERSION, "type": MessageType.IPC_READ,
                                         "transfer_id": params.transfer_id, "nonce": "n"}  # fmt: skip
    writer.close()  # gone before ipc_done
    deadline = time.monotonic() + 5
    while not releases.calls:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and pair.producer.pending_count == 0


async def test_ipc_reads_are_served_while_the_producer_loop_is_blocked(pair: Pair) -> None:
    """The read desk is a thread of its own: a pull completes (copied, answered) while the producer's event
    loop is stuck in a long synchronous stretch (a big step's bookkeeping); only the release of the blocks
    waits for that loop."""
    releases = Releases()
    params = pair.producer.offer([5, 6, 7], 1, releases.callback("t"))
    consumer = pair.consumer()
    await consumer.pull(pair.producer.offer([1], 1, releases.callback("warm")), [1])  # maps the pools
    started = threading.Event()
    # The pull runs on another loop (a decode engine's); this loop (the producer's) is blocked meanwhile.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pulled = pool.submit(_pull_on_new_loop, consumer, params, [10, 11, 12], started)
        started.wait(5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and not pulled.done():  # the producer's loop does not run meanwhile
            time.sleep(0.005)
        assert pulled.done(), "the pull needed the producer's event loop"
        assert pulled.result() < 10 and releases.reasons("t") == []  # landed; the release waits for the loop
    _assert_copied_some(pair, [5, 6, 7], [10, 11, 12])
    deadline = time.monotonic() + 5
    while releases.reasons("t") != [ReleaseReason.WRITTEN]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert pair.producer.pending_count == 0


def _pull_on_new_loop(consumer: KVConsumer, params: object, dst: list[int], started: threading.Event) -> float:
    async def run() -> float:
        t = time.monotonic()
        started.set()
        await consumer.pull(params, dst)  # type: ignore[arg-type]
        return time.monotonic() - t

    return asyncio.run(run())


def _assert_copied_some(pair: Pair, src: list[int], dst: list[int]) -> None:
    for r in range(len(pair.prefill.views)):
        for s, d in zip(src, dst, strict=True):
            assert pair.decode.block(r, d) == pair.prefill.block(r, s), f"region {r}: block {s} -> {d} differs"


async def test_a_pull_lands_nothing_before_the_step_it_must_follow_ended(pair: Pair) -> None:
    """``after``: the engine's step in flight when an abort freed some of the destination blocks (it may still
    write them). The claim goes out at once, the copy waits for that step; without ``after`` nothing waits."""
    releases = Releases()
    consumer = pair.consumer()
    step: concurrent.futures.Future[None] = concurrent.futures.Future()
    pull = asyncio.ensure_future(consumer.pull(pair.producer.offer([4, 5], 1, releases.callback("t")), [8, 9], step))
    await asyncio.sleep(0.5)
    assert not pull.done() and pair.decode.block(0, 8) == bytes(len(pair.decode.block(0, 8)))
    step.set_result(None)  # the step ended
    await asyncio.wait_for(pull, 10)
    _assert_copied_some(pair, [4, 5], [8, 9])
    await consumer.pull(pair.producer.offer([6], 1, releases.callback("u")), [10], None)
    _assert_copied_some(pair, [6], [10])
    await _settled(pair.producer)
    assert releases.reasons("t") == releases.reasons("u") == [ReleaseReason.WRITTEN]


async def test_a_timed_out_ipc_pull_frees_both_sides(pair: Pair) -> None:
    """The producer's read desk is stuck before it claims the transfer: decode times out, its blocks are free at
    once (nothing was copied), and the producer releases when it finds the consumer gone."""
    releases = Releases()
    params = pair.producer.offer([1], 1, releases.callback("t"))
    consumer = pair.consumer(timeout_s=1.0)
    gate = threading.Event()
    original = pair.producer._claim_read

    def stuck(msg: dict[str, object]) -> object:
        gate.wait(10)
        return original(msg)

    pair.producer._claim_read = stuck  # type: ignore[method-assign,assignment]
    with pytest.raises(KVTransferError, match="timed out") as err:
        await consumer.pull(params, [2])
    assert err.value.reason == "timeout" and not err.value.dst_may_be_written
    assert consumer.in_flight == 0
    gate.set()
    deadline = time.monotonic() + 5
    while not releases.calls:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and pair.producer.pending_count == 0
    assert pair.decode.block(0, 2) == bytes(len(pair.decode.block(0, 2)))


def test_shared_memory_too_small_is_refused_before_anything_moves() -> None:
    with pytest.raises(IpcUnavailable, match="--shm-size"):
        _check_shm_room(1 << 62)


async def test_a_producer_killed_while_its_pools_are_mapped_fails_pulls_cleanly(engine_device: str) -> None:
    """The producer in its own process (SmolLM2-shaped caches, one shared segment: shared memory on CPU, a
    CUDA IPC handle with ENGINE_TEST_DEVICE=cuda); decode maps it, pulls, then the producer is killed: the
    next pull fails fast (no crash) and the mapping is dropped."""
    from bench.engine import kv_transfer as bench

    num_blocks = 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bench._producer_main, daemon=True,
                       args=(child, num_blocks, "fp32", "engine", "staged", 16, engine_device, 2, "ipc"))  # fmt: skip
    proc.start()
    loop = asyncio.get_running_loop()
    agent = MooncakeAgent("127.0.0.1")
    try:
        assert await asyncio.wait_for(loop.run_in_executor(None, parent.poll, 60), 61), "producer did not start"
        parent.recv()
        local = bench.make_caches(num_blocks, torch.float32, device=engine_device)
        peers = IpcPeers(local.views, IpcMode.FORCED)
        consumer = KVConsumer(agent, local.regions, timeout_s=20, ipc=peers)
        parent.send(("offer", [1, 2, 6]))
        await consumer.pull(parent.recv(), [0, 1, 7])
        expected = bench.make_caches(num_blocks, torch.float32)
        bench.fill(expected)
        for r in range(len(local.views)):
            for s, d in ((1, 0), (2, 1), (6, 7)):
                assert torch.equal(local.views[r][d].cpu(), expected.views[r][s]), f"region {r} block {s}"
        parent.send(("offer", [3]))
        params = parent.recv()
        proc.kill()
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match=r"unreachable|dropped"):
            await consumer.pull(params, [3])
        assert time.monotonic() - start < 2.0 and consumer.in_flight == 0
        assert peers.peers() == {}  # the dead producer's pools are unmapped
    finally:
        agent.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_pools_that_are_not_the_producers_do_not_open() -> None:
    """Another host, another device kind, or a descriptor path that names another file here (a process of
    another PID namespace with the same pid): each refused, saying why, before anything is mapped."""
    export = PoolExport(_caches(fill=True).views)
    here = export.host
    desc = export.describe()
    assert len(PeerPools.open(desc, torch.device("cpu"), here).views) == 2 * LAYERS + LAYERS
    with pytest.raises(IpcUnavailable, match="elsewhere"):
        PeerPools.open(desc, torch.device("cpu"), HostIdentity(here.boot_id, "elsewhere"))
    with pytest.raises(IpcUnavailable, match="on cpu, this engine's on meta"):
        PeerPools.open(desc, torch.device("meta"), here)
    other = [{**seg, "file": [0, 0]} for seg in desc["segments"]]
    with pytest.raises(IpcUnavailable, match="not the producer's shared memory"):
        PeerPools.open({**desc, "segments": other}, torch.device("cpu"), here)


@pytest.mark.parametrize("grouped", [False, True])
def test_copy_blocks_per_region_and_in_layer_groups_copy_the_same(grouped: bool) -> None:
    """The grouped copy (the default on CUDA: K and V of a layer, or all layers of one buffer, in one copy)
    and the per-region one (CPU) move exactly the named blocks, for the engine's per-layer tensors and for
    caches cut from one buffer."""
    from bench.engine import kv_transfer as bench
    from engine.kv_transfer.ipc import _layer_groups, copy_blocks

    one_buffer = bench.make_caches(NUM_BLOCKS, torch.float32), bench.make_caches(NUM_BLOCKS, torch.float32)
    bench.fill(one_buffer[0])
    layouts = {"per-layer": (_caches(fill=True).views, _caches(fill=False).views),
               "one-buffer": (one_buffer[0].views, one_buffer[1].views)}  # fmt: skip
    # per layer: K and V together, then each indexer region alone; one buffer: all KV, then all indexer keys
    assert [len(_layer_groups(*v)) for v in layouts.values()] == [LAYERS + LAYERS, 2]
    for src_views, dst_views in layouts.values():
        for src, dst in ((list(range(5, 13)), list(range(20, 28))), ([3, 9, 1, 40, 22, 63], [5, 60, 2, 33, 8, 11])):
            for v in dst_views:
                v.zero_()
            copy_blocks(src_views, dst_views, src, dst, grouped=grouped)
            for r, (s_view, d_view) in enumerate(zip(src_views, dst_views, strict=True)):
                assert torch.equal(d_view[dst], s_view[src]), f"region {r}"
                untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))
                assert not d_view[untouched].any(), f"region {r}: a block outside the destination was written"


async def _rounds_seen(peers: IpcPeers, before: int, at_least: int) -> None:
    deadline = time.monotonic() + 5
    while peers.early_rounds < before + at_least:
        assert time.monotonic() < deadline, f"{peers.early_rounds - before} rounds copied, waited for {at_least}"
        await asyncio.sleep(0.01)


async def test_an_early_offer_is_copied_round_by_round_as_its_blocks_become_final(pair: Pair) -> None:
    """Offered before its prefill ran: each block is copied once it is final, the first token comes with the last
    round; the decode side's held block (SKIP) is left alone."""
    src, dst = [3, 9, 1, 40, 22, 63], [-1, 60, 2, 33, 8, 11]
    releases = Releases()
    params = pair.producer.offer_early(len(src), releases.callback("t"))
    assert params.early and params.remote_block_ids == () and params.first_token_id is None
    consumer = pair.consumer()
    peers = consumer._ipc
    assert peers is not None
    pull = asyncio.ensure_future(consumer.pull(params, dst))
    await asyncio.sleep(0.1)
    assert not pull.done()  # nothing is final yet: the pull waits for the prefill
    pair.producer.progress(params.transfer_id, src, 2)  # the first chunk's step: two blocks final
    await _rounds_seen(peers, 0, 1)
    assert pair.decode.block(0, 60) == pair.prefill.block(0, 9) and not pull.done()
    assert pair.decode.block(0, 2) == bytes(len(pair.decode.block(0, 2)))  # not final yet: not copied
    pair.producer.progress(params.transfer_id, src, 5)
    await _rounds_seen(peers, 1, 1)
    pair.producer.conclude(params.transfer_id, src, first_token_id=42)
    assert await pull == 42
    _assert_copied(pair, src[1:], dst[1:])
    await _settled(pair.producer)
    assert releases.reasons("t") == [ReleaseReason.WRITTEN]
    assert pair.producer.stats().bytes_written == len(src) * sum(v.shape[1] for v in pair.prefill.views)


async def test_an_early_offer_whose_prefill_fails_is_refused_on_both_sides(pair: Pair) -> None:
    """Mid-read: the reader gets the failure with the last round and the transfer ends once; unread: ended at once,
    and a later pull is refused naming the failure."""
    releases = Releases()
    consumer = pair.consumer()
    params = pair.producer.offer_early(4, releases.callback("read"))
    pull = asyncio.ensure_future(consumer.pull(params, [10, 11, 12, 13]))
    pair.producer.progress(params.transfer_id, [1, 2, 3, 4], 2)
    await asyncio.sleep(0.1)
    pair.producer.conclude(params.transfer_id, error="model step failed")
    with pytest.raises(KVTransferError, match="model step failed") as err:
        await pull
    assert err.value.reason == "prefill_failed" and not err.value.dst_may_be_written
    unread = pair.producer.offer_early(2, releases.callback("unread"))
    pair.producer.conclude(unread.transfer_id, error="aborted")
    assert releases.reasons("unread") == [ReleaseReason.WRITE_FAILED]  # at once: nobody holds it
    with pytest.raises(KVTransferError, match="aborted") as err:
        await consumer.pull(unread, [20, 21])
    assert err.value.reason == "prefill_failed"
    await _settled(pair.producer)
    assert releases.reasons("read") == [ReleaseReason.WRITE_FAILED] and consumer.in_flight == 0


async def test_an_early_offer_given_up_before_its_pull_is_abandoned_and_its_prefill_released(pair: Pair) -> None:
    """A decode engine that gives up an early offer it never read (cancelled while waiting for blocks or for its
    turn) says `abandon`: the producer releases the offer at once (the engine then stops its prefill), and a
    later pull is refused; an offer a read already claimed is left to that read."""
    releases = Releases()
    consumer = pair.consumer()
    params = pair.producer.offer_early(2, releases.callback("given up"))
    consumer.abandon(params)
    deadline = time.monotonic() + 5
    while not releases.reasons("given up"):
        assert time.monotonic() < deadline, "the abandoned offer was not released"
        await asyncio.sleep(0.01)
    assert releases.reasons("given up") == [ReleaseReason.REFUSED]
    with pytest.raises(KVTransferError) as err:
        await consumer.pull(params, [10, 11])
    assert err.value.reason in ("transfer_consumed", "prefill_failed")
    # A pull in progress (claimed, reading rounds): an abandon for it changes nothing; the pull ends it.
    read = pair.producer.offer_early(2, releases.callback("read"))
    pull = asyncio.ensure_future(consumer.pull(read, [12, 13]))
    pair.producer.progress(read.transfer_id, [1, 2], 1)
    await asyncio.sleep(0.2)
    consumer.abandon(read)
    await asyncio.sleep(0.2)
    assert releases.reasons("read") == []
    pair.producer.conclude(read.transfer_id, [1, 2], first_token_id=7)
    assert await pull == 7
    await _settled(pair.producer)
    assert releases.reasons("read") == [ReleaseReason.WRITTEN]
