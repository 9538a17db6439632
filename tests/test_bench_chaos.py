"""`atomesh bench chaos` end to end in a short form, so it cannot rot (its timings are printed, not judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_bench_chaos_quick_run(tmp_path: Path) -> None:
    saved = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "atomesh", "bench", "chaos", "--only", "atomesh", "--workers", "3",
         "--concurrency", "4", "--duration", "4", "--kill-at", "1", "--freeze-at", "2", "--tokens", "8",
         "--json", str(saved)],
        capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "| atomesh |" in out, out
    [report] = json.loads(saved.read_text())["reports"]
    # A worker killed and one frozen cost no request: they failed over or migrated.
    assert report["requests"] > 0 and report["lost"] == 0 and report["bad_usage"] == 0, out
    assert report["frozen_out_after_s"] is not None and report["killed_out_after_s"] is not None, out
