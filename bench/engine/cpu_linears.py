"""``python -m bench.engine.cpu_linears``: a model's linear layers over a few rows on the CPU, three ways.

Every ``nn.Linear`` of the model (SmolLM2 embedded unless ``--model``), float32, over 1 .. N rows: torch's
``linear`` (GEMV for one row, MKL's GEMM from 4), the weights packed for oneDNN, and packed for the engine's
own kernel (``engine/cpu_gemm.c``; engine.cpu_packed). Printed per row count: the time of one pass over all the
layers (the matmuls of one step, the LM head included), the best of ``--repeats`` interleaved, and its ratio to
torch's one-row pass (what a plain decode step spends there). Run with ``--threads 1``: the native kernel runs
on one thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.args import EngineArgs
from engine.cpu_packed import PackedCpuOps, build_cpu_gemm
from engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.cpu_linears", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 9, 13, 17, 33])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    # A plain engine's model: the weights as served (float32), nothing packed yet.
    model = LLMEngine(EngineArgs(model=a.model, device="cpu", dtype="float32", max_model_len=256,
                                 num_kvcache_blocks=16)).runner.model  # fmt: skip
    layers = list({id(m): m for m in model.modules() if type(m) is nn.Linear}.values())
    build = build_cpu_gemm()
    if build.gemm is None:
        raise SystemExit(f"the native kernel cannot be built here: {build.why_not}")
    ops = {"torch": None, "onednn": PackedCpuOps(model), "native": PackedCpuOps(model, build.gemm)}

    def one_pass(op: PackedCpuOps | None, xs: dict[int, torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                x = xs[layer.in_features]
                layer(x) if op is None else op.linear(layer, x)

        return run

    rows_out: list[dict[str, float]] = []
    base = 0.0
    with torch.no_grad():
        for rows in a.rows:
            xs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
            best = dict.fromkeys(ops, float("inf"))
            for op in ops.values():
                one_pass(op, xs)()  # warm-up
            for _ in range(a.repeats):  # interleaved: the shared machine's load moves
                for name, op in ops.items():
                    t0 = time.perf_counter()
                    one_pass(op, xs)()
                    best[name] = min(best[name], time.perf_counter() - t0)
            base = base or best["torch"]
            row = {"rows": rows, **{f"{n}_ms": v * 1e3 for n, v in best.items()},
                   **{f"{n}_ratio": v / base for n, v in best.items()}}  # fmt: skip
            rows_out.append(row)
            print(f"{rows:3d} rows: " + ", ".join(f"{n} {v * 1e3:6.1f} ms (x{v / base:.2f})" for n, v in best.items()),
                  flush=True)  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": a.model,
                       "layers": len(layers), "args": vars(a), "results": rows_out}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
