"""`python -m bench.gateway.serving`: load any OpenAI-compatible server the way ATOM's / vLLM's benchmark_serving does.

Random prompts of `--random-input-len` words (+- `--random-range-ratio`), `--random-output-len`
tokens each, streamed through `/v1/completions`; requests arrive at `--request-rate` (Poisson, or
all at once with `inf`) with at most `--max-concurrency` in flight. Reports request and token
throughput and TTFT / TPOT / ITL / E2E latency percentiles. `--sweep-concurrency 1,4,16` runs one
pass per concurrency and draws throughput per worker against tokens/s per user (PNG), the chart
InferenceX shows for MiniMax-M3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.gateway import help_formatter

# Common English words: each is about one token for Llama-family BPE vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made these game season him film year team under"
).split()


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    input_len: int
    output_len: int


@dataclass(slots=True)
class Outcome:
    ok: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
    out = []
    for _ in range(n):
        n_in = rng.randint(lo_in, hi_in)
        out.append(Prompt(" ".join(rng.choice(_WORDS) for _ in range(n_in)), n_in, rng.randint(lo_out, hi_out)))
    return out


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str | None, p: Prompt, ignore_eos: bool
) -> Outcome:
    body: dict[str, Any] = {
        "prompt": p.text,
        "max_tokens": p.output_len,
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    started = time.perf_counter()
    last = started
    out = Outcome(ok=False, prompt_len=p.input_len)
    chunks = 0
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                event = orjson.loads(payload)
                if "error" in event:
                    out.error = str(event["error"])[:200]
                    return out
                usage = event.get("usage")
                if usage:
                    out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
                    out.output_tokens = usage.get("completion_tokens", out.output_tokens)
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - started
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.e2el = time.perf_counter() - started
    out.output_tokens = out.output_tokens or chunks
    out.ok = chunks > 0
    if not out.ok:
        out.error = "no tokens"
    return out


async def run_pass(
    base_url: str,
    model: str | None,
    prompts: list[Prompt],
    max_concurrency: int,
    request_rate: float,
    ignore_eos: bool,
    seed: int,
    progress: bool = True,
) -> dict[str, Any]:
    """One benchmark pass; returns its summary."""
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency)
    rng = random.Random(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc=f"concurrency {max_concurrency}", leave=False)
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def limited(p: Prompt) -> Outcome:
            async with sem:
                o = await one_request(session, url, model, p, ignore_eos)
            if bar is not None:
                bar.update(1)
            return o

        started = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(limited(p)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return summarize(outcomes, duration, max_concurrency)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize(
    outcomes: list[Outcome], duration: float, concurrency: int, percentiles: tuple[float, ...] = (50, 90, 99)
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_len for o in ok)
    ttft = [o.ttft * 1000 for o in ok]
    tpot = [(o.e2el - o.ttft) / (o.output_tokens - 1) * 1000 for o in ok if o.output_tokens > 1]
    itl = [x * 1000 for o in ok for x in o.itl]
    e2el = [o.e2el * 1000 for o in ok]
    result: dict[str, Any] = {
        "max_concurrency": concurrency,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        result[f"mean_{name}_ms"] = statistics.fmean(values) if values else float("nan")
        result[f"median_{name}_ms"] = _pct(values, 50)
        for q in percentiles:
            result[f"p{q:g}_{name}_ms"] = _pct(values, q)
    mean_tpot = result["mean_tpot_ms"]
    result["tokens_per_sec_per_user"] = 1000.0 / mean_tpot if mean_tpot and math.isfinite(mean_tpot) else 0.0
    return result


def print_summary(r: dict[str, Any], metrics: list[str], percentiles: list[float], num_workers: int) -> None:
    line = "=" * 56
    print(line)
    print(f"{'Serving benchmark result':^56}")
    print(line)
    rows = [
        ("Max concurrency", r["max_concurrency"]),
        ("Successful requests", r["completed"]),
        ("Failed requests", r["failed"]),
        ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
        ("Output tok/s per worker", f"{r['output_throughput'] / num_workers:.2f}"),
        ("Tokens/s per user (1/TPOT)", f"{r['tokens_per_sec_per_user']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v:>16}")
    names = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for m in metrics:
        print(f"{names[m]:-^56}")
        print(f"{'Mean ' + m.upper() + ' (ms)':<40}{r[f'mean_{m}_ms']:>16.2f}")
        print(f"{'Median ' + m.upper() + ' (ms)':<40}{r[f'median_{m}_ms']:>16.2f}")
        for q in percentiles:
            print(f"{f'P{q:g} ' + m.upper() + ' (ms)':<40}{r[f'p{q:g}_{m}_ms']:>16.2f}")
    if r["errors"]:
        print("Errors:", *r["errors"], sep="\n  ")
    print(line)


def plot_sweep(results: list[dict[str, Any]], num_workers: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["tokens_per_sec_per_user"] for r in results]
    ys = [r["output_throughput"] / num_workers for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, ys, marker="o")
    for r, x, y in zip(results, xs, ys, strict=True):
        ax.annotate(f"c={r['max_concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity: tokens/s per user")
    ax.set_ylabel("throughput: output tokens/s per worker")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(
    base_url: str,
    model: str | None,
    dataset_name: str,
    input_len: int,
    output_len: int,
    range_ratio: float,
    num_prompts: int,
    concurrencies: list[int],
    request_rate: float,
    ignore_eos: bool,
    metrics: list[str],
    percentiles: list[float],
    num_workers: int,
    seed: int,
    save_result: Path | None,
    plot: Path | None,
    prompts_per_concurrency: int = 0,
) -> None:
    """Entry point of `python -m bench.gateway.serving` (the CLI parses and checks the flags)."""
    if dataset_name != "random":
        raise ValueError(f"--dataset-name {dataset_name!r} is not supported yet; use 'random'")
    results = []
    for c in concurrencies:
        n = max(num_prompts, prompts_per_concurrency * c) if prompts_per_concurrency else num_prompts
        prompts = random_prompts(n, input_len, output_len, range_ratio, seed)
        r = asyncio.run(run_pass(base_url, model, prompts, c, request_rate, ignore_eos, seed))
        r.update(
            base_url=base_url,
            model=model,
            random_input_len=input_len,
            random_output_len=output_len,
            num_prompts=n,
            request_rate=request_rate,
            num_workers=num_workers,
        )
        print_summary(r, metrics, percentiles, num_workers)
        results.append(r)
    if save_result is not None:
        payload: Any = results[0] if len(results) == 1 else results
        save_result.write_text(json.dumps(payload, indent=2, default=str))
        print(f"saved {save_result}")
    if plot is not None:
        plot_sweep(results, num_workers, plot, f"ISL {input_len} / OSL {output_len} at {base_url}")
        print(f"saved {plot}")


def _csv_ints(text: str) -> list[int]:
    """A comma list of concurrencies (each >= 1), for argparse."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be >= 1")
    return values


def _csv_floats(text: str) -> list[float]:
    try:
        return [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _metrics(text: str) -> list[str]:
    metrics = [m.strip() for m in text.split(",") if m.strip()]
    unknown = set(metrics) - {"ttft", "tpot", "itl", "e2el"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown metrics {sorted(unknown)}")
    return metrics


def _at_least(low: float, kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gateway.serving", description=__doc__.split("\n")[0], formatter_class=help_formatter
    )
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:30000", help="Server to load (atomesh or any OpenAI server).")
    a("--model", default=None, help="Model name sent with each request.")
    a("--dataset-name", default="random", help="Prompt source (random).")
    a("--random-input-len", type=_at_least(1, int), default=1024, help="Prompt length in words (~tokens).")
    a("--random-output-len", type=_at_least(1, int), default=128, help="Tokens generated per request.")
    a("--random-range-ratio", type=_at_least(0.0, float), default=0.0, help="Lengths vary by +- this ratio (0..1).")
    a("--num-prompts", type=_at_least(1, int), default=100, help="Requests per pass.")
    a(
        "--prompts-per-concurrency",
        type=_at_least(0, int),
        default=0,
        help="With a sweep: each pass sends at least this many requests per unit of concurrency.",
    )
    a("--max-concurrency", type=_at_least(1, int), default=16, help="Requests in flight at most.")
    a("--sweep-concurrency", type=_csv_ints, default=None, help="Comma list of concurrencies: one pass each.")
    a(
        "--request-rate",
        type=_at_least(0.0, float),
        default=float("inf"),
        help="Poisson arrivals per second (inf: at once).",
    )
    a("--ignore-eos", action="store_true", help="Generate exactly the requested output length.")
    a("--percentile-metrics", type=_metrics, default=["ttft", "tpot", "itl"], help="Of ttft,tpot,itl,e2el.")
    a("--metric-percentiles", type=_csv_floats, default=[99.0], help="Comma list of percentiles to report.")
    a(
        "--num-workers",
        type=_at_least(1, int),
        default=1,
        help="Workers (GPUs) behind the server, for per-worker throughput.",
    )
    a("--seed", type=int, default=0, help="Prompt and arrival seed.")
    a("--save-result", type=Path, default=None, help="Write the results as JSON here.")
    a("--plot", type=Path, default=None, help="Draw throughput/worker vs tokens/s/user as PNG here.")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.random_range_ratio > 1.0:
        p.error("--random-range-ratio: must be <= 1")
    try:
        run(
            args.base_url,
            args.model,
            args.dataset_name,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.num_prompts,
            args.sweep_concurrency or [args.max_concurrency],
            args.request_rate,
            args.ignore_eos,
            args.percentile_metrics,
            args.metric_percentiles,
            args.num_workers,
            args.seed,
            args.save_result,
            args.plot,
            args.prompts_per_concurrency,
        )
    except ValueError as e:
        p.error(str(e))


__all__ = ["Prompt", "asdict", "main", "random_prompts", "run", "summarize"]


if __name__ == "__main__":
    main()
