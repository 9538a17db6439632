"""`power_of_two`: two distinct random candidates, the lighter one (`Worker.load`) wins."""

from __future__ import annotations

import random
from collections.abc import Sequence

from atomesh.policies.base import Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class PowerOfTwoPolicy(Stateless):
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Worker:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        # Ties go to the first draw, which is itself random: no worker is favoured.
        return b if b.load < a.load else a
