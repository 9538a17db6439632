"""What the leader and its followers say to each other: one frozen dataclass per message.

Messages cross a `multiprocessing` pipe as pickles; each side dispatches on the class with `match`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atomesh.metrics import Export

# One cache-aware placement to replicate: (worker role, worker URL, the prompt's chained prefix hashes).
# A tuple, not a class: one is made per placement on the request path.
PlacementRecord = tuple[str, str, list[int]]


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
    """Cache-aware placements one process recorded, for the others to record too (the leader
    records them and passes them on to every other follower)."""

    placements: tuple[PlacementRecord, ...]


ToFollower = SyncWorkers | MetricsQuery | IndexBatch | Stop
ToLeader = Ready | MetricsReply | DrainReport | Unreachable | IndexBatch
Message = ToFollower | ToLeader
