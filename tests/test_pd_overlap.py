"""P/D with the transfer overlapping the prefill (early offers): the prefill engine answers the prefill leg
before its prefill runs, prefills the prompt in several chunks (``--max-num-batched-tokens`` below the
prompt's length), and the decode engine copies each chunk's blocks once they are final (over ipc), or
is written the whole KV once the prefill ended (staged Mooncake). Generations equal a colocated engine
token for token; a decode leg that gives up while the prefill runs stops it, and every block pool goes
back to idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gwtest import MakeGateway, base_url, require

from tests.test_pd_engine import PROMPTS, Engine, _complete, _greedy, post, same_as_colocated, wait_until

require("mooncake.engine", "P/D engines start a Mooncake agent")

CHUNKED = ("--max-num-batched-tokens", "16")  # one 16-token block per prefill step
LONG = "the quick brown fox jumps over the lazy dog " * 6  # PROMPTS[1]: several chunks
VERY_LONG = "one two three four five six seven eight nine ten " * 30  # ~1,500 tokens: ~45 chunks


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    specs: dict[str, tuple[str | None, str | None, tuple[str, ...]]] = {
        # Offers expire after 10 s: the unread offer below is waited out (each prefill here ends within a second).
        "prefill": ("kv_producer", None, (*CHUNKED, "--kv-transfer-timeout", "10")),
        # Offers expire 1 s after their prefill is admitted: a burst queues far longer than that.
        "quick-prefill": ("kv_producer", None, (*CHUNKED, "--kv-transfer-timeout", "1")),
        "decode": ("kv_consumer", "ipc", ()),
        "staged-prefill": ("kv_producer", "tcp", CHUNKED),
        "staged-decode": ("kv_consumer", "tcp", ()),
        "single": (None, None, ()),
    }
    started = {name: Engine(f"overlap-{name}", role, *extra, protocol=protocol)
               for name, (role, protocol, extra) in specs.items()}  # fmt: skip
    try:
        for e in started.values():
            e.wait_up(timeout=240)
        yield started
    finally:
        for e in started.values():
            e.stop()


def _early_prefill(p: Engine, prompt: str, **extra: Any) -> dict[str, Any]:
    status, body = post(p.url + "/v1/completions", _greedy(prompt, max_tokens=1, **extra, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "early_offer": True}))  # fmt: skip
    assert status == 200, body
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


async def _early_prefill_async(s: aiohttp.ClientSession, p: Engine, prompt: str) -> dict[str, Any]:
    body = _greedy(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                            "early_offer": True})  # fmt: skip
    async with s.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        params: dict[str, Any] = (await r.json())["kv_transfer_params"]
    return params


@pytest.mark.timeout(420)  # the first test pays for the engines' start
@pytest.mark.parametrize("path", ["ipc", "staged"])
async def test_chunked_prefill_read_as_it_runs_equals_a_colocated_engine(
    path: str, engines: dict[str, Engine], gateway: MakeGateway
) -> None:
    pre = "staged-" if path == "staged" else ""
    p, d, single = engines[pre + "prefill"], engines[pre + "decode"], engines["single"]
    rounds = d.metric("atom:kv_transfer_early_rounds_total")
    gw = await gateway(pd_disaggregation=True, backend="atom", prefill=[{"url": p.url}], decode=[d.url],
                       request_timeout_secs=60)  # fmt: skip
    prompts = [*PROMPTS, VERY_LONG]
    async with aiohttp.ClientSession() as s:
        await same_as_colocated(s, single.url, base_url(gw), prompts)
        # Several at once: the decode engine reads them while the prefill engine interleaves their chunks.
        many = [f"request {i}: " + VERY_LONG[: 120 * (i + 1)] for i in range(4)]
        want_many = [await _complete(s, single.url, _greedy(q)) for q in many]
        got = await asyncio.gather(*(_complete(s, base_url(gw), _greedy(q)) for q in many))
        assert list(got) == want_many
    # The gateway asked early offers and the prefill engine made them; none left pending.
    assert p.metric("atom:kv_transfer_released_total", 'reason="written"') >= 2 * len(prompts) + len(many)
    if path == "ipc":
        # Blocks were copied while the prefill ran (a round before the last), not only at its end.
        assert d.metric("atom:kv_transfer_early_rounds_total") > rounds
        info = json.loads(urllib.request.urlopen(d.url + "/kv_transfer_info", timeout=10).read())
        assert list(info["ipc_peers"].values()) == ["ipc"], info
    # The TTFT split: reserved, landed, first step, on the decode engine; TTFT and queue on the prefill engine.
    assert d.metric("atom:pd_decode_reserve_seconds_count") >= len(prompts)
    assert d.metric("atom:pd_decode_first_step_seconds_count") >= len(prompts)
    assert p.metric("atom:time_to_first_token_seconds_count") >= 2 * len(prompts)
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(180)
def test_an_early_offer_names_no_blocks_and_no_first_token(engines: dict[str, Engine]) -> None:
    p, d = engines["prefill"], engines["decode"]
    params = _early_prefill(p, LONG)
    assert params["early"] is True and params["remote_block_ids"] == [] and params["first_token_id"] is None
    assert params["num_blocks"] >= 3
    status, body = post(d.url + "/v1/completions", _greedy(LONG, kv_transfer_params=params))
    assert status == 200, body
    # Asked with logprobs, the first token's logprob must come from the prefill: answered after it, as before.
    params = _early_prefill(p, LONG, logprobs=1)
    assert not params.get("early") and isinstance(params["first_token_id"], int), params
    assert post(d.url + "/v1/completions", _greedy(LONG, logprobs=1, kv_transfer_params=params))[0] == 200
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(180)
async def test_a_decode_leg_gone_while_the_prefill_runs_stops_it_and_leaks_nothing(engines: dict[str, Engine]) -> None:
    """Decode legs that give up (client gone) while their early offers' prefills still run: the decode engine
    stops reading, the prefill engine stops those prefills, and both pools go back to idle; an offer nobody
    reads expires; one the decode engine refuses before pulling (another prompt) is abandoned at once. Both
    engines keep serving."""
    p, d, single = engines["prefill"], engines["decode"], engines["single"]
    failed = p.metric("atom:kv_transfer_released_total", 'reason="write_failed"')
    expired = p.metric("atom:kv_transfer_released_total", 'reason="expired"')
    prompts = [f"abandoned {i}: " + VERY_LONG for i in range(5)]
    # All five queued at once, each prefill leg answered as its prefill is admitted (~94 one-block steps each, the
    # next admitted when the one before ended: ~0.15 s a prefill on a 2-core CPU), and its decode leg sent then,
    # which gives up well before those steps end. On an H200 all five prefills ended within 0.3 s, so there the legs
    # give up after 10 ms.
    on_gpu = os.environ.get("ENGINE_TEST_DEVICE", "cpu").startswith("cuda")
    timeout = aiohttp.ClientTimeout(total=0.01 if on_gpu else 0.03)
    async with aiohttp.ClientSession() as s:

        async def give_up(q: str) -> bool:
            params = await _early_prefill_async(s, p, q)
            try:
                async with s.post(d.url + "/v1/completions", json=_greedy(q, kv_transfer_params=params),
                                  timeout=timeout) as r:  # fmt: skip
                    await r.read()
            except TimeoutError:
                return True
            return False

        gone = await asyncio.gather(*(give_up(q) for q in prompts))
    assert any(gone), gone
    released = {r: p.metric("atom:kv_transfer_released_total", f'reason="{r}"')
                for r in ("written", "write_failed", "refused", "expired", "closed")}  # fmt: skip
    wait_until(lambda: p.metric("atom:kv_transfer_released_total", 'reason="write_failed"') >= failed + 1,
               what=f"an abandoned read to be released (released by reason when it began: {released}, "
                    f"write_failed before the legs: {failed}; decode early rounds: "
                    f"{d.metric('atom:kv_transfer_early_rounds_total')})")  # fmt: skip
    # The abandoned legs' blocks come back on the decode engine without a write grace: a cancelled ipc read has
    # waited for its copies, so nothing lands in them later (checked at the end, while the unread offer below
    # expires meanwhile). The refused prompt is short: it finds room whatever is still held, and is refused (400)
    # for the mismatch, not 503 for want of blocks.
    refusals = p.metric("atom:kv_transfer_released_total", 'reason="refused"')
    never_read = _early_prefill(p, LONG)  # nobody comes: it expires (--kv-transfer-timeout 10)
    refused = _early_prefill(p, LONG)
    status, body = post(d.url + "/v1/completions", _greedy(PROMPTS[0], kv_transfer_params=refused))
    assert status == 400 and "blocks" in body["error"]["message"], body  # another prompt: refused before pulling
    assert never_read["transfer_id"] != refused["transfer_id"]
    # The refused one: the decode engine says `abandon`, and the producer releases it at once (REFUSED).
    wait_until(lambda: p.metric("atom:kv_transfer_released_total", 'reason="refused"') >= refusals + 1, timeout=10,
               what="the refused offer to be abandoned")  # fmt: skip
    wait_until(lambda: p.metric("atom:kv_transfer_released_total", 'reason="expired"') >= expired + 1, timeout=60,
               what="the unread offer to expire")  # fmt: skip
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, timeout=60, what="both block pools to be idle")
    async with aiohttp.ClientSession() as s:  # and both keep serving
        want = await _complete(s, single.url, _greedy(LONG))
        params = _early_prefill(p, LONG)
        assert await _complete(s, d.url, _greedy(LONG, kv_transfer_params=params)) == want


@pytest.mark.timeout(180)
async def test_a_burst_queued_longer_than_the_offer_timeout_is_served_whole(engines: dict[str, Engine]) -> None:
    """Twelve prefill legs at once on an engine whose offers expire after 1 s, queued ~1.8 s deep (~0.15 s a
    prefill on a 2-core CPU): each is answered once its prefill is admitted, its decode leg sent then, and every one
    is served, none of its offers expiring and no decode engine's pull place waiting on a queue. Answered before
    their prefills ran, the offers of those still queued after 1 s expired and their decode legs failed (502); at
    128 requests on `make up`'s engines, 127 failed and the gateway then opened the decode engine's breaker."""
    p, d, single = engines["quick-prefill"], engines["decode"], engines["single"]
    expired = p.metric("atom:kv_transfer_released_total", 'reason="expired"')
    prompts = [f"burst {i}: " + VERY_LONG for i in range(12)]
    async with aiohttp.ClientSession() as s:
        want = [await _complete(s, single.url, _greedy(q)) for q in prompts[:2]]

        async def both_legs(q: str) -> tuple[str, int]:
            params = await _early_prefill_async(s, p, q)
            assert params["early"] is True
            return await _complete(s, d.url, _greedy(q, kv_transfer_params=params))

        got = await asyncio.gather(*(both_legs(q) for q in prompts))
    assert list(got[:2]) == want
    assert p.metric("atom:kv_transfer_released_total", 'reason="expired"') == expired
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")


@pytest.mark.timeout(180)
async def test_a_prefill_leg_gone_while_its_prefill_queues_stops_it_and_leaks_nothing(
    engines: dict[str, Engine],
) -> None:
    """Prefill legs whose clients leave while their prefills still queue (behind a long one): nothing was answered,
    so their offers end there and then, their prefills never run, and the prefill engine's pool goes back to idle."""
    p, d = engines["prefill"], engines["decode"]
    failed = p.metric("atom:kv_transfer_released_total", 'reason="write_failed"')
    body = _greedy(VERY_LONG, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                                "early_offer": True})  # fmt: skip
    on_gpu = os.environ.get("ENGINE_TEST_DEVICE", "cpu").startswith("cuda")
    async with aiohttp.ClientSession() as s:
        ahead = asyncio.ensure_future(_early_prefill_async(s, p, "ahead: " + VERY_LONG))  # admitted first
        await asyncio.sleep(0.01)

        async def leave(i: int) -> bool:
            try:
                async with s.post(p.url + "/v1/completions", json={**body, "prompt": f"queued {i}: " + VERY_LONG},
                                  timeout=aiohttp.ClientTimeout(total=0.005 if on_gpu else 0.05)) as r:  # fmt: skip
                    await r.read()
            except TimeoutError:
                return True
            return False

        gone = await asyncio.gather(*(leave(i) for i in range(4)))
        params = await ahead
        assert await _complete(s, d.url, _greedy("ahead: " + VERY_LONG, kv_transfer_params=params))
    assert any(gone), gone
    wait_until(lambda: p.metric("atom:kv_transfer_released_total", 'reason="write_failed"') >= failed + sum(gone),
               what="the left legs' offers to end")  # fmt: skip
    wait_until(lambda: p.blocks_used() == 0 and d.blocks_used() == 0, what="both block pools to be idle")
