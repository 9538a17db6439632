"""Speculative decoding: verify rows over the paged KV give, under greedy sampling, exactly the tokens of plain
decoding (drafts forced to the target's own argmax, n-gram drafts); the rejection sampler keeps the target
distribution; the counters reach /metrics; the decode side of P/D speculates from transferred KV."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
import torch
from conftest import OnThreads

from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from engine.spec_decode import SpeculativeConfig, accept_greedy, ngram_drafts, rejection_sample

MakeEngine = Callable[..., LLMEngine]

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", 4, 1, 3)
TEXTS = [
    "abc abc abc abc abc abc",
    "The cat sat on the mat. The cat sat on the",
    "1 2 3 4 1 2 3 4 1 2 3 4 1 2",
    "Once upon a time there was a tiny model.",
]


class OracleProposer:
    """Drafts the target's own greedy continuation (from a plain run), spoilt at some places so that
    rejections and KV rollback happen too: where len(seq) % 3 == 1 the second draft is wrong, where
    len(seq) % 5 == 0 the first one is."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, vocab: int) -> None:
        self.reference, self.k, self.vocab = reference, k, vocab

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        full = self.reference.get(tuple(seq.token_ids[: seq.num_prompt_tokens]))
        if full is None:  # a prompt not run plainly: prompt lookup
            return ngram_drafts(seq.token_ids, min(self.k, max_drafts), 1, 3)
        n = len(seq)
        drafts = list(full[n : n + min(self.k, max_drafts)])
        if n % 3 == 1 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % self.vocab
        if n % 5 == 0 and drafts:
            drafts[0] = (drafts[0] + 1) % self.vocab
        return drafts


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [engine.add_request(p, engine.check_request(len(p), params, True)) for p in prompts]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert engine.step(), "the scheduler made no progress"
    return [s.completion_ids for s in seqs]


@pytest.mark.parametrize("blocks", [256, 40], ids=["roomy", "preempting"])
@pytest.mark.parametrize("threads", [1, 2], ids=["native-linears", "onednn-linears"])
def test_drafts_forced_to_the_target_argmax_give_plain_decoding(make_engine: MakeEngine, on_threads: OnThreads,
                                                                blocks: int, threads: int) -> None:  # fmt: skip
    plain = make_engine(block_size=4)
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    expected = plain.generate(prompts, GREEDY)
    reference = {tuple(p): [*p, *c] for p, c in zip(prompts, expected, strict=True)}

    # Block size 4: drafts cross block boundaries; 40 blocks for 4 sequences of up to ~75 tokens: preemptions.
    spec = on_threads(threads, lambda: make_engine(block_size=4, num_kvcache_blocks=blocks, speculative=NGRAM))
    spec.scheduler.proposer = OracleProposer(reference, 5, spec.model_config.vocab_size)
    assert run(spec, prompts, GREEDY) == expected
    s = spec.stats()
    assert s.spec_drafts > 0 and s.spec_accepted_tokens > s.spec_drafts  # several drafts stand per row
    assert s.spec_accepted_tokens < s.spec_draft_tokens  # and some were rejected, their KV rolled back
    assert s.generation_tokens == sum(len(c) for c in expected)
    if blocks == 40:
        assert s.preemptions > 0
    assert spec.block_manager.num_free_blocks == spec.num_blocks  # rejected drafts' blocks came back

    # The blocks that verify steps filled are indexed under their real tokens: a next turn that carries the
    # first answer hits the prefix cache past its prompt and still decodes what a plain engine does.
    turn = [*prompts[1], *expected[1], *plain.tokenizer.encode(" Again:")]
    again = spec.add_request(turn, GREEDY)
    while again.status is not SequenceStatus.FINISHED:
        spec.step()
    if blocks == 256:  # (a small pool has reused those blocks by now)
        assert again.prefix_hit_tokens > len(prompts[1])
    assert again.completion_ids == plain.generate([turn], GREEDY)[0]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
@pytest.mark.parametrize("threads", [1, 2], ids=["native-linears", "onednn-linears"])
def test_ngram_drafts_under_greedy_change_no_token(make_engine: MakeEngine, on_threads: OnThreads, chunked: bool,
                                                   threads: int) -> None:  # fmt: skip
    kw = {"block_size": 4, "enable_chunked_prefill": chunked, "max_num_batched_tokens": 1024}
    plain = make_engine(**kw)
    spec = on_threads(threads, lambda: make_engine(**kw, speculative=NGRAM))
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    assert run(spec, prompts, GREEDY) == plain.generate(prompts, GREEDY)
    s = spec.stats()
    assert s.spec_drafts > 0 and s.spec_accepted_tokens > 0
    assert s.spec_acceptance_length > 1.0
    # Requests whose sampling depends on the tokens so far, or that want logprobs, decode one token a step
    # beside the speculating ones, and still get what a plain engine gives them.
    mixed = [
        dataclasses.replace(GREEDY, presence_penalty=0.5),
        dataclasses.replace(GREEDY, logprobs=2),
        GREEDY,
        dataclasses.replace(GREEDY, max_tokens=3),  # drafts never run past max_tokens
    ]
    got = [spec.add_request(p, spec.check_request(len(p), m, True)) for p, m in zip(prompts, mixed, strict=True)]
    while any(g.status is not SequenceStatus.FINISHED for g in got):
        spec.step()
    for p, m, g in zip(prompts, mixed, got, strict=True):
        assert g.completion_ids == plain.generate([p], m)[0]
    assert len(got[1].logprobs) == GREEDY.max_tokens and len(got[3].completion_ids) == 3
    assert spec.block_manager.num_free_blocks == spec.num_blocks


def test_a_stop_token_among_accepted_drafts_ends_the_sequence_there(make_engine: MakeEngine) -> None:
    plain = make_engine(block_size=4)
    prompt = plain.tokenizer.encode(TEXTS[2])
    full = plain.generate([prompt], GREEDY)[0]
    stop = full[7]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    expected = plain.generate([prompt], params)[0]
    spec = make_engine(block_size=4, speculative=NGRAM)
    spec.scheduler.proposer = OracleProposer({tuple(prompt): [*prompt, *full]}, 8, spec.model_config.vocab_size)
    assert run(spec, [prompt], params) == [expected]
    assert expected[-1] == stop and spec.block_manager.num_free_blocks == spec.num_blocks


def test_sampled_requests_speculate_and_stay_within_their_limits(make_engine: MakeEngine) -> None:
    spec = make_engine(block_size=4, speculative=NGRAM)
    prompts = [spec.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=25, ignore_eos=True)
    outs = run(spec, prompts, params)
    assert all(len(o) == 25 for o in outs)
    assert all(0 <= t < spec.model_config.vocab_size for o in outs for t in o)
    assert spec.stats().spec_drafts > 0
    assert spec.block_manager.num_free_blocks == spec.num_blocks


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    assert ngram_drafts([1, 2, 3, 9, 8, 1, 2, 3], 3, 1, 3) == [9, 8, 1]
    assert ngram_drafts([5, 1, 7, 1, 6, 6, 1], 2, 1, 3) == [6, 6]  # the latest "1" wins
    assert ngram_drafts([4, 2, 5, 3, 2, 5], 4, 2, 2) == [3, 2, 5]  # up to the end of what follows
    assert ngram_drafts([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_drafts([7, 7], 2, 1, 1) == [7]
    assert accept_greedy([4, 5, 6], [4, 9]) == [4, 5]
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_greedy([3, 5, 6], [4, 5]) == [3]


@pytest.mark.parametrize("deterministic_drafts", [True, False], ids=["ngram-like", "draft-distribution"])
def test_the_rejection_sampler_keeps_the_target_distribution(deterministic_drafts: bool) -> None:
    """The first token of a verify row is distributed as the target's p0, and the token after an accepted
    draft as p1 (the target's distribution given that draft), whatever the drafts are."""
    gen = torch.Generator().manual_seed(1234)
    rows, vocab, k = 200_000, 6, 2
    target = torch.tensor([[0.35, 0.05, 0.25, 0.1, 0.2, 0.05], [0.1, 0.3, 0.05, 0.05, 0.4, 0.1],
                           [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])  # fmt: skip
    probs = target.expand(rows, k + 1, vocab).contiguous()
    if deterministic_drafts:
        q = None
        drafts = torch.tensor([2, 4]).expand(rows, k).contiguous()  # all mass on the draft, as n-gram's
    else:
        q_rows = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
        q = q_rows.expand(rows, k, vocab).contiguous()
        drafts = torch.stack([torch.multinomial(q_rows[i], rows, replacement=True, generator=gen)
                              for i in range(k)], dim=1)  # fmt: skip
    out = rejection_sample(probs, drafts, torch.full((rows,), k), q, gen)
    first = torch.tensor([o[0] for o in out])
    freq = torch.bincount(first, minlength=vocab).float() / rows
    # 5 standard errors of a frequency over 200k draws: below 0.006 for every p.
    assert (freq - target[0]).abs().max() < 0.006, (freq, target[0])
    second = torch.tensor([o[1] for o in out if len(o) > 1])
    assert len(second) > rows // 5
    freq2 = torch.bincount(second, minlength=vocab).float() / len(second)
    assert (freq2 - target[1]).abs().max() < 0.012, (freq2, target[1])
    assert all(len(o) <= k + 1 for o in out[:1000])


def test_rows_with_fewer_drafts_stop_at_their_own_count() -> None:
    gen = torch.Generator().manual_seed(0)
    one_hot = torch.eye(5)[[1, 2, 3]].expand(2, 3, 5).contiguous()  # the target is certain: 1, then 2, then 3
    out = rejection_sample(one_hot, torch.tensor([[1, 2], [1, 0]]), torch.tensor([2, 1]), None, gen)
    assert out == [[1, 2, 3], [1, 2]]


async def test_speculation_over_http_and_its_metrics(start_server: Callable[..., object],
                                                     http: aiohttp.ClientSession) -> None:  # fmt: skip
    plain = await start_server()  # type: ignore[misc]
    spec = await start_server(speculative=NGRAM)  # type: ignore[misc]
    texts = []
    for server in (plain, spec):
        body = {"model": "tiny-random", "prompt": TEXTS[2], "max_tokens": 40, "temperature": 0}
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["usage"]["completion_tokens"] == 40
        texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1]
    async with http.get(spec.url + "/metrics") as resp:
        text = await resp.text()
    values = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip
    assert values["atom:spec_decode_num_drafts_total"] > 0
    assert values["atom:spec_decode_num_draft_tokens_total"] >= values["atom:spec_decode_num_accepted_tokens_total"]
    assert values["atom:spec_decode_mean_acceptance_length"] >= 1.0


def test_the_decode_side_of_pd_speculates_from_transferred_kv(make_engine: MakeEngine) -> None:
    """A decode engine whose prompt KV came from another engine (copied block by block, as a transfer
    writes it) speculates on it and decodes what a colocated engine does."""
    prefill = make_engine(block_size=4)
    prompt = prefill.tokenizer.encode(TEXTS[1])
    expected = prefill.generate([prompt], GREEDY)[0]
    held = prefill.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=1), hold_kv=True)
    while held.status is not SequenceStatus.FINISHED:
        prefill.step()
    decode = make_engine(block_size=4, speculative=NGRAM)
    seq = decode.reserve(prompt, GREEDY)
    for src, dst in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
        n = (len(prompt) + 3) // 4
        dst[:, seq.block_table[:n]] = src[:, held.block_table[:n]]
    decode.commit_prefilled(seq, held.completion_ids[0])
    prefill.release(held)
    while seq.status is not SequenceStatus.FINISHED:
        assert decode.step()
    assert seq.completion_ids == expected
    assert decode.stats().spec_drafts > 0
    assert decode.block_manager.num_free_blocks == decode.num_blocks


@pytest.mark.parametrize("window", [0, 24], ids=["full", "sliding-window"])
def test_short_queries_over_a_long_cached_context_attend_as_one_prompt(window: int) -> None:
    """The torch path's explicit-mask attention (a verify row, a short chunk: a few queries over a long cached
    context) gives what attending the whole prompt at once gives."""
    from engine.attention import AttentionMetadata, paged_attention, plan_prefill

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs, cached, q_len = 4, 2, 16, 4, 64, 3
    total = cached + q_len
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    table = torch.arange(total // bs + 1).flip(0)  # blocks out of order

    def attend(start: int) -> torch.Tensor:
        cache = torch.zeros(2, len(table), kv_heads, bs, dim)
        pos = torch.arange(total)
        slots = table[pos // bs] * bs + pos % bs
        if start:  # the context is in the cache already
            cache[0, table[pos[:start] // bs], :, pos[:start] % bs] = k[:start]
            cache[1, table[pos[:start] // bs], :, pos[:start] % bs] = v[:start]
        n = total - start
        meta = AttentionMetadata(num_decodes=0, slot_mapping=slots[start:], block_tables=table[None],
                                 context_lens=torch.tensor([total]), query_lens=[n], cached_lens=[start],
                                 max_query_len=n, max_context=total)  # fmt: skip
        meta.prefill_groups, meta.cached_seqs = plan_prefill([n], [start], torch.device("cpu"))
        return paged_attention(q[start:], k[start:], v[start:], cache, meta, dim**-0.5, window=window)

    torch.testing.assert_close(attend(cached), attend(0)[cached:], rtol=1e-5, atol=1e-5)


async def test_a_grammar_request_beside_verify_rows_keeps_its_mask(start_server: Callable[..., object],
                                                                    http: aiohttp.ClientSession) -> None:  # fmt: skip
    """Structured output never speculates; in a step with verify rows its mask still applies to its own row."""
    import asyncio
    import re

    async def both(url: str) -> list[str]:
        async def one(body: dict[str, object]) -> str:
            async with http.post(url + "/v1/completions", json={"model": "tiny-random", "temperature": 0,
                                                                **body}) as resp:  # fmt: skip
                assert resp.status == 200
                return str((await resp.json())["choices"][0]["text"])

        return list(await asyncio.gather(
            one({"prompt": TEXTS[2], "max_tokens": 200}),
            one({"prompt": "x", "max_tokens": 40, "guided_regex": r"[0-9]{3}-[a-z]{20}"}),
        ))  # fmt: skip

    plain = await start_server()  # type: ignore[misc]
    spec = await start_server(speculative=NGRAM)  # type: ignore[misc]
    execute, mixed = spec.engine.runner.execute, []

    def spy(step: Any) -> Any:
        mixed.append(bool(step.drafts) and step.bitmask is not None)
        return execute(step)

    spec.engine.runner.execute = spy
    got = await both(spec.url)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{20}", got[1])
    assert got == await both(plain.url)
    assert any(mixed)  # a step had both a verify row and a masked row


@pytest.mark.parametrize("threads", [1, 2])
def test_a_speculating_cpu_engine_packs_its_linears_and_they_compute_what_torch_does(
    make_engine: MakeEngine, on_threads: OnThreads, threads: int
) -> None:
    """Verify rows are several rows a step: a speculating engine on the CPU packs its linear layers once
    (engine.cpu_packed: for the native kernel on one thread, for oneDNN on more); over 1..9 rows they give
    torch's linear up to rounding; a plain engine packs nothing."""
    from torch import nn

    from engine.cpu_packed import PackedCpuOps

    spec = on_threads(threads, lambda: make_engine(speculative=SpeculativeConfig("ngram", 3, 1, 2)))
    if spec.device.type != "cpu":
        assert not isinstance(spec.runner.model.ops, PackedCpuOps)  # GPUs keep their kernels
        return
    ops = spec.runner.model.ops
    assert isinstance(ops, PackedCpuOps) and not isinstance(make_engine().runner.model.ops, PackedCpuOps)
    assert ops.kind == ("native" if threads == 1 else "onednn")
    layers = [m for m in spec.runner.model.modules() if type(m) is nn.Linear]
    assert ops.num_packed == len({id(m) for m in layers}) > 0
    gen = torch.Generator().manual_seed(0)
    for layer in [*layers[:4], spec.runner.model.lm_head]:
        for rows in range(1, 10):
            x = torch.randn(rows, layer.in_features, generator=gen)
            torch.testing.assert_close(ops.linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)
