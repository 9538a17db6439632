"""Worker lifecycle jobs: register (probe, discover, publish), drain and remove.

Each registration or removal runs as a background job owned by `Lifecycle`, which cancels and
awaits them all on `stop()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from atomesh.config import BackendKind, check_worker_url
from atomesh.errors import GatewayError, LoopDetected
from atomesh.transport import Upstream
from atomesh.workers.breaker import BreakerSettings, BreakerState, CircuitBreaker
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerSource, WorkerState

log = structlog.get_logger("atomesh.workers")

# Expected `kv_role` of each P/D role when the backend is atom (docs/pd.md).
_ATOM_KV_ROLE = {WorkerRole.PREFILL: "kv_producer", WorkerRole.DECODE: "kv_consumer"}


# The probe's reason when the URL answered 508: it is this gateway (atomesh.transport.HOP_HEADER).
SELF_LOOP = "it answered 508 loop detected: the URL points back at the gateway"


class RegistrationFailed(Exception):
    """A worker could not be registered; the message says why."""


class Lifecycle:
    """Adds workers (as jobs that answer at once), drains and removes them."""

    def __init__(
        self,
        registry: WorkerRegistry,
        upstream: Upstream,
        *,
        backend: BackendKind,
        breaker: BreakerSettings,
        startup_timeout: float,
        check_interval: float,
        probe_timeout: float,
        health_endpoint: str,
        on_breaker: Callable[[Worker, BreakerState, BreakerState], None] | None = None,
        dp_aware: bool = False,
        startup_delay: float = 0.0,
    ) -> None:
        self.dp_aware = dp_aware  # every worker must report its data-parallel size
        self.startup_delay = startup_delay  # --worker-startup-delay: before a new worker's first probe
        self.registry = registry
        self.upstream = upstream
        self.backend = backend
        self.breaker_settings = breaker
        self.startup_timeout = startup_timeout
        self.check_interval = check_interval
        self.probe_timeout = probe_timeout
        self.health_endpoint = health_endpoint
        self.on_breaker = on_breaker
        self._jobs: set[asyncio.Task[Any]] = set()
        self._ready_events: dict[str, asyncio.Event] = {}
        self._drained: dict[str, asyncio.Event] = {}  # draining worker id -> set once nothing is in flight

    # ------------------------------------------------------------------ jobs
    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    async def stop(self) -> None:
        for task in list(self._jobs):
            task.cancel()
        await asyncio.gather(*self._jobs, return_exceptions=True)

    # ------------------------------------------------------------------ add
    def add(
        self,
        url: str,
        role: WorkerRole,
        bootstrap_port: int | None = None,
        labels: dict[str, str] | None = None,
        *,
        source: WorkerSource = WorkerSource.API,
        pod: str | None = None,
        model_id: str | None = None,
        api_key: str | None = None,
    ) -> Worker:
        """Create a pending worker and start its registration job; raises ValueError on bad input.

        `model_id`, when given, is served by the worker besides the models the engine reports; `api_key`
        is the worker's own key, sent on every call to it (inference, health checks, discovery)."""
        url = check_worker_url(url)
        existing = self.registry.by_url(url)
        if existing is not None:
            if existing.state is not WorkerState.FAILED:
                raise ValueError(f"worker {url} is already registered as {existing.id}")
            self.registry.set_state(existing, WorkerState.REMOVED)
        worker = Worker(
            url=url,
            role=role,
            bootstrap_port=bootstrap_port,
            labels=dict(labels or {}),
            source=source,
            pod=pod,
            api_key=api_key,
        )
        worker.breaker = CircuitBreaker(settings=self.breaker_settings, on_transition=self._breaker_hook(worker))
        self.registry.add(worker)
        self._ready_events[worker.id] = asyncio.Event()
        self._spawn(self._register(worker, model_id), f"register {url}")
        log.info(
            "worker_added", worker=url, role=role.value, id=worker.id, source=source.value, own_key=api_key is not None
        )  # (a field named *api_key would be redacted)
        return worker

    def mirror(self, url: str, role: WorkerRole, bootstrap_port: int | None, api_key: str | None = None) -> Worker:
        """A worker another process registered and probes (atomesh.cluster): added as pending, no job."""
        worker = Worker(url=url, role=role, bootstrap_port=bootstrap_port, api_key=api_key)
        worker.breaker = CircuitBreaker(settings=self.breaker_settings, on_transition=self._breaker_hook(worker))
        self.registry.add(worker)
        return worker

    def _breaker_hook(self, worker: Worker) -> Callable[[BreakerState, BreakerState], None]:
        def hook(old: BreakerState, new: BreakerState) -> None:
            log.info(
                "breaker_" + ("opened" if new is BreakerState.OPEN else new.value),
                worker=worker.url,
                previous=old.value,
            )
            if self.on_breaker is not None:
                self.on_breaker(worker, old, new)

        return hook

    async def wait_ready(self, worker: Worker) -> None:
        """Wait for a worker's registration job to end (ready or failed)."""
        event = self._ready_events.get(worker.id)
        if event is not None:
            await event.wait()

    async def _register(self, worker: Worker, model_id: str | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        try:
            if self.startup_delay:
                await asyncio.sleep(min(self.startup_delay, self.startup_timeout))
            await self._wait_healthy(worker, deadline)
            await self._discover(worker)
            if model_id is not None:
                worker.models = (model_id, *(m for m in worker.models if m != model_id))
            if worker.state is WorkerState.PENDING:
                self.registry.set_state(worker, WorkerState.READY)
                log.info("worker_registered", worker=worker.url, role=worker.role.value, models=list(worker.models))
        except RegistrationFailed as e:
            worker.error = str(e)
            if worker.state is WorkerState.PENDING:
                self.registry.set_state(worker, WorkerState.FAILED)
            log.warning("worker_registration_failed", worker=worker.url, reason=str(e))
        finally:
            event = self._ready_events.pop(worker.id, None)
            if event is not None:
                event.set()

    async def _wait_healthy(self, worker: Worker, deadline: float) -> None:
        logged = ""  # the reason last logged: a wrong URL says why at once, and again only when that changes
        while worker.state is WorkerState.PENDING:
            remaining = deadline - time.monotonic()
            ok, last = await self.probe(worker, min(self.probe_timeout, max(remaining, 0.001)))
            if ok:
                worker.error = None
                return
            if last == SELF_LOOP:
                raise RegistrationFailed(f"{worker.url} is this gateway itself ({SELF_LOOP})")
            worker.error = f"not healthy yet: {last}"  # GET /workers/{id} shows why it is still pending
            if last != logged:
                log.warning(
                    "worker_not_healthy_yet",
                    worker=worker.url,
                    reason=last,
                    gives_up_in_secs=round(max(deadline - time.monotonic(), 0.0), 1),
                )
                logged = last
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RegistrationFailed(
                    f"{worker.url} did not become healthy within {self.startup_timeout:g}s ({last})"
                )
            await asyncio.sleep(min(self.check_interval, remaining))

    async def probe(self, worker: Worker, timeout: float | None = None) -> tuple[bool, str]:
        """One health check, bounded by the probe timeout: (healthy, reason)."""
        try:
            status, _, _ = await self.upstream.call(
                "GET",
                worker.url + self.health_endpoint,
                headers=self.upstream.worker_headers(worker),
                timeout=timeout or self.probe_timeout,
            )
        except GatewayError as e:
            return False, e.message
        if status == LoopDetected.status:
            return False, SELF_LOOP
        return (200 <= status < 300), f"{self.health_endpoint} answered {status}"

    async def _discover(self, worker: Worker) -> None:
        timeout = self.probe_timeout
        headers = self.upstream.worker_headers(worker)
        try:
            models = await self.upstream.get_json(worker.url + "/v1/models", timeout, headers)
            worker.models = tuple(m["id"] for m in models.get("data", []) if isinstance(m, dict) and "id" in m)
        except (GatewayError, AttributeError, TypeError):
            worker.models = ()  # engines without /v1/models serve whatever they are asked
        for path in ("/server_info", "/get_server_info"):
            try:
                info = await self.upstream.get_json(worker.url + path, timeout, headers)
            except GatewayError:
                continue
            if isinstance(info, dict):
                worker.server_info = info
                break
        if self.dp_aware:
            worker.dp_size = _dp_size(worker)
            worker.rank_in_flight = [0] * worker.dp_size
        if self.backend is BackendKind.ATOM and worker.role in _ATOM_KV_ROLE:
            await self._check_kv_role(worker, _ATOM_KV_ROLE[worker.role])

    async def _check_kv_role(self, worker: Worker, expected: str) -> None:
        try:
            info = await self.upstream.get_json(
                worker.url + "/kv_transfer_info", self.probe_timeout, self.upstream.worker_headers(worker)
            )
        except GatewayError as e:
            raise RegistrationFailed(f"{worker.url}/kv_transfer_info failed: {e.message}") from None
        role = info.get("kv_role") if isinstance(info, dict) else None
        if role != expected:
            raise RegistrationFailed(
                f"{worker.url} reports kv_role {role!r}; a {worker.role.value} worker must be {expected!r}"
            )
        worker.kv_transfer_info = info

    # ------------------------------------------------------------------ drain and remove
    def remove(self, worker: Worker, grace: float | None = None) -> asyncio.Task[Any] | None:
        """Stop new traffic to the worker now; remove it once its in-flight requests finished.

        Returns the drain job, or None when the worker (never ready, nothing in flight) went at once.
        """
        if worker.state in (WorkerState.FAILED, WorkerState.PENDING) and worker.in_flight == 0:
            if worker.state is WorkerState.PENDING:
                self.registry.set_state(worker, WorkerState.DRAINING)
            self.registry.set_state(worker, WorkerState.REMOVED)
            log.info("worker_removed", worker=worker.url)
            return None
        if worker.state is not WorkerState.DRAINING:
            self.registry.set_state(worker, WorkerState.DRAINING)
            log.info("worker_draining", worker=worker.url, in_flight=worker.in_flight)
        return self._spawn(self._drain(worker, grace), f"drain {worker.url}")

    def _drained_event(self, worker: Worker) -> asyncio.Event:
        """Set once no process has a request on `worker` (woken by Worker.on_release, never polled)."""
        event = self._drained.get(worker.id)
        if event is None:
            event = self._drained[worker.id] = asyncio.Event()

            def released(w: Worker) -> None:
                if w.in_flight + w.remote_in_flight <= 0:
                    event.set()

            worker.on_release = released
            released(worker)
        return event

    async def _drain(self, worker: Worker, grace: float | None) -> None:
        drained = self._drained_event(worker)
        try:
            await asyncio.wait_for(drained.wait(), grace)
        except TimeoutError:
            pass
        if worker.state is WorkerState.DRAINING:
            self.registry.set_state(worker, WorkerState.REMOVED)
            log.info("worker_removed", worker=worker.url, abandoned=worker.in_flight + worker.remote_in_flight)
        if self._drained.pop(worker.id, None) is not None:
            worker.on_release = None
            drained.set()  # another drain job of this worker (a second DELETE) wakes and finds it removed


MAX_DP_SIZE = 1024


def _dp_size(worker: Worker) -> int:
    """The data-parallel size the engine reports in its server info, or RegistrationFailed saying why not."""
    info = worker.server_info
    size = info.get("dp_size", info.get("data_parallel_size"))
    if not info or size is None:
        raise RegistrationFailed(
            f"{worker.url} reports no dp_size in /server_info or /get_server_info: --dp-aware "
            "needs engines that expose their data-parallel ranks (SGLang, ATOM, atomesh's engine)"
        )
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_DP_SIZE:
        raise RegistrationFailed(f"{worker.url} reports dp_size {size!r}; expected an integer in 1..{MAX_DP_SIZE}")
    return size
