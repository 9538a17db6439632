"""Cache-aware index replication: what one process records, the others record too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from atomesh.cluster.messages import IndexBatch, PlacementRecord
from atomesh.gateway import Gateway
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.workers.worker import Worker, WorkerState


class IndexSync:
    """Collects this process's cache-aware placements (sent once per event-loop turn) and records
    other processes' placements in this process's indexes."""

    def __init__(self, gw: Gateway, send: Callable[[IndexBatch], None]) -> None:
        self.gw = gw
        self.send = send
        self.outbox: list[PlacementRecord] = []
        self.policies: dict[str, CacheAwarePolicy] = {}
        for role, policy in gw.placement.policies.items():
            if isinstance(policy, CacheAwarePolicy):
                self.policies[role.value] = policy
                policy.publish = self._publisher(role.value)

    def _publisher(self, role: str) -> Callable[[Worker, list[int]], None]:
        def publish(worker: Worker, hashes: list[int]) -> None:
            if not self.outbox:
                asyncio.get_running_loop().call_soon(self.flush)
            self.outbox.append((role, worker.url, hashes))
        return publish

    def flush(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.send(IndexBatch(tuple(batch)))

    def apply(self, batch: IndexBatch) -> None:
        for role, url, hashes in batch.placements:
            policy = self.policies.get(role)
            worker = self.gw.registry.by_url(url)
            if policy is not None and worker is not None and worker.state is not WorkerState.DRAINING:
                policy.record(worker, hashes)
