"""The sparse MoE block against transformers' Qwen3-MoE and Mixtral blocks, and the fused kernel against it.

The block is built on the meta device and filled from what ``save_pretrained`` writes, as the
loader will. On CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported); with ``ENGINE_TEST_DEVICE=cuda`` they run compiled, in bfloat16 and
inside a CUDA graph too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from gwtest import require

from engine.models.moe import HUB_EXPERT_PARTS, SparseMoE, experts_torch, route
from tests.engine.conftest import DEVICE, assert_within_one_rounding

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.timeout(120)
DEV = torch.device(DEVICE)
H, INTER, E, K = 32, 16, 8, 2  # hidden, intermediate, experts, top_k
TINY = {"hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 64}  # fmt: skip


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the torch path against transformers --------------------------------------------------------

# family -> (prefix of the block's tensors, per-expert part names, renormalize, float32 routing)
FAMILIES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), True, False),
    "qwen3_moe_unnormalized": ("mlp", ("gate_proj", "up_proj", "down_proj"), False, False),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), True, True),
}


def _hf_model(family: str) -> Any:  # a transformers PreTrainedModel
    import transformers

    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K, **TINY)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=INTER, intermediate_size=3 * INTER, num_experts=E, num_experts_per_tok=K,
            norm_topk_prob=family == "qwen3_moe", **TINY,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # the default init's router is too flat to pick distinct experts
            p.normal_(0.0, 0.3)
    model.set_experts_implementation("eager")  # the reference loop (ForCausalLM defaults to grouped_mm)
    return model.eval()


def _load_saved(family: str, model: Any, tmp_path: Path, dtype: torch.dtype) -> SparseMoE:
    """Our block, built on the meta device and filled from the tensors ``save_pretrained`` wrote."""
    from safetensors.torch import load_file

    prefix, parts, renormalize, float32_routing = FAMILIES[family]
    model.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    block_prefix = f"model.layers.0.{prefix}."
    names = sorted(n[len(block_prefix) :] for n in weights if n.startswith(block_prefix))
    # The per-expert Hub names (not transformers' fused in-memory gate_up_proj): what the loader reads.
    assert names == sorted(["gate.weight", *(f"experts.{e}.{p}.weight" for e in range(E) for p in parts)])
    with torch.device("meta"):
        moe = SparseMoE(H, INTER, E, K, renormalize, float32_routing=float32_routing)
    moe = moe.to_empty(device=DEV).to(dtype)
    with torch.no_grad():
        moe.gate.weight.copy_(weights[block_prefix + "gate.weight"])
    for name in names:
        m = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            moe.load_expert(int(m[1]), HUB_EXPERT_PARTS[m[2]], weights[block_prefix + name])
    return moe


@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_moe_equals_transformers_block(family: str, tmp_path: Path) -> None:
    model = _hf_model(family)
    ours = _load_saved(family, model, tmp_path, torch.float32)
    block = model.model.layers[0].mlp
    x = torch.randn(37, H, generator=_g(1))
    with torch.no_grad():
        want = block(x[None])[0]
        got = ours(x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="bit-exactness is against transformers on the CPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_torch_moe_rounds_as_transformers_in_bfloat16(family: str, tmp_path: Path) -> None:
    # Same ops in the same order and dtypes: Qwen3's routing weights cast to bf16, Mixtral's kept in fp32.
    model = _hf_model(family).to(torch.bfloat16)
    ours = _load_saved(family, model, tmp_path, torch.bfloat16)
    x = torch.randn(37, H, generator=_g(2)).to(torch.bfloat16)
    with torch.no_grad():
        want = model.model.layers[0].mlp(x[None])[0]
        assert torch.equal(ours(x), want)


def test_load_expert_refuses_wrong_parts_and_shapes() -> None:
    moe = SparseMoE(H, INTER, E, K, True)
    with pytest.raises(ValueError, match="unknown expert part 'gate_up'"):
        moe.load_expert(0, "gate_up", torch.zeros(2 * INTER, H))
    with pytest.raises(ValueError, match=r"expert 1 down: expected shape \(32, 16\), got \(16, 32\)"):
        moe.load_expert(1, "down", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        moe.load_expert(E, "up", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="unknown MoE kernels 'cuda'"):
        moe.kernels = "cuda"


# -- the fused kernel against the torch path ----------------------------------------------------


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=_g(3)) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=_g(4)) * inter**-0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype)


def _routing(tokens: int, num_experts: int, top_k: int, favour: int | None = None) -> torch.Tensor:
    logits = torch.randn(tokens, num_experts, generator=_g(5))
    if favour is not None:
        logits[:, favour] += 10.0  # every token picks this expert: its run spans several row blocks
    return logits.to(DEV)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "favour", "float32_routing"),
    [
        (1, E, K, None, False),  # one decode token: two experts hit, six idle
        (3, E, K, None, False),  # some experts get no token
        (37, E, K, None, False),
        (37, E, K, 0, True),  # expert 0 gets all 37 pairs; Mixtral's float32 weights
        (5, E, 1, None, False),  # top_k = 1: no sum over slots
        (20, 6, 3, None, False),  # experts not a power of two
    ],
)
def test_fused_moe_equals_torch(tokens: int, num_experts: int, top_k: int, favour: int | None,
                                float32_routing: bool) -> None:  # fmt: skip
    require("triton", "make install puts it in")
    from engine.kernels.fused_moe import fused_moe

    w13, w2 = _weights(num_experts, H, INTER, torch.float32)
    x = torch.randn(tokens, H, generator=_g(6)).to(DEV)
    weights, ids = route(_routing(tokens, num_experts, top_k, favour), top_k, True, float32_routing)
    if tokens == 3:
        assert len(set(ids.flatten().tolist())) < num_experts
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, experts_torch(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("experts", "top_k", "renormalize", "keep_float32"),
                         [(128, 8, True, False), (60, 6, False, False), (8, 2, True, True)])  # fmt: skip
def test_route_kernel_equals_torch_route(experts: int, top_k: int, renormalize: bool, keep_float32: bool) -> None:
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    logits = torch.randn(7, experts, generator=_g(11)).to(DEV)
    weights, ids = fused_moe.route(logits, top_k, renormalize, keep_float32)
    want_w, want_ids = route(logits, top_k, renormalize, keep_float32)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize", "keep_float32"),
                         [(1, 128, 8, True, False), (7, 60, 6, False, False), (16, 8, 2, True, True),
                          (17, 8, 2, True, False)])  # fmt: skip
def test_route_and_align_in_one_launch_equals_route_then_align(
    tokens: int, experts: int, top_k: int, renormalize: bool, keep_float32: bool
) -> None:
    # Decode batches (up to 16 tokens) route and align in one program; 17 tokens take the two launches.
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    logits = torch.randn(tokens, experts, generator=_g(12)).to(DEV)
    weights, ids, al = fused_moe.route_and_align(logits, top_k, renormalize, keep_float32)
    want_w, want_ids = route(logits, top_k, renormalize, keep_float32)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
    block_m = fused_moe.moe_tiles(tokens * top_k, experts).block_m
    want = fused_moe.align(want_ids, experts, block_m)
    used = int(want.used)
    assert int(al.used) == used
    assert torch.equal(al.sorted_pairs[:used], want.sorted_pairs[:used])  # each run in pair order, both ways
    assert bool((al.sorted_pairs[used:] == tokens * top_k).all())
    blocks = used // block_m
    assert torch.equal(al.expert_ids[:blocks], want.expert_ids[:blocks])
    # Ties go to the lower id (equal logits: the first top_k experts, in order).
    _, tied, _ = fused_moe.route_and_align(torch.zeros(tokens, experts, device=DEV), top_k, renormalize, keep_float32)
    assert tied.tolist() == [list(range(top_k))] * tokens


@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.float16), (5, torch.float32), (17, torch.float16)])
def test_the_router_in_parts_routes_as_its_rounded_sum(tokens: int, dtype: torch.dtype) -> None:
    # A decode step's router split along K: its float32 parts [tokens, parts, experts], summed in float32 and rounded
    # once to the router's dtype in the routing program, route as those rounded logits do (17 tokens: summed first).
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    experts, top_k = 60, 4
    parts = torch.randn(tokens, 3, experts, generator=_g(13)).to(DEV)
    logits = parts.sum(dim=1, dtype=torch.float32).to(dtype)
    weights, ids, al = fused_moe.route_and_align(parts, top_k, True, dtype=dtype)
    want_w, want_ids, want_al = fused_moe.route_and_align(logits, top_k, True)
    assert weights.dtype == dtype and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=0, rtol=0)
    assert torch.equal(al.sorted_pairs, want_al.sorted_pairs) and torch.equal(al.expert_ids, want_al.expert_ids)
    with pytest.raises(ValueError, match="need the dtype"):
        fused_moe.route_and_align(parts, top_k, True)
    with pytest.raises(ValueError, match="a dtype is for parts"):
        fused_moe.route_and_align(logits, top_k, True, dtype=torch.float64)


def test_fused_moe_leaves_the_experts_unsummed_for_the_residual_add_and_checks_its_alignment() -> None:
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    w13, w2 = _weights(E, H, INTER, torch.float32)
    x = torch.randn(3, H, generator=_g(6)).to(DEV)
    weights, ids, al = fused_moe.route_and_align(_routing(3, E, K), K, True)
    parts = fused_moe.fused_moe(x, w13, w2, weights, ids, al, sum_experts=False)
    assert parts.shape == (3, K, H)
    torch.testing.assert_close(parts.sum(dim=1), fused_moe.fused_moe(x, w13, w2, weights, ids), rtol=0, atol=0)
    torch.testing.assert_close(parts.sum(dim=1), experts_torch(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)
    other = fused_moe.align(ids, E, 32)  # made for other tiles
    with pytest.raises(ValueError, match="alignment was made for other tiles"):
        fused_moe.fused_moe(x, w13, w2, weights, ids, other)


def test_sparse_moe_on_triton_kernels_equals_torch() -> None:
    require("triton", "make install puts it in")
    moe = SparseMoE(H, 24, E, K, True).to(DEV)  # intermediate 24: not a power of two (masked tiles)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=_g(7)) * 0.3)
    for tokens in (9, 2, 20):  # 20: past the skinny router and the one-launch routing
        x = torch.randn(tokens, H, generator=_g(8)).to(DEV)
        with torch.no_grad():
            moe.kernels = "torch"
            want = moe(x)
            moe.kernels = "triton"
            torch.testing.assert_close(moe(x), want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(moe(x, sum_experts=False).sum(dim=1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "atomics"])
def test_align_puts_each_pair_once_in_its_experts_padded_run(
    one_program: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    if not one_program:
        monkeypatch.setattr(fused_moe, "ONE_PROGRAM_PAIRS", 0)  # the path of large batches
    ids = torch.tensor([[0, 3], [3, 1], [0, 3], [3, 5]], device=DEV)
    block_m = 16
    al = fused_moe.align(ids, 6, block_m)
    pairs = al.sorted_pairs.cpu()
    assert pairs.shape == (fused_moe.padded_capacity(8, 6, block_m),)
    used = int(al.used)
    assert used == 4 * block_m  # experts 0, 1, 3, 5 each get one block
    flat = ids.flatten().cpu()
    assert sorted(pairs[pairs < 8].tolist()) == list(range(8))  # every pair exactly once
    assert bool((pairs[used:] == 8).all())  # nothing past the used rows
    for b, expert in enumerate(al.expert_ids[: used // block_m].tolist()):
        run = pairs[b * block_m : (b + 1) * block_m]
        assert bool((flat[run[run < 8].long()] == expert).all())
    assert al.expert_ids[: used // block_m].tolist() == [0, 1, 3, 5]
    if one_program:  # sorted, not raced for: each run in pair order
        assert pairs[:used].tolist()[:2] == [0, 4] and pairs[3 * block_m : 3 * block_m + 1].tolist() == [7]


def test_fused_moe_large_batch_path_with_prefill_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # What thousands of tokens take on a GPU (atomics-based align, 64-row blocks), at a size the
    # interpreter runs in a second; expert 0's run spans several blocks.
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "ONE_PROGRAM_PAIRS", 0)
    monkeypatch.setattr(fused_moe, "moe_tiles", lambda pairs, experts: fused_moe.MoeTiles(64, 32, 32, 4))
    w13, w2 = _weights(E, H, INTER, torch.float32)
    x = torch.randn(150, H, generator=_g(6)).to(DEV)
    weights, ids = route(_routing(150, E, K, favour=0), K, True)
    got = fused_moe.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, experts_torch(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_a_tuning_runs_moe_tiles_are_read_for_their_gpu_and_refused_when_malformed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    require("triton", "make install puts it in")
    from engine.kernels import fused_moe

    path = tmp_path / "moe.json"
    monkeypatch.setenv("ENGINE_MOE_TILES", str(path))
    path.write_text('{"NVIDIA H200": {"up": [32, 256, 4, 3], "down": [16, 512, 4, 4]}}')
    fused_moe.measured_decode_tiles.cache_clear()
    assert fused_moe.measured_decode_tiles("NVIDIA H200") == {"up": [32, 256, 4, 3], "down": [16, 512, 4, 4]}
    assert fused_moe.measured_decode_tiles("another GPU") == {}
    # Off CUDA the defaults hold whatever the file says.
    assert fused_moe.gemm_tiles(8, 128, torch.device("cpu")) == (fused_moe.moe_tiles(8, 128),) * 2
    path.write_text('{"NVIDIA H200": {"gate": [32, 256, 4, 3]}}')
    fused_moe.measured_decode_tiles.cache_clear()
    with pytest.raises(ValueError, match=r"ENGINE_MOE_TILES.*'gate'"):
        fused_moe.measured_decode_tiles("NVIDIA H200")
    path.write_text('{"NVIDIA H200": {"up": [48, 256, 4, 3]}}')  # a Triton block is a power of two
    fused_moe.measured_decode_tiles.cache_clear()
    with pytest.raises(ValueError, match=r"ENGINE_MOE_TILES.*powers of two"):
        fused_moe.measured_decode_tiles("NVIDIA H200")
    fused_moe.measured_decode_tiles.cache_clear()


# -- CUDA: bfloat16 and graphs ------------------------------------------------------------------

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels and CUDA graphs need a GPU")
GH, GI, GE, GK = 512, 384, 16, 4  # larger than the CPU cases; INTER not a multiple of the tiles


@cuda_only
@pytest.mark.parametrize("tokens", [1, 7, 200, 300, 2048])  # 200 x 4: near the one-program align bound
def test_fused_moe_bfloat16_on_cuda(tokens: int) -> None:
    from engine.kernels.fused_moe import fused_moe

    w13, w2 = _weights(GE, GH, GI, torch.bfloat16)
    x = torch.randn(tokens, GH, generator=_g(9)).to(DEV, torch.bfloat16)
    weights, ids = route(_routing(tokens, GE, GK).to(torch.bfloat16), GK, True)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = experts_torch(x, w13, w2, weights, ids).float()
    # bf16 keeps 8 bits: the two paths differ by accumulation order inside the GEMMs (then one bf16
    # rounding of each intermediate) and by the sum over experts (float32 here, bf16 adds in torch).
    # Outputs are O(1): an absolute error within a few bf16 ulps of 1.
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert (got - want).abs().mean().item() < 2e-3


@cuda_only
@pytest.mark.parametrize("tokens", [16, 300])  # 64 pairs: the one-program align; 1200: the atomics one
def test_fused_moe_replays_in_a_cuda_graph(tokens: int) -> None:
    from engine.kernels.fused_moe import fused_moe

    w13, w2 = _weights(GE, GH, GI, torch.bfloat16)
    x = torch.randn(tokens, GH, generator=_g(10)).to(DEV, torch.bfloat16)
    weights, ids = route(_routing(tokens, GE, GK).to(torch.bfloat16), GK, True)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    # New inputs in the captured buffers, among them a routing that sends every token to expert 3.
    for seed, favour in ((11, None), (12, 3)):
        x.copy_(torch.randn(tokens, GH, generator=_g(seed)).to(DEV, torch.bfloat16))
        w_new, ids_new = route(_routing(tokens, GE, GK, favour).to(torch.bfloat16), GK, True)
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.cuda.synchronize()
        # Each output row depends only on its own input rows: the replay equals an eager call exactly.
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))


def test_one_tokens_cuda_experts_and_router_take_what_they_divide(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token's experts and router on the CUDA kernel (engine.kernels.token_gemv): on unless
    ENGINE_MOE_TOKEN_GEMV=triton; one 16-bit token over stacks of its dtype whose rows are whole runs of chunks, and a
    router of at most 1,024 experts and 32 picks."""
    from engine.kernels import token_gemv

    monkeypatch.delenv("ENGINE_MOE_TOKEN_GEMV", raising=False)
    assert token_gemv.moe_enabled()
    monkeypatch.setenv("ENGINE_MOE_TOKEN_GEMV", "triton")
    assert not token_gemv.moe_enabled()
    monkeypatch.setenv("ENGINE_MOE_TOKEN_GEMV", "cuda")
    assert token_gemv.moe_enabled()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.zeros(1, 2048, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(4, 2 * 768, 2048, dtype=torch.bfloat16), torch.zeros(4, 2048, 768, dtype=torch.bfloat16)
    assert token_gemv.supports_experts(x, w13, w2)
    assert not token_gemv.supports_experts(torch.zeros(2, 2048, dtype=torch.bfloat16), w13, w2)
    assert not token_gemv.supports_experts(x, w13, w2[:, :, :384].contiguous())  # 768-byte rows
    assert not token_gemv.supports_experts(x.half(), w13, w2)
    gate = torch.zeros(128, 2048, dtype=torch.bfloat16)
    assert token_gemv.supports_router(x, gate, 8)
    assert not token_gemv.supports_router(x, gate, 33)  # a lane a pick
    assert not token_gemv.supports_router(x, torch.zeros(2048, 2048, dtype=torch.bfloat16), 8)  # past 1,024 experts
    assert not token_gemv.supports_router(x, gate.float(), 8)


@cuda_only
@pytest.mark.parametrize("float32_routing", [False, True])
def test_one_tokens_cuda_experts_equal_the_fused_kernels(monkeypatch: pytest.MonkeyPatch,
                                                         float32_routing: bool) -> None:  # fmt: skip
    """On the CUDA one-token kernel (ENGINE_MOE_TOKEN_GEMV=cuda, the default), one token's MoE layer
    (qwen3-30b-a3b's intermediate size) against the torch reference and the grouped GEMMs, summed and left unsummed,
    and replayed from a CUDA graph with a new routing."""
    from engine.kernels.fused_moe import fused_moe

    hidden, inter, experts, top_k = 512, 768, 16, 4
    w13, w2 = _weights(experts, hidden, inter, torch.bfloat16)
    x = torch.randn(1, hidden, generator=_g(30)).to(DEV, torch.bfloat16)
    weights, ids = route(_routing(1, experts, top_k).to(torch.bfloat16), top_k, True, float32_routing)
    monkeypatch.setenv("ENGINE_MOE_TOKEN_GEMV", "triton")
    triton_sum = fused_moe(x, w13, w2, weights, ids)
    triton_parts = fused_moe(x, w13, w2, weights, ids, sum_experts=False)
    monkeypatch.setenv("ENGINE_MOE_TOKEN_GEMV", "cuda")
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), experts_torch(x, w13, w2, weights, ids).float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, triton_sum, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, sum_experts=False), triton_parts, atol=2e-2,
                               rtol=2e-2)  # fmt: skip
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fused_moe(x, w13, w2, weights, ids)
    w_new, ids_new = route(_routing(1, experts, top_k, 3).to(torch.bfloat16), top_k, True, float32_routing)
    weights.copy_(w_new)
    ids.copy_(ids_new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids))


def _same_picks(logits: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` ids pick what ``want`` picks, in order: distinct, with the same probabilities (bf16 logits tie often
    among a thousand experts, and torch.topk breaks ties its own way, the kernel to the lower id)."""
    probs = torch.softmax(logits.float(), dim=-1)[0]
    assert got.unique().numel() == got.numel()
    assert torch.equal(probs[got[0]], probs[want[0]])


@cuda_only
@pytest.mark.parametrize(
    ("experts", "top_k", "renormalize", "float32_routing"),
    [(128, 8, True, False), (8, 2, True, True), (60, 4, False, False), (1024, 32, True, False)],
)
def test_one_tokens_cuda_router_routes_as_torch(experts: int, top_k: int, renormalize: bool,
                                                float32_routing: bool) -> None:  # fmt: skip
    """The router and its routing in one launch (token_gemv.token_route) against route() of the router's bf16
    logits: the same experts in the same order and weights within a bf16 rounding, launch after launch (the last
    block resets the count of finished blocks) and replayed from a CUDA graph with a new token."""
    from engine.kernels import token_gemv

    hidden = 2048
    gate = (torch.randn(experts, hidden, generator=_g(11)) * hidden**-0.5).to(DEV, torch.bfloat16)
    for seed in range(3):
        x = torch.randn(1, hidden, generator=_g(20 + seed)).to(DEV, torch.bfloat16)
        want_w, want_ids = route(x @ gate.T, top_k, renormalize, float32_routing)
        got_w, got_ids = token_gemv.token_route(x, gate, top_k, renormalize, float32_routing)
        assert got_w.dtype == want_w.dtype and got_ids.dtype == torch.int64
        _same_picks(x @ gate.T, got_ids, want_ids)
        torch.testing.assert_close(got_w.float(), want_w.float(), atol=1e-6, rtol=8e-3)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out_w, out_ids = token_gemv.token_route(x, gate, top_k, renormalize, float32_routing)
    for seed in (40, 41):
        x.copy_(torch.randn(1, hidden, generator=_g(seed)).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_ids = route(x @ gate.T, top_k, renormalize, float32_routing)
        _same_picks(x @ gate.T, out_ids, want_ids)
        torch.testing.assert_close(out_w.float(), want_w.float(), atol=1e-6, rtol=8e-3)


@cuda_only
def test_one_token_sparse_moe_with_the_fused_router_equals_the_triton_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoE at one token (qwen3-30b-a3b's sizes, fewer experts): the router in one launch with its routing
    (moe.ROUTER_TOKEN) gives the layer the separate router and routing kernels give."""
    from engine.kernels import token_gemv
    from engine.models import moe as moe_module

    model = SparseMoE(2048, 768, 32, 8, True, kernels="triton").to(DEV, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=_g(9)) * p.shape[-1] ** -0.5)
        x = torch.randn(1, 2048, generator=_g(10)).to(DEV, torch.bfloat16)
        assert token_gemv.supports_router(x, model.gate.weight, 8)  # else both sides would take the same path
        fused = model(x, sum_experts=False)
        monkeypatch.setattr(moe_module, "ROUTER_TOKEN", False)
        torch.testing.assert_close(fused, model(x, sum_experts=False), atol=2e-2, rtol=2e-2)


def test_the_norm_goes_into_one_tokens_cuda_router_where_it_divides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The residual add and norm before a MoE block go into its router's launch (token_gemv.supports_norm_route,
    fuses_norm_route): one token the CUDA norm takes before a router the one-token kernel takes, of the norm's width,
    whole 16-byte chunks a thread; ROUTER_NORM = 0 or ENGINE_TOKEN_NORM=triton keep them apart; the torch kernels
    never."""
    from engine.kernels import token_gemv

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bf = torch.bfloat16
    x, nw, gate = torch.zeros(1, 2048, dtype=bf), torch.ones(2048, dtype=bf), torch.zeros(128, 2048, dtype=bf)
    assert token_gemv.supports_norm_route(x, x, nw, gate, 8)
    assert token_gemv.supports_norm_route(torch.zeros(1, 8, 2048, dtype=bf), x, nw, gate, 8)  # the experts' outputs
    assert not token_gemv.supports_norm_route(x, x, nw, gate, 33)  # a lane a pick
    assert not token_gemv.supports_norm_route(x, x, nw, torch.zeros(128, 1024, dtype=bf), 8)  # not the norm's width
    small = torch.zeros(1, 512, dtype=bf)
    assert not token_gemv.supports_norm_route(small, small, nw[:512], gate[:, :512], 8)  # 64 chunks, 128 threads
    monkeypatch.setattr(token_gemv, "ROUTER_NORM", 1)
    assert token_gemv.fuses_norm_route(x, x, nw, gate, 8)
    monkeypatch.setenv("ENGINE_TOKEN_NORM", "triton")
    assert not token_gemv.fuses_norm_route(x, x, nw, gate, 8)
    monkeypatch.delenv("ENGINE_TOKEN_NORM")
    monkeypatch.setattr(token_gemv, "ROUTER_NORM", 0)
    assert not token_gemv.fuses_norm_route(x, x, nw, gate, 8)
    assert SparseMoE(2048, 768, 128, 8, True, kernels="torch").norm_forward(x, x, nw, 1e-6) is None


@cuda_only
def test_one_tokens_cuda_router_with_the_norm_in_it_routes_the_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``token_norm_route`` against the CUDA norm's launch: the residual stream exactly, the stored norm equal but
    for a rare value a rounding away, and the routing of that norm as route() routes it; for an attention output, a
    MoE layer's 16-bit experts and float32 parts; ``SparseMoE.norm_forward`` against the norm then the layer; and
    replayed from a CUDA graph with a new token."""
    from engine.kernels import token_gemv, token_norm

    monkeypatch.setattr(token_gemv, "ROUTER_NORM", 1)
    hidden, top_k = 2048, 8
    model = SparseMoE(hidden, 768, 32, top_k, True, kernels="triton").to(DEV, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=_g(12)) * p.shape[-1] ** -0.5)
    gate = model.gate.weight.detach()
    # A residual stream of RMS ~3, so that the inverse RMS is far from 1 and an error in it would show in the norm.
    res = (3 * torch.randn(1, hidden, generator=_g(13))).to(DEV, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(hidden, generator=_g(14))).to(DEV, torch.bfloat16)
    inputs = [torch.randn(1, hidden, generator=_g(15)).to(DEV, torch.bfloat16),
              torch.randn(1, top_k, hidden, generator=_g(16)).to(DEV, torch.bfloat16),
              torch.randn(1, 2, hidden, generator=_g(17)).to(DEV)]  # fmt: skip

    def check(x: torch.Tensor, routed: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The residual stream exactly, the stored norm but for a rare rounding, its routing; the stream."""
        w, ids, h, r = routed
        h_ref, r_ref = token_norm.token_norm(x, res, nw, 1e-6)
        torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
        assert_within_one_rounding(h, h_ref)  # its sum of squares is added in another order than the norm's
        want_w, want_ids = route(h @ gate.T, top_k, True, False)
        _same_picks(h @ gate.T, ids, want_ids)
        torch.testing.assert_close(w.float(), want_w.float(), atol=1e-6, rtol=8e-3)
        return r_ref

    for x in inputs:
        assert token_gemv.fuses_norm_route(x, res, nw, gate, top_k)
        routed = token_gemv.token_norm_route(x, res, nw, 1e-6, gate, top_k, True)
        r_ref = check(x, routed)
        h = routed[2]
        with torch.no_grad():
            got = model.norm_forward(x, res, nw, 1e-6)
            assert got is not None
            out, r2 = got
            torch.testing.assert_close(r2, r_ref, rtol=0, atol=0)
            torch.testing.assert_close(out, model(h, sum_experts=False), atol=2e-2, rtol=2e-2)
    x = inputs[0]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        replayed = token_gemv.token_norm_route(x, res, nw, 1e-6, gate, top_k, True)
    for seed in (42, 43):
        x.copy_(torch.randn(1, hidden, generator=_g(seed)).to(DEV, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        check(x, replayed)
