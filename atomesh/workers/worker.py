"""A worker: one engine endpoint with a role, an explicit lifecycle state and live load counters."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from atomesh.workers.breaker import CircuitBreaker


class WorkerRole(StrEnum):
    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerSource(StrEnum):
    """Who added a worker: the command line, the admin API (POST /workers) or Kubernetes discovery."""

    COMMAND_LINE = "command_line"
    API = "api"
    KUBERNETES = "kubernetes"


class WorkerState(StrEnum):
    PENDING = "pending"  # registered, being probed / discovered
    READY = "ready"  # takes traffic
    UNHEALTHY = "unhealthy"  # failed health checks; no traffic until it recovers
    DRAINING = "draining"  # removal asked: no new traffic, in-flight requests finish
    REMOVED = "removed"  # gone from the registry
    FAILED = "failed"  # registration did not succeed (kept for GET /workers/{id} to report)


_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.PENDING: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.DRAINING}),
    WorkerState.READY: frozenset({WorkerState.UNHEALTHY, WorkerState.DRAINING}),
    WorkerState.UNHEALTHY: frozenset({WorkerState.READY, WorkerState.DRAINING}),
    WorkerState.DRAINING: frozenset({WorkerState.REMOVED}),
    WorkerState.FAILED: frozenset({WorkerState.REMOVED}),
    WorkerState.REMOVED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow."""


def check_transition(old: WorkerState, new: WorkerState) -> None:
    """The one place that allows or refuses a worker state change."""
    if new not in _TRANSITIONS[old]:
        raise IllegalTransition(f"worker cannot go from {old} to {new}")


_ids = itertools.count(1)


# The label naming where a worker publishes its KV events (atomesh.kv.events reads it; discovery sets it).
KV_EVENTS_LABEL = "kv_events_endpoint"


@dataclass(eq=False, slots=True)
class Worker:
    """Live record of one worker. Identity is the object; `id` is stable for its lifetime."""

    url: str
    role: WorkerRole = WorkerRole.REGULAR
    bootstrap_port: int | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    id: str = field(default_factory=lambda: f"w{next(_ids)}")
    state: WorkerState = WorkerState.PENDING
    # Requests placed on this worker whose last byte has not been sent yet.
    in_flight: int = 0
    # Requests other gateway processes have on it (reported while it drains; see atomesh.cluster).
    remote_in_flight: int = 0
    # Set while the worker drains: called after a request on it ended (Placement.release) or the other
    # processes' count changed, so that whoever waits for the drain wakes then instead of polling.
    on_release: Callable[[Worker], None] | None = field(default=None, repr=False)
    # Load the engine itself reports (queued + running requests), when polled.
    engine_load: int | None = None
    # Of the engine's load at the last poll, the requests that were not this gateway's.
    foreign_load: int = 0
    models: tuple[str, ...] = ()
    server_info: dict[str, Any] = field(default_factory=dict)
    kv_transfer_info: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    source: WorkerSource = WorkerSource.API
    # The pod behind a discovered worker ("namespace/name"), None for the others.
    pod: str | None = None
    host: str = ""
    # Data-parallel ranks (--dp-aware): how many the engine reports, and requests in flight on each.
    dp_size: int = 1
    rank_in_flight: list[int] = field(default_factory=lambda: [0])
    # The worker's own key (POST /workers api_key, a discovery secret): sent as its Bearer token on every
    # call to it instead of the client's Authorization. Never shown (describe says only whether it has one).
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or ""

    @property
    def routable(self) -> bool:
        """Ready, and its circuit breaker not refusing traffic (a pure query: changes nothing)."""
        return self.state is WorkerState.READY and not self.breaker.is_open

    @property
    def is_healthy(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def load(self) -> int:
        """The load policies compare: our in-flight count, or the engine's when it reports more."""
        if self.engine_load is not None and self.engine_load > self.in_flight:
            return self.engine_load
        return self.in_flight

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "state": self.state.value,
            "is_healthy": self.is_healthy,
            "load": self.load,
            "in_flight": self.in_flight,
            "models": list(self.models),
            "circuit_breaker": self.breaker.describe(),
            "labels": self.labels,
            "source": self.source.value,
            "pod": self.pod,
            "dp_size": self.dp_size,
            "has_api_key": self.api_key is not None,
            "error": self.error,
        }
