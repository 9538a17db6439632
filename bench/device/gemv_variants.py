"""Two ways to keep more FP8 weight bytes in flight in a skinny matmul, against the engine's kernel, on the H200.

At one token the engine's FP8 kernel streams qkv / o / down at 35-46% of HBM bandwidth where the fused gate/up
(two weight tiles per step, 384 programs) reaches 75% (bench/device/fp8_tune.py, 2026-12-02). Candidates:

- split-K: ``S`` programs share each row tile, each over ``K / S`` columns, writing float32 partials that a second
  kernel sums, scales and casts (more programs per SM, each with the same tile);
- dual: each step of the loop reads two slices of the row tile, ``k0`` and ``k0 + K/2`` (two loads in flight).

Weights rotate over copies (512 MB per pass) so that they stream from HBM. Bench-local kernels: the winner, if
any, moves into ``engine.kernels.gemv``.

    python3 bench/device/gemv_variants.py --json $OUT/gemv-variants.json
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from bench.device.fp8_tune import HBM, PASS_BYTES, graph_time
from engine.kernels.gemv import config_for, gemv
from engine.models.quant import Fp8Linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288)}


@triton.jit
def _partial_kernel(
    x_ptr, w_ptr, part_ptr, M, N, stride_x, stride_w, K: tl.constexpr, K_SPLIT: tl.constexpr, DUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lo = s * K_SPLIT
    if DUAL:
        half: tl.constexpr = K_SPLIT // 2
        for k0 in range(0, half, BLOCK_K):
            ka = lo + k0 + rk
            kb = ka + half
            xa = tl.load(x_rows + ka[None, :], mask=m_ok[:, None] & (ka < K)[None, :], other=0.0)
            wa = tl.load(w_rows + ka[None, :], mask=n_ok[:, None] & (ka < K)[None, :], other=0.0)
            xb = tl.load(x_rows + kb[None, :], mask=m_ok[:, None] & (kb < K)[None, :], other=0.0)
            wb = tl.load(w_rows + kb[None, :], mask=n_ok[:, None] & (kb < K)[None, :], other=0.0)
            acc += tl.dot(xa.to(tl.float16), tl.trans(wa.to(tl.float16)))
            acc += tl.dot(xb.to(tl.float16), tl.trans(wb.to(tl.float16)))
    else:
        for k0 in range(0, K_SPLIT, BLOCK_K):
            k = lo + k0 + rk
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    out = part_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _reduce_kernel(part_ptr, scale_ptr, out_ptr, M, N, S: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=ok, other=0.0)
    acc = acc * tl.load(scale_ptr + rn, mask=ok, other=0.0)
    tl.store(out_ptr + m.to(tl.int64) * N + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def variant(x, w, scale, splits: int, dual: bool, bn: int, bk: int, warps: int, stages: int, part, out):
    m, k = x.shape
    n = w.shape[0]
    k_split = k // splits
    if k % (splits * (2 if dual else 1) * bk):
        raise ValueError("the columns must split evenly into the slices")
    _partial_kernel[(triton.cdiv(n, bn), splits)](
        x, w, part, m, n, x.stride(0), w.stride(0), k, k_split, dual,
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _reduce_kernel[(m, triton.cdiv(n, 1024))](part, scale, out, m, n, splits, BLOCK=1024)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=120.0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    deadline = time.monotonic() + a.seconds
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        shape_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(SHAPES) - i)
        copies = min(16, max(2, -(-PASS_BYTES // (n * k))))
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        layers = []
        for _ in range(copies):
            layer = Fp8Linear(k, n).to(dev)
            layer.load_rows(0, w16)
            layers.append((layer.weight, layer.weight_scale))
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = gemv(x, *layers[0]).float()
        t = graph_time([partial(gemv, x, w, s) for w, s in layers], rounds=3)
        row: dict[str, Any] = {
            "engine": {"cfg": str(config_for(layers[0][0])), "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM}
        }
        print(name, "engine", row["engine"], flush=True)
        runs: list[dict[str, Any]] = []
        for splits, dual, bn, bk, warps, stages in itertools.product(
            (1, 2, 4), (False, True), (32, 64), (256, 512), (4,), (3, 4)
        ):
            if time.monotonic() > shape_deadline or (splits == 1 and not dual):
                continue
            part = torch.empty(splits, 1, n, device=dev, dtype=torch.float32)
            out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            label = f"splits={splits} dual={dual} block_n={bn} block_k={bk} warps={warps} stages={stages}"
            try:
                y = variant(x, *layers[0], splits, dual, bn, bk, warps, stages, part, out).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if err > 0.02:
                    raise RuntimeError(f"wrong result ({err:.3f})")
                calls = [partial(variant, x, w, s, splits, dual, bn, bk, warps, stages, part, out) for w, s in layers]
                t = graph_time(calls, rounds=3)
            except Exception as e:
                runs.append({"variant": label, "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            runs.append({"variant": label, "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM})
        ok = sorted((r for r in runs if "us" in r), key=lambda r: r["us"])
        row["top5"] = ok[:5]
        row["errors"] = [r for r in runs if "error" in r][:3]
        print(name, "best", ok[:3], flush=True)
        res[name] = row
        del layers
        torch.cuda.empty_cache()
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
