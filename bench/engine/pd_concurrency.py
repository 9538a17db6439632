"""``python -m bench.engine.pd_concurrency``: N P/D requests at once through a prefill and a decode engine,
the decode engine's pulls serial (``max_inflight_pulls`` 1) against concurrent (N).

For each setting a fresh ``kv_producer`` / ``kv_consumer`` pair of ``engine.openai_server`` processes on
loopback (``bench.engine.pd``'s ``Engine``: prefix caching off, so every request moves its whole prompt;
the staged memory backend unless ``--memory-backend``), one warm-up relay, then N relays started at once,
each as the gateway runs it: the prefill leg (``max_tokens`` 1, ``do_remote_decode``), then the decode leg
with the returned ``kv_transfer_params`` (``max_tokens`` 2, streamed). Prompts are distinct token ids
(``--tokens`` each). Reported per setting: the wall time until the last relay's first token, the mean
TTFT (prefill leg + decode leg's first chunk), and the decode engine's mean pull time
(``atom:kv_transfer_pull_time_seconds_total`` / pulls, before and after); then serial / concurrent.
Printed (and written as JSON with ``--json``), never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.engine.pd import Engine, metric, request, stream_times


def relay(prefill: Engine, decode: Engine, ids: list[int]) -> float:
    """One P/D request as the gateway runs it; returns its TTFT in seconds."""
    start = time.perf_counter()
    body: dict[str, Any] = {
        "model": "m",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    status, raw = request(prefill.port, "POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"prefill leg: HTTP {status}: {raw[:300]!r}")
    params = {**json.loads(raw)["kv_transfer_params"], "remote_dp_size": 1, "remote_tp_size": 1, "remote_dp_rank": 0}
    prefill_s = time.perf_counter() - start
    first, _, _ = stream_times(
        decode.port,
        {
            "model": "m",
            "prompt": ids,
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "kv_transfer_params": params,
        },
    )
    return prefill_s + first


def run_setting(a: argparse.Namespace, inflight: int, log_dir: str) -> dict[str, Any]:
    kv: dict[str, Any] = {"memory_backend": a.memory_backend, "staging_buffer_mb": a.staging_mb,
                          "max_inflight_pulls": inflight}  # fmt: skip
    if a.protocol:
        kv["protocol"] = a.protocol
    dtype = ["--dtype", "bfloat16"] if a.device == "cuda" else ["--torch-threads", "1"]
    extra = [
        "--model",
        a.model,
        "--served-model-name",
        "m",
        "--device",
        a.device,
        *dtype,
        "--max-model-len",
        str(a.tokens + 64),
        "--num-kvcache-blocks",
        str((a.tokens // 16 + 8) * (a.n + 2)),
    ]
    prefill, decode = Engine("kv_producer", extra, log_dir, kv), Engine("kv_consumer", extra, log_dir, kv)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        relay(prefill, decode, [7 + (i % 900) for i in range(a.tokens)])  # warm-up
        walls, ttfts, pulls = [], [], []
        for r in range(a.repeats):
            prompts = [[1000 + (r * 97 + k * 31 + i) % 20000 for i in range(a.tokens)] for k in range(a.n)]
            pulled, seconds = (metric(decode.port, "atom:kv_transfer_pulled_total"),
                               metric(decode.port, "atom:kv_transfer_pull_time_seconds_total"))  # fmt: skip
            start = time.perf_counter()
            with ThreadPoolExecutor(a.n) as pool:
                done = list(pool.map(lambda ids: relay(prefill, decode, ids), prompts))
            walls.append(time.perf_counter() - start)
            ttfts.append(statistics.mean(done))
            n = metric(decode.port, "atom:kv_transfer_pulled_total") - pulled
            pulls.append((metric(decode.port, "atom:kv_transfer_pull_time_seconds_total") - seconds) / n)
    except Exception:
        print(f"--- prefill log ---\n{prefill.tail()}\n--- decode log ---\n{decode.tail()}")
        raise
    finally:
        prefill.stop()
        decode.stop()
    return {
        "max_inflight_pulls": inflight,
        "n": a.n,
        "tokens": a.tokens,
        "wall_ms": statistics.median(walls) * 1e3,
        "mean_ttft_ms": statistics.median(ttfts) * 1e3,
        "mean_pull_ms": statistics.median(pulls) * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine.pd_concurrency", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--n", type=int, default=8, help="requests started at once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-backend", choices=["auto", "direct", "staged"], default="staged")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both engines' device (one GPU: shared)")
    p.add_argument("--staging-mb", type=int, default=128)
    p.add_argument(
        "--protocol",
        choices=["ipc", "tcp", "rdma"],
        default=None,
        help="both engines' protocol (default: chosen: ipc, the engines sharing this host)",
    )
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        print(
            f"{a.n} P/D requests at once, {a.tokens} prompt tokens each, {a.model} on {a.device}, "
            f"{a.memory_backend}, median of {a.repeats}"
        )
        print(f"{'max_inflight_pulls':>18} {'wall ms':>8} {'mean TTFT ms':>12} {'mean pull ms':>12}")
        for inflight in (1, a.n):
            row = run_setting(a, inflight, log_dir)
            rows.append(row)
            print(f"{inflight:>18} {row['wall_ms']:>8.0f} {row['mean_ttft_ms']:>12.0f} {row['mean_pull_ms']:>12.1f}",
                  flush=True)  # fmt: skip
    serial, concurrent = rows
    print(
        f"serial / concurrent: wall {serial['wall_ms'] / concurrent['wall_ms']:.2f}x, "
        f"mean TTFT {serial['mean_ttft_ms'] / concurrent['mean_ttft_ms']:.2f}x"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m bench.engine.pd_concurrency", "args": vars(a),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
