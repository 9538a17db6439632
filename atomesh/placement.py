"""THE placement core: every decision about where a request runs is made here.

`Placement.place(view)` turns a RequestView into a Plan (one worker, or a prefill/decode pair
chosen together) using the configured policy of each pool, and counts the load on the chosen
workers from that moment until `release(plan)`, called after the last byte was sent.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import xxhash

from atomesh.errors import NotFound, NoWorkerAvailable
from atomesh.policies import Policy
from atomesh.request import RequestView
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState


@dataclass(frozen=True, slots=True)
class Single:
    """Run the request on one worker (on one of its data-parallel ranks with --dp-aware)."""

    worker: Worker
    dp_rank: int | None = None

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.worker,)


@dataclass(frozen=True, slots=True)
class Pair:
    """Prefill on one worker, decode on another."""

    prefill: Worker
    decode: Worker

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.prefill, self.decode)


Plan = Single | Pair


class Placement:
    """Chooses workers for requests; owns the per-pool policies and the in-flight load counts."""

    def __init__(self, registry: WorkerRegistry, policies: dict[WorkerRole, Policy], *, pd: bool,
                 dp_ranks: bool = False) -> None:
        self.registry = registry
        self.policies = policies
        self.pd = pd
        self.dp_ranks = dp_ranks  # regular mode: also choose a data-parallel rank of the worker
        registry.subscribe(self._on_state)

    def place(self, view: RequestView, exclude: Collection[Worker] = ()) -> Plan:
        """Choose where `view` runs, avoiding `exclude` (earlier failed attempts) when possible."""
        if self.pd:
            # Both pools are chosen before either is charged; each pool's policy sees its own loads,
            # which count every pair placed on that worker until its last byte.
            prefill = self._choose(WorkerRole.PREFILL, view, exclude)
            decode = self._choose(WorkerRole.DECODE, view, exclude)
            plan: Plan = Pair(prefill, decode)
        else:
            worker = self._choose(WorkerRole.REGULAR, view, exclude)
            if self.dp_ranks:
                rank = self._rank(worker, view)
                worker.rank_in_flight[rank] += 1
                plan = Single(worker, rank)
            else:
                plan = Single(worker)
        for w in plan.workers:
            w.in_flight += 1
        return plan

    def _rank(self, worker: Worker, view: RequestView) -> int:
        """dp_sticky keeps a routing key on one rank (its prefix cache); otherwise the least busy rank."""
        loads = worker.rank_in_flight
        if view.routing_key is not None and self.policies[worker.role].name == "dp_sticky":
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

    def _choose(self, role: WorkerRole, view: RequestView, exclude: Collection[Worker]) -> Worker:
        pool = self.candidates(role, view, exclude)
        if not pool:
            ready = self.registry.ready(role)
            if ready and view.model is not None and not any(w.serves(view.model) for w in ready):
                served = sorted({m for w in ready for m in w.models})
                raise NotFound(f"the model {view.model!r} does not exist; served: {', '.join(served)}",
                               code="model_not_found")
            raise NoWorkerAvailable(_no_worker_message(role, view, ready))
        policy = self.policies[role]
        # One candidate is the answer, unless the policy may refuse it (a target header naming another).
        single = len(pool) == 1 and not getattr(policy, "select_single", False)
        worker = pool[0] if single else policy.select(pool, view)
        policy.on_placed(worker, view)
        return worker

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
