"""Worker management API (SMG / ATOMesh shape): add, list, inspect, update, drain-and-remove."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atomesh.api.openai import json_response
from atomesh.errors import BadRequest, Conflict, GatewayError, NotFound
from atomesh.gateway import GATEWAY, Gateway
from atomesh.workers.worker import Worker, WorkerRole, WorkerSource, WorkerState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AddWorker(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    worker_type: WorkerRole = WorkerRole.REGULAR
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    labels: dict[str, str] = Field(default_factory=dict)
    # The worker's own key (SMG's field): sent as its Bearer token instead of the client's Authorization.
    api_key: str | None = Field(None, min_length=1, max_length=4096, pattern=r"^[\x21-\x7e]+$")


class UpdateWorker(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str] | None = None


def _protected(handler: Handler) -> Handler:
    """Require the admin key (`--admin-api-key`, else `--api-key`) when one is configured."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        request.app[GATEWAY].keys.check_admin(request.headers)
        return await handler(request)

    return wrapped


async def _body(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None


def _invalid(e: ValidationError) -> BadRequest:
    first = e.errors()[0]
    where = ".".join(map(str, first["loc"])) or "body"
    return BadRequest(f"{where}: {first['msg']}", code="invalid_worker")


def _find(gw: Gateway, request: web.Request) -> Worker:
    key = unquote(request.match_info["worker_id"])
    worker = gw.registry.get(key)
    if worker is None:
        raise NotFound(f"no worker {key!r}", code="worker_not_found")
    return worker


@_protected
async def add_worker(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        spec = AddWorker.model_validate(await _body(request))
    except ValidationError as e:
        raise _invalid(e) from None
    allowed = gw.roles
    if spec.worker_type not in allowed:
        mode = "P/D" if gw.config.pd_disaggregation else "regular"
        raise BadRequest(
            f"worker_type {spec.worker_type.value!r} is not served in {mode} mode; "
            f"use {' or '.join(r.value for r in allowed)}",
            code="invalid_worker_type",
        )
    if gw.shutting_down:
        raise BadRequest("the gateway is shutting down", code="shutting_down")
    try:
        worker = gw.lifecycle.add(spec.url, spec.worker_type, spec.bootstrap_port, spec.labels, api_key=spec.api_key)
    except ValueError as e:
        if "already registered" in str(e):
            raise Conflict(str(e), code="worker_exists") from None
        raise BadRequest(str(e), code="invalid_worker_url") from None
    return json_response(
        {
            "status": "accepted",
            "worker_id": worker.id,
            "url": worker.url,
            "message": "registration started; GET /workers/" + worker.id + " shows its progress",
        },
        status=202,
    )


@_protected
async def list_workers(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    workers = [w.describe() for w in gw.registry]
    return json_response(
        {"workers": workers, "total": len(workers), "stats": {"healthy": sum(1 for w in workers if w["is_healthy"])}}
    )


@_protected
async def get_worker(request: web.Request) -> web.Response:
    return json_response(_find(request.app[GATEWAY], request).describe())


@_protected
async def update_worker(request: web.Request) -> web.Response:
    worker = _find(request.app[GATEWAY], request)
    try:
        update = UpdateWorker.model_validate(await _body(request))
    except ValidationError as e:
        raise _invalid(e) from None
    if update.labels is not None:
        worker.labels = dict(update.labels)
    return json_response(worker.describe())


@_protected
async def delete_worker(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    worker = _find(gw, request)
    if worker.source is WorkerSource.KUBERNETES and worker.state is not WorkerState.FAILED:
        raise Conflict(
            f"worker {worker.id} is pod {worker.pod}, managed by Kubernetes discovery: scale, "
            "relabel or delete the pod instead",
            code="worker_discovered",
        )
    gw.lifecycle.remove(worker)
    return json_response(
        {
            "status": "accepted",
            "worker_id": worker.id,
            "url": worker.url,
            "message": "draining; the worker is removed when its in-flight requests finish",
        },
        status=202,
    )


@_protected
async def get_loads(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return json_response(
        {
            "workers": [
                {"worker": w.url, "worker_type": w.role.value, "load": w.load, "in_flight": w.in_flight}
                for w in gw.registry
            ]
        }
    )


@_protected
async def flush_cache(request: web.Request) -> web.Response:
    """Ask every healthy worker to flush its prefix cache."""
    gw = request.app[GATEWAY]
    workers = [w for role in gw.roles for w in gw.registry.ready(role)]

    async def one(w: Worker) -> dict[str, Any]:
        try:
            status, _, _ = await gw.upstream.call(
                "POST",
                w.url + "/flush_cache",
                headers=gw.upstream.worker_headers(w),
                timeout=gw.config.health_check_timeout_secs,
            )
            return {"worker": w.url, "status": status}
        except GatewayError as e:
            return {"worker": w.url, "error": e.message}

    results = await asyncio.gather(*(one(w) for w in workers))
    flushed = [r for r in results if r.get("status", 500) < 300]
    # A worker without the route (404 / 405 / 501) does not have a cache to flush: that is no failure.
    unsupported = [r for r in results if r.get("status") in _NO_FLUSH_ROUTE]
    failed = len(results) - len(flushed) - len(unsupported)
    if failed:
        status, http = ("partial" if flushed else "failed"), 502
    elif results and not flushed:
        status, http = "unsupported", 501
    else:
        status, http = "ok", 200
    body: dict[str, Any] = {"status": status, "workers": results}
    if status == "unsupported":
        body["message"] = "no worker serves POST /flush_cache"
    return json_response(body, status=http)


_NO_FLUSH_ROUTE = frozenset({404, 405, 501})


def setup(app: web.Application) -> None:
    app.router.add_post("/workers", add_worker)
    app.router.add_get("/workers", list_workers)
    app.router.add_get("/workers/{worker_id:.+}", get_worker)
    app.router.add_put("/workers/{worker_id:.+}", update_worker)
    app.router.add_delete("/workers/{worker_id:.+}", delete_worker)
    app.router.add_get("/get_loads", get_loads)
    app.router.add_post("/flush_cache", flush_cache)
