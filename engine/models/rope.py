"""Rotary position tables, with the frequency scalings checkpoints ask for (transformers' definitions).

``default``, ``linear`` (positions interpolated), ``llama3`` (Llama 3.1-3.3: low frequencies divided by the
factor, high ones kept, a smooth ramp between), ``yarn`` (ramped interpolation plus an attention factor that
scales cos and sin) and ``dynamic`` (NTK-aware base). transformers grows a ``dynamic`` base with the current
sequence as it decodes; a paged cache holds keys already rotated, so the engine fixes the base once: the plain
frequencies while the served context fits the checkpoint's ``max_position_embeddings`` (then identical to
transformers), else the base transformers would use at the longest served context (as vLLM does).
"""

from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    s = cfg.rope_scaling
    assert s is not None
    base, factor = cfg.rope_theta, s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per dimension pair
    return interpolation * (1 - keep) + extrapolation * keep, attention


def inverse_frequencies(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, attention factor)`` for a context of up to ``max_len`` positions."""
    dim, s = cfg.head_dim, cfg.rope_scaling
    if s is None:
        return _base_inv_freq(cfg.rope_theta, dim), 1.0
    if s.kind == "linear":
        return _base_inv_freq(cfg.rope_theta, dim) / s.factor, 1.0
    if s.kind == "llama3":
        inv = _base_inv_freq(cfg.rope_theta, dim)
        return _llama3(inv, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings), 1.0
    if s.kind == "dynamic":
        trained = cfg.max_position_embeddings
        if max_len <= trained:
            return _base_inv_freq(cfg.rope_theta, dim), 1.0
        base = cfg.rope_theta * ((s.factor * max_len / trained) - (s.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if s.kind == "yarn":
        return _yarn(cfg, dim)
    raise ValueError(f"rope type {s.kind!r} has no tables")  # parse_hf_config refuses it first


def context_limit(cfg: ModelConfig) -> int:
    """The longest context the model serves: ``dynamic`` scaling stretches the trained one by its factor."""
    s = cfg.rope_scaling
    if s is not None and s.kind == "dynamic":
        return int(cfg.max_position_embeddings * s.factor)
    return cfg.max_position_embeddings


def rope_tables(cfg: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin for positions ``0..max_len-1``, float32 ``[max_len, head_dim]`` on ``device``.

    Computed on the CPU and then moved, so the tables do not depend on the device's cos / sin.
    """
    inv_freq, attention = inverse_frequencies(cfg, max_len)
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention).to(device), (emb.sin() * attention).to(device)
