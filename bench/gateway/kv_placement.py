"""KV-aware placement on real engines: `python -m bench.gateway.kv_placement`.

Starts N engine processes (`engine.openai_server`, SmolLM2 on CPU by default, small KV pools so that
the prefix caches evict, KV events on) and, per policy, gateway processes in front of them. Traces,
replayed with streamed chat requests (max_tokens 1) by a fixed number of clients:

- multi-turn: C conversations x T turns; each turn re-sends the whole conversation (a canned
  assistant reply between user turns);
- shared system prompt: R single-turn requests, each one of S long system prompts plus a short
  unique question;
- restart: the multi-turn trace with the gateways restarted (new processes) after every
  conversation's first turn; the conversations then come back in another order;
- long-tail: the multi-turn trace with a quarter of the conversations (drawn at random, anew each
  round) 4x as long (turns), as chat lengths are in practice: where the long ones end up decides
  how much KV each engine must hold.

With `--replicas 2` (the default) every policy runs as two independent gateway processes and the
clients alternate between them per request, as behind a plain L4 load balancer: each cache_aware
instance sees half of the traffic, while kv_aware instances both read the engines' own events.
`--replicas 1` runs one gateway.

Reported per policy: the engines' own prefix-cache hit rate (cached / looked-up prompt tokens, from
their /metrics, deltas over the run), TTFT p50 / p99 as the client saw it, load balance (max / min
requests per engine, from the engines' counters) and the cached blocks the engines evicted (the
pressure; every run starts from flushed prefix caches). `--kv-blocks` takes several pool sizes: a
sweep, the engines restarted for each. Each run salts its prompts too, so that no run could reuse
another's cache. Then (a): kv_aware's decision cost per request at 16 workers with 32 KB prompts,
with tokenization measured on its own.

It prints and writes JSON (`--json`); it never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from atomesh.config import GatewayConfig
from atomesh.kv.index import as_tokens, chain_keys
from atomesh.kv.tokens import PromptTokenizer
from atomesh.placement import Placement, Plan
from atomesh.policies import make_kv_aware
from atomesh.request import RequestView, Route
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState
from bench.gateway.placement import wait_http
from bench.gateway.procs import free_port, start, stop

POLICIES = ("kv_aware", "cache_aware", "prefix_hash", "round_robin")
WORDS = (
    "the quick brown fox jumps over lazy dogs while engines prefill long prompts and decode tokens "
    "system user assistant context window cache block prefix router gateway latency"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ---------------------------------------------------------------------------------------------- traces
Request = tuple[int, list[dict[str, str]]]  # (conversation, messages so far)


def multi_turn(salt: str, conversations: int, turns: int, seed: int = 1) -> list[list[dict[str, str]]]:
    """Per conversation, its user turns (the replay adds assistant replies between them)."""
    return _chats(salt, [turns] * conversations, random.Random(seed))


def long_tail(salt: str, conversations: int, turns: int, seed: int = 3) -> list[list[dict[str, str]]]:
    """The multi-turn trace with lengths as real chats have them, a few long and most short: a
    quarter of the conversations, drawn at random (``seed``), run ``4 * turns`` turns, the others
    ``turns``. Nothing tells the long ones apart when they start; where they end up decides how much
    KV an engine must hold."""
    rng = random.Random(seed)
    long = set(rng.sample(range(conversations), max(1, conversations // 4)))
    return _chats(salt, [4 * turns if c in long else turns for c in range(conversations)], rng)


def _chats(salt: str, turns: list[int], rng: random.Random) -> list[list[dict[str, str]]]:
    """Conversation c: a system message, then ``turns[c]`` user messages."""
    return [
        [
            {"role": "system", "content": f"{salt} You are assistant {c}. Answer briefly."},
            *({"role": "user", "content": f"question {t} of chat {c}: " + words(rng, 45)} for t in range(n)),
        ]
        for c, n in enumerate(turns)
    ]


def shared_prefix(salt: str, systems: int, requests: int, seed: int = 2) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    prompts = [f"{salt} system prompt {s}: " + words(rng, 130) for s in range(systems)]
    return [
        [
            {"role": "system", "content": prompts[rng.randrange(systems)]},
            {"role": "user", "content": f"question {i}: " + words(rng, 25)},
        ]
        for i in range(requests)
    ]


@dataclass(slots=True)
class RunResult:
    trace: str
    policy: str
    replicas: int
    hit_rate: float
    cached_tokens: int
    prompt_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    load_ratio: float
    requests_per_engine: list[int]
    errors: int
    seconds: float
    gateway: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    kv_blocks: int = 0  # per engine
    evicted_blocks: int = 0  # cached blocks the engines dropped to reuse their memory, over the run


def _reply(c: int, t: int) -> dict[str, str]:
    return {"role": "assistant", "content": f"Answer {t} for chat {c}: noted, continuing."}


async def replay_multi_turn(
    session: aiohttp.ClientSession,
    gws: list[str],
    convs: list[list[dict[str, str]]],
    concurrency: int,
    model: str,
    first: int = 0,
    until: int | None = None,
) -> tuple[list[float], int]:
    """Clients take ready conversations in turn order; a conversation's next turn waits for its last.
    Turns ``first`` to ``until`` (exclusive; each conversation's own number of turns at most) are
    sent; earlier ones are in the conversation already."""
    ready: asyncio.Queue[tuple[int, int, list[dict[str, str]]]] = asyncio.Queue()
    last = [len(conv) - 1 if until is None else min(until, len(conv) - 1) for conv in convs]
    order = [c for c in range(len(convs)) if last[c] > first]
    if first:  # conversations taken up again come back in their own order, not the one they started in
        random.Random(first).shuffle(order)
    for c in order:
        conv = convs[c]
        before = [conv[0]]
        for t in range(first):
            before += [conv[1 + t], _reply(c, t)]
        ready.put_nowait((c, first, before))
    remaining = sum(last[c] - first for c in order)
    ttfts: list[float] = []
    errors = 0
    sent = 0

    async def client() -> None:
        nonlocal remaining, errors, sent
        while remaining > 0:
            try:
                c, t, msgs = await asyncio.wait_for(ready.get(), 0.05)
            except TimeoutError:
                continue
            msgs = [*msgs, convs[c][1 + t]]
            gw = gws[sent % len(gws)]
            sent += 1
            ttft = await one(session, gw, msgs, model)
            if ttft is None:
                errors += 1
            else:
                ttfts.append(ttft)
            remaining -= 1
            if t + 1 < last[c]:
                ready.put_nowait((c, t + 1, [*msgs, _reply(c, t)]))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, errors


async def replay_independent(
    session: aiohttp.ClientSession, gws: list[str], reqs: list[list[dict[str, str]]], concurrency: int, model: str
) -> tuple[list[float], int]:
    queue = list(reversed(list(enumerate(reqs))))
    ttfts: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        while queue:
            i, msgs = queue.pop()
            ttft = await one(session, gws[i % len(gws)], msgs, model)
            if ttft is None:
                errors += 1
            else:
                ttfts.append(ttft)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ttfts, errors


async def one(session: aiohttp.ClientSession, gw: str, msgs: list[dict[str, str]], model: str) -> float | None:
    body = {"model": model, "messages": msgs, "max_tokens": 1, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(gw + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None
            async for line in r.content:
                # The first chunk that carries text (an opening chunk with only the role does not count).
                if ttft is None and line.startswith(b"data: {") and _has_content(line[6:]):
                    ttft = time.perf_counter() - t0
            if ttft is None:
                ttft = time.perf_counter() - t0  # the token was empty text (e.g. EOS): the whole response
    except aiohttp.ClientError:
        return None
    return ttft


def _has_content(data: bytes) -> bool:
    try:
        choice = json.loads(data)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    return bool((choice.get("delta") or {}).get("content"))


# ---------------------------------------------------------------------------------------------- engines
_COUNTERS = (
    "atom:prefix_cache_cached_tokens_total",
    "atom:prefix_cache_wanted_tokens_total",
    "atom:requests_finished_total",
    "atom:prefix_cache_evicted_blocks_total",
)


async def engine_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for name in _COUNTERS:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def run_one(
    session: aiohttp.ClientSession,
    engines: list[str],
    policy: str,
    trace: str,
    replicas: int,
    args: argparse.Namespace,
    model: str,
    rnd: int = 0,
    kv_blocks: int = 0,
) -> RunResult:
    salt = f"[{trace} {policy} x{replicas} {time.time_ns()}]"
    for e in engines:  # every run starts from empty prefix caches: its evictions are its own
        async with session.post(e + "/flush_cache") as r:
            r.raise_for_status()
    procs, gws = _gateways(engines, policy, trace, replicas, args, rnd)
    try:
        await _ready(session, gws, policy)
        before = [await engine_counters(session, e) for e in engines]
        t0 = time.perf_counter()
        if trace == "shared-prefix":
            reqs = shared_prefix(salt, args.systems, args.requests)
            ttfts, errors = await replay_independent(session, gws, reqs, args.concurrency, model)
        else:
            if trace == "long-tail":  # which conversations are long changes from round to round
                convs = long_tail(salt, args.conversations, args.turns, seed=3 + rnd)
            else:
                convs = multi_turn(salt, args.conversations, args.turns)
            if trace == "restart":  # the gateways restart (a rolling update) after every first turn
                ttfts, errors = await replay_multi_turn(session, gws, convs, args.concurrency, model, until=1)
                for p in procs:
                    stop(p)
                procs, gws = _gateways(engines, policy, trace, replicas, args, rnd, "b")
                await _ready(session, gws, policy)
                more, errs = await replay_multi_turn(session, gws, convs, args.concurrency, model, first=1)
                ttfts, errors = ttfts + more, errors + errs
            else:
                ttfts, errors = await replay_multi_turn(session, gws, convs, args.concurrency, model)
        seconds = time.perf_counter() - t0
        after = [await engine_counters(session, e) for e in engines]
    finally:
        for p in procs:
            stop(p)
    cached = sum(a[_COUNTERS[0]] - b[_COUNTERS[0]] for a, b in zip(after, before, strict=True))
    wanted = sum(a[_COUNTERS[1]] - b[_COUNTERS[1]] for a, b in zip(after, before, strict=True))
    per = [int(a[_COUNTERS[2]] - b[_COUNTERS[2]]) for a, b in zip(after, before, strict=True)]
    evicted = sum(a[_COUNTERS[3]] - b[_COUNTERS[3]] for a, b in zip(after, before, strict=True))
    return RunResult(
        trace,
        policy,
        replicas,
        cached / wanted if wanted else 0.0,
        int(cached),
        int(wanted),
        pct(ttfts, 0.5) * 1e3,
        pct(ttfts, 0.99) * 1e3,
        max(per) / max(1, min(per)),
        per,
        errors,
        seconds,
        round=rnd,
        kv_blocks=kv_blocks,
        evicted_blocks=int(evicted),
    )


def _gateways(
    engines: list[str], policy: str, trace: str, replicas: int, args: argparse.Namespace, rnd: int, tag: str = ""
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs = []
    gws = []
    sync = [f"tcp://127.0.0.1:{free_port()}" for _ in range(replicas)]
    for r in range(replicas):
        port, mport = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "atomesh",
            "launch",
            "--policy",
            policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(mport),
            "--log-level",
            args.gateway_log_level,
            "--worker-urls",
            *engines,
        ]
        if policy == "kv_aware":
            cmd += args.kv_args
        if policy == "kv_aware" and replicas > 1 and args.kv_sync:  # the replicas share their placements
            cmd += ["--kv-sync-bind", sync[r], "--kv-sync-peers", *(a for i, a in enumerate(sync) if i != r)]
        procs.append(start(cmd, Path(f"/tmp/atomesh-bench-kv-{trace}-{policy}-x{replicas}-{rnd}-{r}{tag}.log")))
        gws.append(f"http://127.0.0.1:{port}")
    return procs, gws


async def _ready(session: aiohttp.ClientSession, gws: list[str], policy: str) -> None:
    for gw in gws:
        await wait_http(session, gw + "/readiness", 60)
    if policy == "kv_aware":
        await asyncio.sleep(2.0)  # the tokenizer download and the event subscriptions' catch-up


HEADER = (
    f"{'trace':<14}{'policy':<13}{'gw':>3}{'hit':>8}{'cached':>9}{'prompt':>9}{'p50 ms':>9}{'p99 ms':>9}"
    f"{'max/min':>8}{'evict':>7}{'err':>5}{'secs':>7}  requests/engine"
)


def print_row(r: RunResult) -> None:
    print(
        f"{r.trace:<14}{r.policy:<13}{r.replicas:>3}{r.hit_rate:>8.1%}{r.cached_tokens:>9}{r.prompt_tokens:>9}"
        f"{r.ttft_p50_ms:>9.0f}{r.ttft_p99_ms:>9.0f}{r.load_ratio:>8.2f}{r.evicted_blocks:>7}{r.errors:>5}"
        f"{r.seconds:>7.1f}  {r.requests_per_engine}",
        flush=True,
    )


def summarize(
    results: list[RunResult], traces: list[str], replicas: list[int], policies: list[str]
) -> list[dict[str, Any]]:
    """Per KV pool size, trace, gateway count and policy: medians over the rounds; then kv_aware
    against cache_aware."""
    rows: dict[tuple[int, str, int, str], dict[str, Any]] = {}
    pools = sorted({r.kv_blocks for r in results})
    print(
        f"\nmedians over the rounds\n{'blocks':>6}  {'trace':<14}{'policy':<13}{'gw':>3}{'hit':>8}{'min':>8}"
        f"{'max':>8}{'p50 ms':>9}{'p99 ms':>9}{'max/min':>8}{'evict':>7}{'runs':>6}"
    )
    for key in itertools.product(pools, traces, replicas, policies):
        rs = [r for r in results if (r.kv_blocks, r.trace, r.replicas, r.policy) == key]
        if not rs:
            continue
        pool, trace, gw, policy = key
        hits = [r.hit_rate for r in rs]
        row = rows[key] = {
            "kv_blocks": pool,
            "trace": trace,
            "replicas": gw,
            "policy": policy,
            "runs": len(rs),
            "hit_rate": statistics.median(hits),
            "hit_min": min(hits),
            "hit_max": max(hits),
            "ttft_p50_ms": statistics.median(r.ttft_p50_ms for r in rs),
            "ttft_p99_ms": statistics.median(r.ttft_p99_ms for r in rs),
            "load_ratio": statistics.median(r.load_ratio for r in rs),
            "evicted_blocks": statistics.median(r.evicted_blocks for r in rs),
        }
        print(
            f"{pool:>6}  {trace:<14}{policy:<13}{gw:>3}{row['hit_rate']:>8.1%}{row['hit_min']:>8.1%}"
            f"{row['hit_max']:>8.1%}{row['ttft_p50_ms']:>9.0f}{row['ttft_p99_ms']:>9.0f}"
            f"{row['load_ratio']:>8.2f}{row['evicted_blocks']:>7.0f}{len(rs):>6}"
        )
    for pool, trace, gw in itertools.product(pools, traces, replicas):
        ka, ca = rows.get((pool, trace, gw, "kv_aware")), rows.get((pool, trace, gw, "cache_aware"))
        if ka and ca:
            cell = {
                (r.policy, r.round): r.hit_rate
                for r in results
                if (r.kv_blocks, r.trace, r.replicas) == (pool, trace, gw)
            }
            per_round = [
                cell[("kv_aware", n)] / max(cell[("cache_aware", n)], 1e-9)
                for n in sorted({n for _, n in cell})
                if ("kv_aware", n) in cell and ("cache_aware", n) in cell
            ]
            ratio = ka["hit_rate"] / max(ca["hit_rate"], 1e-9)
            ka["vs_cache_aware"] = ratio
            ka["vs_cache_aware_per_round"] = per_round
            print(
                f"{pool} blocks, {trace}, {gw} gateway(s): kv_aware hit rate x{ratio:.2f} of cache_aware (medians "
                f"{ka['hit_rate']:.1%} vs {ca['hit_rate']:.1%}; per round "
                f"{' '.join(f'x{x:.2f}' for x in per_round)}), load max/min {ka['load_ratio']:.2f} vs "
                f"{ca['load_ratio']:.2f}, TTFT p50 {ka['ttft_p50_ms']:.0f} vs {ca['ttft_p50_ms']:.0f} ms"
            )
    return list(rows.values())


# ---------------------------------------------------------------------------------------------- decision cost
def bench_decision(
    tokenizer: PromptTokenizer, requests: int, workers: int = 16, prompt_kb: int = 32, block_size: int = 16
) -> dict[str, float]:
    """kv_aware's placement decision with 32 requests in flight; tokenization timed on its own."""
    rng = random.Random(0)
    shared = [words(rng, prompt_kb * 1024 * 3 // 4 // 6) for _ in range(64)]
    texts = [rng.choice(shared) + " " + words(rng, prompt_kb * 1024 // 4 // 6) for _ in range(min(requests, 256))]
    # Tokenization, as the gateway does it per request: a 32 KB completion prompt (one piece, not cached
    # unless repeated) and the same as chat (the 24 KB system message is a cached piece after first use).
    t_plain, t_chat = [], []
    for i, text in enumerate(texts[:64]):
        t0 = time.perf_counter_ns()
        tokenizer.ids(RequestView(Route.COMPLETIONS, {"prompt": text + f" {i}"}, b"", "r"))
        t_plain.append((time.perf_counter_ns() - t0) / 1000)
        sys_part, user_part = text[: len(text) * 3 // 4], text[len(text) * 3 // 4 :]
        chat = {"messages": [{"role": "system", "content": sys_part}, {"role": "user", "content": user_part}]}
        t0 = time.perf_counter_ns()
        tokenizer.ids(RequestView(Route.CHAT, chat, b"", "r"))
        t_chat.append((time.perf_counter_ns() - t0) / 1000)
    ids = [tokenizer.ids(RequestView(Route.COMPLETIONS, {"prompt": t}, b"", "r")) for t in texts]
    registry = WorkerRegistry()
    ws = []
    for i in range(workers):
        w = Worker(f"http://10.0.0.{i}:8000")
        registry.add(w)
        registry.set_state(w, WorkerState.READY)
        ws.append(w)
    cfg = GatewayConfig.model_validate({"policy": "kv_aware"})
    policy = make_kv_aware(cfg)
    pre = {id(t): a for t, a in zip(texts, ids, strict=True)}
    views = [RequestView(Route.COMPLETIONS, {"prompt": t}, b"", "r") for t in texts]
    by_view = {id(v): pre[id(t)] for v, t in zip(views, texts, strict=True)}

    class Pretokenized(PromptTokenizer):
        """The ids computed above: the decision measured without tokenization."""

        def __init__(self) -> None:
            pass

        def ids(self, view: RequestView) -> Any:
            return by_view[id(view)]

    policy.tokenizer = Pretokenized()
    # Each worker holds 8 of the 64 shared prefixes, as its events described them.
    for wi, w in enumerate(ws):
        policy.index.add_worker(w.url, block_size)
        for j in range(8):
            toks = tokenizer.ids(RequestView(Route.COMPLETIONS, {"prompt": shared[(wi * 8 + j) % 64]}, b"", "r"))
            assert toks is not None
            n = len(toks) // block_size
            policy.index.stored(
                w.url, [(wi, j, k) for k in range(n)], None, toks[: n * block_size].tolist(), block_size
            )
    placement = Placement(registry, {WorkerRole.REGULAR: policy}, pd=False)
    inflight: list[Plan] = []
    times: list[float] = []
    keys_t: list[float] = []
    gc.collect()
    for k in range(requests):
        view = views[k % len(views)]
        t0 = time.perf_counter_ns()
        plan = placement.place(view)
        times.append((time.perf_counter_ns() - t0) / 1000)
        inflight.append(plan)
        if len(inflight) > 32:
            placement.release(inflight.pop(0))
        if k < 200:
            t0 = time.perf_counter_ns()
            chain_keys(as_tokens(by_view[id(view)]), block_size)
            keys_t.append((time.perf_counter_ns() - t0) / 1000)
    tokens = statistics.fmean(len(a) for a in ids if a is not None)
    out = {
        "decision_p50_us": pct(times, 0.5),
        "decision_p99_us": pct(times, 0.99),
        "decision_mean_us": statistics.fmean(times),
        "block_keys_p50_us": pct(keys_t, 0.5),
        "tokenize_completion_p50_us": pct(t_plain, 0.5),
        "tokenize_chat_cached_system_p50_us": pct(t_chat, 0.5),
        "prompt_tokens_mean": tokens,
        "hit_share": policy.hit_blocks / max(1, policy.prompt_blocks),
    }
    print(
        f"\n(a) kv_aware decision per request: {workers} workers, {prompt_kb} KB prompts (~{tokens:.0f} tokens, "
        f"{block_size}-token blocks; 64 shared 24 KB prefixes, each worker holding 8), {requests} requests, "
        "32 in flight"
    )
    print(
        f"decision (ids given)   p50 {out['decision_p50_us']:.1f} us  p99 {out['decision_p99_us']:.1f} us  "
        f"(block keys alone p50 {out['block_keys_p50_us']:.1f} us); placed blocks already held: "
        f"{out['hit_share']:.0%}"
    )
    print(
        f"tokenization           32 KB completion p50 {out['tokenize_completion_p50_us']:.0f} us; "
        f"32 KB chat with its 24 KB system message cached p50 {out['tokenize_chat_cached_system_p50_us']:.0f} us"
    )
    return out


# ---------------------------------------------------------------------------------------------- main
def _engines(args: argparse.Namespace, kv_blocks: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    ports = [free_port() for _ in range(args.engines)]
    procs = []
    for i, port in enumerate(ports):
        events, replay = free_port(), free_port()
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv-events",
        }
        cmd = [
            sys.executable,
            "-m",
            "engine.openai_server",
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--server-port",
            str(port),
            "--num-kvcache-blocks",
            str(kv_blocks),
            "--block-size",
            "16",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "8",
            "--torch-threads",
            "1",
            "--device",
            "cpu",
            "--kv-events-config",
            json.dumps(cfg),
        ]
        procs.append(start(cmd, Path(f"/tmp/atomesh-bench-kv-engine-{i}.log")))
    return procs, [f"http://127.0.0.1:{p}" for p in ports]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[RunResult] = []
    out: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        # One set of engines per pool size (--kv-blocks takes several: a sweep of eviction pressure).
        for pool in args.kv_blocks if "trace" in args.only else args.kv_blocks[:1]:
            procs, urls = _engines(args, pool)
            try:
                for u in urls:
                    await wait_http(session, u + "/health", 300)
                async with session.get(urls[0] + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
                if "decision" in args.only and "decision" not in out:
                    async with session.get(urls[0] + "/tokenizer_info") as r:
                        tokenizer = PromptTokenizer.from_info(await r.json())
                    out["decision"] = bench_decision(tokenizer, args.decision_requests)
                if "trace" not in args.only:
                    continue
                print(
                    f"\n{args.engines} engines ({args.model}, CPU, {pool} KV blocks of 16 tokens each), "
                    f"{args.concurrency} clients, max_tokens 1; multi-turn: {args.conversations} chats x "
                    f"{args.turns} turns; shared: {args.requests} requests over {args.systems} system prompts"
                )
                print(HEADER)
                # Rounds of every cell, policies in turn within a round: drift on the machine and
                # run-to-run variation (replicas racing each other) reach every policy alike.
                for rnd in range(args.repeat):
                    for trace in args.traces:
                        for replicas in args.replicas:
                            for policy in args.policies:
                                res = await run_one(session, urls, policy, trace, replicas, args, model, rnd, pool)
                                results.append(res)
                                print_row(res)
            finally:
                for proc in procs:
                    stop(proc)
    if "trace" in args.only:
        out["summary"] = summarize(results, args.traces, args.replicas, args.policies)
    out["runs"] = [asdict(r) for r in results]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gateway.kv_placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument(
        "--kv-blocks",
        type=int,
        nargs="+",
        default=[40],
        help="KV blocks per engine (16 tokens each); several: a sweep, the engines restarted per size",
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--systems", type=int, default=12)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--replicas", type=int, nargs="+", default=[2])
    p.add_argument("--repeat", type=int, default=3, help="rounds of every cell; the summary takes medians")
    p.add_argument(
        "--kv-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kv_aware replicas share their in-flight placements (--kv-sync-bind / --kv-sync-peers)",
    )
    p.add_argument(
        "--kv-args",
        nargs="*",
        default=[],
        metavar="ARG",
        help="more `atomesh launch` flags for the kv_aware gateways (e.g. --kv-args=--kv-overlap-weight=2)",
    )
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument(
        "--traces",
        nargs="+",
        default=["multi-turn", "shared-prefix"],
        choices=["multi-turn", "shared-prefix", "restart", "long-tail"],
        help="restart: multi-turn with the gateways restarted after every first turn; long-tail: "
        "a quarter of the conversations (drawn anew each round) run 4x as many turns",
    )
    p.add_argument("--only", nargs="+", default=["trace", "decision"], choices=["trace", "decision"])
    p.add_argument("--decision-requests", type=int, default=3000)
    p.add_argument(
        "--gateway-log-level",
        default="warn",
        choices=["debug", "info", "warn", "error"],
        help="debug: kv_aware logs each decision (the gateways log to "
        "/tmp/atomesh-bench-kv-TRACE-POLICY-xREPLICAS-ROUND-N.log)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = asyncio.run(run(args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
