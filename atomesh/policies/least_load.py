"""`least_load`: the worker with the lowest `Worker.load` (in-flight, or polled engine load if higher)."""

from __future__ import annotations

from collections.abc import Sequence

from atomesh.config import PolicyName
from atomesh.policies.base import Decision, Stateless, least_loaded
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class LeastLoadPolicy(Stateless):
    name = PolicyName.LEAST_LOAD

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        # Scan from a rotating start so that ties (an idle fleet) are spread, not sent to the first worker.
        start = self._turn % len(candidates)
        self._turn = (self._turn + 1) % (1 << 30)
        return Decision(least_loaded(candidates, start), "least_loaded")
