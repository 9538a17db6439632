"""FP8 decode kernels on the H200 with the weights and caches streamed from HBM, not from L2.

A 16-32 MB weight replayed in a graph stays in the H200's 50 MB L2, which is how the first tuning of the skinny
matmul chose its FP8 tiles. Here every timed call reads a different copy of the weight (copies enough for 512 MB
per pass), as the 36 layers of a model do.

1. Skinny matmul (engine.kernels.gemv) at 1 token on qwen3-8b's linear layers: bf16 and FP8 weights over a sweep of
   tiles, against cuBLAS bf16; the tile the engine picks today (``config_for``) beside the best.
2. Decode attention at batch 256 / 2K context and batch 16 / 8K (qwen3-8b heads): bf16 cache against an FP8 cache
   (read through fp16) over tiles, each in the engine's head-major cache layout (``[2, blocks, kv_heads, block_size,
   head_dim]``: a KV head's keys of a block contiguous) and in the slot-major one it replaced (``[2, blocks,
   block_size, kv_heads, head_dim]``, read by the same kernel through a permuted view): the same values, so the
   same result, and the time each layout's access pattern costs. FP8 runs as the engine does (``fp8``: V tiles
   widened in registers) and, with ``--fp8-modes``, with Triton's own widening (``fp8-triton``).
3. ``--only splits``: decode attention by split count (programs per sequence) for a few tiles of each cache dtype,
   at batch 256 / 2K, 64 / 544, 16 / 8K and 1 / 4K: what ``engine.kernels.decode_splits`` and
   ``triton_ops.decode_tile`` were chosen from.
4. ``--only loops``: decode attention by loop at those shapes: every tile masked and rescaled (the loop before),
   full tiles without masks (``unmasked``), the running maximum moved lazily (``lazy_rescale``), and both, each
   cache dtype at the engine's split count, and FP8's 1-warp programs under register caps (``max_registers``).
5. ``--only gemv64``: the skinny-matmul kernel on 64-token tiles against cuBLAS at 64 tokens (bf16).

Tried on 2026-12-02 and taken out of the kernels since none won (docs/engine.md, "FP8 on the H200"): FP8 x FP8
skinny matmuls with activations quantized per token in the kernel, and for attention a native FP8 dot and a
hand-pipelined loop (commits 9fbeeb8, b996925).

    python3 bench/device/fp8_tune.py --json $OUT/fp8-tune.json
    python3 bench/device/fp8_tune.py --only attention --json $OUT/attention.json  # the layouts' round
    python3 bench/device/fp8_tune.py --only splits --json $OUT/splits.json
    python3 bench/device/fp8_tune.py --only loops --json $OUT/loops.json
    python3 bench/device/fp8_tune.py --only gemv64 --json $OUT/gemv64.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import triton

from engine.attention import kv_cache_shape
from engine.kernels import DecodeTile, decode_splits, decode_tile
from engine.kernels.gemv import GemvConfig, config_for, gemv
from engine.kernels.triton_ops import paged_attention
from engine.models.quant import Fp8Linear

HBM = 4.8e12
PASS_BYTES = 512 << 20
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}  # fmt: skip
# --shapes qwen3-30b-a3b: that model's dense layers (the experts run on the fused MoE kernel), the router included.
MOE_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}


@contextmanager
def environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` while the block runs (a kernel switch the engine reads at each launch)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def graph_time(calls: Sequence[Callable[[], object]], rounds: int = 5) -> float:
    """Seconds per call when ``calls`` run once each in one CUDA graph (median of ``rounds`` replays)."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    torch.cuda.synchronize()
    g.replay()
    times = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del g
    return float(sorted(times)[len(times) // 2])


def _checked_time(run: Callable[[], torch.Tensor], ref: torch.Tensor) -> tuple[float, float]:
    """(largest absolute error against ``ref``, seconds per call in a graph of four) of an attention variant;
    raises on a wrong result (error above 0.05), which the sweeps record as that variant's error."""
    err = (run().float() - ref).abs().max().item()
    if err > 0.05:
        raise RuntimeError(f"wrong result ({err:.3f})")
    return err, graph_time([run] * 4, rounds=3)


def tune_gemv(
    out: dict[str, Any], deadline: float, kinds_wanted: list[str], shapes: dict[str, tuple[int, int]]
) -> None:
    dev = torch.device("cuda")
    narrow = min(n for n, _ in shapes.values()) < 1024  # a router: 16-row tiles too
    sweep = {"fp8": [GemvConfig(bn, bk, 4, st) for bn, bk, st in
                     itertools.product((16, 32, 64), (128, 256, 512), (3, 4))],
             "bf16": [GemvConfig(bn, bk, 4, st) for bn, bk, st in
                      itertools.product((16, 32, 64) if narrow else (32, 64), (256, 512), (3, 4))]}  # fmt: skip
    tiles = out.setdefault("tiles", {}).setdefault(torch.cuda.get_device_name(), {})
    for i, (name, (n, k)) in enumerate(shapes.items()):
        shape_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(shapes) - i)
        copies = max(2, -(-PASS_BYTES // (n * k)))
        # At most 8 copies of a big weight (memory); small ones (a router) need many to leave the 50 MB L2.
        held = min(copies, max(8, copies // 4))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(held)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {"copies_bf16": len(ws)}
        t = graph_time([partial(F.linear, x, w) for w in ws] * 2)
        row["cublas_bf16"] = {"us": t * 1e6, "pct_hbm": 100 * n * k * 2 / t / HBM}
        kinds: list[tuple[str, list[tuple[torch.Tensor, torch.Tensor | None]]]] = [("bf16", [(w, None) for w in ws])]
        if name != "lm_head":
            fp8s: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            for c in range(min(2 * copies, 16)):
                layer = Fp8Linear(k, n).to(dev)
                layer.load_rows(0, ws[c % len(ws)])
                fp8s.append((layer.weight, layer.weight_scale))
            kinds.append(("fp8", fp8s))
        swiglu = name == "gate_up"
        for wdt, weights in kinds:
            if wdt not in kinds_wanted:
                continue
            esize = weights[0][0].element_size()
            ref = F.linear(x, ws[0]).float()
            if swiglu:
                g, u = ref.chunk(2, dim=-1)
                ref = F.silu(g) * u
            results: list[dict[str, Any]] = []
            today = config_for(weights[0][0])
            for cfg in [today, *sweep[wdt]]:
                if time.monotonic() > shape_deadline:
                    break
                try:
                    y = gemv(x, weights[0][0], weights[0][1], swiglu=swiglu, config=cfg)
                    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 0.05:
                        raise RuntimeError(f"wrong result (relative error {err:.3f})")
                    calls = [partial(gemv, x, w, s, swiglu=swiglu, config=cfg) for w, s in weights]
                    t = graph_time(calls, rounds=3)
                except Exception as e:  # a tile that does not compile (shared memory) is left out
                    results.append({"cfg": str(cfg), "error": f"{type(e).__name__}: {str(e)[:80]}"})
                    continue
                results.append({"cfg": str(cfg), "us": t * 1e6, "pct_hbm": 100 * n * k * esize / t / HBM})
            ok = [r for r in results if "us" in r]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            row[wdt] = {"today": ok[0] if ok and ok[0]["cfg"] == str(today) else None, "best": best,
                        "top5": sorted(ok, key=lambda r: r["us"])[:5], "errors": len(results) - len(ok)}  # fmt: skip
            print("gemv", name, wdt, "today", row[wdt]["today"], "best", best, flush=True)
            if best is not None:
                cfg = next(c for c in [today, *sweep[wdt]] if str(c) == best["cfg"])
                key = f"{n}x{k}"
                tiles.setdefault(wdt, {})[key] = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
        out.setdefault("gemv", {})[name] = row
        del ws, kinds
        torch.cuda.empty_cache()


HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # qwen3-8b's attention, the engine's block size


def _decode_case(seqs: int, ctx: int) -> tuple[torch.Tensor, ...]:
    """A decode step of ``seqs`` sequences of ``ctx`` keys each, their blocks scattered over a random bf16 cache
    (head-major): block tables, query starts, context lengths, queries, cache."""
    dev = torch.device("cuda")
    blocks_per = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per + 1
    tables = torch.randperm(num_blocks - 1, device=dev, dtype=torch.int32)[: seqs * blocks_per].view(seqs, -1)
    qstart = torch.arange(seqs + 1, device=dev, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device=dev, dtype=torch.bfloat16)
    return tables, qstart, lens, q, cache


def tune_attention(
    out: dict[str, Any], deadline: float, layouts: Sequence[str] = ("head", "slot"),
    fp8_modes: Sequence[str] = ("fp8", "fp8-triton"), fp8_tiles: Sequence[tuple[int, int, int]] = (),
) -> None:  # fmt: skip
    dev = torch.device("cuda")
    kvh, d = KV_HEADS, HEAD_DIM
    top: list[str] = []
    for first, (seqs, ctx) in enumerate(((256, 2048), (16, 8192))):
        # The first shape sweeps, the second re-times its leaders: 70% of what is left, then the rest.
        shape_deadline = time.monotonic() + (deadline - time.monotonic()) * (0.7 if first == 0 else 1.0)
        tables, qstart, lens, q, cache16 = _decode_case(seqs, ctx)
        cache8 = cache16.to(torch.float8_e4m3fn)
        # The slot-major layout holds the same values; its permuted view has the engine's shape.
        # "fp8" is the engine's kernel (V widened in registers); "fp8-triton" leaves V's widening to Triton.
        by_dtype = {"bf16": cache16, **{m: cache8 for m in fp8_modes}}
        caches = {(c, lay): (t if lay == "head" else t.transpose(2, 3).contiguous().transpose(2, 3))
                  for c, t in by_dtype.items() for lay in layouts}  # fmt: skip
        # The engine's split count for each cache dtype ("fp8-triton" too, to compare it with "fp8" alike).
        splits = {c: decode_splits(seqs, kvh, ctx, dev, fp8=c != "bf16") for c in by_dtype}
        kv_elems = seqs * ctx * kvh * d * 2
        ref = paged_attention(q, cache8.to(torch.bfloat16), tables, qstart, lens, d**-0.5, 1, ctx).float()
        res: dict[str, Any] = {"splits": splits, "runs": []}
        tiles = {"bf16": list(itertools.product((64, 128), (2, 4, 8), (2, 3))),
                 "fp8": list(fp8_tiles or itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))}  # fmt: skip
        tiles["fp8-triton"] = tiles["fp8"]
        # What the engine runs (paged_attention's defaults: decode_tile, by whether V is widened in registers).
        engine_tile = {c: _tile3(decode_tile(c == "fp8")) for c in by_dtype}
        tiles = {c: [engine_tile[c], *(t for t in tiles[c] if t != engine_tile[c])] for c in by_dtype}
        # The engine's tiles first, then the sweep with the dtypes alternating and each tile in both layouts one
        # after the other, so that a deadline cuts all four alike.
        order = sorted((t != engine_tile[c], i, c, t) for c in tiles for i, t in enumerate(tiles[c]))
        variants = [(c, lay, *t) for _, _, c, t in order for lay in layouts]
        for cname, layout, bn, warps, stages in variants:
            cache = caches[(cname, layout)]
            label = f"{cname} {layout}-major block_n={bn} warps={warps} stages={stages}"
            if time.monotonic() > shape_deadline or (top and label not in top):
                continue

            run = partial(
                paged_attention, q, cache, tables, qstart, lens, d**-0.5, 1, ctx, splits[cname], block_n=bn,
                num_warps=warps, num_stages=stages, v_regs=False if cname == "fp8-triton" else None,
            )  # fmt: skip
            try:
                err, t = _checked_time(run, ref)
            except Exception as e:
                res["runs"].append({"variant": label, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                print("attention", seqs, ctx, label, type(e).__name__, str(e)[:100], flush=True)
                continue
            r = {"variant": label, "us": t * 1e6, "pct_hbm": 100 * kv_elems * cache.element_size() / t / HBM,
                 "max_abs_err": err}  # fmt: skip
            res["runs"].append(r)
            print("attention", seqs, ctx, r, flush=True)
        for cname, layout in caches:
            kind = f"{cname} {layout}-major"
            ok = [r for r in res["runs"] if "us" in r and r["variant"].startswith(kind + " ")]
            # The longer context re-times only the leaders of the first (and the engine's tile).
            top += [r["variant"] for r in sorted(ok, key=lambda r: r["us"])[:3]]
            if ok:
                res[f"best_{cname}_{layout}"] = min(ok, key=lambda r: r["us"])
            # What the engine runs (paged_attention's defaults), beside the best of the sweep.
            engine = "{} block_n={} warps={} stages={}".format(kind, *engine_tile[cname])
            res[f"engine_{cname}_{layout}"] = next((r for r in ok if r["variant"] == engine), None)
            top.append(engine)
        us = {k.removeprefix("best_"): v["us"] for k, v in res.items() if k.startswith("best_")}
        ratios = {"fp8_over_bf16_head": ("bf16_head", "fp8_head"), "fp8_over_bf16_slot": ("bf16_slot", "fp8_slot"),
                  "head_over_slot_bf16": ("bf16_slot", "bf16_head"), "head_over_slot_fp8": ("fp8_slot", "fp8_head"),
                  "fp8_head_over_bf16_slot": ("bf16_slot", "fp8_head"),
                  "fp8_regs_over_triton_head": ("fp8-triton_head", "fp8_head")}  # fmt: skip
        # Speedups (the first's time over the second's): > 1 means the second is faster.
        res["speedup"] = {k: us[a] / us[b] for k, (a, b) in ratios.items() if a in us and b in us}
        print("attention best", seqs, ctx, {k: round(v, 1) for k, v in us.items()},
              {k: round(v, 3) for k, v in res["speedup"].items()}, flush=True)  # fmt: skip
        out.setdefault("attention", {})[f"b{seqs}_ctx{ctx}"] = res
        del cache16, cache8, caches
        torch.cuda.empty_cache()


def tune_splits(out: dict[str, Any], deadline: float) -> None:
    """Decode attention by split count (programs per sequence), per cache dtype and tile: batch 256 at 2K context, 64
    at 544 (the engine benchmark's batch-64 step), 16 at 8K and 1 at 4K, qwen3-8b heads, head-major cache."""
    kvh, d = KV_HEADS, HEAD_DIM
    tiles = {"bf16": [(64, 4, 2), (64, 4, 3), (32, 1, 3), (64, 2, 2)], "fp8": [(32, 1, 3), (128, 4, 3), (64, 2, 3)]}
    res: dict[str, Any] = {}
    for seqs, ctx in ((256, 2048), (64, 544), (16, 8192), (1, 4096)):
        tables, qstart, lens, q, cache16 = _decode_case(seqs, ctx)
        caches = {"bf16": cache16, "fp8": cache16.to(torch.float8_e4m3fn)}
        kv_elems = seqs * ctx * kvh * d * 2
        ref = paged_attention(q, caches["fp8"].to(torch.bfloat16), tables, qstart, lens, d**-0.5, 1, ctx).float()
        runs: list[dict[str, Any]] = []
        for cname, cache in caches.items():
            for bn, warps, stages in tiles[cname]:
                for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                    if splits > -(-ctx // bn) or time.monotonic() > deadline:
                        continue
                    run = partial(paged_attention, q, cache, tables, qstart, lens, d**-0.5, 1, ctx, splits,
                                  block_n=bn, num_warps=warps, num_stages=stages)  # fmt: skip
                    label = f"{cname} block_n={bn} warps={warps} stages={stages} splits={splits}"
                    try:
                        err, t = _checked_time(run, ref)
                    except Exception as e:
                        runs.append({"variant": label, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                        continue
                    pct = 100 * kv_elems * cache.element_size() / t / HBM
                    runs.append({"variant": label, "dtype": cname, "tile": [bn, warps, stages], "splits": splits,
                                 "us": t * 1e6, "pct_hbm": pct, "max_abs_err": err})  # fmt: skip
        best = {c: min((r for r in runs if r.get("dtype") == c), key=lambda r: r["us"], default=None) for c in caches}
        res[f"b{seqs}_ctx{ctx}"] = {"runs": runs, "best": best}
        print("splits", seqs, ctx, {c: (b["variant"], round(b["us"], 1), round(b["pct_hbm"], 1)) for c, b in
                                    best.items() if b}, flush=True)  # fmt: skip
        del caches, cache16
        torch.cuda.empty_cache()
    out["splits"] = res


def _cublas64(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    from engine.kernels.triton_ops import silu_and_mul

    y = F.linear(x, w)
    return silu_and_mul(y) if swiglu else y


def _gemv64(x: torch.Tensor, w: torch.Tensor, swiglu: bool, tile: tuple[int, int, int, int]) -> torch.Tensor:
    from engine.kernels.gemv import _gemv_kernel

    (m, k), n = x.shape, w.shape[0] // 2 if swiglu else w.shape[0]
    bn, bk, warps, stages = tile
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, x, x, y, m, n, x.stride(0), w.stride(0), y.stride(0), k,
        HAS_SCALE=False, HAS_BIAS=False, SWIGLU=swiglu, FP16_DOT=False, PRECISION="tf32", K_SPLIT=k,
        BLOCK_M=triton.next_power_of_2(max(m, 16)), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def tune_gemv64(out: dict[str, Any], deadline: float) -> None:
    """The skinny-matmul kernel (engine.kernels.gemv's ``_gemv_kernel``, 64-row tiles of tokens) at 64 tokens, bf16,
    against cuBLAS on qwen3-8b's layers, weights streamed from HBM: whether a batch-64 decode step (cuBLAS today;
    the kernel serves at most 16 tokens) would gain from it. gate/up is timed with its SwiGLU epilogue against cuBLAS
    plus the engine's SwiGLU kernel."""
    from engine.kernels.triton_ops import silu_and_mul

    dev = torch.device("cuda")
    m = 64
    sweep = list(itertools.product((32, 64, 128), (64, 128), (4,), (3, 4)))
    res: dict[str, Any] = {}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        shape_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(SHAPES) - i)
        copies = max(2, -(-PASS_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 8))]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        swiglu = name == "gate_up"
        ref = F.linear(x, ws[0])
        if swiglu:
            ref = silu_and_mul(ref)
        ref = ref.float()

        t = graph_time([partial(_cublas64, x, w, swiglu) for w in ws] * 2)
        row: dict[str, Any] = {"cublas": {"us": t * 1e6, "pct_hbm": 100 * n * k * 2 / t / HBM}, "runs": []}
        for bn, bk, warps, stages in sweep:
            if time.monotonic() > shape_deadline:
                break
            ours = partial(_gemv64, x, swiglu=swiglu, tile=(bn, bk, warps, stages))
            label = f"block_n={bn} block_k={bk} warps={warps} stages={stages}"
            try:
                err = (ours(ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
                if err > 0.05:
                    raise RuntimeError(f"wrong result (relative error {err:.3f})")
                t = graph_time([partial(ours, w) for w in ws] * 2, rounds=3)
            except Exception as e:
                row["runs"].append({"cfg": label, "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            row["runs"].append({"cfg": label, "us": t * 1e6, "pct_hbm": 100 * n * k * 2 / t / HBM})
        ok = [r for r in row["runs"] if "us" in r]
        row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        print("gemv64", name, "cublas", {k_: round(v, 1) for k_, v in row["cublas"].items()}, "best", row["best"],
              flush=True)  # fmt: skip
        res[name] = row
        del ws
        torch.cuda.empty_cache()
    out["gemv64"] = res


def _tile3(t: DecodeTile) -> tuple[int, int, int]:
    return t.block_n, t.warps, t.stages


def tune_loops(out: dict[str, Any], deadline: float) -> None:
    """Decode attention by loop form and register cap, at the engine's split count, qwen3-8b heads, head-major cache,
    the shapes of ``tune_splits``: every tile masked and rescaled (the loop before round seven), full tiles without
    masks (``unmasked``), the running maximum moved lazily (``lazy``), both, and FP8's 1-warp programs capped at
    fewer registers (more of them on an SM, with spills)."""
    kvh, d = KV_HEADS, HEAD_DIM
    dev = torch.device("cuda")
    # (tile, unmasked, lazy, register cap) per cache dtype; the engine's own (decode_tile) first.
    variants: dict[str, list[tuple[tuple[int, int, int], bool, bool, int]]] = {"bf16": [], "fp8": []}
    for cname in variants:
        eng = decode_tile(cname == "fp8")
        variants[cname].append((_tile3(eng), eng.unmasked, eng.lazy_rescale, eng.max_registers))
    for um, lz in ((False, False), (True, False), (False, True), (True, True)):
        variants["bf16"] += [((64, 4, 2), um, lz, 0), ((32, 1, 3), um, lz, 0)]
        variants["fp8"] += [((32, 1, 3), um, lz, r) for r in (0, 168, 128)] + [((64, 1, 3), um, lz, 128)]
    variants = {c: list(dict.fromkeys(v)) for c, v in variants.items()}
    res: dict[str, Any] = {}
    for seqs, ctx in ((256, 2048), (64, 544), (16, 8192), (1, 4096)):
        tables, qstart, lens, q, cache16 = _decode_case(seqs, ctx)
        caches = {"bf16": cache16, "fp8": cache16.to(torch.float8_e4m3fn)}
        kv_elems = seqs * ctx * kvh * d * 2
        ref = paged_attention(q, caches["fp8"].to(torch.bfloat16), tables, qstart, lens, d**-0.5, 1, ctx,
                              unmasked=False, lazy_rescale=False).float()  # fmt: skip
        runs: list[dict[str, Any]] = []
        for cname, cache in caches.items():
            splits = decode_splits(seqs, kvh, ctx, dev, fp8=cname == "fp8")
            for i, ((bn, warps, stages), unmasked, lazy, regs) in enumerate(variants[cname]):
                if time.monotonic() > deadline:
                    continue
                run = partial(paged_attention, q, cache, tables, qstart, lens, d**-0.5, 1, ctx, splits,
                              block_n=bn, num_warps=warps, num_stages=stages, unmasked=unmasked,
                              lazy_rescale=lazy, max_registers=regs)  # fmt: skip
                loop = "engine" if i == 0 else f"{'unmasked' if unmasked else 'masked'}-{'lazy' if lazy else 'eager'}"
                label = f"{cname} {loop} block_n={bn} warps={warps} stages={stages} regs={regs} splits={splits}"
                try:
                    err, t = _checked_time(run, ref)
                except Exception as e:
                    runs.append({"variant": label, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                    print("loops", seqs, ctx, label, type(e).__name__, str(e)[:100], flush=True)
                    continue
                pct = 100 * kv_elems * cache.element_size() / t / HBM
                runs.append({"variant": label, "dtype": cname, "unmasked": unmasked, "lazy": lazy,
                             "tile": [bn, warps, stages], "max_registers": regs, "splits": splits, "us": t * 1e6,
                             "pct_hbm": pct, "max_abs_err": err})  # fmt: skip
                print("loops", seqs, ctx, label, f"{t * 1e6:.1f} us {pct:.1f}%", flush=True)
        best = {c: min((r for r in runs if r.get("dtype") == c), key=lambda r: r["us"], default=None) for c in caches}
        engine = {c: next((r for r in runs if r["variant"].startswith(f"{c} engine ")), None) for c in caches}
        res[f"b{seqs}_ctx{ctx}"] = {"runs": runs, "best": best, "engine": engine}
        print("loops best", seqs, ctx, {c: (b["variant"], round(b["us"], 1)) for c, b in best.items() if b},
              "engine", {c: round(e["us"], 1) for c, e in engine.items() if e and "us" in e}, flush=True)  # fmt: skip
        del caches, cache16
        torch.cuda.empty_cache()
    out["loops"] = res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--only", choices=("gemv", "attention", "splits", "loops", "gemv64"), default=None)
    ap.add_argument("--layouts", default="head,slot", help="attention: cache layouts to time (head, slot)")
    ap.add_argument(
        "--fp8-modes",
        default="fp8,fp8-triton",
        help="attention: FP8 kernels to time (fp8: V widened in registers; fp8-triton: by Triton)",
    )
    ap.add_argument("--fp8-tiles", default="", help="attention: FP8 tiles, block_n:warps:stages,...")
    ap.add_argument("--kinds", default="bf16,fp8", help="skinny-matmul weight kinds to sweep")
    ap.add_argument("--shapes", choices=("qwen3-8b", "qwen3-30b-a3b"), default="qwen3-8b",
                    help="skinny matmuls: which model's linear layers")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=300.0, help="stop sweeping after this long (each part)")
    ap.add_argument(
        "--tiles", help="also write the best skinny-matmul tiles here (engine/kernels/gemv_tiles.json form)"
    )
    a = ap.parse_args()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    try:
        if a.only in (None, "attention"):
            fp8_tiles = [tuple(int(v) for v in t.split(":")) for t in a.fp8_tiles.split(",") if t]
            tune_attention(out, time.monotonic() + a.seconds, a.layouts.split(","), a.fp8_modes.split(","),
                           fp8_tiles)  # type: ignore[arg-type]  # fmt: skip
        if a.only == "splits":
            tune_splits(out, time.monotonic() + a.seconds)
        if a.only == "loops":
            tune_loops(out, time.monotonic() + a.seconds)
        if a.only == "gemv64":
            tune_gemv64(out, time.monotonic() + a.seconds)
        if a.only in (None, "gemv"):
            tune_gemv(out, time.monotonic() + a.seconds, a.kinds.split(","),
                      MOE_SHAPES if a.shapes == "qwen3-30b-a3b" else SHAPES)  # fmt: skip
    finally:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        if a.tiles:
            with open(a.tiles, "w") as f:
                json.dump(out.get("tiles", {}), f, indent=1)


if __name__ == "__main__":
    main()
