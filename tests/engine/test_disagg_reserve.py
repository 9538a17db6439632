"""The decode side of P/D waits (bounded) for KV blocks instead of refusing at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

import engine.async_engine
from engine.async_engine import AsyncLLMEngine, Phase
from engine.errors import InvalidRequestError, OverloadedError
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from tests.engine.conftest import DEVICE

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def test_reservation_waits_for_blocks_then_gets_them(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_kvcache_blocks=8, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    tries: list[int] = []
    real_reserve = engine.reserve

    def counted(prompt_ids: list[int], params: SamplingParams) -> object:
        tries.append(len(prompt_ids))
        return real_reserve(prompt_ids, params)

    engine.reserve = counted
    try:
        prompt = list(range(1, 97))  # 6 blocks of the 8
        first = await async_engine.reserve(async_engine.check(prompt, PARAMS, True))
        other = async_engine.check(list(range(2, 98)), PARAMS, True)
        waiting = asyncio.ensure_future(async_engine.reserve(other, wait_secs=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no room yet: it waits instead of answering 503
        assert len(tries) == 2, "a waiting reservation tries again when blocks come back, not on a timer"
        async_engine.release(first)
        second = await asyncio.wait_for(waiting, 5)
        assert len(second.seq.block_table) == 6 and len(tries) == 3
        async_engine.release(second)
        with pytest.raises(OverloadedError):  # still bounded: a pool that stays full is refused
            held = await async_engine.reserve(async_engine.check(prompt, PARAMS, True))
            await async_engine.reserve(other, wait_secs=0.2)
        async_engine.release(held)
        assert engine.block_manager.num_free_blocks == engine.num_blocks and not engine.held
    finally:
        await async_engine.stop()


async def test_a_reservation_waiting_for_blocks_gets_those_a_finished_request_frees(make_engine, wait_for) -> None:  # type: ignore[no-untyped-def]
    """Blocks freed by a running request that finishes (not only by a released transfer) wake the reservation."""
    engine = make_engine(num_kvcache_blocks=8, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    try:
        running = async_engine.submit(list(range(1, 90)), SamplingParams(temperature=0.0, max_tokens=20,
                                                                         ignore_eos=True), True)  # fmt: skip
        await wait_for(lambda: engine.block_manager.num_free_blocks < engine.num_blocks, 10, "the request's blocks")
        reserved = asyncio.ensure_future(async_engine.reserve(async_engine.check(list(range(2, 98)), PARAMS, True)))
        outputs = [out async for out in async_engine.stream(running)]
        assert outputs[-1].finished
        transfer = await asyncio.wait_for(reserved, 10)
        async_engine.release(transfer)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        await async_engine.stop()


def test_a_cuda_relay_with_the_cpu_mooncake_wheel_goes_through_staging() -> None:
    from types import SimpleNamespace

    import torch

    from engine.args import parse_kv_transfer_config
    from engine.disagg import check_transfer_support, transfer_backend
    from engine.kv_transfer.backend import MemoryBackend, MooncakeWheel, choose_backend

    cuda, cpu = MemoryBackend.AUTO, "cpu"
    assert choose_backend(cuda, "cuda", MooncakeWheel.NON_CUDA)[0] is MemoryBackend.STAGED
    assert choose_backend(cuda, "cuda", MooncakeWheel.CUDA)[0] is MemoryBackend.DIRECT
    assert choose_backend(cuda, cpu, MooncakeWheel.NON_CUDA)[0] is MemoryBackend.STAGED
    assert choose_backend(MemoryBackend.DIRECT, cpu, MooncakeWheel.NON_CUDA)[0] is MemoryBackend.DIRECT
    assert choose_backend(MemoryBackend.STAGED, "cuda", MooncakeWheel.CUDA)[0] is MemoryBackend.STAGED
    with pytest.raises(ValueError, match="CUDA build of Mooncake"):
        choose_backend(MemoryBackend.DIRECT, "cuda", MooncakeWheel.NON_CUDA)

    cuda_engine = SimpleNamespace(device=torch.device("cuda"))
    consumer = parse_kv_transfer_config('{"kv_role": "kv_consumer"}')
    check_transfer_support(cuda_engine, parse_kv_transfer_config("{}"))  # type: ignore[arg-type]  # no relay
    check_transfer_support(SimpleNamespace(device=torch.device("cpu")), consumer)  # type: ignore[arg-type]
    try:  # this machine's wheel decides what auto gives on CUDA
        from importlib import metadata

        metadata.distribution("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        pytest.skip("the CPU-only Mooncake wheel is not installed")
    chosen = transfer_backend(cuda_engine, consumer)  # type: ignore[arg-type]
    assert chosen is not None and chosen[0] is MemoryBackend.STAGED and "pinned host staging" in chosen[1]
    direct = parse_kv_transfer_config('{"kv_role": "kv_consumer", "memory_backend": "direct"}')
    with pytest.raises(ValueError, match="CUDA build of Mooncake"):
        check_transfer_support(cuda_engine, direct)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "match"), [
    ('{"memory_backend": "gpu"}', "memory_backend 'gpu' must be one of"),
    ('{"staging_buffer_mb": 0}', "staging_buffer_mb 0 must be an integer"),
    ('{"staging_buffer_mb": "64"}', "staging_buffer_mb '64' must be an integer"),
])  # fmt: skip
def test_bad_memory_backend_settings_are_refused(text: str, match: str) -> None:
    from engine.args import parse_kv_transfer_config

    with pytest.raises(ValueError, match=match):
        parse_kv_transfer_config(text)
    cfg = parse_kv_transfer_config('{"kv_role": "kv_producer", "memory_backend": "staged", "staging_buffer_mb": 64}')
    assert (cfg.memory_backend, cfg.staging_buffer_mb) == ("staged", 64)


def test_concurrency_settings_are_read_and_bounded() -> None:
    from engine.args import parse_kv_transfer_config

    cfg = parse_kv_transfer_config('{"kv_role": "kv_consumer"}')
    assert (cfg.max_inflight_pulls, cfg.write_lanes) == (8, 2)
    cfg = parse_kv_transfer_config('{"kv_role": "kv_consumer", "max_inflight_pulls": 32, "write_lanes": 4}')
    assert (cfg.max_inflight_pulls, cfg.write_lanes) == (32, 4)
    for text, match in [('{"max_inflight_pulls": 0}', "max_inflight_pulls 0 must be an integer in 1..256"),
                        ('{"max_inflight_pulls": true}', "max_inflight_pulls True"),
                        ('{"write_lanes": 65}', "write_lanes 65 must be an integer in 1..64")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_kv_transfer_config(text)


def test_the_transport_is_chosen_from_the_host_and_protocol_forces_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine.args import KV_PROTOCOLS, parse_kv_transfer_config
    from engine.kv_transfer.backend import MooncakeWheel
    from engine.kv_transfer.transport import PROTOCOLS, HostFacts, Transport, choose_transport

    assert KV_PROTOCOLS == ("ipc", *PROTOCOLS)  # the flag accepts what the chooser knows, and ipc
    wheel = MooncakeWheel.CUDA
    tcp_host = HostFacts(rdma_device=False, force_tcp=False, wheel=wheel, gpu_direct=True)
    hca_host = HostFacts(rdma_device=True, force_tcp=False, wheel=wheel, gpu_direct=True)
    assert choose_transport(None, tcp_host).protocol is Transport.TCP
    assert choose_transport(None, hca_host).protocol is Transport.RDMA
    assert choose_transport("tcp", hca_host).protocol is Transport.TCP  # forced
    fallback = choose_transport("rdma", tcp_host)
    assert fallback.protocol is Transport.TCP and "no RDMA device" in fallback.reason
    forced = HostFacts(rdma_device=True, force_tcp=True, wheel=wheel)
    assert choose_transport("rdma", forced) == choose_transport(None, forced)
    assert choose_transport(None, forced).reason == "MC_FORCE_TCP is set"
    # Intra-node transports: never chosen by themselves; asked for, refused with a pip wheel (not built in)...
    for proto, flag in (("nvlink_intra", "USE_INTRA_NODE_NVLINK"), ("nvlink", "USE_MNNVL")):
        for pip_wheel in (MooncakeWheel.CUDA, MooncakeWheel.NON_CUDA):
            with pytest.raises(ValueError, match=f"protocol '{proto}' needs Mooncake built from source with {flag}"):
                choose_transport(proto, HostFacts(rdma_device=True, force_tcp=False, wheel=pip_wheel))
    # ...taken with a source build when the KV is GPU memory written in place, refused otherwise.
    source = HostFacts(rdma_device=False, force_tcp=True, wheel=MooncakeWheel.MISSING, gpu_direct=True)
    assert choose_transport("nvlink_intra", source).protocol is Transport.NVLINK_INTRA
    staged = HostFacts(rdma_device=False, force_tcp=False, wheel=MooncakeWheel.MISSING, gpu_direct=False)
    with pytest.raises(ValueError, match="memory_backend 'direct'"):
        choose_transport("nvlink_intra", staged)
    with pytest.raises(ValueError, match=r"protocol 'ib' must be one of \['tcp', 'rdma', 'nvlink_intra', 'nvlink'\]"):
        choose_transport("ib", tcp_host)
    assert parse_kv_transfer_config('{"protocol": "nvlink_intra"}').protocol == "nvlink_intra"
    from engine.disagg import ipc_mode
    from engine.kv_transfer.ipc import IpcMode

    modes = {p: ipc_mode(parse_kv_transfer_config(f'{{"protocol": "{p}"}}')) for p in ("ipc", "tcp", "rdma")}
    assert modes == {"ipc": IpcMode.FORCED, "tcp": IpcMode.OFF, "rdma": IpcMode.OFF}
    assert ipc_mode(parse_kv_transfer_config("{}")) is IpcMode.AUTO  # left out: ipc for producers on this host
    (tmp_path / "mlx5_0").mkdir()
    assert HostFacts.probe(devices=tmp_path).rdma_device and not HostFacts.probe(devices=tmp_path / "none").rdma_device


def test_a_relay_asking_for_an_intra_node_transport_it_lacks_is_refused_before_serving() -> None:
    from types import SimpleNamespace

    import torch

    from engine.args import parse_kv_transfer_config
    from engine.disagg import check_transfer_support
    from engine.kv_transfer.backend import MooncakeWheel, installed_wheel

    if installed_wheel() is MooncakeWheel.MISSING:
        pytest.skip("no Mooncake pip wheel installed")
    cfg = parse_kv_transfer_config('{"kv_role": "kv_consumer", "protocol": "nvlink_intra"}')
    with pytest.raises(ValueError, match="--kv-transfer-config: protocol 'nvlink_intra' needs Mooncake built"):
        check_transfer_support(SimpleNamespace(device=torch.device("cpu")), cfg)  # type: ignore[arg-type]


async def test_the_running_batch_keeps_decoding_while_pulls_are_pending_then_admits_them(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Reservations whose KV is still on its way (pulls in flight) do not stop the running batch: a
    request decodes to its end meanwhile; each reservation, once its KV landed, joins and finishes."""
    engine = make_engine(num_kvcache_blocks=64, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    try:
        running = async_engine.submit(list(range(1, 40)), SamplingParams(temperature=0.0, max_tokens=24,
                                                                         ignore_eos=True), True)  # fmt: skip
        pending = [await async_engine.reserve(async_engine.check(list(range(100 + i, 140 + i)), PARAMS, True))
                   for i in range(3)]  # fmt: skip
        outputs = [out async for out in async_engine.stream(running)]
        assert outputs[-1].finished and outputs[-1].completion_tokens == 24  # never waited for the pulls
        assert all(t.seq.seq_id in engine.held for t in pending)
        handles = [async_engine.commit(t, 7) for t in pending]  # their KV has landed
        for h in handles:
            last = [out async for out in async_engine.stream(h)][-1]
            assert last.finished and last.completion_tokens == PARAMS.max_tokens
        assert not engine.held and engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        await async_engine.stop()


async def test_the_pd_verbs_own_reserve_pull_commit_and_release(make_engine, free_port) -> None:  # type: ignore[no-untyped-def]
    """Through the engines' facades only (real Mooncake on loopback): a prefill for a remote decode hands its
    KV over, the decode from remote KV continues it exactly as a colocated engine would; a second pull of the
    same transfer is refused, an unreachable producer fails the pull, and every block comes back on both sides."""
    from engine.args import parse_kv_transfer_config
    from engine.async_engine import Role
    from engine.disagg import Disaggregation
    from engine.kv_transfer import KVTransferError

    def relay(engine, role: str) -> Disaggregation:  # type: ignore[no-untyped-def]
        config = parse_kv_transfer_config(f'{{"kv_role": "{role}", "handshake_port": {free_port()}, '
                                          '"memory_backend": "staged", "staging_buffer_mb": 1}')  # fmt: skip
        return Disaggregation(engine, config, "127.0.0.1", transfer_timeout=10.0)

    single, prefill_core, decode_core = (make_engine(block_size=16) for _ in range(3))
    prompt = list(range(1, 60))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = single.generate([prompt], params)[0]
    prefill = AsyncLLMEngine(prefill_core, relay(prefill_core, "kv_producer"))
    decode = AsyncLLMEngine(decode_core, relay(decode_core, "kv_consumer"))
    await prefill.start()
    await decode.start()
    try:
        leg = prefill.check(prompt, replace(params, max_tokens=1), True, {"do_remote_decode": True})
        assert leg.role is Role.PREFILL_FOR_REMOTE_DECODE
        gen = await prefill.open(leg)
        first = [out async for out in prefill.stream(gen.handles[0])]
        kv = gen.hand_over()
        gen.close()
        assert kv is not None and kv["first_token_id"] == first[-1].token_ids[0] == expected[0]
        assert prefill_core.held  # pinned for the pull

        admitted = decode.check(prompt, params, True, {**kv, "do_remote_prefill": True})
        assert admitted.role is Role.DECODE_FROM_REMOTE_KV
        gen = await decode.open(admitted)
        outs = [out async for out in decode.stream(gen.handles[0])]
        gen.close()
        assert [t for o in outs for t in o.token_ids] == expected and gen.pulled_at is not None
        assert not prefill_core.held and prefill_core.block_manager.num_free_blocks == prefill_core.num_blocks

        with pytest.raises(KVTransferError, match="transfer_consumed"):
            await decode.open(decode.check(prompt, params, True, {**kv, "do_remote_prefill": True}))
        with pytest.raises(KVTransferError, match="unreachable"):
            await decode.open(decode.check(prompt, params, True, {**kv, "do_remote_prefill": True,
                                                                  "remote_handshake_port": free_port()}))  # fmt: skip
        assert not decode_core.held and decode_core.block_manager.num_free_blocks == decode_core.num_blocks
        with pytest.raises(InvalidRequestError, match="need a kv_producer engine; this one's kv_role is kv_consumer"):
            decode.check(prompt, params, True, {"do_remote_decode": True})
    finally:
        await decode.stop()
        await prefill.stop()


async def test_engines_whose_kv_blocks_hold_other_formats_refuse_to_exchange_them(make_engine, free_port) -> None:  # type: ignore[no-untyped-def]
    """A prefill engine in float16 and a decode engine in bfloat16 have KV blocks of the same size, which a copy
    would read as other numbers: the pull is refused, naming both formats, and both pools come back whole."""
    from engine.args import parse_kv_transfer_config
    from engine.disagg import Disaggregation
    from engine.kv_transfer import KVTransferError

    def relay(engine, role: str) -> Disaggregation:  # type: ignore[no-untyped-def]
        config = parse_kv_transfer_config(f'{{"kv_role": "{role}", "handshake_port": {free_port()}, '
                                          '"memory_backend": "staged", "staging_buffer_mb": 1}')  # fmt: skip
        return Disaggregation(engine, config, "127.0.0.1", transfer_timeout=10.0)

    prefill_core, decode_core = make_engine(dtype="float16"), make_engine(dtype="bfloat16")
    assert prefill_core.kv_formats()[0].startswith("float16[") and decode_core.kv_formats()[0].startswith("bfloat16[")
    prompt = list(range(1, 40))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prefill = AsyncLLMEngine(prefill_core, relay(prefill_core, "kv_producer"))
    decode = AsyncLLMEngine(decode_core, relay(decode_core, "kv_consumer"))
    await prefill.start()
    await decode.start()
    try:
        gen = await prefill.open(prefill.check(prompt, replace(params, max_tokens=1), True, {"do_remote_decode": True}))
        _ = [out async for out in prefill.stream(gen.handles[0])]
        kv = gen.hand_over()
        gen.close()
        assert kv is not None
        with pytest.raises(
            KVTransferError, match=r"KV formats differ \(producer float16\[.*consumer bfloat16\["
        ) as err:
            await decode.open(decode.check(prompt, params, True, {**kv, "do_remote_prefill": True}))
        assert err.value.reason == "region_mismatch"
        assert not prefill_core.held and prefill_core.block_manager.num_free_blocks == prefill_core.num_blocks
        assert not decode_core.held and decode_core.block_manager.num_free_blocks == decode_core.num_blocks
    finally:
        await decode.stop()
        await prefill.stop()


async def test_blocks_an_abort_freed_during_a_step_make_their_pull_wait_for_that_step(make_engine, wait_for) -> None:  # type: ignore[no-untyped-def]
    """A client's abort frees its blocks while the step it was in still runs (and may still write them): a
    reservation that gets one of them carries that step (``after``), so its pull lands nothing before the step
    ended; a reservation of blocks nobody ran on carries nothing and its pull starts at once."""
    engine = make_engine(num_kvcache_blocks=8, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    gate, entered = threading.Event(), threading.Event()
    real_launch = engine.launch

    def held_step(step: object) -> object:
        entered.set()
        gate.wait(10)
        return real_launch(step)

    engine.launch = held_step
    try:
        running = async_engine.submit(list(range(1, 90)), replace(PARAMS, max_tokens=20), True)  # 6 of 8 blocks
        await wait_for(entered.is_set, 10, "a step in flight")
        its_blocks = set(async_engine._states[running.seq_id].seq.block_table)
        clean = await async_engine.reserve(async_engine.check(list(range(2, 18)), PARAMS, True))
        assert clean.after is None and its_blocks.isdisjoint(clean.seq.block_table)
        async_engine.abort(running.seq_id)  # the step still runs
        taken = await async_engine.reserve(async_engine.check(list(range(3, 60)), PARAMS, True))
        assert not its_blocks.isdisjoint(taken.seq.block_table)
        assert taken.after is not None and not taken.after.done()
        gate.set()
        await wait_for(taken.after.done, 10, "the step to end")
        after_step = await async_engine.reserve(async_engine.check(list(range(4, 20)), PARAMS, True))
        assert after_step.after is None  # no step runs now
        for transfer in (clean, taken, after_step):
            async_engine.release(transfer)
        assert engine.block_manager.num_free_blocks == engine.num_blocks and not engine.held
    finally:
        gate.set()
        await async_engine.stop()


@contextlib.asynccontextmanager
async def _pd_pair(
    make_engine: Callable[..., LLMEngine], free_port: Callable[[], int], **config: object
) -> AsyncIterator[tuple[AsyncLLMEngine, AsyncLLMEngine]]:
    """A prefill and a decode engine (tiny, on this process's device) whose relays take ``config``."""
    from engine.args import parse_kv_transfer_config
    from engine.disagg import Disaggregation

    def relay(core: LLMEngine, role: str) -> Disaggregation:
        text = json.dumps({"kv_role": role, "handshake_port": free_port(), **config})
        return Disaggregation(core, parse_kv_transfer_config(text), "127.0.0.1", transfer_timeout=10.0)

    prefill_core, decode_core = make_engine(block_size=16), make_engine(block_size=16)
    prefill = AsyncLLMEngine(prefill_core, relay(prefill_core, "kv_producer"))
    decode = AsyncLLMEngine(decode_core, relay(decode_core, "kv_consumer"))
    await prefill.start()
    try:
        await decode.start()
        try:
            yield prefill, decode
        finally:
            await decode.stop()
    finally:
        await prefill.stop()


PD_PROMPT = list(range(1, 60))  # 4 blocks of 16


async def _offer(prefill: AsyncLLMEngine) -> dict[str, Any]:
    """A finished prefill's kv_transfer_params, its blocks pinned for the pull."""
    gen = await prefill.open(prefill.check(PD_PROMPT, replace(PARAMS, max_tokens=1), True, {"do_remote_decode": True}))
    [out async for out in prefill.stream(gen.handles[0])]
    kv = gen.hand_over()
    gen.close()
    assert kv is not None
    return kv


def _idle(core: LLMEngine) -> bool:
    return not core.held and core.block_manager.num_free_blocks == core.num_blocks


# Both engines of this test live in one process, and CUDA IPC does not map a pool that the same process exported
# (on the H200 this case's copy never started and the offer expired). So on a GPU the ipc path is covered across
# processes (test_kv_ipc.py, test_pd_overlap.py); the ipc case runs here on CPU, where shared memory maps in-process.
IN_PROCESS_IPC = pytest.param(
    "ipc", marks=pytest.mark.skipif(DEVICE == "cuda", reason="CUDA IPC does not map an export of the same process")
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [IN_PROCESS_IPC, "staged"])
async def test_a_pull_cancelled_mid_copy_waits_for_the_copy_then_frees_its_blocks_at_once(  # type: ignore[no-untyped-def]
    path: str, make_engine, free_port, wait_for, monkeypatch
) -> None:
    """The client leaves while the decode engine itself copies its KV into the reserved blocks: from the producer's
    mapped pools (ipc, here over the direct memory backend, whose Mooncake writes alone would need the grace) or
    from a staging slot (staged). The cancelled pull ends only once that copy did (a second cancellation does not
    cut the wait short), so nothing can land in the blocks afterwards: they are free at once, not after the write
    grace (30 s); the staged path's slots, which the producer may still be writing, are what waits it out."""
    config: dict[str, object] = {"protocol": "ipc", "memory_backend": "direct"} if path == "ipc" else {
        "protocol": "tcp", "memory_backend": "staged", "staging_buffer_mb": 1}  # fmt: skip
    async with _pd_pair(make_engine, free_port, **config) as (prefill, decode):
        assert decode.relay is not None
        copier = decode.relay.peers if path == "ipc" else decode.relay.staging
        name = "_copy" if path == "ipc" else "scatter"
        real_copy = getattr(copier, name)
        copying, gate = threading.Event(), threading.Event()

        def held_copy(*args: object) -> object:
            copying.set()
            gate.wait(10)
            return real_copy(*args)

        monkeypatch.setattr(copier, name, held_copy)
        kv = await _offer(prefill)
        pull = asyncio.ensure_future(decode.open(decode.check(PD_PROMPT, PARAMS, True,
                                                              {**kv, "do_remote_prefill": True})))  # fmt: skip
        try:
            await wait_for(copying.is_set, 10, "the copy into the decode engine's blocks")
            assert not _idle(decode.engine)
            pull.cancel()  # the client left
            await asyncio.sleep(0.2)
            pull.cancel()  # and the pull's own timeout fired, say
            await asyncio.sleep(0.2)
            assert not pull.done(), "a cancelled pull returned while its copy still wrote the blocks"
        finally:
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await pull
        assert _idle(decode.engine) and not decode._transfers  # at once: no grace
        assert list(decode.relay.info()["ipc_peers"].values()) == (["ipc"] if path == "ipc" else [])
        if path == "staged":
            assert decode.relay.staging is not None and decode.relay.staging.pool.held_back == 2
        await wait_for(lambda: _idle(prefill.engine), 10, "the prefill engine to release the abandoned offer")


@pytest.mark.timeout(60)
async def test_a_pull_cancelled_while_the_producer_writes_directly_holds_its_blocks_for_the_grace(  # type: ignore[no-untyped-def]
    make_engine, free_port, wait_for, monkeypatch
) -> None:
    """Direct Mooncake: the producer writes straight into the decode engine's blocks, and a cancelled pull can
    neither stop nor wait for that write: the blocks stay out of use for the write grace (shortened here), the
    late write lands in blocks nobody else has, and they come back after the grace."""
    monkeypatch.setattr(engine.async_engine, "WRITE_GRACE_SECS", 1.0)
    async with _pd_pair(make_engine, free_port, protocol="tcp", memory_backend="direct") as (prefill, decode):
        assert prefill.relay is not None and prefill.relay.agent is not None
        agent = prefill.relay.agent
        real_write = agent.write
        writing, gate = asyncio.Event(), asyncio.Event()

        async def held_write(peer: str, ops: Any) -> None:
            writing.set()
            await gate.wait()
            await real_write(peer, ops)

        monkeypatch.setattr(agent, "write", held_write)
        kv = await _offer(prefill)
        pull = asyncio.ensure_future(decode.open(decode.check(PD_PROMPT, PARAMS, True,
                                                              {**kv, "do_remote_prefill": True})))  # fmt: skip
        await asyncio.wait_for(writing.wait(), 10)
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
        assert [t.phase for t in decode._transfers.values()] == [Phase.GRACE] and not _idle(decode.engine)
        gate.set()  # the producer's write goes on into the held blocks
        await wait_for(lambda: _idle(decode.engine), 10, "the blocks to come back after the grace")
        await wait_for(lambda: _idle(prefill.engine), 10, "the prefill engine to release the abandoned offer")
