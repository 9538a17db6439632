"""`python -m bench.gateway.dropped_streams` and `python -m bench.gateway.probes` end to end in a short form, so
that they cannot rot (their figures are printed, not judged; what they find is asserted only where it is
a guarantee)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_bench_dropped_streams_quick_run(tmp_path: Path) -> None:
    saved = tmp_path / "dropped.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway.dropped_streams",
            "--only",
            "atomesh",
            "--streams",
            "300",
            "--every",
            "100",
            "--concurrency",
            "8",
            "--tokens",
            "50",
            "--json",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "| atomesh |" in out, out
    [report] = json.loads(saved.read_text())["reports"]
    assert sorted(int(k) for k in report["rss_mb"]) == [100, 200, 300] and report["errors"] == 0, out


@pytest.mark.timeout(120)
def test_bench_probes_quick_run(tmp_path: Path) -> None:
    saved = tmp_path / "probes.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway.probes",
            "--only",
            "atomesh",
            "--flood",
            "200",
            "--clients",
            "4",
            "--tokens",
            "1500",
            "--wait-secs",
            "3",
            "--json",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    [report] = json.loads(saved.read_text())["reports"]
    assert report["upgrade"].startswith("400, closed") and report["connect"].startswith("501, closed"), report
    assert report["http09"].startswith("400, closed") and report["flood_then_served"], report
    assert report["left_running_after_1s"] == "0 of 4", report
