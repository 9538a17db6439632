"""``python -m engine.bench_spec``: n-gram (prompt-lookup) speculative decoding against plain decoding.

Batch 1, greedy, on tasks whose answers repeat their input (quote a passage back, edit code), with the
embedded SmolLM2 unless ``--model`` says otherwise. Each task runs on a plain engine and on a speculating
one, alternately, ``--repeats`` times; the best wall time of each counts (the machine is shared). Reported:
generated tokens / second of the whole request (prefill included, the same prompt for both), the speed-up,
the acceptance length (tokens per verify row) and whether the two outputs are the same token for token
(they must be, under greedy). Printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from dataclasses import replace

import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import load_model
from engine.sequence import SamplingParams
from engine.spec_decode import SpeculativeConfig

PASSAGE = (
    "The paged KV cache splits each sequence's keys and values into fixed-size blocks. A block table maps a "
    "sequence's logical blocks to physical ones, so sequences of any length share one pool without "
    "fragmentation, and blocks holding a common prefix are shared between requests by reference."
)
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax_rate
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
TASKS = {
    "summarise-and-quote": f"Here is a passage:\n\n{PASSAGE}\n\nRepeat the passage word for word, then summarise "
    "it in one sentence.",
    "code-edit": f"Rename the variable `total` to `amount` in this Python code and return the whole code:\n\n{CODE}",
}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench_spec", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model)
    base = EngineArgs(model=a.model, device="cpu", max_model_len=2048, num_kvcache_blocks=512)
    spec_cfg = SpeculativeConfig("ngram", a.num_speculative_tokens, a.prompt_lookup_min, a.prompt_lookup_max)
    plain = LLMEngine(base, loaded=loaded)
    spec = LLMEngine(replace(base, speculative=spec_cfg), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    results = []
    for name, text in TASKS.items():
        prompt = plain.tokenizer.encode(plain.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        best = {"plain": float("inf"), "ngram": float("inf")}
        outs: dict[str, list[int]] = {}
        before = spec.stats()
        for _ in range(a.repeats):
            for label, engine in (("plain", plain), ("ngram", spec)):
                engine.block_manager.flush()  # every run prefills its prompt: like for like
                t0 = time.perf_counter()
                outs[label] = engine.generate([prompt], params)[0]
                best[label] = min(best[label], time.perf_counter() - t0)
        after = spec.stats()
        rows = after.spec_drafts - before.spec_drafts
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        tokens = len(outs["plain"])
        row = {
            "task": name, "prompt_tokens": len(prompt), "generated_tokens": tokens,
            "plain_tok_s": tokens / best["plain"], "ngram_tok_s": len(outs["ngram"]) / best["ngram"],
            "speedup": (len(outs["ngram"]) / best["ngram"]) / (tokens / best["plain"]),
            "acceptance_length": 1 + accepted / rows if rows else 0.0,
            "identical": outs["plain"] == outs["ngram"],
        }  # fmt: skip
        results.append(row)
        print(f"{name:22s} prompt {len(prompt):4d} tok, {tokens:4d} generated: plain {row['plain_tok_s']:6.1f} tok/s, "
              f"ngram k={a.num_speculative_tokens} {row['ngram_tok_s']:6.1f} tok/s, x{row['speedup']:.2f}, "
              f"acceptance length {row['acceptance_length']:.2f}, identical {row['identical']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "model": a.model, "threads": torch.get_num_threads(), "args": vars(a),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
