"""`least_load`: the worker with the lowest `Worker.load` (in-flight, or polled engine load if higher)."""

from __future__ import annotations

from collections.abc import Sequence

from atomesh.policies.base import Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class LeastLoadPolicy(Stateless):
    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker:
        # Scan from a rotating start so that ties (an idle fleet) are spread, not sent to the first worker.
        n = len(candidates)
        start = self._turn % n
        self._turn = (self._turn + 1) % (1 << 30)
        best = candidates[start]
        best_load = best.load
        for k in range(1, n):
            w = candidates[(start + k) % n]
            load = w.load
            if load < best_load:
                best, best_load = w, load
        return best
