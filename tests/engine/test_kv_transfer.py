"""KV transfer: real Mooncake writes between two agents on loopback, the push handshake, and its faults.

Both agents live in this process (two TransferEngine instances work side by side); the caches are
CPU tensors shaped like the engine's: per layer ``[2, num_blocks, kv_heads, block_size, head_dim]``
plus one ``[num_blocks, head_dim]`` indexer-key cache per layer. Every fault test checks that the
release callback ran exactly once and that nothing stays pending.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import pytest
import torch
from gwtest import free_port, require

# A dead Mooncake peer must fail fast (default 30 s; 5 s is Mooncake's minimum). Set before any agent starts.
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

from engine.kv_transfer import (
    KVConsumer,
    KVProducer,
    KVTransferBusyError,
    KVTransferError,
    KVTransferParams,
    KVTransferParamsError,
    MooncakeAgent,
    Region,
    ReleaseReason,
    WriteOp,
    plan_writes,
    regions_from_kv_caches,
    wire,
)
from engine.kv_transfer.layout import batches, block_runs, merge_adjacent, region_views, view_region
from engine.kv_transfer.staging import StagingBuffer, check_chunk, plan_chunks

require("mooncake.engine", "the KV transfer tests run real Mooncake agents")

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 4, 2, 8
NUM_BLOCKS = 96
MAX_BATCH = 32  # small, so that scattered block lists take several batches


@dataclass
class Side:
    """One engine's caches, their regions and its agent."""

    agent: MooncakeAgent
    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]
    regions: list[Region]

    def block(self, region: int, block_id: int) -> bytes:
        caches = [t for layer in self.kv for t in (layer[0], layer[1])] + self.indexer
        return caches[region][block_id].numpy().tobytes()


def _make_side(fill: bool, max_batch: int = MAX_BATCH) -> Side:
    g = torch.Generator().manual_seed(1234)
    shape = (2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    kv = [torch.randn(shape, generator=g) if fill else torch.zeros(shape) for _ in range(LAYERS)]
    indexer = [torch.randn(NUM_BLOCKS, HEAD_DIM, generator=g) if fill else torch.zeros(NUM_BLOCKS, HEAD_DIM)]
    indexer += [torch.randn(NUM_BLOCKS, HEAD_DIM, generator=g) if fill else torch.zeros(NUM_BLOCKS, HEAD_DIM)
                for _ in range(LAYERS - 1)]  # fmt: skip
    regions = regions_from_kv_caches(kv, indexer)
    agent = MooncakeAgent("127.0.0.1", max_batch=max_batch)
    agent.register(regions)
    return Side(agent, kv, indexer, regions)


@pytest.fixture(scope="module")
def prefill() -> Iterator[Side]:
    side = _make_side(fill=True)
    yield side
    side.agent.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[Side]:
    side = _make_side(fill=False)
    yield side
    side.agent.close()


@pytest.fixture(autouse=True)
def _clean_decode(decode: Side) -> None:
    for t in decode.kv + decode.indexer:
        t.zero_()


@dataclass
class Releases:
    """Records every release callback, per transfer."""

    calls: list[tuple[str, ReleaseReason]] = field(default_factory=list)

    def callback(self, tag: str) -> Callable[[ReleaseReason], None]:
        return lambda reason: self.calls.append((tag, reason))

    def reasons(self, tag: str) -> list[ReleaseReason]:
        return [r for t, r in self.calls if t == tag]


@pytest.fixture
async def producer(prefill: Side) -> AsyncIterator[KVProducer]:
    p = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                   timeout_s=10.0)  # fmt: skip
    await p.start()
    yield p
    await p.close()


async def _poll(cond: Callable[[], bool], deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.01)


def _assert_copied(prefill: Side, decode: Side, src: list[int], dst: list[int]) -> None:
    for r in range(len(prefill.regions)):
        for s, d in zip(src, dst, strict=True):
            assert decode.block(r, d) == prefill.block(r, s), f"region {r}: block {s} -> {d} differs"
    untouched = set(range(NUM_BLOCKS)) - set(dst)
    zero = bytes(len(decode.block(0, 0)))
    assert all(decode.block(0, b) == zero for b in untouched), "a block outside the destination was written"


# -- layout: coalescing and batching -----------------------------------------------------------


def test_block_runs_coalesce_ids_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


def test_plan_writes_one_op_per_run_per_region_and_merges_neighbours() -> None:
    src = [Region(1000, 10, 8), Region(5000, 4, 8)]
    dst = [Region(20000, 10, 16), Region(90000, 4, 16)]
    assert plan_writes(src, dst, [2, 3, 6], [0, 1, 5]) == [
        WriteOp(1020, 20000, 20), WriteOp(1060, 20050, 10), WriteOp(5008, 90000, 8), WriteOp(5024, 90020, 4),
    ]  # fmt: skip
    # K and V of one layer sit back to back: all blocks of both become a single write.
    k, v = Region(0x1000, 16, 4), Region(0x1000 + 64, 16, 4)
    dk, dv = Region(0x9000, 16, 4), Region(0x9000 + 64, 16, 4)
    assert plan_writes([k, v], [dk, dv], [0, 1, 2, 3], [0, 1, 2, 3]) == [WriteOp(0x1000, 0x9000, 128)]
    with pytest.raises(ValueError, match="unit_bytes"):
        plan_writes(src, [Region(1, 10, 8), Region(2, 8, 8)], [0], [0])
    with pytest.raises(ValueError, match="region count"):
        plan_writes(src, dst[:1], [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        plan_writes(src, dst, [8], [0])
    with pytest.raises(ValueError, match="1 destination blocks for 2 source"):
        plan_writes(src, dst, [0, 1], [0])
    # -1 skips a block the consumer already holds; the rest still coalesce.
    assert plan_writes(src[:1], dst[:1], [1, 2, 3, 4], [-1, 5, 6, -1]) == [WriteOp(1020, 20050, 20)]
    assert merge_adjacent([WriteOp(10, 110, 5), WriteOp(0, 100, 10)]) == [WriteOp(0, 100, 15)]
    assert [len(b) for b in batches([WriteOp(i, i, 1) for i in range(5)], 2)] == [2, 2, 1]


def test_regions_follow_the_engine_cache_layout(prefill: Side) -> None:
    layer0 = prefill.kv[0]
    unit = BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    block = f"float32[{KV_HEADS},{BLOCK_SIZE},{HEAD_DIM}]"  # what a unit holds: a head-major block
    assert prefill.regions[0] == Region(layer0.data_ptr(), unit, NUM_BLOCKS, block)
    assert prefill.regions[1] == Region(layer0[1].data_ptr(), unit, NUM_BLOCKS, block)
    indexer = Region(prefill.indexer[0].data_ptr(), HEAD_DIM * 4, NUM_BLOCKS, f"float32[{HEAD_DIM}]")
    assert prefill.regions[2 * LAYERS] == indexer
    assert len(prefill.regions) == 3 * LAYERS
    # On the wire a region carries its format; a peer that sends none (three fields) is checked by size alone.
    assert Region.from_wire(prefill.regions[0].to_wire()) == prefill.regions[0]
    assert Region.from_wire([1, 2, 3]) == Region(1, 2, 3)
    for bad in ([1, 2, 3, 4], [1, 2, 3, ""], [1, 2, 3, "x" * 97], [1, 2], [1, 2, 3, "a", "b"]):
        with pytest.raises(ValueError, match="a region is"):
            Region.from_wire(bad)


# -- real transfers --------------------------------------------------------------------------

CASES = {
    "contiguous": (list(range(10, 30)), list(range(40, 60))),
    "scattered": ([3, 17, 18, 19, 50, 2, 90, 91], [80, 5, 6, 7, 60, 61, 0, 33]),
    # every block its own run: 9 regions x 64 blocks = 576 writes, 18 batches of 32
    "many_batches": (list(range(0, NUM_BLOCKS, 2)) + list(range(1, 33, 2)), list(range(95, 31, -1))),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_pull_copies_kv_and_indexer_blocks_byte_for_byte(
    case: str, prefill: Side, decode: Side, producer: KVProducer
) -> None:
    src, dst = CASES[case]
    releases = Releases()
    params = producer.offer(src, first_token_id=42, on_release=releases.callback("t"))
    assert producer.pending_count == 1
    wire_params = params.to_dict()
    assert wire_params["do_remote_prefill"] is True and wire_params["remote_engine_id"] == prefill.agent.rpc_address
    await KVConsumer(decode.agent, decode.regions, timeout_s=20).pull(wire_params, dst)
    _assert_copied(prefill, decode, src, dst)
    assert releases.reasons("t") == [ReleaseReason.WRITTEN]
    assert producer.pending_count == 0
    stats = producer.stats()
    assert stats.released[ReleaseReason.WRITTEN] == 1 and stats.pending == 0
    assert stats.bytes_written == len(src) * sum(r.unit_bytes for r in prefill.regions)
    if case == "many_batches":
        assert len(plan_writes(prefill.regions, decode.regions, src, dst)) > 4 * MAX_BATCH


async def test_skipped_destination_blocks_are_left_alone(prefill: Side, decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    params = producer.offer([5, 6, 7, 8], 7, releases.callback("t"))
    await KVConsumer(decode.agent, decode.regions).pull(params, [-1, -1, 20, 21])  # a decode prefix hit
    _assert_copied(prefill, decode, [7, 8], [20, 21])
    assert releases.reasons("t") == [ReleaseReason.WRITTEN] and producer.pending_count == 0


async def test_sixteen_concurrent_pulls_all_complete(prefill: Side, decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    consumer = KVConsumer(decode.agent, decode.regions, timeout_s=30)
    jobs = []
    for i in range(16):
        src, dst = [i * 5, i * 5 + 1, 95 - i], [i * 6, i * 6 + 1, i * 6 + 3]
        jobs.append((src, dst, producer.offer(src, 1, releases.callback(str(i)))))
    await asyncio.gather(*(consumer.pull(p, dst) for _, dst, p in jobs))
    for i, (src, dst, _) in enumerate(jobs):
        assert releases.reasons(str(i)) == [ReleaseReason.WRITTEN]
        for r in range(len(prefill.regions)):
            assert all(decode.block(r, d) == prefill.block(r, s) for s, d in zip(src, dst, strict=True))
    assert producer.pending_count == 0


async def test_an_unread_early_offer_expires_only_after_its_prefill_ended(prefill: Side) -> None:
    """A prefill that queues or runs longer than the timeout is not a decode engine that failed to come: an early
    offer's clock starts at ``conclude``."""
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, timeout_s=0.3)
    await producer.start()
    try:
        releases = Releases()
        params = producer.offer_early(3, releases.callback("t"))
        await asyncio.sleep(0.9)  # three timeouts while its prefill runs
        assert releases.calls == [] and producer.pending_count == 1
        producer.conclude(params.transfer_id, [1, 2, 3], first_token_id=7)
        await _poll(lambda: bool(releases.calls))
        assert releases.reasons("t") == [ReleaseReason.EXPIRED] and producer.pending_count == 0
    finally:
        await producer.close()


# -- faults: each leaves nothing pending and releases exactly once ----------------------------


async def test_decode_never_comes_blocks_released_after_timeout(prefill: Side, decode: Side) -> None:
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, timeout_s=0.3)
    await producer.start()
    try:
        releases = Releases()
        params = producer.offer([1, 2, 3], 7, releases.callback("t"))
        await _poll(lambda: bool(releases.calls))
        assert releases.reasons("t") == [ReleaseReason.EXPIRED]
        assert producer.pending_count == 0
        with pytest.raises(KVTransferError) as err:  # a late decode is refused, not served stale blocks
            await KVConsumer(decode.agent, decode.regions).pull(params, [4, 5, 6])
        assert err.value.reason == "transfer_consumed"
        assert releases.reasons("t") == [ReleaseReason.EXPIRED]
    finally:
        await producer.close()


async def test_unknown_transfer_id_refused(prefill: Side, decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    params = producer.offer([1, 2], 7, releases.callback("t")).to_dict()
    params["transfer_id"] = uuid.uuid4().hex
    with pytest.raises(KVTransferError, match="unknown transfer") as err:
        await KVConsumer(decode.agent, decode.regions).pull(params, [1, 2])
    assert err.value.reason == "unknown_transfer" and not err.value.dst_may_be_written
    assert releases.calls == [] and producer.pending_count == 1  # the real transfer is untouched
    await producer.close()
    assert releases.reasons("t") == [ReleaseReason.CLOSED] and producer.pending_count == 0


async def test_consumed_transfer_id_refused_the_second_time(decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    params = producer.offer([8, 9], 7, releases.callback("t"))
    consumer = KVConsumer(decode.agent, decode.regions)
    await consumer.pull(params, [10, 11])
    with pytest.raises(KVTransferError, match="already consumed") as err:
        await consumer.pull(params, [12, 13])
    assert err.value.reason == "transfer_consumed"
    assert releases.reasons("t") == [ReleaseReason.WRITTEN] and producer.pending_count == 0


async def test_producer_gone_fails_quickly(prefill: Side, decode: Side) -> None:
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1")
    await producer.start()
    releases = Releases()
    params = producer.offer([1, 2], 7, releases.callback("t"))
    await producer.close()  # prefill dies after answering
    assert releases.reasons("t") == [ReleaseReason.CLOSED] and producer.pending_count == 0
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="unreachable") as err:
        await KVConsumer(decode.agent, decode.regions, timeout_s=30).pull(params, [1, 2])
    assert time.monotonic() - start < 2.0
    assert err.value.reason == "unreachable" and not err.value.dst_may_be_written
    assert all(decode.block(0, b) == bytes(len(decode.block(0, b))) for b in (1, 2))


async def test_write_into_unregistered_memory_fails_and_releases(
    prefill: Side, decode: Side, producer: KVProducer
) -> None:
    releases = Releases()
    src, dst = list(range(0, 80, 2)), list(range(40))  # 40 runs x 9 regions: many batches if unguarded
    params = producer.offer(src, 7, releases.callback("t"))
    # Same layout as decode's caches, but memory the decode agent never registered.
    stray = [torch.zeros(2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM) for _ in range(LAYERS)]
    stray_idx = [torch.zeros(NUM_BLOCKS, HEAD_DIM) for _ in range(LAYERS)]
    consumer = KVConsumer(decode.agent, regions_from_kv_caches(stray, stray_idx))
    with pytest.raises(KVTransferError, match="failed") as err:
        await consumer.pull(params, dst)
    assert err.value.reason == "write_failed"
    assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and producer.pending_count == 0
    # Only a lone probe was rejected, so Mooncake's lane to the peer is not wedged: the next
    # transfer succeeds (a rejected batch would make it fail after MC_TRANSFER_TIMEOUT).
    params = producer.offer(src, 7, releases.callback("u"))
    await KVConsumer(decode.agent, decode.regions, timeout_s=20).pull(params, dst)
    _assert_copied(prefill, decode, src, dst)
    assert releases.reasons("u") == [ReleaseReason.WRITTEN]


class _StubAgent:
    """An agent that announces an rpc address where no Mooncake engine listens (a dead decode peer)."""

    def __init__(self, rpc_address: str) -> None:
        self.rpc_address = rpc_address


async def test_dead_decode_peer_write_fails_and_releases(decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    params = producer.offer([1, 2], 7, releases.callback("t"))
    consumer = KVConsumer(_StubAgent(f"127.0.0.1:{free_port()}"), decode.regions, timeout_s=20)  # type: ignore[arg-type]
    with pytest.raises(KVTransferError) as err:
        await consumer.pull(params, [1, 2])
    assert err.value.reason == "write_failed"
    assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and producer.pending_count == 0


class _SlowAgent:
    """A TransferAgent that takes 0.1 s per batch and counts them (no Mooncake)."""

    rpc_address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.batches = 0

    def register(self, regions: object) -> None:
        pass

    async def write(self, peer: str, ops: object) -> None:
        self.batches += 1
        await asyncio.sleep(0.1)

    def close(self) -> None:
        pass


async def test_producer_abandons_the_write_when_the_consumer_hangs_up() -> None:
    """After decode gave up (timeout), prefill writes at most one more batch into its memory."""
    regions = [Region(4096, 64, 64)]
    agent = _SlowAgent()
    producer = KVProducer(agent, regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          batch_entries=2)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        params = producer.offer(list(range(0, 64, 2)), 7, releases.callback("t"))  # 32 runs: 16+ batches
        with pytest.raises(KVTransferError, match="timed out") as err:
            await KVConsumer(agent, regions, timeout_s=0.25).pull(params, list(range(32)[::-1]))
        assert err.value.dst_may_be_written
        await _poll(lambda: bool(releases.calls))
        assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and producer.pending_count == 0
        assert agent.batches <= 5, f"{agent.batches} batches written after the consumer left"
    finally:
        await producer.close()


async def test_region_mismatch_refused_clearly(decode: Side, producer: KVProducer) -> None:
    releases = Releases()
    params = producer.offer([1], 7, releases.callback("t"))
    with pytest.raises(KVTransferError, match="region count differs") as err:
        await KVConsumer(decode.agent, decode.regions[:-1]).pull(params, [1])
    assert err.value.reason == "region_mismatch"
    params = producer.offer([1], 7, releases.callback("u"))
    other_units = [Region(r.base, r.unit_bytes // 2, r.num_blocks * 2) for r in decode.regions]
    with pytest.raises(KVTransferError, match="unit_bytes differ"):
        await KVConsumer(decode.agent, other_units).pull(params, [1])
    params = producer.offer([1], 7, releases.callback("v"))
    with pytest.raises(KVTransferError, match="out of range") as err:
        await KVConsumer(decode.agent, decode.regions).pull(params, [NUM_BLOCKS])
    assert err.value.reason == "block_mismatch"
    # Units of the same size holding another format (a float16 cache against a bfloat16 one, another block size):
    # the same bytes would be read as other values, so the producer refuses, naming both.
    params = producer.offer([1], 7, releases.callback("w"))
    other_format = [replace(r, fmt=r.fmt.replace("float32", "int32")) for r in decode.regions]
    with pytest.raises(KVTransferError, match=r"region 0: KV formats differ \(producer float32\[") as err:
        await KVConsumer(decode.agent, other_format).pull(params, [1])
    assert err.value.reason == "region_mismatch"
    assert [r for _, r in releases.calls] == [ReleaseReason.REFUSED] * 4 and producer.pending_count == 0
    assert producer.stats().released[ReleaseReason.REFUSED] == 4 and producer.stats().bytes_written == 0


async def test_nonce_mismatch_rejected() -> None:
    """A producer answering with someone else's nonce must not be trusted."""

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        msg = await wire.recv(reader)
        await wire.send(writer, wire.MessageType.WRITE_DONE, transfer_id=msg["transfer_id"], nonce="not-yours",
                        status="ok", message="", bytes=0)  # fmt: skip
        writer.close()

    server = await asyncio.start_server(liar, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    params = KVTransferParams((1,), "127.0.0.1:1", "127.0.0.1", 1, port, "t1", 7)
    try:
        with pytest.raises(KVTransferError, match="mismatched nonce") as err:
            await KVConsumer(_StubAgent("127.0.0.1:2"), [Region(1, 1, 4)]).pull(params, [0])  # type: ignore[arg-type]
        assert err.value.reason == "nonce_mismatch" and err.value.dst_may_be_written
    finally:
        server.close()
        await server.wait_closed()


async def test_silent_producer_times_out() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    params = KVTransferParams((1,), "x:1", "127.0.0.1", 1, server.sockets[0].getsockname()[1], "t1", 7)
    try:
        with pytest.raises(KVTransferError, match="timed out") as err:
            await KVConsumer(_StubAgent("127.0.0.1:2"), [Region(1, 1, 4)], timeout_s=0.3).pull(params, [0])  # type: ignore[arg-type]
        assert err.value.reason == "timeout" and err.value.dst_may_be_written
    finally:
        server.close()
        await server.wait_closed()


async def test_producer_dying_mid_transfer_is_a_clear_error() -> None:
    """The producer reads the request, then its connection drops without a reply (prefill died)."""

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await wire.recv(reader)
        writer.transport.abort()

    server = await asyncio.start_server(dies, "127.0.0.1", 0)
    params = KVTransferParams((1,), "x:1", "127.0.0.1", 1, server.sockets[0].getsockname()[1], "t1", 7)
    try:
        start = time.monotonic()
        consumer = KVConsumer(_StubAgent("127.0.0.1:2"), [Region(1, 1, 4)], timeout_s=30.0)  # type: ignore[arg-type]
        with pytest.raises(KVTransferError, match="dropped transfer t1") as err:
            await consumer.pull(params, [0])
        assert err.value.reason == "connection_lost" and err.value.dst_may_be_written
        # Told at once, not after the pull's timeout (a loaded 2-core CI machine took 2.8 s once: the bound is loose).
        assert time.monotonic() - start < 10.0
    finally:
        server.close()
        await server.wait_closed()


async def test_bad_wire_version_and_garbage_refused(producer: KVProducer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", producer.port)
    writer.write(b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1")  # not msgpack: dropped without a reply
    assert await reader.read() == b""
    writer.close()

    body = msgpack.packb({"v": 99, "type": "write_request", "transfer_id": "x"})
    reader, writer = await asyncio.open_connection("127.0.0.1", producer.port)
    writer.write(len(body).to_bytes(4, "big") + body)
    reply = await wire.recv(reader)
    writer.close()
    assert reply["type"] == "error" and reply["code"] == "bad_version"


async def test_pending_transfers_are_bounded(prefill: Side) -> None:
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, max_pending=2)
    await producer.start()
    releases = Releases()
    producer.offer([1], 1, releases.callback("a"))
    producer.offer([2], 1, releases.callback("b"))
    with pytest.raises(KVTransferBusyError):
        producer.offer([3], 1, releases.callback("c"))
    await producer.close()
    assert sorted(t for t, _ in releases.calls) == ["a", "b"] and producer.pending_count == 0
    with pytest.raises(KVTransferError, match="not running"):  # closed: no new offers
        producer.offer([3], 1, releases.callback("d"))


def test_params_validation() -> None:
    p = KVTransferParams((1, 2), "1.2.3.4:15000", "1.2.3.4", 15000, 6301, "abc", 5, prefix_cache_hit_tokens=16)
    assert KVTransferParams.from_dict(p.to_dict()) == p
    raw: dict[str, Any] = p.to_dict()
    for key, value, match in [
        ("remote_block_ids", [1, -2], "non-negative"),
        ("remote_handshake_port", "6301", "must be int"),
        ("tp_size", -1, "tp_size -1 must be >= 1"),  # any size >= 1 is carried; the consumer compares it
    ]:
        with pytest.raises(KVTransferParamsError, match=match) as err:
            KVTransferParams.from_dict({**raw, key: value})
        assert err.value.status == 400
    with pytest.raises(KVTransferParamsError, match="missing 'transfer_id'"):
        KVTransferParams.from_dict({k: v for k, v in raw.items() if k != "transfer_id"})


def test_missing_mooncake_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # makes the import fail
    with pytest.raises(KVTransferError, match="pip install mooncake-transfer-engine"):
        MooncakeAgent("127.0.0.1")


async def test_two_processes_and_prefill_killed_after_answering() -> None:
    """A producer in its own process (SmolLM2-shaped caches); then it dies and decode fails fast."""
    import multiprocessing as mp

    from bench.engine import kv_transfer as bench

    num_blocks = 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bench._producer_main, args=(child, num_blocks, "fp32", "engine"), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    try:
        assert await asyncio.wait_for(loop.run_in_executor(None, parent.poll, 60), 61), "producer did not start"
        parent.recv()
        local = bench.make_caches(num_blocks, torch.float32)
        agent = MooncakeAgent("127.0.0.1")
        agent.register(local.regions)
        try:
            consumer = KVConsumer(agent, local.regions, timeout_s=20)
            parent.send(("offer", [1, 2, 6]))
            await consumer.pull(parent.recv(), [0, 1, 7])
            expected = bench.make_caches(num_blocks, torch.float32)
            bench.fill(expected)

            def unit(caches: bench.Caches, region: int, block: int) -> torch.Tensor:
                r = caches.regions[region]
                offset = r.base - caches.flat.data_ptr() + block * r.unit_bytes
                return caches.flat[offset : offset + r.unit_bytes]

            for r in range(len(local.regions)):  # 30 layers x (K, V) + 30 indexer regions
                for s, d in ((1, 0), (2, 1), (6, 7)):
                    assert torch.equal(unit(local, r, d), unit(expected, r, s)), f"region {r} block {s}"
            parent.send(("offer", [3]))
            params = parent.recv()
            proc.kill()
            proc.join(10)
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="unreachable"):
                await consumer.pull(params, [3])
            assert time.monotonic() - start < 2.0
        finally:
            agent.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


# -- the staged memory backend ---------------------------------------------------------------
# Caches on the engine tests' device (ENGINE_TEST_DEVICE: cpu, or cuda with pinned host staging);
# staging buffers of 4 slots of 4 KiB, so that a request takes many chunks.

STAGING_BYTES = 4 * 4096


@dataclass
class StagedSide:
    agent: MooncakeAgent
    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]
    regions: list[Region]
    staging: StagingBuffer

    def block(self, region: int, block_id: int) -> bytes:
        caches = [t for layer in self.kv for t in (layer[0], layer[1])] + self.indexer
        return caches[region][block_id].cpu().numpy().tobytes()


def _make_staged(device: str, fill: bool, staging_bytes: int = STAGING_BYTES, slots: int = 4) -> StagedSide:
    g = torch.Generator().manual_seed(99)
    shape = (2, NUM_BLOCKS + 1, KV_HEADS, BLOCK_SIZE, HEAD_DIM)  # + a trailing scratch block outside the pool

    def make(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g) if fill else torch.zeros(*s)).to(device)

    kv = [make(*shape) for _ in range(LAYERS)]
    indexer = [make(NUM_BLOCKS + 1, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    views = region_views(kv, indexer, num_blocks=NUM_BLOCKS)
    staging = StagingBuffer(views, staging_bytes, slots=slots)
    agent = MooncakeAgent("127.0.0.1", max_batch=MAX_BATCH)
    agent.register([staging.region])
    return StagedSide(agent, kv, indexer, [view_region(v) for v in views], staging)


@pytest.fixture(scope="module")
def staged_prefill(engine_device: str) -> Iterator[StagedSide]:
    side = _make_staged(engine_device, fill=True)
    yield side
    side.agent.close()
    side.staging.close()


@pytest.fixture(scope="module")
def staged_decode(engine_device: str) -> Iterator[StagedSide]:
    side = _make_staged(engine_device, fill=False)
    yield side
    side.agent.close()
    side.staging.close()


@pytest.fixture
async def staged_producer(staged_prefill: StagedSide, staged_decode: StagedSide) -> AsyncIterator[KVProducer]:
    for t in staged_decode.kv + staged_decode.indexer:
        t.zero_()
    p = KVProducer(staged_prefill.agent, staged_prefill.regions, host="127.0.0.1", handshake_port=0,
                   bind_host="127.0.0.1", timeout_s=10.0, staging=staged_prefill.staging)  # fmt: skip
    await p.start()
    yield p
    await p.close()
    assert staged_prefill.staging.pool.free == staged_prefill.staging.slots  # every lease returned


def _assert_staged_copied(prefill: StagedSide, decode: StagedSide, src: list[int], dst: list[int]) -> None:
    pairs = [(s, d) for s, d in zip(src, dst, strict=True) if d != -1]
    for r in range(len(prefill.regions)):
        for s, d in pairs:
            assert decode.block(r, d) == prefill.block(r, s), f"region {r}: block {s} -> {d} differs"
    untouched = set(range(NUM_BLOCKS + 1)) - {d for _, d in pairs}
    zero = bytes(len(decode.block(0, 0)))
    assert all(decode.block(0, b) == zero for b in untouched), "a block outside the destination was written"


def test_plan_chunks_cut_regions_into_slots() -> None:
    chunks = plan_chunks([100, 100, 10], 3, 250)
    assert [[p.to_wire() for p in c.pieces] for c in chunks] == [
        [[0, 0, 2]], [[0, 2, 1], [1, 0, 1]], [[1, 1, 2], [2, 0, 3]]]  # fmt: skip
    assert [c.nbytes for c in chunks] == [200, 200, 230]
    assert plan_chunks([100], 0, 250) == []
    with pytest.raises(ValueError, match="smaller than one block unit"):
        plan_chunks([300], 1, 250)
    assert check_chunk([[1, 1, 2], [2, 0, 3]], [100, 100, 10], 3, 250).nbytes == 230
    for bad, match in [([[3, 0, 1]], "outside"), ([[0, 2, 2]], "outside"), ([[0, 0, 3]], "exceeds"),
                       ([], "non-empty"), ([[0, 0]], "region, first, count")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            check_chunk(bad, [100, 100, 10], 3, 250)


def test_staging_buffer_is_bounded_and_refuses_a_slot_smaller_than_a_block(engine_device: str) -> None:
    views = region_views([torch.zeros(2, 8, 16, 2, 64, device=engine_device)])  # 8 KiB units
    with pytest.raises(ValueError, match="smaller than one block unit"):
        StagingBuffer(views, 4 * 4096)
    staging = StagingBuffer(views, 4 * 8192 + 100)
    try:
        assert (staging.slots, staging.slot_bytes, staging.nbytes) == (4, 8192, 4 * 8192)
        assert staging.host.is_pinned() == (engine_device == "cuda")
        assert staging.region == Region(staging.host.data_ptr(), 8192, 4)
    finally:
        staging.close()


STAGED_CASES = {
    "contiguous": (list(range(10, 30)), list(range(40, 60))),
    "scattered": ([3, 17, 18, 19, 50, 2, 90, 91], [80, 5, 6, 7, 60, 61, 0, 33]),
    "many_chunks": (list(range(0, NUM_BLOCKS, 2)) + list(range(1, 33, 2)), list(range(95, 31, -1))),
    "skipped": ([5, 6, 7, 8, 9], [-1, -1, 20, 22, 21]),
}


@pytest.mark.parametrize("case", list(STAGED_CASES))
async def test_staged_pull_copies_kv_and_indexer_blocks_byte_for_byte(
    case: str, staged_prefill: StagedSide, staged_decode: StagedSide, staged_producer: KVProducer
) -> None:
    src, dst = STAGED_CASES[case]
    releases = Releases()
    params = staged_producer.offer(src, 42, releases.callback("t"))
    consumer = KVConsumer(staged_decode.agent, staged_decode.regions, timeout_s=30, staging=staged_decode.staging)
    assert consumer.backend == staged_producer.backend == "staged"
    await consumer.pull(params.to_dict(), dst)
    _assert_staged_copied(staged_prefill, staged_decode, src, dst)
    assert releases.reasons("t") == [ReleaseReason.WRITTEN] and staged_producer.pending_count == 0
    moved = sum(1 for d in dst if d != -1)
    assert staged_producer.stats().bytes_written == moved * sum(r.unit_bytes for r in staged_prefill.regions)
    assert staged_decode.staging.pool.free == staged_decode.staging.slots
    if case == "many_chunks":  # a request far larger than the staging buffer goes in many rounds
        total = moved * sum(r.unit_bytes for r in staged_prefill.regions)
        assert total > 5 * staged_decode.staging.nbytes


async def test_sixteen_concurrent_staged_pulls_share_the_slots(
    staged_prefill: StagedSide, staged_decode: StagedSide, staged_producer: KVProducer
) -> None:
    releases = Releases()
    consumer = KVConsumer(staged_decode.agent, staged_decode.regions, timeout_s=60, staging=staged_decode.staging)
    jobs = []
    for i in range(16):
        src, dst = [i * 5, i * 5 + 1, 95 - i], [i * 6, i * 6 + 1, i * 6 + 3]
        jobs.append((src, dst, staged_producer.offer(src, 1, releases.callback(str(i)))))
    await asyncio.gather(*(consumer.pull(p, dst) for _, dst, p in jobs))
    for i, (src, dst, _) in enumerate(jobs):
        assert releases.reasons(str(i)) == [ReleaseReason.WRITTEN]
        for r in range(len(staged_prefill.regions)):
            assert all(staged_decode.block(r, d) == staged_prefill.block(r, s) for s, d in zip(src, dst, strict=True))
    assert staged_producer.pending_count == 0 and staged_decode.staging.pool.free == staged_decode.staging.slots


async def test_memory_backend_mismatch_is_refused(
    staged_decode: StagedSide, staged_producer: KVProducer, decode: Side, producer: KVProducer
) -> None:
    releases = Releases()
    params = staged_producer.offer([1, 2], 7, releases.callback("staged"))
    with pytest.raises(KVTransferError, match="memory backend is staged, the consumer's is direct") as err:
        await KVConsumer(decode.agent, staged_decode.regions).pull(params, [1, 2])
    assert err.value.reason == "backend_mismatch"
    params = producer.offer([1, 2], 7, releases.callback("direct"))
    with pytest.raises(KVTransferError, match="backend is direct, the consumer's is staged"):
        await KVConsumer(staged_decode.agent, decode.regions, staging=staged_decode.staging).pull(params, [1, 2])
    assert releases.reasons("staged") == releases.reasons("direct") == [ReleaseReason.REFUSED]
    assert staged_producer.pending_count == producer.pending_count == 0
    assert staged_decode.staging.pool.free == staged_decode.staging.slots  # refused before writing: no grace


async def test_staged_decode_hanging_up_mid_transfer_leaves_its_blocks_and_both_pools_idle(engine_device: str) -> None:
    """Decode times out while the (slow) producer is between chunks: prefill abandons after the
    chunk in flight, decode's blocks get no late write (it scatters itself), its slots wait out the grace."""
    prefill, decode = _make_staged(engine_device, True), _make_staged(engine_device, False)
    agent = _SlowAgent()  # 0.1 s per write, moves nothing
    producer = KVProducer(agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          staging=prefill.staging)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        params = producer.offer(list(range(64)), 7, releases.callback("t"))  # ~40 chunks of 4 KiB
        consumer = KVConsumer(agent, decode.regions, timeout_s=0.35, staging=decode.staging, slot_grace_s=0.3)
        with pytest.raises(KVTransferError, match="timed out") as err:
            await consumer.pull(params, list(range(64)))
        assert not err.value.dst_may_be_written  # nothing lands in the blocks once pull returned
        await _poll(lambda: bool(releases.calls))
        assert releases.reasons("t") == [ReleaseReason.WRITE_FAILED] and producer.pending_count == 0
        assert agent.batches <= 6, f"{agent.batches} chunks written after the consumer left"
        assert decode.staging.pool.held_back == 2  # the producer might still be writing into them
        await _poll(lambda: decode.staging.pool.free == decode.staging.slots, 5.0)
        await _poll(lambda: prefill.staging.pool.free == prefill.staging.slots, 5.0)
    finally:
        await producer.close()
        for side in (prefill, decode):
            side.agent.close()
            side.staging.close()


async def test_staged_pull_from_a_dead_producer_fails_fast_and_frees_the_slots(
    staged_prefill: StagedSide, staged_decode: StagedSide
) -> None:
    producer = KVProducer(staged_prefill.agent, staged_prefill.regions, host="127.0.0.1", handshake_port=0,
                          bind_host="127.0.0.1", staging=staged_prefill.staging)  # fmt: skip
    await producer.start()
    releases = Releases()
    params = producer.offer([1, 2], 7, releases.callback("t"))
    await producer.close()
    consumer = KVConsumer(staged_decode.agent, staged_decode.regions, timeout_s=30, staging=staged_decode.staging)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="unreachable"):
        await consumer.pull(params, [1, 2])
    assert time.monotonic() - start < 2.0 and releases.reasons("t") == [ReleaseReason.CLOSED]
    assert staged_decode.staging.pool.free == staged_decode.staging.slots


async def test_staged_two_processes_smollm2_shape() -> None:
    """The staged backend between two processes (the benchmark's prefill child), all 90 regions compared."""
    import multiprocessing as mp

    from bench.engine import kv_transfer as bench

    num_blocks = 12
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bench._producer_main, daemon=True,
                       args=(child, num_blocks, "bf16", "engine", "staged", 1, "cpu"))  # fmt: skip
    proc.start()
    loop = asyncio.get_running_loop()
    try:
        assert await asyncio.wait_for(loop.run_in_executor(None, parent.poll, 60), 61), "producer did not start"
        parent.recv()
        local = bench.make_caches(num_blocks, torch.bfloat16)
        side = bench.open_side(local, "staged", 1)  # 1 MiB: 4 slots of 256 KiB, the request takes 3 chunks
        try:
            consumer = KVConsumer(side.agent, local.regions, timeout_s=30, staging=side.staging)
            src, dst = [1, 2, 6, 9, 10, 11, 0, 5, 3, 4], [0, 1, 7, 3, 2, 11, 10, 9, 8, 6]
            parent.send(("offer", src))
            await consumer.pull(parent.recv(), dst)
            expected = bench.make_caches(num_blocks, torch.bfloat16)
            bench.fill(expected)
            for r in range(len(local.regions)):
                for s, d in zip(src, dst, strict=True):
                    assert torch.equal(local.views[r][d], expected.views[r][s]), f"region {r} block {s}"
            parent.send(("released",))
            assert parent.recv() == ["written"]
        finally:
            side.close()
    finally:
        parent.send(("stop",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- concurrency: many pulls in flight, each pipelined; failures with several in flight ---------


class _CountingAgent:
    """A TransferAgent whose writes take ``delay`` s, move nothing, and record how many ran at once.

    ``fail_on`` (a destination address) makes the write containing it fail; ``running`` says how
    many writes are running now (a reply sent while one still runs would be a late write)."""

    rpc_address = "127.0.0.1:1"

    def __init__(self, delay: float = 0.05, fail_on: int | None = None) -> None:
        self.delay, self.fail_on = delay, fail_on
        self.running = self.peak = self.writes = 0

    def register(self, regions: object) -> None:
        pass

    async def write(self, peer: str, ops: list[WriteOp]) -> None:
        self.running += 1
        self.writes += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_on is not None and any(op.dst == self.fail_on for op in ops):
                raise KVTransferError("injected write failure", reason="transfer_engine")
        finally:
            self.running -= 1

    def close(self) -> None:
        pass


async def test_pulls_in_flight_are_bounded_by_max_inflight_and_all_complete() -> None:
    regions = [Region(4096, 64, 64)]
    agent = _CountingAgent(delay=0.1)
    producer = KVProducer(
        agent, regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1", pipeline_depth=1
    )  # one write per transfer at a time: writes in flight == pulls
    await producer.start()
    try:
        releases = Releases()
        consumer = KVConsumer(agent, regions, timeout_s=30, max_inflight=3)  # type: ignore[arg-type]
        jobs = [producer.offer([i], 1, releases.callback(str(i))) for i in range(9)]
        pulls = [asyncio.ensure_future(consumer.pull(p, [20 + i])) for i, p in enumerate(jobs)]
        await _poll(lambda: consumer.in_flight == 3)
        assert consumer.waiting == 6  # the rest wait their turn
        await asyncio.gather(*pulls)
        assert agent.peak == 3, f"{agent.peak} writes ran at once, max_inflight is 3"
        assert all(releases.reasons(str(i)) == [ReleaseReason.WRITTEN] for i in range(9))
        assert producer.pending_count == 0 and consumer.in_flight == consumer.waiting == 0
    finally:
        await producer.close()


async def test_concurrent_pulls_overlap_instead_of_queueing(prefill: Side, decode: Side) -> None:
    """Eight pulls of a slow (0.1 s per write) producer take about one pull's time, not eight."""
    agent = _CountingAgent(delay=0.1)
    producer = KVProducer(agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1")
    await producer.start()
    try:
        consumer = KVConsumer(agent, decode.regions, timeout_s=30, max_inflight=8)  # type: ignore[arg-type]
        jobs = [producer.offer([i], 1, lambda reason: None) for i in range(8)]
        await asyncio.gather(*(consumer.pull(p, [40 + i]) for i, p in enumerate(jobs)))
        assert agent.peak >= 8, f"at most {agent.peak} writes overlapped"
    finally:
        await producer.close()


async def test_a_direct_write_keeps_pipeline_depth_batches_in_flight_and_answers_after_the_last() -> None:
    regions = [Region(4096, 64, 64)]
    src, dst = list(range(0, 64, 2)), list(range(32))[::-1]  # 32 runs: one probe, then 16 batches of 2 entries
    agent = _CountingAgent(delay=0.05)
    producer = KVProducer(agent, regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          batch_entries=2, pipeline_depth=3)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        await KVConsumer(agent, regions, timeout_s=30).pull(producer.offer(src, 7, releases.callback("ok")), dst)
        assert agent.peak == 3 and releases.reasons("ok") == [ReleaseReason.WRITTEN]
        # A batch in the middle fails: the reply (an error) comes only once no other batch still runs.
        agent.fail_on = 4096 + 20 * 64  # destination block 20
        before = agent.writes
        seen_running: list[int] = []
        consumer = KVConsumer(agent, regions, timeout_s=30)  # type: ignore[arg-type]
        params = producer.offer(src, 7, lambda reason: seen_running.append(agent.running))
        with pytest.raises(KVTransferError, match="injected write failure") as err:
            await consumer.pull(params, dst)
        assert err.value.reason == "write_failed"
        assert seen_running == [0], "the transfer was released while a write of it still ran"
        assert agent.writes - before < 17  # stopped early, not written to the end
        assert producer.pending_count == 0
    finally:
        await producer.close()


async def test_several_direct_pulls_failing_in_flight_release_each_once(
    prefill: Side, decode: Side, producer: KVProducer
) -> None:
    """Good pulls and pulls to a dead decode peer, all in flight together: each ends once, none pends."""
    releases = Releases()
    good = KVConsumer(decode.agent, decode.regions, timeout_s=30, max_inflight=4)
    dead = KVConsumer(_StubAgent(f"127.0.0.1:{free_port()}"), decode.regions, timeout_s=20,  # type: ignore[arg-type]
                      max_inflight=4)  # fmt: skip
    jobs = []
    for i in range(8):
        src, dst = [i * 3, i * 3 + 1], [50 + i * 2, 51 + i * 2]
        jobs.append((i % 2 == 0, src, dst, producer.offer(src, 1, releases.callback(str(i)))))
    results = await asyncio.gather(*((good if ok else dead).pull(p, dst) for ok, _, dst, p in jobs),
                                   return_exceptions=True)  # fmt: skip
    for i, ((ok, src, dst, _), result) in enumerate(zip(jobs, results, strict=True)):
        if ok:
            assert result is None and releases.reasons(str(i)) == [ReleaseReason.WRITTEN]
            for r in range(len(prefill.regions)):
                assert all(decode.block(r, d) == prefill.block(r, s) for s, d in zip(src, dst, strict=True))
        else:
            assert isinstance(result, KVTransferError) and result.reason == "write_failed", result
            assert releases.reasons(str(i)) == [ReleaseReason.WRITE_FAILED]
    assert producer.pending_count == 0 and good.in_flight == dead.in_flight == 0


async def test_several_staged_pulls_timing_out_at_once_free_every_slot(engine_device: str) -> None:
    """Four staged pulls in flight against a slow producer all time out: each transfer ends once
    (write_failed), both sides' slots come back (decode's after the grace), nothing stays pending."""
    prefill = _make_staged(engine_device, True, staging_bytes=8 * 4096, slots=8)
    decode = _make_staged(engine_device, False, staging_bytes=8 * 4096, slots=8)
    agent = _SlowAgent()  # 0.1 s per write
    producer = KVProducer(agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          staging=prefill.staging)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        consumer = KVConsumer(agent, decode.regions, timeout_s=0.4, staging=decode.staging,  # type: ignore[arg-type]
                              slot_grace_s=0.3, max_inflight=4)  # fmt: skip
        jobs = [producer.offer(list(range(i * 16, i * 16 + 16)), 7, releases.callback(str(i))) for i in range(4)]
        results = await asyncio.gather(*(consumer.pull(p, list(range(i * 16, i * 16 + 16)))
                                         for i, p in enumerate(jobs)), return_exceptions=True)  # fmt: skip
        assert all(isinstance(r, KVTransferError) and "timed out" in str(r) for r in results), results
        await _poll(lambda: len(releases.calls) == 4)
        assert all(releases.reasons(str(i)) == [ReleaseReason.WRITE_FAILED] for i in range(4))
        assert producer.pending_count == 0
        await _poll(lambda: decode.staging.pool.free == decode.staging.slots, 5.0)
        await _poll(lambda: prefill.staging.pool.free == prefill.staging.slots, 5.0)
    finally:
        await producer.close()
        for side in (prefill, decode):
            side.agent.close()
            side.staging.close()


async def test_eight_staged_pulls_in_flight_copy_byte_for_byte(engine_device: str) -> None:
    """Real Mooncake, staged, 8 pulls at once through 16 slots on each side (two agent lanes)."""
    prefill = _make_staged(engine_device, True, staging_bytes=16 * 4096, slots=16)
    decode = _make_staged(engine_device, False, staging_bytes=16 * 4096, slots=16)
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0, bind_host="127.0.0.1",
                          staging=prefill.staging)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        consumer = KVConsumer(decode.agent, decode.regions, timeout_s=60, staging=decode.staging, max_inflight=8)
        jobs = []
        for i in range(8):
            src, dst = list(range(i * 12, i * 12 + 12)), [95 - i * 12 - k for k in range(12)]
            jobs.append((src, dst, producer.offer(src, 1, releases.callback(str(i)))))
        await asyncio.gather(*(consumer.pull(p, dst) for _, dst, p in jobs))
        assert all(releases.reasons(str(i)) == [ReleaseReason.WRITTEN] for i in range(8))
        _assert_staged_copied(prefill, decode, [s for src, _, _ in jobs for s in src],
                              [d for _, dst, _ in jobs for d in dst])  # fmt: skip
        assert decode.staging.pool.free == decode.staging.slots and prefill.staging.pool.free == prefill.staging.slots
    finally:
        await producer.close()
        for side in (prefill, decode):
            side.agent.close()
            side.staging.close()


def test_agent_lanes_keep_every_batch_within_mooncakes_queue() -> None:
    agent = MooncakeAgent("127.0.0.1", lanes=4)
    try:
        assert (agent.lanes, agent.max_batch) == (4, 256)  # 4 lanes x 256 entries = Mooncake's 1024
    finally:
        agent.close()
    with pytest.raises(ValueError, match="lanes"):
        MooncakeAgent("127.0.0.1", lanes=0)


async def test_unequal_tensor_parallel_sizes_are_refused_by_name(prefill: Side, decode: Side) -> None:
    """A TP=2 producer's regions are two ranks' KV heads; a TP=1 consumer cannot pair them rank to rank."""
    producer = KVProducer(prefill.agent, prefill.regions, host="127.0.0.1", handshake_port=0,
                          bind_host="127.0.0.1", tp_size=2)  # fmt: skip
    await producer.start()
    try:
        releases = Releases()
        params = producer.offer([1, 2], 7, releases.callback("t")).to_dict()
        assert params["tp_size"] == 2
        with pytest.raises(KVTransferParamsError, match="prefill engine runs tensor-parallel size 2, this decode "
                                                        "engine 1; unequal tensor parallelism") as err:  # fmt: skip
            await KVConsumer(decode.agent, decode.regions).pull(params, [3, 4])
        assert err.value.reason == "tp_mismatch"
        # Equal sizes pair: the same offer pulled by a TP=2 consumer (regions here are one rank's, as a test)
        await KVConsumer(decode.agent, decode.regions, tp_size=2).pull(params, [3, 4])
        _assert_copied(prefill, decode, [1, 2], [3, 4])
    finally:
        await producer.close()
