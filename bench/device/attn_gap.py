"""Why decode attention over an FP8 cache runs slower in the engine than alone (issue #29, FP8 KV at 1.3x bf16).

Alone (``fp8_tune.py --only splits``) the FP8 kernel takes about 320-336 us a layer at batch 256 with 2K contexts;
the engine's batch-256 step implies about 360. This times the engine's decode attention (its tile, one split, as the
engine launches it at that batch) under each way the engine's step differs from the bench, one at a time, bf16 and
FP8 alike:

- ``even``: every context exactly 2,048 keys, blocks scattered at random over a pool just large enough (the bench);
- ``ragged``: contexts of 2,049 to 2,098 keys (the engine's step after its prompts), so each ends in a partial tile;
- ``in-order``: blocks handed out as the engine's block manager does (a sequence's prompt blocks consecutive, its
  decode block from after every prompt), in a pool three times larger;
- ``engine``: ragged and in order;
- ``masked``, ``lazy``: the engine case with FP8's masks on every tile (the loop before round seven), or with the
  lazy rescale (bf16's own tile has both);
- ``after-gemm``: the even case, each call preceded by a batch-256 matmul of the MLP's shape, timed as the
  difference from the matmuls alone (a warm, power-hungry neighbour, as in the step).

    python3 bench/device/attn_gap.py --json $OUT/attn-gap.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from typing import Any

import torch

from bench.device.fp8_tune import BLOCK_SIZE, HBM, HEAD_DIM, HEADS, KV_HEADS, graph_time
from engine.attention import kv_cache_shape
from engine.kernels import decode_splits
from engine.kernels.triton_ops import paged_attention

SEQS, CTX = 256, 2048


def _tables(ctx: torch.Tensor, in_order: bool, pool: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables of sequences with ``ctx`` keys each: in the block manager's order (a sequence's prompt blocks
    consecutive, the blocks past CTX keys from after every prompt's) or scattered at random over ``pool`` blocks."""
    seqs = ctx.shape[0]
    blocks = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    tables = torch.zeros(seqs, int(blocks.max()), dtype=torch.int32)
    if in_order:
        prompt = CTX // BLOCK_SIZE
        tail = seqs * prompt
        for s in range(seqs):
            tables[s, :prompt] = torch.arange(s * prompt, (s + 1) * prompt, dtype=torch.int32)
            extra = int(blocks[s]) - prompt
            tables[s, prompt : prompt + extra] = torch.arange(tail, tail + extra, dtype=torch.int32)
            tail += extra
    else:
        perm = torch.randperm(pool, generator=gen, dtype=torch.int64).to(torch.int32)
        used = 0
        for s in range(seqs):
            n = int(blocks[s])
            tables[s, :n] = perm[used : used + n]
            used += n
    return tables


def _cache(pool: int, dtype: str) -> torch.Tensor:
    """A random head-major cache of ``pool`` blocks, bf16 or FP8 (e4m3) on the GPU."""
    torch.cuda.empty_cache()
    c = torch.randn(kv_cache_shape(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16)
    return c if dtype == "bf16" else c.to(torch.float8_e4m3fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    even = torch.full((SEQS,), CTX, dtype=torch.int32)
    ragged = torch.randint(CTX + 1, CTX + 51, (SEQS,), generator=gen, dtype=torch.int32)
    need = SEQS * (CTX // BLOCK_SIZE + 4)
    cases: dict[str, tuple[torch.Tensor, bool, int, dict[str, Any]]] = {
        "even": (even, False, need, {}),
        "ragged": (ragged, False, need, {}),
        "in-order": (even, True, 3 * need, {}),
        "engine": (ragged, True, 3 * need, {}),
        "masked": (ragged, True, 3 * need, {"unmasked": False}),
        "lazy": (ragged, True, 3 * need, {"lazy_rescale": True}),
    }
    q = torch.randn(SEQS, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    qstart = torch.arange(SEQS + 1, device=dev, dtype=torch.int32)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "runs": {}}
    for name, (ctx, in_order, pool, extra) in cases.items():
        tables = _tables(ctx, in_order, pool, gen).to(dev)
        lens = ctx.to(dev)
        keys = int(ctx.sum())
        # The loop's variants (masks, rescale) are FP8's: bf16's own tile is masked and lazy.
        for dtype in ("fp8",) if extra else ("bf16", "fp8"):
            cache = _cache(pool, dtype)
            fp8 = dtype == "fp8"
            splits = decode_splits(SEQS, KV_HEADS, int(ctx.max()), dev, fp8=fp8)
            run = partial(paged_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, 1, int(ctx.max()) + 64,
                          splits, **extra)  # fmt: skip
            t = min(graph_time([run] * 4, rounds=5) for _ in range(3))
            nbytes = keys * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
            r = {"us": t * 1e6, "pct_hbm": 100 * nbytes / t / HBM, "splits": splits}
            out["runs"][f"{name} {dtype}"] = r
            print("attention", name, dtype, {k: round(v, 1) for k, v in r.items()}, flush=True)
            del cache, run
    # A power-hungry neighbour: the MLP's gate/up matmul at 256 tokens before each call.
    x = torch.randn(SEQS, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(24576, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    tables = _tables(even, False, need, gen).to(dev)
    lens = even.to(dev)
    for dtype in ("bf16", "fp8"):
        cache = _cache(need, dtype)
        splits = decode_splits(SEQS, KV_HEADS, CTX, dev, fp8=dtype == "fp8")
        attn = partial(paged_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, 1, CTX + 64, splits)

        def both(attn: partial[torch.Tensor] = attn) -> None:
            torch.matmul(x, w.t())
            attn()

        def gemm() -> None:
            torch.matmul(x, w.t())

        tb = min(graph_time([both] * 8, rounds=5) for _ in range(3))
        tg = min(graph_time([gemm] * 8, rounds=5) for _ in range(3))
        ta = min(graph_time([attn] * 8, rounds=5) for _ in range(3))
        r = {"us": (tb - tg) * 1e6, "gemm_us": tg * 1e6, "alone_us": ta * 1e6}
        out["runs"][f"after-gemm {dtype}"] = r
        print("attention after-gemm", dtype, {k: round(v, 1) for k, v in r.items()}, flush=True)
        del cache, attn, both
    # Waves: how the time grows with the batch at one split (programs = batch x 8 KV heads; eight of either dtype's
    # fit on an SM): a partial last wave costs a whole one if a program's time is its own latency.
    for seqs in (132, 165, 200, 232, 256, 300, 330):
        lens = torch.full((seqs,), CTX, dtype=torch.int32)
        tab = _tables(lens, False, seqs * (CTX // BLOCK_SIZE), gen).to(dev)
        qs = torch.randn(seqs, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        qst = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
        for dtype in ("bf16", "fp8"):
            cache = _cache(seqs * (CTX // BLOCK_SIZE), dtype)
            run = partial(paged_attention, qs, cache, tab, qst, lens.to(dev), HEAD_DIM**-0.5, 1, CTX, 1)
            t = min(graph_time([run] * 4, rounds=5) for _ in range(3))
            r = {"us": t * 1e6, "us_per_256": t * 1e6 * 256 / seqs, "programs": seqs * KV_HEADS}
            out.setdefault("waves", {})[f"{seqs} {dtype}"] = r
            print("waves", seqs, dtype, {k: round(v, 1) for k, v in r.items()}, flush=True)
            del cache, run
    runs = out["runs"]
    out["fp8_over_bf16"] = {c: runs[f"{c} bf16"]["us"] / runs[f"{c} fp8"]["us"] for c in
                            ("even", "ragged", "in-order", "engine", "after-gemm")}  # fmt: skip
    print("bf16 time over FP8 time:", {k: round(v, 3) for k, v in out["fp8_over_bf16"].items()}, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
