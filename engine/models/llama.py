"""The Llama family (Llama 2/3, SmolLM2, ...) over flattened token batches and a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kernels.ops import ModelOps, TorchOps


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shape of a Llama model; field names follow Hugging Face's ``config.json``."""

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


def rope_tables(cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin for every position, float32 ``[max_position_embeddings, head_dim]`` on ``device``.

    Computed on the CPU and then moved, so the tables do not depend on the device's cos / sin.
    """
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
    )
    freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (its weight); the computation is the ops' (float32 inside)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the paged cache."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V in one matmul: one kernel launch instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        ops: ModelOps,
        x: torch.Tensor,
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        indexer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = ops.attention(
            self.qkv_proj(x), rope, kv_cache, meta, indexer, self.num_heads, self.num_kv_heads, self.head_dim,
            self.scale,
        )  # fmt: skip
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU feed-forward block; gate and up in one matmul."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, ops: ModelOps, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    """One pre-norm transformer block. The residual stream is carried beside the hidden states so
    that each residual add is fused into the norm that follows it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        ops: ModelOps,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        indexer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``: the next layer adds them."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(ops, h, rope, kv_cache, meta, indexer)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(ops, h), residual


class LlamaForCausalLM(nn.Module):
    """Llama decoder: token ids of a flattened batch in, hidden states out; logits on demand.

    ``ops`` computes norms, activation and attention: ``TorchOps`` (the reference, CPU) unless the
    runner installs another. The rotary tables are not weights: ``init_rope`` builds them once, on the
    device the model was materialised on.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.ops: ModelOps = TorchOps()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.decoder_layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; decoder_layers is the typed view
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Registered empty so .to(dtype) converts them; init_rope fills them.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    def init_rope(self, device: torch.device) -> None:
        """Build the rotary tables on ``device`` (not in the checkpoint, and useless on the meta device)."""
        self.rope_cos, self.rope_sin = rope_tables(self.config, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        indexer_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        ops = self.ops
        x = self.embed_tokens(input_ids)
        # Rotary context gathered once per step, shared by every layer.
        rope = ops.rope(self.rope_cos, self.rope_sin, positions, x.dtype)
        indexers: list[torch.Tensor | None] = list(indexer_caches) if indexer_caches else [None] * len(kv_caches)
        residual: torch.Tensor | None = None
        for layer, kv_cache, indexer in zip(self.decoder_layers, kv_caches, indexers, strict=True):
            x, residual = layer(ops, x, residual, rope, kv_cache, meta, indexer)
        if residual is None:
            return ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the given hidden states ``[n, hidden]``."""
        return self.lm_head(hidden).float()  # type: ignore[no-any-return]

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Fill the model from Hugging Face Llama names (``model.layers.0.self_attn.q_proj.weight``...).

        Q/K/V and gate/up are fused here. Missing or unexpected names are an error, never skipped.
        """
        remaining = dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ValueError(f"checkpoint lacks weight {name!r}")
            return remaining.pop(name)

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.config.tie_word_embeddings:
                remaining.pop("lm_head.weight", None)
            else:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.decoder_layers):
                p = f"model.layers.{i}."
                attn = layer.self_attn
                attn.qkv_proj.weight.copy_(
                    torch.cat(
                        [
                            take(p + "self_attn.q_proj.weight"),
                            take(p + "self_attn.k_proj.weight"),
                            take(p + "self_attn.v_proj.weight"),
                        ]
                    )
                )
                attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                layer.mlp.gate_up_proj.weight.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                )
                layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        # Rotary inverse frequencies are recomputed, not loaded.
        leftover = [k for k in remaining if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"checkpoint has weights this model does not use: {sorted(leftover)[:5]}")
