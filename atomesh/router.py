"""One inference request from admission to the last byte: place, forward, retry, account."""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web

from atomesh.backends import Backend
from atomesh.config import GatewayConfig
from atomesh.errors import UpstreamError, UpstreamStatus
from atomesh.metrics import Metrics
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

    async def serve(self, exchange: Exchange, view: RequestView) -> web.StreamResponse:
        endpoint = view.route.value
        streaming = "true" if view.stream else "false"
        self.metrics.router_requests.labels(endpoint, view.model or "", streaming).inc()
        started = time.perf_counter()
        try:
            return await self._attempts(exchange, view)
        except UpstreamError as e:
            self.metrics.router_errors.labels(endpoint, e.code).inc()
            raise
        finally:
            self.metrics.router_duration.labels(endpoint, streaming).observe(time.perf_counter() - started)

    async def _attempts(self, exchange: Exchange, view: RequestView) -> web.StreamResponse:
        tried: list[Worker] = []
        delays = backoff_delays(*self._backoff)
        attempt = 0
        while True:
            plan = self.placement.place(view, exclude=tried)
            self._count_selection(plan)
            try:
                response = await self.backend.forward(exchange, view, plan)
            except UpstreamError as e:
                self._record_failure(e, plan)
                if exchange.stream is not None:
                    # The client already has part of the answer: end it in-band, never retry.
                    await write_sse_error(exchange.stream, e)
                    return exchange.stream
                if not e.retryable or attempt >= self.max_retries:
                    if e.retryable and self.max_retries:
                        self.metrics.retries_exhausted.labels(view.route.value).inc()
                    raise
                tried.extend(w for w in plan.workers if w not in tried)
                log.debug("retrying", request_id=exchange.request_id, attempt=attempt + 1, error=e.message)
            else:
                for w in plan.workers:
                    w.breaker.record(True)
                    self.metrics.cb_outcomes.labels(w.url, "success").inc()
                return response
            finally:
                self.placement.release(plan)
            attempt += 1
            self.metrics.retries.labels(view.route.value).inc()
            await asyncio.sleep(next(delays))

    def _count_selection(self, plan: Plan) -> None:
        for w in plan.workers:
            self.metrics.selections.labels(w.url, w.role.value, self._policy_names[w.role]).inc()

    def _record_failure(self, e: UpstreamError, plan: Plan) -> None:
        """Charge the failure to the worker at fault (a 4xx answer is the client's fault, not the worker's)."""
        if isinstance(e, UpstreamStatus) and e.status < 500:
            return
        at_fault = e.worker if isinstance(e.worker, Worker) else None
        for w in plan.workers:
            if at_fault is None or w is at_fault:
                w.breaker.record(False)
                self.metrics.cb_outcomes.labels(w.url, "failure").inc()
                self.metrics.worker_errors.labels(w.url, e.code).inc()
