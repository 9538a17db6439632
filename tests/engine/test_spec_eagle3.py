"""EAGLE-3 draft heads: a head written in the Hub layout (config.json + safetensors: ``fc``, ``midlayer.*``, ``d2t``)
loads, drafts inside the engine's steps and, under greedy sampling, changes no token of plain decoding (a random
head, and a head whose choices are forced to the target's own continuation, so that drafts stand and are
rejected); its first draft equals what a plain-torch transcription of the head computes over the whole sequence;
the counters reach /metrics; what is not built is refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.attention import kv_cache_shape
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.models.eagle3 import default_aux_layers, load_eagle3, parse_eagle3_config, write_random_head
from engine.sequence import SamplingParams, SequenceStatus
from engine.spec_decode import SpeculativeConfig, attention_meta

MakeEngine = Callable[..., LLMEngine]

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
TEXTS = [
    "abc abc abc abc abc abc",
    "The cat sat on the mat. The cat sat on the",
    "1 2 3 4 1 2 3 4 1 2 3 4 1 2",
    "Once upon a time there was a tiny model.",
]
AUX = [0, 1, 1]  # the tiny target has two layers (the default picks 2, L // 2 and L - 3 of more)


def write_head(folder: Path, cfg: ModelConfig, draft_vocab: int = 64, seed: int = 1, own_embedding: bool = False,
               **config: Any) -> Path:  # fmt: skip
    """A random EAGLE-3 head for ``cfg``'s target, in the layout the published heads use, reading layers ``AUX``."""
    return write_random_head(folder, cfg, draft_vocab, seed, own_embedding=own_embedding,
                             **{"eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}, **config})  # fmt: skip


@pytest.fixture
def head(tmp_path: Path, make_engine: MakeEngine) -> Path:
    return write_head(tmp_path / "head", make_engine().model_config)


def eagle(head: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig("eagle3", k, model=str(head))


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    seqs = [engine.add_request(p, engine.check_request(len(p), sp, True)) for p, sp in zip(prompts, params,
                                                                                           strict=True)]  # fmt: skip
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert engine.step(), "the scheduler made no progress"
    return [s.completion_ids for s in seqs]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "prefill-first"])
@pytest.mark.parametrize("threads", [1, 2], ids=["native-linears", "onednn-linears"])
def test_a_random_head_under_greedy_changes_no_token(make_engine: MakeEngine, on_threads: Callable[..., LLMEngine],
                                                     head: Path, chunked: bool, threads: int) -> None:  # fmt: skip
    kw = {"block_size": 4, "enable_chunked_prefill": chunked, "max_num_batched_tokens": 1024 if not chunked else 24}
    plain = make_engine(**kw)
    # Built on one thread, a CPU engine packs the target's and the head's linears for the native kernel.
    spec = on_threads(threads, lambda: make_engine(**kw, speculative=eagle(head)))
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    # Beside the speculating requests: ones whose sampling depends on the tokens so far or that want logprobs
    # decode one token a step (and the head skips them).
    params = [GREEDY, dataclasses.replace(GREEDY, presence_penalty=0.5), dataclasses.replace(GREEDY, logprobs=2),
              dataclasses.replace(GREEDY, max_tokens=3)]  # fmt: skip
    assert run(spec, prompts, params) == [plain.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    s = spec.stats()
    assert s.spec_drafts > 0 and s.spec_draft_tokens > s.spec_drafts  # k drafts a row, all from the head
    assert spec.drafter is not None and spec.drafter.head.shares_embedding
    assert spec.block_manager.num_free_blocks == spec.num_blocks


@pytest.mark.parametrize("blocks", [256, 40], ids=["roomy", "preempting"])
def test_drafts_forced_to_the_target_continuation_stand_and_roll_back(make_engine: MakeEngine, head: Path,
                                                                      blocks: int) -> None:  # fmt: skip
    """The head runs as always (its KV written while drafting, then rewritten from the target's hidden states
    where drafts stood), but its picks are the target's own next tokens, spoilt where the position is a multiple
    of 5: several drafts stand per row, some are rejected, and the output is still plain decoding's."""
    plain = make_engine(block_size=4)
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    expected = plain.generate(prompts, GREEDY)
    spec = make_engine(block_size=4, num_kvcache_blocks=blocks, speculative=eagle(head, 5))
    seqs = [spec.add_request(p, GREEDY) for p in prompts]
    full = {s.seq_id: [*p, *c] for s, p, c in zip(seqs, prompts, expected, strict=True)}
    vocab = spec.model_config.vocab_size
    assert spec.drafter is not None
    chosen = spec.drafter.pick

    def oracle(normed: torch.Tensor, seq_ids: list[int], positions: list[int]) -> torch.Tensor:
        chosen(normed, seq_ids, positions)  # the head's own choice is computed all the same
        picks = [full[s][p + 2] if p + 2 < len(full[s]) else 0 for s, p in zip(seq_ids, positions, strict=True)]
        return torch.tensor([(t + 1) % vocab if p % 5 == 0 else t for t, p in zip(picks, positions, strict=True)])

    spec.drafter.pick = oracle  # type: ignore[method-assign]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert spec.step()
    assert [s.completion_ids for s in seqs] == expected
    s = spec.stats()
    assert s.spec_accepted_tokens > s.spec_drafts  # more than one draft stands per row on average
    assert s.spec_accepted_tokens < s.spec_draft_tokens  # and some were rejected
    assert s.generation_tokens == sum(len(c) for c in expected)
    if blocks == 40:
        assert s.preemptions > 0
    assert spec.block_manager.num_free_blocks == spec.num_blocks


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos[:, None].float() * inv[None, :]] * 2, dim=-1)[:, None, :]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * ang.cos() + half * ang.sin()


def reference_first_draft(engine: LLMEngine, tokens: list[int], head: Path) -> tuple[int, torch.Tensor]:
    """The head over a whole sequence in plain torch (its published definition, dense causal attention): at
    position p it reads token p + 1 and the target's three hidden states at p; the output at the last token's
    predecessor is the first draft after ``tokens``. Returns (that draft, the hidden state it leaves)."""
    from safetensors.torch import load_file

    model = engine.runner.model
    cfg = model.config
    n = len(tokens) - 1
    # The target's hidden states entering layers AUX, from one prefill into a scratch cache.
    blocks = -(-n // 4)
    dev = model.embed_tokens.weight.device  # the target runs where the engine put it; the rest of this on CPU
    shape = kv_cache_shape(blocks, 4, cfg.num_key_value_heads, cfg.head_dim)
    caches = [torch.zeros(shape, device=dev) for _ in range(cfg.num_hidden_layers)]
    triton = engine.drafter is not None and engine.drafter.triton  # the engine's own attention path (CUDA: Triton)
    meta = attention_meta([n], [0], np.arange(n), [list(range(blocks))], 4, triton, cfg.num_key_value_heads, dev)
    aux: dict[int, torch.Tensor] = {}
    pos = torch.arange(n)
    with torch.inference_mode():
        model(torch.tensor(tokens[:-1], device=dev), pos.to(dev), caches, meta, None, aux)
    w = load_file(str(head / "model.safetensors"))
    p = "midlayer."
    eps = cfg.rms_norm_eps
    hidden = torch.cat([aux[i].cpu() for i in AUX], dim=-1) @ w["fc.weight"].T
    embeds = model.embed_tokens.weight.detach().cpu()[torch.tensor(tokens[1:])]
    x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], eps), _rms(hidden, w[p + "hidden_norm.weight"], eps)],
                  dim=-1)  # fmt: skip
    hd, nh, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q = _rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd), pos, cfg.rope_theta)
    k = _rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd), pos, cfg.rope_theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
    k, v = k.repeat_interleave(nh // kvh, dim=1), v.repeat_interleave(nh // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
    residual = hidden + attn
    h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    prenorm = residual + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    best = int((_rms(prenorm[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
    return best + int(w["d2t"][best]), prenorm[-1]


@pytest.mark.parametrize("chunk", [1024, 8], ids=["whole-prompt", "chunks-of-8"])
def test_the_first_draft_is_the_heads_whole_sequence_prediction(make_engine: MakeEngine, head: Path,
                                                                chunk: int) -> None:  # fmt: skip
    """After a prefill (whole, or in chunks) and after verify steps, the head's state for the next step equals
    the plain-torch head over the whole sequence so far: its KV was written at the right places from the right
    hidden states, and rejected drafts left nothing behind."""
    spec = make_engine(block_size=4, max_num_batched_tokens=chunk, long_prefill_token_threshold=chunk,
                       speculative=eagle(head, 3))  # fmt: skip
    assert spec.drafter is not None
    prompt = spec.tokenizer.encode(TEXTS[1])
    seq = spec.add_request(prompt, GREEDY)
    checked = 0
    while seq.status is not SequenceStatus.FINISHED:
        spec.step()
        state = spec.drafter.state.get(seq.seq_id)
        if state is None or seq.status is SequenceStatus.FINISHED:
            continue
        draft, hidden = reference_first_draft(spec, seq.token_ids, head)
        assert state[0] == draft
        torch.testing.assert_close(state[1].cpu(), hidden, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked >= 5


async def test_eagle3_over_http_and_its_metrics(start_server: Callable[..., object], http: aiohttp.ClientSession,
                                                head: Path) -> None:  # fmt: skip
    plain = await start_server()  # type: ignore[misc]
    spec = await start_server(speculative=eagle(head))  # type: ignore[misc]
    texts = []
    for server in (plain, spec):
        body = {"model": "tiny-random", "prompt": TEXTS[2], "max_tokens": 40, "temperature": 0}
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            answer = await resp.json()
        texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1]
    # Sampled requests speculate too (drafts are the head's greedy picks: the rejection sampler keeps the target's
    # distribution) and stay within their limits.
    body = {"model": "tiny-random", "prompt": TEXTS[0], "max_tokens": 25, "temperature": 0.8, "n": 2}
    async with http.post(spec.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert all(c["finish_reason"] in ("length", "stop") for c in (await resp.json())["choices"])
    async with http.get(spec.url + "/metrics") as resp:
        text = await resp.text()
    values = {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}  # fmt: skip
    assert values["atom:spec_decode_num_drafts_total"] > 0
    drafts, tokens = values["atom:spec_decode_num_drafts_total"], values["atom:spec_decode_num_draft_tokens_total"]
    assert drafts < tokens <= 4 * drafts  # up to k = 4 drafts a row (fewer near max_tokens)
    assert values["atom:spec_decode_num_accepted_tokens_total"] <= tokens
    assert values["atom:spec_decode_mean_acceptance_length"] >= 1.0


def test_a_head_with_its_own_embedding_loads_and_stays_exact(make_engine: MakeEngine, tmp_path: Path) -> None:
    plain = make_engine(block_size=4)
    own = write_head(tmp_path / "own", plain.model_config, draft_vocab=plain.model_config.vocab_size,
                     own_embedding=True, norm_before_residual=True)  # fmt: skip
    spec = make_engine(block_size=4, speculative=eagle(own, 2))
    assert spec.drafter is not None and not spec.drafter.head.shares_embedding
    prompts = [plain.tokenizer.encode(t) for t in TEXTS[:2]]
    assert run(spec, prompts, [GREEDY] * 2) == plain.generate(prompts, GREEDY)


def test_what_is_not_built_is_refused_by_name(make_engine: MakeEngine, tmp_path: Path) -> None:
    target = make_engine().model_config
    assert default_aux_layers(32) == (2, 16, 29)
    base = json.loads((write_head(tmp_path / "h", target) / "config.json").read_text())
    cases = [
        ({"architectures": ["Eagle3Speculator"]}, "the speculators format"),
        ({"num_hidden_layers": 2}, "num_hidden_layers=2 is not supported"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state=False is not supported"),
        ({"target_hidden_size": 128}, "hidden states of size 128"),
        ({"vocab_size": 100}, "vocab_size=100 differs from the target's"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}, "must be three layers of the target's 2"),
        ({"eagle_config": {}}, "must be three layers of the target's 2"),  # the default 2, 1, -1 does not fit
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ]
    for change, message in cases:
        with pytest.raises(UnsupportedModelError, match=re.escape(message)):
            parse_eagle3_config({**base, **change}, target, "head")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(json.dumps(base))
        load_eagle3(str(tmp_path / "empty"), target)
    # A head whose weights do not match its config fails at load, naming the tensors.
    from safetensors.torch import load_file

    broken = tmp_path / "broken"
    write_head(broken, target)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["midlayer.hidden_norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("lacks weights: ['midlayer.hidden_norm.weight']")):
        make_engine(speculative=eagle(broken))
    with pytest.raises(ValueError, match="EAGLE-3 drafts on a kv_consumer are not supported"):
        from engine.args import KVTransferConfig

        make_engine(speculative=eagle(broken), kv_transfer=KVTransferConfig(kv_role="kv_consumer"))
