"""Turn a ``bench/device/pd_serving.sh`` run into one JSON and one InferenceX-style chart.

    python bench/pd_report.py RUNS_DIR --json docs/results/pd-one-gpu.json --png docs/pd-one-gpu.png

RUNS_DIR holds ``SETUP-ISL-OSL-cN.json`` (``atomesh bench serving`` results) and, for P/D, the engines'
``/metrics`` before and after each pass, from which the mean TTFT is split into the prefill engine's part
(queue + prefill, its own TTFT), the KV pull (the decode engine's pull time: waiting for a staging slot
and the transfer) and the rest (the decode leg's first step, the relay through the gateway, HTTP).
All set-ups ran on one GPU, so output tok/s per GPU is the output tok/s.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

NAME = re.compile(r"^(?P<setup>.+)-(?P<isl>\d+)-(?P<osl>\d+)-c(?P<c>\d+)\.json$")
LABELS = {"colocated": "1 engine (colocated), straight", "colocated-atomesh": "1 engine behind atomesh",
          "pd-1p1d": "1 prefill + 1 decode (P/D) behind atomesh"}  # fmt: skip


def _metric(path: Path, name: str) -> float:
    total = 0.0
    for line in path.read_text().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _delta(runs: Path, tag: str, side: str, name: str) -> float:
    return _metric(runs / f"{tag}.{side}.after.prom", name) - _metric(runs / f"{tag}.{side}.before.prom", name)


def collect(runs: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(runs.glob("*.json")):
        m = NAME.match(path.name)
        if not m:
            continue
        r = json.loads(path.read_text())
        row: dict[str, Any] = {
            "setup": m["setup"], "isl": int(m["isl"]), "osl": int(m["osl"]), "concurrency": int(m["c"]),
            "output_tok_s_per_gpu": r["output_throughput"],
            "tok_s_per_user": 1000.0 / r["mean_tpot_ms"] if r.get("mean_tpot_ms") else 0.0,
            "ttft_ms_mean": r["mean_ttft_ms"], "ttft_ms_p50": r["p50_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"],
            "tpot_ms_p99": r["p99_tpot_ms"], "completed": r["completed"], "failed": r["failed"],
        }  # fmt: skip
        tag = path.stem
        if (runs / f"{tag}.decode.after.prom").exists():
            n = _delta(runs, tag, "prefill", "atom:time_to_first_token_seconds_count")
            pulls = _delta(runs, tag, "decode", "atom:kv_transfer_pull_seconds_count")
            prefill = 1000 * _delta(runs, tag, "prefill", "atom:time_to_first_token_seconds_sum") / max(n, 1)
            pull = 1000 * _delta(runs, tag, "decode", "atom:kv_transfer_pull_seconds_sum") / max(pulls, 1)
            row["ttft_split_ms"] = {"prefill_engine": prefill, "kv_pull": pull,
                                    "rest": max(row["ttft_ms_mean"] - prefill - pull, 0.0)}  # fmt: skip
            row["kv_pull_share_of_ttft"] = pull / row["ttft_ms_mean"] if row["ttft_ms_mean"] else 0.0
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["isl"], r["osl"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 5), squeeze=False)
    for ax, (isl, osl) in zip(axes[0], shapes, strict=True):
        for setup, label in LABELS.items():
            pts = sorted((r for r in rows if r["setup"] == setup and (r["isl"], r["osl"]) == (isl, osl)),
                         key=lambda r: r["concurrency"])  # fmt: skip
            if not pts:
                continue
            xs = [p["tok_s_per_user"] for p in pts]
            ys = [p["output_tok_s_per_gpu"] for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"c{p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(f"ISL {isl} / OSL {osl}")
        ax.set_xlabel("interactivity: output tok/s per user")
        ax.set_ylabel("output tok/s per GPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--png", type=Path, required=True)
    p.add_argument("--title", default="SmolLM2-135M shape, bf16, one H200: colocated vs 1P1D (KV over Mooncake TCP)")
    p.add_argument("--meta", default="{}", help="JSON object merged into the report (device, date, command)")
    a = p.parse_args()
    rows = collect(a.runs)
    a.json.write_text(json.dumps({**json.loads(a.meta), "points": rows}, indent=1))
    plot(rows, a.png, a.title)
    for r in rows:
        split = r.get("ttft_split_ms")
        extra = (f"  split: prefill {split['prefill_engine']:.1f} + kv pull {split['kv_pull']:.1f} + rest "
                 f"{split['rest']:.1f} ms") if split else ""  # fmt: skip
        print(f"{r['setup']:>18} {r['isl']:>5}/{r['osl']:<4} c{r['concurrency']:<3} "
              f"{r['output_tok_s_per_gpu']:>8.0f} tok/s/GPU {r['tok_s_per_user']:>6.0f} tok/s/user "
              f"TTFT mean {r['ttft_ms_mean']:>7.1f} ms{extra}")


if __name__ == "__main__":
    main()
