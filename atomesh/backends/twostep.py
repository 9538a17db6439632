"""Prefill first, then decode with what prefill returned: the shape shared by the atom and vllm backends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from atomesh.errors import UpstreamError, UpstreamStatus, upstream_error_code
from atomesh.metrics import Metrics
from atomesh.placement import Pair, Plan
from atomesh.request import RequestView, Route
from atomesh.tracing import DECODE, PREFILL
from atomesh.transport import ChunkHook, Exchange, Upstream, relay
from atomesh.workers.worker import Worker

# Builds the decode leg's kv_transfer_params from what prefill returned and the prefill worker.
DecodeParams = Callable[[dict[str, Any], Worker], dict[str, Any]]
# Builds the prefill leg's kv_transfer_params from the client's body.
PrefillParams = Callable[[dict[str, Any]], dict[str, Any]]


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any], route: Route) -> bytes:
    """The client's request turned into a prefill-only request: one token, no streaming."""
    out = dict(body)
    out["kv_transfer_params"] = kv_params
    out["stream"] = False
    if route is Route.RESPONSES:  # the Responses API's one limit
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    sampling = out.get("sampling_params")
    if isinstance(sampling, dict):  # /generate: SGLang's spelling of the limit
        out["sampling_params"] = {**sampling, "max_new_tokens": 1}
    out.pop("stream_options", None)
    # One sequence is prefilled; the decode engine forks n / best_of samples from its KV and echoes the
    # prompt itself. best_of ranks by cumulative logprob, so the first token's must come back.
    if (out.get("best_of") or 1) > (out.get("n") or 1) and out.get("logprobs") is None:
        out["logprobs"] = 0
    # echo with logprobs scores the prompt: on the prefill engine, which passes the scores on.
    logprobs = out.get("logprobs")
    if out.get("echo") and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        out["prompt_logprobs"] = max(out.get("prompt_logprobs") or 0, logprobs)
    for key in ("n", "best_of", "echo"):
        out.pop(key, None)
    return orjson.dumps(out)


def kv_failure_code(body: bytes) -> str | None:
    """The engine's error code when a decode leg failed because its KV transfer did (codes `kv_transfer_*`)."""
    code = upstream_error_code(body)
    return code if code is not None and code.startswith("kv_transfer") and len(code) <= 64 else None


class TwoStepBackend:
    """Runs the prefill leg to completion, then the decode leg whose reply goes to the client."""

    def __init__(
        self,
        runtime: str,
        upstream: Upstream,
        metrics: Metrics,
        prefill_params: PrefillParams,
        decode_params: DecodeParams,
        on_chunk: ChunkHook | None = None,
    ) -> None:
        self.runtime = runtime
        self.upstream = upstream
        self.metrics = metrics
        self.prefill_params = prefill_params
        self.decode_params = decode_params
        self.on_chunk = on_chunk

    async def forward(self, exchange: Exchange, view: RequestView, plan: Plan) -> None:
        assert isinstance(plan, Pair), "P/D mode places prefill/decode pairs"
        started = time.monotonic()
        deadline = started + self.upstream.request_timeout
        trace = exchange.trace
        if trace is not None:
            trace.leg(PREFILL, plan.prefill.url)  # the span ends in `finally`
        try:
            returned = await self._prefill(exchange, view, plan.prefill)
        finally:
            if trace is not None:
                trace.end()
        prefilled = time.monotonic()
        self.metrics.observe_pd(self.runtime, view.model, prefill_secs=prefilled - started)
        body = dict(view.body)
        body["kv_transfer_params"] = self.decode_params(returned, plan.prefill)
        remaining = max(0.001, deadline - time.monotonic())
        if trace is not None:
            trace.leg(DECODE, plan.decode.url)
        try:
            await self._decode(exchange, view, plan, body, remaining, prefilled)
        finally:
            if trace is not None:
                trace.end()

    async def _decode(
        self,
        exchange: Exchange,
        view: RequestView,
        plan: Pair,
        body: dict[str, Any],
        remaining: float,
        prefilled: float,
    ) -> None:
        try:
            async with self.upstream.open(
                "POST",
                plan.decode.url + view.route,
                data=orjson.dumps(body),
                headers=self.upstream.headers_for(exchange, plan.decode),
                timeout=remaining,
            ) as resp:
                if view.stream:
                    # A streaming decode answers once it pulled the KV and ran its first step:
                    # the time to here is the hand-off (a whole answer would include the decode).
                    self.metrics.observe_pd(self.runtime, view.model, handoff_secs=time.monotonic() - prefilled)
                await relay(exchange, resp, self.on_chunk)
        except UpstreamError as e:
            e.worker = plan.decode
            if isinstance(e, UpstreamStatus):
                reason = kv_failure_code(e.upstream_body)
                if reason is not None:
                    self.metrics.pd_kv_transfer_failed(self.runtime, reason)
            raise
        self.metrics.observe_pd(self.runtime, view.model, decode_secs=time.monotonic() - prefilled)

    async def _prefill(self, exchange: Exchange, view: RequestView, worker: Worker) -> dict[str, Any]:
        """Run the prefill leg; return the kv_transfer_params it answered with."""
        try:
            data = prefill_body(view.body, self.prefill_params(view.body), view.route)
            status, raw, ctype = await self.upstream.call(
                "POST", worker.url + view.route, data=data, headers=self.upstream.headers_for(exchange, worker)
            )
            if status >= 400:
                raise UpstreamStatus(status, raw, ctype)
            try:
                answer = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise UpstreamError(
                    f"prefill worker {worker.url} did not answer with JSON", code="prefill_invalid_response"
                ) from None
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(params, dict):
                raise UpstreamError(
                    f"prefill worker {worker.url} answered without kv_transfer_params",
                    code="prefill_missing_kv_transfer_params",
                    retryable=False,
                )
            return params
        except UpstreamError as e:
            e.worker = worker
            raise
