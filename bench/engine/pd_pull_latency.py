"""What an intra-host (ipc) KV pull costs while both engines are busy: this tree against an earlier one.

Two prefill/decode pairs of ``engine.openai_server`` processes on loopback, one from this checkout
(*now*) and one from ``--before`` (a git revision, unpacked with ``git archive`` into a temporary
folder: the peer), the same model and settings, ``protocol`` ipc (the producer's pools in shared
memory on CPU, CUDA IPC on a GPU), prefix caching off. Both pairs are up for the whole run; rounds
alternate between them, so both see the same machine. A round starts ``--n`` requests at once, each
as the gateway runs it: the prefill leg (``max_tokens`` 1, ``do_remote_decode``), then the decode
leg with the returned ``kv_transfer_params``, streamed, ``--decode-tokens`` long. So while one
request's KV is pulled, the prefill engine computes the others' prompts and the decode engine
streams the earlier ones: the loops a pull used to wait for are busy.

Reported per pair (median over rounds): the decode engine's mean pull time
(``atom:kv_transfer_pull_time_seconds_total`` / pulls, over the round), the mean and p90 TTFT
(prefill leg + the decode leg's first chunk) and the round's wall time; then before / now.
Printed (and written as JSON with ``--json``), never asserted.

    python -m bench.engine.pd_pull_latency --before 05e01c4 [--n 8] [--tokens 256] [--rounds 6]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine.pd import Engine, metric, request, stream_times

ROOT = Path(__file__).resolve().parents[2]


def unpack(rev: str, into: Path) -> Path:
    """The tree of ``rev`` of this repository, as files under ``into`` (read-only use of git)."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "engine"], check=True, capture_output=True).stdout
    tree = into / f"before-{rev}"
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def relay(prefill: Engine, decode: Engine, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    """One P/D request as the gateway runs it; returns its prefill leg's and its decode leg's first chunk's seconds."""
    start = time.perf_counter()
    # logprobs: every token's chunk carries one, so a token whose text is held back still counts
    body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": False, "logprobs": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}  # fmt: skip
    status, raw = request(prefill.port, "POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"prefill leg: HTTP {status}: {raw[:300]!r}")
    params = {**json.loads(raw)["kv_transfer_params"], "remote_dp_size": 1, "remote_tp_size": 1, "remote_dp_rank": 0}
    prefill_s = time.perf_counter() - start
    decode_body = {"model": "m", "prompt": ids, "max_tokens": decode_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True, "logprobs": 1, "kv_transfer_params": params}  # fmt: skip
    first, _, _ = stream_times(decode.port, decode_body)
    return prefill_s, first


def round_(pair: tuple[Engine, Engine], a: argparse.Namespace, r: int) -> dict[str, float]:
    prefill, decode = pair
    prompts = [[3 + (r * 97 + k * 31 + i * 7) % 250 for i in range(a.tokens)] for k in range(a.n)]  # any vocab
    pulled = metric(decode.port, "atom:kv_transfer_pulled_total")
    seconds = metric(decode.port, "atom:kv_transfer_pull_time_seconds_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(a.n) as pool:
        legs = list(pool.map(lambda ids: relay(prefill, decode, ids, a.decode_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(p + d for p, d in legs)
    n = metric(decode.port, "atom:kv_transfer_pulled_total") - pulled
    pull = (metric(decode.port, "atom:kv_transfer_pull_time_seconds_total") - seconds) / max(n, 1)
    return {"pull_ms": pull * 1e3, "prefill_leg_ms": statistics.mean(p for p, _ in legs) * 1e3,
            "decode_leg_ms": statistics.mean(d for _, d in legs) * 1e3, "ttft_ms": statistics.mean(ttfts) * 1e3,
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, "wall_ms": wall * 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine.pd_pull_latency", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--before", required=True, help="the git revision to measure against (the peer)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens each decode leg streams")
    p.add_argument("--n", type=int, default=8, help="requests started at once")
    p.add_argument("--rounds", type=int, default=6, help="rounds per pair (alternating)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    dtype = ["--dtype", "bfloat16"] if a.device == "cuda" else ["--torch-threads", "1"]
    extra = ["--model", a.model, "--served-model-name", "m", "--device", a.device, *dtype,
             "--max-model-len", str(a.tokens + a.decode_tokens + 64),
             "--num-kvcache-blocks", str(((a.tokens + a.decode_tokens) // 16 + 8) * (a.n + 2))]  # fmt: skip
    kv = {"protocol": "ipc", "memory_backend": "direct", "max_inflight_pulls": a.n}
    results: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": unpack(a.before, Path(tmp)), "now": ROOT}
        pairs = {k: (Engine("kv_producer", extra, tmp, kv, tree=t), Engine("kv_consumer", extra, tmp, kv, tree=t))
                 for k, t in trees.items()}  # fmt: skip
        try:
            for pair in pairs.values():
                for e in pair:
                    e.wait_ready()
                relay(*pair, [3 + i % 250 for i in range(a.tokens)], 2)  # warm-up: maps the pools
                relay(*pair, [4 + i % 250 for i in range(a.tokens)], 2)
            print(f"{a.n} P/D requests at once over ipc, {a.tokens} prompt tokens, {a.decode_tokens} streamed, "
                  f"{a.model} on {a.device}; now = this tree, before = {a.before}; {a.rounds} rounds each")  # fmt: skip
            for r in range(a.rounds):
                for k in ("before", "now") if r % 2 == 0 else ("now", "before"):
                    results[k].append(round_(pairs[k], a, r))
        except Exception:
            for k, pair in pairs.items():
                print(f"--- {k} prefill ---\n{pair[0].tail()}\n--- {k} decode ---\n{pair[1].tail()}")
            raise
        finally:
            for pair in pairs.values():
                for e in pair:
                    e.stop()
    med = {k: {m: statistics.median(row[m] for row in rows) for m in rows[0]} for k, rows in results.items()}
    print(
        f"{'':>8} {'pull ms':>9} {'prefill leg':>11} {'decode leg':>10} {'TTFT ms':>9} {'TTFT p90':>9} {'wall ms':>9}"
    )
    for k, m in med.items():
        print(
            f"{k:>8} {m['pull_ms']:>9.1f} {m['prefill_leg_ms']:>11.0f} {m['decode_leg_ms']:>10.0f} "
            f"{m['ttft_ms']:>9.0f} {m['ttft_p90_ms']:>9.0f} {m['wall_ms']:>9.0f}"
        )
    ratio = {m: med["before"][m] / med["now"][m] for m in med["now"]}
    print(f"before / now: pull {ratio['pull_ms']:.2f}x, TTFT {ratio['ttft_ms']:.2f}x, "
          f"TTFT p90 {ratio['ttft_p90_ms']:.2f}x, wall {ratio['wall_ms']:.2f}x")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            command = "python -m bench.engine.pd_pull_latency " + " ".join(argv or sys.argv[1:])
            json.dump({"command": command, "args": vars(a),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "median": med,
                       "ratio_before_over_now": ratio, "rounds": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
