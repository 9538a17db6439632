"""What the leader and its followers say to each other: one frozen dataclass per message.

Messages cross a `multiprocessing` pipe as pickles; each side dispatches on the class with `match`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atomesh.metrics import Export

# One policy record to replicate: ("worker role/replica name", the record, a plain value the policy
# made: cache_aware's (worker URL, prefix hashes), kv_aware's msgpack bytes). A tuple, not a class:
# one is made per placement on the request path.
PlacementRecord = tuple[str, Any]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a follower needs to know of a worker to route to it."""

    url: str
    role: str
    bootstrap_port: int | None
    state: str
    models: tuple[str, ...]
    kv_transfer_info: dict[str, Any]
    server_info: dict[str, Any]
    engine_load: int | None
    foreign_load: int = 0  # of engine_load, requests of no process of this gateway (kv_aware weighs them)
    dp_size: int = 1  # --dp-aware: data-parallel ranks the worker reported at registration
    api_key: str | None = None  # the worker's own key (local IPC between the gateway's processes only)


# ------------------------------------------------------------------ leader -> follower
@dataclass(frozen=True, slots=True)
class SyncWorkers:
    """The leader's worker list (mirrored states only), numbered so that drain reports can cite it."""

    workers: tuple[WorkerInfo, ...]
    generation: int


@dataclass(frozen=True, slots=True)
class MetricsQuery:
    """Asks for the follower's request-path metric values; the answer cites `query`."""

    query: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Drain and exit."""


# ------------------------------------------------------------------ follower -> leader
@dataclass(frozen=True, slots=True)
class Ready:
    """The follower listens on the shared port."""


@dataclass(frozen=True, slots=True)
class MetricsReply:
    query: int
    values: Export


@dataclass(frozen=True, slots=True)
class DrainReport:
    """The follower's requests in flight on its draining workers (URL -> count), as of worker list
    `generation`: the leader removes a worker only once every follower has seen it draining."""

    in_flight: dict[str, int]
    generation: int


@dataclass(frozen=True, slots=True)
class Unreachable:
    """The follower met a worker that refuses connections: the leader, which owns worker state, takes it
    out of rotation everywhere (health checks bring it back)."""

    url: str


# ------------------------------------------------------------------ both ways
@dataclass(frozen=True, slots=True)
class IndexBatch:
    """Policy records one process made (`Policy.replicas`), for the others to apply too (the leader
    applies them and passes them on to every other follower)."""

    placements: tuple[PlacementRecord, ...]


ToFollower = SyncWorkers | MetricsQuery | IndexBatch | Stop
ToLeader = Ready | MetricsReply | DrainReport | Unreachable | IndexBatch
Message = ToFollower | ToLeader
