"""One token's linear layers in CUDA C++ (``engine/kernels/token_gemv.cu``) against the Triton kernels (issue #29's
batch-1 targets: qwen3-8b at 80% of the HBM roofline, FP8 weights at 1.6x bf16).

For each of qwen3-8b's projections, bf16 and FP8 (per-channel scales), weights streamed from HBM (every call of a
graph reads another copy, as a model's layers do): the engine's Triton pick (``ENGINE_TOKEN_GEMV=triton``) and the
CUDA kernel at each tile of a small sweep, each checked against float32 ``F.linear``. Then the chain of 36 layers'
four projections in one graph, as a decode step runs them (PDL on where the GPU has it), on either kernel.

    python3 bench/device/token_gemv_bench.py --json $OUT/token-gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.device.fp8_tune import HBM, SHAPES, environ, graph_time
from engine.kernels.gemv import gemv
from engine.kernels.token_gemv import TokenTile, tile_for, token_gemv
from engine.models.quant import Fp8Linear

LAYERS = 36
PASS_BYTES = 512 << 20


def run_all(calls: list[partial[torch.Tensor]]) -> None:
    for c in calls:
        c()


def weights(n: int, k: int, dtype: str, copies: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    dev = torch.device("cuda")
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        if dtype == "bf16":
            out.append((w, None))
        else:
            layer = Fp8Linear(k, n).to(dev)
            layer.load_rows(0, w)
            out.append((layer.weight.data, layer.weight_scale.data))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--no-chain", action="store_true")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    a = p.parse_args()
    dev = torch.device("cuda")
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "layers": {}}
    shapes = {k: v for k, v in SHAPES.items()}
    for name, (n, k) in shapes.items():
        swiglu = name == "gate_up"
        for dtype in [d for d in a.dtypes if name != "lm_head" or d == "bf16"]:
            es = 2 if dtype == "bf16" else 1
            copies = min(16, max(2, -(-PASS_BYTES // (n * k * es))))
            ws = weights(n, k, dtype, copies)
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            w0 = ws[0][0].float() * (ws[0][1][:, None] if ws[0][1] is not None else 1.0)
            ref = F.linear(x.float(), w0)
            if swiglu:
                g, u = ref.chunk(2, dim=-1)
                ref = F.silu(g) * u
            nbytes = n * k * es
            r: dict[str, Any] = {"copies": copies}
            with environ("ENGINE_TOKEN_GEMV", "triton"):
                t = graph_time([partial(gemv, x, w, s, swiglu=swiglu) for w, s in ws], rounds=5)
                err = float((gemv(x, *ws[0], swiglu=swiglu).float() - ref).abs().max() / ref.abs().max())
            r["triton"] = {"us": t * 1e6, "pct_hbm": 100 * nbytes / t / HBM, "rel_err": err}
            best: tuple[float, str] | None = None
            tiles = [tile_for(ws[0][0], swiglu)] + [
                TokenTile(wp, rpw, un) for wp, rpw, un in itertools.product((4, 8), (1, 2, 4), (4, 8))
            ]
            n_out = n // 2 if swiglu else n
            for tile in dict.fromkeys(tiles):
                try:
                    y = torch.empty(1, n_out, device=dev, dtype=torch.bfloat16)
                    got = token_gemv(x, ws[0][0], ws[0][1], None, swiglu, y, tile).float()
                    err = float((got - ref).abs().max() / ref.abs().max())
                    calls = [partial(token_gemv, x, w, s, None, swiglu, torch.empty_like(y), tile) for w, s in ws]
                    t = graph_time(calls, rounds=5)
                except Exception as e:  # a tile the shape does not divide into
                    r[str(tile)] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                    continue
                r[str(tile)] = {"us": t * 1e6, "pct_hbm": 100 * nbytes / t / HBM, "rel_err": err}
                if best is None or t < best[0]:
                    best = (t, str(tile))
            if best is not None:
                r["cuda_best"] = {"tile": best[1], "us": best[0] * 1e6, "pct_hbm": 100 * nbytes / best[0] / HBM}
                r["cuda_default"] = r.get(str(tile_for(ws[0][0], swiglu)))
            out["layers"][f"{name} {dtype}"] = r
            print(name, dtype, "triton", {k_: round(v, 3) for k_, v in r["triton"].items()}, "cuda default",
                  r.get("cuda_default"), "best", r.get("cuda_best"), flush=True)  # fmt: skip
            del ws
            torch.cuda.empty_cache()
    if not a.no_chain:
        # 36 layers' qkv, o, gate/up (SwiGLU) and down, each layer its own weights, in one graph.
        for dtype in a.dtypes:
            layers = {nm: weights(*SHAPES[nm], dtype, LAYERS) for nm in ("qkv", "o", "gate_up", "down")}
            xs = {nm: torch.randn(1, SHAPES[nm][1], device=dev, dtype=torch.bfloat16) for nm in layers}
            calls = [partial(gemv, xs[nm], *layers[nm][i], swiglu=nm == "gate_up") for i in range(LAYERS)
                     for nm in ("qkv", "o", "gate_up", "down")]  # fmt: skip
            nbytes = sum(w.numel() * w.element_size() for ws_ in layers.values() for w, _ in ws_)
            for mode in ("triton", "cuda"):
                with environ("ENGINE_TOKEN_GEMV", mode):
                    t = graph_time([partial(run_all, calls)], rounds=5)
                out.setdefault("chain", {})[f"{dtype} {mode}"] = {"us": t * 1e6, "pct_hbm": 100 * nbytes / t / HBM}
                print("chain", dtype, mode, round(t * 1e6, 1), "us", round(100 * nbytes / t / HBM, 1), "%", flush=True)
            del layers
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
