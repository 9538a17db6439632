"""``python -m bench.engine.spec``: n-gram (prompt-lookup) speculative decoding against plain decoding.

Batch 1, greedy, on tasks whose answers repeat their input (quote a passage back, edit code), with the
embedded SmolLM2 unless ``--model`` says otherwise. Each task runs on a plain engine and on a speculating
one (and with ``--unpacked-peer`` on a speculating one whose linears are not packed, with ``--onednn-peer`` on
one whose linears are packed for oneDNN instead of the native kernel: engine.cpu_packed),
alternately, ``--repeats`` times; the median time of each counts (the machine is shared), and so does the median
of the ratios of each run to the plain run just before it ("paired": the load's drift between runs cancels).
Reported: generated tokens / second of the whole request (prefill included, the same prompt for both), the speed-up,
the acceptance length (tokens per verify row) and whether the two outputs are the same token for token
(they must be, under greedy). Printed, never asserted.

``--verify-cost`` measures instead what a verify step costs against a plain decode step: batches of
sequences holding ``--prompt-len`` tokens of context decode with k = 0 (plain) .. ``--max-k`` drafts each
(drafts forced, whatever is accepted), and the mean step time of each k is printed with its ratio to k = 0,
which is the acceptance length (tokens per verify row) that k drafts must reach to gain. Meant for the GPU on
a real shape (``--model`` a folder, ``--load-format dummy``); on CPU it runs too.

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a machine shared with other
work, waits for a core inflate wall times by whatever the neighbours do; CPU time counts only this process's
own work (run it with ``--threads 1``).

``--ceiling`` adds, per task, what no draft-length policy over the same lookup could beat: the verify cost of
k = 0 .. ``--num-speculative-tokens`` drafts is measured in the same run (batch 1, the task's context), and a
dynamic programme over the plain output picks, at every step, the best number of the lookup's drafts to verify
(knowing which would stand); the resulting speed-up bounds any adaptive draft length.

``--eagle HEAD`` times EAGLE-3 steps the same way: a plain engine (CUDA graphs unless ``--enforce-eager``) and,
for each k = 1 .. ``--max-k``, an engine whose head drafts k tokens a step; per batch size the mean step time, the
tokens a step produced and tok/s, with the ratio of step times (the acceptance length the head must reach to
gain). ``HEAD`` is a head's folder, or ``random`` for a random head of the target's shape (``--draft-vocab``
ids; its drafts are noise, so it measures the cost of drafting and verifying, not a trained head's gain).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.args import EngineArgs
from engine.cpu_packed import PackedCpuOps
from engine.kernels.ops import TorchOps
from engine.llm_engine import LLMEngine
from engine.model_runner import StepInput
from engine.models.eagle3 import write_random_head
from engine.models.loader import load_model
from engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from engine.spec_decode import SpeculativeConfig, ngram_drafts

PASSAGE = (
    "The paged KV cache splits each sequence's keys and values into fixed-size blocks. A block table maps a "
    "sequence's logical blocks to physical ones, so sequences of any length share one pool without "
    "fragmentation, and blocks holding a common prefix are shared between requests by reference."
)
CODE = """def total_price(items, tax_rate):
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
"""
TASKS = {
    # (SmolLM2-135M asked to quote and summarise writes a one-line summary; asked to copy, it quotes and
    # paraphrases at length: the task this stands for.)
    "summarise-and-quote": f"{PASSAGE}\n\nCopy the text above exactly.",
    "code-edit": f"Rename the variable `total` to `amount` in this Python code and return the whole code:\n\n{CODE}",
}


class FixedDrafts:
    """A proposer that always drafts ``k`` tokens (token 0): the cost of verifying, whatever is accepted."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return [0] * min(self.k, max_drafts)


def draft_length_ceiling(prompt: list[int], completion: list[int], cost: list[float], lookup_min: int,
                         lookup_max: int) -> float:  # fmt: skip
    """The best decode speed-up over plain decoding of prompt-lookup drafts of any length up to ``len(cost) - 1``
    chosen with hindsight at every step (``cost[k]``: a step verifying k drafts, in plain steps). The first token
    comes from the prefill: decode steps produce the rest."""
    n = len(completion)
    best = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        drafts = ngram_drafts([*prompt, *completion[:i]], len(cost) - 1, lookup_min, lookup_max)
        stand = 0
        while stand < len(drafts) and i + stand < n and drafts[stand] == completion[i + stand]:
            stand += 1
        best[i] = min(cost[k] + best[min(n, i + min(k, stand) + 1)] for k in range(len(drafts) + 1))
    return (n - 1) / best[1] if n > 1 else 1.0


def _step_cost(engine: LLMEngine, prompt: list[int], k: int, steps: int, clock: Callable[[], float]) -> float:
    """Seconds of a batch-1 step that verifies ``k`` forced drafts (0: a plain decode step) after ``prompt``."""
    engine.scheduler.proposer = FixedDrafts(k) if k else None
    seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=(steps + 3) * (k + 1) + 2,
                                                    ignore_eos=True))  # fmt: skip
    while seq.num_completion_tokens == 0:
        engine.step()
    engine.step()
    t0 = clock()
    for _ in range(steps):
        engine.step()
    elapsed = (clock() - t0) / steps
    engine.finish(seq, FinishReason.ABORT)
    return elapsed


def count_step_kinds(engine: LLMEngine) -> Counter[str]:
    """Counts, from now on, the steps ``engine`` prepares by kind (``DecodeGraphStep``: a decode graph's replay,
    ``MixedGraphStep``: a mixed-step graph's, ``EagerStep``: eager), so that a figure says what it timed."""
    prepare, kinds = engine.runner.prepare, Counter[str]()

    def counted(*args: Any) -> StepInput:
        step = prepare(*args)
        kinds[type(step).__name__] += 1
        return step

    engine.runner.prepare = counted  # type: ignore[method-assign,assignment]
    return kinds


def _kinds(kinds: Counter[str]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def verify_cost(a: argparse.Namespace) -> list[dict[str, float]]:
    """Mean step time of batches whose rows verify k drafts each, k = 0 .. max_k, per batch size."""
    # Seats for every logits row of the largest verify batch: a mixed-step graph has one logits row per seat, so
    # verify steps replay graphs (unless --enforce-eager) as a serving engine with that many seats would.
    args = EngineArgs(model=a.model, device=a.device, load_format=a.load_format, max_model_len=a.prompt_len + 512,
                      max_num_seqs=max(a.batch_sizes) * (a.max_k + 1), cudagraph_capture_sizes=tuple(a.batch_sizes),
                      speculative=SpeculativeConfig("ngram", max(a.max_k, 1), 1, 1),
                      enforce_eager=a.enforce_eager)  # fmt: skip
    engine = LLMEngine(args)
    kinds = count_step_kinds(engine)
    rows: list[dict[str, float]] = []
    gen = torch.Generator().manual_seed(0)
    for batch in a.batch_sizes:
        base = 0.0
        for k in range(a.max_k + 1):
            engine.scheduler.proposer = FixedDrafts(k) if k else None
            params = SamplingParams(temperature=0.0, max_tokens=(a.steps + 2) * (k + 1) + 2, ignore_eos=True)
            vocab = engine.model_config.vocab_size
            prompts = torch.randint(
                min(vocab // 4, 5000), min(vocab, 20000), (batch, a.prompt_len), generator=gen
            ).tolist()
            seqs = [engine.add_request(p, params) for p in prompts]
            while any(s.num_completion_tokens == 0 for s in seqs):  # prefill (and the first token)
                engine.step()
            for _ in range(2):  # warm-up of this shape
                engine.step()
            _sync(engine)
            kinds.clear()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                engine.step()
            _sync(engine)
            step_s = (time.perf_counter() - t0) / a.steps
            for s in seqs:
                if s.status is not SequenceStatus.FINISHED:
                    engine.finish(s, FinishReason.ABORT)
            base = base or step_s
            row = {"batch": batch, "k": k, "step_ms": step_s * 1e3, "ratio": step_s / base, "steps": dict(kinds)}
            rows.append(row)
            print(f"batch {batch:3d} k={k}: {row['step_ms']:8.2f} ms/step, x{row['ratio']:.2f} of a plain step: "
                  f"gains when a verify row yields > {row['ratio']:.2f} tokens" if k else
                  f"batch {batch:3d} plain: {row['step_ms']:8.2f} ms/step", f"({_kinds(kinds)})")  # fmt: skip
    return rows


def _decode_steps(engine: LLMEngine, batch: int, a: argparse.Namespace,
                  gen: torch.Generator) -> tuple[dict[str, float], Counter[str]]:  # fmt: skip
    """Mean step time, tokens per sequence per step and tok/s of ``batch`` sequences decoding from ``--prompt-len``
    random tokens; and the kinds of the steps timed."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=(a.steps + 4) * (a.max_k + 1) + 2, ignore_eos=True)
    prompts = torch.randint(min(vocab // 4, 5000), min(vocab, 20000), (batch, a.prompt_len), generator=gen).tolist()
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
    for _ in range(2):
        engine.step()
    _sync(engine)
    kinds = count_step_kinds(engine)
    before = sum(s.num_completion_tokens for s in seqs)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    _sync(engine)
    step_s = (time.perf_counter() - t0) / a.steps
    tokens = (sum(s.num_completion_tokens for s in seqs) - before) / a.steps
    for s in seqs:
        if s.status is not SequenceStatus.FINISHED:
            engine.finish(s, FinishReason.ABORT)
    del engine.runner.prepare  # the count's wrapper
    figures = {"step_ms": step_s * 1e3, "tokens_per_seq_step": tokens / batch, "tok_s": tokens / step_s}
    return figures, kinds


def eagle_cost(a: argparse.Namespace) -> list[dict[str, float | str | dict[str, int]]]:
    """Plain decode steps against EAGLE-3 steps with k = 1 .. max_k drafts, per batch size."""
    head = a.eagle
    scratch = None
    if head == "random":
        scratch = tempfile.TemporaryDirectory(prefix="eagle3-head-")
        target = load_model(a.model).config
        dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
        head = str(write_random_head(Path(scratch.name), target, min(a.draft_vocab, target.vocab_size), dtype=dtype))
    # Seats for every logits row of the largest verify batch, so that its steps replay the mixed-step graphs.
    base = EngineArgs(model=a.model, device=a.device, load_format=a.load_format, max_model_len=a.prompt_len + 1024,
                      max_num_seqs=max(a.batch_sizes) * (a.max_k + 1), cudagraph_capture_sizes=tuple(a.batch_sizes),
                      enforce_eager=a.enforce_eager, gpu_memory_utilization=a.gpu_memory_utilization)  # fmt: skip
    rows: list[dict[str, float | str | dict[str, int]]] = []
    plain: dict[int, float] = {}
    gen = torch.Generator().manual_seed(0)
    for k in range(a.max_k + 1):
        spec = SpeculativeConfig("eagle3", k, model=head) if k else None
        engine = LLMEngine(replace(base, speculative=spec))
        for batch in a.batch_sizes:
            r, kinds = _decode_steps(engine, batch, a, gen)
            plain.setdefault(batch, r["step_ms"])
            ratio = r["step_ms"] / plain[batch]
            rows.append({"method": "eagle3" if k else "plain", "k": k, "batch": batch, **r, "ratio": ratio,
                         "steps": dict(kinds)})  # fmt: skip
            print(f"batch {batch:3d} {'eagle3 k=' + str(k) if k else 'plain':10s}: {r['step_ms']:8.2f} ms/step, "
                  f"{r['tokens_per_seq_step']:.2f} tokens per sequence and step, {r['tok_s']:8.1f} tok/s"
                  + (f", x{ratio:.2f} of a plain step: gains when a step yields > {ratio:.2f} tokens per sequence"
                     if k else "") + f" ({_kinds(kinds)})")  # fmt: skip
        del engine
        gc.collect()
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if scratch is not None:
        scratch.cleanup()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.spec", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--verify-cost", action="store_true", help="time verify steps (k drafts) against plain steps")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-k", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="time with the wall clock or CPU time")
    p.add_argument("--ceiling", action="store_true", help="also the best any draft-length policy could do")
    p.add_argument("--eagle", default=None, help="time EAGLE-3 steps with this head folder ('random': a random head)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary of a random head")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--unpacked-peer", action="store_true",
                   help="also an n-gram engine with unpacked linears (before engine.cpu_packed)")  # fmt: skip
    p.add_argument("--onednn-peer", action="store_true",
                   help="also an n-gram engine with its linears packed for oneDNN, not the native kernel")  # fmt: skip
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.eagle:
        eagle_rows = eagle_cost(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "model": a.model,
                        "device": a.device,
                        "args": vars(a),
                        "eagle3": eagle_rows,
                    },
                    f,
                    indent=1,
                )
        return
    if a.verify_cost:
        cost = verify_cost(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "model": a.model,
                        "device": a.device,
                        "args": vars(a),
                        "verify_cost": cost,
                    },
                    f,
                    indent=1,
                )
        return
    loaded = load_model(a.model)
    base = EngineArgs(model=a.model, device="cpu", max_model_len=2048, num_kvcache_blocks=512)
    spec_cfg = SpeculativeConfig("ngram", a.num_speculative_tokens, a.prompt_lookup_min, a.prompt_lookup_max)
    plain = LLMEngine(base, loaded=loaded)
    spec = LLMEngine(replace(base, speculative=spec_cfg), loaded=loaded)
    engines = {"plain": plain, "ngram": spec}
    if a.unpacked_peer:
        # The speculating engine as it was before its linears were packed (engine.cpu_packed): the torch ops.
        unpacked = LLMEngine(replace(base, speculative=spec_cfg), loaded=loaded)
        unpacked.runner.model.ops = TorchOps()
        engines["ngram-unpacked"] = unpacked
    if a.onednn_peer:
        # The speculating engine with its linears packed for oneDNN instead of engine/cpu_gemm.c.
        onednn = LLMEngine(replace(base, speculative=spec_cfg), loaded=loaded)
        onednn.runner.model.ops = PackedCpuOps(onednn.runner.model)
        engines["ngram-onednn"] = onednn
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    results = []
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    for name in a.tasks:
        text = TASKS[name]
        prompt = plain.tokenizer.encode(plain.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        totals: dict[str, list[float]] = {label: [] for label in engines}
        prefills: dict[str, list[float]] = {label: [] for label in engines}
        outs: dict[str, list[int]] = {}
        before = {label: e.stats() for label, e in engines.items()}
        for _ in range(a.repeats):
            for label, engine in engines.items():  # interleaved: the shared machine's load moves
                engine.block_manager.flush()  # every run prefills its prompt: like for like
                t0 = clock()
                engine.generate([prompt], replace(params, max_tokens=1))
                prefills[label].append(clock() - t0)
                engine.block_manager.flush()
                t0 = clock()
                outs[label] = engine.generate([prompt], params)[0]
                totals[label].append(clock() - t0)
        after = {label: e.stats() for label, e in engines.items()}
        if a.ceiling:
            proposer = spec.scheduler.proposer
            # Interleaved, twice, best of each: the shared machine's load moves between measurements.
            times = [min(_step_cost(spec, prompt, k, a.steps, clock) for _ in range(2))
                     for k in range(a.num_speculative_tokens + 1)]  # fmt: skip
            spec.scheduler.proposer = proposer
            ratios = [t / times[0] for t in times]
            ceiling = draft_length_ceiling(prompt, outs["plain"], ratios, a.prompt_lookup_min, a.prompt_lookup_max)
        # Medians of the interleaved runs; decode = the tokens after the first over the time after the prefill.
        total = {label: statistics.median(v) for label, v in totals.items()}
        prefill = {label: statistics.median(v) for label, v in prefills.items()}
        tok_s = {label: len(outs[label]) / total[label] for label in engines}
        decode = {label: (len(outs[label]) - 1) / (total[label] - prefill[label]) for label in engines}
        tokens = len(outs["plain"])
        row: dict[str, object] = {"task": name, "prompt_tokens": len(prompt), "generated_tokens": tokens,
                                  "runs_s": totals, "prefill_runs_s": prefills}  # fmt: skip
        for label in engines:
            key = label.replace("-", "_")
            row |= {f"{key}_tok_s": tok_s[label], f"{key}_decode_tok_s": decode[label]}
            if label == "plain":
                continue
            rows = after[label].spec_drafts - before[label].spec_drafts
            accepted = after[label].spec_accepted_tokens - before[label].spec_accepted_tokens
            # Each run's ratio to the plain run just before it: the load's drift between runs cancels.
            paired = [p / t for p, t in zip(totals["plain"], totals[label], strict=True)]
            runs = zip(totals["plain"], prefills["plain"], totals[label], prefills[label], strict=True)
            paired_decode = [(p - pp) / (t - tp) for p, pp, t, tp in runs]
            row |= {
                f"{key}_speedup": tok_s[label] / tok_s["plain"],
                f"{key}_decode_speedup": decode[label] / decode["plain"],
                f"{key}_speedup_paired": statistics.median(paired),
                f"{key}_decode_speedup_paired": statistics.median(paired_decode),
                f"{key}_decode_speedup_runs": paired_decode,
                f"{key}_acceptance_length": 1 + accepted / rows if rows else 0.0,
                f"{key}_identical": outs[label] == outs["plain"],
            }
        row["speedup"], row["identical"] = row["ngram_speedup"], row["ngram_identical"]  # the figures of old runs
        row["acceptance_length"] = row["ngram_acceptance_length"]
        if a.ceiling:
            row |= {"verify_cost": ratios, "draft_length_ceiling": ceiling}
            print(
                f"{name:22s} verify cost of k = 0..{a.num_speculative_tokens} drafts (plain steps): "
                f"{', '.join(f'{c:.2f}' for c in ratios)}; best any draft-length policy could do: x{ceiling:.2f}"
            )
        results.append(row)
        print(f"{name:22s} prompt {len(prompt):4d} tok, {tokens:4d} generated, medians of {a.repeats}: plain "
              f"{tok_s['plain']:6.1f} tok/s (decode {decode['plain']:.1f})")  # fmt: skip
        for label in engines:
            if label != "plain":
                key = label.replace("-", "_")
                print(f"  {label:15s} k={a.num_speculative_tokens}: {tok_s[label]:6.1f} tok/s "
                      f"x{row[f'{key}_speedup']:.2f}; "
                      f"decode {decode[label]:6.1f} tok/s x{row[f'{key}_decode_speedup']:.2f} (paired runs: "
                      f"x{row[f'{key}_speedup_paired']:.2f}, decode x{row[f'{key}_decode_speedup_paired']:.2f}); "
                      f"acceptance length "
                      f"{row[f'{key}_acceptance_length']:.2f}; identical {row[f'{key}_identical']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "model": a.model, "threads": torch.get_num_threads(), "args": vars(a),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
