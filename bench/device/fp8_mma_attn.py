"""FP8 decode attention in CUDA C++ (``engine/kernels/fp8_decode.cu``) against the Triton kernel, alone (issue #29).

For each decode case (qwen3-8b's heads, 2K contexts at batch 256 as the FP8-KV target's, and smaller batches with
longer contexts): both kernels' outputs against a float32 reference on the dequantized cache, then each one's time
in a CUDA graph (``fp8_tune.graph_time``) at the engine's split count and, for the CUDA kernel, at other splits and
launch bounds. bf16 attention over a bf16 cache of the same case is timed alongside for the ratio the target asks.

    python3 bench/device/fp8_mma_attn.py --json $OUT/fp8-mma-attn.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from typing import Any

import torch

from bench.device.attn_gap import _cache, _tables
from bench.device.fp8_tune import BLOCK_SIZE, HBM, HEAD_DIM, HEADS, KV_HEADS, environ, graph_time
from engine.kernels import decode_splits
from engine.kernels.fp8_decode import fp8_decode_attention
from engine.kernels.triton_ops import paged_attention

CASES = {"8x1000": (8, 1000), "64x544": (64, 544), "1x4K": (1, 4096), "16x8K": (16, 8192), "256x2K": (256, 2048),
         "256x2K ragged": (256, -2048)}  # fmt: skip


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """float32 attention of each sequence's query over its dequantized keys and values."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = HEADS // KV_HEADS
    for s in range(q.shape[0]):
        n = int(lens[s])
        slots = torch.arange(n, device=q.device)
        blk = tables[s, slots // BLOCK_SIZE].long()
        k = cache[0, blk, :, slots % BLOCK_SIZE].float()  # [n, KVH, D]
        v = cache[1, blk, :, slots % BLOCK_SIZE].float()
        qs = q[s].float().view(KV_HEADS, group, HEAD_DIM)
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qs, k) * HEAD_DIM**-0.5, -1)
        out[s] = torch.einsum("hgn,nhd->hgd", w, v).reshape(HEADS, HEAD_DIM)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "cases": {}}
    for name in a.cases.split(","):
        seqs, ctx = CASES[name]
        if ctx < 0:
            lens_h = torch.randint(-ctx + 1, -ctx + 51, (seqs,), generator=gen, dtype=torch.int32)
        else:
            lens_h = torch.full((seqs,), ctx, dtype=torch.int32)
        pool = seqs * (int(lens_h.max()) // BLOCK_SIZE + 4)
        tables = _tables(lens_h, False, pool, gen).to(dev)
        lens = lens_h.to(dev)
        q = torch.randn(seqs, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        qstart = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
        top = int(lens_h.max())
        keys = int(lens_h.sum())
        r: dict[str, Any] = {"seqs": seqs, "max_context": top}
        for dtype in ("bf16", "fp8"):
            cache = _cache(pool, dtype)
            fp8 = dtype == "fp8"
            nbytes = keys * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
            with environ("ENGINE_FP8_ATTENTION", "triton"):
                splits = decode_splits(seqs, KV_HEADS, top, dev, fp8=fp8)
                triton_run = partial(paged_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, 1, top, splits)
                t = min(graph_time([triton_run] * 4, rounds=5) for _ in range(3))
                ref_triton = triton_run().float() if fp8 and seqs <= 64 else None
            r[f"triton_{dtype}_us"] = t * 1e6
            r[f"triton_{dtype}_pct_hbm"] = 100 * nbytes / t / HBM
            r[f"triton_{dtype}_splits"] = splits
            if not fp8:
                del cache
                continue
            # The engine's path: paged_attention dispatching to the CUDA kernel at its own split rule.
            with environ("ENGINE_FP8_ATTENTION", "cuda"):
                esplits = decode_splits(seqs, KV_HEADS, top, dev, fp8=True)
                engine_run = partial(paged_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, 1, top, esplits)
                if ref_triton is not None:
                    ref = reference(q, cache, tables, lens)
                    for label, got in (("triton", ref_triton), ("cuda", engine_run().float())):
                        r[f"max_err_{label}"] = float((got - ref).abs().max())
                        r[f"mean_err_{label}"] = float((got - ref).abs().mean())
                    if r["max_err_cuda"] > 4 * r["max_err_triton"] + 0.01:
                        # Where the kernel is wrong: by query head of a group, by dimension (a fragment's map).
                        e = (engine_run().float() - ref).abs().view(seqs, KV_HEADS, -1, HEAD_DIM)
                        print("error by head of a group", [round(x, 3) for x in e.mean((0, 1, 3)).tolist()])
                        print("error by dim", [round(x, 3) for x in e.mean((0, 1, 2)).tolist()])
                t = min(graph_time([engine_run] * 4, rounds=5) for _ in range(3))
                r["cuda_engine_us"], r["cuda_engine_splits"] = t * 1e6, esplits
                for sp in sorted({1, 2, 4, 8, splits, esplits}):
                    run = partial(fp8_decode_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, sp)
                    r[f"cuda_s{sp}_us"] = min(graph_time([run] * 4, rounds=5) for _ in range(3)) * 1e6
            best = min((v, k) for k, v in r.items() if k.startswith("cuda_s"))
            r["cuda_best"] = {"key": best[1], "us": best[0], "pct_hbm": 100 * nbytes / (best[0] * 1e-6) / HBM}
            del cache
        r["triton_fp8_over_bf16"] = r["triton_bf16_us"] / r["triton_fp8_us"]
        r["cuda_fp8_over_bf16"] = r["triton_bf16_us"] / r["cuda_engine_us"]
        r["cuda_over_triton_fp8"] = r["triton_fp8_us"] / r["cuda_engine_us"]
        out["cases"][name] = r
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
