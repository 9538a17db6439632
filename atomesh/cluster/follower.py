"""A follower process: the request path on a mirror of the leader's workers.

It serves inference on the shared port and passes every other request to the leader's private
port; it mirrors the worker list the leader sends, answers metric queries, replicates policy state
(cache_aware, kv_aware) and reports its requests on draining workers whenever they change.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import structlog

from atomesh.api.middleware import HttpAccounting
from atomesh.cluster.channel import Channel, Conn, unexpected
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
    Unreachable,
)
from atomesh.cluster.mirror import mirror
from atomesh.config import GatewayConfig
from atomesh.frontdoor import FrontDoor, Relay
from atomesh.gateway import Gateway
from atomesh.logs import AccessLog
from atomesh.service import ssl_context, tune_gc
from atomesh.workers.worker import Worker, WorkerState


class FollowerServer:
    """A follower process's server: the front door on the shared port; every request it does not
    serve itself goes to the leader's private service port."""

    def __init__(self, config: GatewayConfig, leader_port: int, instance_id: str) -> None:
        self.config = config
        self.gateway = Gateway(config, instance_id)
        accounting = self.accounting = HttpAccounting(
            config.request_id_headers,
            self.gateway.metrics,
            config.max_payload_size,
            self.gateway.instance_id,
            config.access_log_sample_rate,
            AccessLog(),
        )
        self.door = FrontDoor(self.gateway, accounting)
        self.leader_port = leader_port

    async def listen(self) -> None:
        cfg = self.config
        await self.gateway.start()
        self.door.relay = Relay(self.gateway.upstream, self.leader_port, cfg.request_timeout_secs)
        await self.door.start(cfg.host, cfg.port, ssl_context(cfg), reuse_port=True)
        self.gateway.placement.start()

    async def shutdown(self) -> None:
        await self.gateway.drain_requests(self.config.shutdown_grace_period_secs)
        await self.door.close()
        await self.gateway.stop()
        self.accounting.close()


def draining_in_flight(gw: Gateway) -> dict[str, int]:
    """This process's requests on its draining workers, by URL."""
    out: dict[str, int] = {}
    for w in gw.registry:
        if w.state is WorkerState.DRAINING and w.in_flight:
            out[w.url] = out.get(w.url, 0) + w.in_flight
    return out


class Follower:
    """One follower's side of the pipe: applies what the leader sends, reports what it asks for."""

    def __init__(self, server: FollowerServer, conn: Conn) -> None:
        self.server = server
        self.gw = server.gateway
        self.stopping = asyncio.Event()
        self.has_workers = asyncio.Event()
        self.synced = 0  # the generation of the worker list applied last
        self._reported: dict[str, int] | None = None  # the last drain report sent
        self._report_scheduled = False
        self.channel = Channel(conn, self._on_message, self.stopping.set)  # the leader gone: stop too
        self.index = IndexSync(self.gw, self.channel.send)
        self.gw.registry.subscribe(self._on_worker_state)
        self.gw.router.on_unreachable = self._unreachable

    def _unreachable(self, worker: Worker) -> None:
        self.gw.mark_unreachable(worker)  # out of this process's rotation now,
        self.channel.send(Unreachable(worker.url))  # and of every process's once the leader, its owner, says so

    def _on_message(self, message: Message) -> None:
        match message:
            case SyncWorkers(workers, generation):
                mirror(self.gw, workers)
                self.synced = generation
                self.has_workers.set()
                self.report_draining()  # the leader waits for this before removing a worker
            case MetricsQuery(query):
                self.gw.sync_metrics()
                self.channel.send(MetricsReply(query, self.gw.metrics.export()))
            case IndexBatch():
                self.index.apply(message)
            case Stop():
                self.stopping.set()
            case _:
                unexpected(message, "follower")

    # ------------------------------------------------------------------ drain reports
    def _on_worker_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if new is WorkerState.DRAINING:
            worker.on_release = self._request_ended
        elif new is WorkerState.REMOVED:
            worker.on_release = None

    def _request_ended(self, worker: Worker) -> None:
        """A request on a draining worker ended: report the new counts (once per event-loop turn)."""
        if not self._report_scheduled:
            self._report_scheduled = True
            asyncio.get_running_loop().call_soon(self._report_if_changed)

    def _report_if_changed(self) -> None:
        self._report_scheduled = False
        if draining_in_flight(self.gw) != self._reported:
            self.report_draining()

    def report_draining(self) -> None:
        self._reported = draining_in_flight(self.gw)
        self.channel.send(DrainReport(self._reported, self.synced))

    # ------------------------------------------------------------------ run
    async def run(self) -> None:
        # Listen only once the worker list is in (no 503 for want of it), unless told to stop first.
        waits = [asyncio.ensure_future(self.has_workers.wait()), asyncio.ensure_future(self.stopping.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        if self.stopping.is_set():
            self.channel.close()
            return
        await self.server.listen()
        tune_gc()
        self.channel.send(Ready())
        await self.stopping.wait()
        await self.server.shutdown()
        self.report_draining()
        self.channel.close()


def follower_main(config_data: dict[str, Any], index: int, private_port: int, conn: Conn, instance_id: str) -> None:
    """Entry point of a follower process."""
    import uvloop

    from atomesh.logs import setup_logging

    config = GatewayConfig.model_validate(config_data)
    setup_logging(config.log_level.value, config.json_log, config.log_dir, log_file=f"atomesh-{index}.log")
    structlog.contextvars.bind_contextvars(process=index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the leader, which stops us in order
    uvloop.run(_follow(config, private_port, conn, instance_id))


async def _follow(config: GatewayConfig, private_port: int, conn: Conn, instance_id: str) -> None:
    follower = Follower(FollowerServer(config, private_port, instance_id), conn)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, follower.stopping.set)
    await follower.run()
