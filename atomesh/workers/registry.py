"""The set of known workers, indexed by id and URL, with cached routable views per role."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from atomesh.workers.worker import Worker, WorkerRole, WorkerState, check_transition

# Called with (worker, old_state, new_state) after every state change, including additions
# (old_state None) and removals (new_state REMOVED).
StateListener = Callable[[Worker, WorkerState | None, WorkerState], None]


class WorkerRegistry:
    """Owns every Worker object; the only place their state changes."""

    def __init__(self) -> None:
        self._by_id: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}
        self._routable: dict[WorkerRole, tuple[Worker, ...]] | None = None
        self._listeners: list[StateListener] = []

    def subscribe(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    # ------------------------------------------------------------------ reads
    def __iter__(self) -> Iterator[Worker]:
        return iter(tuple(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, key: str) -> Worker | None:
        """Find a worker by id or by URL."""
        return self._by_id.get(key) or self._by_url.get(key.rstrip("/"))

    def by_url(self, url: str) -> Worker | None:
        return self._by_url.get(url.rstrip("/"))

    def ready(self, role: WorkerRole) -> tuple[Worker, ...]:
        """Workers of a role in the READY state (breaker not consulted)."""
        if self._routable is None:
            groups: dict[WorkerRole, list[Worker]] = {r: [] for r in WorkerRole}
            for w in self._by_id.values():
                if w.state is WorkerState.READY:
                    groups[w.role].append(w)
            self._routable = {r: tuple(ws) for r, ws in groups.items()}
        return self._routable[role]

    def healthy_count(self, role: WorkerRole) -> int:
        return len(self.ready(role))

    # ------------------------------------------------------------------ writes
    def add(self, worker: Worker) -> None:
        if worker.url in self._by_url:
            raise ValueError(f"worker {worker.url} is already registered")
        self._by_id[worker.id] = worker
        self._by_url[worker.url] = worker
        self._routable = None
        self._notify(worker, None, worker.state)

    def set_state(self, worker: Worker, new: WorkerState) -> None:
        old = worker.state
        if old is new:
            return
        check_transition(old, new)
        worker.state = new
        if new is WorkerState.REMOVED:
            self._by_id.pop(worker.id, None)
            if self._by_url.get(worker.url) is worker:
                del self._by_url[worker.url]
        self._routable = None
        self._notify(worker, old, new)

    def _notify(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        for listener in self._listeners:
            listener(worker, old, new)
