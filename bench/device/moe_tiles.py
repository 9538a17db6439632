"""The fused MoE kernel's grouped GEMMs at decode sizes on the H200, over a sweep of tiles (issue #29, MoE decode).

qwen3-30b-a3b's experts (128 experts of hidden 2,048 and intermediate 768, top 8) at 1 and 16 tokens: the up
projection (gate + up with SwiGLU) and the down projection, timed separately in one CUDA graph of 32 calls, each
with its own random routing so that the touched experts' weights stream from HBM (the experts of one layer hold
1.2 GB; a call touches at most 16 x 8 of them). Prints each tile's bandwidth over the touched experts' bytes and
the tile ``moe_tiles`` picks today beside the best, so the next round can choose decode tiles per projection.

    python3 bench/device/moe_tiles.py --json $OUT/moe-tiles.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from functools import partial

import torch

from engine.kernels import fused_moe as fm

E, H, INTER, TOP_K = 128, 2048, 768, 8
CALLS = 32


def graph_time(calls: list[partial[None]], rounds: int = 5) -> float:
    """Seconds per call when ``calls`` run once each in one CUDA graph (median of ``rounds`` replays); on the CPU
    (``--device cpu`` with ``TRITON_INTERPRET=1``, which checks the script, not the kernels' speed) one pass."""
    for c in calls[:2]:
        c()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) / len(calls)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (tiny shapes)")
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":  # the interpreter: shapes small enough to run in seconds
        global E, H, INTER, CALLS
        E, H, INTER, CALLS = 16, 64, 48, 2
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    report: dict[str, dict[str, object]] = {}
    # Stages and warps as today (3, 4): the sweep is over the tile's width and depth, 12 compiles per projection.
    sweep = [fm.MoeTiles(16, bn, bk, 4, 3) for bn, bk in itertools.product((16, 32, 64, 128), (64, 128, 256))]
    if dev.type == "cpu":
        sweep = sweep[:2]
    for tokens in a.tokens:
        pairs = tokens * TOP_K
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16, generator=gen)
        steps = []
        for _ in range(CALLS):
            logits = torch.randn(tokens, E, device=dev, generator=gen)
            weights, ids = fm.route(logits, TOP_K, True)
            al = fm.align(ids, E, 16)
            experts = len(set(ids.flatten().tolist()))
            steps.append((weights.to(torch.bfloat16), al, experts))
        touched = statistics.mean(s[2] for s in steps)
        h = torch.empty(pairs, INTER, device=dev, dtype=torch.bfloat16)
        y = torch.empty(pairs, H, device=dev, dtype=torch.bfloat16)
        today = fm.moe_tiles(pairs, E)
        for proj, nbytes in (("up", 2 * INTER * H * 2), ("down", H * INTER * 2)):
            rows = {}
            for tiles in [*sweep, today]:
                if proj == "up":
                    up = partial(fm._grouped_gemm, x, w13, h)
                    calls = [partial(up, al, w, TOP_K, True, False, tiles) for w, al, _ in steps]
                else:
                    down = partial(fm._grouped_gemm, h, w2, y)
                    calls = [partial(down, al, w, 1, False, True, tiles) for w, al, _ in steps]
                try:
                    sec = graph_time(calls)
                except Exception as exc:  # a tile that does not compile (shared memory): reported, not fatal
                    rows[str(tiles)] = {"error": str(exc)[:120]}
                    continue
                rows[str(tiles)] = {"us": sec * 1e6, "tb_s": touched * nbytes / sec / 1e12}
            ok = {k: v for k, v in rows.items() if "us" in v}
            best = min(ok, key=lambda k: ok[k]["us"])
            now = rows[str(today)]
            print(f"{tokens:>2} tokens, {proj:>4}: best {best} {ok[best]['us']:.1f} us ({ok[best]['tb_s']:.2f} TB/s); "
                  f"today {today} {now.get('us', float('nan')):.1f} us ({now.get('tb_s', float('nan')):.2f} TB/s); "
                  f"{touched:.1f} experts touched")  # fmt: skip
            report[f"{tokens}-{proj}"] = {"best": best, "today": str(today), "tiles": rows, "experts": touched}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
