"""Serving: one gateway process, or the leader of several; signals and graceful shutdown.

The top of the import graph: nothing imports this module but the command line (`atomesh.cli`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable

import structlog
from aiohttp import web

from atomesh.api.middleware import HttpAccounting
from atomesh.cluster.leader import Cluster
from atomesh.config import GatewayConfig
from atomesh.frontdoor import FrontDoor, Relay
from atomesh.gateway import Gateway, StartupError
from atomesh.logs import AccessLog
from atomesh.service import build_app, build_metrics_app, build_probe_app, private_site, ssl_context, tune_gc

log = structlog.get_logger("atomesh")


class GatewayServer:
    """The gateway with its front doors (service and metrics ports); `start()` returns once workers are
    registered.

    Clients only ever talk to the front doors; the aiohttp applications behind them (every route that
    is not inference, and /metrics) listen on private loopback ports. With `--processes N` this is the
    leader process, and it starts the N-1 followers (atomesh.cluster.leader), which pass those routes
    to its private service port too.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway = Gateway(config)
        self.cluster = Cluster(config, self.gateway) if config.processes > 1 else None
        accounting = self.accounting = HttpAccounting(
            config.request_id_headers,
            self.gateway.metrics,
            config.max_payload_size,
            self.gateway.instance_id,
            config.access_log_sample_rate,
            AccessLog(),
        )
        self._runner = web.AppRunner(
            build_app(self.gateway, accounting), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        self.door = FrontDoor(self.gateway, accounting)
        remote = self.cluster.metrics if self.cluster is not None else None
        self._metrics_runner = web.AppRunner(build_metrics_app(self.gateway, remote), access_log=None)
        self.metrics_door = FrontDoor(self.gateway, accounting, hot=False)
        # --health-check-port: the probes on a port of their own, so a load balancer's checks never queue
        # behind client connections on the service port.
        self._probe_runner = (
            web.AppRunner(build_probe_app(self.gateway, accounting), access_log=None)
            if config.health_check_port is not None
            else None
        )
        self.probe_door = FrontDoor(self.gateway, accounting, hot=False) if self._probe_runner else None
        self._private_port = 0

    async def listen(self) -> None:
        """Open both ports (readiness says 503 until workers are up)."""
        cfg = self.config
        gw = self.gateway
        await gw.start()
        await self._runner.setup()
        await self._metrics_runner.setup()
        if self._probe_runner is not None:
            await self._probe_runner.setup()
        self._private_port = await private_site(self._runner)
        self.door.relay = Relay(gw.upstream, self._private_port, cfg.request_timeout_secs)
        self.metrics_door.relay = Relay(gw.upstream, await private_site(self._metrics_runner), cfg.request_timeout_secs)
        await _listen(
            self.door.start(cfg.host, cfg.port, ssl_context(cfg), reuse_port=self.cluster is not None),
            cfg.host,
            cfg.port,
            "--host/--port",
        )
        await _listen(
            self.metrics_door.start(cfg.metrics_host, cfg.prometheus_port, None),
            cfg.metrics_host,
            cfg.prometheus_port,
            "--prometheus-host/--prometheus-port",
        )
        if self._probe_runner is not None and self.probe_door is not None and cfg.health_check_port is not None:
            self.probe_door.relay = Relay(gw.upstream, await private_site(self._probe_runner), cfg.request_timeout_secs)
            await _listen(
                self.probe_door.start(cfg.host, cfg.health_check_port, None),
                cfg.host,
                cfg.health_check_port,
                "--health-check-port",
            )
        log.info(
            "gateway_listening",
            host=cfg.host,
            port=cfg.port,
            metrics_port=cfg.prometheus_port,
            mode="pd" if cfg.pd_disaggregation else "regular",
            backend=cfg.backend.value,
            policy=cfg.policy,
            processes=cfg.processes,
        )

    async def start(self) -> None:
        await self.listen()
        await self.gateway.add_startup_workers()
        await self.gateway.start_discovery()
        self.gateway.start_background()
        if self.cluster is not None:
            try:
                await self.cluster.start(self._private_port)
            except RuntimeError as e:
                raise StartupError(str(e)) from None
        log.info("gateway_ready", workers=len(self.gateway.registry))

    async def shutdown(self) -> None:
        """Refuse new requests, let in-flight ones finish within the grace period, stop everything."""
        gw = self.gateway
        grace = self.config.shutdown_grace_period_secs
        log.info("shutdown_started", in_flight=gw.active_requests, grace_secs=grace)
        if self.cluster is not None:
            drained, _ = await asyncio.gather(gw.drain_requests(grace), self.cluster.stop(grace))
        else:
            drained = await gw.drain_requests(grace)
        log.info("shutdown_drained" if drained else "shutdown_grace_expired", in_flight=gw.active_requests)
        await self.close()

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop(0)
        await self.door.close()
        await self.metrics_door.close()
        if self.probe_door is not None and self._probe_runner is not None:
            await self.probe_door.close()
            await self._probe_runner.cleanup()
        await self._runner.cleanup()
        await self._metrics_runner.cleanup()
        await self.gateway.stop()
        self.accounting.close()
        log.info("shutdown_complete")


async def serve(config: GatewayConfig) -> None:
    """Run the gateway until SIGTERM / SIGINT, then drain and stop. Raises StartupError."""
    server = GatewayServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.ensure_future(server.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        if not starting.cancelled() and starting.exception() is not None:
            await server.close()
            raise starting.exception()  # type: ignore[misc]
        if not stop.is_set():
            tune_gc()
        await stopped
        await server.shutdown()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(config: GatewayConfig) -> None:
    import uvloop

    uvloop.run(serve(config))


async def _listen(start: Awaitable[None], host: str, port: int, flags: str) -> None:
    """Open a port; one that cannot be bound stops start-up with a message naming address, port and flags."""
    try:
        await start
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise StartupError(f"cannot listen on {host}:{port} ({flags}): {reason}") from None
