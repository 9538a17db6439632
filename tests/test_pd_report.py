"""`python -m bench.engine.pd_report` on small synthetic runs folders: the two-GPU chart, TTFT split and target verdict,
and the one-GPU report as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gwtest import require

ROOT = Path(__file__).resolve().parent.parent
# The keys every row of docs/results/pd-one-gpu.json carries (more may follow them).
ROW_KEYS = (
    "shape",
    "isl",
    "osl",
    "concurrency",
    "mode",
    "output_tok_s",
    "ttft_p50_ms",
    "tpot_p50_ms",
    "kv_share_of_ttft",
)
pytestmark = pytest.mark.timeout(60)


def result(tmp: Path, tag: str, out_tps: float, tpot_ms: float, ttft_ms: float, gpus: int) -> None:
    body = {
        "output_throughput": out_tps,
        "mean_tpot_ms": tpot_ms,
        "mean_ttft_ms": ttft_ms,
        "p50_ttft_ms": ttft_ms,
        "p99_ttft_ms": ttft_ms,
        "p99_tpot_ms": tpot_ms,
        "p50_tpot_ms": tpot_ms,
        "completed": 8,
        "failed": 0,
        "num_workers": gpus,
    }
    (tmp / f"{tag}.json").write_text(json.dumps(body))


def prom(tmp: Path, tag: str, side: str, when: str, count: int, seconds: float, queued: float = 0.0) -> None:
    name = "atom:time_to_first_token_seconds" if side == "prefill" else "atom:kv_transfer_pull_seconds"
    text = f'# HELP x\n{name}_count{{model_name="m"}} {count}\n{name}_sum{{model_name="m"}} {seconds}\n'
    if queued:  # the prefill engine's queue time, as many observations as its TTFT
        q = "atom:request_queue_time_seconds"
        text += f'{q}_count{{model_name="m"}} {count}\n{q}_sum{{model_name="m"}} {queued}\n'
    (tmp / f"{tag}.{side}.{when}.prom").write_text(text)


def report(runs: Path, out: Path, *args: str) -> tuple[dict, str]:
    require("matplotlib", "the chart needs matplotlib (the bench extra)")
    png, js = out / "chart.png", out / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.pd_report", str(runs), "--json", str(js), "--png", str(png), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    return json.loads(js.read_text()), proc.stdout


def test_two_gpu_report_divides_by_gpus_splits_ttft_and_judges_the_target(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    # 1P1D: at 100 tok/s/user (TPOT 10 ms) 1,600 tok/s over 2 GPUs; colocated there only 1,200.
    result(runs, "pd-1p1d-dense-1024-256-c16", 1600, 10.0, 50.0, 2)
    result(runs, "pd-1p1d-dense-1024-256-c64", 5000, 40.0, 400.0, 2)  # 25 tok/s/user: below the target
    result(runs, "colocated-cache_aware-dense-1024-256-c16", 1200, 12.5, 30.0, 2)
    result(runs, "colocated-round_robin-dense-1024-256-c16", 1100, 12.5, 30.0, 2)
    result(runs, "colocated-round_robin-dense-1024-256-c64", 9000, 30.0, 200.0, 2)
    result(runs, "colocated-cache_aware-sparse-1024-256-c16", 1300, 12.0, 30.0, 2)  # sparse: no 1P1D point
    for tag in ("pd-1p1d-dense-1024-256-c16", "pd-1p1d-dense-1024-256-c64"):
        prom(runs, tag, "prefill", "before", 4, 0.1, queued=0.01)
        prom(runs, tag, "prefill", "after", 36, 0.42, queued=0.106)  # 32 prefills, 10 ms each, 3 ms of it queued
        prom(runs, tag, "decode", "before", 4, 0.2)
        prom(runs, tag, "decode", "after", 36, 0.84)  # 32 pulls, 20 ms each
    (runs / "meta-dense.json").write_text(json.dumps({"device": "2x test", "part": "dense"}))
    (runs / "skipped-dense.txt").write_text("pd-1p1d-dense-4096-512-c256\n")
    data, stdout = report(runs, tmp_path)
    pd16 = next(p for p in data["points"] if p["setup"] == "pd-1p1d" and p["concurrency"] == 16)
    assert (pd16["attention"], pd16["gpus"], pd16["output_tok_s_per_gpu"]) == ("dense", 2, 800.0)
    assert pd16["tok_s_per_user"] == pytest.approx(100.0)
    split = pd16["ttft_split_ms"]
    assert (split["prefill_engine"], split["kv_pull"], split["rest"]) == pytest.approx((10.0, 20.0, 20.0))
    assert (split["queue"], split["prefill"]) == pytest.approx((3.0, 7.0))
    dense, sparse = data["target"]
    assert dense["met"] is True and dense["pd"]["output_tok_s_per_gpu"] == 800.0
    assert dense["colocated"]["setup"] == "colocated-cache_aware" and dense["colocated"]["output_tok_s_per_gpu"] == 600
    assert sparse["met"] is None and sparse["pd"] is None
    assert data["runs"] == [{"device": "2x test", "part": "dense"}]
    assert data["skipped"] == ["pd-1p1d-dense-4096-512-c256"]
    assert "target 1024/256 dense: at >= 60 tok/s/user: 1P1D 800 tok/s/GPU (c16) vs colocated 600" in stdout
    assert "split: queue 3.0 + prefill 7.0 + kv pull 20.0 + rest 20.0 ms" in stdout
    assert "1.33x, MET" in stdout and "no pd point reaches it" in stdout


def test_one_gpu_report_is_unchanged(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    result(runs, "colocated-1024-256-c1", 700, 1.4, 9.0, 1)
    result(runs, "pd-1p1d-1024-256-c1", 750, 1.2, 30.0, 1)
    data, stdout = report(runs, tmp_path, "--meta", '{"device": "one"}')
    assert data["device"] == "one" and "target" not in data
    assert [(p["setup"], p["output_tok_s_per_gpu"]) for p in data["points"]] == [("colocated", 700), ("pd-1p1d", 750)]
    assert all("attention" not in p for p in data["points"]) and "target" not in stdout


def test_one_gpu_runs_become_the_issue_rows_under_a_shape_name(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    result(runs, "colocated-1024-256-c16", 5000, 2.8, 85.0, 1)
    result(runs, "colocated-atomesh-1024-256-c16", 4700, 2.9, 90.0, 1)
    result(runs, "pd-1p1d-1024-256-c16", 4600, 2.7, 120.0, 1)
    for side, seconds in (("prefill", 0.8), ("decode", 0.3)):
        prom(runs, "pd-1p1d-1024-256-c16", side, "before", 0, 0.0)
        prom(runs, "pd-1p1d-1024-256-c16", side, "after", 16, seconds)
    data, _ = report(runs, tmp_path, "--shape", "llama31-8b")
    assert "ttft_split_ms" in data["rows"][1]  # P/D rows add where their TTFT goes
    assert [{k: r[k] for k in ROW_KEYS} for r in data["rows"]] == [
        {"shape": "llama31-8b", "isl": 1024, "osl": 256, "concurrency": 16, "mode": "colocated", "output_tok_s": 5000,
         "ttft_p50_ms": 85.0, "tpot_p50_ms": 2.8, "kv_share_of_ttft": 0.0},
        {"shape": "llama31-8b", "isl": 1024, "osl": 256, "concurrency": 16, "mode": "pd", "output_tok_s": 4600,
         "ttft_p50_ms": 120.0, "tpot_p50_ms": 2.7, "kv_share_of_ttft": pytest.approx(1000 * 0.3 / 16 / 120.0)},
    ]  # fmt: skip


def test_rest_of_ttft_split_per_row(tmp_path: Path) -> None:
    """The decode engine's and the gateway's histograms, when scraped, split the TTFT's rest in each P/D row."""
    runs = tmp_path / "runs"
    runs.mkdir()
    tag = "pd-1p1d-1024-256-c64"
    result(runs, tag, 8000.0, 6.0, 500.0, 1)
    result(runs, "colocated-1024-256-c64", 10000.0, 5.5, 200.0, 1)
    for when, k in (("before", 0), ("after", 1)):
        prom(runs, tag, "prefill", when, 10 * k, 1.0 * k)
        decode = ""
        for name, secs in (
            ("atom:kv_transfer_pull_seconds", 2.0),
            ("atom:pd_decode_reserve_seconds", 0.5),
            ("atom:time_to_first_token_seconds", 2.5),
            ("atom:pd_decode_first_step_seconds", 3.0),
        ):
            decode += f'{name}_count{{model_name="m"}} {10 * k}\n{name}_sum{{model_name="m"}} {secs * k}\n'
        (runs / f"{tag}.decode.{when}.prom").write_text(decode)
        gateway = ""
        for name, secs in (("mesh_pd_prefill_duration_seconds", 1.5), ("mesh_pd_handoff_seconds", 3.5)):
            for model in ("a", "b"):  # summed over label sets
                gateway += f'{name}_count{{runtime="atom",model="{model}"}} {5 * k}\n'
                gateway += f'{name}_sum{{runtime="atom",model="{model}"}} {secs / 2 * k}\n'
        (runs / f"{tag}.gateway.{when}.prom").write_text(gateway)
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "bench.engine.pd_report", str(runs), "--json", str(out),
                           "--png", str(tmp_path / "r.png"), "--shape", "smollm2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    (row,) = [r for r in report["rows"] if r["mode"] == "pd"]
    assert row["decode_since_arrival_ms"] == pytest.approx(
        {"reserved": 50.0, "kv_landed": 200.0, "first_token": 250.0, "first_step": 300.0}
    )
    assert row["gateway_legs_ms"] == pytest.approx({"prefill_leg": 150.0, "handoff": 350.0})
    assert set(ROW_KEYS) <= row.keys()
    assert "decode since arrival: reserved 50.0, kv_landed 200.0" in done.stdout


def test_several_runs_give_medians_and_pd_paired_with_colocated_within_each_run(tmp_path: Path) -> None:
    """REPEAT=N in pd_one_gpu_rows.sh: each number the median over the runs; P/D over colocated is taken per run."""
    from bench.engine.pd_report import collect, issue_rows, median_of_reps

    dirs = []
    for k, (col, pd) in enumerate(((10000.0, 7300.0), (12000.0, 11800.0), (9000.0, 8900.0))):
        runs = tmp_path / f"runs-{k + 1}"
        runs.mkdir()
        result(runs, "colocated-1024-256-c64", col, 5.0, 150.0, 1)
        result(runs, "pd-1p1d-1024-256-c64", pd, 5.0 + k, 250.0, 1)
        dirs.append(runs)
    rows = issue_rows(median_of_reps([collect(d) for d in dirs]), "smollm2-135m")
    col, pd = rows
    assert (col["mode"], col["output_tok_s"], col["reps"]) == ("colocated", 10000.0, 3)
    assert (pd["mode"], pd["output_tok_s"], pd["tpot_p50_ms"], pd["isl"]) == ("pd", 8900.0, 6.0, 1024)
    assert pd["pd_over_colocated_reps"] == pytest.approx([0.73, 11800 / 12000, 8900 / 9000])
    assert pd["pd_over_colocated"] == pytest.approx(11800 / 12000)  # not 8900 / 10000, the ratio of the medians
