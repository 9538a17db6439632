"""`python -m bench.gateway.serving` against a real gateway and mock workers (figures are printed, not judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gwtest import MakeGateway, MakeWorkers, base_url, require

from bench.gateway.serving import Outcome, random_prompts, summarize


def test_random_prompts_respect_the_range() -> None:
    prompts = random_prompts(50, 100, 20, 0.5, seed=1)
    assert all(50 <= p.input_len <= 150 and 10 <= p.output_len <= 30 for p in prompts)
    assert random_prompts(5, 10, 5, 0.0, seed=3) == random_prompts(5, 10, 5, 0.0, seed=3)


def test_summary_percentiles() -> None:
    outcomes = [
        Outcome(ok=True, prompt_len=10, output_tokens=5, ttft=0.1 * i, e2el=0.1 * i + 0.4, itl=[0.1] * 4)
        for i in range(1, 11)
    ] + [Outcome(ok=False, error="boom")]
    r = summarize(outcomes, duration=2.0, concurrency=4)
    assert (r["completed"], r["failed"], r["errors"]) == (10, 1, ["boom"])
    assert r["median_ttft_ms"] == pytest.approx(550)
    assert r["mean_tpot_ms"] == pytest.approx(100)
    assert r["tokens_per_sec_per_user"] == pytest.approx(10)
    assert r["output_throughput"] == pytest.approx(25)


@pytest.mark.timeout(120)
async def test_bench_serving_sweep_through_the_gateway(
    mock_workers: MakeWorkers, gateway: MakeGateway, tmp_path: Path
) -> None:
    require("matplotlib", "--plot needs matplotlib (the bench extra)")
    workers = await mock_workers(2, stream_chunks=8)
    gw = await gateway(worker_urls=[w.url for w in workers])
    result, plot = tmp_path / "r.json", tmp_path / "sweep.png"
    proc = await __import__("asyncio").create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.gateway.serving",
        "--base-url",
        base_url(gw),
        "--num-prompts",
        "20",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--sweep-concurrency",
        "1,4",
        "--num-workers",
        "2",
        "--save-result",
        str(result),
        "--plot",
        str(plot),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, text
    assert "Output token throughput" in text and "P99 E2EL" in text
    data = json.loads(result.read_text())
    assert [r["max_concurrency"] for r in data] == [1, 4]
    assert all(r["completed"] == 20 and r["failed"] == 0 and r["total_output_tokens"] == 160 for r in data)
    assert plot.stat().st_size > 1000
