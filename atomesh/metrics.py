"""Prometheus metrics of the gateway (`mesh_*` names, as ATOMesh), in a registry the app owns.

Label names follow SMG / ATOMesh (`worker`, `worker_type`, `model`, `policy`, `endpoint`,
`streaming`, `status_code`, ...). Every label value comes from a bounded set: worker URLs (series
dropped when the worker is removed; at most 2,048 bytes each), routes, roles, statuses, error codes, and
model names the workers serve (a client-supplied name no worker serves is `unknown`). Nothing per request.

`python -m atomesh.metrics` prints docs/metrics.md from the declarations below.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

UNKNOWN = "unknown"
NO_MODEL = "none"  # the `model` label of a request that names no model (an empty label reads as absent)
MAX_MODEL_LABEL = 256  # characters; a longer advertised name is labelled `unknown`

# Route path -> `endpoint` label, as SMG names its endpoints.
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/generate": "generate",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/score": "score",
    "/v1/classify": "classify",
    "/v1/tokenize": "tokenize",
    "/v1/detokenize": "detokenize",
}


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One declared metric: what docs/metrics.md lists and the dashboard test checks against."""

    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def series_names(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this metric."""
        if self.kind == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


class CounterValue:
    """One labelled counter: a plain number, read at scrape time (no lock: one event-loop thread writes)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class GaugeValue(CounterValue):
    __slots__ = ()

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramValue:
    """One labelled histogram: a count per bucket (upper bounds inclusive, +Inf last) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


V = TypeVar("V")


class Family(ABC, Generic[V]):
    """A metric and its labelled values, kept as plain Python numbers on the request path.

    prometheus-client's metric classes take a lock and validate labels on every update, which cost more
    than the rest of a request's bookkeeping together; these values are turned into its exposition
    format only when Prometheus scrapes (`collect`). Record with `family.labels(*values).inc()` (or
    `.set()`, `.observe()`): the one spelling.
    """

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.children: dict[tuple[str, ...], V] = {}

    def labels(self, *values: str) -> V:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.spec.labels):
                raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {values}")
            child = self.children[values] = self._new()
        return child

    def remove(self, *values: str) -> None:
        self.children.pop(values, None)

    @abstractmethod
    def _new(self) -> V:
        """A fresh value for a new label set."""

    @abstractmethod
    def export(self) -> dict[tuple[str, ...], Any]:
        """The values, as plain data another process can add to its own (atomesh.cluster)."""

    @abstractmethod
    def merged(self, remote: Sequence[dict[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Any]:
        """This process's values plus other processes' exports, label set by label set."""

    @abstractmethod
    def collect(self, remote: Sequence[dict[tuple[str, ...], Any]] = ()) -> Metric:
        """The prometheus-client metric family to expose, other processes' values added in."""


class _Scalar(Family[V]):
    _exposed: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def export(self) -> dict[tuple[str, ...], Any]:
        return {k: v.value for k, v in self.children.items()}  # type: ignore[attr-defined]

    def merged(self, remote: Sequence[dict[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Any]:
        out = self.export()
        for values in remote:
            for k, v in values.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def collect(self, remote: Sequence[dict[tuple[str, ...], Any]] = ()) -> Metric:
        fam = self._exposed(self.spec.name, self.spec.help, labels=self.spec.labels)
        for values, v in self.merged(remote).items():
            fam.add_metric(list(values), v)
        return fam


class CounterFamily(_Scalar[CounterValue]):
    _exposed = CounterMetricFamily

    def _new(self) -> CounterValue:
        return CounterValue()


class GaugeFamily(_Scalar[GaugeValue]):
    _exposed = GaugeMetricFamily

    def _new(self) -> GaugeValue:
        return GaugeValue()

    # A label-less gauge is updated on the family itself.
    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)


class HistogramFamily(Family[HistogramValue]):
    def __init__(self, spec: MetricSpec, buckets: tuple[float, ...]) -> None:
        super().__init__(spec)
        self.buckets = tuple(sorted(buckets))
        self._les = [floatToGoString(b) for b in self.buckets] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new(self) -> HistogramValue:
        return HistogramValue(self.buckets)

    def export(self) -> dict[tuple[str, ...], Any]:
        return {k: (list(h.counts), h.sum) for k, h in self.children.items()}

    def merged(self, remote: Sequence[dict[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Any]:
        out = self.export()
        for values in remote:
            for k, (counts, total) in values.items():
                mine = out.get(k)
                if mine is None:
                    out[k] = (list(counts), total)
                else:
                    out[k] = ([a + b for a, b in zip(mine[0], counts, strict=True)], mine[1] + total)
        return out

    def collect(self, remote: Sequence[dict[tuple[str, ...], Any]] = ()) -> Metric:
        fam = HistogramMetricFamily(self.spec.name, self.spec.help, labels=self.spec.labels)
        for values, (counts, total) in self.merged(remote).items():
            running, cumulative = 0, []
            for le, n in zip(self._les, counts, strict=True):
                running += n
                cumulative.append((le, float(running)))
            fam.add_metric(list(values), cumulative, total)
        return fam


F = TypeVar("F", bound=Family[Any])


# One process's request-path values: metric name -> label values -> value (atomesh.cluster).
Export = dict[str, dict[tuple[str, ...], Any]]

# Series that describe the worker registry, which the leader process owns: other processes mirror
# the registry, and their copies of these are not added in.
LEADER_ONLY = frozenset(
    {
        "mesh_worker_pool_size",
        "mesh_worker_health",
        "mesh_worker_health_checks_total",
        "mesh_worker_cb_state",
        "mesh_worker_cb_transitions_total",
        "mesh_cache_aware_index_entries",
        "mesh_engine_metrics_scrape_errors_total",
    }
)


class _Collector:
    """Hands every family to prometheus-client's registry at scrape time, with other processes' values."""

    def __init__(self, families: list[Family[Any]]) -> None:
        self.families = families
        self.remote: Sequence[Export] = ()

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            name = f.spec.name
            yield f.collect([r[name] for r in self.remote if name in r])


class Metrics:
    """Every metric the gateway exports, and small methods to record what the request path sees."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.registry = CollectorRegistry()
        self.specs: list[MetricSpec] = []
        self.families: list[Family[Any]] = []
        self.served_models: frozenset[str] = frozenset()
        self._cache_seen: dict[str, tuple[int, int]] = {}  # worker_type -> (hits, misses) already counted
        b = tuple(buckets)
        c, g, h = self._counter, self._gauge, self._histogram
        # --- HTTP layer (every route of the service port)
        self.http_requests = c(
            "mesh_http_requests_total", "HTTP requests received, by method and route.", ("method", "path")
        )
        self.http_responses = c(
            "mesh_http_responses_total", "HTTP responses sent, by route and status code.", ("path", "status_code")
        )
        self.http_duration = h(
            "mesh_http_request_duration_seconds",
            "Time from request received to handler returned (for streams: to the last byte).",
            ("method", "path"),
            b,
        )
        self.http_active = g("mesh_http_connections_active", "Requests being served now.", ())
        self.rate_limit = c(
            "mesh_http_rate_limit_total",
            "Admission decisions for inference requests: allowed, rejected (queue full) or "
            "timeout (waited too long in the queue).",
            ("result",),
        )
        # --- router (inference requests)
        self.router_requests = c(
            "mesh_router_requests_total",
            "Inference requests routed.",
            ("endpoint", "model", "streaming", "backend_type"),
        )
        self.router_duration = h(
            "mesh_router_request_duration_seconds",
            "Inference request duration, placement to last byte, retries included.",
            ("endpoint", "model", "streaming"),
            b,
        )
        self.router_errors = c(
            "mesh_router_request_errors_total",
            "Inference requests that failed, by error code: the gateway's own refusals (invalid "
            "body 400, key 401, admission 429/503, no worker 503, unknown model 404) as well "
            "as worker errors and streams broken after their first byte.",
            ("endpoint", "model", "error_type"),
        )
        self.upstream_responses = c(
            "mesh_router_upstream_responses_total",
            "HTTP answers received from workers, by status code.",
            ("worker", "worker_type", "status_code"),
        )
        self.ttft = h(
            "mesh_router_ttft_seconds",
            "Time to first token of streamed responses: request routed to the first event with "
            "non-empty content, measured at the gateway.",
            ("endpoint", "model"),
            b,
        )
        self.tpot = h(
            "mesh_router_tpot_seconds",
            "Time per output token (mean inter-token latency) of one streamed response, after the first token.",
            ("endpoint", "model"),
            b,
        )
        self.generation_duration = h(
            "mesh_router_generation_duration_seconds",
            "Streamed responses: first content token to last event.",
            ("endpoint", "model"),
            b,
        )
        self.tokens = c(
            "mesh_router_tokens_total",
            "Tokens in answered requests: output from the engine's usage when given, else one per "
            "streamed content event; input from usage only.",
            ("endpoint", "model", "token_type"),
        )
        # --- workers
        self.pool_size = g("mesh_worker_pool_size", "Workers per role and lifecycle state.", ("worker_type", "state"))
        self.worker_active = g(
            "mesh_worker_requests_active",
            "Requests placed on the worker whose last byte is not sent yet.",
            ("worker", "worker_type"),
        )
        self.worker_health = g(
            "mesh_worker_health", "1 if the worker is ready (healthy), else 0.", ("worker", "worker_type")
        )
        self.health_checks = c(
            "mesh_worker_health_checks_total",
            "Health checks, by result (success, failure).",
            ("worker", "worker_type", "result"),
        )
        self.selections = c(
            "mesh_worker_selection_total",
            "Times the policy placed a request on the worker.",
            ("worker", "worker_type", "policy"),
        )
        self.worker_errors = c(
            "mesh_worker_errors_total",
            "Failed calls charged to the worker (transport errors and 5xx answers).",
            ("worker", "worker_type", "error_type"),
        )
        self.retries = c(
            "mesh_worker_retries_total", "Attempts retried on another placement.", ("worker_type", "endpoint")
        )
        self.retries_exhausted = c(
            "mesh_worker_retries_exhausted_total",
            "Requests that failed after using every allowed retry.",
            ("worker_type", "endpoint"),
        )
        self.migrations = c(
            "mesh_migrations_total",
            "Streams broken after their first byte, by what became of them (--migration-limit): "
            "migrated (continued on another worker), refused (the request cannot be continued), "
            "limit_reached, no_worker (nowhere to continue), failed (the continuation failed).",
            ("outcome",),
        )
        self.cb_state = g("mesh_worker_cb_state", "Circuit breaker state: 0 closed, 1 open, 2 half-open.", ("worker",))
        self.cb_transitions = c(
            "mesh_worker_cb_transitions_total", "Circuit breaker state changes.", ("worker", "from", "to")
        )
        self.cb_outcomes = c(
            "mesh_worker_cb_outcomes_total",
            "Request outcomes the circuit breaker recorded (success, failure).",
            ("worker", "outcome"),
        )
        # --- prefill / decode disaggregation (recorded by the P/D backends through observe_pd)
        self.pd_prefill = h(
            "mesh_pd_prefill_duration_seconds",
            "P/D: prefill leg, request sent to prefill answered.",
            ("runtime", "model"),
            b,
        )
        self.pd_handoff = h(
            "mesh_pd_handoff_seconds",
            "P/D, streamed requests of the atom and vllm backends only: prefill answered to the "
            "decode leg's response head (KV pulled, first step run); a whole answer would include "
            "the decode, and sglang sends both legs at once.",
            ("runtime", "model"),
            b,
        )
        self.pd_decode = h(
            "mesh_pd_decode_duration_seconds",
            "P/D: decode leg, decode request sent to its last byte relayed.",
            ("runtime", "model"),
            b,
        )
        self.pd_kv_failures = c(
            "mesh_pd_kv_transfer_failures_total",
            "P/D: KV transfers that failed, as the engines reported them (or prefill answers "
            "without kv_transfer_params).",
            ("runtime", "reason"),
        )
        # --- cache-aware placement (recorded by the cache-aware policy)
        self.cache_hits = c(
            "mesh_cache_aware_hits_total",
            "Cache-aware placements that matched a prefix above the threshold.",
            ("worker_type",),
        )
        self.cache_misses = c(
            "mesh_cache_aware_misses_total",
            "Cache-aware placements that fell back to load balancing.",
            ("worker_type",),
        )
        self.cache_index_entries = g(
            "mesh_cache_aware_index_entries",
            "Entries in the approximate prefix index of each pool (bounded by its budget).",
            ("worker_type",),
        )
        # --- engine metrics proxy (GET /engine_metrics)
        self.engine_scrape_errors = c(
            "mesh_engine_metrics_scrape_errors_total",
            "Workers whose /metrics could not be read for /engine_metrics.",
            ("worker",),
        )
        self._collector = _Collector(self.families)
        self.registry.register(self._collector)
        # The values one request updates, looked up once per distinct label set (all bounded, see the
        # module docstring) instead of one `labels()` call per metric per request. The worker-labelled
        # ones are dropped with the worker's series (forget_worker).
        self._active = self.http_active.labels()
        self._received: dict[tuple[str, str], CounterValue] = {}
        self._answered: dict[
            tuple[str, str, int, str | None], tuple[CounterValue, HistogramValue, CounterValue | None]
        ] = {}
        self._routed: dict[tuple[str, str, str, str], tuple[CounterValue, HistogramValue]] = {}
        self._picked: dict[tuple[str, str, str], CounterValue] = {}
        self._served: dict[tuple[str, str, int | None], tuple[CounterValue, CounterValue]] = {}
        self._tokens: dict[tuple[str, str, str], CounterValue] = {}

    # ------------------------------------------------------------------ declaration
    def _declare(self, family: F) -> F:
        self.specs.append(family.spec)
        self.families.append(family)
        return family

    def _counter(self, name: str, help_: str, labels: tuple[str, ...]) -> CounterFamily:
        return self._declare(CounterFamily(MetricSpec(name, "counter", labels, help_)))

    def _gauge(self, name: str, help_: str, labels: tuple[str, ...]) -> GaugeFamily:
        return self._declare(GaugeFamily(MetricSpec(name, "gauge", labels, help_)))

    def _histogram(self, name: str, help_: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> HistogramFamily:
        return self._declare(HistogramFamily(MetricSpec(name, "histogram", labels, help_), buckets))

    def series_names(self) -> set[str]:
        """Every sample name this registry can export."""
        return {n for s in self.specs for n in s.series_names}

    def render(self, remote: Sequence[Export] = ()) -> web.Response:
        """The text exposition of the registry, other processes' values added in, as an HTTP response."""
        self._collector.remote = remote
        try:
            body = generate_latest(self.registry)
        finally:
            self._collector.remote = ()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def export(self) -> Export:
        """This process's values of the request-path metrics, for the leader process to add in."""
        return {f.spec.name: f.export() for f in self.families if f.spec.name not in LEADER_ONLY}

    # ------------------------------------------------------------------ bounded labels
    def model_label(self, model: str | None) -> str:
        """A client-supplied model name as a label: one of the names the workers serve, else `unknown`
        (so a client cannot mint series); `none` when the request names none."""
        if not model:
            return NO_MODEL
        return model if model in self.served_models else UNKNOWN

    def set_served_models(self, names: Iterable[str]) -> None:
        """The model names workers advertise (the only `model` label values besides `unknown`)."""
        self.served_models = frozenset(n for n in names if 0 < len(n) <= MAX_MODEL_LABEL)

    def forget_worker(self, url: str) -> None:
        """Drop every series of a removed worker so label sets do not grow with churn."""
        self._picked.clear()
        self._served.clear()
        for family in (
            self.worker_active,
            self.worker_health,
            self.health_checks,
            self.selections,
            self.worker_errors,
            self.upstream_responses,
            self.cb_state,
            self.cb_transitions,
            self.cb_outcomes,
            self.engine_scrape_errors,
        ):
            for labels in [k for k in family.children if k and k[0] == url]:  # the worker label is first
                family.remove(*labels)

    # ------------------------------------------------------------------ the request path
    def http_received(self, method: str, path: str) -> None:
        """One HTTP request in: `mesh_http_requests_total` and the active gauge."""
        counter = self._received.get((method, path))
        if counter is None:
            counter = self._received[(method, path)] = self.http_requests.labels(method, path)
        counter.value += 1
        self._active.value += 1

    def http_answered(self, method: str, path: str, status: int, admission: str | None, seconds: float) -> None:
        """One HTTP request answered: its response, duration and admission result, one fewer active."""
        key = (method, path, status, admission)
        values = self._answered.get(key)
        if values is None:
            values = self._answered[key] = (
                self.http_responses.labels(path, str(status)),
                self.http_duration.labels(method, path),
                None if admission is None else self.rate_limit.labels(admission),
            )
        responses, duration, admitted = values
        responses.value += 1
        duration.observe(seconds)
        if admitted is not None:
            admitted.value += 1
        self._active.value -= 1

    def routed(self, endpoint: str, model: str, streaming: str, backend: str) -> HistogramValue:
        """One inference request routed (`mesh_router_requests_total`); returns its duration histogram."""
        key = (endpoint, model, streaming, backend)
        values = self._routed.get(key)
        if values is None:
            values = self._routed[key] = (
                self.router_requests.labels(*key),
                self.router_duration.labels(endpoint, model, streaming),
            )
        values[0].value += 1
        return values[1]

    def picked(self, worker: str, role: str, policy: str) -> None:
        """The policy placed a request on `worker` (`mesh_worker_selection_total`)."""
        key = (worker, role, policy)
        counter = self._picked.get(key)
        if counter is None:
            counter = self._picked[key] = self.selections.labels(*key)
        counter.value += 1

    def worker_served(self, worker: str, role: str, status: int | None) -> None:
        """`worker` answered the client (`mesh_router_upstream_responses_total`), a breaker success."""
        key = (worker, role, status)
        values = self._served.get(key)
        if values is None:
            values = self._served[key] = (
                self.upstream_responses.labels(worker, role, str(status)),
                self.cb_outcomes.labels(worker, "success"),
            )
        values[0].value += 1
        values[1].value += 1

    def token_counter(self, endpoint: str, model: str, kind: str) -> CounterValue:
        """`mesh_router_tokens_total` of an endpoint, model and kind (`input` or `output`)."""
        key = (endpoint, model, kind)
        counter = self._tokens.get(key)
        if counter is None:
            counter = self._tokens[key] = self.tokens.labels(*key)
        return counter

    # ------------------------------------------------------------------ recording helpers
    def meter(self, route: str, model: str | None, streaming: bool) -> RequestMeter:
        """A per-request token meter; pass its `feed` as the relay's on_chunk hook, then `finish()` it."""
        return RequestMeter(self, ENDPOINTS.get(route, route), self.model_label(model), streaming)

    def request_failed(self, route: str, model: str | None, code: str) -> None:
        """Count one failed inference request (`code`: a gateway error code, from a fixed set)."""
        self.router_errors.labels(ENDPOINTS.get(route, route), self.model_label(model), code).inc()

    def observe_pd(
        self,
        runtime: str,
        model: str | None,
        *,
        prefill_secs: float | None = None,
        handoff_secs: float | None = None,
        decode_secs: float | None = None,
    ) -> None:
        """Record the stages of one P/D request (any subset; call once per stage or once at the end)."""
        label = self.model_label(model)
        if prefill_secs is not None:
            self.pd_prefill.labels(runtime, label).observe(prefill_secs)
        if handoff_secs is not None:
            self.pd_handoff.labels(runtime, label).observe(handoff_secs)
        if decode_secs is not None:
            self.pd_decode.labels(runtime, label).observe(decode_secs)

    def pd_kv_transfer_failed(self, runtime: str, reason: str) -> None:
        """Count one failed KV transfer; `reason` must come from a small fixed set (an error code)."""
        self.pd_kv_failures.labels(runtime, reason).inc()

    def cache_aware_lookup(self, hit: bool, worker_type: str = "regular") -> None:
        """Count one cache-aware placement decision."""
        (self.cache_hits if hit else self.cache_misses).labels(worker_type).inc()

    def set_cache_index_entries(self, entries: int, worker_type: str = "regular") -> None:
        self.cache_index_entries.labels(worker_type).set(entries)

    def sync_cache_aware(self, worker_type: str, hits: int, misses: int, entries: int) -> None:
        """Copy a cache-aware policy's own running totals (read at scrape time) into the metrics."""
        last_hits, last_misses = self._cache_seen.get(worker_type, (0, 0))
        if hits > last_hits:
            self.cache_hits.labels(worker_type).inc(hits - last_hits)
        if misses > last_misses:
            self.cache_misses.labels(worker_type).inc(misses - last_misses)
        self._cache_seen[worker_type] = (max(hits, last_hits), max(misses, last_misses))
        self.cache_index_entries.labels(worker_type).set(entries)


# A streamed event carrying generated text: `"content": "x..."` (chat) or `"text": "x..."` (completions,
# /generate). The negative look-ahead skips empty strings, e.g. the role-only first chat event.
_CONTENT = re.compile(rb'"(?:content|text)"\s*:\s*"(?!")')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
# A streamed event that is a JSON object: a token, usage or error event (not `data: [DONE]`, nor a comment).
_EVENT = b"data: {"
_KEEP = 64 * 1024  # bytes of the stream's end kept for its usage (what follows the last event's start)
_now = time.perf_counter


class RequestMeter:
    """Token timing of one response, read from the relayed bytes without decoding JSON.

    `feed` takes each SSE chunk (the relay's ChunkHook: pass the bound method, cheaper to call than the
    object): counts `data: {` events, stamps the first one
    with non-empty content (TTFT) and the last one, and keeps the stream's end from its last event on;
    `finish()` takes the engine's `usage` token counts from it (the last count wins: engines send usage
    at the end, or cumulatively with every event) and records everything once, when the request ends.
    Per event that is one clock read and one count: this runs for every event of every stream.
    """

    __slots__ = (
        "_done",
        "_end",
        "_m",
        "_tail",
        "endpoint",
        "events",
        "first_at",
        "last_at",
        "model",
        "started",
        "streaming",
        "usage_in",
        "usage_out",
    )

    def __init__(self, metrics: Metrics, endpoint: str, model: str, streaming: bool) -> None:
        self._m = metrics
        self.endpoint = endpoint
        self.model = model
        self.streaming = streaming
        self.started = _now()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.events = 0  # content-bearing events from the first token on
        self.usage_out: int | None = None
        self.usage_in: int | None = None
        # The previous chunk's end when it ended inside a line: an event marker may be split across the two.
        self._tail = b""
        self._end = b""  # the stream from the start of its last event on (at most _KEEP bytes)
        self._done = False

    def feed(self, chunk: bytes) -> None:
        # A chunk that ends a line (an event per chunk, the usual case) leaves no marker half-sent.
        if self._tail or chunk[-1:] != b"\n":
            chunk = self._join(chunk)
            if not chunk:
                return
        if self.first_at is None:
            self._first(chunk)
            return
        n = chunk.count(_EVENT)
        if n:
            self.events += n
            self.last_at = _now()
            self._end = chunk
        elif len(self._end) < _KEEP:
            self._end += chunk  # the rest of the last event, or `data: [DONE]`

    def counted(self, first_at: float | None, events: int, last_at: float, end: bytes, tail: bytes) -> None:
        """Take what a native relay (atomesh/splice.c) read of the whole stream by `feed`'s rules, in place of
        `feed` itself: the first token's time (None: not seen), the events from it on, the last one's time,
        the stream's end and the part line left over."""
        if first_at is not None:
            self.first_at = first_at
            self.events = events
            self.last_at = last_at
            self._end = end
        self._tail = tail

    def _join(self, chunk: bytes) -> bytes:
        """`chunk` after what the previous one left of a line (an event marker may be split across the two);
        keeps this one's end when it ends inside a line."""
        if self._tail:
            chunk = self._tail + chunk
        self._tail = b"" if chunk[-1:] == b"\n" else chunk[1 - len(_EVENT) :]
        return chunk

    def _first(self, chunk: bytes) -> None:
        """Until the first event with content: look for it (TTFT); events before it do not count."""
        found = _CONTENT.search(chunk)
        if found is None:
            return
        self.first_at = self.last_at = _now()
        self._end = chunk
        self.events = chunk.count(_EVENT, max(0, chunk.rfind(_EVENT, 0, found.start())))

    def _read_usage(self, data: bytes) -> None:
        # The last count in the chunk wins: engines that stream usage send it cumulatively or at the end.
        at = data.rfind(b'"completion_tokens"')
        if at >= 0 and (out := _COMPLETION_TOKENS.match(data, at)) is not None:
            self.usage_out = int(out.group(1))
        at = data.rfind(b'"prompt_tokens"')
        if at >= 0 and (inp := _PROMPT_TOKENS.match(data, at)) is not None:
            self.usage_in = int(inp.group(1))

    def finish(self, status: int | None = None, body: bytes | None = None) -> None:
        """Record the request's token metrics (once; later calls do nothing)."""
        if self._done:
            return
        self._done = True
        m = self._m
        labels = (self.endpoint, self.model)
        if not self.streaming:
            if body is not None and status is not None and status < 300:
                self._read_usage(body)
        elif self.first_at is not None:
            self._read_usage(self._end)
            m.ttft.labels(*labels).observe(self.first_at - self.started)
            m.generation_duration.labels(*labels).observe(self.last_at - self.first_at)
        out = self.usage_out if self.usage_out is not None else (self.events if self.streaming else None)
        if self.streaming and self.first_at is not None and out is not None and out > 1:
            m.tpot.labels(*labels).observe((self.last_at - self.first_at) / (out - 1))
        if out:
            m.token_counter(self.endpoint, self.model, "output").value += out
        if self.usage_in:
            m.token_counter(self.endpoint, self.model, "input").value += self.usage_in


def metrics_markdown(metrics: Metrics | None = None) -> str:
    """docs/metrics.md, generated from the declarations (a test keeps the file in sync)."""
    m = metrics or Metrics([1.0])
    lines = [
        "# Gateway metrics",
        "",
        "Generated by `python -m atomesh.metrics > docs/metrics.md` from `atomesh/metrics.py`; do not edit by hand.",
        "",
        "The gateway serves these on `--prometheus-host:--prometheus-port` at `/metrics` (default: `--host`'s",
        "address, port 29000).",
        "Every histogram uses the buckets of `--prometheus-duration-buckets` (seconds).",
        "",
        "Labels take values from bounded sets only: `worker` is a worker URL (its series are dropped when the",
        "worker is removed), `worker_type` is `regular`, `prefill` or `decode`, `endpoint` is `completions`,",
        "`chat`, `generate`, `responses`, `messages`, `embeddings`, `rerank` (`/v1/rerank` and `/rerank`), `score`,",
        "`classify`, `tokenize` or `detokenize`, `model` is the requested model name (an alias's canonical name;",
        "the one served model for a request naming none) when a registered worker serves",
        f"a model of that name (up to {MAX_MODEL_LABEL} characters), `none` when the request names no model, else",
        "`unknown`,",
        "`runtime` is the `--backend` (`atom`, `sglang`, `vllm`), `streaming` is `true` or `false`.",
        "No label carries a request id, a prompt or anything else per request.",
        "",
        "Worker engines' own metrics are on the service port at `GET /engine_metrics`: every worker's",
        "`/metrics` merged, each sample with a `worker_addr` label; a worker that cannot be read is listed in a",
        "comment and as `mesh_engine_metrics_scrape_errors{worker_addr=...} 1` in that answer.",
        "",
        "| Metric | Type | Labels | Meaning |",
        "|---|---|---|---|",
    ]
    for s in m.specs:
        labels = ", ".join(f"`{x}`" for x in s.labels) or "-"
        lines.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(metrics_markdown(), end="")
