"""Serving: the front door and the aiohttp apps (service + metrics), TLS, signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import signal
import ssl

import structlog
from aiohttp import web

from atomesh.api import admin, health, observability, openai
from atomesh.api.middleware import HttpAccounting, make_middleware
from atomesh.cluster import Cluster
from atomesh.config import GatewayConfig
from atomesh.frontdoor import FrontDoor, Relay
from atomesh.gateway import GATEWAY, Gateway, StartupError

log = structlog.get_logger("atomesh")


def build_app(gateway: Gateway, accounting: HttpAccounting) -> web.Application:
    """The OpenAI-compatible service app (the metrics app is separate): every route, for the
    connections the front door hands over."""
    app = web.Application(client_max_size=gateway.config.max_payload_size,
                          middlewares=[make_middleware(accounting)])
    app[GATEWAY] = gateway
    openai.setup(app)
    health.setup(app)
    admin.setup(app)
    observability.setup(app)
    return app


def build_metrics_app(gateway: Gateway, cluster: Cluster | None) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        gateway.sync_metrics()
        return gateway.metrics.render(await cluster.metrics() if cluster is not None else ())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def _ssl_context(cfg: GatewayConfig) -> ssl.SSLContext | None:
    if cfg.tls_cert_path is None or cfg.tls_key_path is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cfg.tls_cert_path), str(cfg.tls_key_path))
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"--tls-cert-path/--tls-key-path: cannot load the certificate: {e}") from None
    return ctx


async def _private_site(runner: web.AppRunner) -> int:
    """Serve an aiohttp app on a loopback port of the kernel's choosing (behind a front door); its port."""
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


class GatewayServer:
    """The gateway with its front doors (service and metrics ports); `start()` returns once workers are
    registered.

    Clients only ever talk to the front doors; the aiohttp applications behind them (every route that
    is not inference, and /metrics) listen on private loopback ports. With `--processes N` this is the
    leader process, and it starts the N-1 followers (atomesh.cluster), which pass those routes to its
    private service port too.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway = Gateway(config)
        self.cluster = Cluster(config, self.gateway) if config.processes > 1 else None
        accounting = HttpAccounting(config.request_id_headers, self.gateway.metrics, config.max_payload_size,
                                    self.gateway.instance_id, config.access_log_sample_rate)
        self._runner = web.AppRunner(build_app(self.gateway, accounting), handler_cancellation=True,
                                     access_log=None, shutdown_timeout=1.0)
        self.door = FrontDoor(self.gateway, accounting)
        self._metrics_runner = web.AppRunner(build_metrics_app(self.gateway, self.cluster), access_log=None)
        self.metrics_door = FrontDoor(self.gateway, accounting, hot=False)
        self._private_port = 0

    async def listen(self) -> None:
        """Open both ports (readiness says 503 until workers are up)."""
        cfg = self.config
        gw = self.gateway
        await gw.start()
        await self._runner.setup()
        await self._metrics_runner.setup()
        self._private_port = await _private_site(self._runner)
        self.door.relay = Relay(gw.upstream, self._private_port, cfg.request_timeout_secs)
        self.metrics_door.relay = Relay(gw.upstream, await _private_site(self._metrics_runner),
                                        cfg.request_timeout_secs)
        try:
            await self.door.start(cfg.host, cfg.port, _ssl_context(cfg), reuse_port=self.cluster is not None)
            await self.metrics_door.start(cfg.metrics_host, cfg.prometheus_port, None)
        except OSError as e:
            raise StartupError(f"cannot listen: {e.strerror or e}") from None
        log.info("gateway_listening", host=cfg.host, port=cfg.port, metrics_port=cfg.prometheus_port,
                 mode="pd" if cfg.pd_disaggregation else "regular", backend=cfg.backend.value,
                 policy=cfg.policy, processes=cfg.processes)

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
        await self._runner.cleanup()
        await self._metrics_runner.cleanup()
        await self.gateway.stop()
        log.info("shutdown_complete")


class FollowerServer:
    """A follower process's server: the front door on the shared port; every request it does not
    serve itself goes to the leader's private service port."""

    def __init__(self, config: GatewayConfig, leader_port: int, instance_id: str) -> None:
        self.config = config
        self.gateway = Gateway(config, instance_id)
        accounting = HttpAccounting(config.request_id_headers, self.gateway.metrics, config.max_payload_size,
                                    self.gateway.instance_id, config.access_log_sample_rate)
        self.door = FrontDoor(self.gateway, accounting)
        self.leader_port = leader_port

    async def listen(self) -> None:
        cfg = self.config
        await self.gateway.start()
        self.door.relay = Relay(self.gateway.upstream, self.leader_port, cfg.request_timeout_secs)
        await self.door.start(cfg.host, cfg.port, _ssl_context(cfg), reuse_port=True)
        self.gateway.placement.start()

    async def shutdown(self) -> None:
        await self.gateway.drain_requests(self.config.shutdown_grace_period_secs)
        await self.door.close()
        await self.gateway.stop()


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


def tune_gc() -> None:
    """Once serving: keep start-up objects out of every later collection and collect the young
    generation less often. At 256 concurrent requests the default thresholds cost ~15 % of the CPU per
    request (docs/performance.md); what the request path allocates is mostly freed by reference
    counting, so fewer, larger young collections find the same cycles."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 50)


def run(config: GatewayConfig) -> None:
    import uvloop

    uvloop.run(serve(config))
