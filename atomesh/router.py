"""One inference request from admission to the last byte: place, forward, retry, account."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from atomesh.backends import Backend
from atomesh.config import GatewayConfig
from atomesh.errors import GatewayError, UpstreamError, UpstreamStatus, UpstreamUnreachable, upstream_error_code
from atomesh.metrics import ENDPOINTS, HistogramValue, Metrics, RequestMeter
from atomesh.migration import MigrationRefused, StreamTracker, refusal
from atomesh.placement import Placement, Plan
from atomesh.request import RequestView
from atomesh.transport import Exchange, backoff_delays, write_sse_error
from atomesh.workers.worker import Worker, WorkerRole

log = structlog.get_logger("atomesh.router")

# Called with a worker that refused a connection: it is taken out of rotation at once.
UnreachableHook = Callable[[Worker], None]


class WorkerLost(UpstreamError):
    """The attempt was taken off its worker because the worker was declared dead (health checks, breaker)."""

    code = "worker_lost"


class _Attempt:
    """One placement of a request while it runs: what `fail_over` needs to take it off its worker."""

    __slots__ = ("exchange", "lost", "plan", "reason", "task", "tracker", "workers")

    def __init__(self, task: asyncio.Task[Any], exchange: Exchange, plan: Plan, tracker: StreamTracker | None) -> None:
        self.task = task
        self.exchange = exchange
        self.plan = plan
        self.workers = plan.workers  # read once: a plan makes the tuple on each read
        self.tracker = tracker
        self.lost: Worker | None = None  # the worker it was taken off
        self.reason = ""


class Router:
    """Drives a RequestView through placement and a backend, with bounded retries."""

    def __init__(self, config: GatewayConfig, placement: Placement, backend: Backend, metrics: Metrics) -> None:
        self.placement = placement
        self.backend = backend
        self.max_retries = 0 if config.disable_retries else config.retry_max_retries
        self._backoff = (
            config.retry_initial_backoff_ms,
            config.retry_max_backoff_ms,
            config.retry_backoff_multiplier,
            config.retry_jitter_factor,
        )
        self._policy_names = {role: config.policy_for(role.value) for role in placement.policies}
        # An attempt span's policies, in its plan's order of workers (--enable-trace).
        legs = (WorkerRole.PREFILL, WorkerRole.DECODE) if placement.pd else (WorkerRole.REGULAR,)
        self._span_policies = tuple(str(self._policy_names[role]) for role in legs)
        self.counts = AttemptMetrics(metrics, self._policy_names, "pd" if placement.pd else "regular")
        self.migration_limit = config.migration_limit
        self.on_unreachable: UnreachableHook | None = None
        # The attempts running on each worker, for fail_over (a worker is in here only while it has some).
        self._running: dict[Worker, set[_Attempt]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop serving requests (one: the gateway's)

    def fail_over(self, worker: Worker, reason: str) -> int:
        """Take the requests running on a worker declared dead off it, to be placed again at once.

        Requests with no answer byte sent yet are retried elsewhere; streams already under way are
        migrated when they may be (`--migration-limit`), and otherwise left to finish or fail on their own.
        Returns how many were taken off.
        """
        runs = self._running.get(worker)
        if not runs:
            return 0
        current = asyncio.current_task()
        moved = 0
        for run in list(runs):
            if run.lost is not None or run.task is current or run.task.done():
                continue
            ex = run.exchange
            if ex.committed:
                tracker = run.tracker
                # Only the worker streaming the answer matters to a stream (in P/D, the decode worker).
                if tracker is None or worker is not run.workers[-1]:
                    continue
                starting = tracker.migrations > 0 and tracker.attempt_tokens == 0  # a continuation, no token yet
                if (
                    not tracker.probing
                    and not starting
                    and (tracker.ended or tracker.migrations >= self.migration_limit)
                ):
                    continue
            elif ex.status is not None:
                continue  # a whole answer is already on its way
            run.lost, run.reason = worker, reason
            run.task.cancel()
            moved += 1
        if moved:
            log.info("requests_failed_over", worker=worker.url, reason=reason, requests=moved)
        return moved

    def _track(self, run: _Attempt) -> None:
        for w in run.workers:
            runs = self._running.get(w)
            if runs is None:
                self._running[w] = {run}
            else:
                runs.add(run)

    def _untrack(self, run: _Attempt) -> None:
        for w in run.workers:
            runs = self._running.get(w)
            if runs is not None:
                runs.discard(run)
                if not runs:
                    del self._running[w]

    async def serve(self, exchange: Exchange, view: RequestView) -> None:
        meter, duration = self.counts.started(view)
        exchange.on_chunk = meter.feed
        exchange.meter = meter
        try:
            await self._attempts(exchange, view)
        finally:
            meter.finish(exchange.status, exchange.body)
            duration.observe(time.perf_counter() - meter.started)

    async def _attempts(self, exchange: Exchange, view: RequestView) -> None:
        tried: list[Worker] = []
        delays: Iterator[float] | None = None  # made on the first retry: a fresh Random() seeds from urandom
        attempt = 0
        loop = self._loop
        if loop is None:  # looked up once: asyncio.get_running_loop() makes a getpid() system call each time
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        tracker: StreamTracker | None = None
        refused: str | None = None
        if self.migration_limit and view.stream:
            refused = refusal(view)
            if refused is None:
                tracker = exchange.stream_filter = StreamTracker(view)
        current = view  # what the next attempt sends: the client's request, or a continuation of its stream
        broken: Worker | None = None  # the worker whose stream is being migrated, until the next one is placed
        while True:
            try:
                plan = self.placement.place(current, exclude=tried)
            except GatewayError as e:
                if not exchange.committed:
                    raise
                if broken is not None:
                    self._migration("no_worker", exchange, broken, None, tracker, e.message)
                self.counts.failed_in_band(view, e.code)
                await write_sse_error(exchange, e)  # a stream to continue, and nowhere to continue it
                return
            if broken is not None:
                self._migration("migrated", exchange, broken, plan.workers[-1], tracker)
                broken = None
            run = _Attempt(task, exchange, plan, tracker)
            workers = run.workers
            exchange.workers = (workers[0].url,) if len(workers) == 1 else tuple([w.url for w in workers])
            self.counts.placed(workers)
            if tracker is not None:
                tracker.start_attempt()
            self._track(run)
            try:
                try:
                    trace = exchange.trace
                    if trace is not None:  # the span ends in `finally`
                        kind = (
                            "first" if not tried and current is view else "migration" if exchange.committed else "retry"
                        )
                        trace.attempt(attempt, kind, self._span_policies, exchange.workers)
                    try:
                        await self.backend.forward(exchange, current, plan)
                    finally:
                        if trace is not None:
                            trace.end()
                except asyncio.CancelledError:
                    if run.lost is None or task.uncancel() > 0:
                        raise  # the client went away (or the gateway stops): not ours to handle
                    err = WorkerLost(f"{run.lost.url} was {run.reason}")
                    err.worker = run.lost
                    raise err from None
            except UpstreamError as e:
                self._untrack(run)
                self._record_failure(e, workers)
                # Avoid the worker at fault next time (both legs when the fault is unknown).
                at_fault = [e.worker] if isinstance(e.worker, Worker) else list(workers)
                if exchange.committed:
                    # The client already has part of the answer: continue it elsewhere, or end it in-band.
                    moved = await self._after_break(exchange, view, e, tracker, refused, attempt, workers[-1])
                    if moved is None:
                        return
                    if moved == "migrate":
                        broken = workers[-1]
                    assert tracker is not None
                    current = tracker.usage_probe() if moved == "usage" else tracker.continuation()
                    if moved == "retry":
                        attempt += 1
                else:
                    if not e.retryable or attempt >= self.max_retries:
                        if e.retryable and self.max_retries:
                            self.counts.retries_exhausted(workers, view)
                        raise
                    attempt += 1
                    moved = "retry"
                wait = not isinstance(e, WorkerLost)  # a worker declared dead: the next one need not wait
                tried.extend(w for w in at_fault if w not in tried)
                log.debug("retrying", request_id=exchange.request_id, attempt=attempt, how=moved, error=e.message)
            else:
                for w in workers:
                    w.breaker.record(True)
                self.counts.answered(workers, exchange.status)
                return
            finally:
                self._untrack(run)
                self.placement.release(plan)
            if moved != "retry":
                continue  # a migration goes on at once: the client is waiting mid-answer
            self.counts.retried(workers, view)
            if not wait:
                continue
            if delays is None:
                delays = backoff_delays(*self._backoff)
            await asyncio.sleep(next(delays))

    async def _after_break(
        self,
        exchange: Exchange,
        view: RequestView,
        e: UpstreamError,
        tracker: StreamTracker | None,
        refused: str | None,
        attempt: int,
        worker: Worker,
    ) -> str | None:
        """A started stream broke on `worker`: "migrate", "retry" (a continuation that failed before sending
        anything) or "usage" (the answer is whole, its usage was lost) to go on elsewhere, or None once the
        client's stream has been ended."""

        async def fail(err: GatewayError) -> None:
            # Ended in-band: the request failed all the same (serve_inference counts only those raised).
            self.counts.failed_in_band(view, err.code)
            await write_sse_error(exchange, err)

        if tracker is None:
            err: UpstreamError = e
            if refused is not None:
                err = MigrationRefused(f"{e.message}; the stream was not migrated: {refused}")
                self._migration("refused", exchange, worker, None, None, refused)
            await fail(err)
            return None
        remaining = tracker.remaining()
        if tracker.ended or tracker.probing or (remaining is not None and remaining <= 0):
            # The answer is complete (or its token limit reached): only its last events were lost.
            if tracker.errored or tracker.done:
                await _end_stream(exchange, b"")
                return None
            if not tracker.finished:
                try:
                    await exchange.write(tracker.closing_events())
                except (ConnectionError, RuntimeError):
                    return None  # the client is gone too
            if tracker.wants_usage and not tracker.probing and tracker.migrations < self.migration_limit:
                tracker.migrations += 1
                return "usage"  # another worker tells the prompt's token count
            await _end_stream(exchange, b"data: [DONE]\n\n")
            return None
        if tracker.migrations and tracker.attempt_tokens == 0:
            # A continuation that failed before its first token: an ordinary retry.
            if e.retryable and attempt < self.max_retries:
                return "retry"
            self._migration("failed", exchange, worker, None, tracker, e.message)
            await fail(e)
            return None
        if tracker.migrations >= self.migration_limit:
            self._migration("limit_reached", exchange, worker, None, tracker, e.message)
            await fail(
                MigrationRefused(
                    f"{e.message}; the stream was not migrated: --migration-limit {self.migration_limit} reached",
                    code="migration_limit_reached",
                )
            )
            return None
        tracker.migrations += 1
        log.debug(
            "stream_migrating",
            request_id=exchange.request_id,
            migration=tracker.migrations,
            tokens=tracker.tokens,
            error=e.message,
        )
        return "migrate"

    def _migration(
        self,
        outcome: str,
        exchange: Exchange,
        source: Worker,
        target: Worker | None,
        tracker: StreamTracker | None,
        why: str = "",
    ) -> None:
        """Count what became of a broken stream and say so in the log: one line per break."""
        self.counts.migration(outcome)
        tokens = tracker.tokens if tracker is not None else None
        if outcome == "migrated":
            assert target is not None and tracker is not None
            log.info(
                "stream_migrated",
                request_id=exchange.request_id,
                from_worker=source.url,
                to_worker=target.url,
                tokens_so_far=tokens,
                migration=tracker.migrations,
            )
        else:
            log.warning(
                "stream_not_migrated",
                request_id=exchange.request_id,
                outcome=outcome,
                from_worker=source.url,
                tokens_so_far=tokens,
                reason=why,
            )

    def _record_failure(self, e: UpstreamError, workers: tuple[Worker, ...]) -> None:
        """Charge the failure to the worker at fault (a 4xx answer is the client's fault, not the worker's)."""
        at_fault = e.worker if isinstance(e.worker, Worker) else None
        if isinstance(e, WorkerLost):
            return  # already out of rotation; the failure that took it out was counted where it happened
        if isinstance(e, UpstreamUnreachable) and at_fault is not None and self.on_unreachable is not None:
            self.on_unreachable(at_fault)
        if not self.counts.failed(e, workers, at_fault):
            return
        for w in workers:
            if at_fault is None or w is at_fault:
                w.breaker.record(False)


class AttemptMetrics:
    """What the router counts about a request and its attempts, one call per event, so that the retry loop
    reads as placing, forwarding and retrying; every metric family the router feeds is named here."""

    __slots__ = ("_backend", "_metrics", "_policies")

    def __init__(self, metrics: Metrics, policies: Mapping[WorkerRole, str], backend: str) -> None:
        self._metrics = metrics
        self._policies = policies  # each role's policy name (the selection counter's label)
        self._backend = backend  # "regular" or "pd"

    def started(self, view: RequestView) -> tuple[RequestMeter, HistogramValue]:
        """A request is routed (`mesh_router_requests_total`): its token meter and its duration histogram."""
        m = self._metrics
        meter = m.meter(view.route, view.model, view.stream)
        return meter, m.routed(meter.endpoint, meter.model, "true" if view.stream else "false", self._backend)

    def placed(self, workers: tuple[Worker, ...]) -> None:
        """An attempt was placed (`mesh_worker_selection_total` per worker of the plan)."""
        m = self._metrics
        for w in workers:
            m.picked(w.url, w.role, self._policies[w.role])

    def answered(self, workers: tuple[Worker, ...], status: int | None) -> None:
        """The plan's last worker answered the client; the others (a P/D prefill) count a breaker success."""
        m = self._metrics
        last = workers[-1]  # the worker whose answer the client got (decode in P/D)
        if workers[0] is not last:
            for w in workers[:-1]:
                m.cb_outcomes.labels(w.url, "success").inc()
        m.worker_served(last.url, last.role, status)

    def failed(self, e: UpstreamError, workers: tuple[Worker, ...], at_fault: Worker | None) -> bool:
        """An attempt failed; True when it is the workers' fault (their breakers then count a failure)."""
        m = self._metrics
        if isinstance(e, UpstreamStatus):
            answered = at_fault or workers[-1]
            m.upstream_responses.labels(answered.url, answered.role.value, str(e.status)).inc()
            if e.status < 500 or _sheds_load(e):
                return False
        for w in workers:
            if at_fault is None or w is at_fault:
                m.cb_outcomes.labels(w.url, "failure").inc()
                m.worker_errors.labels(w.url, w.role.value, e.code).inc()
        return True

    def retried(self, workers: tuple[Worker, ...], view: RequestView) -> None:
        self._metrics.retries.labels(workers[-1].role.value, ENDPOINTS.get(view.route, view.route)).inc()

    def retries_exhausted(self, workers: tuple[Worker, ...], view: RequestView) -> None:
        self._metrics.retries_exhausted.labels(workers[-1].role.value, ENDPOINTS.get(view.route, view.route)).inc()

    def failed_in_band(self, view: RequestView, code: str) -> None:
        """A started stream ended with an error event (serve_inference counts only the errors raised)."""
        self._metrics.request_failed(view.route, view.model, code)

    def migration(self, outcome: str) -> None:
        """What became of a broken stream (`mesh_migrations_total`)."""
        self._metrics.migrations.labels(outcome).inc()


# Error codes of a worker that is up and turns a request away for want of room (our engine's OverloadedError:
# its waiting queue is full, or a P/D decode engine found no blocks in time): retried, not charged to its breaker.
SHEDDING_CODES = frozenset({"queue_full"})


def _sheds_load(e: UpstreamStatus) -> bool:
    """A 503 whose OpenAI-shaped body says the worker is full, not broken: counting it would turn an overload
    into an outage (the breaker opens, the requests on the worker are failed over, new ones get 503 for
    ``--cb-timeout-duration-secs``)."""
    return e.status == 503 and upstream_error_code(e.upstream_body) in SHEDDING_CODES


async def _end_stream(exchange: Exchange, tail: bytes) -> None:
    try:
        if tail:
            await exchange.write(tail)
        await exchange.end()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too
