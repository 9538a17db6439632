"""THE placement core: every decision about where a request runs is made here.

`Placement.place(view)` turns a RequestView into a Plan (one worker, or a prefill/decode pair
chosen together) using the configured policy of each pool, and counts the load on the chosen
workers from that moment until `release(plan)`, called after the last byte was sent.

Each pool's policy first only decides (`select` returns a `Decision`); the decisions are recorded
(`Policy.record`: the cache-aware index, its replication) once every leg of the plan is chosen, so
a plan that fails part way (no decode worker) leaves no trace in any policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import structlog
import xxhash

from atomesh.config import PolicyName
from atomesh.errors import NotFound, NoWorkerAvailable
from atomesh.policies import Decision, Policy
from atomesh.policies.base import ONLY_CANDIDATE, slot_setter
from atomesh.request import RequestView
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState

log = structlog.get_logger("atomesh.placement")


@dataclass(frozen=True, slots=True, init=False)
class Single:
    """Run the request on one worker (on one of its data-parallel ranks with --dp-aware)."""

    worker: Worker
    dp_rank: int | None = None

    def __init__(self, worker: Worker, dp_rank: int | None = None) -> None:
        _set_worker(self, worker)  # made per placement: see slot_setter
        _set_dp_rank(self, dp_rank)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.worker,)


@dataclass(frozen=True, slots=True, init=False)
class Pair:
    """Prefill on one worker, decode on another."""

    prefill: Worker
    decode: Worker

    def __init__(self, prefill: Worker, decode: Worker) -> None:
        _set_prefill(self, prefill)  # made per placement: see slot_setter
        _set_decode(self, decode)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.prefill, self.decode)


_set_worker, _set_dp_rank = slot_setter(Single, "worker"), slot_setter(Single, "dp_rank")
_set_prefill, _set_decode = slot_setter(Pair, "prefill"), slot_setter(Pair, "decode")

Plan = Single | Pair


class StickyKeys:
    """SMG's routing-key override (`--routing-key-override`, alias `--sticky-sessions`): on any policy, a
    request whose routing key was placed before goes back to that worker while it is routable; otherwise
    the policy decides and the key is pinned to its choice (SMG's `delegate` assignment). Keys unused
    for `--max-idle-secs` are forgotten (checked at most once a minute, as placements happen)."""

    def __init__(self, max_idle_secs: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_idle_secs = max_idle_secs
        self._clock = clock
        self._pins: dict[tuple[WorkerRole, str], tuple[str, float]] = {}  # (pool, key) -> (worker URL, last use)
        self._swept = clock()

    def find(self, role: WorkerRole, key: str, pool: Sequence[Worker]) -> Worker | None:
        pin = self._pins.get((role, key))
        if pin is None:
            return None
        return next((w for w in pool if w.url == pin[0]), None)

    def pin(self, role: WorkerRole, key: str, worker: Worker) -> None:
        now = self._clock()
        self._pins[(role, key)] = (worker.url, now)
        if now - self._swept > 60.0:
            self._swept = now
            cutoff = now - self.max_idle_secs
            for k in [k for k, (_, used) in self._pins.items() if used < cutoff]:
                del self._pins[k]

    def __len__(self) -> int:
        return len(self._pins)


class Placement:
    """Chooses workers for requests; owns the per-pool policies and the in-flight load counts."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policies: dict[WorkerRole, Policy],
        *,
        pd: bool,
        dp_ranks: bool = False,
        sticky: StickyKeys | None = None,
    ) -> None:
        self.registry = registry
        self.sticky = sticky  # --routing-key-override
        self.policies = policies
        self.pd = pd
        self.dp_ranks = dp_ranks  # regular mode: also choose a data-parallel rank of the worker
        # Each leg's role and policy, looked up once rather than on every placement.
        roles = (WorkerRole.PREFILL, WorkerRole.DECODE) if pd else (WorkerRole.REGULAR,)
        self._legs = tuple((role, policies[role]) for role in roles)
        # Decided once (logging is set up before the gateway is built, with the same level for the
        # standard library, which stays at WARNING where nothing set it up: benchmarks, tests).
        self._log_decisions = logging.getLogger().isEnabledFor(logging.DEBUG)
        registry.subscribe(self._on_state)

    def place(self, view: RequestView, exclude: Collection[Worker] = ()) -> Plan:
        """Choose where `view` runs, avoiding `exclude` (earlier failed attempts) when possible."""
        if self.pd:
            (prefill_role, prefill_policy), (decode_role, decode_policy) = self._legs
            # Both legs are chosen before either is recorded or charged, so a plan that fails part way
            # leaves no trace; each pool's policy sees its own loads, which count every pair placed on
            # that worker until its last byte.
            prefill = self._decide(prefill_role, prefill_policy, view, exclude)
            decode = self._decide(decode_role, decode_policy, view, exclude)
            prefill_policy.record(prefill, view)
            decode_policy.record(decode, view)
            if self.sticky is not None and view.routing_key is not None:
                self.sticky.pin(prefill_role, view.routing_key, prefill.worker)
                self.sticky.pin(decode_role, view.routing_key, decode.worker)
            if self._log_decisions:
                log.debug(
                    "placed",
                    request_id=view.request_id,
                    prefill=prefill.worker.url,
                    prefill_reason=prefill.reason,
                    decode=decode.worker.url,
                    decode_reason=decode.reason,
                )
            prefill.worker.in_flight += 1
            decode.worker.in_flight += 1
            return Pair(prefill.worker, decode.worker)
        ((role, policy),) = self._legs
        decision = self._decide(role, policy, view, exclude)
        policy.record(decision, view)
        if self.sticky is not None and view.routing_key is not None:
            self.sticky.pin(role, view.routing_key, decision.worker)
        if self._log_decisions:
            log.debug("placed", request_id=view.request_id, worker=decision.worker.url, reason=decision.reason)
        worker = decision.worker
        worker.in_flight += 1
        if self.dp_ranks:
            rank = self._rank(worker, view)
            worker.rank_in_flight[rank] += 1
            return Single(worker, rank)
        return Single(worker)

    def _rank(self, worker: Worker, view: RequestView) -> int:
        """dp_sticky keeps a routing key on one rank (its prefix cache); otherwise the least busy rank."""
        loads = worker.rank_in_flight
        if view.routing_key is not None and self.policies[worker.role].name is PolicyName.DP_STICKY:
            return xxhash.xxh3_64_intdigest(view.routing_key.encode()) % len(loads)
        return loads.index(min(loads))

    def start(self) -> None:
        """Start the policies' background tasks (cache-aware eviction)."""
        for policy in self.policies.values():
            policy.start()

    async def stop(self) -> None:
        for policy in self.policies.values():
            await policy.stop()

    def release(self, plan: Plan) -> None:
        """The request placed by `plan` has sent its last byte (or failed)."""
        if isinstance(plan, Single) and plan.dp_rank is not None:
            plan.worker.rank_in_flight[plan.dp_rank] -= 1
        for w in plan.workers:
            w.in_flight -= 1
            self.policies[w.role].released(w)
            if w.on_release is not None:  # it drains: tell whoever waits
                w.on_release(w)

    def candidates(self, role: WorkerRole, view: RequestView, exclude: Collection[Worker] = ()) -> list[Worker]:
        ready = self.registry.ready(role)
        pool = [w for w in ready if w.breaker.admit()]
        model = view.model
        if model is not None:
            serving = [w for w in pool if w.serves(model)]
            # A fleet that does not advertise the requested name still serves it (one-model fleets).
            if serving or not any(w.models for w in pool):
                pool = serving or pool
            else:
                pool = serving
        if exclude:
            fresh = [w for w in pool if w not in exclude]
            pool = fresh or pool
        return pool

    def _decide(self, role: WorkerRole, policy: Policy, view: RequestView, exclude: Collection[Worker]) -> Decision:
        pool = self.candidates(role, view, exclude)
        if not pool:
            ready = self.registry.ready(role)
            if ready and view.model is not None and not any(w.serves(view.model) for w in ready):
                served = sorted({m for w in ready for m in w.models})
                raise NotFound(
                    f"the model {view.model!r} does not exist; served: {', '.join(served)}", code="model_not_found"
                )
            raise NoWorkerAvailable(_no_worker_message(role, view, ready))
        if self.sticky is not None and view.routing_key is not None:
            pinned = self.sticky.find(role, view.routing_key, pool)
            if pinned is not None:
                return Decision(pinned, "sticky_key")
        # One candidate is the answer, unless the policy may refuse it (a target header naming another)
        # or records from its own decision (kv_aware).
        if len(pool) == 1 and not policy.select_single:
            return Decision(pool[0], ONLY_CANDIDATE)
        return policy.select(pool, view)

    def _on_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if new is WorkerState.REMOVED:
            policy = self.policies.get(worker.role)
            if policy is not None:
                policy.on_worker_removed(worker)


def _no_worker_message(role: WorkerRole, view: RequestView, ready: Sequence[Worker]) -> str:
    what = "worker" if role is WorkerRole.REGULAR else f"{role.value} worker"
    if not ready:
        return f"no healthy {what} is available"
    if view.model is not None and not any(w.serves(view.model) for w in ready):
        return f"no healthy {what} serves model {view.model!r}"
    return f"every healthy {what} has its circuit breaker open"
