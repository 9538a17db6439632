"""The one seam every placement policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class Policy(Protocol):
    """Chooses one worker among routable candidates for a request.

    `select` is called with a non-empty candidate list. The hooks let stateful policies (cache-aware,
    prefix-hash) keep their indexes in step with the traffic and the worker set: `on_placed` runs
    after every placement (also when placement skipped `select` because one candidate was left),
    `on_worker_removed` when a worker leaves the registry. `start` / `stop` own any background task
    (cache-aware eviction); stateless policies make them no-ops. Placement takes a lone candidate
    without asking, unless the policy has `select_single = True` (it may refuse that candidate).
    """

    name: str

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker: ...

    def on_placed(self, worker: Worker, view: RequestView) -> None: ...

    def on_worker_removed(self, worker: Worker) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Stateless:
    """No-op hooks for policies that keep no state between requests."""

    def on_placed(self, worker: Worker, view: RequestView) -> None:
        pass

    def on_worker_removed(self, worker: Worker) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
