"""`python -m bench.gateway.kv_placement`'s summary: medians over rounds, kv_aware against cache_aware per round."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from bench.gateway.kv_placement import RunResult, parser, summarize

pytestmark = pytest.mark.timeout(30)


def _run(policy: str, hit: float, rnd: int, gw: int = 2) -> RunResult:
    return RunResult(
        "multi-turn", policy, gw, hit, 0, 0, 500.0 + rnd, 900.0, 1.0 + rnd / 10, [12] * 4, 0, 7.0, round=rnd
    )


def test_summary_takes_medians_and_pairs_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run("kv_aware", h, i) for i, h in enumerate((0.30, 0.36, 0.33))]
    runs += [_run("cache_aware", h, i) for i, h in enumerate((0.25, 0.30, 0.20))]
    rows = summarize(runs, ["multi-turn"], [1, 2], ["kv_aware", "cache_aware"])
    kv, ca = rows
    assert (kv["hit_rate"], kv["hit_min"], kv["hit_max"], kv["runs"]) == (0.33, 0.30, 0.36, 3)
    assert ca["hit_rate"] == 0.25 and kv["load_ratio"] == pytest.approx(1.1) and kv["ttft_p50_ms"] == 501.0
    assert kv["vs_cache_aware"] == pytest.approx(0.33 / 0.25)
    assert kv["vs_cache_aware_per_round"] == pytest.approx([0.30 / 0.25, 0.36 / 0.30, 0.33 / 0.20])
    out = capsys.readouterr().out
    assert "kv_aware hit rate x1.32 of cache_aware" in out and "x1.20 x1.20 x1.65" in out


def test_repeat_defaults_to_three_rounds() -> None:
    assert parser().parse_args([]).repeat == 3
    assert parser().parse_args(["--repeat", "7"]).repeat == 7


def test_free_ports_are_not_handed_out_twice() -> None:
    """A run draws several ports before any of its servers binds one: no two draws may be equal."""
    from bench.gateway.procs import free_port

    ports = [free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports)


@contextlib.asynccontextmanager
async def _chat_server(seen: list[list[dict[str, str]]]) -> AsyncIterator[str]:
    """A loopback chat endpoint that records each request's messages and streams one token."""
    from aiohttp import web

    from bench.gateway.procs import free_port

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append((await request.json())["messages"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_multi_turn_replay_resumes_conversations_after_a_restart() -> None:
    """The restart trace sends every first turn, then (after the gateways restart) the later turns of
    each conversation with its earlier turns and replies, in another order than they started."""
    from aiohttp import ClientSession

    from bench.gateway.kv_placement import multi_turn, replay_multi_turn

    seen: list[list[dict[str, str]]] = []
    convs = multi_turn("salt", 6, 3)
    async with _chat_server(seen) as url, ClientSession() as session:
        ttfts, errors = await replay_multi_turn(session, [url], convs, 2, "m", until=1)
        assert (len(ttfts), errors) == (6, 0) and all(len(m) == 2 for m in seen)
        first = [m[0]["content"] for m in seen]
        seen.clear()
        ttfts, errors = await replay_multi_turn(session, [url], convs, 2, "m", first=1)
    assert (len(ttfts), errors) == (12, 0)
    assert sorted(len(m) for m in seen) == [4] * 6 + [6] * 6  # system, user, reply, user (, reply, user)
    second = [m[0]["content"] for m in seen if len(m) == 4]
    assert sorted(second) == sorted(first) and second != first  # every conversation, in another order
    for m in seen:
        c = convs[[conv[0]["content"] for conv in convs].index(m[0]["content"])]
        assert [x["content"] for x in m if x["role"] == "user"] == [u["content"] for u in c[1 : len(m) // 2 + 1]]


async def test_long_tail_replay_runs_each_conversation_to_its_own_length() -> None:
    """Every fourth conversation of the long-tail trace runs 4x the turns; each is sent turn by turn
    to its own end, a later turn only after the one before it."""
    from aiohttp import ClientSession

    from bench.gateway.kv_placement import long_tail, replay_multi_turn

    seen: list[list[dict[str, str]]] = []
    convs = long_tail("salt", 8, 2)
    assert sorted(len(c) - 1 for c in convs) == [2] * 6 + [8] * 2
    assert [len(c) for c in long_tail("salt", 8, 2, seed=4)] != [len(c) for c in convs]  # drawn anew per round
    async with _chat_server(seen) as url, ClientSession() as session:
        ttfts, errors = await replay_multi_turn(session, [url], convs, 3, "m")
    assert (len(ttfts), errors) == (2 * 8 + 6 * 2, 0)
    for c, conv in enumerate(convs):
        mine = [m for m in seen if m[0]["content"] == conv[0]["content"]]
        assert [len(m) for m in mine] == [2 + 2 * t for t in range(len(conv) - 1)], c  # in turn order


def test_summary_keeps_pool_sizes_apart(capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep (--kv-blocks 40 80): each pool size gets its own medians and its own ratio."""
    runs = []
    for pool, (kv, ca) in ((40, (0.32, 0.26)), (80, (0.50, 0.36))):
        for policy, hit in (("kv_aware", kv), ("cache_aware", ca)):
            r = _run(policy, hit, 0)
            r.kv_blocks, r.evicted_blocks = pool, 300 if pool == 40 else 20
            runs.append(r)
    rows = summarize(runs, ["multi-turn"], [2], ["kv_aware", "cache_aware"])
    assert [(r["kv_blocks"], r["policy"], r["hit_rate"], r["evicted_blocks"]) for r in rows] == [
        (40, "kv_aware", 0.32, 300),
        (40, "cache_aware", 0.26, 300),
        (80, "kv_aware", 0.50, 20),
        (80, "cache_aware", 0.36, 20),
    ]
    assert rows[0]["vs_cache_aware"] == pytest.approx(0.32 / 0.26)
    assert rows[2]["vs_cache_aware"] == pytest.approx(0.5 / 0.36)
    out = capsys.readouterr().out
    assert "40 blocks, multi-turn, 2 gateway(s): kv_aware hit rate x1.23" in out
    assert "80 blocks, multi-turn, 2 gateway(s): kv_aware hit rate x1.39" in out
