"""OpenAI-compatible inference routes and the model / server info routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from atomesh.api.middleware import LOOP_MESSAGE, REQUEST_ID
from atomesh.errors import GatewayError, LoopDetected, NotServed, NoWorkerAvailable, ShuttingDown, UpstreamStatus
from atomesh.gateway import GATEWAY, Gateway
from atomesh.request import RequestView, Route, pd_refusal
from atomesh.tenancy import PRIORITY_HEADER, PriorityClass, estimated_tokens
from atomesh.transport import HOP_HEADER, Exchange
from atomesh.validation import parse_request


def serve_inference(gw: Gateway, route: Route, raw: bytes | bytearray, exchange: Exchange) -> Awaitable[None]:
    """One inference request, whichever server took it: parse, validate, admit, route (await it).

    Every failure raised here, the gateway's own refusals included, counts in
    `mesh_router_request_errors_total`. With --enable-trace, a sampled request runs in its server span."""
    return _serve(gw, route, raw, exchange)


async def _serve(gw: Gateway, route: Route, raw: bytes | bytearray, exchange: Exchange) -> None:
    body: dict[str, Any] | None = None
    trace = gw.tracing.start(exchange) if gw.tracing.on else None  # None: not traced (or not sampled)
    try:
        headers = exchange.headers
        if headers.get(HOP_HEADER) == gw.instance_id:
            raise LoopDetected(LOOP_MESSAGE)
        tenant = gw.tenants.of(headers)
        if not tenant.startswith("auth:"):  # a --tenant-api-key opens inference by itself
            gw.keys.check_inference(headers)
        if gw.shutting_down:
            raise ShuttingDown("the gateway is shutting down")
        if gw.config.pd_disaggregation and (refusal := pd_refusal(route, gw.config.backend)) is not None:
            raise NotServed(refusal)
        body = parse_request(route, raw)
        raw = gw.models.resolve(route, body, raw)
        key = None
        for h in gw.config.routing_key_headers:
            if key := headers.get(h):
                break
        view = RequestView(
            route=route, body=body, raw=raw, request_id=exchange.request_id, routing_key=key or None, headers=headers
        )
        if gw.rate_limits is not None:
            gw.rate_limits.take(tenant, estimated_tokens(body, len(view.locality_text)))
        cls, priority = PriorityClass.DEFAULT, 0
        if gw.scheduler is not None:
            cls = gw.scheduler.class_of(tenant, headers.get(PRIORITY_HEADER))
            p = body.get("priority")
            priority = p if isinstance(p, int) and not isinstance(p, bool) else 0
        gw.request_started()
        try:
            permit = gw.admission.permit(cls, priority)
            trace = exchange.trace
            if trace is not None:
                trace.admission(view.model, cls, tenant)  # ended with the request if the wait is cut
                if not permit.take_now():
                    await permit.__aenter__()
                trace.end()
            elif not permit.take_now():
                await permit.__aenter__()  # waits in the admission queue
            try:
                await gw.router.serve(exchange, view)
            finally:
                permit.release()
        finally:
            gw.request_finished()
    except GatewayError as e:
        model = body.get("model") if body is not None else None
        gw.metrics.request_failed(route, model if isinstance(model, str) else None, e.code)
        if trace is not None:
            trace.failed(e.status, e.code)
        raise
    finally:
        if trace is not None:
            gw.tracing.finish(trace, route, exchange)


class AiohttpExchange(Exchange):
    """An Exchange answering through aiohttp (requests on connections the front door handed over)."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request, request_id: str) -> None:
        super().__init__(request_id, request.headers)
        self.request = request
        self.response: web.StreamResponse | None = None

    def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status, self.body = status, body
        self.sent = len(body)
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.response = web.StreamResponse(status=status, headers=headers)
        await self.response.prepare(self.request)
        self.committed = True

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        self.sent += len(data)
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


def _inference(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        exchange = AiohttpExchange(request, request[REQUEST_ID])
        await serve_inference(request.app[GATEWAY], route, await request.read(), exchange)
        assert exchange.response is not None, "a served request has an answer"
        return exchange.response

    return handler


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def models(request: web.Request) -> web.Response:
    """The models the healthy workers serve, merged (decode workers in P/D mode)."""
    gw = request.app[GATEWAY]
    role = gw.roles[-1]
    seen = {m: {"id": m, "object": "model", "owned_by": "atomesh", "root": root} for m, root in gw.models.listed()}
    if not seen and not gw.registry.ready(role):
        raise NoWorkerAvailable("no healthy worker is available to list models")
    return json_response({"object": "list", "data": list(seen.values())})


async def _from_any_worker(request: web.Request, path: str) -> web.Response:
    gw = request.app[GATEWAY]
    ready = gw.registry.ready(gw.roles[-1])
    if not ready:
        raise NoWorkerAvailable("no healthy worker is available")
    timeout = gw.config.health_check_timeout_secs
    status, body, ctype = await gw.upstream.call(
        "GET", ready[0].url + path, timeout=timeout, headers=gw.upstream.worker_headers(ready[0])
    )
    if status >= 400:
        raise UpstreamStatus(status, body, ctype)
    return web.Response(body=body, status=status, content_type=ctype or "application/json")


async def model_info(request: web.Request) -> web.Response:
    request.app[GATEWAY].keys.check_inference(request.headers)
    return await _from_any_worker(request, "/get_model_info")


async def server_info(request: web.Request) -> web.Response:
    """The gateway's own settings and state, with each worker's discovered server info (admin key)."""
    gw = request.app[GATEWAY]
    gw.keys.check_admin(request.headers)
    cfg = gw.config
    return json_response(
        {
            "gateway": "atomesh",
            "mode": "pd" if cfg.pd_disaggregation else "regular",
            "backend": cfg.backend.value,
            "policy": {r.value: cfg.policy_for(r.value) for r in gw.roles},
            "active_requests": gw.active_requests,
            "workers": [{**w.describe(), "server_info": w.server_info} for w in gw.registry],
        }
    )


def setup(app: web.Application) -> None:
    for route in Route:
        app.router.add_post(route.value, _inference(route))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_server_info", server_info)
