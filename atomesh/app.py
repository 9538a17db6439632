"""Serving: the front door and the aiohttp apps (service + metrics), TLS, signals and graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
import ssl

import structlog
from aiohttp import web

from atomesh.api import admin, health, observability, openai
from atomesh.api.middleware import HttpAccounting, make_middleware
from atomesh.config import GatewayConfig
from atomesh.frontdoor import FrontDoor
from atomesh.gateway import GATEWAY, Gateway, StartupError
from atomesh.policies.cache_aware import CacheAwarePolicy

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


def build_metrics_app(gateway: Gateway) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        # Values the components keep themselves are copied in at scrape time, off the request path.
        for w in gateway.registry:
            gateway.metrics.worker_active.labels(w.url, w.role.value).set(w.in_flight)
        for role, policy in gateway.placement.policies.items():
            if isinstance(policy, CacheAwarePolicy):
                gateway.metrics.sync_cache_aware(role.value, policy.hits, policy.misses, len(policy.index))
        return gateway.metrics.render()

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


class GatewayServer:
    """The gateway with its two listening apps; `start()` returns once workers are registered."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway = Gateway(config)
        accounting = HttpAccounting(config.request_id_headers, self.gateway.metrics, config.max_payload_size)
        self._runner = web.AppRunner(build_app(self.gateway, accounting), handler_cancellation=True,
                                     access_log=None, shutdown_timeout=1.0)
        self.door = FrontDoor(self.gateway, accounting, fallback=lambda: self._runner.server())  # type: ignore[misc]
        self._metrics_runner = web.AppRunner(build_metrics_app(self.gateway), access_log=None)

    async def listen(self) -> None:
        """Open both ports (readiness says 503 until workers are up)."""
        cfg = self.config
        await self.gateway.start()
        await self._runner.setup()
        await self._metrics_runner.setup()
        try:
            await self.door.start(cfg.host, cfg.port, _ssl_context(cfg))
            await web.TCPSite(self._metrics_runner, cfg.prometheus_host, cfg.prometheus_port,
                              reuse_address=True).start()
        except OSError as e:
            raise StartupError(f"cannot listen: {e.strerror or e}") from None
        log.info("gateway_listening", host=cfg.host, port=cfg.port, metrics_port=cfg.prometheus_port,
                 mode="pd" if cfg.pd_disaggregation else "regular", backend=cfg.backend.value,
                 policy=cfg.policy)

    async def start(self) -> None:
        await self.listen()
        await self.gateway.add_startup_workers()
        self.gateway.start_background()
        log.info("gateway_ready", workers=len(self.gateway.registry))

    async def shutdown(self) -> None:
        """Refuse new requests, let in-flight ones finish within the grace period, stop everything."""
        gw = self.gateway
        grace = self.config.shutdown_grace_period_secs
        log.info("shutdown_started", in_flight=gw.active_requests, grace_secs=grace)
        drained = await gw.drain_requests(grace)
        log.info("shutdown_drained" if drained else "shutdown_grace_expired", in_flight=gw.active_requests)
        await self.close()

    async def close(self) -> None:
        await self.door.close()
        await self._runner.cleanup()
        await self._metrics_runner.cleanup()
        await self.gateway.stop()
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
        await stopped
        await server.shutdown()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(config: GatewayConfig) -> None:
    import uvloop

    uvloop.run(serve(config))
