"""Engine load poller: reads each ready worker's queue depth into `Worker.engine_load`.

Our own in-flight count only sees requests sent through this gateway; an engine shared with other
clients (or another gateway replica) is busier than that. Every `interval` seconds one task scrapes
each ready worker's Prometheus `/metrics` and sums the running and waiting request gauges of the
engine families we know (ATOM, SGLang, vLLM). A worker that does not answer within `timeout`, or
exports none of those gauges, gets `engine_load = None`, so policies fall back to in-flight counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from atomesh.errors import GatewayError
from atomesh.tasks import PeriodicTask
from atomesh.transport import Upstream
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole

log = structlog.get_logger("atomesh.load")

# Per engine family, the gauges whose sum is its load (running + queued requests). An engine that
# exports several families (a compatibility shim) is read through the first one found.
LOAD_GAUGES: tuple[tuple[str, str], ...] = (
    ("atom:requests_running", "atom:requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
)


def parse_load(text: str, families: tuple[tuple[str, str], ...] = LOAD_GAUGES) -> int | None:
    """Sum one family's load gauges (over all label sets) in a Prometheus text exposition; None if absent."""
    wanted = {name for family in families for name in family}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < name_end:
                name_end = i
        name = line[:name_end]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1 :] if line[name_end : name_end + 1] == "{" else line[name_end:]
        try:
            values[name] = values.get(name, 0.0) + float(rest.split()[0])  # `value [timestamp]`
        except (ValueError, IndexError):
            continue
    for family in families:
        if any(n in values for n in family):
            return int(sum(values.get(n, 0.0) for n in family))
    return None


class LoadPoller:
    """Owns one task that polls every ready worker's engine load."""

    def __init__(
        self,
        registry: WorkerRegistry,
        upstream: Upstream,
        interval: float = 1.0,
        timeout: float = 0.5,
        path: str = "/metrics",
        elsewhere: Callable[[Worker], int] | None = None,
    ) -> None:
        self.registry = registry
        # Requests on a worker that other gateway replicas or this gateway's other processes said they
        # have in flight (the pool's policy knows: Policy.elsewhere): known exactly, so not "foreign" either.
        self.elsewhere = elsewhere
        self.upstream = upstream
        self.interval = interval
        self.timeout = timeout
        self.path = path
        self._task = PeriodicTask("load-poller", interval, self.poll_once, first_delay=0.0)

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def poll_once(self) -> None:
        workers = [w for role in WorkerRole for w in self.registry.ready(role)]
        await asyncio.gather(*(self._poll(w) for w in workers))

    async def _poll(self, worker: Worker) -> None:
        elsewhere = self.elsewhere
        mine = worker.in_flight
        theirs = elsewhere(worker) if elsewhere is not None else 0
        try:
            status, body, _ = await self.upstream.call(
                "GET", worker.url + self.path, timeout=self.timeout, headers=self.upstream.worker_headers(worker)
            )
            text = body.decode() if status == 200 else ""
        except (GatewayError, UnicodeDecodeError):
            text = ""
        worker.engine_load = parse_load(text) if text else None
        # What the engine runs beyond this gateway's own requests (other replicas, other clients):
        # ours are counted at their most during the scrape, so ours never pass for others; so are
        # those the synced replicas reported.
        mine = max(mine, worker.in_flight)
        if elsewhere is not None:
            mine += max(theirs, elsewhere(worker))
        worker.foreign_load = max(0, worker.engine_load - mine) if worker.engine_load is not None else 0
