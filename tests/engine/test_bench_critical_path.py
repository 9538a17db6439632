"""bench.engine.throughput's critical path of a decode step: overlapping kernels' shares of the GPU's timeline."""

from __future__ import annotations

import pytest

from bench.engine.throughput import critical_path, kernel_label, launch_times


@pytest.mark.timeout(30)
def test_overlapping_kernels_add_only_what_they_end_past_the_ones_before() -> None:
    # a: 0-10; b starts at 4 (launched early, waiting for a) and ends at 12; c runs inside b; idle 12-15; d 15-20.
    spans = [(4.0, 12.0, "b"), (0.0, 10.0, "a"), (5.0, 11.0, "c"), (15.0, 20.0, "d")]
    got = critical_path(spans)
    assert got == {"a": 10.0, "b": 2.0, "c": 0.0, "(idle)": 3.0, "d": 5.0}
    assert sum(got.values()) == 20.0


@pytest.mark.timeout(30)
def test_a_kernel_name_sums_over_its_launches() -> None:
    assert critical_path([(0.0, 1.0, "k"), (1.0, 3.0, "k"), (2.5, 4.0, "n")]) == {"k": 3.0, "n": 1.0}
    assert critical_path([]) == {}


@pytest.mark.timeout(30)
def test_the_one_token_kernels_are_told_apart_by_their_launch() -> None:
    qkv = {"name": "token_gemv", "args": {"grid": [768, 1, 1], "block": [256, 1, 1], "shared memory": 9216}}
    experts = {"name": "token_gemv", "args": {"grid": [96, 8, 1], "block": [128, 1, 1], "shared memory": 4096}}
    assert kernel_label(qkv) == "token_gemv grid 768 block 256 smem 9216"
    assert kernel_label(experts) == "token_gemv grid 96x8 block 128 smem 4096"
    assert kernel_label({"name": "token_gemv"}) == "token_gemv"  # a trace without the launch's arguments
    assert kernel_label({"name": "_paged_attention_kernel", "args": qkv["args"]}) == "_paged_attention_kernel"
    assert launch_times([(0.0, 2.0, "k"), (3.0, 7.0, "k"), (1.0, 2.0, "n")]) == {"k": (2, 3.0), "n": (1, 1.0)}
