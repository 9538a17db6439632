"""The linear layers of a decode step, chained as in the model and replayed in one CUDA graph, with programmatic
dependent launch off and on (engine.kernels.pdl): what PDL buys where a step is made of many short kernels.
Qwen3-8B's shapes (hidden 4096, 36 layers, qkv 6144, gate/up 2 x 12288), one to a few tokens; per layer: add +
RMSNorm, qkv, o, add + RMSNorm, gate/up with SwiGLU, down. No attention. Every layer has its own weights, so they
stream from HBM as in the model.

    python3 bench/device/pdl_chain.py --json OUT.json [--tokens 1 8] [--fp8]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.device.fp8_tune import graph_time
from engine.kernels import gemv as g
from engine.kernels import triton_ops as k

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 12288, 36
Layers = list[dict[str, torch.Tensor | None]]


def make_layers(fp8: bool) -> Layers:
    layers = []
    for _ in range(LAYERS):
        layer: dict[str, torch.Tensor | None] = {}
        for name, n, kk in (("qkv", QKV, HIDDEN), ("o", HIDDEN, HIDDEN), ("gu", 2 * INTER, HIDDEN),
                            ("down", HIDDEN, INTER)):  # fmt: skip
            w = torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02
            if fp8:
                scale = w.abs().amax(1).float() / 448.0
                layer[name] = (w / scale[:, None]).to(torch.float8_e4m3fn)
                layer[name + "_s"] = scale
            else:
                layer[name] = w
                layer[name + "_s"] = None
        layer["n1"] = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        layer["n2"] = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        layers.append(layer)
    return layers


def chain(x: torch.Tensor, layers: Layers) -> torch.Tensor:
    res = x
    h = x
    for layer in layers:
        h, res = k.add_rms_norm(h, res, layer["n1"], 1e-6)  # type: ignore[arg-type]
        qkv = g.gemv(h, layer["qkv"], layer["qkv_s"])  # type: ignore[arg-type]
        h = g.gemv(qkv[:, :HIDDEN], layer["o"], layer["o_s"])  # type: ignore[arg-type]
        h, res = k.add_rms_norm(h, res, layer["n2"], 1e-6)  # type: ignore[arg-type]
        h = g.gemv(h, layer["gu"], layer["gu_s"], swiglu=True)  # type: ignore[arg-type]
        h = g.gemv(h, layer["down"], layer["down_s"])  # type: ignore[arg-type]
    return h


def time_graph(x: torch.Tensor, layers: Layers) -> tuple[float, torch.Tensor]:
    """Microseconds per replay of the chain in one CUDA graph, and what the graph computed."""
    result: dict[str, torch.Tensor] = {}

    def run() -> None:
        result["out"] = chain(x, layers)  # captured: the graph's own output buffer, which its replays fill

    seconds = graph_time([run], rounds=20)
    return seconds * 1e6, result["out"].clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    rows = []
    for fp8 in [False, True] if args.fp8 else [False]:
        layers = make_layers(fp8)
        wbytes = sum(t.numel() * t.element_size() for layer in layers for t in layer.values() if t is not None)
        for tokens in args.tokens:
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            configs = [("off", "0"), ("on", "1")]
            ref = None
            for label, pdl in [*configs, *configs]:  # twice: the spread between two runs
                os.environ["ENGINE_PDL"] = pdl
                us, out = time_graph(x, layers)
                same = True if ref is None else bool(torch.equal(out, ref))
                ref = out if ref is None else ref
                row = {"fp8": fp8, "tokens": tokens, "pdl": label, "us": round(us, 1),
                       "weight_gb": round(wbytes / 1e9, 2), "tb_s": round(wbytes / us / 1e6, 3),
                       "equal_to_off": same}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        del layers
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
