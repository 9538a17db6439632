"""Verify rows on the Triton kernels: a speculating engine on the kernels generates what a plain torch engine
does, eager and with the CUDA graphs on (plain decodes replay the graphs; verify rows run eagerly beside them).

On CPU the kernels run under Triton's interpreter; with ``ENGINE_TEST_DEVICE=cuda`` compiled on the GPU (not
run on a GPU yet). Skipped when the triton package is absent.
"""

from __future__ import annotations

import os

import pytest

from tests.engine.conftest import DEVICE, MakeEngine

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from typing import Any

from engine.model_runner import MixedGraphStep, StepInput
from engine.sequence import SamplingParams
from engine.spec_decode import SpeculativeConfig

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


def test_an_eagle3_head_on_the_kernels_changes_no_token(make_engine: MakeEngine, tmp_path: Any) -> None:
    """The head's passes (its drafts, one query each, and its catch-up chunks) on the Triton kernels, graphs on:
    steps with speculating sequences run eagerly (the graphs do not hand out the target's hidden states)."""
    from tests.engine.test_spec_eagle3 import write_head

    expected = make_engine(kernels="torch", block_size=4, max_num_seqs=12).generate(PROMPTS, PARAMS)
    head = write_head(tmp_path / "head", make_engine().model_config)
    spec = make_engine(kernels="triton", block_size=4, max_num_seqs=12,
                       speculative=SpeculativeConfig("eagle3", 3, model=str(head)))  # fmt: skip
    assert spec.generate(PROMPTS, PARAMS) == expected
    s = spec.stats()
    assert s.spec_drafts > 0 and s.spec_draft_tokens > s.spec_drafts
