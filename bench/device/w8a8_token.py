"""FP8 x FP8 at one token on Hopper's warp-group MMA, activations quantized before the kernel (issue #29).

At one token the engine multiplies FP8 weights by bf16 activations: each weight byte is widened and multiplied on
the CUDA cores (qkv / o / down, ``_gemv_token_kernel``) or widened into the tensor cores' operand (gate/up with its
SwiGLU), which streams qkv / o / down at 47-57% of 4.8 TB/s and gate/up at 76% (docs/engine.md, fifth and ninth
rounds). The third round's FP8 x FP8 try quantized the activation inside every program (an amax pass and a division
per element in each of ~100 programs) and reached 6-25%. Here the activation arrives already in FP8 with its
scales, as a norm or an activation kernel before could write it, so the loop is only the weight's stream into the
MMA with no widening at all. Candidates:

- ``w8a8``: ``W[BLOCK_N, K] @ xq[16, K].T`` with both FP8 (the weight the first operand: 64-128 rows, warp-group
  MMA), one float32 scale per token applied at the end;
- ``w8a8g``: the same with a scale per token and 128 columns (finer than per token; a producer whose programs each
  hold a slice of the row, such as attention's heads or SwiGLU's tiles, can write it without a cross-program amax);
- either cut into ``parts`` along K, float32 parts left unsummed (for a consumer that sums, as the residual add +
  RMSNorm does for the o projection's parts today).

Each timing is one CUDA graph of calls that read different copies of the weight (512 MB per pass: HBM, not L2),
against the engine's own pick for that layer in the same run. Then a chain of 36 layers of qwen3-8b's projections.

    python3 bench/device/w8a8_token.py --json $OUT/w8a8.json [--seconds 200]
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

from engine.kernels.pdl import enter, leave_loop

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 36
GROUP = 128
HBM = 4.8e12
LABELS = {False: "w8a8", True: "w8a8g", "engine": "engine8"}
PASS_BYTES = 512 << 20


@triton.jit
def _w8a8_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, stride_x, stride_xs, stride_w, stride_out,
    K: tl.constexpr, K_SPLIT: tl.constexpr, GROUPED: tl.constexpr, GROUP: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    part = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            k = part * K_SPLIT + k0 + g * GROUP + tl.arange(0, GROUP)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :])
            if GROUPED:
                s = tl.load(xs_ptr + rm * stride_xs + (part * K_SPLIT + k0) // GROUP + g, mask=m_ok, other=0.0)
                acc += tl.dot(w, tl.trans(x)) * s[None, :]
            else:
                acc = tl.dot(w, tl.trans(x), acc)
            if SWIGLU:
                u = tl.load(w_rows + N * stride_w + k[None, :])
                if GROUPED:
                    acc_up += tl.dot(u, tl.trans(x)) * s[None, :]
                else:
                    acc_up = tl.dot(u, tl.trans(x), acc_up)
    leave_loop(PDL)
    y = tl.trans(acc)
    if not GROUPED:
        y = y * tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)[:, None]
    y = y * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    dt = out_ptr.dtype.element_ty
    if SWIGLU:
        up = tl.trans(acc_up)
        if not GROUPED:
            up = up * tl.load(xs_ptr + rm * stride_xs, mask=m_ok, other=0.0)[:, None]
        up = up * tl.load(ws_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
        gate = y.to(dt).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_out + part * N + rn[None, :]
    tl.store(out, y.to(dt), mask=m_ok[:, None] & n_ok[None, :])


def w8a8(xq, xs, w, ws, out, tile, grouped: bool, swiglu: bool = False, parts: int = 1, pdl: int = 0):
    """``out [M, N]`` (or float32 ``[M, parts, N]``) = dequantized ``xq @ w.T``; ``tile`` (block_n, block_k, warps,
    stages)."""
    bn, bk, warps, stages = tile
    m, k = xq.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    k_split = k // parts
    extra = {"launch_pdl": True} if pdl else {}
    _w8a8_kernel[(triton.cdiv(n, bn), parts)](
        xq, xs, w, ws, out, m, n, xq.stride(0), xs.stride(0), w.stride(0), out.stride(0),
        K=k, K_SPLIT=k_split, GROUPED=grouped, GROUP=GROUP, SWIGLU=swiglu,
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip
    return out


def quantize(x: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 activations with float32 scales per token ``[M, 1]`` or per token and 128 columns ``[M, K/128]``."""
    m, k = x.shape
    xg = x.float().view(m, k // GROUP, GROUP) if grouped else x.float().view(m, 1, k)
    s = (xg.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    q = (xg / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, s.view(m, -1).contiguous()


def reference(xq, xs, w, ws, grouped: bool) -> torch.Tensor:
    m, k = xq.shape
    x = xq.float().view(m, -1, GROUP if grouped else k) * xs.view(m, -1, 1)
    return (x.view(m, k) @ w.float().T) * ws[None, :]


def tiles(k: int, parts: int) -> list[tuple[int, int, int, int]]:
    return [  # the likeliest first (4 warps, 64 rows: the first call's winners), since a job stops at its deadline
        (bn, bk, warps, stages)
        for warps, bn, bk, stages in itertools.product((4, 8), (64, 128), (128, 256, 512), (5, 4, 3, 6))
        if (k // parts) % bk == 0 and bn * bk <= 65536 and not (bn == 128 and warps == 4 and bk == 512)
    ]


def main() -> None:
    from bench.device.fp8_tune import graph_time
    from engine.kernels.gemv import W8A8Config, gemv
    from engine.models.quant import quantize_per_channel

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=200.0)
    ap.add_argument(
        "--variants",
        default="engine8,w8a8,w8a8g",
        help="of engine8 (the engine's kernel, quantizing in "
        "each program), w8a8 (per token, quantized before), w8a8g (per 128 columns, quantized before)",
    )
    a = ap.parse_args()
    dev = torch.device("cuda")
    start = time.monotonic()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    best: dict[str, tuple[str, Any, float]] = {}
    # grouped: False per token, True per 128 columns (both quantized before the kernel), "engine" the engine's
    # W8A8 kernel (gemv(..., w8a8=True)), which quantizes per 128 columns in each program from bf16 activations.
    variants = [v for v in ("engine", False, True) if LABELS[v] in a.variants.split(",")]
    jobs = [(name, grouped, parts) for name in SHAPES for grouped in variants for parts in (1, 2, 4)
            if not (name == "gate_up" and parts > 1) and not (grouped is True and parts == 1)]  # fmt: skip
    sweep_end = start + 0.75 * a.seconds
    weights_of: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for j, (name, grouped, parts) in enumerate(jobs):
        n, k = SHAPES[name]
        swiglu = name == "gate_up"
        deadline = time.monotonic() + (sweep_end - time.monotonic()) / (len(jobs) - j)
        if name not in weights_of:
            weights_of.clear()
            torch.cuda.empty_cache()
            copies = min(16, max(2, -(-PASS_BYTES // (n * k))))
            weights_of[name] = [quantize_per_channel(torch.randn(n, k, device=dev) * 0.02) for _ in range(copies)]
        ws_ = weights_of[name]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize(x, grouped is not False)
        nout = n // 2 if swiglu else n
        rows: list[dict[str, Any]] = []
        if (grouped, parts) == ("engine", 1):  # the engine's weight-only pick for this layer, bf16 activations
            t = graph_time([partial(gemv, x, w, s, swiglu=swiglu) for w, s in ws_], rounds=3)
            res["shapes"][f"{name}:engine"] = {"us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM}
            best[f"{name}:engine"] = ("engine", None, t * 1e6)
            print(name, "engine", round(t * 1e6, 2), "us", round(100 * n * k / t / HBM, 1), "%", flush=True)
        ref = reference(xq, xs, ws_[0][0], ws_[0][1], grouped is not False)
        if swiglu:
            g, u = ref[:, :nout], ref[:, nout:]
            g = g.bfloat16().float()
            ref = (g * torch.sigmoid(g)).bfloat16().float() * u.bfloat16().float()
        for tile in tiles(k, parts):
            if time.monotonic() > deadline:
                break
            out = torch.empty(1, parts, nout, device=dev, dtype=torch.float32) if parts > 1 else \
                torch.empty(1, nout, device=dev, dtype=torch.bfloat16)  # fmt: skip
            try:
                if grouped == "engine":
                    cfg = W8A8Config(*tile)
                    y = gemv(x, *ws_[0], swiglu=swiglu, config=cfg, parts=parts)
                    calls = [partial(gemv, x, w, s, swiglu=swiglu, config=cfg, parts=parts) for w, s in ws_]
                else:
                    y = w8a8(xq, xs, ws_[0][0], ws_[0][1], out, tile, grouped, swiglu, parts)
                    calls = [partial(w8a8, xq, xs, w, s, out, tile, grouped, swiglu, parts) for w, s in ws_]
                y = y.sum(1) if parts > 1 else y
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if err > 0.03:
                    raise RuntimeError(f"wrong result ({err:.4f})")
                t = graph_time(calls, rounds=3)
            except Exception as e:
                rows.append({"tile": tile, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                continue
            rows.append({"tile": tile, "us": t * 1e6, "pct_hbm": 100 * n * k / t / HBM})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        label = f"{name}:{LABELS[grouped]}:p{parts}"
        res["shapes"][label] = {"top5": ok[:5], "tried": len(rows), "errors": [r for r in rows if "error" in r][:3]}
        if ok:
            best[label] = ("w8a8", (ok[0]["tile"], grouped, parts), ok[0]["us"])
        print(label, ok[:1], "errors", len(rows) - len(ok), flush=True)
    weights_of.clear()
    torch.cuda.empty_cache()
    res["chain"] = chain(best, dev, start + a.seconds)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


def chain(best: dict[str, tuple[str, Any, float]], dev: torch.device, deadline: float) -> dict[str, Any]:
    """36 layers' four projections in one graph: the engine's picks, then W8A8 per token / per group at their best
    tiles (parts where they won, unsummed), each with PDL off and with the next kernel let in after the loop."""
    from bench.device.fp8_tune import graph_time
    from engine.kernels.gemv import gemv
    from engine.models.quant import quantize_per_channel

    layers = {nm: [quantize_per_channel(torch.randn(*SHAPES[nm], device=dev) * 0.02) for _ in range(LAYERS)]
              for nm in SHAPES}  # fmt: skip
    total = sum(n * k for n, k in SHAPES.values()) * LAYERS
    out: dict[str, Any] = {"bytes": total}
    xs16 = {nm: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for nm, (n, k) in SHAPES.items()}

    def engine_calls():
        return [partial(gemv, xs16[nm], *layers[nm][i], swiglu=nm == "gate_up") for i in range(LAYERS) for nm in SHAPES]

    def w8a8_calls(grouped: bool, pdl: int, quant: bool = False):
        from engine.kernels.fp8 import per_token_quant

        calls = []
        for nm, (n, _) in SHAPES.items():
            keys = [f"{nm}:{'w8a8g' if grouped else 'w8a8'}:p{p}" for p in (1, 2, 4)]
            tile, _, parts = min((best[key] for key in keys if key in best), key=lambda b: b[2])[1]
            xq, xsc = quantize(xs16[nm], grouped)
            nout = n // 2 if nm == "gate_up" else n
            o = torch.empty(1, parts, nout, device=dev, dtype=torch.float32) if parts > 1 else \
                torch.empty(1, nout, device=dev, dtype=torch.bfloat16)  # fmt: skip
            calls.append((nm, partial(w8a8, xq=xq, xs=xsc, tile=tile, grouped=grouped, swiglu=nm == "gate_up",
                                      parts=parts, pdl=pdl, out=o)))  # fmt: skip
        fns = dict(calls)
        if not quant:
            return [partial(fns[nm], w=layers[nm][i][0], ws=layers[nm][i][1]) for i in range(LAYERS) for nm in SHAPES]

        def quantized(nm: str, i: int) -> None:  # the activation quantized by its own launch first
            q, s = per_token_quant(xs16[nm], torch.float8_e4m3fn, 448.0, 1 / 448.0, 1e-12)
            fns[nm](xq=q, xs=s, w=layers[nm][i][0], ws=layers[nm][i][1])

        return [partial(quantized, nm, i) for i in range(LAYERS) for nm in SHAPES]

    def engine8_calls():  # the engine's W8A8 kernel where it will run it: o and down in parts, gate/up
        from engine.kernels.gemv import W8A8Config

        picks = {}
        for nm in ("o", "gate_up", "down"):
            keys = [f"{nm}:engine8:p{p}" for p in (1, 2, 4)]
            hit = [best[key] for key in keys if key in best]
            if hit:
                tile, _, parts = min(hit, key=lambda b: b[2])[1]
                picks[nm] = {"config": W8A8Config(*tile), "parts": parts}
        out["engine8_picks"] = {nm: [str(p["config"]), p["parts"]] for nm, p in picks.items()}
        return [partial(gemv, xs16[nm], *layers[nm][i], swiglu=nm == "gate_up", **picks.get(nm, {}))
                for i in range(LAYERS) for nm in SHAPES]  # fmt: skip

    plans = [("engine", engine_calls), ("engine8", engine8_calls)]
    for grouped in (False, True):
        if not any(key.split(":")[1] == LABELS[grouped] for key in best):
            continue
        for pdl in (0, 2):
            plans.append((f"{'w8a8g' if grouped else 'w8a8'}_pdl{pdl}", partial(w8a8_calls, grouped, pdl)))
    plans.append(("w8a8_pdl2_with_quant_launches", partial(w8a8_calls, False, 2, True)))
    for label, make in plans:
        if time.monotonic() > deadline:
            break
        try:
            calls = make()
            t = graph_time(calls, rounds=5) * len(calls)
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            print("chain", label, out[label], flush=True)
            continue
        out[label] = {"us": t * 1e6, "pct_hbm": 100 * total / t / HBM}
        print("chain", label, round(t * 1e6, 1), "us", round(100 * total / t / HBM, 1), "%", flush=True)
    return out


if __name__ == "__main__":
    main()
