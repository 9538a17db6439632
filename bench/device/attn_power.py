"""Decode attention as the engine's batch-256 step runs it: between the step's matmuls, with the GPU at its power cap.

``attn_gap.py`` found decode attention over an FP8 cache 1.46-1.52x faster than over a bf16 one alone, while the
engine's step is 1.23x; an nvidia-smi log of the same call showed the engine's batch-256 runs at the H200's 700 W
cap with the SM clock at 1.5-1.6 GHz, where the attention bench ran at 1.98 GHz and 130-360 W. The FP8 kernel is
bound by its programs' chains of dependent instructions, which the SM clock paces, and bf16's by HBM, which it
does not. This times each variant of the engine's decode attention in a synthetic step: 36 layers of qwen3-8b's
matmuls at 256 tokens (cuBLAS, as the engine runs them at that batch) and one attention call each, for long enough
that the power cap settles, CUDA events around every attention call; and the same calls alone.

    python3 bench/device/attn_power.py --json $OUT/attn-power.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Any

import torch

from bench.device.attn_gap import CTX, SEQS, _tables
from bench.device.fp8_tune import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, SHAPES
from engine.attention import kv_cache_shape
from engine.kernels import decode_splits
from engine.kernels.triton_ops import paged_attention

LAYERS = 36
# qwen3-8b's projections, (out, in), in a layer's order: run at 256 tokens.
MATMULS = tuple(SHAPES[name] for name in ("qkv", "o", "gate_up", "down"))
# name: (cache dtype, paged_attention's tile fields, splits (0: the engine's)). ``--variants`` replaces the FP8 ones.
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "bf16": ("bf16", {}, 0),
    "fp8": ("fp8", {}, 0),
    "fp8 lazy": ("fp8", {"lazy_rescale": True}, 0),
    "fp8 masked": ("fp8", {"unmasked": False}, 0),
    "fp8 masked lazy": ("fp8", {"unmasked": False, "lazy_rescale": True}, 0),
}


def _step(weights: list[torch.Tensor], xs: list[torch.Tensor], attn: Any, events: list[Any] | None) -> None:
    for layer in range(LAYERS):
        torch.matmul(xs[0], weights[0].t())
        if events is not None:
            events[2 * layer].record()
        attn()
        if events is not None:
            events[2 * layer + 1].record()
        for i in (1, 2, 3):
            torch.matmul(xs[i], weights[i].t())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--warm-s", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=1.5)
    p.add_argument(
        "--variants",
        default="",
        help='JSON {"name": [tile fields, splits]} of FP8 variants to time '
        'beside bf16 and the engine\'s FP8 tile, e.g. {"fp8 168 regs, 3 splits": [{"max_registers": 168}, 3]}',
    )
    a = p.parse_args()
    variants = dict(VARIANTS)
    if a.variants:
        variants = {k: v for k, v in VARIANTS.items() if k in ("bf16", "fp8")}
        variants |= {k: ("fp8", fields, splits) for k, (fields, splits) in json.loads(a.variants).items()}
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ragged = torch.randint(CTX + 1, CTX + 51, (SEQS,), generator=gen, dtype=torch.int32)
    pool = 3 * SEQS * (CTX // BLOCK_SIZE + 4)
    tables = _tables(ragged, True, pool, gen).to(dev)  # the engine's case: ragged contexts, blocks in order
    lens = ragged.to(dev)
    q = torch.randn(SEQS, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    qstart = torch.arange(SEQS + 1, device=dev, dtype=torch.int32)
    cache16 = torch.randn(kv_cache_shape(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device=dev, dtype=torch.bfloat16)
    caches = {"bf16": cache16, "fp8": cache16.to(torch.float8_e4m3fn)}
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in MATMULS]
    xs = [torch.randn(SEQS, k, device=dev, dtype=torch.bfloat16) for _, k in MATMULS]
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "runs": {}}
    for name, (dtype, extra, forced) in variants.items():
        cache = caches[dtype]
        splits = forced or decode_splits(SEQS, KV_HEADS, int(ragged.max()), dev, fp8=dtype == "fp8")
        attn = partial(paged_attention, q, cache, tables, qstart, lens, HEAD_DIM**-0.5, 1, CTX + 64, splits, **extra)
        attn()
        torch.cuda.synchronize()
        # Alone: the calls back to back, as attn_gap.py times them (the clock stays high).
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * LAYERS)]  # type: ignore[no-untyped-call]
        for i in range(LAYERS):
            ev[2 * i].record()
            attn()
            ev[2 * i + 1].record()
        torch.cuda.synchronize()
        alone = statistics.median(ev[2 * i].elapsed_time(ev[2 * i + 1]) * 1e3 for i in range(LAYERS))
        # In a step: warm until the power cap has settled, then time every attention call of each step.
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.warm_s:
            _step(weights, xs, attn, None)
            torch.cuda.synchronize()
        times: list[float] = []
        steps: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.measure_s:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * LAYERS)]  # type: ignore[no-untyped-call]
            s0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            s1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            s0.record()
            _step(weights, xs, attn, ev)
            s1.record()
            torch.cuda.synchronize()
            times += [ev[2 * i].elapsed_time(ev[2 * i + 1]) * 1e3 for i in range(LAYERS)]
            steps.append(s0.elapsed_time(s1) * 1e3)
        r = {"fields": extra, "splits": splits, "forced": bool(forced), "alone_us": alone,
             "in_step_us": statistics.median(times), "step_us": statistics.median(steps),
             "steps": len(steps)}  # fmt: skip
        out["runs"][name] = r
        print("attention", name, {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()},
              time.strftime("%T"), flush=True)  # fmt: skip
    runs = out["runs"]
    out["bf16_over_fp8"] = {k: {"alone": runs["bf16"]["alone_us"] / v["alone_us"],
                                "in_step": runs["bf16"]["in_step_us"] / v["in_step_us"],
                                "step": runs["bf16"]["step_us"] / v["step_us"]}
                            for k, v in runs.items() if k != "bf16"}  # fmt: skip
    for k, v in out["bf16_over_fp8"].items():
        print("bf16 over", k, {x: round(y, 3) for x, y in v.items()}, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
