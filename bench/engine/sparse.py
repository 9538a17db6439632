"""``python -m bench.engine.sparse``: block-sparse (MSA-style) decode against dense, on long prompts.

For each prompt length, ``--batch`` distinct prompts are built from real English text: the
Python reference documentation that ships with CPython (``pydoc_data.topics``), each prompt a
different slice of it, wrapped in the model's chat template as "summarise this document". Then,
all in one engine and one process:

* the prompts are prefilled once (with the indexer on, so every block has its indexer key);
* dense decode (the indexer detached: exactly the ``--sparse-attention off`` code path) and
  sparse decode at each ``--topk`` generate ``--new-tokens`` greedy tokens for the whole batch,
  every run after the first re-using the prompts' KV through the prefix cache (only the prompt's
  partial last block is recomputed), so the runs differ only in their decode attention;
* agreement: per prompt, the share of positions where sparse and dense chose the same token and
  the length of the identical prefix (mean and min over the prompts);
* decode tok/s of each at batch ``--batch`` (those same runs) and at batch 1 (the first prompt,
  ``--batch1-tokens`` tokens).

A ``topk`` with ``topk + 2 >= blocks`` selects every block: ``sparse_decode`` then runs the dense
computation (exact), reported as "(dense)". Printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from engine.args import parse_args
from engine.llm_engine import LLMEngine
from engine.models.loader import load_model
from engine.sequence import SamplingParams, SequenceStatus
from engine.tokenizer import Tokenizer

INSTRUCTION = "Summarize the following document in a few sentences.\n\n"
MARK = "\x00DOC\x00"


def document_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids of CPython's reference documentation (real, varied English text with some code)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return tokenizer.encode(text)


def build_prompts(tokenizer: Tokenizer, doc: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` chat prompts of exactly ``length`` tokens, each a different slice of ``doc``."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION + MARK}])
    head, tail = rendered.split(MARK)
    head_ids, tail_ids = tokenizer.encode(head), tokenizer.encode(tail)
    body = length - len(head_ids) - len(tail_ids)
    stride = max((len(doc) - body) // max(count, 1), 1)
    if body <= 0 or body > len(doc):
        raise ValueError(f"prompt length {length} does not fit the document ({len(doc)} tokens)")
    return [head_ids + doc[i * stride : i * stride + body] + tail_ids for i in range(count)]


@dataclass(slots=True)
class Run:
    completions: list[list[int]]
    decode_tok_s: float
    decode_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, topk: int, indexer: list[torch.Tensor]) -> Run:
    """Generate greedily for ``prompts`` together; decode attention sparse at ``topk`` (0: dense).

    Prefill steps run with the indexer attached (indexer keys of every prompt block stay written);
    decode steps attach it only when sparse, so dense decode is the plain dense code path.
    """
    runner = engine.runner
    runner.sparse_topk = topk
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    decode_s, decode_tokens = 0.0, 0
    try:
        while any(s.status is not SequenceStatus.FINISHED for s in seqs):
            scheduled = engine.schedule()
            if scheduled is None:
                raise RuntimeError("the scheduler can make no progress (KV pool too small?)")
            batch, step = scheduled
            runner.indexer_caches = indexer if not batch.decode_only or topk else []
            _sync(engine.device)
            start = time.perf_counter()
            tokens = engine.execute(step)
            _sync(engine.device)
            if batch.decode_only:
                decode_s += time.perf_counter() - start
                decode_tokens += len(tokens.tokens)
            engine.postprocess(batch, tokens)
    finally:
        runner.indexer_caches = indexer
    return Run([s.completion_ids for s in seqs], decode_tokens / decode_s if decode_s else 0.0, decode_s)


def agreement(sparse: list[int], dense: list[int]) -> tuple[float, int]:
    """(share of positions with the same token, length of the identical prefix)."""
    same = [a == b for a, b in zip(sparse, dense, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    return sum(same) / len(same), prefix


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.sparse", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt tokens")
    p.add_argument("--topk", type=int, nargs="+", default=[4, 8, 16, 32], help="--sparse-topk-blocks values")
    p.add_argument("--batch", type=int, default=8, help="distinct prompts decoded together")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (agreement + batch timing)")
    p.add_argument("--batch1-tokens", type=int, default=32, help="tokens of the batch-1 timing (0: skip it)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    loaded = load_model(a.model)
    doc = document_ids(loaded.tokenizer)
    longest = max(a.lengths)

    def blocks_per(tokens: int) -> int:
        return int((tokens + a.block_size - 1) // a.block_size)

    # The prompts' blocks stay cached across runs: room for all of them plus every run's fresh blocks.
    runs = 1 + len(a.topk) * (2 if a.batch1_tokens else 1) + 1
    pool = a.batch * blocks_per(longest) + runs * a.batch * (blocks_per(a.new_tokens) + 2) + 64
    engine = LLMEngine(
        parse_args([
            "--model", a.model, "--device", a.device, "--dtype", a.dtype, "--block-size", str(a.block_size),
            "--num-kvcache-blocks", str(pool), "--max-model-len", str(longest + a.new_tokens + a.block_size),
            "--max-num-seqs", str(a.batch), "--sparse-attention", "on", "--sparse-topk-blocks", str(max(a.topk)),
        ]),
        loaded=loaded,
    )  # fmt: skip
    device, dtype = engine.device, engine.dtype
    indexer = engine.runner.indexer_caches
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{a.threads} threads"
    print(
        f"model={engine.model_id} device={name} dtype={str(dtype).removeprefix('torch.')} "
        f"block={a.block_size} batch={a.batch} new_tokens={a.new_tokens} batch1_tokens={a.batch1_tokens}; "
        f"prompts: slices of pydoc_data.topics ({len(doc)} tokens) in the chat template"
    )
    rows: list[str] = []
    for length in a.lengths:
        prompts = build_prompts(loaded.tokenizer, doc, length, a.batch)
        blocks = blocks_per(length + a.new_tokens)
        t0 = time.perf_counter()
        warm = run(engine, prompts, 4, 0, indexer)  # prefills (and caches) the prompts; warms decode up
        prefill_s = time.perf_counter() - t0 - warm.decode_s
        dense = run(engine, prompts, a.new_tokens, 0, indexer)  # timed like the others: prompts cached
        dense1 = run(engine, prompts[:1], a.batch1_tokens, 0, indexer) if a.batch1_tokens else None
        print(f"\nprompt {length} tokens ({blocks_per(length)} blocks; up to {blocks} while decoding); "
              f"prefill of {a.batch} prompts {prefill_s:.1f}s; dense decode {dense.decode_tok_s:.1f} tok/s "
              f"at batch {a.batch}" + (f", {dense1.decode_tok_s:.1f} at batch 1" if dense1 else ""))  # fmt: skip
        for k in a.topk:
            sparse = run(engine, prompts, a.new_tokens, k, indexer)
            sparse1 = run(engine, prompts[:1], a.batch1_tokens, k, indexer) if a.batch1_tokens else None
            agree = [agreement(s, d) for s, d in zip(sparse.completions, dense.completions, strict=True)]
            frac = statistics.mean(f for f, _ in agree)
            prefixes = [n for _, n in agree]
            kind = "(dense)" if k + 2 >= blocks_per(length + 1) else ""
            speed = sparse.decode_tok_s / dense.decode_tok_s
            speed1 = f"{sparse1.decode_tok_s / dense1.decode_tok_s:.2f}x" if sparse1 and dense1 else "-"
            row = (f"| {length} | {k}{kind} | {frac:.1%} | {statistics.mean(prefixes):.1f} | {min(prefixes)} | "
                   f"{sparse.decode_tok_s:.1f} | {speed:.2f}x | "
                   f"{sparse1.decode_tok_s if sparse1 else 0:.1f} | {speed1} |")  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    print(f"\n| prompt | topk | same tokens | identical prefix (mean) | (min) | tok/s b{a.batch} | vs dense "
          f"| tok/s b1 | vs dense |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
