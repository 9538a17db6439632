"""Policy state replicated between processes: what one process records, the others record too.

Which state that is each policy says (`Policy.replicas`: cache_aware's prefix index, kv_aware's
in-flight placements); this module only carries the records, batched once per event-loop turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from atomesh.cluster.messages import IndexBatch, PlacementRecord
from atomesh.gateway import Gateway
from atomesh.policies import Replica


class IndexSync:
    """Collects this process's policy records (sent once per event-loop turn) and applies other
    processes' records to this process's policies."""

    def __init__(self, gw: Gateway, send: Callable[[IndexBatch], None]) -> None:
        self.gw = gw
        self.send = send
        self.outbox: list[PlacementRecord] = []
        self.replicas: dict[str, Replica] = {}
        for role, policy in gw.placement.policies.items():
            for name, replica in policy.replicas().items():
                key = f"{role.value}/{name}"
                self.replicas[key] = replica
                replica.connect(self._publisher(key))

    def _publisher(self, key: str) -> Callable[[Any], None]:
        def publish(record: Any) -> None:
            if not self.outbox:
                asyncio.get_running_loop().call_soon(self.flush)
            self.outbox.append((key, record))

        return publish

    def flush(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.send(IndexBatch(tuple(batch)))

    def apply(self, batch: IndexBatch) -> None:
        registry = self.gw.registry
        for key, record in batch.placements:
            replica = self.replicas.get(key)
            if replica is not None:
                replica.apply(record, registry)
