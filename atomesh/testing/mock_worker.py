"""A configurable OpenAI-compatible mock worker for tests and benchmarks.

It answers `/v1/completions`, `/v1/chat/completions`, `/generate` and `/v1/responses` (streamed or not) with fake
tokens, identifies itself in the `x-mock-worker` header, records what it received, and can be made
slow, failing, hanging or dying mid-stream, at start or at run time (`POST /_mock/config`).
Run it in-process (`MockWorker(...).start()`) or as a process:
`python -m atomesh.testing.mock_worker --port 8001 --name a`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self

import orjson
from aiohttp import web

RECORD_LIMIT = 1000


@dataclass(slots=True)
class MockBehaviour:
    """How the mock answers; every field can be changed at run time."""

    latency_secs: float = 0.0  # before the response starts
    stream_chunks: int = 4  # tokens in a streamed reply (and words in a non-streamed one)
    chunk_interval_secs: float = 0.0
    fail_status: int | None = None  # answer inference requests with this status
    fail_times: int = -1  # how many requests fail_status applies to (-1: all)
    fail_code: str | None = None  # the error code of a failure (default: the status)
    hang: bool = False  # never answer inference requests
    die_after_chunks: int | None = None  # close the connection after this many streamed chunks
    drop_connection: bool = False  # close the connection without answering
    health_status: int = 200
    models: list[str] = field(default_factory=lambda: ["mock-model"])
    kv_role: str | None = None  # reported by /kv_transfer_info
    # P/D protocol checked on every inference request: "atom", "sglang" or "vllm" (None: no checks),
    # and this worker's side of it: "prefill" or "decode".
    pd_backend: str | None = None
    pd_role: str | None = None
    omit_kv_params: bool = False  # a prefill that forgets kv_transfer_params (atom / vllm)
    missing_routes: list[str] = field(default_factory=list)  # paths answered 404, as by an engine lacking them
    dp_size: int | None = 1  # reported in /server_info (None: not reported)
    api_key: str | None = None  # every route but the mock's own answers 401 without `Bearer api_key`


class ServedApp:
    """An aiohttp app served on host:port (0: a free port), started and stopped by a test or benchmark."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self) -> Self:
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class MockWorker(ServedApp):
    """One mock worker server on a loopback port."""

    def __init__(
        self, name: str = "mock", host: str = "127.0.0.1", port: int = 0, behaviour: MockBehaviour | None = None
    ) -> None:
        super().__init__(host, port)
        self.name = name
        self.behaviour = behaviour or MockBehaviour()
        self.received: deque[dict[str, Any]] = deque(maxlen=RECORD_LIMIT)
        self.active = 0  # inference requests being answered now
        self.cancelled = 0  # inference requests whose client went away before the end
        self.authorizations: deque[tuple[str, str | None]] = deque(maxlen=RECORD_LIMIT)  # with api_key set
        self.served = 0

    def app(self) -> web.Application:
        @web.middleware
        async def missing(request: web.Request, handler: Any) -> web.StreamResponse:
            key = self.behaviour.api_key
            if key is not None and not request.path.startswith("/_mock/"):
                self.authorizations.append((request.path, request.headers.get("Authorization")))
                if request.headers.get("Authorization") != "Bearer " + key:
                    return web.json_response(
                        {"error": {"message": "bad key", "type": "authentication_error", "code": 401}},
                        status=401,
                        headers=self._headers(),
                    )
            if request.path in self.behaviour.missing_routes:
                return web.json_response(
                    {"error": {"message": "not found", "type": "not_found_error", "code": 404}},
                    status=404,
                    headers=self._headers(),
                )
            resp: web.StreamResponse = await handler(request)
            return resp

        app = web.Application(middlewares=[missing])
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses"):
            app.router.add_post(path, self._inference)
        for path in (
            "/v1/messages",
            "/v1/embeddings",
            "/v1/rerank",
            "/rerank",
            "/v1/score",
            "/v1/classify",
            "/v1/tokenize",
            "/v1/detokenize",
        ):
            app.router.add_post(path, self._relayed)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/kv_transfer_info", self._kv_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_get("/_mock/requests", self._requests)
        app.router.add_post("/_mock/config", self._config)
        return app

    # ------------------------------------------------------------------ handlers
    def _headers(self) -> dict[str, str]:
        return {"x-mock-worker": self.name}

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return web.json_response(
                {"error": {"message": "bad json", "type": "invalid_request_error", "code": 400}},
                status=400,
                headers=self._headers(),
            )
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append({"path": request.path, "body": body, "headers": headers, "at": time.time()})
        b = self.behaviour
        problem = pd_protocol_problem(b.pd_backend, b.pd_role, body) if b.pd_backend else None
        if problem is not None:
            return web.json_response(
                {"error": {"message": problem, "type": "invalid_request_error", "code": 400}},
                status=400,
                headers=self._headers(),
            )
        self.active += 1
        finished = False
        try:
            if b.drop_connection:
                assert request.transport is not None
                request.transport.close()
                finished = True
                return web.Response(status=500)
            if b.hang:
                await asyncio.Event().wait()
            if b.latency_secs:
                await asyncio.sleep(b.latency_secs)
            if b.fail_status is not None and b.fail_times != 0:
                if b.fail_times > 0:
                    b.fail_times -= 1
                finished = True
                return web.json_response(
                    {
                        "error": {
                            "message": f"mock failure from {self.name}",
                            "type": "server_error",
                            "code": b.fail_code or b.fail_status,
                        }
                    },
                    status=b.fail_status,
                    headers=self._headers(),
                )
            resp = await (self._stream(request, body) if body.get("stream") else self._whole(request, body))
            finished = True
            self.served += 1
            return resp
        finally:
            self.active -= 1
            if not finished:
                self.cancelled += 1

    def _max_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_tokens", body.get("max_completion_tokens"))
        if isinstance(body.get("sampling_params"), dict):
            n = body["sampling_params"].get("max_new_tokens", n)
        return min(int(n), self.behaviour.stream_chunks) if isinstance(n, int) else self.behaviour.stream_chunks

    def _words(self, request: web.Request, body: dict[str, Any]) -> range:
        """Which words `tok{i}` this answer holds. The answer to a prompt is `tok0 tok1 ...` up to
        `stream_chunks` words; a request that continues one (chat with `continue_final_message`, or a
        completion prompt ending in `tok0 tok1 ... tok{k-1} `) gets the words from `tok{k}` on, as an
        engine continuing its own greedy output would."""
        first = 0
        if request.path.endswith("chat/completions"):
            messages = body.get("messages") or []
            if body.get("continue_final_message") and messages and isinstance(messages[-1], dict):
                first = _words_done(str(messages[-1].get("content") or ""))
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]
            at = prompt.find("tok0 ")
            first = _words_done(prompt[at:]) if at >= 0 else 0
        n = self._max_tokens(body) if first == 0 else body.get("max_tokens", body.get("max_completion_tokens"))
        end = self.behaviour.stream_chunks if not isinstance(n, int) else min(self.behaviour.stream_chunks, first + n)
        return range(first, max(first, end))

    def _kv_params(self, body: dict[str, Any]) -> dict[str, Any] | None:
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_decode") or self.behaviour.omit_kv_params:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0, 1],
            "remote_engine_id": f"{self.host}:1",
            "remote_host": self.host,
            "remote_port": 1,
            "remote_handshake_port": 2,
            "tp_size": 1,
            "dp_rank": 0,
            "transfer_id": "mock",
            "first_token_id": 7,
            "prefix_cache_hit_tokens": 0,
        }

    async def _whole(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        words = self._words(request, body)
        text = " ".join(f"tok{i}" for i in words)
        chat = request.path.endswith("chat/completions")
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        out: dict[str, Any] = {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "mock-model"),
            "choices": [choice],
            "usage": _usage(words),
        }
        kv = self._kv_params(body)
        if kv is not None:
            out["kv_transfer_params"] = kv
        return web.Response(body=orjson.dumps(out), content_type="application/json", headers=self._headers())

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        b = self.behaviour
        words = self._words(request, body)
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self._headers()})
        await resp.prepare(request)
        ident = {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "mock-model"),
        }
        if chat:  # the role event engines send first
            role = {
                **ident,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
            await resp.write(b"data: " + orjson.dumps(role) + b"\n\n")
        for sent, i in enumerate(words):
            if b.die_after_chunks is not None and sent >= b.die_after_chunks:
                assert request.transport is not None
                request.transport.close()
                return resp
            delta: dict[str, Any] = {"content": f"tok{i} "} if chat else {}
            choice: dict[str, Any] = (
                {"index": 0, "delta": delta, "finish_reason": None}
                if chat
                else {"index": 0, "text": f"tok{i} ", "finish_reason": None}
            )
            if i == words[-1]:
                choice["finish_reason"] = "length"
            await resp.write(b"data: " + orjson.dumps({**ident, "choices": [choice]}) + b"\n\n")
            if b.chunk_interval_secs:
                await asyncio.sleep(b.chunk_interval_secs)
        if b.die_after_chunks is not None and 0 < len(words) == b.die_after_chunks:
            assert request.transport is not None
            request.transport.close()  # the whole answer went out, its usage and [DONE] do not
            return resp
        if not words:  # nothing left to say: just the end
            end: dict[str, Any] = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
            await resp.write(b"data: " + orjson.dumps({**ident, "choices": [end]}) + b"\n\n")
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({**ident, "choices": [], "usage": _usage(words)}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok" if self.behaviour.health_status == 200 else "bad"},
            status=self.behaviour.health_status,
            headers=self._headers(),
        )

    async def _relayed(self, request: web.Request) -> web.StreamResponse:
        """The routes a gateway relays as they are: what was asked, echoed (Anthropic's events when streamed)."""
        body = orjson.loads(await request.read() or b"{}")
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append({"path": request.path, "body": body, "headers": headers, "at": time.time()})
        echo = {"object": "mock." + request.path.rsplit("/", 1)[-1], "model": body.get("model")}
        if body.get("stream") is not True:
            return web.json_response(echo, headers=self._headers())
        resp = web.StreamResponse(headers={**self._headers(), "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event, data in (
            ("message_start", {"type": "message_start", "message": echo}),
            ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}),
            ("message_stop", {"type": "message_stop"}),
        ):
            await resp.write(b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "owned_by": "mock"} for m in self.behaviour.models],
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        info = {
            "model_id": self.behaviour.models[0] if self.behaviour.models else None,
            "served_model_name": self.behaviour.models,
            "tp_size": 1,
            "dp_size": self.behaviour.dp_size,
            "mock": self.name,
        }
        if self.behaviour.dp_size is None:
            del info["dp_size"]
        return web.json_response(info)

    async def _kv_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"tp_size": 1, "dp_size": 1, "kv_role": self.behaviour.kv_role, "handshake_port": 6301}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            f"# TYPE atom:requests_running gauge\natom:requests_running {self.active}\n"
            f"# TYPE atom:requests_served_total counter\natom:requests_served_total {self.served}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _flush(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _requests(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(list(self.received)), content_type="application/json")

    async def _config(self, request: web.Request) -> web.Response:
        changes = orjson.loads(await request.read())
        known = {f.name for f in fields(MockBehaviour)}
        unknown = set(changes) - known
        if unknown:
            return web.json_response({"error": f"unknown settings {sorted(unknown)}"}, status=400)
        for k, v in changes.items():
            setattr(self.behaviour, k, v)
        return web.json_response(asdict(self.behaviour))


def _words_done(text: str) -> int:
    """How many words `tok0 tok1 ...` (in order, each followed by a space) `text` holds."""
    k = 0
    for word in text.split(" ")[:-1]:
        if word != f"tok{k}":
            break
        k += 1
    return k


def _usage(words: range) -> dict[str, int]:
    # The prompt is 3 tokens, plus one per word of a continued answer it carries.
    prompt = 3 + words.start
    return {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": prompt + len(words)}


_ATOM_DECODE_FIELDS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_handshake_port",
    "transfer_id",
    "first_token_id",
    "remote_dp_size",
    "remote_tp_size",
    "remote_dp_rank",
)
_VLLM_DECODE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port")
_VLLM_PREFILL_NULLS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def pd_protocol_problem(backend: str, role: str | None, body: dict[str, Any]) -> str | None:
    """What a real engine of `backend` would refuse in this request, or None (docs/pd.md)."""
    if backend == "sglang":
        for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            if key not in body:
                return f"sglang {role} leg without {key}"
        room = body["bootstrap_room"]
        rooms = room if isinstance(room, list) else [room]
        if not all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms):
            return "bootstrap_room must be a 63-bit integer"
        return None
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return f"{backend} {role} leg without kv_transfer_params"
    if role == "prefill":
        if params.get("do_remote_decode") is not True or params.get("do_remote_prefill") is not False:
            return "prefill leg must have do_remote_decode=true, do_remote_prefill=false"
        if body.get("max_tokens") != 1 or body.get("stream") is not False or "stream_options" in body:
            return "prefill leg must have max_tokens=1, stream=false and no stream_options"
        if "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
            return "prefill leg must have max_completion_tokens=1"
        if backend == "vllm" and any(k not in params or params[k] is not None for k in _VLLM_PREFILL_NULLS):
            return "vllm prefill leg must carry null remote_* fields"
        return None
    if not params.get("do_remote_prefill"):
        return "decode leg must carry the do_remote_prefill=true params prefill returned"
    missing = [k for k in (_ATOM_DECODE_FIELDS if backend == "atom" else _VLLM_DECODE_FIELDS) if k not in params]
    return f"decode leg kv_transfer_params lack {missing}" if missing else None


def main() -> None:
    parser = argparse.ArgumentParser(description="atomesh mock worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="mock")
    parser.add_argument("--latency-secs", type=float, default=0.0)
    parser.add_argument("--stream-chunks", type=int, default=4)
    parser.add_argument("--chunk-interval-secs", type=float, default=0.0)
    parser.add_argument("--kv-role", default=None)
    parser.add_argument("--pd-backend", choices=("atom", "sglang", "vllm"), default=None)
    parser.add_argument("--pd-role", choices=("prefill", "decode"), default=None)
    args = parser.parse_args()
    behaviour = MockBehaviour(
        latency_secs=args.latency_secs,
        stream_chunks=args.stream_chunks,
        chunk_interval_secs=args.chunk_interval_secs,
        kv_role=args.kv_role,
        pd_backend=args.pd_backend,
        pd_role=args.pd_role,
    )
    worker = MockWorker(args.name, args.host, args.port, behaviour)

    async def run() -> None:
        await worker.start()
        print(f"mock worker {args.name} on {worker.url}", flush=True)
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(run())


if __name__ == "__main__":
    main()
