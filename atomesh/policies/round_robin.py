"""`round_robin`: each request goes to the next routable worker in turn."""

from __future__ import annotations

from collections.abc import Sequence

from atomesh.policies.base import Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class RoundRobinPolicy(Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker:
        worker = candidates[self._next % len(candidates)]
        self._next = (self._next + 1) % (1 << 30)
        return worker
