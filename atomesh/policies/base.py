"""The one seam every placement policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class Policy(Protocol):
    """Chooses one worker among routable candidates for a request.

    `select` is called with a non-empty candidate list. The hooks let stateful policies (cache-aware,
    prefix-hash) keep their indexes in step with the traffic and the worker set.
    """

    name: str

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker: ...

    def on_placed(self, worker: Worker, view: RequestView) -> None: ...

    def on_worker_removed(self, worker: Worker) -> None: ...
