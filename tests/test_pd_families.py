"""P/D with the model families beyond Llama: a Qwen3 and a Qwen3-MoE checkpoint (tiny, random, written with
transformers' own classes) served by a prefill and a decode engine behind the gateway's atom relay, KV over a
real Mooncake transfer on loopback: the generations equal a colocated engine's, streamed or not, and both block
pools go back to idle."""

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
from tests.test_pd_engine import _complete as complete  # (text, completion tokens), streamed or not

require("mooncake.engine", "P/D engines relay KV over Mooncake")

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
PROMPTS = [" ".join(f"t{(7 * i + 3) % 300}" for i in range(n)) for n in (3, 37)]  # one block, then several


def engine(name: str, folder: Path, role: str | None) -> EngineProcess:
    args = [sys.executable, "-m", "engine.openai_server", "--model", str(folder), "--served-model-name", "tiny",
            "--device", DEVICE, "--host", "127.0.0.1", "--num-kvcache-blocks", "128", "--block-size", "4",
            "--max-model-len", "256", "--torch-threads", "1"]  # fmt: skip
    if role is not None:
        cfg = {"kv_role": role, "kv_connector": "mooncake", "handshake_port": free_port(),
               "memory_backend": "staged", "staging_buffer_mb": 1}  # fmt: skip
        args += ["--kv-transfer-config", json.dumps(cfg)]
    return EngineProcess(name, args, env={**os.environ, "MC_TRANSFER_TIMEOUT": "5"})


def greedy(prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
async def test_pd_equals_colocated(family: str, tmp_path: Path, gateway: MakeGateway) -> None:
    checkpoint(family, tmp_path)
    started = {name: engine(f"{family}-{name}", tmp_path, role)
               for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"), ("single", None))}  # fmt: skip
    try:
        for e in started.values():
            e.wait_up()
        p, d, single = started["prefill"], started["decode"], started["single"]
        gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                           request_timeout_secs=60)  # fmt: skip
        async with aiohttp.ClientSession() as s:
            for prompt in PROMPTS:
                for stream in (False, True):
                    want = await complete(s, single.url, greedy(prompt, stream))
                    assert await complete(s, base_url(gw), greedy(prompt, stream)) == want, (prompt[:12], stream)
                    assert want[1] == 12
        assert d.metric("atom:kv_transfer_pulled_total") >= 4
        deadline = time.monotonic() + 20
        while p.metric("atom:kv_cache_blocks_used") or d.metric("atom:kv_cache_blocks_used"):
            assert time.monotonic() < deadline, "block pools did not go back to idle"
            time.sleep(0.1)
    finally:
        for e in started.values():
            e.stop()
