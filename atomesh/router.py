"""One inference request from admission to the last byte: place, forward, retry, account."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import structlog

from atomesh.backends import Backend
from atomesh.config import GatewayConfig
from atomesh.errors import UpstreamError, UpstreamStatus
from atomesh.metrics import ENDPOINTS, Metrics
from atomesh.placement import Placement, Plan
from atomesh.request import RequestView
from atomesh.transport import Exchange, backoff_delays, write_sse_error
from atomesh.workers.worker import Worker

log = structlog.get_logger("atomesh.router")


class Router:
    """Drives a RequestView through placement and a backend, with bounded retries."""

    def __init__(self, config: GatewayConfig, placement: Placement, backend: Backend, metrics: Metrics) -> None:
        self.placement = placement
        self.backend = backend
        self.metrics = metrics
        self.max_retries = 0 if config.disable_retries else config.retry_max_retries
        self._backoff = (config.retry_initial_backoff_ms, config.retry_max_backoff_ms,
                         config.retry_backoff_multiplier, config.retry_jitter_factor)
        self._policy_names = {role: config.policy_for(role.value) for role in placement.policies}
        self._backend_type = "pd" if placement.pd else "regular"

    async def serve(self, exchange: Exchange, view: RequestView) -> None:
        m = self.metrics
        stream = view.stream
        meter = exchange.on_chunk = m.meter(view.route, view.model, stream)
        streaming = "true" if stream else "false"
        m.router_requests.labels(meter.endpoint, meter.model, streaming, self._backend_type).inc()
        try:
            await self._attempts(exchange, view)
        finally:
            meter.finish(exchange.status, exchange.body)
            m.router_duration.labels(meter.endpoint, meter.model, streaming).observe(
                time.perf_counter() - meter.started)

    async def _attempts(self, exchange: Exchange, view: RequestView) -> None:
        tried: list[Worker] = []
        delays: Iterator[float] | None = None  # made on the first retry: a fresh Random() seeds from urandom
        attempt = 0
        while True:
            plan = self.placement.place(view, exclude=tried)
            exchange.workers = tuple(w.url for w in plan.workers)
            self._count_selection(plan)
            try:
                await self.backend.forward(exchange, view, plan)
            except UpstreamError as e:
                self._record_failure(e, plan)
                if exchange.committed:
                    # The client already has part of the answer: end it in-band, never retry. The request
                    # failed all the same (the errors counted by serve_inference are those raised).
                    self.metrics.request_failed(view.route, view.model, e.code)
                    await write_sse_error(exchange, e)
                    return
                endpoint = ENDPOINTS.get(view.route, view.route)
                if not e.retryable or attempt >= self.max_retries:
                    if e.retryable and self.max_retries:
                        self.metrics.retries_exhausted.labels(plan.workers[-1].role.value, endpoint).inc()
                    raise
                # Avoid the worker at fault next time (both legs when the fault is unknown).
                at_fault = [e.worker] if isinstance(e.worker, Worker) else list(plan.workers)
                tried.extend(w for w in at_fault if w not in tried)
                log.debug("retrying", request_id=exchange.request_id, attempt=attempt + 1, error=e.message)
            else:
                m = self.metrics
                for w in plan.workers:
                    w.breaker.record(True)
                    m.cb_outcomes.labels(w.url, "success").inc()
                last = plan.workers[-1]  # the worker whose answer the client got (decode in P/D)
                m.upstream_responses.labels(last.url, last.role, str(exchange.status)).inc()
                return
            finally:
                self.placement.release(plan)
            attempt += 1
            self.metrics.retries.labels(plan.workers[-1].role.value, endpoint).inc()
            if delays is None:
                delays = backoff_delays(*self._backoff)
            await asyncio.sleep(next(delays))

    def _count_selection(self, plan: Plan) -> None:
        m = self.metrics
        for w in plan.workers:
            m.selections.labels(w.url, w.role, self._policy_names[w.role]).inc()

    def _record_failure(self, e: UpstreamError, plan: Plan) -> None:
        """Charge the failure to the worker at fault (a 4xx answer is the client's fault, not the worker's)."""
        at_fault = e.worker if isinstance(e.worker, Worker) else None
        if isinstance(e, UpstreamStatus):
            answered = at_fault or plan.workers[-1]
            self.metrics.upstream_responses.labels(answered.url, answered.role.value, str(e.status)).inc()
            if e.status < 500:
                return
        for w in plan.workers:
            if at_fault is None or w is at_fault:
                w.breaker.record(False)
                self.metrics.cb_outcomes.labels(w.url, "failure").inc()
                self.metrics.worker_errors.labels(w.url, w.role.value, e.code).inc()
