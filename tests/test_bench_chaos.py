"""`python -m bench.gateway.chaos` end to end in a short form, so it cannot rot (timings are printed, not judged)."""

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
        [
            sys.executable,
            "-m",
            "bench.gateway.chaos",
            "--only",
            "atomesh",
            "--workers",
            "3",
            "--concurrency",
            "4",
            "--duration",
            "4",
            "--kill-at",
            "1",
            "--freeze-at",
            "2",
            "--tokens",
            "8",
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
    # A worker killed and one frozen cost no request: they failed over or migrated.
    assert report["requests"] > 0 and report["lost"] == 0 and report["bad_usage"] == 0, out
    assert report["frozen_out_after_s"] is not None and report["killed_out_after_s"] is not None, out


def test_rows_compare_like_with_like_first() -> None:
    """atomesh without migration, then SMG (which has none), then atomesh with it: the same flags otherwise."""
    import argparse

    from bench.gateway.chaos import NO_MIGRATION, SYSTEMS, gateway_command

    assert SYSTEMS == (NO_MIGRATION, "smg", "atomesh")
    args = argparse.Namespace(
        health_interval_secs=1,
        health_timeout_secs=1,
        health_failure_threshold=2,
        request_timeout_secs=60,
        retry_max_retries=5,
        migration_limit=3,
    )
    plain = gateway_command(NO_MIGRATION, 1, 2, ["http://w"], args)
    migrating = gateway_command("atomesh", 1, 2, ["http://w"], args)
    assert plain[plain.index("--migration-limit") + 1] == "0"
    assert migrating[migrating.index("--migration-limit") + 1] == "3"
    assert plain[: plain.index("--migration-limit")] == migrating[: migrating.index("--migration-limit")]
