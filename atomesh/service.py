"""What every gateway process serves with: the aiohttp applications behind the front door, the TLS
context, the private loopback site and the garbage-collector tuning.

`atomesh.app` (one process, or the leader of several) and `atomesh.cluster.follower` both build on it.
"""

from __future__ import annotations

import gc
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from atomesh.api import admin, health, observability, openai
from atomesh.api.middleware import HttpAccounting, make_middleware
from atomesh.config import GatewayConfig
from atomesh.gateway import GATEWAY, Gateway, StartupError
from atomesh.metrics import Export

# Other processes' request-path metric values, gathered at scrape time (atomesh.cluster.leader).
RemoteMetrics = Callable[[], Awaitable[Sequence[Export]]]


def build_app(gateway: Gateway, accounting: HttpAccounting) -> web.Application:
    """The OpenAI-compatible service app (the metrics app is separate): every route, for the
    connections the front door hands over."""
    app = web.Application(client_max_size=gateway.config.max_payload_size, middlewares=[make_middleware(accounting)])
    app[GATEWAY] = gateway
    openai.setup(app)
    health.setup(app)
    admin.setup(app)
    observability.setup(app)
    return app


def build_probe_app(gateway: Gateway, accounting: HttpAccounting) -> web.Application:
    """--health-check-port: the probe routes alone (/liveness, /readiness, /health, /health_generate)."""
    app = web.Application(middlewares=[make_middleware(accounting)])
    app[GATEWAY] = gateway
    health.setup(app)
    return app


def build_metrics_app(gateway: Gateway, remote: RemoteMetrics | None) -> web.Application:
    """The metrics port's app: this process's values, plus `remote()`'s when there are other processes."""

    async def metrics(_: web.Request) -> web.Response:
        gateway.sync_metrics()
        return gateway.metrics.render(await remote() if remote is not None else ())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def ssl_context(cfg: GatewayConfig) -> ssl.SSLContext | None:
    """The service port's TLS context (--tls-cert-path / --tls-key-path), or None for plain HTTP."""
    if cfg.tls_cert_path is None or cfg.tls_key_path is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(str(cfg.tls_cert_path), str(cfg.tls_key_path))
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"--tls-cert-path/--tls-key-path: cannot load the certificate: {e}") from None
    return ctx


async def private_site(runner: web.AppRunner) -> int:
    """Serve an aiohttp app on a loopback port of the kernel's choosing (behind a front door); its port."""
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


def tune_gc() -> None:
    """Once serving: keep start-up objects out of every later collection and collect the young
    generation less often. At 256 concurrent requests the default thresholds cost ~15 % of the CPU per
    request (docs/performance.md); what the request path allocates is mostly freed by reference
    counting, so fewer, larger young collections find the same cycles."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 50)
