"""A mock worker cheap enough that a gateway benchmark measures the gateway, not the mock.

`python -m atomesh.testing.fast_mock --port 8001 [--role regular|prefill|decode]` serves the inference
routes (`/v1/completions`, `/v1/chat/completions`, `/generate`) with canned answers from a bare
uvloop `asyncio.Protocol` HTTP/1.1 server (keep-alive, Content-Length request bodies): a small JSON
completion, or with `"stream": true` an SSE stream of `--stream-chunks` events written one event per
event-loop turn (streams interleave, as a batching engine's do), chunked, then `data: [DONE]`.
`--event-interval-ms N` spaces a stream's events N ms apart instead, as an engine's decode steps are
(a gateway then relays each event on its own wake-up, not in bursts).

P/D: a `prefill` or `decode` worker speaks both protocols the benchmark needs and refuses (400) a leg
that follows neither: ATOM's relay (`kv_transfer_params`; a prefill leg with `do_remote_decode` gets
`kv_transfer_params` back) and SGLang's dual dispatch (`bootstrap_host/port/room` on both legs).
The GET routes gateways probe at registration (`/health`, `/v1/models`, `/server_info`, ...) answer
small fixed documents. Features of `atomesh.testing.mock_worker` (failures, recording) are left out
on purpose: use that one for behaviour tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson

from atomesh.flow import FlowControl

MODEL = "mock-model"
INFERENCE = frozenset({b"/v1/completions", b"/v1/chat/completions", b"/generate"})
_MAX_HEAD = 64 * 1024


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _json(status: str, doc: object) -> bytes:
    return _response(status, orjson.dumps(doc))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Canned:
    """Every answer the mock gives, encoded once."""

    def __init__(self, name: str, role: str, tokens: int, stream_chunks: int, bootstrap_port: int | None) -> None:
        text = " ".join(f"tok{i}" for i in range(tokens))
        usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
        self.completion = _json(
            "200 OK",
            {
                "id": f"cmpl-{name}",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            },
        )
        self.chat = _json(
            "200 OK",
            {
                "id": f"chat-{name}",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage,
            },
        )
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0, 1],
            "remote_engine_id": f"{name}:1",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "remote_handshake_port": 2,
            "tp_size": 1,
            "dp_rank": 0,
            "transfer_id": "mock",
            "first_token_id": 7,
            "prefix_cache_hit_tokens": 0,
        }
        self.prefill = _json(
            "200 OK",
            {
                "id": f"cmpl-{name}",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": "tok0", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
                "kv_transfer_params": kv,
            },
        )
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        events = []
        for i in range(stream_chunks):
            last = i == stream_chunks - 1
            event: dict[str, object] = {
                "id": f"cmpl-{name}",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": "length" if last else None}],
            }
            if last:
                event["usage"] = {
                    "prompt_tokens": 8,
                    "completion_tokens": stream_chunks,
                    "total_tokens": 8 + stream_chunks,
                }
            events.append(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
        self.events = events
        self.stream_tail = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.health = _json("200 OK", {"status": "ok"})
        self.models = _json(
            "200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock", "root": MODEL}]}
        )
        mode = {"prefill": "prefill", "decode": "decode"}.get(role, "null")
        self.server_info = _json(
            "200 OK",
            {
                "model_path": MODEL,
                "tokenizer_path": MODEL,
                "served_model_name": MODEL,
                "model_id": MODEL,
                "tp_size": 1,
                "dp_size": 1,
                "disaggregation_mode": mode,
                "version": "mock",
                "mock": name,
                **({"disaggregation_bootstrap_port": bootstrap_port} if bootstrap_port else {}),
            },
        )
        self.model_info = _json(
            "200 OK",
            {
                "model_path": MODEL,
                "tokenizer_path": MODEL,
                "is_generation": True,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            },
        )
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(role)
        self.kv_info = _json("200 OK", {"tp_size": 1, "dp_size": 1, "kv_role": kv_role, "handshake_port": 6301})
        self.load = _json("200 OK", [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
        self.metrics = _response(
            "200 OK", b"# TYPE atom:requests_running gauge\natom:requests_running 0\n", b"text/plain"
        )
        self.not_found = _json("404 Not Found", {"error": {"message": "not found", "type": "not_found", "code": 404}})
        self.gets = {
            b"/health": self.health,
            b"/health_generate": self.health,
            b"/readiness": self.health,
            b"/liveness": self.health,
            b"/v1/models": self.models,
            b"/server_info": self.server_info,
            b"/get_server_info": self.server_info,
            b"/get_model_info": self.model_info,
            b"/model_info": self.model_info,
            b"/kv_transfer_info": self.kv_info,
            b"/get_load": self.load,
            b"/metrics": self.metrics,
            b"/flush_cache": self.health,
        }


def _bad(message: str) -> bytes:
    return _json("400 Bad Request", {"error": {"message": message, "type": "invalid_request_error", "code": 400}})


class MockProtocol(FlowControl):
    """One client connection: parse requests off the buffer, answer from the canned set."""

    __slots__ = ("_buf", "_canned", "_closed", "_interval", "_loop", "_pd", "_resume", "_role", "_stream_at")

    def __init__(self, canned: Canned, role: str, interval: float = 0.0) -> None:
        super().__init__()
        self._interval = interval  # seconds between a stream's events; 0: one event per loop turn
        self._canned = canned
        self._role = role
        self._pd = role in ("prefill", "decode")
        self._buf = b""
        self._loop = asyncio.get_running_loop()
        self._stream_at = -1  # index of the next SSE event to write; -1: not streaming
        self._resume = False  # a stream waits for the transport to take more
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.connection_ended()

    def writing_resumed(self) -> None:
        if self._resume:
            self._resume = False
            self._loop.call_soon(self._next_event)

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if self._stream_at < 0:
            self._parse()

    def _parse(self) -> None:
        assert self.transport is not None
        while self._buf and self._stream_at < 0:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self.transport.close()
                return
            head = buf[:end]
            line_end = head.find(b"\r\n")
            request_line = head[:line_end] if line_end >= 0 else head
            parts = request_line.split(b" ")
            if len(parts) != 3:
                self.transport.close()
                return
            method, target = parts[0], parts[1]
            length = 0
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : stop if stop >= 0 else len(lower)])
            if len(buf) < end + 4 + length:
                return
            body = buf[end + 4 : end + 4 + length]
            self._buf = buf[end + 4 + length :]
            path = target.split(b"?", 1)[0]
            if method == b"POST" and path in INFERENCE:
                self._inference(path, body)
            elif method == b"GET" or path == b"/flush_cache":
                self.transport.write(self._canned.gets.get(path, self._canned.not_found))
            else:
                self.transport.write(self._canned.not_found)

    def _inference(self, path: bytes, body: bytes) -> None:
        assert self.transport is not None
        c = self._canned
        if self._pd:
            if b'"kv_transfer_params"' in body:  # ATOM's relay
                if self._role == "prefill":
                    if b'"do_remote_decode":true' not in body or b'"stream":false' not in body:
                        self.transport.write(_bad("prefill leg must have do_remote_decode=true, stream=false"))
                        return
                    self.transport.write(c.prefill)
                    return
                if b'"do_remote_prefill":true' not in body:
                    self.transport.write(_bad("decode leg without prefill's kv_transfer_params"))
                    return
            elif b'"bootstrap_room"' not in body:  # neither ATOM nor SGLang dual dispatch
                self.transport.write(_bad(f"{self._role} leg without kv_transfer_params or bootstrap_room"))
                return
        if b'"stream":true' in body or b'"stream": true' in body:
            self.transport.write(c.stream_head)
            self._stream_at = 0
            self._schedule()
            return
        self.transport.write(c.chat if path == b"/v1/chat/completions" else c.completion)

    def _schedule(self) -> None:
        if self._interval:
            self._loop.call_later(self._interval, self._next_event)
        else:
            self._loop.call_soon(self._next_event)

    def _next_event(self) -> None:
        """Write one SSE event, then give the loop to the other streams (one event per turn)."""
        if self._closed or self.transport is None:
            return
        if self.write_paused:
            self._resume = True
            return
        events = self._canned.events
        i = self._stream_at
        if i < len(events):
            self.transport.write(events[i])
            self._stream_at = i + 1
            self._schedule()
            return
        self.transport.write(self._canned.stream_tail)
        self._stream_at = -1
        if self._buf:
            self._parse()


async def serve(host: str, port: int, canned: Canned, role: str, interval: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: MockProtocol(canned, role, interval), host, port, reuse_address=True, backlog=4096
    )
    print(f"fast mock {role} on http://{host}:{port} (pid {os.getpid()})", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="atomesh fast mock worker (gateway benchmarks)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fast")
    p.add_argument("--role", choices=("regular", "prefill", "decode"), default="regular")
    p.add_argument("--tokens", type=int, default=16, help="tokens in a non-streamed answer")
    p.add_argument("--stream-chunks", type=int, default=256, help="SSE events in a streamed answer")
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument(
        "--event-interval-ms",
        type=float,
        default=0.0,
        help="ms between a stream's events (default 0: one event per event-loop turn)",
    )
    args = p.parse_args(argv)
    canned = Canned(args.name, args.role, args.tokens, args.stream_chunks, args.bootstrap_port)
    import uvloop

    uvloop.run(serve(args.host, args.port, canned, args.role, args.event_interval_ms / 1000))


if __name__ == "__main__":
    main()
