"""P/D between tensor-parallel engines: a TP=2 prefill and a TP=2 decode engine (each rank 1 in its own process,
gloo on CPU) behind the gateway's atom relay, KV over a real Mooncake transfer on loopback (rank r's KV heads from
the prefill rank r to the decode rank r). Greedy generations, streamed or not, give the same tokens, with logprobs
within 1e-4, as one colocated engine on one rank (fp32): a dense (Qwen3) checkpoint with tensor parallelism, an MoE
(Qwen3-MoE) one with expert parallelism."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gwtest import EngineProcess, MakeGateway, base_url, free_port, require

from tests.engine.test_model_families import checkpoint

require("mooncake.engine", "P/D engines relay KV over Mooncake")

PROMPTS = [" ".join(f"t{(7 * i + 3) % 300}" for i in range(n)) for n in (3, 37)]  # one block, then several
TOLERANCE = 1e-4
# family -> the parallel flags of its P/D pair
CASES = {"qwen3": ["-tp", "2"], "qwen3-moe": ["-tp", "2", "--enable-expert-parallel"]}


def engine(name: str, folder: Path, role: str | None, parallel: list[str]) -> EngineProcess:
    args = [sys.executable, "-m", "engine.openai_server", "--model", str(folder), "--served-model-name", "tiny",
            "--device", "cpu", "--host", "127.0.0.1", "--num-kvcache-blocks", "128", "--block-size", "4",
            "--max-model-len", "256", "--torch-threads", "1", *parallel]  # fmt: skip
    if role is not None:
        cfg = {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(),
               "memory_backend": "staged", "staging_buffer_mb": 1}  # fmt: skip
        args += ["--kv-transfer-config", json.dumps(cfg)]
    return EngineProcess(name, args, env={**os.environ, "MC_TRANSFER_TIMEOUT": "5"})


Answer = tuple[list[str], list[float]]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, stream: bool) -> Answer:
    """(tokens, their logprobs) of a greedy completion of 12 tokens, streamed or not."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                            "logprobs": 0}  # fmt: skip
    if stream:
        body["stream"] = True
    tokens: list[str] = []
    logprobs: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            choice = (await r.json())["choices"][0]
            return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    if choice.get("logprobs"):
                        tokens += choice["logprobs"]["tokens"]
                        logprobs += choice["logprobs"]["token_logprobs"]
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(CASES))
async def test_parallel_pd_equals_one_rank(family: str, tmp_path: Path, gateway: MakeGateway) -> None:
    checkpoint(family, tmp_path)
    parallel = CASES[family]
    started = {name: engine(f"{family}-tp-{name}", tmp_path, role, flags)
               for name, role, flags in (("prefill", "kv_producer", parallel), ("decode", "kv_consumer", parallel),
                                         ("single", None, []))}  # fmt: skip
    try:
        for e in started.values():
            e.wait_up(timeout=180)
        p, d, single = started["prefill"], started["decode"], started["single"]
        gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                           request_timeout_secs=60)  # fmt: skip
        async with aiohttp.ClientSession() as s:
            async with s.get(d.url + "/kv_transfer_info") as r:
                assert (await r.json())["tp_size"] == 2
            for prompt in PROMPTS:
                for stream in (False, True):
                    want_tokens, want_logprobs = await complete(s, single.url, prompt, stream)
                    tokens, logprobs = await complete(s, base_url(gw), prompt, stream)
                    assert tokens == want_tokens and len(tokens) == 12, (prompt[:12], stream)
                    gap = max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True))
                    assert gap < TOLERANCE, (prompt[:12], stream, gap)
        assert d.metric("atom:kv_transfer_pulled_total") >= 4
        deadline = time.monotonic() + 20
        while p.metric("atom:kv_cache_blocks_used") or d.metric("atom:kv_cache_blocks_used"):
            assert time.monotonic() < deadline, "block pools did not go back to idle"
            time.sleep(0.1)
    finally:
        for e in started.values():
            e.stop()
