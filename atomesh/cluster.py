"""Several gateway processes on one port (`--processes N`): one leader, N-1 followers.

The kernel spreads incoming connections over every process listening with SO_REUSEPORT, so each one
serves inference requests on its own core. State has one owner:

- The **leader** is the gateway as it runs alone: worker registry and lifecycle, health checks, load
  polling, the admin API and the metrics port. It sends each follower the workers it knows (with
  their state and engine-reported load) whenever that changes, and at least once a second.
- A **follower** mirrors that worker list into a registry of its own and runs the request path on
  it: front door, placement, router, backends, admission (each process gets 1/N of the admission
  limits). Every request that is not a plain inference request (admin, health, models, metrics...)
  is read whole by its front door and passed to the leader's private loopback port, so there is one truth for
  workers and one answer for every other route.
- **Metrics stay whole**: at scrape time the leader asks every follower for its request-path values
  and adds them to its own (gauges and counters summed, histograms bucket by bucket); series that
  describe the registry come from the leader alone.
- **Draining stays sound**: followers report their in-flight requests on draining workers, and the
  leader removes a worker only when no process has a request on it.
- **Placement**: round_robin, random, power_of_two and least_load balance each process's share of
  the traffic (engine-reported loads reach every process); prefix_hash is the same function in every
  process. cache_aware keeps one index per process and every process sends the placements it records
  to the others (batched once per event-loop turn, through the leader), so each index learns from all
  the traffic, a few hundred microseconds late at most.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from atomesh.config import GatewayConfig
from atomesh.metrics import Export
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.workers.worker import Worker, WorkerRole, WorkerState

if TYPE_CHECKING:
    from atomesh.gateway import Gateway

log = structlog.get_logger("atomesh.cluster")

SYNC_SECS = 1.0  # the leader sends the worker list at least this often (it carries engine loads)
DRAIN_REPORT_SECS = 0.05  # followers report in-flight requests on draining workers this often
METRICS_TIMEOUT_SECS = 2.0
RESTART_DELAY_SECS = 1.0
# Worker states a follower mirrors; the others (pending, failed) take no traffic anywhere.
_MIRRORED = (WorkerState.READY, WorkerState.UNHEALTHY, WorkerState.DRAINING)

Conn = multiprocessing.connection.Connection


def describe(w: Worker) -> dict[str, Any]:
    """What a follower needs to know of a worker to route to it."""
    return {"url": w.url, "role": w.role.value, "bootstrap_port": w.bootstrap_port, "state": w.state.value,
            "models": w.models, "kv_transfer_info": w.kv_transfer_info, "server_info": w.server_info,
            "engine_load": w.engine_load}


class Channel:
    """One end of a leader-follower pipe, read from the event loop (messages are small pickles)."""

    def __init__(self, conn: Conn, on_message: Callable[[Any], None], on_eof: Callable[[], None]) -> None:
        self.conn = conn
        self._on_message = on_message
        self._on_eof = on_eof
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._readable)
        self.closed = False

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self._on_message(self.conn.recv())
        except (EOFError, OSError):
            self.close()
            self._on_eof()

    def send(self, message: Any) -> None:
        if not self.closed:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self.conn.fileno())
            self.conn.close()


class IndexSync:
    """Replicates cache-aware placements between processes: what one records, the others record too."""

    def __init__(self, gw: Gateway, send: Callable[[Any], None]) -> None:
        self.gw = gw
        self.send = send
        self.outbox: list[tuple[str, str, list[int]]] = []
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
            self.send(("index", batch))

    def apply(self, batch: list[tuple[str, str, list[int]]]) -> None:
        for role, url, hashes in batch:
            policy = self.policies.get(role)
            worker = self.gw.registry.by_url(url)
            if policy is not None and worker is not None and worker.state is not WorkerState.DRAINING:
                policy.record(worker, hashes)


# ---------------------------------------------------------------------------------------- leader side
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


class Cluster:
    """Starts the followers, keeps them in sync with the leader's registry, stops them."""

    def __init__(self, config: GatewayConfig, gateway: Gateway) -> None:
        self.config = config
        self.gateway = gateway
        self.private_port = 0  # the leader's loopback port for what followers do not serve (start())
        self.followers = [_Follower(i) for i in range(1, config.processes)]
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._sync_scheduled = False
        self._next_query = 0
        self._generation = 0  # of the worker list sent
        self._drained_at: dict[str, int] = {}  # draining worker URL -> first generation that says so
        gateway.registry.subscribe(self._on_worker_state)
        self.index = IndexSync(gateway, lambda message: self._broadcast(message))

    def _broadcast(self, message: Any, skip: _Follower | None = None) -> None:
        for f in self.followers:
            if f is not skip and f.channel is not None:
                f.channel.send(message)

    async def start(self, private_port: int, timeout: float = 60.0) -> None:
        """Start every follower and wait until each one listens."""
        self.private_port = private_port
        for f in self.followers:
            self._spawn(f)
        try:
            await asyncio.wait_for(asyncio.gather(*(f.ready.wait() for f in self.followers)), timeout)
        except TimeoutError:
            raise RuntimeError(f"gateway processes did not start within {timeout:g}s") from None
        self._keep(self._heartbeat())
        log.info("processes_started", processes=self.config.processes)

    def _spawn(self, f: _Follower) -> None:
        ours, theirs = self._ctx.Pipe()
        f.ready.clear()
        f.process = self._ctx.Process(target=follower_main, name=f"atomesh-{f.index}", daemon=True,
                                      args=(self.config.model_dump(mode="json"), f.index, self.private_port, theirs,
                                            self.gateway.instance_id))
        f.process.start()
        theirs.close()
        f.channel = Channel(ours, lambda m: self._on_message(f, m), lambda: self._on_exit(f))
        f.synced = 0
        f.channel.send(("workers", self._workers(), self._generation))

    def _keep(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_message(self, f: _Follower, message: Any) -> None:
        kind = message[0]
        if kind == "ready":
            f.ready.set()
            log.info("process_ready", process=f.index, pid=f.process.pid if f.process is not None else None)
        elif kind == "metrics":
            waiter = f.metrics_waiters.pop(message[1], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message[2])
        elif kind == "draining":
            f.draining, f.synced = message[1], message[2]
            self._count_remote_in_flight()
        elif kind == "index":
            self.index.apply(message[1])
            self._broadcast(message, skip=f)
        elif kind == "unreachable":
            worker = self.gateway.registry.by_url(message[1])
            if worker is not None:
                self.gateway.mark_unreachable(worker)

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
            self._keep(self._restart(f))

    async def _restart(self, f: _Follower) -> None:
        if f.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, f.process.join, 5)
        await asyncio.sleep(RESTART_DELAY_SECS)
        if not self._stopping:
            self._spawn(f)

    def _on_worker_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if new is WorkerState.DRAINING:
            self._drained_at[worker.url] = self._generation + 1
            # Until every follower has seen the change and reported, count one request per follower.
            worker.remote_in_flight = sum(1 for f in self.followers if self._alive(f))
        elif new is WorkerState.REMOVED:
            self._drained_at.pop(worker.url, None)
        self.schedule_sync()

    @staticmethod
    def _alive(f: _Follower) -> bool:
        return f.channel is not None and not f.channel.closed

    def _count_remote_in_flight(self) -> None:
        """Requests other processes have on each draining worker (one for a follower not caught up yet)."""
        for w in self.gateway.registry:
            since = self._drained_at.get(w.url)
            if since is None:
                continue
            total = 0
            for f in self.followers:
                if self._alive(f):
                    total += f.draining.get(w.url, 0) if f.synced >= since else 1
            w.remote_in_flight = total

    # ------------------------------------------------------------------ worker sync
    def _workers(self) -> list[dict[str, Any]]:
        return [describe(w) for w in self.gateway.registry if w.state in _MIRRORED]

    def schedule_sync(self) -> None:
        """Send the worker list soon (changes arriving together go in one message)."""
        if not self._sync_scheduled:
            self._sync_scheduled = True
            asyncio.get_running_loop().call_soon(self._sync)

    def _sync(self) -> None:
        self._sync_scheduled = False
        self._generation += 1
        workers = self._workers()
        for f in self.followers:
            if f.channel is not None:
                f.channel.send(("workers", workers, self._generation))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(SYNC_SECS)
            self._sync()

    # ------------------------------------------------------------------ metrics
    async def metrics(self) -> list[Export]:
        """Every follower's request-path metric values (a follower that does not answer is left out)."""
        loop = asyncio.get_running_loop()
        waiters = []
        for f in self.followers:
            if f.channel is None or f.channel.closed:
                continue
            self._next_query += 1
            fut: asyncio.Future[Export] = loop.create_future()
            f.metrics_waiters[self._next_query] = fut
            f.channel.send(("metrics?", self._next_query))
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
        for task in list(self._tasks):
            task.cancel()
        for f in self.followers:
            if f.channel is not None:
                f.channel.send(("stop",))
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


# ---------------------------------------------------------------------------------------- follower side
def follower_main(config_data: dict[str, Any], index: int, private_port: int, conn: Conn,
                  instance_id: str) -> None:
    """Entry point of a follower process."""
    import uvloop

    from atomesh.logs import setup_logging

    config = GatewayConfig.model_validate(config_data)
    setup_logging(config.log_level.value, config.json_log, config.log_dir, log_file=f"atomesh-{index}.log")
    structlog.contextvars.bind_contextvars(process=index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the leader, which stops us in order
    uvloop.run(_follow(config, index, private_port, conn, instance_id))


async def _follow(config: GatewayConfig, index: int, private_port: int, conn: Conn, instance_id: str) -> None:
    from atomesh.app import FollowerServer, tune_gc

    server = FollowerServer(config, private_port, instance_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    gw = server.gateway
    synced = [0]  # the generation of the worker list applied last
    has_workers = asyncio.Event()

    def on_message(message: Any) -> None:
        kind = message[0]
        if kind == "workers":
            mirror(gw, message[1])
            synced[0] = message[2]
            has_workers.set()
            _send_draining(gw, channel, synced[0])  # the leader waits for this before removing a worker
        elif kind == "metrics?":
            gw.sync_metrics()
            channel.send(("metrics", message[1], gw.metrics.export()))
        elif kind == "index":
            placements.apply(message[1])
        elif kind == "stop":
            stop.set()

    channel = Channel(conn, on_message, stop.set)  # the leader gone: stop too

    def unreachable(worker: Worker) -> None:
        gw.mark_unreachable(worker)  # out of this process's rotation now,
        channel.send(("unreachable", worker.url))  # and of every process's once the leader, its owner, says so

    gw.router.on_unreachable = unreachable
    placements = IndexSync(gw, channel.send)
    # Listen only once the worker list is in (no 503 for want of it), unless told to stop first.
    waits = [asyncio.ensure_future(has_workers.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if stop.is_set():
        channel.close()
        return
    await server.listen()
    tune_gc()
    channel.send(("ready",))
    reporter = asyncio.ensure_future(_report_draining(gw, channel, synced))
    await stop.wait()
    reporter.cancel()
    await server.shutdown()
    _send_draining(gw, channel, synced[0])
    channel.close()


def mirror(gw: Gateway, workers: list[dict[str, Any]]) -> None:
    """Make a follower's registry match the leader's worker list."""
    registry = gw.registry
    seen = set()
    for d in workers:
        seen.add(d["url"])
        state = WorkerState(d["state"])
        w = registry.by_url(d["url"])
        if w is None:
            w = gw.lifecycle.mirror(d["url"], WorkerRole(d["role"]), d["bootstrap_port"])
        w.models = tuple(d["models"])
        w.kv_transfer_info = d["kv_transfer_info"]
        w.server_info = d["server_info"]
        w.engine_load = d["engine_load"]
        if w.state is not state and w.state is not WorkerState.DRAINING:
            if w.state is WorkerState.PENDING and state is WorkerState.UNHEALTHY:
                registry.set_state(w, WorkerState.READY)  # a pending worker cannot go straight to unhealthy
            registry.set_state(w, state)
    for w in registry:
        if w.url not in seen:
            if w.state is not WorkerState.DRAINING:
                registry.set_state(w, WorkerState.DRAINING)
            registry.set_state(w, WorkerState.REMOVED)  # requests still on it finish on the Worker object
    gw.refresh_served_models()


def _draining(gw: Gateway) -> dict[str, int]:
    """This process's requests on its draining workers, by URL."""
    out: dict[str, int] = {}
    for w in gw.registry:
        if w.state is not WorkerState.DRAINING:
            continue
        if w.in_flight:
            out[w.url] = out.get(w.url, 0) + w.in_flight
    return out


def _send_draining(gw: Gateway, channel: Channel, synced: int) -> None:
    channel.send(("draining", _draining(gw), synced))


async def _report_draining(gw: Gateway, channel: Channel, synced: list[int]) -> None:
    last: dict[str, int] = {}
    while True:
        await asyncio.sleep(DRAIN_REPORT_SECS)
        draining = _draining(gw)
        if draining != last:
            last = draining
            channel.send(("draining", draining, synced[0]))
