"""``python -m bench.engine.pd_gpu --model DIR --out OUT``: the KV relay on one GPU, as one batch.

Runs, each in its own processes, and writes JSON (plus the printed tables) under ``--out``:

1. ``kv_transfer_bench.json``: ``bench.engine.kv_transfer`` with the caches on ``--device``
   (SmolLM2-135M's cache shape, bfloat16 on CUDA), the staged backend, against raw Mooncake
   between the same two processes (pinned host -> pinned host on CUDA): GB/s per request for
   contiguous, fragmented and scattered block ids, and the ratio to raw.
2. ``bench_pd.json``: ``bench.engine.pd``: a prefill and a decode engine on the same device
   (``--num-kvcache-blocks`` each, so that both fit on one GPU), dense and sparse, prompts of
   ``--lengths`` tokens: TTFT split into prefill, KV transfer, decode leg rest and first decode step.
3. ``summary.json``: the headline figures (staged GB/s vs raw at 4096 tokens with scattered ids,
   KV transfer share of TTFT at 4096 tokens) and the engines' memory-backend log lines.

``--model`` is a SmolLM2-shaped safetensors folder (config.json + tokenizer files); when it has
no ``*.safetensors``, random bfloat16 weights of the config's shape are written into it first
(speed only: the text is noise). Nothing is downloaded. ``--device cpu`` runs the same batch on
the CPU (slowly: use short ``--lengths`` and ``--tokens``) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def write_random_weights(folder: Path, seed: int = 0) -> int:
    """Random bfloat16 Llama weights of ``folder/config.json``'s shape (tied embeddings); returns the count."""
    import torch
    from safetensors.torch import save_file

    c = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv_heads, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    head_dim = c.get("head_dim") or hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    w = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": ones(hidden)}
    if not c.get("tie_word_embeddings", True):
        w["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
        }
    save_file(w, str(folder / "model.safetensors"))
    return sum(t.numel() for t in w.values())


def run(cmd: list[str], log: Path, timeout: float) -> None:
    """Run one step, tee its output into ``log``; raises on failure."""
    print("$", " ".join(cmd), flush=True)
    started = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        f.write(proc.stdout)
    keep = [line for line in proc.stdout.splitlines() if line[:1] not in "IWE" or not line[1:2].isdigit()]
    print("\n".join(keep[-40:]), flush=True)
    print(f"({time.monotonic() - started:.0f} s, rc {proc.returncode})", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed (rc {proc.returncode}); see {log}")


def summarize(out: Path, tokens: int) -> dict[str, Any]:
    kv = json.loads((out / "kv_transfer_bench.json").read_text())
    pd = json.loads((out / "bench_pd.json").read_text())
    summary: dict[str, Any] = {"kv_transfer": {}, "ttft": {}}
    measured = sorted({row["tokens"] for row in kv["rows"]})
    kv_tokens = tokens if tokens in measured else measured[-1]
    summary["kv_transfer_tokens"] = kv_tokens
    for row in kv["rows"]:
        if row["tokens"] == kv_tokens:
            summary["kv_transfer"][row["layout"]] = {k: row[k] for k in ("gb_s", "raw_gb_s", "ratio", "ms")}
    for mode in ("dense", "sparse"):
        rows = [r for r in pd["rows"] if r["mode"] == mode and r["tokens"] >= tokens * 0.9 and r["tokens"] <= tokens]
        if rows:
            summary["ttft"][mode] = {k: statistics.median(r[k] for r in rows) for k in (
                "ttft_ms", "prefill_ms", "transfer_ms", "decode_leg_rest_ms", "first_decode_step_ms",
                "transfer_share_of_ttft", "gb_s", "vs_raw")}  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.pd_gpu", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", required=True, help="SmolLM2-shaped safetensors folder (weights made if missing)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_pd_gpu_out"), help="output folder ($OUT)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", default="1024,4096,8192", help="transfer benchmark prompt lengths")
    p.add_argument("--lengths", default="1024 4096", help="end-to-end prompt lengths (space-separated)")
    p.add_argument("--repeats", type=int, default=3, help="end-to-end requests per length and mode")
    p.add_argument("--num-kvcache-blocks", type=int, default=4096, help="per engine")
    p.add_argument("--staging-mb", type=int, default=128)
    p.add_argument(
        "--memory-backend",
        choices=["auto", "direct", "staged"],
        default="auto",
        help="the engines' backend (the transfer benchmark always measures staged)",
    )
    a = p.parse_args(argv)
    out, model = Path(a.out), Path(a.model)
    out.mkdir(parents=True, exist_ok=True)
    if model.is_dir() and not list(model.glob("*.safetensors")):
        print(f"writing random bfloat16 weights into {model}: {write_random_weights(model):,} parameters", flush=True)
    py = sys.executable
    dtype = "bf16" if a.device == "cuda" else "fp32"
    run([py, "-m", "bench.engine.kv_transfer", "--device", a.device, "--dtype", dtype, "--backend", "staged",
         "--staging-mb", str(a.staging_mb), "--tokens", a.tokens, "--repeats", "5",
         "--json", str(out / "kv_transfer_bench.json")], out / "kv_transfer_bench.txt", 300)  # fmt: skip
    run([py, "-m", "bench.engine.pd", "--model", str(model), "--device", a.device, "--lengths", *a.lengths.split(),
         "--repeats", str(a.repeats), "--num-kvcache-blocks", str(a.num_kvcache_blocks),
         "--memory-backend", a.memory_backend, "--staging-mb", str(a.staging_mb),
         "--json", str(out / "bench_pd.json")], out / "bench_pd.txt", 600)  # fmt: skip
    tokens = max(int(t) for t in a.lengths.split())
    summary = {"device": a.device, "model": str(model), "date": time.strftime("%Y-%m-%d"), "tokens": tokens,
               **summarize(out, tokens)}  # fmt: skip
    if a.device == "cuda":
        import torch

        summary["gpu"] = torch.cuda.get_device_name(0)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
