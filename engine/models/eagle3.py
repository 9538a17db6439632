"""An EAGLE-3 draft head: one Llama decoder layer over the target's fused low/mid/high hidden states.

The layout is the one published EAGLE-3 heads for Llama-family targets use (``LlamaForCausalLMEagle3``, e.g.
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``; vLLM and SGLang read the same one):

- ``fc.weight [hidden, 3 * target_hidden]`` fuses the target's hidden states taken at three layers (the residual
  stream entering layers ``eagle_aux_hidden_state_layer_ids``; by default 2, L // 2 and L - 3 of L layers);
- ``midlayer.*``: the decoder layer, whose Q/K/V projections read ``[norm(token embedding), norm(hidden)]``
  (``2 * hidden`` wide) and whose ``hidden_norm`` normalises the hidden half;
- ``norm.weight``, ``lm_head.weight [draft_vocab, hidden]``: the head over a reduced draft vocabulary, mapped to
  the target's by ``d2t`` (target id = draft id + ``d2t[draft id]``); ``t2d`` (the inverse mask) is not needed;
- ``embed_tokens.weight``: its own embedding, or none (the target's is shared).

At draft position ``p`` the head reads the token at ``p + 1`` and a hidden state for position ``p`` (the target's,
fused by ``fc``, or its own previous output), writes its one layer's K/V at ``p`` in its own paged cache and
predicts the token at ``p + 2``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.kernels.ops import ModelOps, TorchOps
from engine.models.config import ModelConfig, UnsupportedModelError, parse_hf_config
from engine.models.decoder import MLP, Attention, Loader, RMSNorm, rows_of
from engine.models.loader import WeightSource, safetensors_files
from engine.models.rope import rope_tables

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """A draft head's shape: its decoder layer (``layer``, a one-layer Llama config) and the EAGLE-3 fields."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]  # target layers whose entering residual stream ``fc`` fuses
    norm_before_residual: bool  # the residual is the normalised hidden state (speculators' checkpoints)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers vLLM and SGLang capture when a head names none: low, middle and high."""
    return (2, num_layers // 2, num_layers - 3)


def parse_eagle3_config(raw: dict[str, Any], target: ModelConfig, where: str) -> Eagle3Config:
    """Read a draft head's ``config.json`` against its target, refusing what this engine does not run."""
    arch = (raw.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        hint = " (the speculators format: convert it back to LlamaForCausalLMEagle3)" if "Speculator" in arch else ""
        raise UnsupportedModelError(f"{where}: config.json architectures={arch!r} is not an EAGLE-3 head this engine "
                                    f"loads (expected one of {list(ARCHITECTURES)}){hint}")  # fmt: skip
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise UnsupportedModelError(f"{where}: config.json num_hidden_layers={raw['num_hidden_layers']!r} is not "
                                    "supported: EAGLE-3 heads of one decoder layer are built")  # fmt: skip
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise UnsupportedModelError(
            f"{where}: config.json eagle_config.use_aux_hidden_state=False is not supported: "
            "heads over the target's last hidden state only (EAGLE-1/2) are not built"
        )
    layer = parse_hf_config({**raw, "architectures": ["LlamaForCausalLM"]}, where)
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise UnsupportedModelError(f"{where}: the head reads hidden states of size {target_hidden} "
                                    f"(target_hidden_size) but the target's are {target.hidden_size}")  # fmt: skip
    if layer.vocab_size != target.vocab_size:
        raise UnsupportedModelError(f"{where}: config.json vocab_size={layer.vocab_size} differs from the target's "
                                    f"{target.vocab_size}: the head was trained for another tokenizer")  # fmt: skip
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(i) for i in ids) if ids else default_aux_layers(target.num_hidden_layers)
    if len(aux) != 3 or not all(0 <= i < target.num_hidden_layers for i in aux):
        raise UnsupportedModelError(f"{where}: eagle_aux_hidden_state_layer_ids={list(aux)} must be three layers of "
                                    f"the target's {target.num_hidden_layers}")  # fmt: skip
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=target_hidden,
        aux_layer_ids=(aux[0], aux[1], aux[2]),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


@dataclass(frozen=True, slots=True)
class LoadedDraft:
    """A draft head's config and its weights (read when the head is built)."""

    path: Path
    config: Eagle3Config
    weights: WeightSource


def load_eagle3(path: str, target: ModelConfig) -> LoadedDraft:
    """Find an EAGLE-3 head in a folder (``config.json`` + ``*.safetensors``); never downloads."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"EAGLE-3 draft {path!r}: expected a folder with config.json and *.safetensors "
                         "(models are never downloaded)")  # fmt: skip
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        extra = f" (found {bins}: convert them to safetensors)" if bins else ""
        raise ValueError(f"EAGLE-3 draft {path!r}: no *.safetensors files{extra}")
    raw = json.loads((folder / "config.json").read_text())
    return LoadedDraft(folder, parse_eagle3_config(raw, target, str(folder)), safetensors_files(files))


class Eagle3Draft(nn.Module):
    """The head itself: ``forward`` runs its layer over a flattened batch of draft positions."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    d2t: torch.Tensor

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        layer = cfg.layer
        self.config = cfg
        self.ops: ModelOps = TorchOps()
        hidden = layer.hidden_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, hidden)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.self_attn = Attention(layer, 0)
        # Q/K/V read the embedding and the hidden state side by side.
        a = self.self_attn
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, a.q_size + 2 * a.kv_size, bias=layer.qkv_bias)
        self.post_attention_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
        self.mlp = MLP(hidden, layer.intermediate_size)
        self.norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.shares_embedding = False  # set by load_weights: the checkpoint has no embedding of its own

    def init_rope(self, device: torch.device, max_len: int) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.config.layer, max_len, device)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states ``[n, 3 * target_hidden]`` -> the head's hidden input ``[n, hidden]``."""
        return self.fc(target_hidden)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(normalised output for the head, output before the norm: the next position's hidden input)``."""
        ops = self.ops
        embeds = ops.rms_norm(self.embed_tokens(input_ids), self.input_layernorm.weight, self.input_layernorm.eps)
        normed = ops.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps)
        residual = normed if self.config.norm_before_residual else hidden
        rope = ops.rope(self.rope_cos, self.rope_sin, positions, embeds.dtype)
        h = self.self_attn(ops, torch.cat([embeds, normed], dim=-1), rope, kv_cache, meta)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return ops.add_rms_norm(self.mlp(ops, h), residual, self.norm.weight, self.norm.eps)

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The most likely next token of each row, as a target-vocabulary id."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]  # type: ignore[no-any-return]

    def weight_loaders(self) -> dict[str, Loader]:
        p = "midlayer."
        out: dict[str, Loader] = {
            name: rows_of(param, 0, name)
            for name, param in (("fc.weight", self.fc.weight), ("norm.weight", self.norm.weight),
                                ("lm_head.weight", self.lm_head.weight), ("embed_tokens.weight",
                                                                          self.embed_tokens.weight),
                                (p + "input_layernorm.weight", self.input_layernorm.weight),
                                (p + "hidden_norm.weight", self.hidden_norm.weight),
                                (p + "post_attention_layernorm.weight", self.post_attention_layernorm.weight))
        }  # fmt: skip
        out |= self.self_attn.loaders(p + "self_attn.") | self.mlp.loaders(p + "mlp.")
        out["d2t"] = rows_of(self.d2t, 0, "d2t")
        return out

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], target_embedding: torch.Tensor) -> None:
        """Fill the head from its checkpoint (names with or without a ``model.`` prefix; ``layers.0.`` for
        ``midlayer.``). Without an ``embed_tokens`` of its own it takes the target's; without ``d2t`` the draft
        vocabulary must be the target's. Missing or unexpected names are an error."""
        loaders = self.weight_loaders()
        seen: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in tensors:
                name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
                if name == "t2d":
                    continue  # the target -> draft mask: drafts are mapped the other way only
                load = loaders.get(name)
                if load is None:
                    if not name.endswith("rotary_emb.inv_freq"):
                        unexpected.append(name)
                    continue
                load(tensor)
                seen.add(name)
            if "embed_tokens.weight" not in seen:
                if target_embedding.shape != self.embed_tokens.weight.shape:
                    raise ValueError(f"EAGLE-3 head has no embed_tokens and the target's embedding "
                                     f"{tuple(target_embedding.shape)} does not fit its "
                                     f"{tuple(self.embed_tokens.weight.shape)}")  # fmt: skip
                self.embed_tokens.weight = target_embedding  # shared, not copied
                self.shares_embedding = True
                seen.add("embed_tokens.weight")
            if "d2t" not in seen:
                if self.config.draft_vocab_size != self.config.layer.vocab_size:
                    raise ValueError("EAGLE-3 head: draft_vocab_size differs from vocab_size but the checkpoint has "
                                     "no d2t map")  # fmt: skip
                self.d2t.zero_()  # the identity
                seen.add("d2t")
        if unexpected:
            raise ValueError(f"EAGLE-3 head has weights this engine does not use: {sorted(unexpected)[:5]}")
        missing = sorted(loaders.keys() - seen)
        if missing:
            raise ValueError(f"EAGLE-3 head lacks weights: {missing[:5]}")


def write_random_head(folder: Path, target: ModelConfig, draft_vocab: int, seed: int = 0,
                      dtype: torch.dtype = torch.float32, own_embedding: bool = False,
                      **config: Any) -> Path:  # fmt: skip
    """A random EAGLE-3 head for ``target`` in the published layout (config.json + model.safetensors), the first
    ``draft_vocab`` ids drawn from the target's vocabulary (``d2t``); tests and benchmarks (its drafts are noise).
    ``config`` adds or overrides config.json fields."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, v, i = target.hidden_size, target.vocab_size, target.intermediate_size
    q, kv = target.num_attention_heads * target.head_dim, target.num_key_value_heads * target.head_dim
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.1).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + torch.randn(h, generator=gen) * 0.1).to(dtype)

    kept = torch.randperm(v, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[kept] = True
    p = "midlayer."
    weights = {
        "fc.weight": rand(h, 3 * h), "norm.weight": norm(), "lm_head.weight": rand(draft_vocab, h),
        "d2t": kept - torch.arange(draft_vocab), "t2d": t2d,
        p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": rand(q, 2 * h), p + "self_attn.k_proj.weight": rand(kv, 2 * h),
        p + "self_attn.v_proj.weight": rand(kv, 2 * h), p + "self_attn.o_proj.weight": rand(h, q),
        p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
        p + "mlp.down_proj.weight": rand(h, i),
    }  # fmt: skip
    if own_embedding:
        weights["embed_tokens.weight"] = rand(v, h)
    save_file(weights, str(folder / "model.safetensors"))
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": i,
        "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim, "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps, "vocab_size": v,
        "draft_vocab_size": draft_vocab, "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": target.rope_theta, "torch_dtype": str(dtype).removeprefix("torch."), **config,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    return folder
