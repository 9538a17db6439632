"""Tiles of the fused MoE's grouped GEMMs at decode batches, on the H200 (issue #29: qwen3-30b-a3b at batch 1).

At one token the MoE layer of Qwen3-30B-A3B reads 8 experts' weights (75.5 MB) and took 33 us, 2.3 TB/s: its up
projection runs as 8 x 12 = 96 programs of 64 columns over a K of 2,048 (fewer programs than the 132 SMs), the down
projection as 256 programs over a K of only 768. This sweeps each GEMM's tile by itself (the same alignment, weights
streamed from HBM: every call reads another layer's copy and another routing), then times whole layers with the
defaults and with each GEMM's best tile, at 1 and 4 tokens. Writes the best decode tiles as an ``ENGINE_MOE_TILES``
file.

    python3 bench/device/moe_tiles.py --json $OUT/moe-tiles.json --tiles $OUT/moe-tiles-table.json [--seconds 150]
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from bench.device.fp8_tune import HBM, graph_time
from engine.kernels import fused_moe as fm

E, H, INTER, TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B
COPIES = 6


def routing(tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)]).to("cuda", torch.int32)
    w = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1).to("cuda", torch.bfloat16)
    return ids, w


def touched_bytes(ids: torch.Tensor) -> int:
    return len(set(ids.flatten().tolist())) * (2 * INTER * H + H * INTER) * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tiles", required=True)
    ap.add_argument("--seconds", type=float, default=150.0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    w13 = [torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    w2 = [torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "sweep": {}}
    end = time.monotonic() + a.seconds
    # Each GEMM alone at one token: the alignment of each copy's routing computed once, outside the timing.
    tokens = 1
    routes = [routing(tokens, g) for _ in range(COPIES)]
    base = fm.moe_tiles(tokens * TOP_K, E)
    als = [fm.align(ids, E, base.block_m) for ids, _ in routes]
    xs = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    hs = torch.randn(tokens * TOP_K, INTER, device=dev, dtype=torch.bfloat16)
    space = [(bn, bk, w, st) for bn, bk, w, st in itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (2, 4, 8),
                                                                       (2, 3, 4, 5)) if bn * bk <= 32768]  # fmt: skip
    random.Random(0).shuffle(space)
    best: dict[str, tuple[list[int], float]] = {}
    for j, gemm in enumerate(("up", "down")):
        deadline = time.monotonic() + 0.7 * (end - time.monotonic()) / (2 - j)
        rows: list[dict[str, Any]] = []
        bytes_ = sum(touched_bytes(ids) for ids, _ in routes) / COPIES * (2 / 3 if gemm == "up" else 1 / 3)
        for t in [(base.block_n, base.block_k, base.num_warps, base.num_stages), *space]:
            if time.monotonic() > deadline and rows:
                break
            tiles = replace(base, block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3])

            def one(i: int, tiles=tiles, gemm=gemm):
                if gemm == "up":
                    out = torch.empty(tokens * TOP_K, INTER, device=dev, dtype=torch.bfloat16)
                    fm._grouped_gemm(xs, w13[i], out, als[i], routes[i][1], TOP_K, True, False, tiles)
                else:
                    out = torch.empty(tokens * TOP_K, H, device=dev, dtype=torch.bfloat16)
                    fm._grouped_gemm(hs, w2[i], out, als[i], routes[i][1], 1, False, True, tiles)
                return out

            try:
                sec = graph_time([partial(one, i) for i in range(COPIES)], rounds=5)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is left out
                rows.append({"tile": list(t), "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            rows.append(
                {"tile": list(t), "us": sec * 1e6, "tb_s": bytes_ / sec / 1e12, "pct_hbm": 100 * bytes_ / sec / HBM}
            )
            if gemm not in best or sec < best[gemm][1]:
                best[gemm] = (list(t), sec)
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res["sweep"][gemm] = {"default": rows[0], "top5": ok[:5], "tried": len(rows)}
        print(gemm, "default", rows[0], "best", ok[:2], flush=True)
    # Whole layers (alignment, both GEMMs, the sum over experts) at 1 and 4 tokens, default tiles against the best.
    table = {torch.cuda.get_device_name(): {k: v[0] for k, v in best.items()}}
    with open(a.tiles, "w") as f:
        json.dump(table, f)
    res["layer"] = {}
    for tokens in (1, 4):
        routes = [routing(tokens, g) for _ in range(COPIES)]
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        bytes_ = sum(touched_bytes(ids) for ids, _ in routes) / COPIES
        outs = []
        for label, path in (("default", None), ("best", a.tiles)):
            fm.measured_decode_tiles.cache_clear()
            if path:
                os.environ["ENGINE_MOE_TILES"] = path
            else:
                os.environ.pop("ENGINE_MOE_TILES", None)
            outs.append(fm.fused_moe(x, w13[0], w2[0], routes[0][1], routes[0][0]).float())
            calls = [partial(fm.fused_moe, x, w13[i], w2[i], routes[i][1], routes[i][0]) for i in range(COPIES)]
            sec = graph_time(calls, rounds=5)
            res["layer"][f"{tokens}:{label}"] = {"us": sec * 1e6, "tb_s": bytes_ / sec / 1e12}
            err = ((outs[-1] - outs[0]).abs().max() / outs[0].abs().max()).item()
            res["layer"][f"{tokens}:{label}"]["err_vs_default"] = err
            tb = round(bytes_ / sec / 1e12, 2)
            print("layer", tokens, "tokens", label, f"err {err:.2e}", round(sec * 1e6, 2), "us", tb, "TB/s",
                  flush=True)  # fmt: skip
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
