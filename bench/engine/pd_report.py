"""Turn a P/D experiment's runs into one JSON and one InferenceX-style chart.

    python -m bench.engine.pd_report RUNS_DIR --json docs/results/pd-one-gpu.json --png docs/pd-one-gpu.png
    python -m bench.engine.pd_report RUNS_DIR --json docs/results/pd-two-gpu.json --png docs/pd-two-gpu.png

RUNS_DIR holds ``SETUP-ISL-OSL-cN.json`` (``python -m bench.gateway.serving`` results) and, for P/D, the engines'
``/metrics`` before and after each pass, from which the mean TTFT is split into the prefill engine's part
(its own TTFT: queue and prefill apart where it exports ``atom:request_queue_time_seconds``), the KV pull
(the decode engine's pull time: waiting for a staging slot and the transfer; for ``pd-1p1d-early``, early
offers, only the part past the prefill engine's TTFT) and the rest (the decode leg's first step, the relay
through the gateway, HTTP). Where the engines and the gateway export them, P/D points also list the decode
engine's stages since the decode leg's arrival and the gateway's two legs (``_rest_split``).
Output tok/s per GPU is the pass's output tok/s over the GPUs behind the server (``num_workers``).

``bench/device/pd_serving.sh`` (one GPU) names set-ups ``colocated``, ``colocated-atomesh``, ``pd-1p1d``;
``bench/device/pd_two_gpu.sh`` (two GPUs) ends each name with ``-dense`` or ``-sparse``: such runs get
the two-GPU chart (one curve per set-up and attention, the target line, the TTFT split of the P/D
points) and a verdict on the target: at >= ``--target-user-tps`` tok/s per user, the best 1P1D tok/s
per GPU against the best colocated one.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

NAME = re.compile(r"^(?P<setup>.+)-(?P<isl>\d+)-(?P<osl>\d+)-c(?P<c>\d+)\.json$")
ATTENTION = re.compile(r"^(?P<setup>.+)-(?P<attention>dense|sparse)$")
LABELS = {"colocated": "1 engine (colocated), straight", "colocated-atomesh": "1 engine behind atomesh",
          "pd-1p1d": "1 prefill + 1 decode (P/D) behind atomesh",
          "pd-1p1d-early": "P/D, early offers (transfer overlapping prefill)"}  # fmt: skip
LABELS_TWO = {"pd-1p1d": "1P1D (prefill GPU 0, decode GPU 1)",
              "colocated-cache_aware": "2 colocated, cache_aware",
              "colocated-round_robin": "2 colocated, round_robin"}  # fmt: skip
TITLE_ONE = "SmolLM2-135M shape, bf16, one H200: colocated vs 1P1D (KV over Mooncake TCP)"
TITLE_TWO = "SmolLM2-135M shape, bf16, two H200s: 2 colocated engines vs 1P1D (KV over Mooncake TCP)"
SPLIT_LABELS = {"queue": "queue (prefill engine)", "prefill": "prefill",
                "prefill_engine": "queue + prefill (prefill engine)", "kv_pull": "KV transfer (decode's pull)",
                "rest": "first decode step + relay"}  # fmt: skip


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
        gpus = int(r.get("num_workers", 1))
        row: dict[str, Any] = {"setup": m["setup"]}
        if a := ATTENTION.match(m["setup"]):
            row.update(setup=a["setup"], attention=a["attention"], gpus=gpus)
        row.update({
            "isl": int(m["isl"]), "osl": int(m["osl"]), "concurrency": int(m["c"]),
            "output_tok_s_per_gpu": r["output_throughput"] / gpus,
            "tok_s_per_user": 1000.0 / r["mean_tpot_ms"] if r.get("mean_tpot_ms") else 0.0,
            "ttft_ms_mean": r["mean_ttft_ms"], "ttft_ms_p50": r["p50_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"],
            "tpot_ms_p50": r.get("p50_tpot_ms", 0.0), "tpot_ms_p99": r["p99_tpot_ms"], "completed": r["completed"],
            "failed": r["failed"],
        })  # fmt: skip
        tag = path.stem
        if (runs / f"{tag}.decode.after.prom").exists():
            n = _delta(runs, tag, "prefill", "atom:time_to_first_token_seconds_count")
            pulls = _delta(runs, tag, "decode", "atom:kv_transfer_pull_seconds_count")
            prefill = 1000 * _delta(runs, tag, "prefill", "atom:time_to_first_token_seconds_sum") / max(n, 1)
            pull = 1000 * _delta(runs, tag, "decode", "atom:kv_transfer_pull_seconds_sum") / max(pulls, 1)
            if row["setup"].endswith("-early") or (runs / f"{m['setup']}.early").exists():
                # Early offers: the decode engine's pull starts as the prefill is queued, so only what it takes
                # past the prefill engine's own TTFT adds to the client's (the rest of it overlapped the prefill).
                row["kv_pull_since_decode_arrival_ms"] = pull
                pull = max(pull - prefill, 0.0)
            row["ttft_split_ms"] = {"prefill_engine": prefill, "kv_pull": pull,
                                    "rest": max(row["ttft_ms_mean"] - prefill - pull, 0.0)}  # fmt: skip
            # Engines that export the queue time split the prefill engine's part into queue and prefill.
            if queued := _delta(runs, tag, "prefill", "atom:request_queue_time_seconds_count"):
                queue = 1000 * _delta(runs, tag, "prefill", "atom:request_queue_time_seconds_sum") / queued
                row["ttft_split_ms"].update(queue=queue, prefill=max(prefill - queue, 0.0))
            row["kv_pull_share_of_ttft"] = pull / row["ttft_ms_mean"] if row["ttft_ms_mean"] else 0.0
            row.update(_rest_split(runs, tag))
        rows.append(row)
    return rows


def _mean_ms(runs: Path, tag: str, side: str, name: str) -> float | None:
    """The mean of histogram ``name`` over a pass, in ms (None when the side or the metric is missing)."""
    if not (runs / f"{tag}.{side}.after.prom").exists():
        return None
    n = _delta(runs, tag, side, name + "_count")
    return 1000 * _delta(runs, tag, side, name + "_sum") / n if n else None


def _rest_split(runs: Path, tag: str) -> dict[str, Any]:
    """What the TTFT's "rest" is made of, as far as the engines and the gateway export it (means, ms):
    on the decode engine, from a request's arrival until its blocks were reserved, its KV landed, its first
    token went out and it was admitted to its first step; on the gateway, the prefill leg (sent to answered)
    and the hand-off (prefill answered to the decode leg's response head)."""
    decode = {
        key: _mean_ms(runs, tag, "decode", name)
        for key, name in (
            ("reserved", "atom:pd_decode_reserve_seconds"),
            ("kv_landed", "atom:kv_transfer_pull_seconds"),
            ("first_token", "atom:time_to_first_token_seconds"),
            ("first_step", "atom:pd_decode_first_step_seconds"),
        )
    }
    gateway = {
        key: _mean_ms(runs, tag, "gateway", name)
        for key, name in (("prefill_leg", "mesh_pd_prefill_duration_seconds"), ("handoff", "mesh_pd_handoff_seconds"))
    }
    out: dict[str, Any] = {}
    if any(v is not None for v in decode.values()):
        out["decode_since_arrival_ms"] = {k: v for k, v in decode.items() if v is not None}
    if any(v is not None for v in gateway.values()):
        out["gateway_legs_ms"] = {k: v for k, v in gateway.items() if v is not None}
    return out


# The set-ups the issue's rows compare. pd-1p1d-early (EARLY_AB=1 in bench/device/pd_serving.sh): its decode
# engine's "KV pull" runs from the decode leg's arrival, before the prefill ends, so it overlaps the prefill.
MODES = {"colocated": "colocated", "pd-1p1d": "pd", "pd-1p1d-early": "pd"}


def issue_rows(points: list[dict[str, Any]], shape: str) -> list[dict[str, Any]]:
    """The one-GPU points as ``docs/results/pd-one-gpu.json`` lists them: ``{shape, isl, osl, concurrency, mode,
    output_tok_s, ttft_p50_ms, tpot_p50_ms, kv_share_of_ttft}``, colocated (straight) and P/D."""
    # P/D rows: where the TTFT goes
    extra = ("ttft_split_ms", "decode_since_arrival_ms", "gateway_legs_ms", "kv_pull_since_decode_arrival_ms",
             "reps", "output_tok_s_per_gpu_reps", "pd_over_colocated", "pd_over_colocated_reps")  # fmt: skip
    return [{"shape": shape, "isl": p["isl"], "osl": p["osl"], "concurrency": p["concurrency"],
             "mode": MODES[p["setup"]], "output_tok_s": p["output_tok_s_per_gpu"], "ttft_p50_ms": p["ttft_ms_p50"],
             "tpot_p50_ms": p["tpot_ms_p50"], "kv_share_of_ttft": p.get("kv_pull_share_of_ttft", 0.0),
             "setup": p["setup"], **{k: p[k] for k in extra if k in p}}
            for p in points if p["setup"] in MODES and "attention" not in p]  # fmt: skip


def _curve(rows: list[dict[str, Any]], shape: tuple[int, int], setup: str, attention: str | None) -> list[Any]:
    return sorted((r for r in rows if r["setup"] == setup and (r["isl"], r["osl"]) == shape
                   and r.get("attention") == attention), key=lambda r: r["concurrency"])  # fmt: skip


def verdicts(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per shape and attention: at >= ``target`` tok/s per user, the best 1P1D and colocated tok/s per GPU."""
    out = []
    for isl, osl, attention in sorted({(r["isl"], r["osl"], r["attention"]) for r in rows if "attention" in r}):
        best: dict[str, Any] = {}
        for side in ("pd", "colocated"):
            pts = [r for r in rows if (r["isl"], r["osl"], r.get("attention")) == (isl, osl, attention)
                   and r["setup"].startswith("pd-" if side == "pd" else "colocated")
                   and r["tok_s_per_user"] >= target and r["completed"] > 0]  # fmt: skip
            top = max(pts, key=lambda r: r["output_tok_s_per_gpu"], default=None)
            keep = ("setup", "concurrency", "output_tok_s_per_gpu", "tok_s_per_user")
            best[side] = None if top is None else {k: top[k] for k in keep}
        pd, colo = best["pd"], best["colocated"]
        met = None if pd is None or colo is None else pd["output_tok_s_per_gpu"] >= colo["output_tok_s_per_gpu"]
        out.append({"isl": isl, "osl": osl, "attention": attention, "target_tok_s_per_user": target,
                    "pd": pd, "colocated": colo, "met": met})  # fmt: skip
    return out


def verdict_line(v: dict[str, Any]) -> str:
    head = f"target {v['isl']}/{v['osl']} {v['attention']}: at >= {v['target_tok_s_per_user']:g} tok/s/user"
    if v["met"] is None:
        missing = " and ".join(k for k in ("pd", "colocated") if v[k] is None)
        return f"{head}: no {missing} point reaches it, no verdict"
    pd, colo = v["pd"], v["colocated"]
    return (
        f"{head}: 1P1D {pd['output_tok_s_per_gpu']:.0f} tok/s/GPU (c{pd['concurrency']}) vs colocated "
        f"{colo['output_tok_s_per_gpu']:.0f} ({colo['setup']}, c{colo['concurrency']}): "
        f"{pd['output_tok_s_per_gpu'] / colo['output_tok_s_per_gpu']:.2f}x, {'MET' if v['met'] else 'NOT MET'}"
    )


def plot(rows: list[dict[str, Any]], path: Path, title: str, target: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = any("attention" in r for r in rows)
    shapes = sorted({(r["isl"], r["osl"]) for r in rows})
    curves = ([(s, a, f"{label}, {a}") for a in ("dense", "sparse") for s, label in LABELS_TWO.items()] if two
              else [(s, None, label) for s, label in LABELS.items()])  # fmt: skip
    nrows = 2 if two else 1
    fig, axes = plt.subplots(nrows, len(shapes), figsize=(max(7 * len(shapes), 11), 5 * nrows), squeeze=False)
    colors = {s: f"C{i}" for i, s in enumerate(list(LABELS_TWO) if two else list(LABELS))}
    for ax, shape in zip(axes[0], shapes, strict=True):
        for setup, attention, label in curves:
            pts = _curve(rows, shape, setup, attention)
            if not pts:
                continue
            xs = [p["tok_s_per_user"] for p in pts]
            ys = [p["output_tok_s_per_gpu"] for p in pts]
            ax.plot(xs, ys, marker="o", label=label, color=colors[setup],
                    linestyle="--" if attention == "sparse" else "-")  # fmt: skip
            for p, x, y in zip(pts, xs, ys, strict=True):
                ax.annotate(f"c{p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if target is not None:
            ax.axvline(target, color="grey", linestyle=":", label=f"{target:g} tok/s/user")
        ax.set_title(f"ISL {shape[0]} / OSL {shape[1]}")
        ax.set_xlabel("interactivity: output tok/s per user")
        ax.set_ylabel("output tok/s per GPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if two:
        for ax, shape in zip(axes[1], shapes, strict=True):
            _split_bars(ax, rows, shape)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _split_bars(ax: Any, rows: list[dict[str, Any]], shape: tuple[int, int]) -> None:
    """The P/D points' mean TTFT, stacked by part, one bar per concurrency and attention."""
    pts = [p for a in ("dense", "sparse") for p in _curve(rows, shape, "pd-1p1d", a) if "ttft_split_ms" in p]
    names = [f"c{p['concurrency']}\n{p['attention']}" for p in pts]
    queue = bool(pts) and all("queue" in p["ttft_split_ms"] for p in pts)
    parts = ("queue", "prefill", "kv_pull", "rest") if queue else ("prefill_engine", "kv_pull", "rest")
    bottom = [0.0] * len(pts)
    for i, part in enumerate(parts):
        heights = [p["ttft_split_ms"][part] for p in pts]
        ax.bar(names, heights, bottom=bottom, label=SPLIT_LABELS[part], color=f"C{i + 3}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_title(f"1P1D mean TTFT split, ISL {shape[0]} / OSL {shape[1]}")
    ax.set_ylabel("ms")
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _runs_meta(runs: Path) -> dict[str, Any]:
    """What the device script left beside the results: its settings and the passes it skipped."""
    meta: dict[str, Any] = {}
    parts = [json.loads(p.read_text()) for p in sorted(runs.glob("meta-*.json"))]
    if parts:
        meta["runs"] = parts
    skipped = [line for p in sorted(runs.glob("skipped-*.txt")) for line in p.read_text().splitlines()]
    if skipped:
        meta["skipped"] = skipped
    return meta


def median_of_reps(reps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Points of several runs of one sweep (each a ``collect``), one per set-up and shape: each number the median
    over the runs that have it. A P/D point also gets each run's P/D over colocated tok/s, paired within the run
    (``pd_over_colocated_reps``) and their median (``pd_over_colocated``): the two passes of a pair ran minutes
    apart, the runs further apart, so a paired ratio moves less than a ratio of medians."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rows in reps:
        for r in rows:
            groups.setdefault((r["setup"], r.get("attention"), r["isl"], r["osl"], r["concurrency"]), []).append(r)
    out = []
    for rows in groups.values():
        merged: dict[str, Any] = dict(rows[0])
        for name, value in rows[0].items():
            if isinstance(value, (int, float)) and name not in ("isl", "osl", "concurrency", "gpus"):
                merged[name] = statistics.median(float(r[name]) for r in rows if name in r)
            elif isinstance(value, dict):
                merged[name] = {k: statistics.median(float(r[name][k]) for r in rows if k in r.get(name, {}))
                                for k in value}  # fmt: skip
        merged["reps"] = len(rows)
        merged["output_tok_s_per_gpu_reps"] = [r["output_tok_s_per_gpu"] for r in rows]
        out.append(merged)
    by_key = {(r["setup"], r.get("attention"), r["isl"], r["osl"], r["concurrency"]): r for r in out}
    for r in out:
        if MODES.get(r["setup"]) != "pd":
            continue
        ratios = []
        for rows in reps:
            here = {(x["setup"], x["isl"], x["osl"], x["concurrency"]): x for x in rows}
            pd, col = (here.get((s, r["isl"], r["osl"], r["concurrency"])) for s in (r["setup"], "colocated"))
            if pd and col and col["output_tok_s_per_gpu"]:
                ratios.append(pd["output_tok_s_per_gpu"] / col["output_tok_s_per_gpu"])
        if ratios and (r["setup"], None, r["isl"], r["osl"], r["concurrency"]) in by_key:
            r["pd_over_colocated_reps"] = ratios
            r["pd_over_colocated"] = statistics.median(ratios)
    return sorted(out, key=lambda r: (r["setup"], r.get("attention") or "", r["isl"], r["concurrency"]))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.pd_report", description=__doc__.split("\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="a runs folder; several: one sweep's runs, medians of each")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--png", type=Path, required=True)
    p.add_argument("--title", default=None, help="chart title (default: the one- or two-GPU experiment's)")
    p.add_argument("--meta", default="{}", help="JSON object merged into the report (device, date, command)")
    p.add_argument("--shape", default=None,
                   help="one-GPU runs: also list them as the issue's rows under this model_shapes name")  # fmt: skip
    p.add_argument("--target-user-tps", type=float, default=60.0,
                   help="two-GPU runs: 1P1D and colocated are compared at and above this tok/s per user")  # fmt: skip
    a = p.parse_args()
    reps = [collect(runs) for runs in a.runs]
    if not all(reps):
        p.error(f"no SETUP-ISL-OSL-cN.json results in {a.runs[[bool(r) for r in reps].index(False)]}")
    rows = reps[0] if len(reps) == 1 else median_of_reps(reps)
    two = any("attention" in r for r in rows)
    report: dict[str, Any] = {**json.loads(a.meta), **_runs_meta(a.runs[0])}
    if len(reps) > 1:
        report["reps"] = [str(runs) for runs in a.runs]
    checks = verdicts(rows, a.target_user_tps) if two else []
    if two:
        report["target"] = checks
    if a.shape:
        report["rows"] = issue_rows(rows, a.shape)
    a.json.write_text(json.dumps({**report, "points": rows}, indent=1))
    plot(rows, a.png, a.title or (TITLE_TWO if two else TITLE_ONE), a.target_user_tps if two else None)
    for r in rows:
        split = r.get("ttft_split_ms")
        extra = ""
        if split:
            head = (f"queue {split['queue']:.1f} + prefill {split['prefill']:.1f}" if "queue" in split
                    else f"prefill {split['prefill_engine']:.1f}")  # fmt: skip
            extra = f"  split: {head} + kv pull {split['kv_pull']:.1f} + rest {split['rest']:.1f} ms"
        for key, label in (("decode_since_arrival_ms", "decode since arrival"), ("gateway_legs_ms", "gateway")):
            if parts := r.get(key):
                extra += f"; {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + " ms"
        if "pd_over_colocated" in r:
            extra += "; P/D / colocated per run " + ", ".join(f"{x:.2f}" for x in r["pd_over_colocated_reps"])
            extra += f" (median {r['pd_over_colocated']:.2f})"
        setup = r["setup"] + (f"-{r['attention']}" if "attention" in r else "")
        print(
            f"{setup:>28} {r['isl']:>5}/{r['osl']:<4} c{r['concurrency']:<3} "
            f"{r['output_tok_s_per_gpu']:>8.0f} tok/s/GPU {r['tok_s_per_user']:>6.0f} tok/s/user "
            f"TTFT mean {r['ttft_ms_mean']:>7.1f} ms{extra}"
        )
    for v in checks:
        print(verdict_line(v))


if __name__ == "__main__":
    main()
