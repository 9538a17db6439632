"""The CPU's packed linears (engine.cpu_packed): the native kernel builds with the C compiler and computes what
torch's ``linear`` does for any row count, width and bias; which rows take it; a build that cannot be made says
why and the engine packs for oneDNN instead."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.cpu_packed import MAX_NATIVE_ROWS, MIN_PACKED_ROWS, PackedCpuOps, build_cpu_gemm
from engine.spec_decode import SpeculativeConfig
from tests.engine.conftest import MakeEngine, OnThreads

pytestmark = pytest.mark.timeout(120)


def test_the_native_kernel_computes_torchs_linear_for_every_shape(tmp_path: Path) -> None:
    build = build_cpu_gemm(tmp_path)
    assert build.gemm is not None, build.why_not  # AVX-512 or AVX2 and a C compiler: what the CPU packing is built for
    gemm = build.gemm
    gen = torch.Generator().manual_seed(0)
    # Widths that fill whole panels and widths that pad the last one; odd inner sizes; with and without bias.
    for out_features, in_features, bias in ((64, 48, False), (100, 37, True), (33, 576, False), (7, 5, True)):
        layer = nn.Linear(in_features, out_features, bias=bias)
        packed = gemm.pack(layer.weight)
        for rows in (1, 2, 3, 9, 10, 11, 17, 33):
            x = torch.randn(rows, in_features, generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(gemm.linear(packed, x, layer.bias, out_features), layer(x),
                                           rtol=1e-5, atol=1e-5)  # fmt: skip
    # Built once: a second engine loads the same library without compiling again.
    (library,) = tmp_path.iterdir()
    built = library.stat().st_mtime_ns
    assert build_cpu_gemm(tmp_path).gemm is not None
    assert list(tmp_path.iterdir()) == [library] and library.stat().st_mtime_ns == built


def test_rows_2_to_the_limit_take_the_kernel_and_others_torch(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:  # fmt: skip
    gemm = build_cpu_gemm(tmp_path).gemm
    assert gemm is not None
    model = nn.Sequential(nn.Linear(16, 40), nn.Linear(40, 16, bias=False))
    ops = PackedCpuOps(model, gemm)
    assert ops.kind == "native" and ops.num_packed == 2
    calls: list[int] = []
    native = gemm.linear
    monkeypatch.setattr(
        gemm, "linear", lambda packed, x, bias, n: calls.append(x.shape[0]) or native(packed, x, bias, n)
    )
    for rows in (1, 2, MAX_NATIVE_ROWS, MAX_NATIVE_ROWS + 1):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            torch.testing.assert_close(ops.linear(model[0], x), model[0](x), rtol=1e-5, atol=1e-5)
    assert calls == [2, MAX_NATIVE_ROWS]
    assert PackedCpuOps(model).kind == "onednn" and MIN_PACKED_ROWS == 4


def test_a_kernel_that_cannot_be_built_says_why_and_the_engine_packs_for_onednn(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    make_engine: MakeEngine,
    on_threads: OnThreads,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    build = build_cpu_gemm(tmp_path)
    assert build.gemm is None and build.why_not.startswith("false failed")
    assert list(tmp_path.iterdir()) == []  # nothing half-built is left to load
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert build_cpu_gemm(tmp_path).why_not.startswith(f"{tmp_path / 'no-such-cc'} did not run")
    monkeypatch.setenv("CC", "false")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):  # built on one thread: the native kernel's
        spec = on_threads(1, lambda: make_engine(speculative=SpeculativeConfig("ngram", 3, 1, 2)))
    assert isinstance(spec.runner.model.ops, PackedCpuOps) and spec.runner.model.ops.kind == "onednn"
    assert any("cpu_gemm_unavailable" in r.getMessage() and "false failed" in r.getMessage() for r in caplog.records)
