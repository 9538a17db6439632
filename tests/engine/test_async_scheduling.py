"""Scheduling a decode step while the one before still runs (--async-scheduling), and a step's output with a
sequence that ended while it ran.

A step scheduled ahead reads its input ids on the device from the step before's tokens. On CPU the decode
graphs' staged inputs run under Triton's interpreter (no capture), which exercises the same staging, feed and
bookkeeping as a replay; with ``ENGINE_TEST_DEVICE=cuda`` the graphs are replayed on the GPU.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

import pytest
from gwtest import require

from tests.engine.conftest import DEVICE, MakeEngine

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.async_engine import AsyncLLMEngine
from engine.llm_engine import LLMEngine
from engine.sequence import PENDING_TOKEN, FinishReason, SamplingParams, Sequence, SequenceStatus

require("triton", "make install puts it in")

pytestmark = pytest.mark.timeout(300)

PROMPTS = [list(range(40, 60)), [7] * 3, list(range(50, 90)), [*list(range(40, 60)), 9, 8, 7]]
GRAPHS: dict[str, Any] = {"kernels": "triton", "max_num_seqs": 8, "cudagraph_capture_sizes": (1, 2, 4, 8)}
# What one step at a time generates: the torch kernels (no graphs, so nothing runs ahead), which the kernels' own
# tests show generate what the Triton kernels do; on CPU they also skip the interpreter.
# (On CUDA, in bf16, the same kernels one step at a time: another kernel's rounding could change a token.)
REFERENCE: dict[str, Any] = (
    {"kernels": "torch", "max_num_seqs": 8} if DEVICE == "cpu" else {**GRAPHS, "async_scheduling": False}
)


def _params() -> list[SamplingParams]:
    """Requests that end at different steps, seeded sampling, a stop token (with min_tokens) and logit bias."""
    return [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias=((65, 2.0),)),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(101, 74)),
    ]


def _run(engine: LLMEngine, params: list[SamplingParams], before_step: Any = None) -> list[Sequence]:
    pairs = zip(PROMPTS, params, strict=True)
    seqs = [engine.add_request(p, engine.check_request(len(p), sp, True)) for p, sp in pairs]
    step = 0
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        if before_step is not None:
            before_step(engine, seqs, step)
        engine.step()
        step += 1
    engine.drain()
    return seqs


def _idle(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.num_blocks and engine._inflight is None


def test_steps_scheduled_ahead_generate_what_one_step_at_a_time_does(make_engine: MakeEngine) -> None:
    expected = _run(make_engine(**REFERENCE), _params())
    engine = make_engine(**GRAPHS)
    got = _run(engine, _params())
    assert engine.steps_ahead > 0  # the decode steps did run ahead
    assert [s.completion_ids for s in got] == [s.completion_ids for s in expected]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in expected]
    assert _idle(engine) and not any(s.ahead for s in got)


def test_a_request_that_needs_its_tokens_on_the_host_stops_steps_running_ahead(make_engine: MakeEngine) -> None:
    # Logprobs and penalties need the step's output before the next step: nothing runs ahead of them, and the
    # other requests still generate what they would.
    params = _params()
    params[2] = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2, presence_penalty=0.5)
    expected = _run(make_engine(**REFERENCE), params)
    engine = make_engine(**GRAPHS)
    got = _run(engine, params)
    assert [s.completion_ids for s in got] == [s.completion_ids for s in expected]
    # On CPU the reference runs torch's kernels and the engine Triton's (interpreted): float32 sums in another order,
    # a few 1e-6 apart depending on the host's vector units.
    assert [lp.logprob for lp in got[2].logprobs] == pytest.approx(
        [lp.logprob for lp in expected[2].logprobs], rel=1e-5, abs=1e-5
    )
    engine.steps_ahead = 0  # alone, it runs one step at a time
    seq = engine.add_request(PROMPTS[0], replace(params[2], max_tokens=4))
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    assert engine.steps_ahead == 0 and _idle(engine)


def test_an_abort_and_a_new_request_while_a_step_runs_ahead(make_engine: MakeEngine) -> None:
    expected = _run(make_engine(**REFERENCE), _params())
    engine = make_engine(**GRAPHS)
    late: list[Sequence] = []
    seen: dict[str, int] = {}
    held: list[Sequence] = []
    real_launch = engine.launch

    def launch(step: Any) -> Any:
        # As the server's loop can: an abort arrives while a step scheduled ahead is handed to the device (its
        # sequences count their pending tokens); the pending token goes with the sequence.
        if held and "abort" not in seen and held[2].ahead:
            seen["abort"] = held[2].num_completion_tokens
            assert held[2].token_ids[-1] == PENDING_TOKEN
            engine.finish(held[2], FinishReason.ABORT)
            assert not held[2].ahead and PENDING_TOKEN not in held[2].token_ids
        return real_launch(step)

    def meddle(eng: LLMEngine, seqs: list[Sequence], step: int) -> None:
        held[:] = seqs
        if eng._inflight is not None and "abort" in seen and "late" not in seen:
            # It waits: the next step takes the output of the one on the device first, then admits it.
            seen["late"] = step
            late.append(eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))

    engine.launch = launch  # type: ignore[method-assign]
    got = _run(engine, _params(), meddle)
    while late[0].status is not SequenceStatus.FINISHED:
        engine.step()
    engine.drain()
    assert set(seen) == {"abort", "late"}
    for i in (0, 1, 3):
        assert got[i].completion_ids == expected[i].completion_ids
    assert got[2].finish_reason is FinishReason.ABORT
    assert got[2].completion_ids == expected[2].completion_ids[: got[2].num_completion_tokens]
    alone = make_engine(**REFERENCE)
    assert late[0].completion_ids == alone.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                 ignore_eos=True))[0]  # fmt: skip
    assert _idle(engine)


def test_a_pool_short_of_blocks_does_not_run_ahead_into_a_preemption(make_engine: MakeEngine) -> None:
    # 16-token blocks, 7 of them: the four prompts take 6; a step ahead that would need more blocks than are
    # free is not scheduled (its pending tokens cannot be preempted), and the sequences still end equal.
    kw = {"num_kvcache_blocks": 7, "block_size": 16}
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 4
    expected = _run(make_engine(**REFERENCE, **kw), params)
    engine = make_engine(**GRAPHS, **kw)
    assert [s.completion_ids for s in _run(engine, params)] == [s.completion_ids for s in expected]
    assert engine.steps_ahead > 0 and _idle(engine)


def test_an_abort_while_a_step_runs_leaves_the_other_rows_their_tokens(make_engine: MakeEngine) -> None:
    # One step at a time, the torch kernels: a sequence aborted while its step runs loses its blocks and its count
    # of computed tokens, and the step's output still holds its row; the rows after it get their own tokens.
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = make_engine().generate(PROMPTS[:3], params)
    engine = make_engine()
    seqs = [engine.add_request(p, params) for p in PROMPTS[:3]]
    engine.step()  # the prompts
    scheduled = engine.schedule()
    assert scheduled is not None
    batch, step = scheduled
    out = engine.execute(step)
    engine.finish(seqs[0], FinishReason.ABORT)
    engine.postprocess(batch, out)
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        engine.step()
    assert [s.completion_ids for s in seqs[1:]] == expected[1:]
    assert engine.block_manager.num_free_blocks == engine.num_blocks


async def test_the_server_loop_runs_steps_ahead_and_aborts_mid_stream(make_engine: MakeEngine) -> None:
    expected = _run(make_engine(**REFERENCE), _params())
    engine = make_engine(**GRAPHS)
    async_engine = AsyncLLMEngine(engine)
    await async_engine.start()
    try:

        async def collect(prompt: list[int], params: SamplingParams, stop_after: int | None = None) -> list[str]:
            handle = async_engine.submit(prompt, params, True)
            texts: list[str] = []
            async for out in async_engine.stream(handle):
                texts.append(out.text)
                if stop_after is not None and len(texts) >= stop_after:
                    break  # the client is gone: the stream's exit aborts the request
            return texts

        params = _params()
        params[0] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        streams = [collect(p, sp, 2 if i == 0 else None) for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        for i in (1, 2, 3):
            assert "".join(results[i]) == engine.tokenizer.decode(expected[i].completion_ids)
        assert engine.steps_ahead > 0 and async_engine.stats().steps_ahead == engine.steps_ahead
        for _ in range(100):
            if _idle(engine) and async_engine._inflight is None:
                break
            await asyncio.sleep(0.05)
        assert _idle(engine) and async_engine._inflight is None
    finally:
        await async_engine.stop()


@pytest.mark.skipif(DEVICE != "cuda", reason="what waits for the GPU is a CUDA question")
def test_a_step_scheduled_ahead_is_launched_without_waiting_for_the_device(make_engine: MakeEngine) -> None:
    import torch

    from engine.llm_engine import InFlight

    # Sampled rows of every kind a step ahead allows: any host-device synchronization while it is scheduled, staged
    # and launched (a tensor made on the device from a list, a copy from pageable memory, .item()) would make the
    # host wait for the step before, and CUDA's sync debug mode raises on it.
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True, logit_bias=((65, 3.0),)),
        SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8, stop_token_ids=(9,)),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    engine = make_engine(**GRAPHS)
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    for _ in range(4):  # the prompts, then the first decode step, which runs the next one ahead
        if engine._inflight is None:
            engine.step()
    inflight, engine._inflight = engine._inflight, None
    assert inflight is not None
    assert engine.can_run_ahead(inflight)
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch, step = engine.schedule_ahead(inflight)
        launched = engine.launch(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.postprocess(inflight.batch, inflight.launched.result())
    engine._inflight = InFlight(batch, launched)
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        engine.step()
    engine.drain()
    alone = make_engine(**REFERENCE)
    expected = [alone.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while any(s.status is not SequenceStatus.FINISHED for s in expected):
        alone.step()
    assert [s.completion_ids for s in seqs] == [s.completion_ids for s in expected]
    assert _idle(engine)
