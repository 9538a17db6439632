"""Every served family against transformers' own model class: a tiny random checkpoint written with
``save_pretrained`` (seeded), loaded by the engine from that folder, generates greedily; transformers then scores
the same tokens teacher-forced and must rank each generated token first, with logprobs within 1e-3 (fp32, CPU).

Also: what a config asks for that the engine does not do is refused at load, naming the field and value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
import transformers

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.config import UnsupportedModelError, parse_hf_config
from engine.models.loader import load_model
from engine.sequence import SamplingParams, SequenceStatus
from tests.engine.conftest import DEVICE

VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (config class, model class, extra config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama31-rope-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-rope-linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama-rope-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "llama-rope-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    ),
    "llama32-tied-bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=6, norm_topk_prob=True, mlp_only_layers=[1], **MOE),
    ),
    "qwen3-moe-unnormalised": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, decoder_sparse_step=2, **MOE),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
PROMPTS = [[5, 17, 99, 240, 3, 77, 12, 8, 150, 42, 9, 31, 260, 7, 88, 19, 4],
           [200, 11, 64, 2, 301, 45]]  # fmt: skip
NEW_TOKENS = 12


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the test vocabulary (the tests feed ids; the engine needs the file)."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def checkpoint(family: str, folder: Path) -> torch.nn.Module:
    """Write a seeded tiny checkpoint of ``family`` with transformers' own classes; return the model."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1234)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(str(folder))
    write_tokenizer(folder)
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_teacher_forced(family: str, tmp_path: Path) -> None:
    reference = checkpoint(family, tmp_path)
    loaded = load_model(str(tmp_path))
    # Small blocks so that windows, prompts and decodes cross block boundaries.
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="float32", num_kvcache_blocks=64, block_size=4,
                      max_model_len=256, cudagraph_capture_sizes=(1, 2, 4))  # fmt: skip
    engine = LLMEngine(args, loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    seqs = [engine.add_request(p, engine.check_request(len(p), params, True)) for p in PROMPTS]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert engine.step()
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        ids = prompt + seq.completion_ids
        with torch.inference_mode():
            logits = reference(torch.tensor([ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        for i, (token, lp) in enumerate(zip(seq.completion_ids, seq.logprobs, strict=True)):
            assert int(want[i].argmax()) == token, f"{family}: position {i}: transformers ranks another token first"
            assert abs(float(want[i, token]) - lp.logprob) < 1e-3, f"{family}: position {i}: logprob differs"
    assert engine.block_manager.num_free_blocks == 64


@pytest.mark.timeout(120)
def test_sliding_window_changes_the_output(tmp_path: Path) -> None:
    """The window is honoured (not silently ignored): the same weights without it decode otherwise."""
    checkpoint("mistral-window", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert parse_hf_config(raw).sliding_windows == (7, 7, 7)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="float32", num_kvcache_blocks=64, block_size=4)
    windowed = LLMEngine(args, loaded=load_model(str(tmp_path))).generate(PROMPTS[:1], params)
    raw["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    full = LLMEngine(args, loaded=load_model(str(tmp_path))).generate(PROMPTS[:1], params)
    assert windowed != full


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures='GPT2LMHeadModel'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope_parameters.rope_type='su'"),
        ({"attention_sinks": True}, "attention_sinks=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types=['chunked_attention']"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change: dict[str, Any], named: str) -> None:
    raw: dict[str, Any] = dict(COMMON, architectures=["LlamaForCausalLM"], num_hidden_layers=2) | change
    with pytest.raises(UnsupportedModelError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_hf_config(raw)


@pytest.mark.timeout(60)
def test_quantized_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    checkpoint("llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        load_model(str(tmp_path))


@pytest.mark.timeout(60)
def test_dummy_load_format_needs_only_the_config(tmp_path: Path) -> None:
    checkpoint("qwen3", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    loaded = load_model(str(tmp_path))
    args = EngineArgs(model=str(tmp_path), device=DEVICE, num_kvcache_blocks=32, load_format="dummy")
    out = LLMEngine(args, loaded=loaded).generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0]) >= 1
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        LLMEngine(EngineArgs(model=str(tmp_path), device=DEVICE, num_kvcache_blocks=32), loaded=loaded)


def teacher_forced_gap(reference: torch.nn.Module, engine: LLMEngine) -> tuple[float, float]:
    """``(largest logprob difference, share of positions where transformers ranks the engine's token first)``
    of the engine's greedy tokens, scored by ``reference`` teacher-forced."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    seqs = [engine.add_request(p, engine.check_request(len(p), params, True)) for p in PROMPTS]
    while any(s.status is not SequenceStatus.FINISHED for s in seqs):
        assert engine.step()
    gap, agree, total = 0.0, 0, 0
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + seq.completion_ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        for i, (token, lp) in enumerate(zip(seq.completion_ids, seq.logprobs, strict=True)):
            gap = max(gap, abs(float(want[i, token]) - lp.logprob))
            agree += int(want[i].argmax()) == token
            total += 1
    return gap, agree / total


# FP8 weights + per-token FP8 activations against the float32 model, teacher-forced, on these tiny random
# checkpoints (weights N(0, 0.3): sharp, chaotic logits): largest logprob difference 0.8-3.5 and top-1 agreement
# 58-75% (bf16 weights on the same: 0.12-0.23 and 88-96%; docs/engine.md). The bounds catch a broken scale or
# layout (agreement near 1/320 then), not the format's own rounding.
FP8_LOGPROB_BOUND = 5.0
FP8_MIN_AGREEMENT = 0.5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_online_fp8_stays_close_to_the_float_model(family: str, tmp_path: Path) -> None:
    reference = checkpoint(family, tmp_path)
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="float32", num_kvcache_blocks=64, block_size=4,
                      max_model_len=256, quantization="fp8")  # fmt: skip
    engine = LLMEngine(args, loaded=load_model(str(tmp_path)))
    layer = engine.runner.model.decoder_layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert engine.runner.model.lm_head.weight.dtype == torch.float32  # the head stays in the model dtype
    gap, agree = teacher_forced_gap(reference, engine)
    print(f"{family}: FP8 largest logprob difference {gap:.4f}, top-1 agreement {agree:.0%}")
    assert gap < FP8_LOGPROB_BOUND
    assert agree >= FP8_MIN_AGREEMENT


@pytest.mark.timeout(120)
def test_fp8_checkpoint_loads_as_fp8(tmp_path: Path) -> None:
    """A compressed-tensors FP8 checkpoint (per-tensor weight scales, dynamic per-token activations), as
    llm-compressor writes it, loads with its own FP8 bytes and scales."""
    from safetensors.torch import load_file, save_file

    reference = checkpoint("qwen3", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            scale = t.abs().max().float() / 448.0
            fp8[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            fp8[name.removesuffix("weight") + "weight_scale"] = scale.reshape(1)
        else:
            fp8[name] = t
    save_file(fp8, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    fmt = {"num_bits": 8, "type": "float", "symmetric": True}
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**fmt, "strategy": "tensor", "dynamic": False},
        "input_activations": {**fmt, "strategy": "token", "dynamic": True}}}, "ignore": ["lm_head"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="float32", num_kvcache_blocks=64, block_size=4,
                      max_model_len=256)  # fmt: skip
    engine = LLMEngine(args, loaded=load_model(str(tmp_path)))
    qkv = engine.runner.model.decoder_layers[1].self_attn.qkv_proj
    q_name = "model.layers.1.self_attn.q_proj.weight"
    rows = fp8[q_name].shape[0]
    assert torch.equal(qkv.weight[:rows].view(torch.uint8).cpu(), fp8[q_name].view(torch.uint8))
    assert torch.equal(qkv.weight_scale[:rows].cpu(), fp8[q_name + "_scale"].expand(rows))
    gap, agree = teacher_forced_gap(reference, engine)
    print(f"FP8 checkpoint: largest logprob difference {gap:.4f}, top-1 agreement {agree:.0%}")
    assert gap < FP8_LOGPROB_BOUND
    assert agree >= FP8_MIN_AGREEMENT


# bf16 weights and activations against the float32 transformers model, teacher-forced, on these tiny random
# checkpoints: largest logprob difference 0.09-0.37, top-1 agreement 88-100% (CPU, 2026-12-01). The bounds
# state that tolerance; on CUDA (ENGINE_TEST_DEVICE=cuda) the same test runs the Triton kernels and graphs.
BF16_LOGPROB_BOUND = 0.75
BF16_MIN_AGREEMENT = 0.8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama31-rope-llama3", "mistral-window", "qwen3", "qwen3-moe", "mixtral"])
def test_family_in_bfloat16_within_the_stated_tolerance(family: str, tmp_path: Path) -> None:
    reference = checkpoint(family, tmp_path)
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="bfloat16", num_kvcache_blocks=64, block_size=4,
                      max_model_len=256, cudagraph_capture_sizes=(1, 2, 4))  # fmt: skip
    gap, agree = teacher_forced_gap(reference, LLMEngine(args, loaded=load_model(str(tmp_path))))
    print(f"{family}: bfloat16 largest logprob difference {gap:.3f}, top-1 agreement {agree:.0%}")
    assert gap < BF16_LOGPROB_BOUND
    assert agree >= BF16_MIN_AGREEMENT


@pytest.mark.timeout(120)
@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA one-token kernels need a GPU")
def test_qwen3_moe_wide_enough_for_the_one_token_kernels_stays_within_the_bf16_tolerance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3-MoE checkpoint whose rows the CUDA one-token kernel divides (hidden 256, expert width 256): its decode
    steps route through token_gemv.token_route and the one-token experts, and stay within the bf16 bounds."""
    from engine.kernels import token_gemv

    torch.manual_seed(1234)
    config = transformers.Qwen3MoeConfig(**{**COMMON, "hidden_size": 256, "initializer_range": 0.05}, head_dim=64,
                                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                                         norm_topk_prob=True)  # fmt: skip
    reference = transformers.Qwen3MoeForCausalLM(config).float().eval()
    reference.save_pretrained(str(tmp_path))
    write_tokenizer(tmp_path)
    monkeypatch.setitem(globals(), "PROMPTS", PROMPTS[:1])  # one sequence: its decode steps are one token each
    routed = []
    real = token_gemv.token_route
    monkeypatch.setattr(token_gemv, "token_route", lambda *a, **k: routed.append(1) or real(*a, **k))
    args = EngineArgs(model=str(tmp_path), device=DEVICE, dtype="bfloat16", num_kvcache_blocks=64, block_size=4,
                      max_model_len=256, cudagraph_capture_sizes=(1, 2, 4), enforce_eager=True)  # fmt: skip
    gap, agree = teacher_forced_gap(reference, LLMEngine(args, loaded=load_model(str(tmp_path))))
    print(f"qwen3-moe, hidden 256: bfloat16 largest logprob difference {gap:.3f}, top-1 agreement {agree:.0%}")
    assert routed, "one token's decode steps never reached the one-token router"
    assert gap < BF16_LOGPROB_BOUND
    assert agree >= BF16_MIN_AGREEMENT
