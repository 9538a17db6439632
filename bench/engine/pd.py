"""``python -m bench.engine.pd``: the KV relay end to end, through a prefill and a decode engine.

Starts two ``engine.openai_server`` processes on free loopback ports, a ``kv_producer`` (prefill)
and a ``kv_consumer`` (decode), both with prefix caching off (every request prefills and moves its
whole prompt), once dense and once with ``--sparse-attention on`` (the indexer-key regions travel
too). For each prompt length (real text: slices of CPython's reference docs in the chat template,
sent as token ids; a distinct prompt for every request) it runs the relay as the gateway would:

1. prefill leg: ``POST /v1/completions`` with ``kv_transfer_params {do_remote_decode: true}``,
   ``max_tokens 1``, not streamed; timed (client side);
2. decode leg: the same prompt with the returned ``kv_transfer_params`` (plus ``remote_dp_size``,
   ``remote_tp_size``, ``remote_dp_rank``), ``max_tokens 2``, streamed. Its first chunk carries
   the prefill's token, once the KV has arrived; its second, the first token decode computed.

TTFT of the pair = prefill leg + decode leg's first chunk. It splits into prefill (the prefill leg),
transfer (the decode engine's ``atom:kv_transfer_pull_time_seconds_total``: its Mooncake pull, from
the handshake to the producer's reply, read before and after each request) and the rest of the
decode leg's first chunk (reserve, HTTP); "first decode step" is the time from the first chunk to
the second. Bytes moved per request = layers x blocks x (2 x unit bytes (K, V) + indexer unit bytes
when sparse), from the model's shape; GB/s = bytes / transfer time.

Raw: Mooncake's own throughput between two processes on the same loopback in the same run (this
process and a spawned child, through ``bench.engine.kv_transfer``'s helpers): one contiguous write
of the same byte count, timed inside the writer, ``--raw-repeats`` times right before each decode
leg (median). ``vs raw`` = transfer GB/s / raw GB/s (target >= 70%). Printed (and written as JSON
with ``--json``), never asserted.

On a GPU: ``--device cuda`` (both engines on the same GPU, each with ``--num-kvcache-blocks``
blocks; bfloat16 caches unless ``--dtype``), ``--memory-backend`` chooses how the KV moves (auto:
pinned host staging with the CPU-only Mooncake wheel) and ``--protocol`` which transport (left out:
``ipc``, the two engines share this host). ``bench.engine.pd_gpu`` runs this and the
transfer benchmark as one batch.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine.kv_transfer import _producer_main, make_caches
from bench.engine.sparse import build_prompts, document_ids
from engine.kv_transfer.mooncake import MooncakeAgent
from engine.models.loader import load_model

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 600) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stream_times(port: int, body: dict[str, Any]) -> tuple[float, float, list[str]]:
    """POST a streamed completion; returns (seconds to its first token chunk, to its last, texts)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    start = time.perf_counter()
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"decode leg: HTTP {resp.status}: {resp.read()[:500]!r}")
    stamps: list[float] = []
    texts: list[str] = []
    try:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"decode leg failed: {event['error']}")
            for choice in event.get("choices", []):
                if choice.get("text") or choice.get("finish_reason") or choice.get("logprobs"):
                    stamps.append(time.perf_counter() - start)
                    texts.append(choice.get("text", ""))
    finally:
        conn.close()
    if len(stamps) < 2:
        raise RuntimeError(f"decode leg: expected two token chunks, got {texts!r}")
    return stamps[0], stamps[1], texts


def metric(port: int, name: str) -> float:
    """Sum of a metric's samples (labels ignored) in an engine's /metrics."""
    status, text = request(port, "GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics on {port}: HTTP {status}")
    total = 0.0
    for line in text.decode().splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


class Engine:
    """One ``engine.openai_server`` child process; from the source tree ``tree`` when given (an older revision
    measured against this one), else from this checkout."""

    def __init__(
        self, role: str, extra: list[str], log_dir: str, kv_config: dict[str, Any] | None = None,
        tree: Path | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        config = {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(), **(kv_config or {})}
        self.argv = [sys.executable, "-m", "engine.openai_server", "--host", HOST, "--server-port", str(self.port),
                     "--kv-transfer-config", json.dumps(config), "--no-enable_prefix_caching", *extra]  # fmt: skip
        prefix = f"{tree.name}-" if tree is not None else ""
        self.log_path = os.path.join(log_dir, f"{prefix}{role}-{self.port}.log")
        self.log = open(self.log_path, "wb")  # closed in stop()
        env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
        self.proc = subprocess.Popen(self.argv, cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}): {self.tail()}")
            try:
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"engine not ready after {timeout}s: {self.tail()}")

    def tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RawPeer:
    """Mooncake's raw throughput: a child process writes one contiguous buffer into this one's."""

    def __init__(self, nbytes: int) -> None:
        # make_caches lays out KV + a 1-head indexer per block; size it to hold nbytes in one flat buffer.
        per_block = 30 * (2 * 16 * 3 * 64 + 64) * 4
        self.num_blocks = nbytes // per_block + 16
        self.caches = make_caches(self.num_blocks, torch.float32)
        self.agent = MooncakeAgent(HOST)
        self.agent.register(self.caches.regions)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, self.num_blocks, "fp32", "engine"), daemon=True)
        self.proc.start()
        self.conn.recv()  # the child is up

    def write_seconds(self, nbytes: int) -> float:
        assert nbytes <= self.caches.flat.numel()
        self.conn.send(("raw", self.agent.rpc_address, self.caches.flat.data_ptr(), nbytes))
        return float(self.conn.recv())

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(30)
        self.agent.close()


@dataclass(slots=True)
class Row:
    mode: str
    tokens: int
    blocks: int
    nbytes: int
    prefill_s: float
    transfer_s: float
    first_chunk_s: float
    decode_step_s: float
    raw_s: float

    def to_dict(self) -> dict[str, Any]:
        ttft = self.prefill_s + self.first_chunk_s
        gbs, raw_gbs = self.nbytes / self.transfer_s / 1e9, self.nbytes / self.raw_s / 1e9
        return {"mode": self.mode, "tokens": self.tokens, "blocks": self.blocks, "bytes": self.nbytes,
                "ttft_ms": ttft * 1e3, "prefill_ms": self.prefill_s * 1e3, "transfer_ms": self.transfer_s * 1e3,
                "decode_leg_rest_ms": (self.first_chunk_s - self.transfer_s) * 1e3,
                "first_decode_step_ms": self.decode_step_s * 1e3, "transfer_share_of_ttft": self.transfer_s / ttft,
                "gb_s": gbs, "raw_gb_s": raw_gbs, "vs_raw": gbs / raw_gbs}  # fmt: skip

    def cells(self) -> str:
        gbs, raw_gbs = self.nbytes / self.transfer_s / 1e9, self.nbytes / self.raw_s / 1e9
        ttft = self.prefill_s + self.first_chunk_s
        return (f"| {self.mode} | {self.tokens} | {self.blocks} | {self.nbytes / 2**20:.1f} | "
                f"{ttft * 1e3:.0f} | {self.prefill_s * 1e3:.0f} | {self.transfer_s * 1e3:.1f} | "
                f"{(self.first_chunk_s - self.transfer_s) * 1e3:.1f} | {self.decode_step_s * 1e3:.0f} | "
                f"{gbs:.2f} | {raw_gbs:.2f} | {gbs / raw_gbs:.0%} |")  # fmt: skip


HEADER = ("| mode | prompt tokens | blocks | MiB moved | TTFT ms | prefill ms | transfer ms | decode leg rest ms "
          "| first decode step ms | GB/s | raw GB/s | vs raw |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")  # fmt: skip


def run_mode(mode: str, engine_args: list[str], prompts: dict[int, list[list[int]]], layer_bytes: tuple[int, int, int],
             raw: RawPeer, a: argparse.Namespace, log_dir: str) -> list[Row]:  # fmt: skip
    sparse = ["--sparse-attention", "on", "--sparse-topk-blocks", str(a.topk)] if mode == "sparse" else []
    kv_config = {"memory_backend": a.memory_backend, "staging_buffer_mb": a.staging_mb}
    if a.protocol:
        kv_config["protocol"] = a.protocol
    prefill = Engine("kv_producer", engine_args + sparse, log_dir, kv_config)
    decode = Engine("kv_consumer", engine_args + sparse, log_dir, kv_config)
    layers, unit, idx_unit = layer_bytes
    rows: list[Row] = []
    try:
        prefill.wait_ready()
        decode.wait_ready()
        info = json.loads(request(decode.port, "GET", "/kv_transfer_info")[1])
        print(f"[{mode}] prefill :{prefill.port}, decode :{decode.port}, kv_transfer_info(decode)={info}", flush=True)
        warm = prompts[min(prompts)][-1][:256]
        for i, (_, batch) in enumerate([(0, [warm]), *sorted(prompts.items())]):
            for r, ids in enumerate(batch):
                blocks = (len(ids) + 15) // 16
                nbytes = layers * blocks * (2 * unit + (idx_unit if mode == "sparse" else 0))
                row = one_request(prefill.port, decode.port, ids, nbytes, raw, a.raw_repeats)
                row.mode, row.blocks = mode, blocks
                if i == 0:
                    continue  # warm-up (first request of a fresh engine pair)
                rows.append(row)
                print(row.cells() + (f" (repeat {r + 1})" if len(batch) > 1 else ""), flush=True)
        pulled = metric(decode.port, "atom:kv_transfer_pulled_total")
        released = metric(prefill.port, "atom:kv_transfer_released_total")
        print(f"[{mode}] decode pulled {pulled:.0f}, prefill released {released:.0f}", flush=True)
    except Exception:
        print(f"--- prefill log ---\n{prefill.tail()}\n--- decode log ---\n{decode.tail()}", file=sys.stderr)
        raise
    finally:
        prefill.stop()
        decode.stop()
    return rows


def one_request(prefill: int, decode: int, ids: list[int], nbytes: int, raw: RawPeer, raw_repeats: int) -> Row:
    # logprobs: every token is an event, also one whose text is held back (random-weight shapes whose vocabulary
    # outgrows the borrowed tokenizer draw tokens that decode to nothing).
    body: dict[str, Any] = {"prompt": ids, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    start = time.perf_counter()
    status, answer = request(prefill, "POST", "/v1/completions", {
        **body, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})  # fmt: skip
    prefill_s = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"prefill leg: HTTP {status}: {answer[:500]!r}")
    kv = json.loads(answer)["kv_transfer_params"]
    raw_s = statistics.median(raw.write_seconds(nbytes) for _ in range(raw_repeats))
    pulled_before = metric(decode, "atom:kv_transfer_pull_time_seconds_total")
    first, second, _ = stream_times(decode, {
        **body, "max_tokens": 2, "stream": True,
        "kv_transfer_params": {**kv, "remote_dp_size": 1, "remote_tp_size": 1, "remote_dp_rank": 0}})  # fmt: skip
    transfer_s = metric(decode, "atom:kv_transfer_pull_time_seconds_total") - pulled_before
    return Row("", len(ids), 0, nbytes, prefill_s, transfer_s, first, second - first, raw_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine.pd", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000], help="prompt tokens")
    p.add_argument("--modes", nargs="+", choices=["dense", "sparse"], default=["dense", "sparse"])
    p.add_argument("--repeats", type=int, default=1, help="requests per length and mode (distinct prompts)")
    p.add_argument("--raw-repeats", type=int, default=3, help="raw writes (median) before each decode leg")
    p.add_argument("--topk", type=int, default=16, help="--sparse-topk-blocks of the sparse engines")
    p.add_argument("--kv-cache-memory-gb", default="2")
    p.add_argument("--max-model-len", default="8192")
    p.add_argument("--engine-arg", action="append", default=[], help="extra flag for both engines (repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the engines' device")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the engines' dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--num-kvcache-blocks",
        type=int,
        default=None,
        help="KV blocks per engine (on CUDA, two engines share the GPU: set it)",
    )
    p.add_argument("--memory-backend", choices=["auto", "direct", "staged"], default="auto")
    p.add_argument("--staging-mb", type=int, default=128, help="staging_buffer_mb of both engines")
    p.add_argument(
        "--protocol",
        choices=["ipc", "tcp", "rdma"],
        default=None,
        help="both engines' protocol (default: chosen: ipc, the engines sharing this host)",
    )
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    a = p.parse_args(argv)

    loaded = load_model(a.model)
    cfg = loaded.config
    doc = document_ids(loaded.tokenizer)
    prompts = {n: build_prompts(loaded.tokenizer, doc, n, a.repeats) for n in a.lengths}
    dtype = a.dtype if a.dtype != "auto" else ("float32" if a.device == "cpu" else "bfloat16")
    elem = 4 if dtype == "float32" else 2  # the engines' cache dtype is the model dtype
    unit = 16 * cfg.num_key_value_heads * cfg.head_dim * elem
    idx_unit = cfg.num_key_value_heads * cfg.head_dim * elem
    layer_bytes = (cfg.num_hidden_layers, unit, idx_unit)
    del loaded
    engine_args = ["--model", a.model, "--device", a.device, "--dtype", dtype, "--kv-cache-memory-gb",
                   a.kv_cache_memory_gb, "--max-model-len", a.max_model_len, *a.engine_arg]  # fmt: skip
    if a.num_kvcache_blocks:
        engine_args += ["--num-kvcache-blocks", str(a.num_kvcache_blocks)]
    most = cfg.num_hidden_layers * ((max(a.lengths) + 15) // 16) * (2 * unit + idx_unit)
    raw = RawPeer(most)
    print(f"model={a.model} ({cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads x {cfg.head_dim}, "
          f"{dtype} cache, block 16: {unit} B per block per layer for K and for V, indexer {idx_unit} B); "
          f"engines: {' '.join(engine_args)}; raw: median of {a.raw_repeats} writes per request",
          flush=True)  # fmt: skip
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_pd-") as log_dir:
            for mode in a.modes:
                rows += run_mode(mode, engine_args, prompts, layer_bytes, raw, a, log_dir)
    finally:
        raw.close()
    print()
    print(HEADER)
    for row in rows:
        print(row.cells())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m bench.engine.pd", "args": vars(a), "engine_args": engine_args,
                       "rows": [r.to_dict() for r in rows]}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
