"""``python -m engine.bench``: prefill and decode throughput of the engine next to HF transformers.

Both run the same dequantized weights in the same process, one after the other, at each batch
size. Prefill tok/s = prompt tokens / time of the prefill step; decode tok/s = generated tokens /
time of the decode steps. "HF 1-by-1" is the reference serving the same requests one after
another (its batch-1 decode rate), which is what a server without continuous batching does.
Printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import LoadedModel, load_model
from engine.sequence import SamplingParams, SequenceStatus


@dataclass(frozen=True, slots=True)
class Result:
    """Throughput of one implementation at one batch size."""

    prefill_tok_s: float
    decode_tok_s: float


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    # Distinct random prompts: no prefix-cache hits, no shortcut for either side.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (batch, length), generator=gen).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step()  # the whole batch fits one prefill step
    _sync(engine.device)
    t1 = time.perf_counter()
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        engine.step()
    _sync(engine.device)
    t2 = time.perf_counter()
    batch = len(prompts)
    return Result(batch * len(prompts[0]) / (t1 - t0), batch * (new_tokens - 1) / (t2 - t1))


def bench_hf(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, device: torch.device) -> Result:
    from transformers import DynamicCache

    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        t2 = time.perf_counter()
    batch = len(prompts)
    return Result(batch * len(prompts[0]) / (t1 - t0), batch * (new_tokens - 1) / (t2 - t1))


def hf_reference(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with the same weights (the reference of the tests)."""
    import transformers

    c = loaded.config
    cfg = transformers.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)
    result = model.load_state_dict(loaded.weights, strict=False)
    # Only the tied head may be absent from the checkpoint; anything else means the weights do not fit.
    if not set(result.missing_keys) <= {"lm_head.weight"} or result.unexpected_keys:
        raise ValueError(f"weights do not fit transformers' Llama: missing {result.missing_keys}, "
                         f"unexpected {result.unexpected_keys}")
    model.tie_weights()  # type: ignore[operator]
    return model.to(device=device, dtype=dtype).eval()


def median_of(runs: int, fn: Callable[[], Result]) -> Result:
    """Median over ``runs`` (after one warm-up run)."""
    fn()
    results = [fn() for _ in range(runs)]
    return Result(
        statistics.median(r.prefill_tok_s for r in results), statistics.median(r.decode_tok_s for r in results)
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    loaded = load_model(a.model)
    max_batch = max(a.batch_sizes)
    need = max_batch * (a.prompt_len + a.new_tokens)
    args = EngineArgs(
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        num_kvcache_blocks=(need + 15) // 16 + 8,
        max_model_len=a.prompt_len + a.new_tokens + 16,
        max_num_seqs=max_batch,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(args, loaded=loaded)
    device, dtype = engine.device, engine.dtype
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{a.threads} threads"
    print(
        f"model={engine.model_id} device={name} dtype={str(dtype).removeprefix('torch.')} "
        f"prompt={a.prompt_len} new_tokens={a.new_tokens} runs={a.runs} (median)"
    )
    vocab = loaded.config.vocab_size
    ours: dict[int, Result] = {}
    for b in a.batch_sizes:
        prompts = _prompts(b, a.prompt_len, vocab, b)
        ours[b] = median_of(a.runs, partial(bench_engine, engine, prompts, a.new_tokens))
    del engine
    gc.collect()
    ref: dict[int, Result] = {}
    if not a.no_reference:
        model = hf_reference(loaded, device, dtype)
        for b in a.batch_sizes:
            prompts = _prompts(b, a.prompt_len, vocab, b)
            ref[b] = median_of(a.runs, partial(bench_hf, model, prompts, a.new_tokens, device))
    print(
        f"{'batch':>5} | {'prefill tok/s':>13} {'HF':>9} {'ratio':>6} | {'decode tok/s':>12} {'HF':>9} {'ratio':>6}"
        f" | {'HF 1-by-1':>9} {'ratio':>6}"
    )
    for b in a.batch_sizes:
        o, r, one = ours[b], ref.get(b), ref.get(1)
        line = f"{b:>5} | {o.prefill_tok_s:>13.0f} "
        line += f"{r.prefill_tok_s:>9.0f} {o.prefill_tok_s / r.prefill_tok_s:>5.2f}x" if r else f"{'-':>9} {'-':>6}"
        line += f" | {o.decode_tok_s:>12.1f} "
        line += f"{r.decode_tok_s:>9.1f} {o.decode_tok_s / r.decode_tok_s:>5.2f}x" if r else f"{'-':>9} {'-':>6}"
        # HF serving the same requests one after another decodes at its batch-1 rate.
        line += f" | {one.decode_tok_s:>9.1f} {o.decode_tok_s / one.decode_tok_s:>5.2f}x" if one else ""
        print(line)


if __name__ == "__main__":
    main()
