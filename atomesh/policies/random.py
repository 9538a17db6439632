"""`random`: uniform choice among routable workers."""

from __future__ import annotations

import random
from collections.abc import Sequence

from atomesh.policies.base import Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class RandomPolicy(Stateless):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker:
        return candidates[self._rng.randrange(len(candidates))]
