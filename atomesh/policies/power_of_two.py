"""`power_of_two`: two distinct random candidates, the lighter one (`Worker.load`) wins."""

from __future__ import annotations

import random
from collections.abc import Sequence

from atomesh.config import PolicyName
from atomesh.policies.base import ONLY_CANDIDATE, Decision, Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker


class PowerOfTwoPolicy(Stateless):
    name = PolicyName.POWER_OF_TWO

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        n = len(candidates)
        if n == 1:
            return Decision(candidates[0], ONLY_CANDIDATE)
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        # One comparison, not a scan (`least_loaded` would cost more than the rest of this policy).
        # Ties go to the first draw, which is itself random: no worker is favoured.
        return Decision(b if b.load < a.load else a, "lighter_of_two")
