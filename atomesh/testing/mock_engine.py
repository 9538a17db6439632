"""A mock inference engine whose timing depends on where requests land: for placement studies.

Each engine has an LRU prefix cache of fixed capacity (blocks of `block_tokens` tokens; a token is
approximated as 4 characters of the prompt text), one prefill lane (requests queue FIFO for it;
prefill takes `prefill_secs_per_token` per *uncached* token) and a decode phase whose time per token
grows with the number of sequences decoding at once (`decode_secs_base + decode_secs_per_seq * batch`).
So a router that keeps a prompt prefix on one engine gets prefix hits and short TTFTs, and one that
piles requests on one engine gets queueing.

It speaks enough of SGLang's and ATOM's HTTP surface for atomesh and SGLang's router (`smg`,
`sglang-router`) to use it: `/health`, `/health_generate`, `/v1/models`, `/get_server_info`,
`/server_info`, `/get_model_info`, `/model_info`, `/get_load`, `/metrics`, `/flush_cache`,
`/generate`, `/v1/completions`, `/v1/chat/completions` (streamed or not). Prefix hits are reported in
each answer (`usage.prompt_tokens_details.cached_tokens`, `meta_info.cached_tokens` on /generate,
the `x-mock-cached-tokens` header), in `/metrics` and in `GET /_mock/stats`; `POST /_mock/reset`
empties the cache and the counters. Paths it does not serve are recorded in `stats.unknown_paths`.

In-process: `MockEngine(...).start()`; as a process hosting several engines:
`python -m atomesh.testing.mock_engine --ports 8001 8002 --cache-blocks 2048`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import xxhash
from aiohttp import web

from atomesh.testing.mock_worker import ServedApp

CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class EngineSettings:
    """Capacity and speed of one mock engine."""

    cache_blocks: int = 2048  # prefix-cache capacity, in blocks
    block_tokens: int = 16
    prefill_secs_base: float = 0.002
    prefill_secs_per_token: float = 0.00002  # per uncached token: 50k tokens/s
    decode_secs_base: float = 0.004
    decode_secs_per_seq: float = 0.0002
    max_tokens_default: int = 16
    model: str = "mock-model"


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    running: int = 0  # in prefill or decode
    waiting: int = 0  # queued for the prefill lane
    max_running: int = 0


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The text the engine prefills: a chat's whole conversation, a prompt, or /generate's text or ids."""
    if path.endswith("chat/completions"):
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                c = m.get("content")
                if isinstance(c, list):
                    c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
                parts.append(f"<|{m.get('role', '')}|>{c if isinstance(c, str) else ''}")
        return "".join(parts) + "<|assistant|>"
    p = body.get("prompt", body.get("text"))
    if isinstance(p, list):
        p = p[0] if p and isinstance(p[0], str) else " ".join(map(str, p))
    if isinstance(p, str):
        return p
    ids = body.get("input_ids")
    return " ".join(map(str, ids)) if isinstance(ids, list) else ""


class PrefixCache:
    """LRU cache of prompt blocks, keyed by chained block hashes (as a paged KV cache with prefix reuse)."""

    def __init__(self, capacity_blocks: int, block_chars: int) -> None:
        self.capacity = capacity_blocks
        self.block_chars = block_chars
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, text: str) -> list[int]:
        data = text.encode()
        out, h = [], 0
        for i in range(0, len(data) - self.block_chars + 1, self.block_chars):  # full blocks only
            h = xxhash.xxh3_64_intdigest(data[i : i + self.block_chars], h)
            out.append(h)
        return out

    def lookup(self, hashes: list[int]) -> int:
        """Leading blocks already cached (touched as used)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def store(self, hashes: list[int]) -> None:
        for h in hashes[-self.capacity :] if self.capacity else ():
            self._blocks[h] = None
            self._blocks.move_to_end(h)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class MockEngine(ServedApp):
    """One mock engine server on a loopback port."""

    def __init__(
        self, name: str = "engine", host: str = "127.0.0.1", port: int = 0, settings: EngineSettings | None = None
    ) -> None:
        super().__init__(host, port)
        self.name = name
        self.settings = settings or EngineSettings()
        s = self.settings
        self.cache = PrefixCache(s.cache_blocks, s.block_tokens * CHARS_PER_TOKEN)
        self.stats = EngineStats()
        self.unknown_paths: Counter[str] = Counter()
        self._prefill_lane = asyncio.Lock()
        self._decoding = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.router.add_post(path, self._inference)
        for path in ("/health", "/health_generate", "/liveness", "/readiness"):
            app.router.add_get(path, self._health)
        app.router.add_get("/v1/models", self._models)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self._server_info)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self._model_info)
        app.router.add_get("/get_load", self._get_load)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_get("/flush_cache", self._flush)
        app.router.add_get("/_mock/stats", self._stats)
        app.router.add_post("/_mock/reset", self._reset)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    def reset(self) -> None:
        self.cache.clear()
        self.stats = EngineStats()
        self.unknown_paths.clear()

    def describe(self) -> dict[str, Any]:
        st = asdict(self.stats)
        st.update(
            name=self.name,
            url=self.url,
            cache_blocks_used=len(self.cache),
            hit_rate=self.stats.cached_tokens / self.stats.prompt_tokens if self.stats.prompt_tokens else 0.0,
            unknown_paths=dict(self.unknown_paths),
        )
        return st

    # ------------------------------------------------------------------ the engine model
    async def _prefill(self, text: str) -> tuple[int, int]:
        """Queue for the prefill lane, compute the uncached part; returns (prompt_tokens, cached_tokens)."""
        s = self.settings
        hashes = self.cache.hashes(text)
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        st = self.stats
        st.waiting += 1
        queued = True
        try:
            async with self._prefill_lane:
                st.waiting -= 1
                queued = False
                st.running += 1
                st.max_running = max(st.max_running, st.running)
                try:
                    cached = min(self.cache.lookup(hashes) * s.block_tokens, prompt_tokens)
                    await asyncio.sleep(s.prefill_secs_base + (prompt_tokens - cached) * s.prefill_secs_per_token)
                    self.cache.store(hashes)
                except BaseException:
                    st.running -= 1
                    raise
        finally:
            if queued:
                st.waiting -= 1
        st.requests += 1
        st.prompt_tokens += prompt_tokens
        st.cached_tokens += cached
        return prompt_tokens, cached

    async def _decode_step(self) -> None:
        s = self.settings
        await asyncio.sleep(s.decode_secs_base + s.decode_secs_per_seq * self._decoding)

    # ------------------------------------------------------------------ handlers
    def _max_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_tokens", body.get("max_completion_tokens"))
        sp = body.get("sampling_params")
        if isinstance(sp, dict):
            n = sp.get("max_new_tokens", n)
        return max(1, int(n)) if isinstance(n, int) else self.settings.max_tokens_default

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response(
                {"error": {"message": "bad json", "type": "invalid_request_error", "code": 400}}, status=400
            )
        path = request.path
        stats = self.stats
        prompt_tokens, cached = await self._prefill(prompt_text(path, body))
        self._decoding += 1
        try:
            n = self._max_tokens(body)
            headers = {"x-mock-worker": self.name, "x-mock-cached-tokens": str(cached)}
            if body.get("stream"):
                return await self._stream(request, body, n, prompt_tokens, cached, headers)
            for _ in range(n - 1):
                await self._decode_step()
            return web.Response(
                body=orjson.dumps(self._answer(path, body, n, prompt_tokens, cached)),
                content_type="application/json",
                headers=headers,
            )
        finally:
            stats.running -= 1
            self._decoding -= 1

    def _answer(self, path: str, body: dict[str, Any], n: int, prompt_tokens: int, cached: int) -> dict[str, Any]:
        text = " ".join(f"t{i}" for i in range(n))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if path == "/generate":
            return {
                "text": text,
                "meta_info": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "cached_tokens": cached,
                    "finish_reason": {"type": "length"},
                    "id": self.name,
                },
            }
        chat = path.endswith("chat/completions")
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return {
            "id": f"cmpl-{self.name}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", self.settings.model),
            "choices": [choice],
            "usage": usage,
        }

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        n: int,
        prompt_tokens: int,
        cached: int,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        path = request.path
        chat = path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        for i in range(n):
            if i:
                await self._decode_step()
            last = i == n - 1
            event: dict[str, Any]
            if path == "/generate":
                event = {
                    "text": " ".join(f"t{k}" for k in range(i + 1)),
                    "meta_info": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": i + 1,
                        "cached_tokens": cached,
                        "finish_reason": {"type": "length"} if last else None,
                    },
                }
            elif chat:
                event = {
                    "id": f"cmpl-{self.name}",
                    "object": "chat.completion.chunk",
                    "model": body.get("model", self.settings.model),
                    "choices": [
                        {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "length" if last else None}
                    ],
                }
            else:
                event = {
                    "id": f"cmpl-{self.name}",
                    "object": "text_completion",
                    "model": body.get("model", self.settings.model),
                    "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": "length" if last else None}],
                }
            if last and path != "/generate":
                event["usage"] = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.settings.model, "object": "model", "owned_by": "mock", "root": self.settings.model}
                ],
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        m = self.settings.model
        return web.json_response(
            {
                "model_path": m,
                "tokenizer_path": m,
                "served_model_name": m,
                "model_id": m,
                "tp_size": 1,
                "dp_size": 1,
                "page_size": self.settings.block_tokens,
                "max_total_num_tokens": self.settings.cache_blocks * self.settings.block_tokens,
                "disaggregation_mode": "null",
                "version": "mock",
                "mock": self.name,
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        m = self.settings.model
        return web.json_response(
            {
                "model_path": m,
                "tokenizer_path": m,
                "is_generation": True,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def _get_load(self, request: web.Request) -> web.Response:
        st = self.stats
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": st.running + st.waiting,
                    "num_waiting_reqs": st.waiting,
                    "num_tokens": len(self.cache) * self.settings.block_tokens,
                }
            ]
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        st = self.stats
        lines = []
        for name, value in (
            ("atom:requests_running", st.running),
            ("atom:requests_waiting", st.waiting),
            ("sglang:num_running_reqs", st.running),
            ("sglang:num_queue_reqs", st.waiting),
        ):
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        for name, value in (
            ("mock:prompt_tokens_total", st.prompt_tokens),
            ("mock:cached_tokens_total", st.cached_tokens),
            ("mock:requests_total", st.requests),
        ):
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _flush(self, request: web.Request) -> web.Response:
        self.cache.clear()
        return web.json_response({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.describe()), content_type="application/json")

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"status": "ok"})

    async def _unknown(self, request: web.Request) -> web.Response:
        self.unknown_paths[f"{request.method} {request.path}"] += 1
        return web.json_response(
            {"error": {"message": f"mock engine does not serve {request.path}", "type": "not_found", "code": 404}},
            status=404,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="atomesh mock engine (placement studies)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ports", type=int, nargs="+", required=True)
    defaults = EngineSettings()
    for name in (
        "cache_blocks",
        "block_tokens",
        "prefill_secs_base",
        "prefill_secs_per_token",
        "decode_secs_base",
        "decode_secs_per_seq",
        "max_tokens_default",
    ):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args()
    settings = {
        k: getattr(args, k)
        for k in (
            "cache_blocks",
            "block_tokens",
            "prefill_secs_base",
            "prefill_secs_per_token",
            "decode_secs_base",
            "decode_secs_per_seq",
            "max_tokens_default",
        )
    }

    async def run() -> None:
        engines = [
            MockEngine(f"e{i}", args.host, port, EngineSettings(**settings)) for i, port in enumerate(args.ports)
        ]
        for e in engines:
            await e.start()
        print("mock engines on " + " ".join(e.url for e in engines), flush=True)
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(run())


if __name__ == "__main__":
    main()
