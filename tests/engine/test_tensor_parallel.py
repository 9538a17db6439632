"""Tensor and expert parallelism on CPU (gloo; NCCL with ENGINE_TEST_DEVICE=cuda on two GPUs): an engine with
``--tensor-parallel-size 2`` (rank 1 in its own process) generates the same greedy tokens, with logprobs within
1e-4, as the same engine on one rank (fp32), for a dense (Qwen3, its vocabulary of 321 not divisible by 2) and an
MoE (Qwen3-MoE) tiny checkpoint written with transformers' own classes; the MoE one also with
``--enable-expert-parallel``, and with sparse attention. A prompt served again from the prefix cache gives the
same answer. Each parallel engine starts its ranks once for the module."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams, Sequence
from tests.engine.conftest import DEVICE
from tests.engine.test_model_families import COMMON, FAMILIES, PROMPTS, checkpoint, write_tokenizer

TOLERANCE = 1e-4
NEW_TOKENS = 12
# name -> (family, settings of both engines, settings of the parallel one)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "dense-tp2": ("qwen3-odd-vocab", {}, dict(tensor_parallel_size=2)),
    "moe-tp2-sparse": ("qwen3-moe", dict(sparse_attention=True, sparse_topk_blocks=2),
                       dict(tensor_parallel_size=2)),
    "moe-ep2": ("qwen3-moe", {}, dict(tensor_parallel_size=2, enable_expert_parallel=True)),
}  # fmt: skip


def odd_vocab_checkpoint(folder: Path) -> None:
    """A Qwen3 checkpoint whose vocabulary (321) two ranks do not split evenly: the last rank's slice is padded."""
    config_cls, model_cls, extra = FAMILIES["qwen3"]
    torch.manual_seed(1234)
    config = getattr(transformers, config_cls)(**{**COMMON, "vocab_size": 321}, **extra)
    getattr(transformers, model_cls)(config).float().eval().save_pretrained(str(folder))
    write_tokenizer(folder)


def engine_args(folder: Path, **extra: Any) -> EngineArgs:
    # On CUDA (ENGINE_TEST_DEVICE=cuda, bench/device/tp_two_gpu.sh): NCCL, the Triton kernels and CUDA graphs that
    # capture the collectives; still fp32.
    return replace(EngineArgs(model=str(folder), device=DEVICE, dtype="float32", num_kvcache_blocks=64, block_size=4,
                              max_model_len=256, max_num_seqs=8, torch_threads=1), **extra)  # fmt: skip


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[Sequence]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(list(p), params) for p in prompts]
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    return seqs


def answers(seqs: list[Sequence]) -> list[tuple[list[int], list[float]]]:
    return [(s.completion_ids, [lp.logprob for lp in s.logprobs]) for s in seqs]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[LLMEngine, LLMEngine]]:  # fmt: skip
    """(one-rank engine, parallel engine) of a case; the parallel one's ranks start once per case."""
    family, common, parallel = CASES[request.param]
    folder = tmp_path_factory.mktemp(family)
    if family == "qwen3-odd-vocab":
        odd_vocab_checkpoint(folder)
    else:
        checkpoint(family, folder)
    single = LLMEngine(engine_args(folder, **common))
    many = LLMEngine(engine_args(folder, **common, **parallel))
    yield single, many
    many.close()


def assert_same(want: list[tuple[list[int], list[float]]], got: list[tuple[list[int], list[float]]]) -> None:
    for (tokens, logprobs), (tokens2, logprobs2) in zip(want, got, strict=True):
        assert tokens2 == tokens
        assert len(tokens) == NEW_TOKENS
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2, strict=True)) < TOLERANCE


@pytest.mark.timeout(240)
def test_parallel_engine_equals_one_rank(pair: tuple[LLMEngine, LLMEngine]) -> None:
    single, many = pair
    assert many.ranks is not None and many.runner.kv_heads == single.runner.kv_heads // 2
    assert_same(answers(generate(single, PROMPTS)), answers(generate(many, PROMPTS)))


@pytest.mark.timeout(240)
def test_prefix_cache_hit_gives_the_same_answer(pair: tuple[LLMEngine, LLMEngine]) -> None:
    single, many = pair
    prompt = [*PROMPTS[0], 44, 45, 46]  # PROMPTS[0]'s blocks are cached by the test above
    want = answers(generate(single, [prompt]))
    (seq,) = generate(many, [prompt])
    assert seq.prefix_hit_tokens >= 16
    assert_same(want, answers([seq]))


@pytest.mark.timeout(60)
def test_unshardable_model_is_refused_by_name(tmp_path: Path) -> None:
    checkpoint("qwen3", tmp_path)  # 2 KV heads
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide config.json "
                                         r"num_key_value_heads=2"):  # fmt: skip
        LLMEngine(engine_args(tmp_path, tensor_parallel_size=4))
    with pytest.raises(ValueError, match="--enable-expert-parallel: Qwen3ForCausalLM has no experts"):
        LLMEngine(engine_args(tmp_path, tensor_parallel_size=2, enable_expert_parallel=True))
