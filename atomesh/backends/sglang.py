"""`--backend sglang`: dual dispatch. The same request goes to prefill and decode at once, tied together
by `bootstrap_host` / `bootstrap_port` / `bootstrap_room`; decode's reply goes to the client.

If either leg fails, the other is cancelled at once, so nothing waits for the request timeout.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson

from atomesh.errors import UpstreamError, UpstreamStatus
from atomesh.metrics import Metrics
from atomesh.placement import Pair, Plan
from atomesh.request import RequestView, Route
from atomesh.transport import ChunkHook, Exchange, Upstream, relay

# How long a finished decode leg waits for its prefill leg's answer before dropping it.
PREFILL_LINGER_SECS = 5.0


def batch_size(route: Route, body: dict[str, Any]) -> int | None:
    """The number of prompts of a batch request, or None for a single one."""
    if route is Route.GENERATE:
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
    elif route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return len(prompt)
    return None


def new_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


class SglangBackend:
    """Sends both legs concurrently and cancels the survivor when one of them fails."""

    def __init__(
        self, upstream: Upstream, metrics: Metrics, on_chunk: ChunkHook | None = None, rng: random.Random | None = None
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.on_chunk = on_chunk
        self.rng = rng or random.SystemRandom()

    def bootstrap_body(self, view: RequestView, plan: Pair) -> bytes:
        body = dict(view.body)
        host, port = plan.prefill.host, plan.prefill.bootstrap_port
        n = batch_size(view.route, body)
        if n is None:
            body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room(self.rng))
        else:
            body.update(
                bootstrap_host=[host] * n,
                bootstrap_port=[port] * n,
                bootstrap_room=[new_room(self.rng) for _ in range(n)],
            )
        return orjson.dumps(body)

    async def forward(self, exchange: Exchange, view: RequestView, plan: Plan) -> None:
        assert isinstance(plan, Pair), "P/D mode places prefill/decode pairs"
        data = self.bootstrap_body(view, plan)
        prefill = asyncio.ensure_future(
            self._prefill(plan, view, data, self.upstream.headers_for(exchange, plan.prefill))
        )
        decode = asyncio.ensure_future(
            self._decode(exchange, plan, view, data, self.upstream.headers_for(exchange, plan.decode))
        )
        try:
            done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and prefill.exception() is not None:
                decode.cancel()
                await asyncio.gather(decode, return_exceptions=True)
                raise prefill.exception()  # type: ignore[misc]
            await decode  # raises the decode leg's error, if any
            try:
                await asyncio.wait_for(asyncio.shield(prefill), PREFILL_LINGER_SECS)
            except (TimeoutError, UpstreamError):
                pass  # the client has its answer; a late prefill problem changes nothing for it
        finally:
            for leg in (prefill, decode):
                if not leg.done():
                    leg.cancel()
            await asyncio.gather(prefill, decode, return_exceptions=True)

    async def _prefill(self, plan: Pair, view: RequestView, data: bytes, headers: dict[str, str]) -> None:
        started = time.monotonic()
        try:
            async with self.upstream.open("POST", plan.prefill.url + view.route, data=data, headers=headers) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise UpstreamStatus(resp.status, raw, resp.content_type)
        except UpstreamError as e:
            e.worker = plan.prefill
            raise
        self.metrics.observe_pd("sglang", view.model, prefill_secs=time.monotonic() - started)

    async def _decode(
        self, exchange: Exchange, plan: Pair, view: RequestView, data: bytes, headers: dict[str, str]
    ) -> None:
        started = time.monotonic()
        try:
            async with self.upstream.open("POST", plan.decode.url + view.route, data=data, headers=headers) as resp:
                await relay(exchange, resp, self.on_chunk)
        except UpstreamError as e:
            e.worker = plan.decode
            raise
        self.metrics.observe_pd("sglang", view.model, decode_secs=time.monotonic() - started)
