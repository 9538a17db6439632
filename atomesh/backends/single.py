"""Regular mode: the request goes to one worker as it came, and its answer back as it comes."""

from __future__ import annotations

import orjson

from atomesh.errors import UpstreamError
from atomesh.httpclient import HTTPClientError
from atomesh.placement import Plan, Single
from atomesh.request import RequestView
from atomesh.tracing import UPSTREAM
from atomesh.transport import ChunkHook, Exchange, Upstream, relay, relay_now, upstream_error


class SingleBackend:
    """Forwards the untouched body to the planned worker (the same for every engine family)."""

    def __init__(self, upstream: Upstream, on_chunk: ChunkHook | None = None) -> None:
        self.upstream = upstream
        self.on_chunk = on_chunk

    async def forward(self, exchange: Exchange, view: RequestView, plan: Plan) -> None:
        assert isinstance(plan, Single), "regular mode places single workers"
        worker = plan.worker
        # --dp-aware: the rank goes in the body (vLLM, SGLang and ATOM read `data_parallel_rank`).
        data = view.raw if plan.dp_rank is None else orjson.dumps({**view.body, "data_parallel_rank": plan.dp_rank})
        url = worker.url + view.route
        trace = exchange.trace
        if trace is not None:
            trace.leg(UPSTREAM, worker.url)  # the span ends in `finally`
        try:
            try:
                resp = await self.upstream.request(
                    "POST", url, data=data, headers=self.upstream.headers_for(exchange, worker)
                )
                try:
                    if not relay_now(exchange, resp):
                        await relay(exchange, resp, self.on_chunk)
                finally:
                    resp.release()  # back to the pool only if its body was read to the end
            except HTTPClientError as e:
                raise upstream_error(e, url) from None
        except UpstreamError as e:
            e.worker = worker
            raise
        finally:
            if trace is not None:
                trace.end()
