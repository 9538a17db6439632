"""The fused decode kernels (steps of at most 16 tokens) against the unfused path they replace.

The RMSNorm (with its residual add) in the skinny matmul's prologue against ``add_rms_norm`` then ``gemv``;
MoE routing + alignment in one launch against ``route`` then ``align``; a decode step's launches with the
fusions on against off. On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported); with ``ENGINE_TEST_DEVICE=cuda`` compiled, in bfloat16, and replayed from a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.conftest import DEVICE

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels import fused_decode, fused_moe, ops
from engine.kernels.gemv import GemvConfig, NormIn, gemv, norm_gemv
from engine.models.moe import SparseMoE, route
from engine.models.quant import quantize_per_channel

pytestmark = pytest.mark.timeout(60)
DEV = torch.device(DEVICE)
# Compiled on CUDA in bf16; fp16 under the interpreter (it has no bf16 matmul). Shapes not multiples of the tile.
DT = torch.bfloat16 if DEVICE == "cuda" else torch.float16
CFG = GemvConfig(16, 64, 4, 2)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # The inverse RMS is summed in another order (K slices, then across them): equal in fp16 here, within an ulp
    # of the model dtype where a rounding falls the other way.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_norm_in_the_matmul_prologue_equals_norm_then_matmul(tokens: int) -> None:
    ref = ops.TorchOps()
    x, res = (torch.randn(tokens, 200, generator=_g(i)).to(DEV, DT) for i in (1, 2))
    nw = (1 + 0.1 * torch.randn(200, generator=_g(3))).to(DEV, DT)
    w = (torch.randn(72, 200, generator=_g(4)) * 0.1).to(DEV, DT)
    b = torch.randn(72, generator=_g(5)).to(DEV, DT)
    h, want_res = ref.add_rms_norm(x, res, nw, 1e-6)
    out, got_res, normed = norm_gemv(x, NormIn(res, nw, 1e-6, keep_normed=True), w, bias=b, config=CFG)
    assert torch.equal(got_res, want_res)  # one rounding of one add: exact
    assert normed is not None
    _close(normed, h)
    _close(out, gemv(h, w, bias=b, config=CFG))
    # The gate/up projection's SwiGLU epilogue; the first layer's norm, which has no residual yet.
    out, got_res, normed = norm_gemv(x, NormIn(None, nw, 1e-6), w, swiglu=True, config=CFG)
    assert got_res is x and normed is None
    _close(out, gemv(ref.rms_norm(x, nw, 1e-6), w, swiglu=True, config=CFG))
    # FP8 weights with per-channel scales.
    q, scale = quantize_per_channel(w.float())
    out, _, _ = norm_gemv(x, NormIn(res, nw, 1e-6), q, scale, config=CFG)
    _close(out, gemv(h, q, scale, config=CFG))
    with pytest.raises(ValueError, match="at most 16 tokens"):
        norm_gemv(torch.zeros(17, 200, dtype=DT, device=DEV), NormIn(None, nw, 1e-6), w)


def test_norm_linear_of_the_ops_takes_the_fused_kernel_only_when_on() -> None:
    layer = torch.nn.Linear(200, 72, bias=False).to(DEV, DT)
    x, res = (torch.randn(3, 200, generator=_g(i)).to(DEV, DT) for i in (6, 7))
    nw = torch.ones(200, dtype=DT, device=DEV)
    want = ops.TorchOps().norm_linear(layer, x, res, nw, 1e-6, keep_normed=True)
    for fused in (True, False):
        out, residual, normed = ops.TritonOps(fused=fused).norm_linear(layer, x, res, nw, 1e-6, keep_normed=True)
        assert torch.equal(residual, want[1]) and normed is not None
        _close(out, want[0])
        _close(normed, want[2])  # type: ignore[arg-type]


def test_the_switch_reads_zero_or_one_and_refuses_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_FUSED_DECODE", raising=False)
    assert fused_decode()
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "0")
    assert not fused_decode() and not ops.TritonOps().fused
    moe = SparseMoE(32, 16, 8, 2, True)
    moe.kernels = "triton"  # the switch is read when the MoE block is put on the kernels
    assert not moe._fused
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1")
    moe.kernels = "triton"
    assert moe._fused
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "off")
    with pytest.raises(ValueError, match="ENGINE_FUSED_DECODE must be 0 or 1"):
        fused_decode()


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "keep_float32"),
    [(1, 128, 8, True, False), (16, 128, 8, True, False), (5, 60, 6, False, False), (3, 8, 2, True, True)],
)
def test_route_and_align_in_one_launch_equal_the_two_launches(
    tokens: int, experts: int, top_k: int, renormalize: bool, keep_float32: bool
) -> None:
    logits = torch.randn(tokens, experts, generator=_g(11)).to(DEV)
    weights, ids, al = fused_moe.route_align(logits, top_k, renormalize, 16, keep_float32)
    want_w, want_ids = route(logits, top_k, renormalize, keep_float32)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
    want = fused_moe.align(want_ids, experts, 16)
    used = int(al.used)
    assert used == int(want.used)
    assert torch.equal(al.sorted_pairs, want.sorted_pairs)  # both sort (expert, pair) keys in one program
    assert torch.equal(al.expert_ids[: used // 16], want.expert_ids[: used // 16])
    with pytest.raises(ValueError, match=r"route_align takes 1\.\.16 tokens"):
        fused_moe.route_align(torch.zeros(17, experts, device=DEV), top_k, renormalize, 16)


@pytest.mark.parametrize("fused", [True, False])
def test_routed_moe_equals_the_torch_experts(fused: bool) -> None:
    from engine.models.moe import experts_torch

    e, hidden, inter, k = 8, 32, 24, 2
    w13 = (torch.randn(e, 2 * inter, hidden, generator=_g(1)) * 0.3).to(DEV)
    w2 = (torch.randn(e, hidden, inter, generator=_g(2)) * 0.3).to(DEV)
    for tokens in (1, 7):
        x = torch.randn(tokens, hidden, generator=_g(3)).to(DEV)
        logits = torch.randn(tokens, e, generator=_g(4)).to(DEV)
        weights, ids = route(logits, k, True)
        got = fused_moe.routed_moe(x, logits, w13, w2, k, True, fused=fused)
        torch.testing.assert_close(got, experts_torch(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(120)  # ~15 s alone; two engines per family under the interpreter
def test_a_decode_step_launches_fewer_kernels_fused() -> None:
    # Two layers of each family: the norms go into the matmuls (2 a layer); MoE routing takes alignment along, and
    # the down projection the sum over each token's experts.
    if DEVICE != "cpu":
        pytest.skip("counts launches under the interpreter; a CUDA graph replays the same ones")
    from bench.engine import launch_count

    for shape, fewer in (("qwen3-8b", 2), ("qwen3-30b-a3b", 4)):
        off, on = launch_count.count(shape, False, layers=2), launch_count.count(shape, True, layers=2)
        assert off["total"] - on["total"] == 2 * fewer, (shape, off, on)
        assert on["triton"].get("_rms_norm_kernel") == 1  # the final norm, before the LM head
        assert "sum" not in on["torch"]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fused_kernels_replay_in_a_cuda_graph() -> None:
    x, res = (torch.randn(4, 512, generator=_g(i)).to(DEV, DT) for i in (1, 2))
    nw = torch.ones(512, dtype=DT, device=DEV)
    w = (torch.randn(1024, 512, generator=_g(3)) * 0.05).to(DEV, DT)
    logits = torch.randn(4, 128, generator=_g(4)).to(DEV, DT)
    # An MoE block whose down projection sums each token's 8 experts in its epilogue (tile counters reset per call).
    w13 = (torch.randn(128, 2 * 384, 512, generator=_g(7)) * 0.05).to(DEV, DT)
    w2 = (torch.randn(128, 512, 384, generator=_g(8)) * 0.05).to(DEV, DT)

    def step() -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor, torch.Tensor]:
        ids = fused_moe.route_align(logits, 8, True, 16)[1]
        return norm_gemv(x, NormIn(res, nw, 1e-6, True), w), ids, fused_moe.routed_moe(x, logits, w13, w2, 8, True)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids, moe = step()
    for seed in (5, 6, 7):
        x.copy_(torch.randn(4, 512, generator=_g(seed)).to(DEV, DT))
        logits.copy_(torch.randn(4, 128, generator=_g(seed + 10)).to(DEV, DT))
        graph.replay()
        torch.cuda.synchronize()
        (eager, eager_res, eager_normed), eager_ids, eager_moe = step()
        assert torch.equal(out[0], eager) and torch.equal(out[1], eager_res)
        assert out[2] is not None and eager_normed is not None and torch.equal(out[2], eager_normed)
        assert torch.equal(ids, eager_ids)
        assert torch.equal(moe, eager_moe)  # the epilogue's sum does not depend on which program finished last
        weights, want_ids = route(logits, 8, True)
        assert torch.equal(ids, want_ids)
        want = fused_moe.fused_moe(x, w13, w2, weights, want_ids)  # the unfused kernels: a separate sum
        torch.testing.assert_close(moe.float(), want.float(), atol=2e-2, rtol=2e-2)
