"""One token's residual add and RMSNorm before a layer: in their own Triton launch, or done by the layer's blocks as
they stage the token (token_gemv's NORM_IN), against no norm at all. Chains of 48 layers captured in a CUDA graph
(PDL as the engine launches), replayed; GPU time a layer, per variant.

python3 bench/device/norm_in_bench.py --json OUT.json

qwen3-30b-a3b's shape (hidden 2,048): "qkv", the o projection [2048, 4096], the norm, the QKV projection
[5120, 2048]; "router", the o projection, the norm, the router (128 experts, 8 a token) and the experts' gate/up and
down. qwen3-8b's "gate/up": the down projection [4096, 12288], the norm, gate/up with SwiGLU [2 x 12288, 4096].
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from engine.kernels import token_gemv, triton_ops

LAYERS = 48
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


def _time(step: Callable[[], None], reps: int = 30) -> float:
    """GPU microseconds a layer of ``step`` (a chain of LAYERS layers) replayed from a CUDA graph."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile, make the router's counter
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


def _gemv(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    return token_gemv.token_gemv(x, w, None, None, swiglu, torch.empty(1, n, device=DEV, dtype=BF16))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    a = p.parse_args()
    results: dict[str, dict[str, float]] = {}

    def variants(name: str, before: Callable[[int], torch.Tensor], after: Callable[..., object], hidden: int) -> None:
        """Layer i: ``y = before(i)``; then ``after(i, h)`` of the normed token (``after(i, None, add)``: fused)."""
        r = _rand(1, hidden, scale=1.0)
        nw = (torch.rand(hidden, device=DEV) + 0.5).to(BF16)

        def chain(mode: str) -> Callable[[], None]:
            def step() -> None:
                for i in range(LAYERS):
                    y = before(i)
                    if mode == "none":
                        after(i, y, None)
                    elif mode == "triton":
                        after(i, triton_ops.add_rms_norm(y, r, nw, 1e-6)[0], None)
                    else:
                        after(i, y, token_gemv.AddNorm(r, nw, 1e-6))

            return step

        out = {"no norm": _time(chain("none")), "triton norm": _time(chain("triton")),
               "norm in the next layer": _time(chain("fused"))}  # fmt: skip
        results[name] = out
        for k, v in out.items():
            print(f"{name:8s} {k:24s} {v:8.2f} us a layer", flush=True)

    u = _rand(1, 4096, scale=1.0)
    os_ = [_rand(2048, 4096) for _ in range(8)]
    qkvs = [_rand(5120, 2048) for _ in range(8)]

    def qkv_after(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None) -> object:
        if add is None:
            return _gemv(h, qkvs[i % 8])
        return token_gemv.token_gemv_norm_in(h, qkvs[i % 8], None, None, False, add)

    o_out = [torch.empty(1, 2048, device=DEV, dtype=BF16) for _ in range(8)]

    def o_before(i: int) -> torch.Tensor:
        return token_gemv.token_gemv(u, os_[i % 8], None, None, False, o_out[i % 8])

    variants("qkv", o_before, qkv_after, 2048)
    gate = _rand(128, 2048, scale=2048**-0.5)
    w13, w2 = _rand(128, 1536, 2048), _rand(128, 2048, 768)

    def router_after(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None) -> object:
        if add is None:
            weights, ids = token_gemv.token_route(h, gate, 8, True)
        else:
            weights, ids, h, _ = token_gemv.token_route_norm_in(h, gate, 8, True, False, add)
        h1 = token_gemv.token_experts(h, w13, ids, None, gated=True)
        return token_gemv.token_experts(h1, w2, ids, weights, gated=False)

    variants("router", o_before, router_after, 2048)
    m = _rand(1, 12288, scale=1.0)
    downs = [_rand(4096, 12288) for _ in range(4)]
    gus = [_rand(24576, 4096) for _ in range(4)]
    d_out = [torch.empty(1, 4096, device=DEV, dtype=BF16) for _ in range(4)]

    def down_before(i: int) -> torch.Tensor:
        return token_gemv.token_gemv(m, downs[i % 4], None, None, False, d_out[i % 4])

    def gu_after(i: int, h: torch.Tensor, add: token_gemv.AddNorm | None) -> object:
        if add is None:
            return _gemv(h, gus[i % 4], swiglu=True)
        return token_gemv.token_gemv_norm_in(h, gus[i % 4], None, None, True, add)

    variants("gate/up", down_before, gu_after, 4096)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
