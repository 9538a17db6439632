"""The leader's side of `--processes N`: starts the followers, restarts one that dies, keeps their
worker lists in sync, gathers their metrics, counts their requests on draining workers, stops them."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Coroutine
from typing import Any

import structlog

from atomesh.cluster.channel import Channel, unexpected
from atomesh.cluster.follower import follower_main
from atomesh.cluster.index import IndexSync
from atomesh.cluster.messages import (
    DrainReport,
    IndexBatch,
    Message,
    MetricsQuery,
    MetricsReply,
    Ready,
    Stop,
    SyncWorkers,
    ToFollower,
    Unreachable,
)
from atomesh.cluster.mirror import mirrored_workers
from atomesh.config import GatewayConfig
from atomesh.gateway import Gateway
from atomesh.metrics import Export
from atomesh.tasks import PeriodicTask
from atomesh.workers.worker import Worker, WorkerState

log = structlog.get_logger("atomesh.cluster")

SYNC_SECS = 1.0  # the leader sends the worker list at least this often (it carries engine loads)
METRICS_TIMEOUT_SECS = 2.0
RESTART_DELAY_SECS = 1.0


class _Follower:
    """The leader's handle on one follower process."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: multiprocessing.process.BaseProcess | None = None
        self.channel: Channel | None = None
        self.ready = asyncio.Event()
        self.metrics_waiters: dict[int, asyncio.Future[Export]] = {}
        self.draining: dict[str, int] = {}  # worker URL -> its requests in flight in this follower
        self.synced = 0  # the last worker-list generation it applied

    @property
    def alive(self) -> bool:
        return self.channel is not None and not self.channel.closed


class Cluster:
    """Starts the followers, keeps them in sync with the leader's registry, stops them."""

    def __init__(self, config: GatewayConfig, gateway: Gateway) -> None:
        self.config = config
        self.gateway = gateway
        self.private_port = 0  # the leader's loopback port for what followers do not serve (start())
        self.followers = [_Follower(i) for i in range(1, config.processes)]
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = False
        self._heartbeat = PeriodicTask("cluster-heartbeat", SYNC_SECS, self._sync)
        self._restarts: set[asyncio.Task[None]] = set()
        self._sync_scheduled = False
        self._next_query = 0
        self._generation = 0  # of the worker list sent
        self._drained_at: dict[str, int] = {}  # draining worker URL -> first generation that says so
        gateway.registry.subscribe(self._on_worker_state)
        self.index = IndexSync(gateway, self._broadcast)

    def _broadcast(self, message: ToFollower, skip: _Follower | None = None) -> None:
        for f in self.followers:
            if f is not skip and f.channel is not None:
                f.channel.send(message)

    # ------------------------------------------------------------------ supervision
    async def start(self, private_port: int, timeout: float = 60.0) -> None:
        """Start every follower and wait until each one listens."""
        self.private_port = private_port
        for f in self.followers:
            self._spawn(f)
        try:
            await asyncio.wait_for(asyncio.gather(*(f.ready.wait() for f in self.followers)), timeout)
        except TimeoutError:
            raise RuntimeError(f"gateway processes did not start within {timeout:g}s") from None
        self._heartbeat.start()
        log.info("processes_started", processes=self.config.processes)

    def _spawn(self, f: _Follower) -> None:
        ours, theirs = self._ctx.Pipe()
        f.ready.clear()
        f.process = self._ctx.Process(
            target=follower_main,
            name=f"atomesh-{f.index}",
            daemon=True,
            args=(self.config.model_dump(mode="json"), f.index, self.private_port, theirs, self.gateway.instance_id),
        )
        f.process.start()
        theirs.close()
        f.channel = Channel(ours, lambda m: self._on_message(f, m), lambda: self._on_exit(f))
        f.synced = 0
        f.channel.send(SyncWorkers(mirrored_workers(self.gateway), self._generation))

    def _on_message(self, f: _Follower, message: Message) -> None:
        match message:
            case Ready():
                f.ready.set()
                log.info("process_ready", process=f.index, pid=f.process.pid if f.process is not None else None)
            case MetricsReply(query, values):
                waiter = f.metrics_waiters.pop(query, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(values)
            case DrainReport(in_flight, generation):
                f.draining, f.synced = in_flight, generation
                self._count_remote_in_flight()
            case Unreachable(url):
                worker = self.gateway.registry.by_url(url)
                if worker is not None:
                    self.gateway.mark_unreachable(worker)
            case IndexBatch():
                self.index.apply(message)
                self._broadcast(message, skip=f)
            case _:
                unexpected(message, "leader")

    def _on_exit(self, f: _Follower) -> None:
        f.draining = {}
        if f.channel is not None:
            f.channel.close()
        self._count_remote_in_flight()
        for waiter in f.metrics_waiters.values():
            if not waiter.done():
                waiter.cancel()
        f.metrics_waiters.clear()
        if not self._stopping:
            code = f.process.exitcode if f.process is not None else None
            log.error("process_exited", process=f.index, exit_code=code, restart_in_secs=RESTART_DELAY_SECS)
            self._own(self._restart(f))

    def _own(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, f: _Follower) -> None:
        if f.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, f.process.join, 5)
        await asyncio.sleep(RESTART_DELAY_SECS)
        if not self._stopping:
            self._spawn(f)

    # ------------------------------------------------------------------ draining workers
    def _on_worker_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if new is WorkerState.DRAINING:
            self._drained_at[worker.url] = self._generation + 1
            # Until every follower has seen the change and reported, count one request per follower.
            worker.remote_in_flight = sum(1 for f in self.followers if f.alive)
        elif new is WorkerState.REMOVED:
            self._drained_at.pop(worker.url, None)
        self.schedule_sync()

    def _count_remote_in_flight(self) -> None:
        """Requests other processes have on each draining worker (one for a follower not caught up yet)."""
        for w in self.gateway.registry:
            since = self._drained_at.get(w.url)
            if since is None:
                continue
            total = 0
            for f in self.followers:
                if f.alive:
                    total += f.draining.get(w.url, 0) if f.synced >= since else 1
            w.remote_in_flight = total
            if w.on_release is not None:
                w.on_release(w)  # whoever waits for the drain looks again

    # ------------------------------------------------------------------ worker sync
    def schedule_sync(self) -> None:
        """Send the worker list soon (changes arriving together go in one message)."""
        if not self._sync_scheduled:
            self._sync_scheduled = True
            asyncio.get_running_loop().call_soon(self._sync)

    def _sync(self) -> None:
        self._sync_scheduled = False
        self._generation += 1
        self._broadcast(SyncWorkers(mirrored_workers(self.gateway), self._generation))

    # ------------------------------------------------------------------ metrics
    async def metrics(self) -> list[Export]:
        """Every follower's request-path metric values (a follower that does not answer is left out)."""
        loop = asyncio.get_running_loop()
        waiters = []
        for f in self.followers:
            if f.channel is None or not f.alive:
                continue
            self._next_query += 1
            fut: asyncio.Future[Export] = loop.create_future()
            f.metrics_waiters[self._next_query] = fut
            f.channel.send(MetricsQuery(self._next_query))
            waiters.append(fut)
        if not waiters:
            return []
        done, pending = await asyncio.wait(waiters, timeout=METRICS_TIMEOUT_SECS)
        for fut in pending:
            fut.cancel()
        if pending:
            log.warning("metrics_incomplete", missing_processes=len(pending))
        return [fut.result() for fut in done if not fut.cancelled()]

    # ------------------------------------------------------------------ stop
    async def stop(self, grace: float) -> None:
        """Ask every follower to drain and exit; kill those still running after `grace` (+5 s). Once."""
        if self._stopping:
            return
        self._stopping = True
        await self._heartbeat.stop()
        restarts = list(self._restarts)
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        self._broadcast(Stop())
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + grace + 5.0
        for f in self.followers:
            if f.process is None:
                continue
            await loop.run_in_executor(None, f.process.join, max(0.1, deadline - time.monotonic()))
            if f.process.is_alive():
                log.error("process_killed", process=f.index)
                f.process.kill()
                await loop.run_in_executor(None, f.process.join, 5)
            if f.channel is not None:
                f.channel.close()
