"""The decode side of P/D waits (bounded) for KV blocks instead of refusing at once."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import OverloadedError
from engine.llm_engine import AsyncLLMEngine
from engine.sequence import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def test_reservation_waits_for_blocks_then_gets_them(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_kvcache_blocks=8, block_size=16)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    try:
        prompt = list(range(1, 97))  # 6 blocks of the 8
        first = await async_engine.reserve(prompt, PARAMS, True)
        waiting = asyncio.ensure_future(async_engine.reserve(list(range(2, 98)), PARAMS, True, wait_secs=10))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no room yet: it waits instead of answering 503
        engine.release(first)
        second = await asyncio.wait_for(waiting, 5)
        assert len(second.block_table) == 6
        engine.release(second)
        with pytest.raises(OverloadedError):  # still bounded: a pool that stays full is refused
            held = await async_engine.reserve(prompt, PARAMS, True)
            await async_engine.reserve(list(range(2, 98)), PARAMS, True, wait_secs=0.2)
        engine.release(held)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        await async_engine.stop()


def test_a_cuda_relay_with_the_cpu_mooncake_wheel_is_refused() -> None:
    from types import SimpleNamespace

    import torch

    from engine.disagg import check_transfer_support

    cuda_engine = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ValueError, match="CUDA build of Mooncake"):
        check_transfer_support(cuda_engine, "kv_consumer")  # type: ignore[arg-type]
    check_transfer_support(cuda_engine, None)  # type: ignore[arg-type]  # no relay: nothing to check
    check_transfer_support(SimpleNamespace(device=torch.device("cpu")), "kv_producer")  # type: ignore[arg-type]
