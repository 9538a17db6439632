"""Prometheus metrics of the gateway (`mesh_*` names, as ATOMesh), in a registry the app owns."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Every metric the gateway exports. Labels are bounded: workers, routes, roles, statuses."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        b = tuple(buckets)
        # --- HTTP layer
        self.http_requests = Counter("mesh_http_requests_total", "HTTP requests received",
                                     ["method", "endpoint"], registry=r)
        self.http_responses = Counter("mesh_http_responses_total", "HTTP responses sent",
                                      ["endpoint", "status_code"], registry=r)
        self.http_duration = Histogram("mesh_http_request_duration_seconds", "HTTP request duration",
                                       ["endpoint"], buckets=b, registry=r)
        self.http_active = Gauge("mesh_http_connections_active", "Requests being served", registry=r)
        self.rate_limited = Counter("mesh_http_rate_limit_total", "Requests refused or timed out by admission",
                                    ["reason"], registry=r)
        # --- router
        self.router_requests = Counter("mesh_router_requests_total", "Inference requests routed",
                                       ["endpoint", "model", "streaming"], registry=r)
        self.router_duration = Histogram("mesh_router_request_duration_seconds", "Inference request duration",
                                         ["endpoint", "streaming"], buckets=b, registry=r)
        self.router_errors = Counter("mesh_router_request_errors_total", "Inference requests that failed",
                                     ["endpoint", "error"], registry=r)
        self.upstream_responses = Counter("mesh_router_upstream_responses_total", "Worker responses",
                                          ["worker", "status_code"], registry=r)
        # --- workers
        self.pool_size = Gauge("mesh_worker_pool_size", "Workers per role and state",
                               ["worker_type", "state"], registry=r)
        self.worker_active = Gauge("mesh_worker_requests_active", "In-flight requests per worker",
                                   ["worker", "worker_type"], registry=r)
        self.worker_health = Gauge("mesh_worker_health", "1 if the worker is healthy",
                                   ["worker", "worker_type"], registry=r)
        self.health_checks = Counter("mesh_worker_health_checks_total", "Health checks", ["worker", "result"],
                                     registry=r)
        self.selections = Counter("mesh_worker_selection_total", "Placements per worker",
                                  ["worker", "worker_type", "policy"], registry=r)
        self.worker_errors = Counter("mesh_worker_errors_total", "Failed calls per worker", ["worker", "error"],
                                     registry=r)
        self.retries = Counter("mesh_worker_retries_total", "Retried attempts", ["endpoint"], registry=r)
        self.retries_exhausted = Counter("mesh_worker_retries_exhausted_total", "Requests that ran out of retries",
                                         ["endpoint"], registry=r)
        self.cb_state = Gauge("mesh_worker_cb_state", "Breaker state (0 closed, 1 open, 2 half-open)",
                              ["worker"], registry=r)
        self.cb_transitions = Counter("mesh_worker_cb_transitions_total", "Breaker state changes",
                                      ["worker", "from_state", "to_state"], registry=r)
        self.cb_outcomes = Counter("mesh_worker_cb_outcomes_total", "Outcomes the breaker recorded",
                                   ["worker", "outcome"], registry=r)

    def forget_worker(self, url: str, role: str) -> None:
        """Drop a removed worker's series so label sets do not grow with churn."""
        for metric, labels in ((self.worker_active, (url, role)), (self.worker_health, (url, role)),
                               (self.cb_state, (url,))):
            try:
                metric.remove(*labels)
            except KeyError:
                pass
