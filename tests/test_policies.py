"""Placement policies: unit behaviour per policy, index bounds (hypothesis), and through a real gateway."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp
import pytest
from click.testing import CliRunner
from gwtest import MakeGateway, base_url, gateway_config, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from atomesh.cli import launch_command
from atomesh.cluster.index import IndexSync
from atomesh.cluster.messages import IndexBatch
from atomesh.config import GatewayConfig, PolicyName
from atomesh.errors import NoWorkerAvailable
from atomesh.gateway import Gateway
from atomesh.placement import Pair, Placement
from atomesh.policies import FACTORIES, least_loaded, make_policy
from atomesh.policies.cache_aware import CacheAwarePolicy, PrefixIndex
from atomesh.policies.least_load import LeastLoadPolicy
from atomesh.policies.power_of_two import PowerOfTwoPolicy
from atomesh.policies.prefix_hash import PrefixHashPolicy
from atomesh.request import RequestView, Route
from atomesh.testing.mock_engine import EngineSettings, MockEngine
from atomesh.transport import Upstream
from atomesh.workers.load import LoadPoller, parse_load
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState


def workers(n: int) -> list[Worker]:
    return [Worker(url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def completion(prompt: str, key: str | None = None) -> RequestView:
    return RequestView(Route.COMPLETIONS, {"prompt": prompt}, b"", "r", routing_key=key)


def chat(*turns: str) -> RequestView:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return RequestView(Route.CHAT, {"messages": msgs}, b"", "r")


def place(policy: CacheAwarePolicy | PrefixHashPolicy, ws: list[Worker], view: RequestView) -> Worker:
    decision = policy.select(ws, view)
    policy.record(decision, view)
    return decision.worker


def text(seed: int, n: int = 2000) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij ") for _ in range(n))


# ---------------------------------------------------------------------------- simple policies
def test_every_policy_name_has_a_factory_and_every_factory_a_name() -> None:
    cfg = GatewayConfig.model_validate({})
    assert cfg.policy is PolicyName.CACHE_AWARE
    assert set(FACTORIES) == set(PolicyName)
    for name in PolicyName:
        assert make_policy(name, cfg).name is name
        assert GatewayConfig.model_validate({"policy": name.value}).policy is name
    help_text = CliRunner().invoke(launch_command, ["--help"]).output
    assert "--policy " + "|".join(PolicyName) in help_text  # the help lists every choice


def test_least_loaded_breaks_ties_by_tiebreak_then_scan_order() -> None:
    ws = workers(4)
    ws[0].in_flight = ws[3].in_flight = 2
    assert least_loaded(ws) is ws[1]  # ws[1], ws[2] tie at 0: the first scanned
    assert least_loaded(ws, start=2) is ws[2]  # scan ws[2], ws[3], ws[0], ws[1]
    assert least_loaded(ws, tiebreak=lambda w: -ws.index(w)) is ws[2]
    ws[2].engine_load = 3  # the engine reports more than we sent: that counts
    assert least_loaded(ws, start=2) is ws[1]


def test_power_of_two_picks_the_lighter_of_two_and_spreads() -> None:
    ws = workers(2)
    ws[0].in_flight = 5
    p = PowerOfTwoPolicy(random.Random(1))
    assert all(p.select(ws, completion("x")).worker is ws[1] for _ in range(20))
    ws = workers(4)
    seen = Counter(p.select(ws, completion("x")).worker.url for _ in range(400))
    assert len(seen) == 4 and min(seen.values()) > 60


def test_least_load_uses_engine_load_and_spreads_ties() -> None:
    ws = workers(3)
    ws[0].in_flight = 1
    ws[1].engine_load = 7  # the engine reports more than we sent
    p = LeastLoadPolicy()
    assert p.select(ws, completion("x")).worker is ws[2]
    idle = workers(4)
    assert {p.select(idle, completion("x")).worker.url for _ in range(4)} == {w.url for w in idle}


# ---------------------------------------------------------------------------- prefix_hash
def test_prefix_hash_is_sticky_spread_and_stable_under_churn() -> None:
    ws = workers(8)
    p = PrefixHashPolicy(prefix_token_count=64)
    keys = [text(i, 600) for i in range(400)]
    before = {k: p.select(ws, completion(k)).worker.url for k in keys}
    assert all(p.select(ws, completion(k)).worker.url == before[k] for k in keys[:50])  # sticky
    counts = Counter(before.values())
    assert len(counts) == 8 and min(counts.values()) > 20  # spread
    # Only the prefix counts: a different tail keeps the worker.
    assert p.select(ws, completion(keys[0][:256] + "different tail")).worker.url == before[keys[0]]
    # Removing one worker moves only its keys.
    gone = ws[3]
    after = {k: p.select([w for w in ws if w is not gone], completion(k)).worker.url for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert moved and all(before[k] == gone.url for k in moved)


def test_prefix_hash_routing_key_wins_and_overload_walks_the_ring() -> None:
    ws = workers(4)
    p = PrefixHashPolicy()
    a = p.select(ws, completion("one prompt", key="session-1")).worker
    assert p.select(ws, completion("another prompt", key="session-1")).worker is a
    a.in_flight = 50  # far above the bound: the next worker on the ring takes it
    b = p.select(ws, completion("one prompt", key="session-1"))
    assert b.worker is not a and b.reason == "ring_next"


# ---------------------------------------------------------------------------- cache_aware
def test_cache_aware_sticks_a_shared_prefix_and_spreads_new_ones() -> None:
    ws = workers(4)
    p = CacheAwarePolicy()
    system = [text(100 + i, 3000) for i in range(8)]
    homes: dict[int, set[str]] = {}
    for r in range(64):
        s = r % 8
        w = place(p, ws, completion(system[s] + f" user {r} asks something"))
        homes.setdefault(s, set()).add(w.url)
    assert all(len(h) == 1 for h in homes.values())  # each system prompt stays on one worker
    assert len({next(iter(h)) for h in homes.values()}) == 4  # new prefixes went to the emptier workers
    assert p.hits == 56 and p.misses == 8


def test_cache_aware_below_threshold_goes_to_least_loaded() -> None:
    ws = workers(2)
    p = CacheAwarePolicy(cache_threshold=0.5)
    base = text(1, 1024)
    first = place(p, ws, completion(base))
    first.in_flight = 1
    # Shares ~25% with `base`: below the threshold, so the other (idle) worker takes it.
    assert place(p, ws, completion(base[:256] + text(2, 768))) is not first
    # Shares ~90%: above it, so it follows the cache even though that worker is busier.
    assert place(p, ws, completion(base[:1000] + "x" * 100)) is first


def test_cache_aware_imbalance_triggers_shortest_queue() -> None:
    ws = workers(3)
    p = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = text(7, 4000)
    home = place(p, ws, completion(prompt))
    home.in_flight = 4  # gap 4 is not > 4: still balanced, the cache wins
    assert place(p, ws, completion(prompt)) is home
    home.in_flight = 5  # 5 - 0 > 4 and 5 > 1.5 * 0: imbalanced
    other = place(p, ws, completion(prompt))
    assert other is not home and other.load == 0
    # The spill made `other` a holder too: with loads balanced again, both serve the prefix.
    home.in_flight = 0
    other.in_flight = 1
    assert place(p, ws, completion(prompt)) is home


def test_cache_aware_chat_uses_the_whole_conversation() -> None:
    ws = workers(4)
    p = CacheAwarePolicy()
    system = [text(i, 400) for i in range(4)]
    # Same first message, different long histories: placed by history, not by the first message.
    hist_a = chat(system[0], text(50, 3000))
    hist_b = chat(system[0], text(51, 3000))
    a = place(p, ws, hist_a)
    b = place(p, ws, hist_b)
    assert a is not b
    assert place(p, ws, chat(system[0], text(51, 3000), "and a new question")) is b
    assert place(p, ws, chat(system[0], text(50, 3000), "and a new question")) is a


def test_cache_aware_forgets_a_removed_worker() -> None:
    ws = workers(3)
    p = CacheAwarePolicy()
    prompts = [text(i, 2000) for i in range(30)]
    for s in prompts:
        place(p, ws, completion(s))
    gone = ws[0]
    held = p.index.share(gone)
    assert held > 0
    before = len(p.index)
    p.on_worker_removed(gone)
    assert p.index.share(gone) == 0 and len(p.index) == before - held
    assert all(gone not in p.index.holders(h) for h in list(p.index._entries))
    # Its prompts now go elsewhere, and are sticky there.
    rest = ws[1:]
    moved = place(p, rest, completion(prompts[0]))
    assert place(p, rest, completion(prompts[0])) is moved


def test_cache_aware_eviction_keeps_the_bound_and_the_hot_prefix() -> None:
    ws = workers(2)
    p = CacheAwarePolicy(max_tree_size=256 * 100)  # 100 entries of 256 chars
    hot = text(0, 256 * 8)
    home = place(p, ws, completion(hot))
    for i in range(200):  # a stream of cold prompts, with the hot one coming back
        place(p, ws, completion(text(1000 + i, 256 * 4)))
        if i % 5 == 0:
            place(p, ws, completion(hot))
        assert len(p.index) <= 100
    assert p.index.evictions > 0
    assert p.index.match(p.index.hashes(hot)[0], lambda v: home in v) == 8  # the hot chain survived
    assert p.evict() > 0 and len(p.index) <= 90  # the periodic pass trims to the low-water mark


async def test_cache_aware_eviction_task_runs_on_its_interval() -> None:
    p = CacheAwarePolicy(max_tree_size=256 * 10, eviction_interval_secs=0.05)
    ws = workers(1)
    place(p, ws, completion(text(3, 256 * 10)))
    assert len(p.index) == 10
    p.start()
    try:
        await wait_for(lambda: len(p.index) <= 9, timeout=5, what="eviction pass")
    finally:
        await p.stop()


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 40),
    chunk=st.integers(1, 16),
    ops=st.lists(st.tuples(st.integers(0, 5), st.text(alphabet="ab", max_size=120), st.booleans()), max_size=60),
)
def test_index_never_exceeds_its_bound(budget: int, chunk: int, ops: list[tuple[int, str, bool]]) -> None:
    ws = workers(6)
    index = PrefixIndex(budget, chunk, max_holders=2)
    for w_i, prompt, remove in ops:
        w = ws[w_i]
        if remove:
            index.remove_worker(w)
        else:
            hashes, _ = index.hashes(prompt)
            held = index.match(hashes, lambda v, w=w: w in v)
            index.insert(hashes, w, held)
        assert len(index) <= budget
        # Shares add up to the holder slots in use, and no entry has more holders than allowed.
        entries = list(index._entries.values())
        assert all(1 <= len(v) <= 2 for v in entries)
        assert sum(index.share(x) for x in ws) == sum(len(v) for v in entries)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(alphabet="abc", min_size=1, max_size=300), min_size=1, max_size=40), st.integers(1, 50))
def test_policy_index_bound_holds_for_any_traffic(prompts: list[str], entries: int) -> None:
    p = CacheAwarePolicy(max_tree_size=entries * 8, chunk_chars=8)
    ws = workers(3)
    for s in prompts:
        place(p, ws, completion(s))
        assert len(p.index) <= entries


# ---------------------------------------------------------------------------- placement + load
def test_placement_counts_load_from_placement_to_release_for_pairs() -> None:
    reg = WorkerRegistry()
    pf, dc = Worker("http://p:1", WorkerRole.PREFILL), Worker("http://d:1", WorkerRole.DECODE)
    for w in (pf, dc):
        reg.add(w)
        reg.set_state(w, WorkerState.READY)
    pol = {WorkerRole.PREFILL: CacheAwarePolicy(), WorkerRole.DECODE: LeastLoadPolicy()}
    placement = Placement(reg, pol, pd=True)  # type: ignore[arg-type]
    plans = [placement.place(completion("hello")) for _ in range(3)]
    assert pf.load == 3 and dc.load == 3
    told: list[tuple[str, int]] = []  # each leg's policy hears of the release, its count already lowered
    for p in pol.values():
        p.released = lambda w: told.append((w.url, w.in_flight))  # type: ignore[method-assign]
    for plan in plans:
        placement.release(plan)
    assert pf.load == 0 and dc.load == 0
    assert told == [
        ("http://p:1", 2),
        ("http://d:1", 2),
        ("http://p:1", 1),
        ("http://d:1", 1),
        ("http://p:1", 0),
        ("http://d:1", 0),
    ]
    # A removed worker's index entries go with it.
    assert pol[WorkerRole.PREFILL].index.share(pf) > 0  # type: ignore[attr-defined]
    reg.set_state(pf, WorkerState.DRAINING)
    reg.set_state(pf, WorkerState.REMOVED)
    assert pol[WorkerRole.PREFILL].index.share(pf) == 0  # type: ignore[attr-defined]


async def test_pd_plan_failing_on_decode_records_nothing_anywhere() -> None:
    cfg = gateway_config(pd_disaggregation=True, policy="cache_aware", decode_policy="least_load")
    gw = Gateway(cfg)
    batches: list[IndexBatch] = []
    sync = IndexSync(gw, batches.append)  # the replication to other gateway processes
    prefill = [Worker(f"http://p:{i}", WorkerRole.PREFILL) for i in (1, 2)]
    decode = Worker("http://d:1", WorkerRole.DECODE)
    for w in (*prefill, decode):
        gw.registry.add(w)
    for w in prefill:
        gw.registry.set_state(w, WorkerState.READY)
    policy = gw.placement.policies[WorkerRole.PREFILL]
    assert isinstance(policy, CacheAwarePolicy)
    view = completion(text(7))
    # First with two prefill candidates (select's decision), then with one (the lone candidate's).
    for _ in range(2):
        with pytest.raises(NoWorkerAvailable, match="decode"):
            gw.placement.place(view)
        assert len(policy.index) == 0 and policy.hits == policy.misses == 0
        assert all(w.in_flight == 0 for w in (*prefill, decode))
        await asyncio.sleep(0)  # a pending flush would run here
        assert sync.outbox == [] and batches == []
        gw.registry.set_state(prefill[1], WorkerState.DRAINING)
    # With a decode worker the same request is recorded once, here and for the other processes.
    gw.registry.set_state(decode, WorkerState.READY)
    plan = gw.placement.place(view)
    assert isinstance(plan, Pair) and plan.prefill is prefill[0]
    assert policy.index.share(prefill[0]) > 0
    await asyncio.sleep(0)
    assert [[(key, url) for key, (url, _) in b.placements] for b in batches] == [
        [("prefill/prefix_index", prefill[0].url)]
    ]
    gw.placement.release(plan)


def test_parse_load_sums_running_and_waiting() -> None:
    text_ = (
        "# TYPE atom:requests_running gauge\natom:requests_running 3\n"
        'atom:requests_waiting{model="m"} 2 1700000000\nunrelated 9\n'
    )
    assert parse_load(text_) == 5
    assert parse_load("unrelated 1\n") is None


async def test_load_poller_reads_engine_load() -> None:
    engine = await MockEngine("e", settings=EngineSettings()).start()
    try:
        reg = WorkerRegistry()
        w = Worker(engine.url)
        reg.add(w)
        reg.set_state(w, WorkerState.READY)
        engine.stats.running, engine.stats.waiting = 2, 3
        upstream = Upstream(request_timeout_secs=5)
        await upstream.start()
        peers = {w.url: 0}
        poller = LoadPoller(reg, upstream, interval=0.05, elsewhere=lambda worker: peers[worker.url])
        poller.start()
        try:
            await wait_for(lambda: w.engine_load == 5, timeout=5, what="polled load")
            assert w.load == 5
            w.in_flight = 1
            await wait_for(lambda: w.foreign_load == 4, timeout=5, what="our request left out")
            peers[w.url] = 3  # requests synced gateway replicas said they have there are not foreign either
            await wait_for(lambda: w.foreign_load == 1, timeout=5, what="the peers' requests left out")
        finally:
            w.in_flight = 0
            await poller.stop()
            await upstream.stop()
    finally:
        await engine.stop()


# ---------------------------------------------------------------------------- through a real gateway
async def test_gateway_cache_aware_sticks_a_prefix_and_spreads_a_burst(
    gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    engines = [
        await MockEngine(
            f"e{i}", settings=EngineSettings(prefill_secs_base=0.0, decode_secs_base=0.02, max_tokens_default=4)
        ).start()
        for i in range(3)
    ]
    try:
        gw = await gateway(
            worker_urls=[e.url for e in engines],
            policy="cache_aware",
            balance_abs_threshold=2,
            balance_rel_threshold=1.5,
        )
        prompt = text(42, 4000)
        body = {"model": "mock-model", "prompt": prompt, "max_tokens": 2}
        seen = []
        for _ in range(4):  # one at a time: all on one engine, which then hits its prefix cache
            async with http.post(base_url(gw) + "/v1/completions", json=body) as r:
                assert r.status == 200
                seen.append(r.headers["x-mock-worker"])
                data = await r.json()
        assert len(set(seen)) == 1
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 900

        # A burst of the same prefix: load counts from placement, so it spreads once the gap passes 2.
        async def one() -> str:
            async with http.post(base_url(gw) + "/v1/completions", json={**body, "max_tokens": 8}) as r:
                assert r.status == 200
                return r.headers["x-mock-worker"]

        burst = Counter(await asyncio.gather(*(one() for _ in range(12))))
        assert len(burst) == 3, burst
        assert max(burst.values()) < 12
    finally:
        for e in engines:
            await e.stop()


@pytest.mark.parametrize("policy", ["power_of_two", "least_load", "prefix_hash"])
async def test_gateway_serves_with_each_load_policy(
    policy: str, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    engines = [await MockEngine(f"e{i}").start() for i in range(2)]
    try:
        gw = await gateway(worker_urls=[e.url for e in engines], policy=policy)
        for i in range(4):
            async with http.post(
                base_url(gw) + "/v1/chat/completions",
                json={"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": f"hi {i}"}]},
            ) as r:
                assert r.status == 200
    finally:
        for e in engines:
            await e.stop()
