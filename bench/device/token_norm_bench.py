"""One token's residual add and RMSNorm after a layer: in their own Triton launch, or in the layer's last block
(token_gemv's NORM epilogue, its blocks counted on one counter or in groups), against no norm at all. A chain of 48
layers captured in a CUDA graph (PDL as the engine launches), replayed; GPU time a layer, per variant.

python3 bench/device/token_norm_bench.py --json OUT.json

Two chains of qwen3-30b-a3b's shape (hidden 2,048): "o", an up-projection [4096, 2048] then the o projection
[2048, 4096] and the norm; "experts", the routed experts (128 of [1536, 2048] gate/up, [2048, 768] down, 8 a token)
then the norm. And qwen3-8b's "down": gate/up with SwiGLU [2 x 12288, 4096], down [4096, 12288], the norm.
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.kernels import token_gemv, triton_ops

LAYERS = 48
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


def _time(step, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    """GPU microseconds a layer of ``step`` (a chain of LAYERS layers) replayed from a CUDA graph."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile, make the counters
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graph.replay()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) * 1000 / reps / LAYERS


def _chain(layer, x: torch.Tensor, r: torch.Tensor):  # type: ignore[no-untyped-def]
    def step() -> None:
        h, res = x, r
        for i in range(LAYERS):
            h, res = layer(i, h, res)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    a = p.parse_args()
    norm_w = (torch.rand(4096, device=DEV) + 0.5).to(BF16)
    results: dict[str, dict[str, float]] = {}

    def variants(name: str, project, hidden: int) -> None:  # type: ignore[no-untyped-def]
        """``project(i, h) -> y`` (unfused) or ``(h, r)`` given an AddNorm (fused)."""
        x, r = _rand(1, hidden, scale=1.0), _rand(1, hidden, scale=1.0)
        nw = norm_w[:hidden]
        out: dict[str, float] = {}
        out["no norm"] = _time(_chain(lambda i, h, res: (project(i, h, None), res), x, r))
        out["triton norm"] = _time(_chain(lambda i, h, res: triton_ops.add_rms_norm(project(i, h, None), res, nw,
                                                                                    1e-6), x, r))  # fmt: skip
        for groups, late in ((1, False), (64, False), (1, True), (64, True)):
            token_gemv.COUNT_GROUPS, token_gemv.NORM_LATE = groups, late
            add = lambda i, h, res: project(i, h, token_gemv.AddNorm(res, nw, 1e-6))  # noqa: E731
            out[f"epilogue, {groups} groups{', late' if late else ''}"] = _time(_chain(add, x, r))
        results[name] = out
        for k, v in out.items():
            print(f"{name:8s} {k:28s} {v:8.2f} us a layer", flush=True)

    # o: up [4096, 2048] then o [2048, 4096] (+ norm); 8 distinct weight sets, cycled.
    ups = [_rand(4096, 2048) for _ in range(8)]
    os_ = [_rand(2048, 4096) for _ in range(8)]

    def o_layer(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None):  # type: ignore[no-untyped-def]
        u = token_gemv.token_gemv(h, ups[i % 8], None, None, False, torch.empty(1, 4096, device=DEV, dtype=BF16))
        if add is None:
            return token_gemv.token_gemv(u, os_[i % 8], None, None, False, torch.empty(1, 2048, device=DEV, dtype=BF16))
        return token_gemv.token_gemv_add_norm(u, os_[i % 8], None, None, add)

    variants("o", o_layer, 2048)
    # experts: 128 experts, 8 a token (distinct random picks a layer), Qwen3-MoE's bf16 routing weights.
    w13, w2 = _rand(128, 1536, 2048), _rand(128, 2048, 768)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = [torch.randperm(128, generator=g)[:8].view(1, 8).to(DEV) for _ in range(LAYERS)]
    route_w = torch.full((1, 8), 0.125, device=DEV, dtype=BF16)

    def experts_layer(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None):  # type: ignore[no-untyped-def]
        h1 = token_gemv.token_experts(h, w13, ids[i], None, gated=True)
        if add is None:
            return token_gemv.token_experts(h1, w2, ids[i], route_w, gated=False).view(1, 8, 2048)
        return token_gemv.token_experts_add_norm(h1, w2, ids[i], route_w, add)

    variants("experts", experts_layer, 2048)
    # down (qwen3-8b): gate/up SwiGLU [24576, 4096], down [4096, 12288]; 4 weight sets, cycled.
    gus = [_rand(24576, 4096) for _ in range(4)]
    downs = [_rand(4096, 12288) for _ in range(4)]

    def down_layer(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None):  # type: ignore[no-untyped-def]
        m = token_gemv.token_gemv(h, gus[i % 4], None, None, True, torch.empty(1, 12288, device=DEV, dtype=BF16))
        if add is None:
            return token_gemv.token_gemv(m, downs[i % 4], None, None, False, torch.empty(1, 4096, device=DEV,
                                                                                          dtype=BF16))  # fmt: skip
        return token_gemv.token_gemv_add_norm(m, downs[i % 4], None, None, add)

    variants("down-8b", down_layer, 4096)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
