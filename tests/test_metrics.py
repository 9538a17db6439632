"""Gateway metrics: what /metrics reports after real traffic, bounded labels, docs and dashboard in sync."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
from gwtest import MakeGateway, MakeWorkers, base_url
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from atomesh.app import GatewayServer
from atomesh.metrics import Metrics, metrics_markdown

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 3}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= ls)


async def scrape(http: aiohttp.ClientSession, gw: GatewayServer) -> str:
    async with http.get(f"http://127.0.0.1:{gw.config.prometheus_port}/metrics") as r:
        assert r.status == 200
        return await r.text()


# ---------------------------------------------------------------------------- the token meter
def test_meter_reads_ttft_and_tokens_from_sse_bytes() -> None:
    m = Metrics([0.1, 1.0])
    m.set_served_models(["m"])
    meter = m.meter("/v1/chat/completions", "m", streaming=True)
    meter.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')  # no content yet
    assert meter.first_at is None
    meter.feed(b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\nda')  # first token; next marker split
    meter.feed(b'ta: {"choices":[{"delta":{"content":"lo"}}]}\n\n')
    meter.feed(b'data: {"choices": [{"delta": {"content": "!"}}]}\n\ndata: [DONE]\n\n')
    meter.finish()
    text = generate_latest(m.registry).decode()
    assert meter.events == 3
    assert value(text, "mesh_router_ttft_seconds_count", endpoint="chat", model="m") == 1
    assert value(text, "mesh_router_tpot_seconds_count", endpoint="chat") == 1
    assert value(text, "mesh_router_tokens_total", token_type="output") == 3


def test_meter_prefers_engine_usage() -> None:
    m = Metrics([1.0])
    meter = m.meter("/v1/completions", "m", streaming=True)
    meter.feed(b'data: {"choices":[{"text":"a"}]}\n\n')
    meter.feed(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":12,"total_tokens":19}}\n\n')
    meter.finish()
    meter.finish()  # idempotent
    text = generate_latest(m.registry).decode()
    assert value(text, "mesh_router_tokens_total", token_type="output") == 12
    assert value(text, "mesh_router_tokens_total", token_type="input") == 7


def test_meter_takes_usage_split_across_chunks_and_followed_by_done() -> None:
    m = Metrics([1.0])
    meter = m.meter("/v1/completions", "m", streaming=True)
    for i in range(3):
        meter.feed(b'data: {"choices":[{"text":"t"}],"usage":{"prompt_tokens":7,"completion_tokens":%d}}\n\n' % (i + 1))
    meter.feed(b'data: {"choices":[],"usage":{"prompt_tokens":7,"compl')  # the final usage, in two pieces
    meter.feed(b'etion_tokens":40,"total_tokens":47}}\n\n')
    meter.feed(b"data: [DONE]\n\n")
    meter.finish()
    assert meter.events == 4  # three tokens and the usage event; [DONE] is not one
    text = generate_latest(m.registry).decode()
    assert value(text, "mesh_router_tokens_total", token_type="output") == 40
    assert value(text, "mesh_router_tokens_total", token_type="input") == 7


def test_pd_and_cache_aware_recorders() -> None:
    m = Metrics([0.01, 1.0])
    m.observe_pd("atom", "mock-model", prefill_secs=0.2, handoff_secs=0.001, decode_secs=0.5)
    m.pd_kv_transfer_failed("atom", "transfer_timeout")
    m.cache_aware_lookup(True, "prefill")
    m.cache_aware_lookup(False, "prefill")
    m.set_cache_index_entries(42, "prefill")
    m.sync_cache_aware("decode", hits=3, misses=1, entries=7)
    m.sync_cache_aware("decode", hits=5, misses=1, entries=9)
    text = generate_latest(m.registry).decode()
    for name in (
        "mesh_pd_prefill_duration_seconds_count",
        "mesh_pd_handoff_seconds_count",
        "mesh_pd_decode_duration_seconds_count",
    ):
        assert value(text, name) == 1, name
    assert value(text, "mesh_pd_kv_transfer_failures_total", runtime="atom", reason="transfer_timeout") == 1
    assert value(text, "mesh_cache_aware_index_entries", worker_type="prefill") == 42
    assert value(text, "mesh_cache_aware_hits_total", worker_type="prefill") == 1
    assert value(text, "mesh_cache_aware_misses_total", worker_type="prefill") == 1
    assert value(text, "mesh_cache_aware_hits_total", worker_type="decode") == 5
    assert value(text, "mesh_cache_aware_misses_total", worker_type="decode") == 1
    assert value(text, "mesh_cache_aware_index_entries", worker_type="decode") == 9


# ---------------------------------------------------------------------------- through a real gateway
async def test_traffic_shows_up_in_metrics(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2, stream_chunks=5, chunk_interval_secs=0.01)
    gw = await gateway(worker_urls=[w.url for w in workers])
    for _ in range(2):
        async with http.post(base_url(gw) + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            await r.read()
    for _ in range(2):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
    async with http.post(
        base_url(gw) + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
    text = await scrape(http, gw)
    assert value(text, "mesh_router_requests_total", endpoint="chat", streaming="true", model="mock-model") == 2
    assert value(text, "mesh_router_requests_total", endpoint="completions", streaming="false") == 2
    assert value(text, "mesh_router_ttft_seconds_count", endpoint="chat", model="mock-model") == 2
    assert value(text, "mesh_router_tpot_seconds_count", endpoint="chat") == 2
    # 5 streamed tokens twice; 3 tokens twice from the non-streamed answers' usage.
    assert value(text, "mesh_router_tokens_total", endpoint="chat", token_type="output") == 10
    assert value(text, "mesh_router_tokens_total", endpoint="completions", token_type="output") == 6
    assert value(text, "mesh_router_tokens_total", endpoint="completions", token_type="input") == 6
    for w in workers:  # round robin: two requests each
        assert value(text, "mesh_worker_selection_total", worker=w.url, policy="round_robin") == 2
        assert value(text, "mesh_router_upstream_responses_total", worker=w.url, status_code="200") == 2
        assert value(text, "mesh_worker_health", worker=w.url, worker_type="regular") == 1
        assert value(text, "mesh_worker_cb_state", worker=w.url) == 0
    assert value(text, "mesh_worker_pool_size", worker_type="regular", state="ready") == 2
    assert value(text, "mesh_http_responses_total", path="/v1/completions", status_code="400") == 1
    assert value(text, "mesh_http_requests_total", method="POST", path="/v1/chat/completions") == 2
    assert value(text, "mesh_http_rate_limit_total", result="allowed") == 5
    assert value(text, "mesh_http_connections_active") == 0


async def test_worker_failures_are_counted(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [bad, good] = await mock_workers(2)
    gw = await gateway(worker_urls=[bad.url, good.url])
    bad.behaviour.fail_status = 503
    for _ in range(2):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
    text = await scrape(http, gw)
    assert value(text, "mesh_router_upstream_responses_total", worker=bad.url, status_code="503") >= 1
    assert value(text, "mesh_worker_errors_total", worker=bad.url, error_type="upstream_status") >= 1
    assert value(text, "mesh_worker_cb_outcomes_total", worker=bad.url, outcome="failure") >= 1
    assert value(text, "mesh_worker_retries_total", worker_type="regular", endpoint="completions") >= 1


async def test_duration_buckets_flag_is_honoured(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1)
    gw = await gateway(worker_urls=[w.url], prometheus_duration_buckets=[0.25, 7.5])
    async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        await r.read()
    text = await scrape(http, gw)
    les = {dict(ls)["le"] for (n, ls), _ in samples(text).items() if n.endswith("_bucket")}
    assert les == {"0.25", "7.5", "+Inf"}


async def test_label_cardinality_is_bounded(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [w] = await mock_workers(1, stream_chunks=2)
    gw = await gateway(worker_urls=[w.url])

    async def burst(n: int, start: int) -> None:
        for i in range(start, start + n):
            body = {**COMPLETION, "prompt": f"distinct prompt {i}", "stream": i % 2 == 0, "user": f"u{i}"}
            async with http.post(
                base_url(gw) + "/v1/completions",
                json=body,
                headers={"x-request-id": f"req-{i}", "x-session-id": f"s{i}"},
            ) as r:
                assert r.status == 200
                await r.read()
            # Unknown models (client-controlled) fail, but must not mint a label each.
            async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "model": f"m{i}"}) as r:
                await r.read()

    await burst(6, 0)
    before = set(samples(await scrape(http, gw)))
    await burst(40, 100)
    text = await scrape(http, gw)
    after = set(samples(text))
    assert after == before, sorted(after - before)
    for _, labels in after:
        for v in dict(labels).values():
            assert "req-" not in v and "distinct prompt" not in v
    models = {dict(ls).get("model") for (n, ls) in after if n == "mesh_router_requests_total"}
    assert models <= {"mock-model", "unknown"}


async def test_removed_worker_series_are_dropped(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers])
    for _ in range(2):
        async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
    gone = workers[1]
    await gw.gateway.lifecycle.remove(gw.gateway.registry.by_url(gone.url))  # type: ignore[arg-type]
    text = await scrape(http, gw)
    assert gone.url not in text
    assert workers[0].url in text


# ---------------------------------------------------------------------------- docs and dashboard
def test_docs_list_every_metric() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert doc == metrics_markdown(), "docs/metrics.md is stale: run `python -m atomesh.metrics > docs/metrics.md`"


def _dashboard_exprs() -> list[str]:
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text()))
    return exprs


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = Metrics([1.0]).series_names()
    exprs = _dashboard_exprs()
    assert len(exprs) >= 8
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\b(mesh_[a-z0-9_]+)", expr))
        assert names, f"query reads no gateway metric: {expr}"
        unknown = names - exported
        assert not unknown, f"{expr!r} reads metrics the gateway does not export: {unknown}"
        used |= names
    # The dashboard covers the families operators look at first.
    for family in (
        "mesh_router_ttft_seconds_bucket",
        "mesh_worker_health",
        "mesh_worker_cb_state",
        "mesh_router_tokens_total",
        "mesh_worker_selection_total",
    ):
        assert family in used


def test_prometheus_config_scrapes_gateway_and_engines() -> None:
    text = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "/metrics" in text or "metrics_path" not in text
    assert "/engine_metrics" in text
    assert "29000" in text


def test_engine_metrics_merge_keeps_families_together() -> None:
    from atomesh.api.observability import EngineMetrics

    merged = EngineMetrics()
    body = (
        "# HELP atom:requests_running Running.\n# TYPE atom:requests_running gauge\n"
        'atom:requests_running{dp="0"} {n}\n# TYPE atom:done_total counter\natom:done_total 5\n'
    )
    merged.add("http://a:1", body.replace("{n}", "1"))
    merged.add("http://b:2", body.replace("{n}", "2"))
    merged.fail("http://c:3", "cannot connect\nat all")
    text = merged.render()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = fams["atom:requests_running"]
    assert running.type == "gauge"
    assert {(s.labels["worker_addr"], s.value) for s in running.samples} == {("http://a:1", 1), ("http://b:2", 2)}
    assert fams["atom:done"].type == "counter"
    assert [s.labels for s in fams["mesh_engine_metrics_scrape_errors"].samples] == [{"worker_addr": "http://c:3"}]
    assert text.count("# TYPE atom:requests_running ") == 1


async def test_engine_metrics_route(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers], disable_health_check=True, health_check_timeout_secs=2)
    async with http.post(base_url(gw) + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 200
    await workers[1].stop()  # dead, but still registered
    async with http.get(base_url(gw) + "/engine_metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    assert f"# worker {workers[1].url} skipped" in text
    served = value(text, "atom:requests_served_total", worker_addr=workers[0].url)
    assert served == 1
    assert value(text, "mesh_engine_metrics_scrape_errors", worker_addr=workers[1].url) == 1
    assert not any(dict(ls).get("worker_addr") == workers[1].url and n.startswith("atom:") for (n, ls) in samples(text))
    gw_text = await scrape(http, gw)
    assert value(gw_text, "mesh_engine_metrics_scrape_errors_total", worker=workers[1].url) == 1


async def test_cache_aware_policy_counts_show_up(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    workers = await mock_workers(2)
    gw = await gateway(worker_urls=[w.url for w in workers], policy="cache_aware")
    prompt = "a long shared system prompt that the cache-aware index should remember " * 8
    for _ in range(3):
        async with http.post(base_url(gw) + "/v1/completions", json={**COMPLETION, "prompt": prompt}) as r:
            assert r.status == 200
    text = await scrape(http, gw)
    hits = value(text, "mesh_cache_aware_hits_total", worker_type="regular")
    misses = value(text, "mesh_cache_aware_misses_total", worker_type="regular")
    assert hits + misses == 3 and hits >= 1
    assert value(text, "mesh_cache_aware_index_entries", worker_type="regular") > 0
    assert value(await scrape(http, gw), "mesh_cache_aware_hits_total") == hits  # a second scrape adds nothing


async def test_pd_stream_is_metered_on_the_decode_leg(
    mock_workers: MakeWorkers, gateway: MakeGateway, http: aiohttp.ClientSession
) -> None:
    [p] = await mock_workers(1, pd_backend="atom", pd_role="prefill", kv_role="kv_producer")
    [d] = await mock_workers(1, pd_backend="atom", pd_role="decode", kv_role="kv_consumer", stream_chunks=4)
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url])
    async with http.post(base_url(gw) + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status == 200
        await r.read()
    text = await scrape(http, gw)
    assert value(text, "mesh_router_requests_total", backend_type="pd", endpoint="chat") == 1
    assert value(text, "mesh_router_ttft_seconds_count", endpoint="chat") == 1
    assert value(text, "mesh_router_tokens_total", token_type="output") >= 1
    assert value(text, "mesh_worker_selection_total", worker=p.url, worker_type="prefill") == 1
    assert value(text, "mesh_worker_selection_total", worker=d.url, worker_type="decode") == 1
    assert value(text, "mesh_router_upstream_responses_total", worker=d.url, status_code="200") == 1
