"""FP8 weights at one token: widened by Hopper's conversion instruction, or by moving bits (issue #29).

The skinny-matmul kernel (``engine.kernels.gemv``) widens FP8 weight bytes before its tensor-core dot. With Triton's
conversion that is ``F2FP.F16.E4M3.UNPACK_B`` (two bytes an instruction), and since the dot is then fp16, the bf16
activations are converted too, in every program and every K slice (``F2FP.F16.F32.PACK_AB``, as many as for the
weight): read from the sm_90 SASS, the loop issues one conversion per weight byte. Hopper issues conversions at a
quarter of the rate of integer logic. ``ENGINE_FP8_WIDEN=bits`` (the default) widens by a byte permute, a mask, a
shift and a three-input logic op instead, straight to the activations' dtype, so the activations are not touched.

For qwen3-8b's projections at one token (qkv, o, down; gate/up with its SwiGLU), weights streamed from HBM (every
call reads another copy): the engine's pick today (the CUDA-core one-token kernel for qkv / o / down, the tensor-core
kernel with the conversion instruction for gate/up), the tensor-core kernel with each widening at the engine's tile,
then widening by bits over a sweep of tiles. Then a chain of 36 layers of the four (one CUDA graph), today's picks
against each shape's best, and bf16 for the ratio. Writes the winning tiles as an ``ENGINE_GEMV_TILES`` file:
``fp8_m1`` (one token on the tensor cores) where a tile beat the CUDA-core kernel, ``fp8`` for gate/up.

    python3 bench/device/fp8_widen.py --json $OUT/fp8-widen.json --tiles $OUT/widen-tiles.json [--seconds 150]
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.device.fp8_tune import HBM, PASS_BYTES, graph_time
from bench.device.gemv_swap import LAYERS, SHAPES, weights
from engine.kernels import gemv as gm
from engine.kernels.gemv import GemvConfig, TokenConfig, config_for, token_config_for

Config = GemvConfig | TokenConfig


def call(x, w, s, cfg: Config | None, bits: bool, swiglu: bool) -> Callable[[], Any]:
    def run():
        gm.WIDEN_BITS = bits
        return gm.gemv(x, w, s, swiglu=swiglu, config=cfg)

    return run


def today(name: str, w: torch.Tensor) -> Config:
    return config_for(w) if name == "gate_up" else token_config_for(w)


def sweep(seconds: float) -> tuple[dict[str, Any], dict[str, tuple[Config, bool, float]]]:
    dev = torch.device("cuda")
    end = time.monotonic() + seconds
    res: dict[str, Any] = {}
    best: dict[str, tuple[Config, bool, float]] = {}
    space = [GemvConfig(*t) for t in itertools.product((16, 32, 64, 128), (256, 512, 1024), (4, 8), (2, 3, 4))]
    random.Random(0).shuffle(space)
    for i, name in enumerate(SHAPES):
        n, k = SHAPES[name]
        swiglu = name == "gate_up"
        deadline = time.monotonic() + (end - time.monotonic()) / (len(SHAPES) - i)
        ws = weights(n, k, True, min(16, max(2, -(-PASS_BYTES // (n * k)))), dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ (ws[0][0].float() * ws[0][1][:, None]).T
        if swiglu:
            gate, up = ref.chunk(2, dim=-1)
            ref = torch.nn.functional.silu(gate) * up
        eng = today(name, ws[0][0])
        tile = config_for(ws[0][0])
        todo: list[tuple[str, Config, bool]] = [
            ("today", eng, False), ("cvt at the engine's tile", tile, False), ("bits at the engine's tile", tile, True)
        ]  # fmt: skip
        todo += [("bits", cfg, True) for cfg in space]
        rows: list[dict[str, Any]] = []
        for label, cfg, bits in todo:
            if time.monotonic() > deadline and label == "bits":
                break
            try:
                y = call(x, ws[0][0], ws[0][1], cfg, bits, swiglu)().float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if err > 0.02:
                    raise RuntimeError(f"wrong result ({err:.4f})")
                t = graph_time([call(x, w, s, cfg, bits, swiglu) for w, s in ws], rounds=3)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is left out
                rows.append({"variant": f"{label} {cfg}", "error": f"{type(e).__name__}: {str(e)[:100]}"})
                continue
            rows.append({"variant": f"{label} {cfg}", "label": label, "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM,
                         "err": err})  # fmt: skip
            if name not in best or t < best[name][2]:
                best[name] = (cfg, bits, t)
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res[name] = {
            "rows": rows[:3],
            "top5": ok[:5],
            "tried": len(rows),
            "errors": [r for r in rows if "error" in r][:3],
        }
        print(name, [(r["variant"], round(r["us"], 2), round(r["pct_hbm"], 1)) if "us" in r else r for r in rows[:3]],
              "best",
              [(r["variant"], round(r["us"], 2), round(r["pct_hbm"], 1)) for r in ok[:1]], flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    return res, best


def chain(fp8: bool, picks: dict[str, tuple[Config | None, bool]]) -> float:
    """Seconds of 36 layers' four projections in one graph, each with its pick."""
    dev = torch.device("cuda")
    layers = {name: weights(*SHAPES[name], fp8, LAYERS, dev) for name in SHAPES}
    xs = {name: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    calls = [
        call(xs[name], *layers[name][i], *picks[name], name == "gate_up") for i in range(LAYERS) for name in SHAPES
    ]
    t = graph_time(calls, rounds=5) * len(calls)
    layers.clear()
    torch.cuda.empty_cache()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tiles", required=True)
    ap.add_argument("--seconds", type=float, default=150.0)
    a = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    res["shapes"], best = sweep(a.seconds)
    total = {fp8: sum(n * k * (1 if fp8 else 2) for n, k in SHAPES.values()) * LAYERS for fp8 in (True, False)}
    plans: dict[str, tuple[bool, dict[str, tuple[Config | None, bool]]]] = {
        "bf16": (False, {name: (None, False) for name in SHAPES}),
        "fp8 today": (True, {name: (None, False) for name in SHAPES}),
        "fp8 best": (True, {name: (best[name][0], best[name][1]) for name in SHAPES if name in best}),
    }
    res["chain"] = {}
    for label, (fp8, picks) in plans.items():
        if len(picks) < len(SHAPES):
            continue
        t = chain(fp8, picks)
        res["chain"][label] = {"us": t * 1e6, "pct_hbm": 100 * total[fp8] / t / HBM,
                               "picks": {n: [str(c), b] for n, (c, b) in picks.items()}}  # fmt: skip
        print("chain", label, round(t * 1e6, 1), "us", round(100 * total[fp8] / t / HBM, 1), "%", flush=True)
    c = res["chain"]
    if "bf16" in c and "fp8 best" in c:
        print(f"chain fp8 best / bf16: {c['bf16']['us'] / c['fp8 best']['us']:.3f}x; fp8 today / bf16: "
              f"{c['bf16']['us'] / c['fp8 today']['us']:.3f}x", flush=True)  # fmt: skip
    m1: dict[str, list[int]] = {}
    tc: dict[str, list[int]] = {}
    for name, (cfg, bits, _) in best.items():
        n, k = SHAPES[name]
        if isinstance(cfg, GemvConfig) and bits:
            (tc if name == "gate_up" else m1)[f"{n}x{k}"] = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
    with open(a.tiles, "w") as f:
        json.dump({torch.cuda.get_device_name(): {"fp8_m1": m1, "fp8": tc}}, f)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
