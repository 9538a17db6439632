"""`random`: uniform choice among routable workers."""

from __future__ import annotations

import random
from collections.abc import Sequence

from atomesh.config import PolicyName
from atomesh.policies.base import Decision, Loads, Needs, Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class RandomPolicy(Stateless):
    needs = Needs(loads=Loads.UNUSED)
    name = PolicyName.RANDOM

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        return Decision(candidates[self._rng.randrange(len(candidates))], "random")
