"""`round_robin`: each request goes to the next routable worker in turn."""

from __future__ import annotations

from collections.abc import Sequence

from atomesh.config import PolicyName
from atomesh.policies.base import Decision, Loads, Needs, Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class RoundRobinPolicy(Stateless):
    needs = Needs(loads=Loads.UNUSED)
    name = PolicyName.ROUND_ROBIN

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        worker = candidates[self._next % len(candidates)]
        self._next = (self._next + 1) % (1 << 30)
        return Decision(worker, "turn")
