"""Prometheus metrics under ATOM's ``atom:*`` names, read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.llm_engine import EngineStats

if TYPE_CHECKING:
    from engine.disagg import TransferStats


class EngineCollector(Collector):
    """Turns an EngineStats snapshot into gauges and counters on each scrape (nothing to keep in sync)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        b = s.blocks
        gauges = (
            ("atom:requests_running", "Sequences in the running batch", s.running),
            ("atom:requests_waiting", "Sequences waiting for admission", s.waiting),
            ("atom:kv_cache_blocks_used", "KV blocks in use or held", b.used),
            ("atom:kv_cache_blocks_free", "KV blocks free (some still hold reusable prefixes)", b.free),
            ("atom:kv_cache_blocks_total", "KV blocks in the pool", b.total),
            ("atom:kv_cache_blocks_indexed", "KV blocks findable by prefix hash", b.cached),
            ("atom:kv_cache_usage_ratio", "Share of KV blocks in use", b.usage),
            ("atom:prefix_cache_hit_ratio", "Prompt tokens served by the prefix cache / looked up", b.hit_ratio),
            (
                "atom:spec_decode_mean_acceptance_length",
                "Speculative decoding: tokens per verify row (accepted drafts + 1); 0 before any",
                s.spec_acceptance_length,
            ),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g
        counters = (
            ("atom:requests_finished", "Requests finished (any reason)", s.requests_finished),
            ("atom:prompt_tokens", "Prompt tokens admitted", s.prompt_tokens),
            ("atom:generation_tokens", "Tokens generated", s.generation_tokens),
            ("atom:preemptions", "Sequences preempted for lack of KV blocks", s.preemptions),
            (
                "atom:steps_scheduled_ahead",
                "Decode steps launched while the step before still ran (--async-scheduling)",
                s.steps_ahead,
            ),
            ("atom:prefix_cache_wanted_tokens", "Prompt tokens looked up in the prefix cache", b.prefix_queries),
            ("atom:prefix_cache_cached_tokens", "Prompt tokens found in the prefix cache", b.prefix_hits),
            ("atom:prefix_cache_evicted_blocks", "Cached KV blocks dropped to reuse their memory", b.evicted),
            (
                "atom:spec_decode_num_drafts",
                "Speculative decoding: verify rows (a sequence's drafts checked once)",
                s.spec_drafts,
            ),
            ("atom:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed", s.spec_draft_tokens),
            (
                "atom:spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted",
                s.spec_accepted_tokens,
            ),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(value))
            yield c


class ServerMetrics:
    """The server's own registry (never the global one): engine gauges plus request latencies."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = seconds("atom:time_to_first_token_seconds", "Time from request arrival to its first token")
        self.queue = seconds(
            "atom:request_queue_time_seconds",
            "Time from request arrival until the scheduler first admitted its prompt (prefilling engines)",
        )
        self.e2e = seconds("atom:e2e_request_latency_seconds", "Time from request arrival to its last token")
        self.kv_pull = seconds(
            "atom:kv_transfer_pull_seconds",
            "Decode side: from request arrival until the prompt's KV had arrived from prefill",
        )
        self.pd_reserve = seconds(
            "atom:pd_decode_reserve_seconds",
            "Decode side: from request arrival until blocks for the prompt's KV were reserved (waiting for room)",
        )
        self.pd_first_step = seconds(
            "atom:pd_decode_first_step_seconds",
            "Decode side: from request arrival until its sequence was admitted to a step (its first decode step; "
            "its first token went out before, when the KV landed)",
        )

    def watch_transfers(self, stats: Callable[[], TransferStats]) -> None:
        """Export the KV relay's counters (read at scrape time)."""
        self.registry.register(TransferCollector(stats))


class TransferCollector(Collector):
    """KV relay counters: offered / pulled transfers, failures by reason, releases by reason; pulls in flight."""

    def __init__(self, stats: Callable[[], TransferStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        offered = CounterMetricFamily("atom:kv_transfer_offered", "Prefills whose KV was offered to a decode engine")
        offered.add_metric([], float(s.offered))
        pulled = CounterMetricFamily("atom:kv_transfer_pulled", "KV transfers this decode engine completed")
        pulled.add_metric([], float(s.pulled))
        seconds = CounterMetricFamily("atom:kv_transfer_pull_time_seconds", "Time spent pulling KV (sum)")
        seconds.add_metric([], s.pull_seconds)
        failures = CounterMetricFamily("atom:kv_transfer_failures", "Failed KV pulls by reason", labels=["reason"])
        for reason, n in sorted(s.pull_failures.items()):
            failures.add_metric([reason], float(n))
        released = CounterMetricFamily(
            "atom:kv_transfer_released", "Prefill blocks released by reason (written, expired, ...)", labels=["reason"]
        )
        for reason, n in sorted(s.released.items()):
            released.add_metric([reason], float(n))
        in_flight = GaugeMetricFamily(
            "atom:kv_transfer_pulls_in_flight", "KV pulls talking to a producer now (at most max_inflight_pulls)"
        )
        in_flight.add_metric([], float(s.pulls_in_flight))
        waiting = GaugeMetricFamily("atom:kv_transfer_pulls_waiting", "KV pulls waiting for a max_inflight_pulls place")
        waiting.add_metric([], float(s.pulls_waiting))
        rounds = CounterMetricFamily(
            "atom:kv_transfer_early_rounds",
            "Decode side: rounds of KV blocks copied from early offers while their prefill still ran",
        )
        rounds.add_metric([], float(s.early_rounds))
        yield from (offered, pulled, seconds, failures, released, in_flight, waiting, rounds)
