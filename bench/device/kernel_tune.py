"""Decode kernels on the H200, timed inside CUDA graphs (as the engine replays them), against cuBLAS.

1. Skinny matmuls (engine.kernels.gemv) on the linear layers of qwen3-8b at 1 and 16 tokens: bf16 weights
   against ``F.linear`` (cuBLAS), FP8 weights against the engine's FP8 x FP8 ``_scaled_mm`` path, over a sweep
   of tiles; GB/s of weight read and the share of 4.8 TB/s.
2. Decode attention at batch 256, 2K context (qwen3-8b heads): bf16 cache against FP8 cache, over tiles.

    python3 bench/device/kernel_tune.py --json $OUT/kernel-tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels import decode_splits
from engine.kernels.gemv import GemvConfig, gemv
from engine.kernels.triton_ops import paged_attention, silu_and_mul
from engine.models.quant import Fp8Linear

HBM = 4.8e12
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}  # fmt: skip


def graph_time(fn: Callable[[], object], reps: int = 20, rounds: int = 5) -> float:
    """Seconds per call of ``fn`` replayed ``reps`` times in one CUDA graph (median of ``rounds``)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(float(a.elapsed_time(b)) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def tune_gemv(out: dict[str, Any]) -> None:
    dev = torch.device("cuda")
    configs = [GemvConfig(bn, bk, w, st) for bn, bk, w, st in
               itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4))]  # fmt: skip
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        fp8 = Fp8Linear(k, n).to(dev)
        fp8.load_rows(0, w)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row: dict[str, Any] = {}
            t = graph_time(partial(F.linear, x, w))
            row["cublas_bf16_us"] = t * 1e6
            row["cublas_bf16_pct_hbm"] = 100 * n * k * 2 / t / HBM
            if name == "gate_up":
                t = graph_time(partial(lambda x, w: silu_and_mul(F.linear(x, w)), x, w))
                row["cublas_bf16_plus_silu_us"] = t * 1e6
            t = graph_time(partial(fp8, x))
            row["scaled_mm_fp8_us"] = t * 1e6
            for wdt, weight, scale in (("bf16", w, None), ("fp8", fp8.weight, fp8.weight_scale)):
                ref = F.linear(x, w).float()
                best: tuple[float, GemvConfig | None] = (math.inf, None)
                for cfg in configs:
                    if name == "lm_head" and cfg.block_n < 32:
                        continue
                    try:
                        y = gemv(x, weight, scale, config=cfg)
                        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                        if err > 0.05:
                            raise RuntimeError(f"wrong result (relative error {err:.3f})")
                        t = graph_time(partial(gemv, x, weight, scale, config=cfg), reps=10, rounds=3)
                    except Exception as e:  # a tile that does not compile (shared memory) is skipped
                        row.setdefault("failed", []).append(f"{wdt} {cfg}: {type(e).__name__} {str(e)[:80]}")
                        continue
                    best = min(best, (t, cfg), key=lambda p: p[0])
                t, chosen = best
                row[f"gemv_{wdt}_us"] = t * 1e6
                row[f"gemv_{wdt}_cfg"] = str(chosen)
                row[f"gemv_{wdt}_pct_hbm"] = 100 * n * k * weight.element_size() / t / HBM
                if name == "gate_up" and chosen is not None:
                    t = graph_time(partial(gemv, x, weight, scale, swiglu=True, config=chosen))
                    row[f"gemv_{wdt}_swiglu_us"] = t * 1e6
            row.pop("failed", None) if len(row.get("failed", [])) < 5 else None
            print(name, m, {k2: (round(v, 1) if isinstance(v, float) else v) for k2, v in row.items()
                            if k2 != "failed"}, flush=True)  # fmt: skip
            out.setdefault("gemv", {}).setdefault(name, {})[str(m)] = row


def tune_attention(out: dict[str, Any]) -> None:
    dev = torch.device("cuda")
    seqs, ctx, heads, kvh, d, bs = 256, 2048, 32, 8, 128, 16
    blocks_per = ctx // bs
    num_blocks = seqs * blocks_per + 1
    tables = torch.randperm(num_blocks - 1, device=dev, dtype=torch.int32)[: seqs * blocks_per].view(seqs, -1)
    qstart = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(seqs, heads, d, device=dev, dtype=torch.bfloat16)
    cache16 = torch.randn(2, num_blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    cache8 = cache16.to(torch.float8_e4m3fn)
    splits = decode_splits(seqs, kvh, ctx, dev)
    kv_bytes = seqs * ctx * kvh * d * 2
    res: dict[str, Any] = {"splits": splits}
    ref = paged_attention(q, cache8.to(torch.bfloat16), tables, qstart, lens, d**-0.5, 1, ctx, splits).float()
    for name, cache in (("bf16", cache16), ("fp8", cache8)):
        best = (math.inf, "")
        for bn, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
            try:

                def run(bn: int = bn, warps: int = warps, stages: int = stages, cache: torch.Tensor = cache) -> Any:
                    return paged_attention(q, cache, tables, qstart, lens, d**-0.5, 1, ctx, splits, block_n=bn,
                                           num_warps=warps, num_stages=stages)  # fmt: skip

                if name == "fp8":
                    err = (run().float() - ref).abs().max().item()
                    if err > 0.05:
                        raise RuntimeError(f"wrong result ({err:.3f})")
                t = graph_time(run, reps=5, rounds=3)
            except Exception as e:
                print("attention", name, bn, warps, stages, type(e).__name__, str(e)[:80])
                continue
            best = min(best, (t, f"block_n={bn} warps={warps} stages={stages}"), key=lambda p: p[0])
        t, cfg = best
        res[name] = {"us": t * 1e6, "cfg": cfg, "pct_hbm": 100 * kv_bytes * cache.element_size() / t / HBM}
        t = graph_time(partial(paged_attention, q, cache, tables, qstart, lens, d**-0.5, 1, ctx, splits))
        res[name]["default_us"] = t * 1e6
        print("attention", name, res[name], flush=True)
    out["attention_b256_ctx2048"] = res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--only", choices=("gemv", "attention"), default=None)
    a = ap.parse_args()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    if a.only in (None, "attention"):
        tune_attention(out)
    if a.only in (None, "gemv"):
        tune_gemv(out)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
