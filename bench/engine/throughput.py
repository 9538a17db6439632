"""``python -m bench.engine.throughput``: prefill and decode throughput of the engine next to HF transformers.

Every implementation runs the same weights in the same process, one after the other, at each batch
size: our engine (CUDA graphs + Triton kernels on a GPU unless ``--enforce-eager`` /
``--kernels torch``), transformers eager with a ``DynamicCache`` (the reference of the tests), and
on CUDA transformers with a static cache under ``torch.compile`` (``--compiled``: each mode is
tried in turn and the first that runs is reported; one that fails is named with its error).
Prefill tok/s = prompt tokens / time until every sequence has its first token; decode tok/s =
generated tokens / time of the decode steps. On CUDA the decode rate is also given as a share of
the HBM roofline (weights + the KV read per step at the datasheet's bandwidth). ``--prefix-row``
adds the prefill time of one prompt with no prefix cache against a hit of one block (what every
chat sharing a system prompt gets) and of half the prompt. ``--profile`` splits one decode step (of
``--profile-batch`` sequences) into its host and GPU parts, and on CUDA by kernel. ``--json`` writes
every figure. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import resource
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.loader import LoadedModel, load_model
from engine.sequence import FinishReason, SamplingParams, SequenceStatus

# H200 (SXM) HBM3e bandwidth by the datasheet; the roofline share is against it.
HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12}
COMPILE_MODES = ("reduce-overhead", "default", "max-autotune-no-cudagraphs")


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


def bench_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> Result:  # fmt: skip
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    _sync(engine.device)
    t0 = time.perf_counter()
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
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


def bench_hf_compiled(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, device: torch.device, mode: str
) -> Result:
    """transformers' own static-cache generation with its decode step under ``torch.compile(mode)``."""
    from transformers import CompileConfig

    ids = torch.tensor(prompts, device=device)
    common: dict[str, Any] = {
        "do_sample": False, "cache_implementation": "static", "compile_config": CompileConfig(mode=mode),
        "pad_token_id": 0, "min_new_tokens": None,
    }  # fmt: skip

    def timed(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_length=ids.shape[1] + n, **common)  # type: ignore[operator]
        _sync(device)
        return time.perf_counter() - t0

    first = timed(1)
    whole = timed(new_tokens)
    batch = len(prompts)
    return Result(batch * len(prompts[0]) / first, batch * (new_tokens - 1) / max(whole - first, 1e-9))


def hf_reference(loaded: LoadedModel, device: torch.device, dtype: torch.dtype, dummy: bool = False) -> torch.nn.Module:
    """transformers' own model class with the same weights (the reference of the tests).

    A checkpoint folder loads through ``AutoModelForCausalLM`` (every family); in-memory weights (GGUF,
    tiny-random) fill a ``LlamaForCausalLM``. ``dummy``: transformers' own random init of the folder's config
    (speed only, as the engine's ``--load-format dummy``), drawn on ``device``.
    """
    import transformers

    if loaded.folder is not None:
        if dummy:
            config = transformers.AutoConfig.from_pretrained(str(loaded.folder))
            with torch.device(device):
                built: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
            return built.eval()
        pretrained: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=dtype)
        return pretrained.to(device).eval()
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
    result = model.load_state_dict(dict(loaded.weights()), strict=False)
    # Only the tied head may be absent from the checkpoint; anything else means the weights do not fit.
    if not set(result.missing_keys) <= {"lm_head.weight"} or result.unexpected_keys:
        raise ValueError(
            f"weights do not fit transformers' Llama: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    model.tie_weights()  # type: ignore[operator]
    return model.to(device=device, dtype=dtype).eval()


def median_of(runs: int, fn: Callable[[], Result]) -> Result:
    """Median over ``runs`` (after one warm-up run)."""
    fn()
    results = [fn() for _ in range(runs)]
    return Result(
        statistics.median(r.prefill_tok_s for r in results), statistics.median(r.decode_tok_s for r in results)
    )


def step_weight_bytes(engine: LLMEngine, batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads: every dense weight (the embedding rows
    aside), and of each MoE layer only the experts its tokens touch, expected under uniform routing
    (``E * (1 - (1 - k/E) ** batch)`` distinct experts of E when each token picks k)."""
    model, c = engine.runner.model, engine.model_config
    total: float = 0.0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and not c.tie_word_embeddings:
            continue  # a step reads only its tokens' rows
        size: float = p.numel() * p.element_size()
        if name.endswith(("experts.w13", "experts.w2")) and c.num_experts:
            e, k = c.num_experts, c.num_experts_per_tok
            size *= 1 - (1 - k / e) ** batch
        total += size
    return total


def roofline_tok_s(engine: LLMEngine, batch: int, context: int, device: str) -> float:
    """Decode tok/s if a step only read its weights and the batch's KV once at full HBM bandwidth."""
    bw = next((v for k, v in HBM_BYTES_S.items() if k in device), None)
    if bw is None:
        return 0.0
    c = engine.model_config
    elem = torch.empty((), dtype=engine.runner.cache_dtype).element_size()
    # Per rank (with -tp N, rank 0's weights and KV heads: the ranks read theirs at the same time).
    kv = batch * context * c.num_hidden_layers * 2 * engine.runner.kv_heads * c.head_dim * elem
    return batch * bw / (step_weight_bytes(engine, batch) + kv)


def prefix_row(loaded: LoadedModel, args: EngineArgs, length: int, runs: int = 3) -> dict[str, float]:
    """Median prefill seconds of a ``length``-token prompt: caching off, a miss, a one-block hit, a half hit.

    Each timed prompt shares its first tokens with a prompt served before it and has a suffix of
    its own, so only the intended prefix can come from the cache. The three cases take turns run by
    run, so a machine whose load changes during the row slows them alike.
    """
    vocab = loaded.config.vocab_size
    base = _prompts(1, length, vocab, 4242)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    half = length // 2 // args.block_size * args.block_size
    # Shared leading tokens per case; -1: caching on, but the prompt shares nothing (a miss).
    cases = {"no_cache": 0, "cache_miss": -1, "one_block_hit": args.block_size, "half_hit": half}
    engines: dict[str, LLMEngine] = {}
    for name, shared in cases.items():
        engine = LLMEngine(replace(args, enable_prefix_caching=shared != 0), loaded=loaded)
        engine.generate([base[:32]], params)  # warm-up: kernels compiled
        engine.generate([base], params)  # base's blocks in the prefix cache (when caching)
        engines[name] = engine
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(runs):
        suffix = _prompts(1, length, vocab, 5000 + run)[0]
        for name, shared in cases.items():
            engine = engines[name]
            prompt = base[: max(shared, 0)] + suffix[: length - max(shared, 0)]
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            _sync(engine.device)
            times[name].append(time.perf_counter() - t0)
    engines.clear()
    gc.collect()
    return {name: statistics.median(t) for name, t in times.items()}


def async_ab(engine: LLMEngine, batches: list[int], prompt_len: int, new_tokens: int, runs: int,
             temperature: float = 0.0, top_p: float = 1.0) -> dict[int, dict[str, float]]:  # fmt: skip
    """Decode tok/s of each batch with --async-scheduling off and on, runs alternating on the same engine (the same
    weights, graphs and prompts); medians, and on / off. Greedy unless ``temperature`` (with ``top_p``) asks for
    sampling."""
    vocab = engine.model_config.vocab_size
    keep = engine.async_scheduling
    out: dict[int, dict[str, float]] = {}
    try:
        for b in batches:
            prompts = _prompts(b, prompt_len, vocab, b)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(max(runs, 3)):
                for mode in ("off", "on"):
                    engine.async_scheduling = mode == "on"
                    times[mode].append(bench_engine(engine, prompts, new_tokens, temperature, top_p).decode_tok_s)
                    engine.drain()
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            out[b] = {"off": off, "on": on, "on_over_off": on / off}
            print(f"  async scheduling batch {b}: decode {off:.1f} tok/s off, {on:.1f} on ({on / off:.3f}x)",
                  flush=True)  # fmt: skip
    finally:
        engine.async_scheduling = keep
    return out


def profile_step(engine: LLMEngine, prompt_len: int, batch: int = 1, steps: int = 200) -> dict[str, Any]:
    """Mean microseconds per decode step of ``batch`` sequences: scheduling + input staging, the model,
    bookkeeping; on CUDA also the GPU time of the step's 25 costliest kernels."""
    vocab = engine.model_config.vocab_size
    steps = max(1, min(steps, engine.max_model_len - prompt_len - 14))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 12, ignore_eos=True)  # 10 more for the trace
    seqs = [engine.add_request(p, params) for p in _prompts(batch, prompt_len, vocab, 99)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        engine.step()
    engine.drain()  # one step at a time below: the host's part of each is timed alone
    host = model = post = gpu = 0.0
    cuda = engine.device.type == "cuda"
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduled = engine.schedule()
        assert scheduled is not None
        scheduled_batch, step = scheduled
        t1 = time.perf_counter()
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        tokens = engine.execute(step)  # ends with the tokens on the host: a full sync
        if cuda:
            end.record()
            end.synchronize()
            gpu += start.elapsed_time(end) * 1e3
        t2 = time.perf_counter()
        engine.postprocess(scheduled_batch, tokens)
        t3 = time.perf_counter()
        host, model, post = host + (t1 - t0) * 1e6, model + (t2 - t1) * 1e6, post + (t3 - t2) * 1e6
    kernels: list[tuple[str, float]] = []
    critical: dict[str, float] = {}
    if cuda:
        # Which kernels the step's GPU time goes to (graph replays are traced kernel by kernel).
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                scheduled = engine.schedule()
                assert scheduled is not None
                engine.postprocess(scheduled[0], engine.execute(scheduled[1]))
        kernels = sorted(((e.key, e.device_time_total / 10) for e in prof.key_averages()), key=lambda kv: -kv[1])
        print(f"GPU time per batch-{batch} decode step by kernel (us):")
        for key, us in kernels[:25]:
            print(f"  {us:9.1f}  {key[:110]}")
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json") as f:
                trace = json.load(f)
        spans = [(e["ts"], e["ts"] + e["dur"], kernel_label(e)) for e in trace.get("traceEvents", [])
                 if e.get("cat") == "kernel" and "dur" in e]  # fmt: skip
        critical = {k: us / 10 for k, us in critical_path(spans).items()}
        launches = launch_times(spans)
        print(f"critical path of a batch-{batch} decode step by kernel (us; kernels overlap under PDL; launches a "
              f"step, each's own mean us):")  # fmt: skip
        for key, us in sorted(critical.items(), key=lambda kv: -kv[1])[:25]:
            count, own = launches.get(key, (0, 0.0))
            print(f"  {us:9.1f}  {count / 10:6.1f} x {own:7.2f}  {key[:110]}")
    for seq in seqs:
        engine.finish(seq, FinishReason.ABORT)
    return {
        "batch": batch,
        "schedule_and_stage_us": host / steps,
        "execute_us": model / steps,
        "execute_gpu_us": gpu / steps if cuda else 0.0,
        "postprocess_us": post / steps,
        "kernels_us": {key[:160]: us for key, us in kernels[:25]},
        "critical_us": dict(sorted(((k[:160], v) for k, v in critical.items()), key=lambda kv: -kv[1])[:40]),
    }


# The engine's own one-token kernels, whose launches in a step differ by their grid alone (a projection's rows, its
# columns in the static shared memory): the profile tells them apart by it.
BY_LAUNCH = ("token_gemv", "token_norm")


def kernel_label(event: dict[str, object]) -> str:
    """A traced kernel's name, with its grid, block and static shared memory for ``BY_LAUNCH``'s kernels (so that a
    QKV projection's launches and a down projection's are counted apart)."""
    name = str(event.get("name", ""))
    args = event.get("args")
    if name not in BY_LAUNCH or not isinstance(args, dict):
        return name
    grid, block = args.get("grid"), args.get("block")
    if not isinstance(grid, list) or not isinstance(block, list):
        return name
    dims = "x".join(str(g) for g in grid if g != 1) or "1"
    return f"{name} grid {dims} block {block[0]} smem {args.get('shared memory', '?')}"


def launch_times(spans: list[tuple[float, float, str]]) -> dict[str, tuple[int, float]]:
    """Each name's launches and their mean duration (start to end, which under PDL counts the wait for the kernel
    before) from (start, end, name) spans."""
    out: dict[str, tuple[int, float]] = {}
    for start, end, name in spans:
        count, total = out.get(name, (0, 0.0))
        out[name] = (count + 1, total + end - start)
    return {name: (count, total / count) for name, (count, total) in out.items()}


def critical_path(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Each kernel's share of the GPU's timeline, from (start, end, name) spans: what a kernel's end adds past every
    earlier kernel's (kernels overlap under PDL, so their own durations count the wait for the kernel before twice);
    the GPU's idle time between kernels goes to ``(idle)``. The shares sum to the span from the first start to the
    last end."""
    out: dict[str, float] = {}
    spans = sorted(spans)
    last = spans[0][0] if spans else 0.0  # the end of the timeline so far
    for start, end, name in spans:
        if start > last:
            out["(idle)"] = out.get("(idle)", 0.0) + start - last
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, last))
        last = max(last, end)
    return out


def tp_peer(args: EngineArgs, loaded: LoadedModel, a: argparse.Namespace) -> dict[int, Result]:
    """The same engine on one rank, timed on the same prompts: the peer of a tensor-parallel run."""
    engine = LLMEngine(replace(args, tensor_parallel_size=1, enable_expert_parallel=False), loaded=loaded)
    out: dict[int, Result] = {}
    for b in a.batch_sizes:
        out[b] = median_of(a.runs, partial(bench_engine, engine, _prompts(b, a.prompt_len, loaded.config.vocab_size, b),
                                           a.new_tokens))  # fmt: skip
        print(f"  engine tp1 batch {b}: {out[b]}", flush=True)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.throughput", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--compiled", action="store_true", help="CUDA: also transformers, static cache + torch.compile")
    p.add_argument("--compile-modes", nargs="+", default=list(COMPILE_MODES), help="torch.compile modes to try")
    p.add_argument("--enforce-eager", action="store_true", help="our engine without CUDA graphs")
    p.add_argument("--kernels", choices=["auto", "triton", "torch"], default="auto")
    p.add_argument(
        "--prefix-row",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also time the prefill of one TOKENS-long prompt with and without prefix-cache hits",
    )
    p.add_argument("--no-async-scheduling", action="store_true", help="the engine's --no-async-scheduling")
    p.add_argument(
        "--async-ab",
        action="store_true",
        help="also time each batch with --async-scheduling off and on, alternating, on the same engine",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of --async-ab's runs (greedy: 0)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of --async-ab's runs")
    p.add_argument("--profile", action="store_true", help="split a decode step into host and GPU time, by kernel")
    p.add_argument("--profile-batch", type=int, default=1, help="sequences in the profiled decode step")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights of the folder's config.json (the engine's and transformers' own init)",
    )
    p.add_argument("--quantization", choices=["fp8"], default=None, help="the engine's --quantization")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="the engine's step budget (default: every prompt of the largest batch in one step)",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="our engine on this many ranks (GPUs); above 1 the same engine on one rank is timed too, as "
                   "the peer of the ratio column")  # fmt: skip
    p.add_argument("--enable-expert-parallel", action="store_true", help="the engine's --enable-expert-parallel")
    a = p.parse_args()
    tp = a.tensor_parallel_size
    torch.set_num_threads(a.threads)

    loaded = load_model(a.model)
    max_batch = max(a.batch_sizes, default=1)
    # A profiled step's sequences decode more tokens (profile_step's steps), and as many of them at once.
    max_model_len = a.prompt_len + a.new_tokens + 16 + (40 if a.profile else 0)
    max_batch = max(max_batch, a.profile_batch if a.profile else 0)
    need = max_batch * max_model_len
    args = EngineArgs(
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        num_kvcache_blocks=(need + 15) // 16 + 8,
        max_model_len=max_model_len,
        max_num_seqs=max_batch,
        # Every batch's prompts in one prefill step, as the reference's static batch does.
        max_num_batched_tokens=a.max_num_batched_tokens or max(16384, max_batch * a.prompt_len),
        enable_prefix_caching=False,
        enforce_eager=a.enforce_eager,
        kernels=a.kernels,
        load_format=a.load_format,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
        tensor_parallel_size=tp,
        enable_expert_parallel=a.enable_expert_parallel,
        async_scheduling=not a.no_async_scheduling,
    )
    started = time.perf_counter()
    engine = LLMEngine(args, loaded=loaded if tp == 1 else None)  # every rank loads --model itself
    load_s = time.perf_counter() - started
    # Peak resident memory of the process so far: the weights' host side while they went to the device.
    build_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"engine built in {load_s:.1f} s, peak host RSS {build_rss_gib:.2f} GiB", flush=True)
    device, dtype = engine.device, engine.dtype
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{a.threads} threads"
    graphs = "cuda graphs" if engine.runner.graphs is not None else "eager"
    print(
        f"model={engine.model_id} device={name} dtype={str(dtype).removeprefix('torch.')} kernels={engine.kernels} "
        f"({graphs}) prompt={a.prompt_len} new_tokens={a.new_tokens} runs={a.runs} (median) tp={tp}"
        f"{' ep' if a.enable_expert_parallel else ''}",
        flush=True,
    )
    vocab = loaded.config.vocab_size
    ours: dict[int, Result] = {}
    for b in a.batch_sizes:
        prompts = _prompts(b, a.prompt_len, vocab, b)
        ours[b] = median_of(a.runs, partial(bench_engine, engine, prompts, a.new_tokens))
        print(f"  engine batch {b}: {ours[b]}", flush=True)
    ab = (
        async_ab(engine, a.batch_sizes, a.prompt_len, a.new_tokens, a.runs, a.temperature, a.top_p)
        if a.async_ab
        else {}
    )
    profile = profile_step(engine, a.prompt_len, a.profile_batch) if a.profile else None
    context = a.prompt_len + a.new_tokens // 2  # the mean context of the decode steps
    roof = {b: roofline_tok_s(engine, b, context, name) for b in a.batch_sizes}
    engine.close()
    del engine
    gc.collect()
    one_rank = tp_peer(args, loaded, a) if tp > 1 else {}
    ref: dict[int, Result] = {}
    compiled: dict[int, Result] = {}
    compile_notes: dict[str, str] = {}
    if not a.no_reference:
        model = hf_reference(loaded, device, dtype, dummy=a.load_format == "dummy")
        for b in a.batch_sizes:
            prompts = _prompts(b, a.prompt_len, vocab, b)
            ref[b] = median_of(a.runs, partial(bench_hf, model, prompts, a.new_tokens, device))
            print(f"  transformers eager batch {b}: {ref[b]}", flush=True)
        if a.compiled and device.type == "cuda":
            for mode in a.compile_modes:
                try:
                    for b in a.batch_sizes:
                        prompts = _prompts(b, a.prompt_len, vocab, b)
                        compiled[b] = median_of(
                            a.runs, partial(bench_hf_compiled, model, prompts, a.new_tokens, device, mode)
                        )
                        print(f"  transformers compiled ({mode}) batch {b}: {compiled[b]}", flush=True)
                    compile_notes[mode] = "ran"
                    break
                except Exception as exc:  # a mode that does not run is reported, then the next is tried
                    compile_notes[mode] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    print(f"  transformers compiled ({mode}) failed:\n{traceback.format_exc(limit=3)}", flush=True)
                    compiled.clear()
                    torch._dynamo.reset()
        del model
        gc.collect()
    print(
        f"{'batch':>5} | {'prefill tok/s':>13} {'HF':>9} {'ratio':>6} | {'decode tok/s':>12} {'HF':>9} {'ratio':>6}"
        f" | {'compiled':>9} {'ratio':>6} | {'roofline':>8}"
    )
    for b in a.batch_sizes:
        o, r, c = ours[b], ref.get(b), compiled.get(b)
        line = f"{b:>5} | {o.prefill_tok_s:>13.0f} "
        line += f"{r.prefill_tok_s:>9.0f} {o.prefill_tok_s / r.prefill_tok_s:>5.2f}x" if r else f"{'-':>9} {'-':>6}"
        line += f" | {o.decode_tok_s:>12.1f} "
        line += f"{r.decode_tok_s:>9.1f} {o.decode_tok_s / r.decode_tok_s:>5.2f}x" if r else f"{'-':>9} {'-':>6}"
        line += f" | {c.decode_tok_s:>9.1f} {o.decode_tok_s / c.decode_tok_s:>5.2f}x" if c else f" | {'-':>9} {'-':>6}"
        line += f" | {100 * o.decode_tok_s / roof[b]:>7.1f}%" if roof[b] else f" | {'-':>8}"
        print(line)
    if one_rank:
        ours_tp = f"tp{tp}"
        print(f"{'batch':>5} | {ours_tp + ' decode':>12} {'tp1':>9} {'ratio':>6} | {ours_tp + ' prefill':>13} "
              f"{'tp1':>9} {'ratio':>6}")  # fmt: skip
        for b in a.batch_sizes:
            o, r = ours[b], one_rank[b]
            print(f"{b:>5} | {o.decode_tok_s:>12.1f} {r.decode_tok_s:>9.1f} {o.decode_tok_s / r.decode_tok_s:>5.2f}x"
                  f" | {o.prefill_tok_s:>13.0f} {r.prefill_tok_s:>9.0f}"
                  f" {o.prefill_tok_s / r.prefill_tok_s:>5.2f}x")  # fmt: skip
    prefix = None
    if a.prefix_row:
        blocks = (a.prefix_row + 64) // args.block_size * 4
        one = replace(args, max_num_seqs=1, cudagraph_capture_sizes=(1,), num_kvcache_blocks=blocks,
                      max_model_len=a.prefix_row + 16)  # fmt: skip
        prefix = prefix_row(loaded, one, a.prefix_row, runs=max(3, a.runs))
    if prefix:
        print(f"prefill of one {a.prefix_row}-token prompt: " + ", ".join(f"{k} {v:.3f} s" for k, v in prefix.items()))
    if profile:
        print(
            f"batch-{profile['batch']} decode step: "
            + ", ".join(f"{k} {v:.0f}" for k, v in profile.items() if k.endswith("_us") and isinstance(v, float))
        )
    if a.json:
        report = {
            "date": datetime.date.today().isoformat(),
            "device": name,
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            # The reference's speed depends on its version (recent releases run MoE experts as grouped matmuls).
            "transformers": None if a.no_reference else importlib.metadata.version("transformers"),
            "kernels": f"{args.kernels} -> {'graphs' if graphs == 'cuda graphs' else 'eager'}",
            "prompt_len": a.prompt_len,
            "engine_build_s": load_s,
            "engine_build_peak_rss_gib": build_rss_gib,
            "load_format": a.load_format,
            "quantization": a.quantization,
            "kv_cache_dtype": a.kv_cache_dtype,
            "new_tokens": a.new_tokens,
            "batches": {
                str(b): {
                    "engine": asdict(ours[b]),
                    "transformers_eager": asdict(ref[b]) if b in ref else None,
                    "transformers_compiled": asdict(compiled[b]) if b in compiled else None,
                    "decode_roofline_tok_s": roof[b],
                }
                for b in a.batch_sizes
            },
            "compile_modes": compile_notes,
            "tensor_parallel_size": tp,
            "expert_parallel": a.enable_expert_parallel,
            "tp1_peer": {str(b): asdict(r) for b, r in one_rank.items()},
            "prefix_cache_prefill_s": prefix,
            "step_profile_us": profile,
            "async_scheduling": not a.no_async_scheduling,
            "async_ab_decode_tok_s": {str(b): {**v, "roofline_tok_s": roof[b]} for b, v in ab.items()},
            "async_ab_sampling": {"temperature": a.temperature, "top_p": a.top_p},
        }
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
