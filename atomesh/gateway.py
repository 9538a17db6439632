"""The running gateway: every component built from the config, with their start / stop order."""

from __future__ import annotations

import asyncio
import os
import ssl
import time

import structlog
from aiohttp import web

from atomesh.admission import Admission, host_concurrency_limit
from atomesh.auth import Keys
from atomesh.backends import Backend
from atomesh.backends.atom import make_atom_backend
from atomesh.backends.sglang import SglangBackend
from atomesh.backends.single import SingleBackend
from atomesh.backends.vllm import make_vllm_backend
from atomesh.config import BackendKind, GatewayConfig, PolicyName, parse_model_aliases
from atomesh.kv.events import KvEventHub, parse_endpoint_flags
from atomesh.kv.index import KvIndex
from atomesh.kv.tokens import PromptTokenizer, TokenizerError
from atomesh.metrics import Metrics
from atomesh.placement import Placement, StickyKeys
from atomesh.policies import Given, Loads, Policy, make_policy
from atomesh.router import Router
from atomesh.tenancy import (
    PriorityClass,
    TenantRateLimits,
    Tenants,
    load_rate_limits,
    load_scheduler,
    parse_tenant_api_keys,
)
from atomesh.tracing import Tracing
from atomesh.transport import Upstream
from atomesh.workers.breaker import BreakerSettings, BreakerState
from atomesh.workers.discovery import DiscoveryError, DiscoverySettings, KubernetesDiscovery
from atomesh.workers.health import HealthChecker
from atomesh.workers.lifecycle import Lifecycle
from atomesh.workers.load import LoadPoller
from atomesh.workers.models import ModelNames
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerSource, WorkerState

log = structlog.get_logger("atomesh")

_CB_VALUE = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}


class StartupError(RuntimeError):
    """The gateway cannot start; the message says why in one line."""


class Gateway:
    """Owns every component of a running gateway and their start / stop order."""

    def __init__(self, config: GatewayConfig, instance_id: str | None = None) -> None:
        self.config = config
        # Sent to workers with every call (HOP_HEADER): a request that comes back with it is a loop.
        # Every process of one gateway shares it (atomesh.cluster passes it on).
        self.instance_id = instance_id or os.urandom(12).hex()
        self.keys = Keys(config.api_key, config.admin_api_key)
        self.metrics = Metrics(config.prometheus_duration_buckets)
        self.registry = WorkerRegistry()
        try:
            self.tracing = Tracing(config.otlp_traces_endpoint if config.enable_trace else None)
        except RuntimeError as e:  # the SDK is not installed
            raise StartupError(str(e)) from None
        self.upstream = Upstream(
            config.request_timeout_secs,
            hop=self.instance_id,
            ssl_context=worker_ssl_context(config),
            pool_idle_timeout_secs=config.upstream_pool_idle_timeout_secs,
            tracing=self.tracing,
        )
        roles = (WorkerRole.PREFILL, WorkerRole.DECODE) if config.pd_disaggregation else (WorkerRole.REGULAR,)
        self.tokens = _prompt_tokens(config)
        policies: dict[WorkerRole, Policy] = {
            r: make_policy(_pool_policy(config, r), config, self.tokens) for r in roles
        }
        for role, policy in policies.items():  # each gets what it declared it needs
            needs = policy.needs
            hub = (
                KvEventHub(KvIndex(), self.registry, (role,), parse_endpoint_flags(config.kv_events_endpoints))
                if needs.kv_events
                else None
            )
            policy.attach(Given(role, self.registry, hub, self.upstream if needs.upstream else None))
        sticky = StickyKeys(config.max_idle_secs) if config.routing_key_override else None
        self.placement = Placement(
            self.registry, policies, pd=config.pd_disaggregation, dp_ranks=config.dp_ranks, sticky=sticky
        )
        # Engine-reported load only matters to policies that read it, polled as often as the most eager wants.
        wanted = [p.needs.loads.value for p in policies.values() if p.needs.loads is not Loads.UNUSED]
        self.load_poller = (
            LoadPoller(
                self.registry,
                self.upstream,
                interval=config.load_monitor_interval or min(wanted),
                elsewhere=lambda w: policies[w.role].elsewhere(w) if w.role in policies else 0,
            )
            if wanted
            else None
        )
        self.models = ModelNames(self.registry, roles[-1], parse_model_aliases(config.model_alias))
        self.backend = self._make_backend()
        self.router = Router(config, self.placement, self.backend, self.metrics)
        # With several processes each admits its share (the kernel spreads connections about evenly).
        n = config.processes
        rate = config.rate_limit_tokens_per_second  # None or 0: no token bucket
        limit = config.max_concurrent_requests
        # -1: derived from this process's own descriptor limit (each process has one); 0: no limit.
        per_process = host_concurrency_limit() if limit == -1 else -(-limit // n) if limit > 0 else -1
        # The bucket's burst is a limit the user set; a derived one is no burst to allow (one second's worth).
        burst = float(per_process) if limit > 0 else (rate / n if rate else None)
        self.scheduler = (
            load_scheduler(
                config.priority_scheduler_config, PriorityClass.named(config.priority_scheduler_default_max_class)
            )
            if config.priority_scheduler_enabled
            else None
        )
        self.admission = Admission(
            per_process,
            -(-config.queue_size // n),
            config.queue_timeout_secs,
            rate / n if rate else None,
            burst,
            classes=self.scheduler.classes if self.scheduler is not None else None,
        )
        self.tenants = Tenants(
            parse_tenant_api_keys(config.tenant_api_key), config.trust_tenant_header, config.tenant_header_name
        )
        self.rate_limits = (
            TenantRateLimits(load_rate_limits(config.tenant_rate_limit_config), share=1 / n)
            if config.tenant_rate_limit_enabled and config.tenant_rate_limit_config
            else None
        )
        self.lifecycle = Lifecycle(
            self.registry,
            self.upstream,
            backend=config.backend,
            breaker=BreakerSettings(
                failure_threshold=config.cb_failure_threshold,
                success_threshold=config.cb_success_threshold,
                timeout_secs=config.cb_timeout_duration_secs,
                window_secs=config.cb_window_duration_secs,
                enabled=not config.disable_circuit_breaker,
            ),
            startup_timeout=config.worker_startup_timeout_secs,
            check_interval=config.worker_startup_check_interval,
            startup_delay=config.worker_startup_delay,
            probe_timeout=config.health_check_timeout_secs,
            health_endpoint=config.health_check_endpoint,
            on_breaker=self._on_breaker,
            dp_aware=config.dp_ranks,
        )
        self.health = HealthChecker(
            self.registry,
            self.lifecycle.probe,
            interval=config.health_check_interval_secs,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
            on_result=lambda w, ok: self.metrics.health_checks.labels(
                w.url, w.role.value, "success" if ok else "failure"
            ).inc(),
        )
        self.registry.subscribe(self._on_worker_state)
        self.router.on_unreachable = self.mark_unreachable
        self.discovery = (
            KubernetesDiscovery(DiscoverySettings.from_config(config), self.lifecycle, self.registry)
            if config.service_discovery
            else None
        )
        self.shutting_down = False
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.started_at = time.time()

    def _make_backend(self) -> Backend:
        if not self.config.pd_disaggregation:
            return SingleBackend(self.upstream)
        if self.config.backend is BackendKind.ATOM:
            return make_atom_backend(self.upstream, self.metrics)
        if self.config.backend is BackendKind.VLLM:
            return make_vllm_backend(self.upstream, self.metrics)
        return SglangBackend(self.upstream, self.metrics)

    @property
    def roles(self) -> tuple[WorkerRole, ...]:
        return tuple(self.placement.policies)

    def sync_metrics(self) -> None:
        """Copy in, at scrape time, the values components keep themselves (off the request path)."""
        for w in self.registry:
            self.metrics.worker_active.labels(w.url, w.role.value).set(w.in_flight)
        for role, policy in self.placement.policies.items():
            stats = policy.export()
            if stats is not None:
                self.metrics.sync_cache_aware(role.value, stats.hits, stats.misses, stats.entries)

    # ------------------------------------------------------------------ request accounting
    def request_started(self) -> None:
        self.active_requests += 1
        if self.active_requests == 1:
            self._idle.clear()

    def request_finished(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.upstream.start()

    async def add_startup_workers(self) -> None:
        """Register the command-line workers and wait for them (up to the startup timeout)."""
        cfg = self.config
        cli = WorkerSource.COMMAND_LINE
        workers: list[Worker] = [self.lifecycle.add(u, WorkerRole.REGULAR, source=cli) for u in cfg.worker_urls]
        workers += [self.lifecycle.add(p.url, WorkerRole.PREFILL, p.bootstrap_port, source=cli) for p in cfg.prefill]
        workers += [self.lifecycle.add(u, WorkerRole.DECODE, source=cli) for u in cfg.decode]
        if not workers:
            return
        log.info("waiting_for_workers", count=len(workers), timeout_secs=cfg.worker_startup_timeout_secs)
        await asyncio.gather(*(self.lifecycle.wait_ready(w) for w in workers))
        failed = [w for w in workers if w.state is WorkerState.FAILED]
        for w in failed:
            log.error("startup_worker_failed", worker=w.url, reason=w.error)
        for role in self.roles:
            if any(w.role is role for w in workers) and not self.registry.ready(role):
                reasons = "; ".join(w.error or "" for w in failed if w.role is role)
                raise StartupError(f"no {role.value} worker became healthy: {reasons}")

    async def start_discovery(self) -> None:
        """Start watching Kubernetes pods (--service-discovery); the workers come as pods turn ready."""
        if self.discovery is not None:
            try:
                await self.discovery.start()
            except DiscoveryError as e:
                raise StartupError(str(e)) from None

    def start_background(self) -> None:
        if not self.config.disable_health_check:
            self.health.start()
        self.placement.start()
        if self.load_poller is not None:
            self.load_poller.start()

    async def drain_requests(self, grace: float) -> bool:
        """Stop taking requests and wait for in-flight ones; True if all finished in time."""
        self.shutting_down = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        await self.placement.stop()
        if self.load_poller is not None:
            await self.load_poller.stop()
        await self.lifecycle.stop()
        await self.upstream.stop()
        self.tracing.shutdown()

    # ------------------------------------------------------------------ observers
    def refresh_served_models(self) -> None:
        """The `model` label takes only names some registered worker serves (metrics.model_label)."""
        self.metrics.set_served_models({m for w in self.registry for m in w.models})

    def _on_worker_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        m = self.metrics
        role = worker.role.value
        if new is WorkerState.READY or new is WorkerState.REMOVED:
            self.refresh_served_models()
        if old is not None:
            m.pool_size.labels(role, old.value).dec()
        if new is WorkerState.REMOVED:
            m.forget_worker(worker.url)
            return
        m.pool_size.labels(role, new.value).inc()
        m.worker_health.labels(worker.url, role).set(1 if new is WorkerState.READY else 0)
        if old is None:
            m.cb_state.labels(worker.url).set(_CB_VALUE[worker.breaker.state])
        if new is WorkerState.UNHEALTHY:
            self.router.fail_over(worker, "declared unhealthy")

    def _on_breaker(self, worker: Worker, old: BreakerState, new: BreakerState) -> None:
        self.metrics.cb_state.labels(worker.url).set(_CB_VALUE[new])
        self.metrics.cb_transitions.labels(worker.url, old.value, new.value).inc()
        if new is BreakerState.OPEN:
            self.router.fail_over(worker, "cut off by its circuit breaker")

    def mark_unreachable(self, worker: Worker) -> None:
        """A worker refused a connection: out of rotation now, not after health checks or the breaker
        count it. Health checks bring it back (or, without them, the breaker's half-open probe)."""
        if worker.state is WorkerState.READY and not self.config.disable_health_check:
            self.registry.set_state(worker, WorkerState.UNHEALTHY)
            log.warning("worker_unreachable", worker=worker.url, reason="connection refused")
        elif worker.state is WorkerState.READY:
            worker.breaker.trip()


def _pool_policy(config: GatewayConfig, role: WorkerRole) -> PolicyName:
    """The policy of one pool. kv_aware places decode by load: decode receives its KV from prefill."""
    name = PolicyName(config.policy_for(role.value))
    return PolicyName.LEAST_LOAD if role is WorkerRole.DECODE and name is PolicyName.KV_AWARE else name


def worker_ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """TLS settings for https:// workers: extra CAs (--ca-cert-paths), a client certificate (mTLS)."""
    if not config.ca_cert_paths and config.client_cert_path is None:
        return None
    ctx = ssl.create_default_context()
    try:
        for ca in config.ca_cert_paths:
            ctx.load_verify_locations(cafile=str(ca))
        if config.client_cert_path is not None and config.client_key_path is not None:
            ctx.load_cert_chain(str(config.client_cert_path), str(config.client_key_path))
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"--ca-cert-paths/--client-cert-path: cannot load: {e}") from None
    return ctx


def _prompt_tokens(config: GatewayConfig) -> PromptTokenizer | None:
    """The tokenizer and chat template of --model-path / --tokenizer-path / --chat-template, loaded once."""
    if config.model_path is None and config.tokenizer_path is None:
        return None
    try:
        tokens = PromptTokenizer.from_files(config.model_path, config.tokenizer_path, config.chat_template)
    except TokenizerError as e:
        raise StartupError(str(e)) from None
    log.info(
        "tokenizer_loaded",
        path=config.tokenizer_path or config.model_path,
        vocab_size=tokens.vocab_size,
        chat_template=config.chat_template is not None or tokens.template_found,
    )
    return tokens


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
