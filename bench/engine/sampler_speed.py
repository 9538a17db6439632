"""Time the sampler's draw of one step on the GPU: top-p cut without a sort against the sort it replaced.

``Sampler.tokens`` on random logits ``[batch, vocab]`` (temperature 0.8, top-p 0.95; and with one row of the batch
also asking top-k 50, which puts every row through the same cut), by CUDA events, median of ``--rounds``, with the
cut bisected at every batch size (``cut``, the sampler's ``BISECT_MIN_ROWS`` set to 1; the sampler itself sorts below
that many rows); then the same draw with the rows sorted (``torch.sort``, a cumulative sum, as the sampler did before)
in the same process.

    python -m bench.engine.sampler_speed [--vocab 151936] [--batches 1 16 64 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine import sampler as sampler_module
from engine.sampler import Sampler, SampleRow
from engine.sequence import SamplingParams


def sorted_draw(sampler: Sampler, scaled: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The draw as it was: each row sorted, ranks masked by top-k and by the cumulative top-p mass."""
    top_k = [r.params.top_k if 0 < r.params.top_k < scaled.shape[-1] else scaled.shape[-1] for r in rows]
    top_p = torch.tensor([r.params.top_p for r in rows], device=scaled.device).unsqueeze(1)
    ordered, ids = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(ordered.shape[-1], device=scaled.device).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k, device=scaled.device).unsqueeze(1)
    probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= probs.cumsum(-1) - probs > top_p
    probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    noise = sampler._noise(rows, scaled.shape[-1], scaled.device)
    choice = (probs / noise.gather(1, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


def cuda_ms(fn: Callable[[], Any], rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    sampler = Sampler(frozenset({0}), 0)
    sampler_module.BISECT_MIN_ROWS = 1
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "vocab": a.vocab}
    for mixed in (False, True):
        for b in a.batches:
            logits = torch.randn(b, a.vocab, device=dev) * 3.0
            rows = [SampleRow(SamplingParams(temperature=0.8, top_p=0.95)) for _ in range(b)]
            if mixed:
                rows[0] = SampleRow(SamplingParams(temperature=0.8, top_p=0.95, top_k=50))
            new = cuda_ms(lambda: sampler.tokens(logits, rows), a.rounds)  # noqa: B023
            old = cuda_ms(lambda: sorted_draw(sampler, logits / 0.8, rows), a.rounds)  # noqa: B023
            key = f"{'top-k row, ' if mixed else ''}batch {b}"
            out[key] = {"cut_ms": new, "sorted_ms": old, "speedup": old / new}
            print(f"{key}: cut {new:.3f} ms, sorted {old:.3f} ms ({old / new:.1f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
