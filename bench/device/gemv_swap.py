"""Three more shapes of the batch-1 skinny matmul, against the engine's kernel, on the H200 (issue #29).

The engine's kernel (``engine.kernels.gemv``) computes ``x[16, K] @ W[N, K].T`` with the weight as the *second*
operand of ``tl.dot``; below 64 rows Triton feeds that to the tensor cores through ``mma.sync``, and an FP8 weight
is widened on its way there. At one token it streams FP8 qkv / o / down at 35-46% of HBM bandwidth where bf16
reaches 60-78% (bench/device/fp8_tune.py, 2026-12-02). Candidates:

- ``swap``: ``W[BLOCK_N, K] @ x[16, K].T``, the weight the first operand (64-128 rows: Hopper's warp-group MMA,
  which takes its first operand from registers, where the FP8 bytes are widened), as CUTLASS and vLLM do for
  small batches ("swap AB");
- ``core``: no tensor cores (one token): each program multiplies a ``[BLOCK_N, BLOCK_K]`` tile by ``x`` on the
  CUDA cores in float32 and sums along K once at the end; optionally split along K over ``S`` programs whose
  float32 partials a second kernel sums. It won for FP8 and is now the engine's (``TokenConfig``), which this bench
  calls (the 2026-12-02 figures came from the bench's own copy, the same arithmetic without edge masks);
- ``pdl``: the engine's kernel launched with programmatic dependent launch (Hopper): each program lets the next
  kernel launch at once and waits for the previous one before reading ``x``, so launches overlap tails.

Each timing is one CUDA graph of calls that read different copies of the weight (512 MB per pass: HBM, not L2).
Then the ``chain``: 36 layers of qwen3-8b's four projections (qkv, o, gate/up, down), each its own weight, one
graph per variant, which is the part of a batch-1 step these kernels are (its share of 4.8 TB/s printed).

    python3 bench/device/gemv_swap.py --json $OUT/gemv-swap.json [--seconds 240]
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from bench.device.fp8_tune import HBM, PASS_BYTES, graph_time
from engine.kernels.gemv import GemvConfig, TokenConfig, config_for, gemv, token_config_for
from engine.models.quant import quantize_per_channel

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 36


# The tensor-core shapes: the engine's (``x @ W.T``, the weight the second operand) or swapped (``W @ x.T``), either
# with the PDL prologue; the bench's own kernel (the engine's has neither flag). The CUDA-core family is the engine's
# own one-token kernel (``TokenConfig``), which this bench found.
@triton.jit
def _tc_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, stride_x, stride_w, stride_out, K: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP16_DOT: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    # acc[i, j] is output (row m, channel n) = (j, i) swapped, (i, j) not.
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        if FP16_DOT:
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        if SWAP:
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w))
    if SWAP:
        acc = tl.trans(acc)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tensor_cores(x, w, scale, out, cfg: GemvConfig, swap: bool, pdl: bool):
    m, k = x.shape
    n = w.shape[0]
    extra = {"launch_pdl": True} if pdl else {}
    _tc_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, scale if scale is not None else x, out, m, n, x.stride(0), w.stride(0), out.stride(0), k,
        HAS_SCALE=scale is not None, FP16_DOT=w.element_size() == 1 or x.dtype == torch.float16, SWAP=swap, PDL=pdl,
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **extra,
    )  # fmt: skip
    return out


def weights(n: int, k: int, fp8: bool, copies: int, dev: torch.device) -> list[tuple[torch.Tensor, Any]]:
    """``copies`` random weights (FP8: quantized per channel as the engine loads them)."""
    out: list[tuple[torch.Tensor, Any]] = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        out.append(quantize_per_channel(w.float()) if fp8 else (w, None))
    return out


Config = GemvConfig | TokenConfig
# "name:family" -> (family, tile, microseconds) of the best tile of a family for a shape
Best = dict[str, tuple[str, Config, float]]


def candidates(n: int, k: int) -> list[tuple[str, Config]]:
    """(family, tile) pairs to time for one shape: swap on the tensor cores, core the engine's one-token kernel."""
    c: list[tuple[str, Config]] = []
    for bn, bk, warps, stages in itertools.product((64, 128), (128, 256, 512), (4, 8), (3, 4, 5)):
        if not (bn == 128 and warps == 4 and bk == 512):
            c.append(("swap", GemvConfig(bn, bk, warps, stages)))
    for bn, bk, warps, stages, splits in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (2, 3), (1, 2, 4)):
        if bn * bk <= 16384 and k % (splits * bk) == 0:
            c.append(("core", TokenConfig(bn, bk, warps, stages, splits)))
    return c


def call_of(family: str, cfg: Config, x, w, s, out, pdl: bool = False) -> Callable[[], Any]:
    """One call of a family's kernel; PDL is the tensor-core kernels' (the engine's shape or swapped)."""
    if family == "core":
        if pdl:
            raise ValueError("the one-token kernel has no PDL prologue")
        return partial(gemv, x, w, s, config=cfg)
    assert isinstance(cfg, GemvConfig)
    if family == "engine" and not pdl:
        return partial(gemv, x, w, s, config=cfg)
    return partial(tensor_cores, x, w, s, out, cfg, family == "swap", pdl)


def chain(kind: str, best: Best, dev: torch.device, deadline: float) -> dict[str, Any]:
    """Seconds of 36 layers' four projections in one graph, per plan: the engine's kernel (with and without PDL),
    the swap family at its best tiles (with and without PDL), and per shape whichever of swap and core won."""
    fp8 = kind == "fp8"
    esize = 1 if fp8 else 2
    layers = {name: weights(*SHAPES[name], fp8, LAYERS, dev) for name in SHAPES}
    total = sum(n * k * esize for n, k in SHAPES.values()) * LAYERS
    xs = {name: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    outs = {name: torch.empty(1, n, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}

    def pick(family: str, name: str) -> tuple[str, Config]:
        if family == "engine":
            return "engine", config_for(layers[name][0][0])
        if family == "mixed":  # per shape, whichever family won that shape
            fam, cfg, _ = min((best[f"{name}:{f}"] for f in ("swap", "core") if f"{name}:{f}" in best),
                              key=lambda b: b[2])  # fmt: skip
            return fam, cfg
        return best[f"{name}:{family}"][:2]

    plans = [("engine", "engine", False), ("engine_pdl", "engine", True)]
    if all(f"{nm}:swap" in best for nm in SHAPES):
        plans += [("swap", "swap", False), ("swap_pdl", "swap", True)]
    if all(f"{nm}:swap" in best or f"{nm}:core" in best for nm in SHAPES):
        plans.append(("mixed", "mixed", False))
    out: dict[str, Any] = {"bytes": total}
    for label, family, pdl in plans:
        if time.monotonic() > deadline:
            break
        try:
            picks = {name: pick(family, name) for name in SHAPES}
            calls = [call_of(*picks[name], xs[name], *layers[name][i], outs[name], pdl)
                     for i in range(LAYERS) for name in SHAPES]  # fmt: skip
            t = graph_time(calls, rounds=5) * len(calls)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
            continue
        picked = {n: [f, str(cfg)] for n, (f, cfg) in picks.items()}
        out[label] = {"us": t * 1e6, "pct_hbm": 100 * total / t / HBM, "picks": picked}
        print("chain", kind, label, round(t * 1e6, 1), "us", round(100 * total / t / HBM, 1), "%", flush=True)
    layers.clear()
    torch.cuda.empty_cache()
    return out


def token_sweep(json_path: str, tiles_path: str, seconds: float) -> None:
    """The engine's one-token FP8 kernel over a wider space of tiles (random order, cut at the deadline) for qkv, o
    and down; each shape's winner goes into the tiles file when it beats the packaged tile in the same run."""
    dev = torch.device("cuda")
    end = time.monotonic() + seconds
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    tiles: dict[str, list[int]] = {}
    names = ["qkv", "o", "down"]
    grid = itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4, 8), (2, 3), (1, 2, 4))
    space = [TokenConfig(bn, bk, w, st, sp) for bn, bk, w, st, sp in grid if bn * bk <= 16384]
    random.Random(0).shuffle(space)
    for i, name in enumerate(names):
        n, k = SHAPES[name]
        deadline = time.monotonic() + (end - time.monotonic()) / (len(names) - i)
        ws = weights(n, k, True, min(16, max(2, -(-PASS_BYTES // (n * k)))), dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ ws[0][0].float().T) * ws[0][1][None, :]
        today = token_config_for(ws[0][0])
        rows: list[dict[str, Any]] = []
        for cfg in [today, *space]:
            if time.monotonic() > deadline:
                break
            try:
                y = gemv(x, ws[0][0], ws[0][1], config=cfg).float()
                if ((y - ref).abs().max() / ref.abs().max()).item() > 0.02:
                    raise RuntimeError("wrong result")
                t = graph_time([partial(gemv, x, w, s, config=cfg) for w, s in ws], rounds=3)
            except Exception as e:
                rows.append({"cfg": str(cfg), "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            rows.append({"cfg": str(cfg), "tile": [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                         cfg.splits], "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM})  # fmt: skip
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res["shapes"][name] = {"today": rows[0], "top5": ok[:5], "tried": len(rows)}
        print("token", name, "today", rows[0], "best", ok[:1], flush=True)
        if ok and "us" in rows[0] and ok[0]["us"] < rows[0]["us"]:
            tiles[f"{n}x{k}"] = ok[0]["tile"]
        del ws
        torch.cuda.empty_cache()
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1)
    with open(tiles_path, "w") as f:
        json.dump({torch.cuda.get_device_name(): {"fp8_token": tiles}}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--kinds", default="fp8,bf16")
    ap.add_argument("--token-tiles", help="sweep only the one-token FP8 kernel of the engine, wider, and write the "
                    "tiles that beat the table's into this file (ENGINE_GEMV_TILES form)")  # fmt: skip
    a = ap.parse_args()
    if a.token_tiles:
        token_sweep(a.json, a.token_tiles, a.seconds)
        return
    dev = torch.device("cuda")
    start = time.monotonic()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    kinds = a.kinds.split(",")
    best: dict[str, Best] = {kind: {} for kind in kinds}
    sweep_s = 0.6 * a.seconds
    jobs = [(kind, name) for kind in kinds for name in SHAPES]
    for j, (kind, name) in enumerate(jobs):
        n, k = SHAPES[name]
        deadline = time.monotonic() + (start + sweep_s - time.monotonic()) / (len(jobs) - j)
        fp8 = kind == "fp8"
        esize = 1 if fp8 else 2
        ws = weights(n, k, fp8, min(16, max(2, -(-PASS_BYTES // (n * k * esize)))), dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ ws[0][0].float().T) * (ws[0][1][None, :] if fp8 else 1)
        eng = config_for(ws[0][0])
        todo = [("engine", eng, False), ("engine_pdl", eng, True), *((f, c, False) for f, c in candidates(n, k))]
        rows: list[dict[str, Any]] = []
        for label, cfg, pdl in todo:
            if time.monotonic() > deadline and label not in ("engine", "engine_pdl"):
                break
            family = "engine" if pdl else label
            try:
                y = call_of(family, cfg, x, *ws[0], out, pdl)()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if err > 0.02:
                    raise RuntimeError(f"wrong result ({err:.3f})")
                t = graph_time([call_of(family, cfg, x, w, s, out, pdl) for w, s in ws], rounds=3)
            except Exception as e:  # a tile that does not compile (registers, shared memory) is left out
                rows.append({"variant": f"{label} {cfg}", "error": f"{type(e).__name__}: {str(e)[:100]}"})
                continue
            us = t * 1e6
            rows.append(
                {"variant": f"{label} {cfg}", "family": label, "us": us, "pct_hbm": 100 * n * k * esize / t / HBM}
            )
            key = f"{name}:{label}"
            if label in ("swap", "core") and (key not in best[kind] or us < best[kind][key][2]):
                best[kind][key] = (label, cfg, us)
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        by_family = {
            f: next((r for r in ok if r["family"] == f), None) for f in ("engine", "engine_pdl", "swap", "core")
        }
        res["shapes"][f"{kind}:{name}"] = {"by_family": by_family, "top5": ok[:5], "tried": len(rows),
                                           "errors": [r for r in rows if "error" in r][:3]}  # fmt: skip
        print(kind, name, {f: (r["variant"], round(r["us"], 1), round(r["pct_hbm"], 1)) if r else None
                           for f, r in by_family.items()}, flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    # The chain: a step's projections, 36 layers, each family at its best tile per shape.
    res["chain"] = {kind: chain(kind, best[kind], dev, start + a.seconds) for kind in kinds}
    res["best"] = {kd: {key: {"family": f, "cfg": str(cfg), "us": us} for key, (f, cfg, us) in b.items()}
                   for kd, b in best.items()}  # fmt: skip
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
