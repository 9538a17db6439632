"""The one seam every placement policy implements, the decision it returns, what a policy declares it
needs from the gateway (and is given), and the shared scorer."""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from atomesh.config import PolicyName
from atomesh.request import RequestView
from atomesh.workers.worker import Worker, WorkerRole

if TYPE_CHECKING:  # the gateway gives these; a policy only calls them
    from atomesh.kv.events import KvEventHub
    from atomesh.transport import Upstream
    from atomesh.workers.registry import WorkerRegistry

# Why placement took the only candidate without asking the policy.
ONLY_CANDIDATE = "only_candidate"


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of one slot of a frozen dataclass, for an `__init__` that runs on every placement:
    the generated one goes through `object.__setattr__` per field, at twice the cost."""
    setter: Callable[[Any, Any], None] = cls.__dict__[name].__set__
    return setter


@dataclass(frozen=True, slots=True, init=False)
class Decision:
    """A policy's choice for one pool: the worker, and why (a short word for debug logs).

    A policy that records its placements subclasses this to carry what `select` computed and
    `record` needs (the cache-aware prefix hashes), so nothing is computed twice and nothing passes
    between the two calls but this value.
    """

    worker: Worker
    reason: str

    def __init__(self, worker: Worker, reason: str) -> None:
        _set_worker(self, worker)  # made per placement: see slot_setter
        _set_reason(self, reason)


_set_worker, _set_reason = slot_setter(Decision, "worker"), slot_setter(Decision, "reason")


class Loads(enum.Enum):
    """What a policy reads of the engines' own load reports; the value is the poll interval it wants
    (the load poller runs at the shortest interval any pool's policy wants, and not at all for none)."""

    UNUSED = 0.0  # places without looking at loads (round_robin, random, passthrough)
    POLLED = 1.0  # compares loads (least_load, cache_aware, ...)
    FRESH = 0.1  # weighs cached blocks against load, so it wants the engines' queues fresher (kv_aware)


@dataclass(frozen=True, slots=True)
class Needs:
    """What a policy needs from the gateway beyond its candidates and requests. The gateway reads it
    once, builds what is asked for and hands it over in `Given` (`Policy.attach`)."""

    loads: Loads = Loads.POLLED
    kv_events: bool = False  # a hub following the KV events of its pool's workers, into the hub's index
    upstream: bool = False  # the upstream client (to ask workers something, e.g. their tokenizer)


@dataclass(frozen=True, slots=True)
class Given:
    """What the gateway hands a policy at start-up, as its `Needs` asked: always its pool and the
    registry; the hub and the upstream client only when asked for (None otherwise)."""

    role: WorkerRole
    registry: WorkerRegistry
    hub: KvEventHub | None = None
    upstream: Upstream | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What a policy that keeps a prefix index exports (as `mesh_cache_*`, per pool)."""

    hits: int
    misses: int
    entries: int


class Replica(Protocol):
    """Part of a policy's state that the gateway's processes (`--processes N`) share: every process's
    records reach the others (batched, through the leader). Records are plain picklable values."""

    def connect(self, publish: Callable[[Any], None]) -> None:
        """Where to send this process's records from now on."""

    def apply(self, record: Any, registry: WorkerRegistry) -> None:
        """A record another process sent (`registry`: this process's workers, by URL)."""


class Policy(Protocol):
    """Chooses one worker among routable candidates for a request.

    `select` is called with two or more candidates (placement takes a lone candidate itself, as
    `Decision(worker, ONLY_CANDIDATE)`, unless `select_single` is true: a policy that may refuse
    that candidate, as consistent_hashing does for a target header naming another, or whose
    `record` needs what its own decision carries, as kv_aware's block keys) and records nothing
    about the placement. `record` runs once the whole plan exists (in P/D: both legs
    chosen), with the decision `select` returned or the lone-candidate one; a plan that could not be
    completed records nothing. `released` runs when a request placed on the worker has sent its
    last byte (or failed), after the worker's in-flight count dropped. `on_worker_removed` runs when
    a worker leaves the registry.
    `start` / `stop` own any background task (cache-aware eviction).

    What it needs from the gateway it declares in `needs`, and gets in `attach` before `start`;
    `elsewhere` tells the load poller how many requests on a worker it knows other gateways placed
    (left out of the engine's "foreign" load); `replicas` names the state the gateway's processes
    share; `export` gives the values the metrics show for it. Stateless policies inherit
    `select_single = False`, `needs = Needs()` and no-op hooks from `Stateless`.
    """

    name: PolicyName
    select_single: bool
    needs: Needs

    def attach(self, given: Given) -> None: ...

    def elsewhere(self, worker: Worker) -> int: ...

    def replicas(self) -> Mapping[str, Replica]: ...

    def export(self) -> CacheStats | None: ...

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision: ...

    def record(self, decision: Decision, view: RequestView) -> None: ...

    def released(self, worker: Worker) -> None: ...

    def on_worker_removed(self, worker: Worker) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Stateless:
    """No-op hooks for policies that keep no state from one placement to the next."""

    select_single = False
    needs = Needs()

    def attach(self, given: Given) -> None:
        pass

    def elsewhere(self, worker: Worker) -> int:
        return 0

    def replicas(self) -> Mapping[str, Replica]:
        return {}

    def export(self) -> CacheStats | None:
        return None

    def record(self, decision: Decision, view: RequestView) -> None:
        pass

    def released(self, worker: Worker) -> None:
        pass

    def on_worker_removed(self, worker: Worker) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


_load = operator.attrgetter("load")


def least_loaded(
    candidates: Sequence[Worker], start: int = 0, tiebreak: Callable[[Worker], int] | None = None
) -> Worker:
    """The worker with the lowest `load`, scanning from `candidates[start]` round to `start - 1`.

    Ties go to `tiebreak`'s lowest value when given, then to the first in scan order: a policy
    spreads ties over an idle fleet by rotating `start`, or prefers the most recent of a list by
    passing it reversed.
    """
    if start:
        candidates = [*candidates[start:], *candidates[:start]]
    if tiebreak is None:
        return min(candidates, key=_load)
    return min(candidates, key=lambda w: (w.load, tiebreak(w)))
