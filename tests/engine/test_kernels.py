"""The Triton kernels against the torch reference, and engines built on them against torch engines.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set below before Triton
is imported); with ``ENGINE_TEST_DEVICE=cuda`` they run compiled on the GPU, where CUDA-graph
replays are checked against eager steps too. Skipped when the triton package is absent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from gwtest import require

from tests.engine.conftest import DEVICE, MakeEngine

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import kernels
from engine.attention import gather_kv
from engine.kernels import ops, triton_ops
from engine.models.loader import LoadedModel, load_model
from engine.sequence import SamplingParams
from engine.sparse import MeanKeyIndexer, select_blocks_paged, sparse_decode

require("triton", "make install puts it in")

pytestmark = pytest.mark.timeout(300)
DEV = torch.device(DEVICE)
T = TypeVar("T")
H, KVH, D, BS, NB = 9, 3, 64, 16, 40  # SmolLM2's head layout


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cuda_or_triton(monkeypatch: pytest.MonkeyPatch, variable: str, uses_cuda: Callable[[], bool]) -> None:
    """A switch between a CUDA C++ kernel and Triton's: unset it is CUDA, ``triton`` is Triton, anything else an error
    naming the variable."""
    monkeypatch.delenv(variable, raising=False)
    assert uses_cuda()
    monkeypatch.setenv(variable, "triton")
    assert not uses_cuda()
    monkeypatch.setenv(variable, "cutlass")
    with pytest.raises(ValueError, match=f"{variable} must be 'cuda' or 'triton'"):
        uses_cuda()
    monkeypatch.delenv(variable)


def _captured(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of ``step`` on a side stream, and what the capture returned (its outputs, which each replay
    rewrites); ``step`` runs once before, outside the capture, so that its kernels are compiled."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        step()
        with torch.cuda.graph(graph, stream=side):
            out = step()
    return graph, out


def test_norms_and_swiglu_match_torch() -> None:
    x, r = (torch.randn(5, 64, generator=_g(i)).to(DEV) for i in (1, 2))
    w = torch.randn(64, generator=_g(3)).to(DEV)
    ref = ops.TorchOps()
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    out, res = triton_ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = ref.add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out)
    # A MoE layer's per-expert outputs [rows, top_k, hidden], summed by the residual add (float32, one rounding).
    parts = torch.randn(5, 8, 64, generator=_g(5)).to(DEV)
    out, res = triton_ops.add_rms_norm(parts, r, w, 1e-5)
    ref_out, ref_res = ref.add_rms_norm(parts, r, w, 1e-5)
    torch.testing.assert_close(res, ref_res, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(res, r + parts.sum(dim=1), rtol=1e-6, atol=1e-6)
    gu = torch.randn(5, 300, generator=_g(4)).to(DEV)  # not a power of two
    torch.testing.assert_close(triton_ops.silu_and_mul(gu), ref.silu_and_mul(gu))


def _skinny_case(tokens: int, k: int) -> tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dtype, x [tokens, k], weight [72, k], bias [72])`` for the skinny-matmul tests: bf16 on CUDA, fp16 under
    the interpreter (it has no bf16 matmul)."""
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(tokens, k, generator=_g(1)).to(DEV, dt)
    w = (torch.randn(72, k, generator=_g(2)) * 0.1).to(DEV, dt)
    return dt, x, w, torch.randn(72, generator=_g(3)).to(DEV, dt)


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_skinny_matmuls_match_linear(tokens: int) -> None:
    from engine.kernels.gemv import GemvConfig, gemv
    from engine.models.quant import quantize_per_channel

    # Shapes not multiples of the tile: masked edges.
    dt, x, w, b = _skinny_case(tokens, 200)
    cfg = GemvConfig(16, 64, 4, 2)
    torch.testing.assert_close(gemv(x, w, bias=b, config=cfg), F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(gemv(x, w, swiglu=True, config=cfg), F.silu(gate) * up, rtol=2e-2, atol=2e-2)
    # FP8 weights with per-channel scales: equal to the dequantized weight's matmul (activations unquantized).
    q, scale = quantize_per_channel(w.float())
    ref = F.linear(x.float(), q.float() * scale[:, None])
    torch.testing.assert_close(gemv(x, q, scale, config=cfg).float(), ref, rtol=2e-2, atol=2e-2)
    gate, up = ref.chunk(2, dim=-1)
    torch.testing.assert_close(gemv(x, q, scale, swiglu=True, config=cfg).float(), F.silu(gate) * up, rtol=2e-2,
                               atol=2e-2)  # fmt: skip
    with pytest.raises(ValueError, match="at most 16 tokens"):
        gemv(torch.zeros(17, 200, dtype=dt, device=DEV), w)


def test_the_top_p_cut_without_a_sort_keeps_what_the_sorted_rows_keep() -> None:
    from engine.kernels.sampling import top_p_threshold as bisected
    from engine.sampler import top_p_threshold

    # Peaked and flat rows, tokens masked out (-inf), top-p from 0.3 to 1, two rows with a top-k cut too.
    vocab = 3000
    logits = torch.randn(8, vocab, generator=_g(5)) * torch.tensor([[8.0], [3.0], [1.0], [0.2], [3.0], [1.0],
                                                                    [0.05], [2.0]])  # fmt: skip
    logits[1, :40] = float("-inf")
    probs = logits.softmax(-1)
    top_p = torch.tensor([[0.9], [0.5], [0.95], [0.99], [0.8], [1.0], [0.3], [0.7]])
    top_k = [vocab, vocab, vocab, vocab, 50, 7, vocab, 1]
    # The rule on sorted rows, as the sampler applied it before: the top k ranks, renormalised, and a token dropped
    # when the ones ranked above it already hold top_p.
    ordered, ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    ranked = ordered.masked_fill(ranks >= torch.tensor(top_k).unsqueeze(1), 0.0)
    ranked = ranked / ranked.sum(-1, keepdim=True)
    keep_sorted = (ranked.cumsum(-1) - ranked <= top_p) & (ranked > 0)
    want = torch.zeros_like(probs, dtype=torch.bool).scatter(1, ids, keep_sorted)
    floor = torch.tensor([[0.0] if k == vocab else [float(ordered[i, k - 1])] for i, k in enumerate(top_k)])
    cut = top_p_threshold(probs.to(DEV), floor.to(DEV), top_p.to(DEV)).cpu()
    assert torch.equal((probs >= cut) & (probs > 0), want)
    cut = bisected(probs.to(DEV), floor.to(DEV), top_p.to(DEV)).cpu()
    assert torch.equal((probs >= cut) & (probs > 0), want)
    assert want[5].sum() == 7 and want[7].sum() == 1  # top-p 1, and top-k 1: the top-k cut alone


@pytest.mark.parametrize("splits", [1, 3])
def test_one_token_fp8_matmul_on_the_cuda_cores_matches_the_dequantized_weight(splits: int) -> None:
    from engine.kernels.gemv import GemvConfig, TokenConfig, gemv
    from engine.models.quant import quantize_per_channel

    # One token on an FP8 weight takes the CUDA-core kernel (split along K or not); K = 200 is no multiple of the
    # slice and N = 72 none of the rows: masked edges. Bias added after the scale, as Fp8Linear does.
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(1, 200, generator=_g(1)).to(DEV, dt)
    w = (torch.randn(72, 200, generator=_g(2)) * 0.1).to(DEV, dt)
    b = torch.randn(72, generator=_g(3)).to(DEV, dt)
    q, scale = quantize_per_channel(w.float())
    ref = F.linear(x.float(), q.float() * scale[:, None], b.float())
    cfg = TokenConfig(8, 64, 4, 2, splits)
    torch.testing.assert_close(gemv(x, q, scale, bias=b, config=cfg).float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gemv(x, q, scale).float(), F.linear(x.float(), q.float() * scale[:, None]), rtol=2e-2,
                               atol=2e-2)  # fmt: skip
    with pytest.raises(ValueError, match="TokenConfig is for one token"):
        gemv(x.expand(2, 200).contiguous(), q, scale, config=cfg)
    with pytest.raises(ValueError, match="TokenConfig is for one token"):
        gemv(x, q, scale, swiglu=True, config=cfg)
    # Asked for by its tile, the kernel takes a 16-bit weight too (the tile sweeps compare it against the tensor cores).
    torch.testing.assert_close(gemv(x, w, bias=b, config=cfg), F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    # A GemvConfig keeps one token on the tensor-core kernel (what the tile sweep compares against).
    torch.testing.assert_close(gemv(x, q, scale, config=GemvConfig(16, 64, 4, 2)).float(), ref - b.float(),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_skinny_matmul_tiles_come_from_the_measured_table_and_a_tuning_run_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.kernels import gemv as g

    packaged = json.loads(g.TILES_FILE.read_text())
    for device, kinds in packaged.items():
        for kind, shapes in kinds.items():
            assert kind in ("bf16", "fp8", "fp8_token"), (device, kind)
            for shape, tile in shapes.items():
                n, k = map(int, shape.split("x"))
                assert (
                    n > 0
                    and k > 0
                    and len(tile) == (5 if kind == "fp8_token" else 4)
                    and all(isinstance(v, int) and v > 0 for v in tile)
                ), shape
    override = tmp_path / "tiles.json"
    override.write_text(json.dumps({"NVIDIA H200": {"fp8": {"4096x4096": [16, 128, 8, 2]}}}))
    monkeypatch.setenv("ENGINE_GEMV_TILES", str(override))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    g._tiles.cache_clear()
    try:
        table = g._tiles(0)
        assert table["fp8"]["4096x4096"] == [16, 128, 8, 2]  # the tuning run's entry wins
        assert table["bf16"] == packaged["NVIDIA H200"]["bf16"]  # the rest stays
    finally:
        g._tiles.cache_clear()


@pytest.mark.parametrize("n", [7, 20])  # 7: a program per (token, KV head); 20: one per token
def test_rope_and_store_writes_rotated_keys_and_values_to_their_slots(n: int) -> None:
    qkv = torch.randn(n, (H + 2 * KVH) * D, generator=_g()).to(DEV)
    pos = torch.randint(0, 200, (n,), generator=_g(1)).to(DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.arange(200).float()[:, None] * inv[None]
    cos, sin = torch.cat((emb, emb), -1).cos().to(DEV), torch.cat((emb, emb), -1).sin().to(DEV)
    cache = torch.zeros(2, NB, KVH, BS, D, device=DEV)
    slots = torch.randperm(NB * BS, generator=_g(2))[:n].to(DEV)
    q = triton_ops.rope_and_store(qkv, pos.int(), cos, sin, cache, slots.int(), H, KVH, D)
    qq, kk, vv = qkv.split([H * D, KVH * D, KVH * D], -1)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    written = cache[:, slots // BS, :, slots % BS]  # [n, 2, KVH, D]: slot i's K and V rows of every KV head
    torch.testing.assert_close(q, qq.view(n, H, D) * c + ops.rotate_half(qq.view(n, H, D)) * s)
    torch.testing.assert_close(written[:, 0], kk.view(n, KVH, D) * c + ops.rotate_half(kk.view(n, KVH, D)) * s)
    torch.testing.assert_close(written[:, 1], vv.view(n, KVH, D))


def _reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    k, v = gather_kv(cache, table.long(), ctx, q.dtype)
    kpos = torch.arange(ctx, device=q.device)
    qpos = torch.arange(ctx - q.shape[0], ctx, device=q.device)
    mask = kpos[None] <= qpos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def _tables(ctx: list[int]) -> torch.Tensor:
    perm = torch.randperm(NB, generator=_g(5))
    width = max(-(-c // BS) for c in ctx)
    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx):
        nb = -(-c // BS)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    return tables.to(DEV)


@pytest.mark.parametrize(("splits", "qk_norm", "dtype", "window"),
                         [(1, False, torch.float32, 0), (3, True, torch.float32, 0), (8, True, torch.bfloat16, 0),
                          (3, False, torch.bfloat16, 40)])  # fmt: skip
def test_rope_in_the_attention_kernel_equals_rope_and_store_then_attention(
    splits: int, qk_norm: bool, dtype: torch.dtype, window: int
) -> None:
    """A decode step's rotary positions and K/V store done by the attention programs (``rope`` of
    ``paged_attention``) give what ``rope_and_store`` then ``paged_attention`` give: the same cache and outputs (bit
    for bit on CPU); unsplit and split (the program holding a sequence's last keys stores them), with Qwen3's per-head
    norm, in bfloat16, with a sliding window; and it is refused for prompt rows."""
    ctx = [70, 5, 33, 200]
    tables = _tables(ctx)
    context = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    starts = torch.arange(5, dtype=torch.int32, device=DEV)
    n = len(ctx)
    qkv = torch.randn(n, (H + 2 * KVH) * D, generator=_g(40)).to(DEV, dtype)
    pos = (context - 1).int()  # a decode token's position: its context's last
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.arange(256).float()[:, None] * inv[None]
    cos, sin = torch.cat((emb, emb), -1).cos().to(DEV), torch.cat((emb, emb), -1).sin().to(DEV)
    slots = torch.stack([tables[i, (c - 1) // BS] * BS + (c - 1) % BS for i, c in enumerate(ctx)]).int()
    norm = None
    if qk_norm:
        qw, kw = ((1 + 0.1 * torch.randn(D, generator=_g(41 + i))).to(DEV, dtype) for i in range(2))
        norm = ops.QKNorm(qw, kw, 1e-6)
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(6)).to(DEV, dtype)
    fused_cache = cache.clone()
    q = triton_ops.rope_and_store(qkv, pos, cos, sin, cache, slots, H, KVH, D, norm)
    want = triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, 1, max(ctx), num_splits=splits,
                                      window=window)  # fmt: skip
    rope = triton_ops.RopeInAttention(pos, cos, sin, slots, H, norm)
    got = triton_ops.paged_attention(qkv, fused_cache, tables, starts, context, D**-0.5, 1, max(ctx),
                                     num_splits=splits, window=window, rope=rope)  # fmt: skip
    # Bit for bit under the interpreter; compiled, a head norm's sum may add in another order (a flipped rounding).
    exact = 0 if DEVICE == "cpu" else 2**-7
    torch.testing.assert_close(fused_cache, cache, rtol=exact, atol=exact)  # the new keys and values, nothing else
    torch.testing.assert_close(got, want, rtol=exact, atol=exact)
    with pytest.raises(ValueError, match="decode steps"):
        triton_ops.paged_attention(qkv, fused_cache, tables, starts, context, D**-0.5, 2, max(ctx), rope=rope)


def test_the_attention_launch_asks_for_its_trigger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's launch lets the next kernel in where ``ATTENTION_TRIGGER`` says (after the loop, or first thing
    to measure it; where in the compiled kernel: tests/engine/test_attention_sass.py)."""
    asked: list[int] = []

    def recording(device: torch.device, tokens: int, trigger: int = kernels.PDL_EARLY) -> dict[str, object]:
        asked.append(trigger)
        return kernels.pdl_launch(device, tokens, trigger)

    monkeypatch.setattr(triton_ops, "pdl_launch", recording)
    ctx = [70, 5]
    q = torch.randn(len(ctx), H, D, generator=_g(51)).to(DEV)
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(6)).to(DEV)
    context = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    starts = torch.arange(len(ctx) + 1, dtype=torch.int32, device=DEV)
    for trigger in (kernels.PDL_LOOP, kernels.PDL_EARLY):
        monkeypatch.setattr(triton_ops, "ATTENTION_TRIGGER", trigger)
        triton_ops.paged_attention(q, cache, _tables(ctx), starts, context, D**-0.5, 1, max(ctx))
        assert asked[-1] == trigger


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_paged_attention_decode_and_prompt_rows_match_dense(splits: int) -> None:
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(6)).to(DEV)
    ctx = [70, 5, 33, 200]
    tables = _tables(ctx)
    context = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    # Mixed: a decode, a fresh prompt of 5, a chunk of 10 after 23 cached, a chunk of 30 after 170.
    q_lens = [1, 5, 10, 30]
    starts = torch.tensor([0, 1, 6, 16, 46], dtype=torch.int32, device=DEV)
    q = torch.randn(46, H, D, generator=_g(7)).to(DEV)
    out = triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, max(q_lens), max(ctx))
    for i in range(4):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows], _reference(q[rows], cache, tables[i], ctx[i]), atol=2e-5, rtol=1e-4)
    # Decode only, the context split over several programs and merged.
    q = torch.randn(4, H, D, generator=_g(8)).to(DEV)
    starts = torch.arange(5, dtype=torch.int32, device=DEV)
    out = triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, 1, max(ctx), num_splits=splits)
    for i in range(4):
        torch.testing.assert_close(out[i : i + 1], _reference(q[i : i + 1], cache, tables[i], ctx[i]),
                                   atol=2e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("window", [0, 24])
def test_unmasked_tiles_and_a_lazy_rescale_equal_the_masked_eager_loop(window: int) -> None:
    """Tiles every query of a program sees whole skip the masks, and a decode program moves its running maximum
    only when a row's grew by more than 2^8: the same attention as masking every tile and rescaling every tile.
    Keys grow with their position, so the maxima grow by far more than 2^8 along the contexts."""
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(22)).to(DEV)
    ctx = [70, 5, 33, 200]
    tables = _tables(ctx)
    for i, c in enumerate(ctx):
        for pos in range(c):
            cache[0, tables[i, pos // BS], :, pos % BS] *= 1 + pos / 10
    context = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    cases = [
        (torch.tensor([0, 1, 6, 16, 46], dtype=torch.int32, device=DEV), 30, 1),  # a decode and three prompts
        (torch.arange(5, dtype=torch.int32, device=DEV), 1, 1),
        (torch.arange(5, dtype=torch.int32, device=DEV), 1, 3),
    ]
    for starts, q_len, splits in cases:
        q = torch.randn(int(starts[-1]), H, D, generator=_g(23)).to(DEV)
        args = (q, cache, tables, starts, context, D**-0.5, q_len, max(ctx))
        got = triton_ops.paged_attention(*args, num_splits=splits, window=window)
        want = triton_ops.paged_attention(*args, num_splits=splits, window=window, unmasked=False,
                                          lazy_rescale=False)  # fmt: skip
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        if window == 0:
            for i in range(4):
                rows = slice(int(starts[i]), int(starts[i + 1]))
                torch.testing.assert_close(got[rows], _reference(q[rows], cache, tables[i], ctx[i]), atol=2e-5,
                                           rtol=1e-4)  # fmt: skip


def test_decode_splits_fill_one_wave_of_the_measured_tiles_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 (132 SMs): a decode step splits its contexts until its programs fill one wave (8 one-warp
    programs an SM, for either cache dtype), never into more splits than 32-key runs of the longest context or
    MAX_DECODE_SPLITS; the split counts and tiles bench/device/fp8_tune.py chose them from."""
    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    monkeypatch.setenv("ENGINE_FP8_ATTENTION", "triton")
    gpu = torch.device("cuda", 0)
    fp8 = {(256, 2048): 1, (64, 544): 2, (16, 8192): 8, (1, 4096): kernels.MAX_DECODE_SPLITS, (1, 100): 4}
    bf16 = {(256, 2048): 1, (64, 544): 2, (16, 8192): 8, (1, 4096): 64, (2, 2048): 64, (4, 2048): 33}
    for (seqs, ctx), want in fp8.items():
        assert kernels.decode_splits(seqs, 8, ctx, gpu, fp8=True) == want, (seqs, ctx)
    for (seqs, ctx), want in bf16.items():
        assert kernels.decode_splits(seqs, 8, ctx, gpu) == want, (seqs, ctx)
    assert kernels.decode_tile(True) == kernels.DecodeTile(32, 1, 3, unmasked=True)
    assert kernels.decode_tile(False) == kernels.DecodeTile(32, 1, 3, lazy_rescale=True)


def test_the_cuda_fp8_decode_kernel_splits_to_shorten_its_last_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an FP8 cache on CUDA, decode steps split for the CUDA kernel (13 one-warp programs an SM): the power of
    two whose waves times tiles a program (plus 8 for its overhead) is least. Measured on the H200 alone
    (bench/device/fp8_mma_attn.py): 2 splits beat 1 and 4 at batch 256 and 2K context, 2 at 64 x 544, 8 at 16 x 8K.
    ENGINE_FP8_ATTENTION=triton keeps the Triton kernel and its rule; anything else is refused by name."""
    from engine.kernels import fp8_decode, nvrtc

    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    monkeypatch.setattr(nvrtc, "available", lambda: True)  # as on the GPU machine
    gpu = torch.device("cuda", 0)
    want = {(256, 2048): 2, (64, 544): 2, (16, 8192): 8, (8, 1000): 16, (1, 4096): kernels.MAX_DECODE_SPLITS,
            (1, 100): 4, (1, 20): 1}  # fmt: skip
    for (seqs, ctx), n in want.items():
        assert kernels.decode_splits(seqs, 8, ctx, gpu, fp8=True) == n, (seqs, ctx)
    assert kernels.decode_splits(256, 8, 2048, gpu) == 1  # a 16-bit cache keeps Triton's rule
    monkeypatch.setattr(nvrtc, "available", lambda: False)  # no NVRTC: Triton's kernel, and its rule
    assert kernels.decode_splits(256, 8, 2048, gpu, fp8=True) == 1
    monkeypatch.setattr(nvrtc, "available", lambda: True)
    monkeypatch.setenv("ENGINE_FP8_ATTENTION", "triton")
    assert kernels.decode_splits(256, 8, 2048, gpu, fp8=True) == 1
    monkeypatch.setenv("ENGINE_FP8_ATTENTION", "tvm")
    with pytest.raises(ValueError, match="ENGINE_FP8_ATTENTION must be 'cuda' or 'triton'"):
        kernels.decode_splits(256, 8, 2048, gpu, fp8=True)
    # What the kernel takes: decode steps over e4m3, head size 128, at most 8 query heads a KV head, no window.
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 8, 16, 128, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fp8_decode.supports(q, cache, 1, 0)
    assert not fp8_decode.supports(q, cache, 2, 0) and not fp8_decode.supports(q, cache, 1, 64)
    assert not fp8_decode.supports(q, cache.to(torch.bfloat16), 1, 0)
    assert not fp8_decode.supports(q[:, :, :64].contiguous(), cache[..., :64].contiguous(), 1, 0)
    assert not fp8_decode.supports(torch.zeros(2, 72, 128, dtype=torch.bfloat16), cache, 1, 0)  # 9 a group
    # Its int32 inputs are checked before anything is compiled or launched: an int64 length would be misread.
    starts = torch.arange(3, dtype=torch.int32)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        fp8_decode.fp8_decode_attention(q, cache, tables, starts, torch.ones(2, dtype=torch.int64), 0.1)


def test_one_tokens_cuda_matmul_takes_what_it_divides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA kernel of one token's linear layers (engine.kernels.token_gemv) takes one 16-bit token on CUDA over
    an e4m3 weight or one of the token's dtype whose rows are whole runs of 32 lanes' 16-byte chunks; its tiles are
    the sweep's (the largest divisor of a lane's chunks where they do not divide); ENGINE_TOKEN_GEMV=triton keeps
    Triton's; anything else is refused."""
    from engine.kernels import token_gemv

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    w8 = torch.zeros(6144, 4096, dtype=torch.float8_e4m3fn)
    assert token_gemv.supports(x, w8, False) and token_gemv.supports(x, torch.zeros(6144, 4096, dtype=torch.bfloat16),
                                                                     True)  # fmt: skip
    assert not token_gemv.supports(torch.zeros(2, 4096, dtype=torch.bfloat16), w8, False)  # two tokens
    assert not token_gemv.supports(x.float(), w8, False)  # float32 activations
    assert not token_gemv.supports(x, torch.zeros(6144, 4096, dtype=torch.float16), False)  # another 16-bit dtype
    assert not token_gemv.supports(x[:, :4000], w8[:, :4000], False)  # rows not whole runs of chunks
    assert token_gemv.tile_for(w8, False) == token_gemv.TokenTile(8, 1, 4)
    assert token_gemv.tile_for(w8, True) == token_gemv.TokenTile(4, 2, 4)
    down = torch.zeros(4096, 12288, dtype=torch.bfloat16)
    assert token_gemv.tile_for(down, False) == token_gemv.TokenTile(8, 1, 8)  # measured for this shape
    assert token_gemv.tile_for(down.to(torch.float8_e4m3fn), False) == token_gemv.TokenTile(8, 1, 4)  # the rules
    monkeypatch.setattr(token_gemv, "SHAPE_TILES", 0)
    assert token_gemv.tile_for(down, False) == token_gemv.TokenTile(4, 1, 8)
    assert token_gemv.tile_for(torch.zeros(4096, 4096, dtype=torch.bfloat16), False) == token_gemv.TokenTile(4, 1, 8)
    assert token_gemv.tile_for(torch.zeros(64, 1536, dtype=torch.bfloat16), False).unroll == 6  # 6 chunks a lane
    assert token_gemv.tile_for(torch.zeros(64, 512, dtype=torch.float8_e4m3fn), False).unroll == 1
    # The A/B knobs of e4m3 tiles: one shape's own (rows, columns), over the rules' for every other.
    monkeypatch.setattr(token_gemv, "E4M3_TILES", {(6144, 4096): (4, 2, 4)})
    assert token_gemv.tile_for(w8, False) == token_gemv.TokenTile(4, 2, 4)
    assert token_gemv.tile_for(w8[:4096], False) == token_gemv.TokenTile(8, 1, 4)
    monkeypatch.setattr(token_gemv, "E4M3_TILE", (16, 1, 8))
    assert token_gemv.tile_for(w8[:4096], False) == token_gemv.TokenTile(16, 1, 8)
    assert token_gemv.tile_for(torch.zeros(64, 1536, dtype=torch.float8_e4m3fn), False).unroll == 3  # 3 chunks a lane
    # The token as float32: e4m3 rows of at most 8,192 columns that stage no run.
    monkeypatch.setattr(token_gemv, "X_F32", 2)
    assert [token_gemv.x_f32_for(k, 1, 0) for k in (4096, 8192, 12288)] == [2, 2, 0]
    assert token_gemv.x_f32_for(4096, 2, 0) == 0 and token_gemv.x_f32_for(4096, 1, 1) == 0
    _cuda_or_triton(monkeypatch, "ENGINE_TOKEN_GEMV", token_gemv.enabled)


def test_the_cuda_norm_takes_what_it_divides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which norms go to the CUDA kernel (``token_norm.supports``): 16-bit rows of whole warps of 16-byte chunks, up
    to MAX_ROWS of them, parts only before a residual add; ENGINE_TOKEN_NORM=triton keeps them on Triton."""
    from engine.kernels import token_norm

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bf = torch.bfloat16
    x, w = torch.zeros(1, 4096, dtype=bf), torch.ones(4096, dtype=bf)
    assert token_norm.supports(x, None, w) and token_norm.supports(x, x, w)
    assert token_norm.supports(torch.zeros(1, 8, 4096, dtype=bf), x, w)  # a MoE layer's experts
    assert token_norm.supports(torch.zeros(1, 2, 4096), x, w)  # a matmul's float32 parts
    assert not token_norm.supports(torch.zeros(1, 8, 4096, dtype=bf), None, w)  # parts need the residual add
    assert not token_norm.supports(x.float(), None, w.float())  # float32 rows
    assert not token_norm.supports(x, None, w.half())  # a weight of another dtype
    assert not token_norm.supports(x[:, :4000], None, w[:4000])  # not whole warps of chunks
    big = torch.zeros(token_norm.MAX_ROWS + 1, 4096, dtype=bf)
    assert not token_norm.supports(big, big, w)  # more rows than a decode step's
    assert [token_norm.vec_for(n) for n in (2048, 4096, 5120, 8192, 4000)] == [1, 1, 2, 2, 0]
    _cuda_or_triton(monkeypatch, "ENGINE_TOKEN_NORM", token_norm.enabled)


@pytest.mark.skipif(DEVICE != "cuda", reason="one token's CUDA matmul is CUDA C++, compiled by NVRTC on the GPU")
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_one_tokens_cuda_matmul_matches_the_float32_product(act: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against float32 F.linear of the (dequantized) weight: 16-bit and e4m3 weights (per-channel scales), a bias,
    SwiGLU of a fused gate/up weight, every tile of a sweep, through gemv's dispatch, and a chain of two launches in
    a CUDA graph under PDL where the second reads what the first wrote."""
    from engine.kernels import token_gemv
    from engine.kernels.gemv import gemv

    g = _g(50)
    for n, k, swiglu in ((48, 512, False), (100, 1024, False), (2 * 72, 2048, True), (4096, 12288, False)):
        w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
        x = torch.randn(1, k, generator=g).to(DEV).to(act)
        bias = None if swiglu else torch.randn(n, generator=g).to(DEV).to(act)
        scale = w.abs().amax(1) / 448
        for weight, sc in ((w.to(act), None), ((w / scale[:, None]).to(torch.float8_e4m3fn), scale.float())):
            deq = weight.float() * (sc[:, None] if sc is not None else 1.0)
            ref = F.linear(x.float(), deq)
            if swiglu:
                gate, up = ref.chunk(2, dim=-1)
                ref = F.silu(gate) * up
            elif bias is not None:
                ref = ref + bias.float()
            assert token_gemv.supports(x, weight, swiglu)
            per_lane = k * weight.element_size() // 512
            tiles = {token_gemv.tile_for(weight, swiglu), token_gemv.TokenTile(8, 1, 4), token_gemv.TokenTile(4, 4, 4)}
            for tile in (t for t in tiles if per_lane % t.unroll == 0):
                got = token_gemv.token_gemv(x, weight, sc, bias, swiglu, torch.empty(1, ref.shape[1], device=DEV,
                                                                                     dtype=act), tile)  # fmt: skip
                torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)
            via = gemv(x, weight, sc, bias, swiglu=swiglu)
            torch.testing.assert_close(via, token_gemv.token_gemv(x, weight, sc, bias, swiglu, torch.empty_like(via)))
    # A chain under PDL: y1 = x W1^T, y2 = y1 W2^T, replayed from a graph with new x; the second launch let in once
    # the first's blocks have left their loop, or first thing (EARLY), its first chunks asked for before its wait or
    # after it (PIN_LOADS).
    w1 = (torch.randn(1024, 1024, generator=g) * 0.05).to(DEV).to(act)
    w2 = (torch.randn(512, 1024, generator=g) * 0.05).to(DEV).to(act)
    for pin, early in ((0, 0), (1, 0), (1, 3)):
        monkeypatch.setattr(token_gemv, "EARLY", early)
        monkeypatch.setattr(token_gemv, "PIN_LOADS", pin)
        x = torch.randn(1, 1024, generator=g).to(DEV).to(act)
        graph, y = _captured(lambda x=x: gemv(gemv(x, w1), w2))
        for _ in range(3):
            x.copy_(torch.randn(1, 1024, generator=g).to(DEV).to(act))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(y, gemv(gemv(x, w1), w2))
            y_ref = F.linear(F.linear(x.float(), w1.float()).to(act).float(), w2.float())  # not under PDL at all
            torch.testing.assert_close(y.float(), y_ref, rtol=0.05, atol=0.05 * y_ref.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="the decode step's CUDA norm is CUDA C++, compiled by NVRTC on the GPU")
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_the_cuda_norm_matches_torch_and_the_triton_kernel(act: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA norm (``token_norm``) against the torch ops and the Triton kernel it replaces: with and without the
    residual add, a MoE layer's 16-bit parts and a matmul's float32 parts, and under PDL in a CUDA graph between two
    matmuls, replayed with new tokens."""
    from engine.kernels import token_norm
    from engine.kernels.gemv import gemv

    g = _g(60)
    ref = ops.TorchOps()
    tol = 2**-7 if act == torch.bfloat16 else 2**-9  # a flipped rounding of y, and of w * y
    for rows, n in ((1, 4096), (3, 2048), (8, 5120)):
        x, r = (torch.randn(rows, n, generator=g).to(DEV).to(act) for _ in range(2))
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV).to(act)
        assert token_norm.supports(x, None, w) and token_norm.supports(x, r, w)
        cases = [x, torch.randn(rows, 8, n, generator=g).to(DEV).to(act), torch.randn(rows, 2, n, generator=g).to(DEV)]
        for xs in cases:
            assert token_norm.supports(xs, r, w)
            got = triton_ops.add_rms_norm(xs, r, w, 1e-6)
            expected = ref.add_rms_norm(xs, r, w, 1e-6)
            exact = 0 if xs.dim() == 2 else 1e-2
            torch.testing.assert_close(got[1], expected[1], rtol=exact, atol=exact)
            torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
            monkeypatch.setenv("ENGINE_TOKEN_NORM", "triton")
            triton_got = triton_ops.add_rms_norm(xs, r, w, 1e-6)
            monkeypatch.delenv("ENGINE_TOKEN_NORM")
            torch.testing.assert_close(got[1], triton_got[1], rtol=0, atol=0)
            torch.testing.assert_close(got[0], triton_got[0], rtol=tol, atol=tol)
        torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
    # Under PDL in a graph: the norm reads what the matmul before wrote, the matmul after reads what the norm wrote.
    w1 = (torch.randn(2048, 1024, generator=g) * 0.05).to(DEV).to(act)
    w2 = (torch.randn(512, 2048, generator=g) * 0.05).to(DEV).to(act)
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).to(DEV).to(act)
    x = torch.randn(1, 1024, generator=g).to(DEV).to(act)
    res = torch.randn(1, 2048, generator=g).to(DEV).to(act)

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        h, r2 = triton_ops.add_rms_norm(gemv(x, w1), res, nw, 1e-6)
        return gemv(h, w2), r2

    graph, (y, r2) = _captured(chain)
    for _ in range(3):
        x.copy_(torch.randn(1, 1024, generator=g).to(DEV).to(act))
        res.copy_(torch.randn(1, 2048, generator=g).to(DEV).to(act))
        graph.replay()
        torch.cuda.synchronize()
        y_eager, r2_eager = chain()
        torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
        torch.testing.assert_close(r2, r2_eager, rtol=0, atol=0)
        # Against torch too: a read that overtook its writer (stale values of the replay before) would pass above,
        # in both the graph and the eager launches, which take part in PDL alike.
        h_ref, r2_ref = ref.add_rms_norm(F.linear(x, w1), res, nw, 1e-6)
        torch.testing.assert_close(r2, r2_ref, rtol=0.05, atol=0.05 * r2_ref.abs().max().item())
        y_ref = F.linear(h_ref, w2)
        torch.testing.assert_close(y, y_ref, rtol=0.05, atol=0.05 * y_ref.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="one token's CUDA matmul is CUDA C++, compiled by NVRTC on the GPU")
def test_the_cuda_matmul_with_the_token_staged_as_float32_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """``X_F32``: e4m3 launches that stage the token as float32 (widened exactly, laid out for the loop's reads) form
    the same products in the same order, so the outputs equal the 16-bit token's bit for bit: bfloat16 and float16,
    K of 1,024 to 8,192 (and 12,288, which keeps 16-bit x), the rules' tiles, SwiGLU, bias, two and four rows a warp,
    unbounded and bounded registers; and replayed from a graph under PDL."""
    from engine.kernels import token_gemv

    g = _g(81)
    seen: list[int] = []
    compiled = token_gemv._kernel

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["xf32"])
        return compiled(*args, **kwargs)

    monkeypatch.setattr(token_gemv, "_kernel", recording)
    cases = [(4096, 96, False, None, False), (4096, 2 * 80, True, None, False), (1024, 64, False, None, True),
             (8192, 64, False, None, False), (12288, 64, False, None, False),
             (4096, 64, False, token_gemv.TokenTile(4, 2, 4), False),
             (2048, 128, False, token_gemv.TokenTile(2, 4, 2), True)]  # fmt: skip
    for act in (torch.bfloat16, torch.float16):
        for k, n, swiglu, tile, with_bias in cases:
            x = (torch.randn(1, k, generator=g) * 3).to(DEV).to(act)
            w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
            scale = w.abs().amax(1) / 448
            weight = (w / scale[:, None]).to(torch.float8_e4m3fn)
            bias = (torch.randn(n, generator=g)).to(DEV).to(act) if with_bias else None
            outs = []
            for mode in (0, 1, 2):
                monkeypatch.setattr(token_gemv, "X_F32", mode)
                out = torch.empty(1, n // 2 if swiglu else n, dtype=act, device=DEV)
                outs.append(token_gemv.token_gemv(x, weight, scale.float(), bias, swiglu, out, tile).clone())
            assert seen[-3:] == ([0, 0, 0] if k > 8192 else [0, 1, 2])
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (act, k, n, swiglu, tile)
    # In a graph under PDL: a float32-x launch after a matmul whose output it reads, and before one that reads its own.
    monkeypatch.setattr(token_gemv, "X_F32", 2)
    act = torch.bfloat16
    ws = []
    for _ in range(2):
        w = (torch.randn(4096, 4096, generator=g) * 0.02).to(DEV)
        scale = w.abs().amax(1) / 448
        ws.append(((w / scale[:, None]).to(torch.float8_e4m3fn), scale.float()))
    x = torch.randn(1, 4096, generator=g).to(DEV).to(act)

    def chain() -> torch.Tensor:
        a = token_gemv.token_gemv(x, *ws[0], None, False, torch.empty(1, 4096, dtype=act, device=DEV))
        return token_gemv.token_gemv(a, *ws[1], None, False, torch.empty(1, 4096, dtype=act, device=DEV))

    graph, y = _captured(chain)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).to(DEV).to(act))
        graph.replay()
        torch.cuda.synchronize()
        w1, w2 = (w.float() * s[:, None] for w, s in ws)
        y_ref = F.linear(F.linear(x.float(), w1).to(act).float(), w2)
        torch.testing.assert_close(y.float(), y_ref, rtol=0.05, atol=0.05 * y_ref.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="one token's CUDA matmul is CUDA C++, compiled by NVRTC on the GPU")
def test_the_cuda_matmul_with_runs_staged_before_the_wait_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """``STAGE_RUNS``: runs of every row staged in shared memory before the wait are the same products summed in the
    same order, so the outputs equal the launch's without them bit for bit: 16-bit and e4m3 weights, K of 4,096,
    5,120 and 12,288, one to three runs, two rows a warp (SwiGLU launches stage none); and replayed from a graph under
    PDL."""
    from engine.kernels import token_gemv

    g = _g(80)
    act = torch.bfloat16

    stages: list[int] = []  # what each launch compiled its kernel with
    compiled = token_gemv._kernel

    def recording(*args: Any, **kwargs: Any) -> Any:
        stages.append(kwargs["stage"])
        return compiled(*args, **kwargs)

    monkeypatch.setattr(token_gemv, "_kernel", recording)

    def both(staged: int, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_gemv``'s output without runs staged, and with as many as the row and the room allow
        (``staged``)."""
        outs = []
        for runs in (0, 8):
            monkeypatch.setattr(token_gemv, "STAGE_RUNS", runs)
            outs.append(token_gemv.token_gemv(*args).clone())
        assert stages[-2:] == [0, staged]
        return outs[0], outs[1]

    # (K, N, SwiGLU, a tile or the rule's, the runs the 16-bit weight's launch stages): one run of Qwen3-8B's o
    # projection's rows, three of 5,120 columns (runs of 5 chunks a lane), two with two rows a warp; none with SwiGLU.
    cases = [(4096, 96, False, None, 1), (4096, 2 * 80, True, None, 0), (12288, 64, False, None, 1),
             (5120, 64, False, None, 3), (4096, 64, False, token_gemv.TokenTile(4, 2, 4), 2)]  # fmt: skip
    for k, n, swiglu, tile, runs16 in cases:
        x = torch.randn(1, k, generator=g).to(DEV).to(act)
        w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
        scale = w.abs().amax(1) / 448
        for weight, sc in ((w.to(act), None), ((w / scale[:, None]).to(torch.float8_e4m3fn), scale.float())):
            out = torch.empty(1, n // 2 if swiglu else n, dtype=act, device=DEV)
            staged = token_gemv.stage_for(k, weight.element_size(), tile or token_gemv.tile_for(weight, swiglu),
                                          swiglu, 8)  # fmt: skip
            assert staged == (runs16 if weight.element_size() == 2 else 0)  # (e4m3 launches stage none: slower)
            plain, got = both(staged, x, weight, sc, None, swiglu, out, tile)
            assert torch.equal(plain, got)
    # In a graph under PDL: a staged launch after a matmul whose output it reads, and before one that reads its own.
    monkeypatch.setattr(token_gemv, "STAGE_RUNS", 8)
    w1, w2 = ((torch.randn(4096, 4096, generator=g) * 0.02).to(DEV).to(act) for _ in range(2))
    x = torch.randn(1, 4096, generator=g).to(DEV).to(act)

    def chain() -> torch.Tensor:
        a = token_gemv.token_gemv(x, w1, None, None, False, torch.empty(1, 4096, dtype=act, device=DEV))
        return token_gemv.token_gemv(a, w2, None, None, False, torch.empty(1, 4096, dtype=act, device=DEV))

    graph, y = _captured(chain)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).to(DEV).to(act))
        graph.replay()
        torch.cuda.synchronize()
        y_ref = F.linear(F.linear(x.float(), w1.float()).to(act).float(), w2.float())
        torch.testing.assert_close(y.float(), y_ref, rtol=0.05, atol=0.05 * y_ref.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="the FP8 decode kernel is CUDA C++, compiled by NVRTC on the GPU")
@pytest.mark.parametrize(
    ("group", "block_size", "dtype"),
    [(4, 16, torch.bfloat16), (8, 32, torch.float16), (1, 16, torch.bfloat16), (6, 16, torch.bfloat16)],
)
def test_the_cuda_fp8_decode_kernel_matches_the_dequantized_reference(group: int, block_size: int,
                                                                       dtype: torch.dtype) -> None:  # fmt: skip
    """The CUDA kernel (engine.kernels.fp8_decode) over an e4m3 cache, at 1 to 8 splits and contexts that end in
    and on tile borders, against float32 attention over the dequantized cache (within Triton's own error there),
    eagerly and replayed from a CUDA graph; paged_attention runs it for such a decode step."""
    from engine.kernels import fp8_decode, nvrtc

    kvh, d = 2, 128
    ctx = [1, 31, 32, 33, 100, 1000, 517, 64]
    blocks_per = [-(-c // block_size) for c in ctx]
    nb = sum(blocks_per) + 3
    g = _g(40)
    cache = (torch.randn(2, nb, kvh, block_size, d, generator=g) * 2).to(DEV).to(torch.float8_e4m3fn)
    perm = torch.randperm(nb, generator=g)[: sum(blocks_per)].to(torch.int32)
    tables = torch.zeros(len(ctx), max(blocks_per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = perm[used : used + n]
        used += n
    tables = tables.to(DEV)
    q = (torch.randn(len(ctx), kvh * group, d, generator=g) * 0.3).to(DEV).to(dtype)
    starts = torch.arange(len(ctx) + 1, dtype=torch.int32, device=DEV)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    ref = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    for s, n in enumerate(ctx):
        slots = torch.arange(n, device=DEV)
        blk = tables[s, slots // block_size].long()
        k, v = cache[0, blk, :, slots % block_size].float(), cache[1, blk, :, slots % block_size].float()
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", q[s].float().view(kvh, group, d), k) * d**-0.5, -1)
        ref[s] = torch.einsum("hgn,nhd->hgd", w, v).reshape(-1, d)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3  # the output's rounding (values up to about 6)
    for splits in (1, 3, 8):
        got = fp8_decode.fp8_decode_attention(q, cache, tables, starts, lens, d**-0.5, splits)
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    assert fp8_decode.supports(q, cache, 1, 0) and nvrtc.available()
    via = triton_ops.paged_attention(q, cache, tables, starts, lens, d**-0.5, 1, max(ctx), num_splits=4)
    torch.testing.assert_close(via, fp8_decode.fp8_decode_attention(q, cache, tables, starts, lens, d**-0.5, 4))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured = fp8_decode.fp8_decode_attention(q, cache, tables, starts, lens, d**-0.5, 3)
    q.mul_(-1)  # new queries, read by the replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, fp8_decode.fp8_decode_attention(q, cache, tables, starts, lens, d**-0.5, 3))


@pytest.mark.skipif(DEVICE != "cuda", reason="the FP8 decode kernel is CUDA C++, compiled by NVRTC on the GPU")
def test_an_fp8_cache_engine_decodes_alike_on_the_cuda_and_the_triton_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 Qwen3 of head size 128 over an FP8 cache, through CUDA graphs: the same greedy tokens, and
    logprobs within 0.05, whether its decode attention runs on the CUDA kernel or on Triton's."""
    import transformers

    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sequence import SequenceStatus
    from tests.engine.test_model_families import COMMON, PROMPTS, write_tokenizer

    torch.manual_seed(1234)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**COMMON, "head_dim": 128}))
    model.save_pretrained(str(tmp_path))
    write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    runs = []
    for mode in ("cuda", "triton"):
        monkeypatch.setenv("ENGINE_FP8_ATTENTION", mode)
        args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="bfloat16", kv_cache_dtype="fp8",
                          num_kvcache_blocks=64, block_size=16, max_model_len=256,
                          cudagraph_capture_sizes=(1, 2, 4))  # fmt: skip
        engine = LLMEngine(args, loaded=loaded)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
        seqs = [engine.add_request(p, engine.check_request(len(p), params, True)) for p in PROMPTS]
        while any(s.status is not SequenceStatus.FINISHED for s in seqs):
            assert engine.step()
        runs.append([(s.completion_ids, [lp.logprob for lp in s.logprobs]) for s in seqs])
    for (ids, lps), (ref_ids, ref_lps) in zip(*runs, strict=True):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 0.05


def test_a_tuning_runs_decode_tiles_override_the_measured_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENGINE_DECODE_TILES (JSON) replaces fields of the measured decode tiles (the programs an SM holds, and with
    them a step's splits, included); anything else is refused by name, and a register cap reaches the launch (the
    same attention)."""
    monkeypatch.setenv("ENGINE_DECODE_TILES", '{"fp8": {"max_registers": 128, "unmasked": false}}')
    assert kernels.decode_tile(True) == kernels.DecodeTile(32, 1, 3, max_registers=128)
    assert kernels.decode_tile(False) == kernels.DECODE_TILES[False]
    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    monkeypatch.setenv("ENGINE_FP8_ATTENTION", "triton")
    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("ENGINE_DECODE_TILES", '{"bf16": {"programs_per_sm": 4}}')
    assert kernels.decode_splits(64, 8, 544, gpu) == 1 and kernels.decode_splits(64, 8, 544, gpu, fp8=True) == 2
    for bad in ('{"fp8": {"regs": 128}}', '{"int8": {}}', "[1]", "fp8=128"):
        monkeypatch.setenv("ENGINE_DECODE_TILES", bad)
        with pytest.raises(ValueError, match="ENGINE_DECODE_TILES must be a JSON object"):
            kernels.decode_tile(True)
    monkeypatch.delenv("ENGINE_DECODE_TILES")
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(24)).to(DEV)
    ctx = [70, 5, 33, 200]
    tables, context = _tables(ctx), torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(4, H, D, generator=_g(25)).to(DEV)
    args = (q, cache, tables, torch.arange(5, dtype=torch.int32, device=DEV), context, D**-0.5, 1, max(ctx))
    capped = triton_ops.paged_attention(*args, num_splits=2, max_registers=128)
    torch.testing.assert_close(capped, triton_ops.paged_attention(*args, num_splits=2), atol=2e-5, rtol=1e-4)


def test_decode_splits_are_sized_from_each_sequences_own_context() -> None:
    """Split decode divides each sequence's keys (its window's, with a sliding window) among the splits, whatever
    bound sized the launch (a graph's is the longest context): the same output as one program per sequence."""
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(16)).to(DEV)
    ctx = [70, 5, 33, 200]
    tables, context = _tables(ctx), torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(4, H, D, generator=_g(17)).to(DEV)
    starts = torch.arange(5, dtype=torch.int32, device=DEV)
    for window in (0, 40):
        whole = triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, 1, 640, window=window)
        for splits in (2, 5, 10):
            got = triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, 1, 640, num_splits=splits,
                                             window=window)  # fmt: skip
            torch.testing.assert_close(got, whole, atol=2e-5, rtol=1e-4)
        if window:
            # Against attention over the window's keys alone.
            for i, c in enumerate(ctx):
                lo = max(0, c - window)
                k, v = gather_kv(cache, tables[i].long(), c, q.dtype)
                ref = F.scaled_dot_product_attention(
                    q[i : i + 1].transpose(0, 1), k[:, lo:], v[:, lo:], enable_gqa=True
                )
                torch.testing.assert_close(whole[i : i + 1], ref.transpose(0, 1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_an_fp8_cache_widened_in_registers_reads_every_e4m3_value_exactly(splits: int) -> None:
    """V tiles of an e4m3 cache widened to fp16 four bytes a word (``v_regs``, the default on such a cache) give
    what Triton's own widening gives, bit for bit, with every finite e4m3 byte among the values; both agree with
    attention over the dequantized cache. (Under Triton's interpreter the widening is bit arithmetic, the same
    values the PTX conversion gives on a GPU.)"""
    g = _g(20)
    byte_values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    v_bytes = byte_values[torch.randint(len(byte_values), (NB * KVH * BS * D,), generator=g)]
    cache = torch.empty(2, NB, KVH, BS, D, dtype=torch.float8_e4m3fn)
    cache[0] = (torch.randn(NB, KVH, BS, D, generator=g) * 2).to(torch.float8_e4m3fn)
    cache[1] = v_bytes.view(torch.float8_e4m3fn).view(NB, KVH, BS, D)
    cache = cache.to(DEV)
    ctx = [70, 5, 33, 200]
    tables, context = _tables(ctx), torch.tensor(ctx, dtype=torch.int32, device=DEV)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter has no bf16 dot
    q = torch.randn(4, H, D, generator=_g(21)).to(DEV, dtype)
    starts = torch.arange(5, dtype=torch.int32, device=DEV)
    got = [triton_ops.paged_attention(q, cache, tables, starts, context, D**-0.5, 1, max(ctx), num_splits=splits,
                                      block_n=32, num_warps=1, v_regs=v_regs, unmasked=True, lazy_rescale=False)
           for v_regs in (True, False)]  # fmt: skip
    assert torch.equal(got[0], got[1])
    wide = cache.float()
    for i in range(4):
        ref = _reference(q[i : i + 1].float(), wide, tables[i], ctx[i])
        torch.testing.assert_close(got[0][i : i + 1].float(), ref, atol=0.5, rtol=2e-2)
    with pytest.raises(ValueError, match="v_regs widens an e4m3 cache"):
        triton_ops.paged_attention(q, wide.to(dtype), tables, starts, context, D**-0.5, 1, max(ctx), v_regs=True)


@pytest.mark.timeout(60)
def test_kernels_address_the_cache_through_its_strides() -> None:
    """The engine's cache is head-major; a slot-major one seen through a permuted view (what the device bench
    compares it with) is written and read the same, value for value."""
    n = 5
    qkv = torch.randn(n, (H + 2 * KVH) * D, generator=_g(12)).to(DEV)
    pos = torch.tensor([0, 1, 2, 40, 41], device=DEV)
    cos, sin = torch.randn(64, D, generator=_g(13)).to(DEV), torch.randn(64, D, generator=_g(14)).to(DEV)
    slots = torch.tensor([16, 17, 18, 100, 101], device=DEV)
    head_major = torch.randn(2, NB, KVH, BS, D, generator=_g(15)).to(DEV)
    slot_major = head_major.transpose(2, 3).contiguous()  # [2, NB, BS, KVH, D]
    view = slot_major.transpose(2, 3)
    q = triton_ops.rope_and_store(qkv, pos.int(), cos, sin, head_major, slots.int(), H, KVH, D)
    triton_ops.rope_and_store(qkv, pos.int(), cos, sin, view, slots.int(), H, KVH, D)
    assert torch.equal(view, head_major)
    tables = _tables([60, 102])
    context = torch.tensor([60, 102], dtype=torch.int32, device=DEV)
    mixed = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEV)  # a decode, then a sequence's two query rows
    decodes = torch.arange(3, dtype=torch.int32, device=DEV)
    for rows, starts, q_len, splits in ((3, mixed, 2, 1), (2, decodes, 1, 2)):
        got = [triton_ops.paged_attention(q[:rows], cache, tables, starts, context, D**-0.5, q_len, 102,
                                          num_splits=splits) for cache in (head_major, view)]  # fmt: skip
        assert torch.equal(got[0], got[1])


def test_sparse_selection_as_a_block_table_equals_the_gathering_path() -> None:
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(9)).to(DEV)
    indexer = torch.zeros(NB, KVH, D, device=DEV)
    MeanKeyIndexer().update(indexer, cache, torch.arange(NB * BS, device=DEV))
    ctx = [300, 40, 161]  # 19 blocks, 3 blocks (short: all kept), 11 blocks
    tables = _tables(ctx)
    context = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(3, H, D, generator=_g(10)).to(DEV)
    topk = 4
    sel, lens = select_blocks_paged(q, indexer, tables, context, BS, topk)
    assert sel.shape == (3, topk + 2)
    starts = torch.arange(4, dtype=torch.int32, device=DEV)
    out = triton_ops.paged_attention(q, cache, sel, starts, lens, D**-0.5, 1, sel.shape[1] * BS, num_splits=2)
    ref = sparse_decode(q, cache, indexer, tables.long(), context.long(), D**-0.5, topk, q.dtype)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_indexer_decode_update_equals_the_general_one() -> None:
    cache = torch.randn(2, NB, KVH, BS, D, generator=_g(11)).to(DEV)
    a = torch.zeros(NB, KVH, D, device=DEV)
    b = torch.zeros(NB, KVH, D, device=DEV)
    slots = torch.tensor([5, 16 * 3 + 15, 16 * 9], device=DEV)  # one token in each of three blocks
    MeanKeyIndexer().update(a, cache, slots)
    MeanKeyIndexer().update_decode(b, cache, slots.int())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# The fourth prompt shares the first's blocks: it runs the cached-prefix path. (Kept short: on CPU the
# kernels run in Triton's interpreter.)
PROMPTS = [list(range(40, 60)), [7] * 3, list(range(50, 90)), [*list(range(40, 60)), 9, 8, 7]]


# The families' checks: shorter prompts, still crossing blocks of 4 and Mistral's 7-token window (the interpreter runs
# one program per token for RoPE and the norms, so prompt tokens are most of these tests' time).
FAMILY_PROMPTS = [list(range(40, 60)), [7] * 3, list(range(50, 66)), [*list(range(40, 60)), 9, 8, 7]]


def _generate(
    make_engine: MakeEngine, loaded: LoadedModel | None = None, prompts: list[list[int]] = PROMPTS, **kw: object
) -> list[list[int]]:
    # Few seats: a mixed-step graph pads its attention grid to one program per seat at least.
    engine = make_engine(loaded, **{"max_num_seqs": 8, **kw})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return engine.generate(prompts, params)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_num_batched_tokens": 24},  # chunked prompts mixed with decodes
        {"sparse_attention": True, "sparse_topk_blocks": 2, "block_size": 4},
        # K/V stored as float8_e4m3fn (unit scale) and read back by the kernels. CUDA only: Triton 3.6's
        # interpreter rounds float32 -> float8 wrongly where rounding carries into the exponent (1.96 -> 1.0).
        pytest.param(
            {"kv_cache_dtype": "fp8"},
            marks=pytest.mark.skipif(
                DEVICE != "cuda", reason="Triton's interpreter converts float32 to float8 wrongly; checked on CUDA"
            ),
        ),
    ],
    ids=["plain", "chunked", "sparse", "fp8-kv"],
)
def test_an_engine_on_the_kernels_generates_what_the_torch_engine_does(make_engine: MakeEngine,
                                                                       extra: dict[str, object]) -> None:  # fmt: skip
    expected = _generate(make_engine, kernels="torch", **extra)
    assert _generate(make_engine, kernels="triton", enforce_eager=True, **extra) == expected
    # Through the graphs' static inputs: replayed CUDA graphs on a GPU; on CPU the interpreter runs the
    # staged inputs eagerly, which checks the staging (padding, tile maps, logits rows) all the same.
    assert _generate(make_engine, kernels="triton", **extra) == expected


@pytest.mark.parametrize("family", ["qwen3", "mistral-window", "qwen3-moe"])
def test_family_variants_on_the_kernels(make_engine: MakeEngine, family: str, tmp_path: Path) -> None:
    """Per-head Q/K norms (Qwen3), sliding windows across blocks (Mistral), the fused MoE kernel: the
    kernels generate what the torch reference does, eager and through the graphs' staged inputs."""
    from tests.engine.test_model_families import checkpoint

    checkpoint(family, tmp_path)
    loaded = load_model(str(tmp_path))
    kw: dict[str, object] = {"block_size": 4, "max_model_len": 256, "prompts": FAMILY_PROMPTS}
    expected = _generate(make_engine, loaded, kernels="torch", **kw)
    assert _generate(make_engine, loaded, kernels="triton", enforce_eager=True, **kw) == expected
    assert _generate(make_engine, loaded, kernels="triton", **kw) == expected


@pytest.mark.parametrize(("family", "rope"), [("smollm2", 0), ("qwen3", 1)])
def test_rope_in_the_attention_kernel_or_before_it_generates_what_the_torch_engine_does(
    make_engine: MakeEngine, family: str, rope: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a decode step's rotary positions and K/V store in the rope kernel before its attention launch (the
    embedded model: GQA groups of 3) or in that launch (``ROPE_IN_ATTENTION``; Qwen3: per-head norms), the engine
    generates what the torch reference does, eager and through the graphs' staged inputs."""
    from tests.engine.test_model_families import checkpoint

    monkeypatch.setattr(triton_ops, "ROPE_IN_ATTENTION", rope)
    loaded = None
    kw: dict[str, object] = {}
    if family != "smollm2":
        checkpoint(family, tmp_path)
        loaded = load_model(str(tmp_path))
        kw = {"block_size": 4, "max_model_len": 256, "prompts": FAMILY_PROMPTS}
    expected = _generate(make_engine, loaded, kernels="torch", **kw)
    assert _generate(make_engine, loaded, kernels="triton", enforce_eager=True, **kw) == expected
    assert _generate(make_engine, loaded, kernels="triton", **kw) == expected


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_in_bfloat16(make_engine: MakeEngine) -> None:
    # The same kernels, replayed from graphs or launched one by one: the same tokens, at batch sizes
    # that hit a bucket exactly and ones that are padded up to the next.
    sizes = {"cudagraph_capture_sizes": (1, 2, 4, 8)}
    for extra in ({}, {"sparse_attention": True, "sparse_topk_blocks": 2, "block_size": 4}):
        eager = _generate(make_engine, kernels="triton", dtype="bfloat16", enforce_eager=True, **extra)
        assert _generate(make_engine, kernels="triton", dtype="bfloat16", **sizes, **extra) == eager


def _generate_with_features(make_engine: MakeEngine, **kw: object) -> list[tuple[list[int], list[float]]]:
    """Each prompt with other sampler features: seeded top-k/top-p with a penalty, logit_bias, min_tokens
    and a stop token, a grammar; tokens and logprobs."""
    from engine.protocol import GrammarSpec
    from engine.structured import GrammarCompiler

    engine = make_engine(None, **{"max_num_seqs": 8, **kw})
    params = [
        SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            seed=3,
            frequency_penalty=0.5,
            max_tokens=6,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(
            temperature=0.0, logit_bias=((65, 5.0),), presence_penalty=1.0, max_tokens=6, ignore_eos=True, logprobs=0
        ),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,), max_tokens=6, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1),
    ]
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    grammar = compiler.state_of(compiler.compile(GrammarSpec("regex", "[a-c]{4}")))
    seqs = [
        engine.add_request(p, engine.check_request(len(p), sp, True), grammar=grammar if i == 3 else None)
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    while any(s.status.value != "finished" for s in seqs):
        engine.step()
    return [(s.completion_ids, [lp.logprob for lp in s.logprobs]) for s in seqs]


def test_sampler_features_on_the_kernels_and_graphs(make_engine: MakeEngine) -> None:
    require("xgrammar", "make install puts it in")
    expected = _generate_with_features(make_engine, kernels="torch")
    assert set(expected[3][0][:4]) <= set(b"abc") and all(t in (256, 258) for t in expected[3][0][4:])  # then EOS
    for extra in ({"enforce_eager": True}, {}):  # eagerly, then through the graphs' staged inputs
        got = _generate_with_features(make_engine, kernels="triton", **extra)
        assert [g[0] for g in got] == [e[0] for e in expected]
        for (_, lps), (_, want) in zip(got, expected, strict=True):
            assert lps == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("tokens", [1, 3])
def test_skinny_matmul_parts_along_k_sum_to_the_product(tokens: int) -> None:
    from engine.kernels import triton_ops
    from engine.kernels.gemv import GemvConfig, gemv, split_rule
    from engine.models.quant import quantize_per_channel

    # A narrow weight cut along K: float32 parts [tokens, parts, N], bias in the first, which the next residual add
    # + RMSNorm sums in float32 and rounds once, as it sums a MoE layer's experts. N = 72: a masked row tile.
    dt, x, w, b = _skinny_case(tokens, 256)
    cfg = GemvConfig(16, 64, 4, 2)
    ref = F.linear(x.float(), w.float(), b.float())
    for parts in (2, 4):
        got = gemv(x, w, bias=b, config=cfg, parts=parts)
        assert got.shape == (tokens, parts, 72) and got.dtype == torch.float32
        torch.testing.assert_close(got.sum(dim=1), ref, rtol=1e-3, atol=1e-3)
    q, scale = quantize_per_channel(w.float())
    got = gemv(x, q, scale, config=cfg, parts=2)
    torch.testing.assert_close(got.sum(dim=1), F.linear(x.float(), q.float() * scale[:, None]), rtol=1e-3, atol=1e-3)
    # The residual add sums the parts and rounds once to the residual's dtype.
    parts = gemv(x, w, bias=b, config=cfg, parts=2)
    residual = torch.randn(tokens, 72, generator=_g(4)).to(DEV, dt)
    norm_w = torch.randn(72, generator=_g(5)).to(DEV, dt)
    out, res = triton_ops.add_rms_norm(parts, residual, norm_w, 1e-6)
    want_res = (residual.float() + parts.sum(dim=1).to(dt).float()).to(dt)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    assert out.dtype == dt and res.dtype == dt
    with pytest.raises(ValueError, match="do not make 3 runs"):
        gemv(x, w, config=cfg, parts=3)  # 256 columns: 4 slices of 64 cannot make 3 runs
    with pytest.raises(ValueError, match="parts are for the tensor-core kernel"):
        gemv(x, w, config=cfg, parts=2, swiglu=True)
    # The rule: split while the programs fit the SMs once and K cuts into whole slices, at most MAX_PARTS.
    assert split_rule(64, 132, 4096, 512) == 2  # Qwen3-30B-A3B's o projection on an H200
    assert split_rule(128, 132, 4096, 512) == 1  # Qwen3-8B's: already fills the SMs
    assert split_rule(16, 132, 4096, 512) == 4  # MAX_PARTS
    assert split_rule(18, 132, 576, 512) == 1  # K of one slice and a bit: no whole runs
