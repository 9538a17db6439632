"""P/D end to end over the intra-host path (protocol ipc): prefill and decode engines of one host, the
decode engine mapping the prefill engine's KV pools (shared memory on CPU, CUDA IPC on a GPU) and copying
each request's blocks itself. Generations must equal a single colocated engine token for token, dense and
sparse (indexer keys); the faults of tests/test_pd_engine.py are checked again for this path, each for
leaked KV blocks.

The dense producer leaves ``protocol`` out (chosen: ipc, since the decode engine shares its host), the
dense decode engine forces it; the sparse pair the other way round.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, base_url, require

from tests.test_pd_engine import PROMPTS, Engine, _complete, _greedy, post, same_as_colocated, wait_until

require("mooncake.engine", "P/D engines start a Mooncake agent")

SPARSE = ("--sparse-attention", "on", "--sparse-topk-blocks", "2")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    specs: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {
        "prefill": ("kv_producer", None, ()),
        "decode": ("kv_consumer", "ipc", ()),
        "single": (None, None, ()),
        "sparse-prefill": ("kv_producer", "ipc", SPARSE),
        "sparse-decode": ("kv_consumer", None, SPARSE),
        "sparse-single": (None, None, SPARSE),
    }
    started = {name: Engine(f"ipc-{name}", role, *extra, protocol=protocol)
               for name, (role, protocol, extra) in specs.items()}  # fmt: skip
    try:
        for e in started.values():
            e.wait_up(timeout=240)  # six engines starting at once on a loaded 2-core machine
        yield started
    finally:
        for e in started.values():
            e.stop()


def _info(e: Engine) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(urllib.request.urlopen(e.url + "/kv_transfer_info", timeout=10).read())
    return info


def _prefill(p: Engine, prompt: str = PROMPTS[1]) -> dict[str, Any]:
    status, body = post(p.url + "/v1/completions", _greedy(prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False}))  # fmt: skip
    assert status == 200, body
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


def _decode(d: Engine, params: dict[str, Any], prompt: str = PROMPTS[1]) -> tuple[int, dict[str, Any]]:
    return post(d.url + "/v1/completions", _greedy(prompt, kv_transfer_params=params))


@pytest.mark.timeout(420)  # the first test pays for the engines' start
@pytest.mark.parametrize("kind", ["dense", "sparse"])
async def test_ipc_pd_generations_equal_a_colocated_engine(kind: str, engines: dict[str, Engine],
                                                           gateway: MakeGateway) -> None:  # fmt: skip
    pre = "sparse-" if kind == "sparse" else ""
    p, d, single = engines[pre + "prefill"], engines[pre + "decode"], engines[pre + "single"]
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                       request_timeout_secs=60)  # fmt: skip
    async with aiohttp.ClientSession() as s:
        await same_as_colocated(s, single.url, base_url(gw), PROMPTS)
    info = _info(d)
    assert info["ipc"] == ("forced" if kind == "dense" else "auto")
    assert list(info["ipc_peers"].values()) == ["ipc"], info  # the one producer, mapped
    assert _info(p)["ipc"] == ("auto" if kind == "dense" else "forced")
    assert d.metric("atom:kv_transfer_pulled_total") >= 6
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(120)
def test_refused_transfers_over_ipc_leave_no_blocks(engines: dict[str, Engine]) -> None:
    p, d, mismatched = engines["prefill"], engines["decode"], engines["sparse-decode"]
    params = _prefill(p)
    status, body = _decode(d, {**params, "transfer_id": "no-such-transfer"})
    assert status == 502 and "unknown" in body["error"]["message"].lower(), body
    assert _decode(d, params)[0] == 200
    status, body = _decode(d, params)  # the same transfer a second time
    assert status == 502 and "already consumed" in body["error"]["message"], body
    params = _prefill(p)
    status, body = _decode(mismatched, params)  # its cache layout has indexer-key regions: refused
    assert status == 502 and "region" in body["error"]["message"], body
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0 and mismatched.blocks_used() == 0,
               what="every block pool to be idle")  # fmt: skip


@pytest.mark.timeout(180)
async def test_a_prefill_engine_dying_while_its_pools_are_mapped_fails_pulls_cleanly(
    engines: dict[str, Engine],
) -> None:
    """Decode maps a prefill engine's pools and pulls from it; the engine is killed with transfers offered.
    Eight pulls at once, half from it and half from a live prefill engine: those fail 502 (decode does not
    crash), the others equal the colocated engine, and every pool goes back to idle."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    doomed = Engine("ipc-doomed-prefill", "kv_producer", protocol=None).wait_up()
    prompts = [f"pull {i} " + PROMPTS[i % 3] for i in range(8)]
    try:
        assert _decode(d, _prefill(doomed))[0] == 200  # mapped now
        assert sum(v == "ipc" for v in _info(d)["ipc_peers"].values()) >= 1
        params = [_prefill(doomed if i % 2 else p, q) for i, q in enumerate(prompts)]
    finally:
        doomed.stop()  # SIGKILL with its pools mapped by decode
    async with aiohttp.ClientSession() as s:
        want = [await _complete(s, single.url, _greedy(q)) for q in prompts[::2]]

        async def decode(i: int) -> tuple[int, Any]:
            async with s.post(d.url + "/v1/completions", json=_greedy(prompts[i], kv_transfer_params=params[i])) as r:
                return r.status, await r.json()

        started = time.monotonic()
        answers = await asyncio.gather(*(decode(i) for i in range(8)))
        assert time.monotonic() - started < 30
    for i, (status, data) in enumerate(answers):
        if i % 2:
            assert status == 502 and data["error"]["code"] == "kv_transfer_failed", data
        else:
            assert status == 200, data
            assert (data["choices"][0]["text"], data["usage"]["completion_tokens"]) == want[i // 2]
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
    assert urllib.request.urlopen(d.url + "/health", timeout=10).status == 200
    assert _decode(d, _prefill(p))[0] == 200  # and it keeps serving
    info = _info(d)
    assert info["pulls_in_flight"] == 0 and list(info["ipc_peers"].values()).count("ipc") == 1, info
