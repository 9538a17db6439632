"""`passthrough` (SMG): every request goes to the first routable worker, for one-worker gateways.

Neither load- nor cache-aware, so nothing is polled or indexed for it. With several workers only the
first (in registration order) gets traffic, which is said once in the log, as SMG does.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from atomesh.config import PolicyName
from atomesh.policies.base import Decision, Loads, Needs, Stateless
from atomesh.request import RequestView
from atomesh.workers.worker import Worker

log = structlog.get_logger("atomesh.policies")


class PassthroughPolicy(Stateless):
    needs = Needs(loads=Loads.UNUSED)
    name = PolicyName.PASSTHROUGH

    def __init__(self) -> None:
        self._warned = False

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        if not self._warned:
            self._warned = True
            log.warning(
                "passthrough_several_workers",
                workers=len(candidates),
                detail="passthrough is meant for one worker; only the first routable one gets traffic",
            )
        return Decision(candidates[0], "first_routable")
