"""The decoder of every served family (Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) over
flattened token batches and a paged KV cache. What differs between families is in ``ModelConfig``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kernels.ops import ModelOps, QKNorm, TorchOps
from engine.models.config import ModelConfig
from engine.models.moe import sum_parts
from engine.models.quant import Fp8Linear, QuantSpec, WeightScheme, is_kv_scale_name
from engine.models.rope import rope_tables
from engine.parallel.group import SINGLE, TensorParallel
from engine.parallel.layers import VocabParallelEmbedding, check_shardable, shard_loaders, vocab_rows

Loader = Callable[[torch.Tensor], None]  # copies one checkpoint tensor into its place in the model


def rows_of(dest: torch.Tensor, start: int, name: str) -> Loader:
    """A loader writing a checkpoint tensor into rows ``start:`` of ``dest`` (fused projections share a tensor)."""

    def load(t: torch.Tensor) -> None:
        if t.dim() == 0 or start + t.shape[0] > dest.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, which does not fit rows "
                             f"{start}: of {tuple(dest.shape)}")  # fmt: skip
        view = dest.narrow(0, start, t.shape[0])
        if t.shape != view.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                             f"{tuple(view.shape)}")  # fmt: skip
        view.copy_(t)  # converts dtype and device in one pass; no full-size temporary

    return load


class _Fp8Rows:
    """Loads one Hub module into rows of an ``Fp8Linear``: its weight alone (quantized at load), or its FP8
    weight with the checkpoint's scale, whichever of the two tensors comes first (each is held until the other)."""

    def __init__(self, layer: Fp8Linear, start: int, quant: QuantSpec) -> None:
        self.layer, self.start, self.quant = layer, start, quant
        self.weight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def take_weight(self, t: torch.Tensor) -> None:
        self.weight = t
        self._flush()

    def take_scale(self, t: torch.Tensor) -> None:
        self.scale = t
        self._flush()

    def _flush(self) -> None:
        if self.weight is None or (self.quant.scale_name is not None and self.scale is None):
            return
        self.layer.load_rows(self.start, self.weight, self.scale, self.quant.block_size)
        self.weight = self.scale = None


def make_linear(in_features: int, out_features: int, bias: bool, quant: QuantSpec | None,
                modules: list[str]) -> nn.Linear | Fp8Linear:  # fmt: skip
    """The projection fused from Hub ``modules``: FP8 when the quantization takes them, else a plain linear."""
    if quant is not None and quant.quantizes_fused(modules):
        return Fp8Linear(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias=bias)


def linear_loaders(linear: nn.Linear | Fp8Linear, parts: list[tuple[str, int]],
                   quant: QuantSpec | None) -> dict[str, Loader]:  # fmt: skip
    """Loaders of the Hub ``(module, first row)`` parts fused into ``linear`` (weights, biases, FP8 scales)."""
    out: dict[str, Loader] = {}
    for module, start in parts:
        if isinstance(linear, Fp8Linear):
            assert quant is not None
            rows = _Fp8Rows(linear, start, quant)
            out[module + ".weight"] = rows.take_weight
            if quant.scale_name is not None:
                out[f"{module}.{quant.scale_name}"] = rows.take_scale
        else:
            out[module + ".weight"] = rows_of(linear.weight, start, module + ".weight")
        if linear.bias is not None:
            out[module + ".bias"] = rows_of(linear.bias, start, module + ".bias")
    return out


def _drop(t: torch.Tensor) -> None:
    """The loader of a checkpoint tensor another rank holds."""


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (its weight); the computation is the ops' (float32 inside)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the paged cache.

    Q, K and V come from one fused projection (one matmul, biases for Qwen2); Qwen3 normalises each head's
    Q and K before rotating them; a sliding window (Mistral) limits how far back a token looks.
    """

    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantSpec | None = None,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__()
        # This rank's heads: Q/K/V column-split by head, O row-split (its partial sums all-reduced).
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.tp = tp
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.quant = quant
        p = f"model.layers.{layer}.self_attn."
        self.qkv_proj = make_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, quant,
                                    [p + "q_proj", p + "k_proj", p + "v_proj"])  # fmt: skip
        self.o_proj = make_linear(self.q_size, cfg.hidden_size, cfg.o_bias, quant, [p + "o_proj"])
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.window(layer)
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
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = ops.attention(
            ops.linear(self.qkv_proj, x), rope, kv_cache, meta, indexer, self.num_heads, self.num_kv_heads,
            self.head_dim, self.scale, self.window, qk_norm,
        )  # fmt: skip
        if self.tp.size == 1:
            return ops.linear_parts(self.o_proj, out)  # the next add_rms_norm sums any parts
        return self.tp.all_reduce(ops.linear(self.o_proj, out))

    def loaders(self, p: str) -> dict[str, Loader]:
        """Hub names (prefix ``p``) -> where they go."""
        parts = [(p + "q_proj", 0), (p + "k_proj", self.q_size), (p + "v_proj", self.q_size + self.kv_size)]
        out = linear_loaders(self.qkv_proj, parts, self.quant)
        out |= linear_loaders(self.o_proj, [(p + "o_proj", 0)], self.quant)
        if self.q_norm is not None and self.k_norm is not None:
            out[p + "q_norm.weight"] = rows_of(self.q_norm.weight, 0, p + "q_norm.weight")
            out[p + "k_norm.weight"] = rows_of(self.k_norm.weight, 0, p + "k_norm.weight")
        return out


class MLP(nn.Module):
    """SwiGLU feed-forward block; gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantSpec | None = None,
                 prefix: str = "", tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__()
        self.intermediate_size = intermediate_size // tp.size  # gate/up column-split, down row-split
        intermediate_size = self.intermediate_size
        self.tp = tp
        self.quant = quant
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, False, quant,
                                        [prefix + "gate_proj", prefix + "up_proj"])  # fmt: skip
        self.down_proj = make_linear(intermediate_size, hidden_size, False, quant, [prefix + "down_proj"])

    def forward(self, ops: ModelOps, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(ops.linear(self.down_proj, ops.swiglu_linear(self.gate_up_proj, x)))

    def loaders(self, p: str) -> dict[str, Loader]:
        parts = [(p + "gate_proj", 0), (p + "up_proj", self.intermediate_size)]
        return linear_loaders(self.gate_up_proj, parts, self.quant) | linear_loaders(
            self.down_proj, [(p + "down_proj", 0)], self.quant
        )


class MoEMLP(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE ``mlp``, Mixtral ``block_sparse_moe``) over ``SparseMoE``."""

    # Hub names of each expert's three projections: Qwen3-MoE's, then Mixtral's (w1 gate, w3 up, w2 down).
    PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        from engine.models.moe import SparseMoE

        self.num_experts = cfg.num_experts
        self.mixtral = cfg.architecture == "MixtralForCausalLM"
        self.tp = tp
        # Tensor parallel: every expert split like a dense MLP. Expert parallel: whole experts, this rank's
        # contiguous share [first_expert, first_expert + local); every rank routes every token (see docs/design.md).
        ep = tp.size if tp.expert_parallel else 1
        self.local_experts = cfg.num_experts // ep
        self.first_expert = tp.rank * self.local_experts if tp.expert_parallel else 0
        # Mixtral weighs each expert's output by a float32 routing weight; Qwen3-MoE rounds it to the model dtype.
        self.experts = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size * ep // tp.size, self.local_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, float32_routing=self.mixtral,
                                 total_experts=cfg.num_experts, first_expert=self.first_expert)  # fmt: skip

    def forward(self, ops: ModelOps, x: torch.Tensor) -> torch.Tensor:
        """On one rank the experts' outputs may come back unsummed, ``[tokens, top_k, hidden]``: the next
        ``add_rms_norm`` sums them (one launch fewer a layer). Ranks sum before their all-reduce."""
        if self.tp.size == 1:
            return cast(torch.Tensor, self.experts(x, sum_experts=False))
        return self.tp.all_reduce(self.experts(x))

    def norm_forward(self, ops: ModelOps, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``forward`` of ``ops.add_rms_norm(x, residual, weight, eps)``'s output, and the residual stream: on one
        rank, one token's router may take the add and the norm into its launch (``SparseMoE.norm_forward``)."""
        if self.tp.size == 1:
            fused = self.experts.norm_forward(x, residual, weight, eps)
            if fused is not None:
                return fused
        h, residual = ops.add_rms_norm(x, residual, weight, eps)
        return self.forward(ops, h), residual

    def loaders(self, p: str) -> dict[str, Loader]:
        moe = self.experts
        out: dict[str, Loader] = {p + "gate.weight": rows_of(moe.gate.weight, 0, p + "gate.weight")}
        names = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(self.num_experts):
            local = e - self.first_expert
            for hub in names:
                name = f"{p}experts.{e}.{hub}.weight"
                # Another rank's expert (expert parallel): read and dropped.
                out[name] = (partial(moe.load_expert, local, self.PARTS[hub]) if 0 <= local < self.local_experts
                             else _drop)  # fmt: skip
        return out


class DecoderLayer(nn.Module):
    """One pre-norm transformer block. The residual stream is carried beside the hidden states so
    that each residual add is fused into the norm that follows it."""

    def __init__(self, cfg: ModelConfig, layer: int, quant: QuantSpec | None = None,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, quant, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Where the Hub keeps this layer's MLP: Mixtral calls its MoE block block_sparse_moe.
        self.mlp_prefix = "block_sparse_moe." if cfg.architecture == "MixtralForCausalLM" else "mlp."
        if cfg.is_moe(layer):
            self.mlp: MLP | MoEMLP = MoEMLP(cfg, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, quant, f"model.layers.{layer}.{self.mlp_prefix}",
                           tp)  # fmt: skip

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
        """``(mlp output, residual stream before it)``: the next layer adds them. A MoE block takes the norm before it
        (``MoEMLP.norm_forward``), which its router may run in its own launch."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(ops, h, rope, kv_cache, meta, indexer)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MoEMLP):
            return self.mlp.norm_forward(ops, h, residual, norm.weight, norm.eps)
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(ops, h), residual

    def loaders(self, p: str) -> dict[str, Loader]:
        out = self.self_attn.loaders(p + "self_attn.") | self.mlp.loaders(p + self.mlp_prefix)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = rows_of(getattr(self, norm).weight, 0, f"{p}{norm}.weight")
        return out


class DecoderForCausalLM(nn.Module):
    """The decoder: token ids of a flattened batch in, hidden states out; logits on demand.

    ``ops`` computes norms, activation and attention: ``TorchOps`` (the reference, CPU) unless the
    runner installs another. The rotary tables are not weights: ``init_rope`` builds them once, on the
    device the model was materialised on.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, quant: QuantSpec | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if quant is not None and quant.scheme is not WeightScheme.ONLINE and cfg.num_experts:
            raise ValueError(
                f"{cfg.architecture}: FP8 checkpoints of MoE models are not supported (the experts run in bf16 "
                "only; --quantization fp8 on a bf16 checkpoint quantizes the rest)"
            )
        if quant is not None and quant.scheme is not WeightScheme.ONLINE and tp.size > 1:
            raise ValueError("FP8 checkpoints with --tensor-parallel-size > 1 are not supported (their scales are "
                             "not split between ranks); --quantization fp8 on a bf16 checkpoint is")  # fmt: skip
        check_shardable(cfg, tp.size, tp.expert_parallel)
        self.config = cfg
        self.tp = tp
        self.ops: ModelOps = TorchOps()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.decoder_layers = [DecoderLayer(cfg, i, quant, tp) for i in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)  # registers them; decoder_layers is the typed view
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows(cfg.vocab_size, tp), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        # EAGLE-3 drafts: the layers whose entering residual stream ``forward`` hands out when asked (``aux``).
        self.aux_layers: frozenset[int] = frozenset()

    def init_rope(self, device: torch.device, max_len: int) -> None:
        """Build float32 rotary tables for ``max_len`` positions on ``device`` (not in the checkpoint)."""
        self.rope_cos, self.rope_sin = rope_tables(self.config, max_len, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        indexer_caches: list[torch.Tensor] | None = None,
        aux: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm; ``aux``, when given, receives the residual stream entering each
        of ``aux_layers`` (by layer), which an EAGLE-3 draft head reads."""
        ops = self.ops
        if self.tp.size > 1 and meta.sparse_topk:
            meta.score_reduce = self.tp.all_reduce  # the block choice sums every rank's heads (engine.sparse)
        x = self.embed_tokens(input_ids)
        # Rotary context gathered once per step, shared by every layer.
        rope = ops.rope(self.rope_cos, self.rope_sin, positions, x.dtype)
        indexers: list[torch.Tensor | None] = list(indexer_caches) if indexer_caches else [None] * len(kv_caches)
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache, indexer) in enumerate(zip(self.decoder_layers, kv_caches, indexers, strict=True)):
            if aux is not None and i in self.aux_layers:
                aux[i] = x if residual is None else sum_parts(x, residual.dtype) + residual
            x, residual = layer(ops, x, residual, rope, kv_cache, meta, indexer)
        if residual is None:
            return ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the given hidden states ``[n, hidden]``."""
        logits = self.tp.all_gather_last(self.ops.linear(self.lm_head, hidden))  # the ranks' vocabulary slices
        return logits[..., : self.config.vocab_size].float()

    def weight_loaders(self) -> dict[str, Loader]:
        """Every Hub tensor name the model needs -> the loader that puts it in place."""
        out = {
            "model.embed_tokens.weight": rows_of(self.embed_tokens.weight, 0, "model.embed_tokens.weight"),
            "model.norm.weight": rows_of(self.norm.weight, 0, "model.norm.weight"),
        }
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = rows_of(self.lm_head.weight, 0, "lm_head.weight")
        for i, layer in enumerate(self.decoder_layers):
            out |= layer.loaders(f"model.layers.{i}.")
        return out

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the model from ``(Hub name, tensor)`` pairs, one at a time (a shard's tensors are read lazily).

        Q/K/V and gate/up are fused on the way, each tensor copied straight into its rows in the model's
        dtype and device. Missing or unexpected names are an error, never skipped.
        """
        loaders = shard_loaders(self.weight_loaders(), self.tp)
        seen: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in tensors:
                load = loaders.get(name)
                if load is None and is_kv_scale_name(name):
                    raise ValueError(f"checkpoint carries calibrated FP8 KV cache scales ({name!r}); this engine "
                                     "does not apply them (its FP8 KV cache uses a scale of 1.0)")  # fmt: skip
                if load is None:
                    # Rotary frequencies are recomputed; a tied head may still be written out.
                    if not (name.endswith("rotary_emb.inv_freq")
                            or (name == "lm_head.weight" and self.config.tie_word_embeddings)):  # fmt: skip
                        unexpected.append(name)
                    continue
                load(tensor)
                seen.add(name)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not use: {sorted(unexpected)[:5]}")
        missing = sorted(loaders.keys() - seen)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}" + (f" and {len(missing) - 5} more"
                                                                             if len(missing) > 5 else ""))  # fmt: skip
