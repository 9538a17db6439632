"""Verify rows on the Triton kernels: a speculating engine (n-gram drafts, or an EAGLE-3 head) on the kernels
generates what a plain torch engine does, eager and with the CUDA graphs on (plain decodes replay the decode
graphs; verify steps, and every step of an EAGLE-3 head's sequences, replay the mixed-step graphs).

On CPU the kernels run under Triton's interpreter and the graphs' staged inputs run eagerly; with
``ENGINE_TEST_DEVICE=cuda`` (``bench/device/spec_eagle.sh``) the graphs are captured and replayed on the GPU.
Skipped when the triton package is absent.
"""

from __future__ import annotations

import os

import pytest
from gwtest import require

from tests.engine.conftest import DEVICE, MakeEngine

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any

import torch

from engine.llm_engine import LLMEngine
from engine.model_runner import MixedGraphStep, StepInput
from engine.sequence import SamplingParams, SequenceStatus
from engine.spec_decode import SpeculativeConfig

require("triton", "make install puts it in")

pytestmark = pytest.mark.timeout(300)

# Short, repetitive prompts: n-gram drafts find matches; the interpreter is slow.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9] * 6, list(range(40, 52))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_verify_rows_on_the_kernels_change_no_token(make_engine: MakeEngine, eager: bool) -> None:
    # 12 seats: the verify rows' logits rows (up to 3 x 4) fit a mixed-step graph's.
    expected = make_engine(kernels="torch", block_size=4, max_num_seqs=12).generate(PROMPTS, PARAMS)
    spec = make_engine(kernels="triton", enforce_eager=eager, block_size=4, max_num_seqs=12,
                       speculative=SpeculativeConfig("ngram", 3, 1, 2))  # fmt: skip
    prepare, graphed = spec.runner.prepare, []

    def spy(*args: Any) -> StepInput:
        step = prepare(*args)
        graphed.append(bool(step.drafts) and isinstance(step, MixedGraphStep))
        return step

    spec.runner.prepare = spy  # type: ignore[method-assign]
    assert spec.generate(PROMPTS, PARAMS) == expected
    assert spec.stats().spec_drafts > 0
    # With graphs on, verify steps replay the mixed-step graphs (on CPU: their staged inputs, run eagerly).
    assert any(graphed) is not eager


def _spy_graphed(engine: LLMEngine) -> list[bool]:
    """Per step that has drafts: whether it replays a mixed-step graph (on CPU: the graph's staged inputs)."""
    prepare, graphed = engine.runner.prepare, []

    def spy(*args: Any) -> StepInput:
        step = prepare(*args)
        if step.drafts or getattr(step, "eagle", None) is not None:
            graphed.append(isinstance(step, MixedGraphStep))
        return step

    engine.runner.prepare = spy  # type: ignore[method-assign]
    return graphed


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_an_eagle3_head_on_the_kernels_changes_no_token(make_engine: MakeEngine, tmp_path: Any, eager: bool) -> None:
    """The head's passes (its drafts, one query each, and its catch-up chunks) on the Triton kernels; with graphs
    on, its steps replay the mixed-step graphs, which hand the target's hidden states out of a static buffer."""
    from tests.engine.test_spec_eagle3 import write_head

    expected = make_engine(kernels="torch", block_size=4, max_num_seqs=12).generate(PROMPTS, PARAMS)
    head = write_head(tmp_path / "head", make_engine().model_config)
    spec = make_engine(kernels="triton", enforce_eager=eager, block_size=4, max_num_seqs=12,
                       speculative=SpeculativeConfig("eagle3", 3, model=str(head)))  # fmt: skip
    graphed = _spy_graphed(spec)
    assert spec.generate(PROMPTS, PARAMS) == expected
    s = spec.stats()
    assert s.spec_drafts > 0 and s.spec_draft_tokens > s.spec_drafts
    assert graphed and all(graphed) is not eager
    assert spec.runner.mixed_graphs is None or spec.runner.mixed_graphs.aux_layers == spec.runner.aux_layers


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_eagle3_drafts_that_stand_through_the_graphs_change_no_token(make_engine: MakeEngine, tmp_path: Any,
                                                                      eager: bool) -> None:  # fmt: skip
    """The head's picks forced to the target's own continuation (spoilt every 5th position): several drafts stand
    per verify row, some are rejected, and the head catches up from the graphs' hidden states; the output is plain
    decoding's, and the head's state after each step is the eager engine's."""
    from tests.engine.test_spec_eagle3 import write_head

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 52))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = make_engine(kernels="torch", block_size=4, max_num_seqs=12).generate(prompts, params)
    head = write_head(tmp_path / "head", make_engine().model_config)
    spec = make_engine(kernels="triton", enforce_eager=eager, block_size=4, max_num_seqs=12,
                       speculative=SpeculativeConfig("eagle3", 3, model=str(head)))  # fmt: skip
    graphed = _spy_graphed(spec)
    seqs = [spec.add_request(p, params) for p in prompts]
    full = {s.seq_id: [*p, *c] for s, p, c in zip(seqs, prompts, expected, strict=True)}
    vocab = spec.model_config.vocab_size
    assert spec.drafter is not None
    chosen = spec.drafter.pick

    def oracle(normed: torch.Tensor, seq_ids: list[int], positions: list[int]) -> torch.Tensor:
        chosen(normed, seq_ids, positions)
        picks = [full[s][p + 2] if p + 2 < len(full[s]) else 0 for s, p in zip(seq_ids, positions, strict=True)]
        return torch.tensor([(t + 1) % vocab if p % 5 == 0 else t for t, p in zip(picks, positions, strict=True)])

    spec.drafter.pick = oracle  # type: ignore[method-assign]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert spec.step()
    assert [s.completion_ids for s in seqs] == expected
    s = spec.stats()
    assert s.spec_accepted_tokens > s.spec_drafts and s.spec_accepted_tokens < s.spec_draft_tokens
    assert graphed and all(graphed) is not eager
    assert spec.block_manager.num_free_blocks == spec.num_blocks
