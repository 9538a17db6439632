"""What a checkpoint's ``config.json`` asks of the engine, read once into a typed shape.

The Hub writes rotary scaling as ``rope_scaling`` (with ``type`` or ``rope_type``) and ``rope_theta`` at the top
level; transformers 5 writes both inside ``rope_parameters``. Both are read. Anything a config asks for that the
engine does not do (another architecture, an unknown rope type, attention sinks, partial rotary, a bias or an
activation the decoder lacks) is refused here, naming the field and its value: a model is never run wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architectures served, and what differs between them (see ``ModelConfig``).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not do (named in the message)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling (``rope_scaling`` / ``rope_parameters``), by transformers' definitions."""

    kind: str  # one of ROPE_TYPES other than "default"
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None = from factor (and mscale / mscale_all_dim)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the correction range to whole dimensions


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and variant of a decoder-only model; field names follow Hugging Face's ``config.json``.

    One decoder serves every supported family: RMSNorm, SwiGLU and rotary positions are common; the
    families differ by Q/K/V (and O) biases (Qwen2; Llama's ``attention_bias``), per-head Q/K RMSNorm
    (Qwen3), sliding-window attention (Mistral, Mixtral; per layer), rotary scaling (Llama 3.x) and MoE
    MLPs (Qwen3-MoE, Mixtral) on the layers ``moe_layers`` marks.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    architecture: str = "LlamaForCausalLM"
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Per layer: how many of the latest positions a token attends to (0: all of them).
    sliding_windows: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: the MLP is a mixture of experts
    dtype: str = ""  # the checkpoint's own dtype ("bfloat16", ...); "" when unknown

    def window(self, layer: int) -> int:
        """Sliding window of ``layer`` (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def any_window(self) -> bool:
        return any(self.sliding_windows)


def _refuse(where: str, field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: config.json {field}={value!r} is not supported: {why}")


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise _refuse(where, "rope_parameters", sorted(params), "rotary parameters per layer type")
    scaling = params if isinstance(params, dict) and params else raw.get("rope_scaling") or {}
    field = "rope_parameters" if scaling is params else "rope_scaling"
    theta = float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(where, "partial_rotary_factor", partial, "rotary over part of each head")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _refuse(where, f"{field}.rope_type", kind, f"rotary types served: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    max_pos = int(raw.get("max_position_embeddings", 2048))
    original = int(raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or max_pos)  # fmt: skip
    factor = scaling.get("factor")
    if factor is None:
        if kind != "yarn":
            raise _refuse(where, f"{field}.factor", None, f"rope type {kind!r} needs a factor")
        factor = max_pos / original
    return theta, RopeScaling(
        kind=kind,
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=None if scaling.get("attention_factor") is None else float(scaling["attention_factor"]),
        mscale=float(scaling.get("mscale") or 0.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        truncate=bool(scaling.get("truncate", True)),
    )


def _windows(raw: dict[str, Any], arch: str, layers: int, where: str) -> tuple[int, ...]:
    """Per-layer sliding windows, as transformers applies them for ``arch``."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is not None:
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise _refuse(where, "layer_types", unknown, "only full and sliding-window attention layers")
        if len(types) != layers:
            raise _refuse(where, "layer_types", len(types), f"expected one per layer ({layers})")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        # Every layer uses the window when one is set (transformers' Mistral/Mixtral attention).
        return (int(window),) * layers if window else ()
    if arch.startswith("Qwen"):
        if not raw.get("use_sliding_window"):
            if types and "sliding_attention" in types:
                raise _refuse(where, "layer_types", "sliding_attention", "with use_sliding_window false")
            return ()
        if not window:
            raise _refuse(where, "sliding_window", window, "use_sliding_window needs a window size")
        if types is None:
            first = int(raw.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    if window:
        raise _refuse(where, "sliding_window", window, f"{arch} has no sliding-window attention")
    return ()


def _moe(raw: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    if arch == "MixtralForCausalLM":
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 8)
        return dict(num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=(True,) * layers)  # fmt: skip
    if arch == "Qwen3MoeForCausalLM":
        # transformers 5 saves the expert count as num_local_experts; the Hub's configs say num_experts.
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        moe = tuple(i not in dense and experts > 0 and step > 0 and (i + 1) % step == 0 for i in range(layers))
        return dict(num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=moe)  # fmt: skip
    return {}


def parse_hf_config(raw: dict[str, Any], where: str = "model") -> ModelConfig:
    """Read a Hugging Face ``config.json`` (already parsed) into a ``ModelConfig``, refusing what is not served."""
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _refuse(where, "architectures", arch, f"architectures served: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "the MLPs are SwiGLU (silu)")
    if raw.get("mlp_bias"):
        raise _refuse(where, "mlp_bias", raw["mlp_bias"], "MLP projections have no bias here")
    for sink in ("attention_sinks", "sinks", "use_sinks", "num_sink_tokens"):
        if raw.get(sink):
            raise _refuse(where, sink, raw[sink], "attention sinks are not implemented")
    layers = int(raw["num_hidden_layers"])
    heads = int(raw["num_attention_heads"])
    theta, scaling = _rope(raw, where)
    llama_bias = bool(raw.get("attention_bias", False)) and arch == "LlamaForCausalLM"
    if raw.get("attention_bias") and arch.startswith("Qwen3"):
        raise _refuse(where, "attention_bias", True, "Qwen3 attention has no projection biases here")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=arch,
        rope_scaling=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM" or llama_bias,
        o_bias=llama_bias,
        qk_norm=arch.startswith("Qwen3"),
        sliding_windows=_windows(raw, arch, layers, where),
        dtype=str(raw.get("torch_dtype") or raw.get("dtype") or ""),
        **_moe(raw, arch, layers),
    )
