"""Worker mirroring: the leader describes its workers, a follower makes its registry match."""

from __future__ import annotations

from atomesh.cluster.messages import WorkerInfo
from atomesh.gateway import Gateway
from atomesh.workers.worker import Worker, WorkerRole, WorkerState

# Worker states a follower mirrors; the others (pending, failed) take no traffic anywhere.
MIRRORED = (WorkerState.READY, WorkerState.UNHEALTHY, WorkerState.DRAINING)


def describe(w: Worker) -> WorkerInfo:
    return WorkerInfo(
        url=w.url,
        role=w.role.value,
        bootstrap_port=w.bootstrap_port,
        state=w.state.value,
        models=w.models,
        kv_transfer_info=w.kv_transfer_info,
        server_info=w.server_info,
        engine_load=w.engine_load,
        foreign_load=w.foreign_load,
        dp_size=w.dp_size,
        api_key=w.api_key,
    )


def mirrored_workers(gw: Gateway) -> tuple[WorkerInfo, ...]:
    """The leader's workers that followers route to (or still drain)."""
    return tuple(describe(w) for w in gw.registry if w.state in MIRRORED)


def mirror(gw: Gateway, workers: tuple[WorkerInfo, ...]) -> None:
    """Make a follower's registry match the leader's worker list."""
    registry = gw.registry
    seen = set()
    for d in workers:
        seen.add(d.url)
        state = WorkerState(d.state)
        w = registry.by_url(d.url)
        if w is None:
            w = gw.lifecycle.mirror(d.url, WorkerRole(d.role), d.bootstrap_port, d.api_key)
        w.models = tuple(d.models)
        w.kv_transfer_info = d.kv_transfer_info
        w.server_info = d.server_info
        w.engine_load = d.engine_load
        w.foreign_load = d.foreign_load
        if w.dp_size != d.dp_size:  # --dp-aware: the ranks the leader read at registration
            w.dp_size = d.dp_size
            w.rank_in_flight = [0] * w.dp_size
        if w.state is not state and w.state is not WorkerState.DRAINING:
            if w.state is WorkerState.PENDING and state is WorkerState.UNHEALTHY:
                registry.set_state(w, WorkerState.READY)  # a pending worker cannot go straight to unhealthy
            registry.set_state(w, state)
    for w in registry:
        if w.url not in seen:
            if w.state is not WorkerState.DRAINING:
                registry.set_state(w, WorkerState.DRAINING)
            registry.set_state(w, WorkerState.REMOVED)  # requests still on it finish on the Worker object
    gw.refresh_served_models()
