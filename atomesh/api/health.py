"""Liveness, readiness and health routes."""

from __future__ import annotations

import asyncio

from aiohttp import web

from atomesh.api.openai import json_response
from atomesh.errors import NoWorkerAvailable, ShuttingDown, UpstreamStatus
from atomesh.gateway import GATEWAY
from atomesh.workers.worker import WorkerRole


async def liveness(request: web.Request) -> web.Response:
    """The process is up and its event loop answers."""
    return json_response({"status": "ok"})


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if gw.shutting_down:
        raise ShuttingDown("the gateway is shutting down")
    return json_response({"status": "ok"})


async def readiness(request: web.Request) -> web.Response:
    """200 when every pool the mode needs has a healthy worker (prefill and decode in P/D mode)."""
    gw = request.app[GATEWAY]
    counts = {role.value: gw.registry.healthy_count(role) for role in gw.roles}
    ready = not gw.shutting_down and all(counts.values())
    return json_response(
        {"status": "ready" if ready else "not_ready", "healthy_workers": counts}, status=200 if ready else 503
    )


async def health_generate(request: web.Request) -> web.Response:
    """Ask one healthy worker of each pool to generate (their /health_generate)."""
    gw = request.app[GATEWAY]
    checks = []
    for role in gw.roles:
        ready = gw.registry.ready(role)
        if not ready:
            what = "worker" if role is WorkerRole.REGULAR else f"{role.value} worker"
            raise NoWorkerAvailable(f"no healthy {what} is available")
        checks.append(
            gw.upstream.call(
                "GET",
                ready[0].url + "/health_generate",
                headers=gw.upstream.worker_headers(ready[0]),
                timeout=gw.config.health_check_timeout_secs,
            )
        )
    results = await asyncio.gather(*checks)
    for status, body, ctype in results:
        if status >= 400:
            raise UpstreamStatus(status, body, ctype)
    return json_response({"status": "ok"})


def setup(app: web.Application) -> None:
    app.router.add_get("/liveness", liveness)
    app.router.add_get("/health", health)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/health_generate", health_generate)
