"""FP8 x FP8 at one token on Hopper's warp-group MMA, activations arriving already in FP8 (issue #29).

At one token the engine multiplied FP8 weights by bf16 activations: each weight byte widened and multiplied on the
CUDA cores (qkv / o / down, ``_gemv_token_kernel``) or widened into the tensor cores' operand (gate/up with its
SwiGLU). The first call of this round (2026-12-03, ``docs/results/fp8-kernels/w8a8-token-20261203.json``, a kernel
of this file's that is now the engine's ``_w8a8_kernel``) found FP8 x FP8 with the activation quantized before the
kernel 15% faster over 36 layers' projections, and quantizing inside each program slower than the widening. The
engine now has the down projection read its activations from the gate/up kernel's SwiGLU epilogue, quantized per
token and run of that kernel's ``block_n`` columns (``gemv.swiglu_fp8`` -> ``Fp8Rows`` -> ``gemv(rows, ...)``).
This times, weights streamed from HBM (every call reads another copy; 512 MB a pass):

- the down projection on ``Fp8Rows`` of runs of 32, 64 and 128 columns, in 1, 2 and 4 parts, over a tile sweep;
- the gate/up projection with and without its quantizing epilogue, at 32- and 64-row tiles;
- an MLP of 36 layers in one CUDA graph: the engine's weight-only pair against swiglu_fp8 + W8A8 down (group 32,
  the packaged gate/up tile's rows, and group 64).

    python3 bench/device/w8a8_token.py --json $OUT/w8a8.json [--seconds 150]
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from typing import Any

import torch

from bench.device.fp8_tune import HBM, PASS_BYTES, graph_time
from engine.kernels.gemv import Fp8Rows, GemvConfig, W8A8Config, config_for, gemv, swiglu_fp8, w8a8_parts
from engine.models.quant import quantize_per_channel

GATE_UP, DOWN = (24576, 4096), (4096, 12288)
LAYERS = 36


def rows_of(x: torch.Tensor, group: int) -> Fp8Rows:
    m, k = x.shape
    runs = x.float().view(m, k // group, group)
    amax = runs.abs().amax(-1, keepdim=True)
    q = (runs * (448.0 / amax.clamp(min=1e-30))).to(torch.float8_e4m3fn).view(m, k)
    return Fp8Rows(q, (amax / 448.0).view(m, -1).contiguous(), group, x.dtype)


def copies(n: int, k: int, dev: torch.device, count: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    count = count or min(16, max(2, -(-PASS_BYTES // (n * k))))
    return [quantize_per_channel(torch.randn(n, k, device=dev) * 0.02) for _ in range(count)]


def down_sweep(res: dict[str, Any], dev: torch.device, deadline: float) -> None:
    n, k = DOWN
    ws = copies(n, k, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    t = graph_time([partial(gemv, x, w, s) for w, s in ws], rounds=3)
    res["down:weight_only"] = {"us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM}
    print("down weight-only", round(t * 1e6, 2), "us", flush=True)
    tiles = [W8A8Config(bn, bk, w, st) for w, bn, bk, st in itertools.product((4,), (64, 128), (128, 256), (5, 4, 3))]
    jobs = [(g, p) for g in (32, 64, 128) for p in (4, 2, 1)]
    for j, (group, parts) in enumerate(jobs):
        end = time.monotonic() + (deadline - time.monotonic()) / (len(jobs) - j)
        h = rows_of(x, group)
        ref = h.dequantize() @ (ws[0][0].float() * ws[0][1][:, None]).T
        rows = []
        for cfg in tiles:
            if time.monotonic() > end:
                break
            try:
                y = gemv(h, *ws[0], config=cfg, parts=parts)
                y = y.sum(1) if parts > 1 else y
                if ((y.float() - ref).abs().max() / ref.abs().max()).item() > 0.02:
                    raise RuntimeError("wrong result")
                t = graph_time([partial(gemv, h, w, s, config=cfg, parts=parts) for w, s in ws], rounds=3)
            except Exception as e:
                rows.append({"cfg": str(cfg), "error": f"{type(e).__name__}: {str(e)[:100]}"})
                continue
            rows.append({"cfg": str(cfg), "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res[f"down:g{group}:p{parts}"] = {"top3": ok[:3], "tried": len(rows)}
        print(f"down g{group} p{parts}", ok[:1], flush=True)
    del ws
    torch.cuda.empty_cache()


def gate_up_times(res: dict[str, Any], dev: torch.device) -> None:
    n, k = GATE_UP
    ws = copies(n, k, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    for cfg in (config_for(ws[0][0]), GemvConfig(64, 256, 4, 3), GemvConfig(64, 128, 4, 4), GemvConfig(64, 512, 4, 3)):
        for quant in (False, True):
            fn = swiglu_fp8 if quant else partial(gemv, swiglu=True)
            try:
                t = graph_time([partial(fn, x, w, s, config=cfg) for w, s in ws], rounds=3)
            except Exception as e:
                res[f"gate_up:{cfg}:{quant}"] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                continue
            out = "fp8_out" if quant else "bf16_out"
            res[f"gate_up:{cfg}:{out}"] = {"us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM}
            print("gate_up", cfg, "fp8 out" if quant else "bf16 out", round(t * 1e6, 2), "us", flush=True)
    del ws
    torch.cuda.empty_cache()


def mlp_chain(res: dict[str, Any], dev: torch.device) -> None:
    gu = copies(*GATE_UP, dev, LAYERS)
    dn = copies(*DOWN, dev, LAYERS)
    x = torch.randn(1, GATE_UP[1], device=dev, dtype=torch.bfloat16)
    total = (GATE_UP[0] * GATE_UP[1] + DOWN[0] * DOWN[1]) * LAYERS

    def weight_only(i: int) -> None:
        gemv(gemv(x, *gu[i], swiglu=True), *dn[i])

    def w8a8(i: int, cfg: GemvConfig | None) -> None:
        h = swiglu_fp8(x, *gu[i], config=cfg)
        gemv(h, *dn[i], parts=w8a8_parts(dn[i][0]))

    plans = {"weight_only": weight_only, "w8a8_table_tile": partial(w8a8, cfg=None),
             "w8a8_g64": partial(w8a8, cfg=GemvConfig(64, 256, 4, 3))}  # fmt: skip
    for label, fn in plans.items():
        t = graph_time([partial(fn, i) for i in range(LAYERS)], rounds=5) * LAYERS
        res[f"mlp_chain:{label}"] = {"us": t * 1e6, "pct_hbm": 100 * total / t / HBM}
        print("mlp chain", label, round(t * 1e6, 1), "us", round(100 * total / t / HBM, 1), "%", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=150.0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    start = time.monotonic()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    mlp_chain(res, dev)
    gate_up_times(res, dev)
    down_sweep(res, dev, start + a.seconds)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
