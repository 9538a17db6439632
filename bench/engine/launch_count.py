"""Kernel launches of one batch-1 decode step on the Triton path, fused decode kernels off and on.

Runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set here), with the layer structure of
a served shape (its family and number of layers; tiny widths, which do not change what a step launches):
every Triton kernel launched and every torch op that would launch a CUDA kernel (views and allocations
excluded) inside the model's forward and logits, counted per step. A CUDA graph replays the same launches.

    python -m bench.engine.launch_count [--shapes qwen3-8b qwen3-30b-a3b] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.config import parse_hf_config
from engine.models.loader import LoadedModel, in_memory
from engine.sequence import SamplingParams
from engine.tokenizer import ByteTokenizer

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
         "tie_word_embeddings": False}  # fmt: skip
# The served shapes' family and depth (bench/device model_shapes.py); widths as _TINY.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
}
# Ops that launch nothing on a GPU: allocations and metadata.
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "_local_scalar_dense", "sym_size", "sym_stride", "is_same_size"}  # fmt: skip


class _TorchLaunches(TorchDispatchMode):
    """Counts torch ops that run a kernel (not views, not allocations) while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.on and not func.is_view and name not in _NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting(model: torch.nn.Module) -> Iterator[tuple[Counter[str], _TorchLaunches]]:
    """Triton launches (by kernel) and torch ops inside ``model.forward`` / ``compute_logits``."""
    from triton.runtime.interpreter import InterpretedFunction

    triton_launches: Counter[str] = Counter()
    mode = _TorchLaunches()
    run = InterpretedFunction.run

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if mode.on:
            triton_launches[self.fn.__name__] += 1
        was, mode.on = mode.on, False  # the interpreter's own tensor work is no launch
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.on = was

    def watched(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            mode.on = True
            try:
                return method(*args, **kwargs)
            finally:
                mode.on = False

        return call

    forward, logits = model.forward, model.compute_logits  # type: ignore[attr-defined]
    InterpretedFunction.run = counted_run  # type: ignore[method-assign]
    model.forward = watched(forward)  # type: ignore[method-assign]
    model.compute_logits = watched(logits)  # type: ignore[attr-defined]
    try:
        with mode:
            yield triton_launches, mode
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
        model.forward = forward  # type: ignore[method-assign]
        model.compute_logits = logits  # type: ignore[attr-defined]


def count(shape: str, fused: bool, layers: int | None = None) -> dict[str, Any]:
    """Launches of one batch-1 decode step of ``shape`` (``layers`` deep, else as served) on the Triton kernels
    (eager: what a graph replays)."""
    before = os.environ.get("ENGINE_FUSED_DECODE")
    os.environ["ENGINE_FUSED_DECODE"] = "1" if fused else "0"
    try:
        return _count(shape, layers)
    finally:
        if before is None:
            del os.environ["ENGINE_FUSED_DECODE"]
        else:
            os.environ["ENGINE_FUSED_DECODE"] = before


def _count(shape: str, layers: int | None) -> dict[str, Any]:
    raw = {**_TINY, **SHAPES[shape]}
    if layers is not None:
        raw["num_hidden_layers"] = layers
    cfg = parse_hf_config(raw, shape)
    loaded = LoadedModel(shape, cfg, in_memory({}), ByteTokenizer())
    args = EngineArgs(model=shape, device="cpu", dtype="float32", kernels="triton", enforce_eager=True,
                      load_format="dummy", num_kvcache_blocks=16, max_model_len=256)  # fmt: skip
    engine = LLMEngine(args, loaded=loaded)
    seq = engine.add_request([1, 2, 3], engine.check_request(3, SamplingParams(max_tokens=3, ignore_eos=True), True))
    engine.step()  # the prompt
    model = engine.runner.model
    with _counting(model) as (triton_launches, mode):
        engine.step()  # one decode step, counted
    assert seq.completion_ids, "the decode step produced no token"
    return {
        "layers": cfg.num_hidden_layers,
        "triton": dict(triton_launches),
        "torch": dict(mode.ops),
        "total": sum(triton_launches.values()) + sum(mode.ops.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", default=None, help="write the counts to this JSON file")
    a = p.parse_args()
    report: dict[str, Any] = {}
    for shape in a.shapes:
        off, on = count(shape, False), count(shape, True)
        layers = on["layers"]
        report[shape] = {"unfused": off, "fused": on}
        fewer = (off["total"] - on["total"]) / layers
        print(f"{shape} ({layers} layers): {off['total']} launches per batch-1 decode step unfused, {on['total']} "
              f"fused ({fewer:.1f} fewer per layer, {on['total'] / off['total']:.2f}x)")  # fmt: skip
        for name, r in (("unfused", off), ("fused", on)):
            print(f"  {name}: triton {r['triton']}; torch {r['torch']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
