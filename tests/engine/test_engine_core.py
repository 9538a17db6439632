"""The engine on the tiny random model: batching, prefix caching and preemption never change tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from engine.errors import ContextLengthError, KVCacheTooSmallError, OverloadedError
from engine.llm_engine import LLMEngine
from engine.sequence import FinishReason, SamplingParams, SequenceStatus

MakeEngine = Callable[..., LLMEngine]

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived a very small model with random weights.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def encode(engine: LLMEngine, texts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in texts]


def one_at_a_time(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [engine.generate([p], params)[0] for p in prompts]


def test_batched_equals_one_at_a_time(make_engine: MakeEngine) -> None:
    engine = make_engine(enable_prefix_caching=False)
    prompts = encode(engine, PROMPTS)
    batched = engine.generate(prompts, GREEDY)
    assert all(len(o) == 24 for o in batched)
    assert batched == one_at_a_time(engine, prompts, GREEDY)


def test_prefix_cache_hits_equal_misses(make_engine: MakeEngine) -> None:
    shared = "System: you are a tiny model. Answer briefly and never repeat yourself. " * 2
    texts = [shared + q for q in ("Q: one?", "Q: two?", "Q: three and more?")]
    cold = make_engine(enable_prefix_caching=False)
    expected = cold.generate(encode(cold, texts), GREEDY)

    warm = make_engine(enable_prefix_caching=True, block_size=16)
    prompts = encode(warm, texts)
    first = warm.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    seqs = [warm.add_request(p, GREEDY) for p in prompts]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        warm.step()
    assert all(s.prefix_hit_tokens >= 128 for s in seqs)
    assert [s.completion_ids for s in seqs] == expected
    assert first[0] == expected[0]
    assert warm.stats().blocks.hit_ratio > 0


def test_generated_tokens_are_cached_for_the_next_turn(make_engine: MakeEngine) -> None:
    engine = make_engine(block_size=16)
    prompt = engine.tokenizer.encode("Tell me a story about blocks.")
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    follow_up = prompt + out + engine.tokenizer.encode(" And then?")
    seq = engine.add_request(follow_up, GREEDY)
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    assert seq.prefix_hit_tokens >= 48  # prompt + generated blocks found again
    cold = make_engine(enable_prefix_caching=False)
    assert seq.completion_ids == cold.generate([follow_up], GREEDY)[0]


def test_preemption_gives_the_same_tokens(make_engine: MakeEngine) -> None:
    roomy = make_engine()
    prompts = encode(roomy, PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = roomy.generate(prompts, params)
    # 24 blocks of 8 tokens: each sequence fits alone, but not all five grown by 40 tokens at once.
    tight = make_engine(num_kvcache_blocks=24, block_size=8)
    assert tight.generate(prompts, params) == expected
    assert tight.stats().preemptions > 0
    assert tight.block_manager.num_free_blocks == 24
    # The same with chunked prefill: a prompt holding blocks mid-chunk while others are preempted.
    chunked = make_engine(num_kvcache_blocks=24, block_size=8, max_num_batched_tokens=16)
    assert chunked.generate(prompts, params) == expected
    assert chunked.stats().preemptions > 0
    assert chunked.block_manager.num_free_blocks == 24


def test_chunked_prefill_gives_the_same_tokens(make_engine: MakeEngine) -> None:
    whole = make_engine(enable_prefix_caching=False)
    prompts = encode(whole, PROMPTS)
    greedy = whole.generate(prompts, GREEDY)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=5, ignore_eos=True)
    sampled = whole.generate(prompts, seeded)
    # A 16-token step budget and 8-token chunks: the long prompts take several steps.
    chunked = make_engine(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=8)
    assert chunked.generate(prompts, GREEDY) == greedy
    assert chunked.generate(prompts, seeded) == sampled
    assert chunked.block_manager.num_free_blocks == chunked.num_blocks


def test_without_chunking_the_budget_must_cover_the_context(make_engine: MakeEngine) -> None:
    with pytest.raises(ValueError, match="no-enable_chunked_prefill"):
        make_engine(max_num_batched_tokens=16, enable_chunked_prefill=False)


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode("Sample me")
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], params)[0]
    others = encode(engine, PROMPTS)
    with_others = engine.generate([*others, prompt], params)[-1]
    assert alone == with_others
    other_seed = engine.generate([prompt], dataclasses.replace(params, seed=99))[0]
    assert other_seed != alone


def test_top_k_one_is_greedy(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode("Greedy?")
    sampled = engine.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True))
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert sampled == greedy


def test_no_block_leaks_after_many_requests(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kvcache_blocks=64, block_size=8, max_num_seqs=4)
    initial = engine.block_manager.num_free_blocks
    prompts = [engine.tokenizer.encode(f"request number {i} " * (1 + i % 4)) for i in range(30)]
    engine.generate(prompts, SamplingParams(temperature=0.7, max_tokens=12, seed=1))
    assert engine.block_manager.num_free_blocks == initial
    assert engine.scheduler.is_idle()
    # Abort mid-flight too: blocks come back at once.
    seqs = [engine.add_request(p, GREEDY) for p in prompts[:6]]
    engine.step()
    engine.step()
    for s in seqs:
        engine.finish(s, FinishReason.ABORT)
    assert engine.block_manager.num_free_blocks == initial


def test_requests_that_cannot_fit_are_refused(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kvcache_blocks=4, block_size=8, max_model_len=64)
    with pytest.raises(ContextLengthError):
        engine.check_request(64, GREEDY, True)
    with pytest.raises(ContextLengthError):
        engine.check_request(30, SamplingParams(max_tokens=40), True)
    with pytest.raises(KVCacheTooSmallError):
        engine.check_request(30, SamplingParams(max_tokens=10), True)  # 40 tokens > 32 in the pool
    # Without max_tokens, the limit becomes what fits.
    assert engine.check_request(10, SamplingParams(), False).max_tokens == 22


def test_max_model_len_ends_generation(make_engine: MakeEngine) -> None:
    engine = make_engine(max_model_len=20)
    prompt = engine.tokenizer.encode("0123456789")
    seq = engine.add_request(prompt, engine.check_request(10, SamplingParams(temperature=0.0), False))
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    assert len(seq) == 20 and seq.finish_reason is not None and seq.finish_reason.value == "length"


def test_waiting_queue_full_is_overloaded(make_engine: MakeEngine) -> None:
    engine = make_engine(max_waiting_requests=2)
    engine.add_request([1, 2], GREEDY)
    engine.add_request([1, 2], GREEDY)
    with pytest.raises(OverloadedError):
        engine.add_request([1, 2], GREEDY)


def test_kv_filled_from_outside_continues_like_a_colocated_run(make_engine: MakeEngine) -> None:
    """The decode side of P/D: blocks reserved, KV copied in from another engine, decoding resumes."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prefill, decode = make_engine(block_size=8), make_engine(block_size=8)
    prompt = prefill.tokenizer.encode("Disaggregated prefill, then decode elsewhere.")  # 46 tokens
    expected = make_engine().generate([prompt], params)[0]

    src = prefill.add_request(prompt, params)
    prefill.step()  # prefill only: the prompt's KV is in src's blocks, the first token sampled
    seq = decode.reserve(prompt, params)
    assert decode.scheduler.is_idle() and len(seq.block_table) == len(src.block_table)
    for layer_src, layer_dst in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
        layer_dst[:, seq.block_table] = layer_src[:, src.block_table]  # what the transfer does
    decode.commit_prefilled(seq, src.completion_ids[0])
    while seq.status is not SequenceStatus.FINISHED:
        decode.step()
    assert seq.completion_ids == expected

    # The transferred blocks are now in decode's prefix cache, and a reservation can be given back.
    again = decode.reserve(prompt, params)
    assert again.num_cached_tokens == 40
    decode.release(again)
    assert decode.block_manager.num_free_blocks == decode.num_blocks
