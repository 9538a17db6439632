"""How one rank's slice of the model is cut: the vocab-parallel embedding, and the checkpoint slicing.

The decoder builds each projection at its per-rank size (``TensorParallel.split``) and loads it through
the same Hub-named loaders as with one rank; ``shard_loaders`` puts this rank's slice of each full
checkpoint tensor in front of them:

- Q/K/V and gate/up (column-parallel): this rank's output rows, by attention / KV heads and by the
  intermediate size. The KV cache of a rank holds its KV heads only.
- O and down (row-parallel): this rank's input columns; their outputs are partial sums, all-reduced
  by the decoder. A bias is added once (rank 0's; the other ranks load zeros).
- embed_tokens and lm_head (vocab-parallel): ``ceil(vocab / size)`` rows per rank, the last rank's tail
  zero-padded; the embedding is masked and all-reduced, the logits all-gathered.
- MoE experts: each expert column/row-split like a dense MLP, or with ``--enable-expert-parallel``
  whole experts per rank (the decoder maps expert ids; this module leaves those names alone).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.parallel.group import TensorParallel

Loader = Callable[[torch.Tensor], None]


def vocab_rows(vocab_size: int, tp: TensorParallel) -> int:
    """Rows of the embedding and LM head on each rank: the vocabulary split in ``size`` (the last rank padded)."""
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    """The token embedding with its rows split between the ranks: each rank looks up the ids in its slice,
    zeros the others, and the ranks sum (exact: one non-zero term per token). One rank: a plain lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab_rows(vocab_size, tp)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


def check_shardable(cfg: ModelConfig, size: int, expert_parallel: bool) -> None:
    """Refuse, naming the field, a model whose heads or MLP widths (or expert count, with ``expert_parallel``)
    ``--tensor-parallel-size`` (``size``) does not divide."""
    fields = [("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads)]
    if any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
        fields.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        fields.append(("num_experts", cfg.num_experts) if expert_parallel
                      else ("moe_intermediate_size", cfg.moe_intermediate_size))  # fmt: skip
    for name, value in fields:
        if value % size:
            why = " (KV heads are not replicated between ranks)" if name == "num_key_value_heads" else ""
            raise ValueError(f"--tensor-parallel-size {size} does not divide config.json {name}={value}{why}")


def _narrow(t: torch.Tensor, dim: int, tp: TensorParallel, name: str) -> torch.Tensor:
    if t.shape[dim] % tp.size:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}: dimension {dim} does not split "
                         f"into {tp.size} ranks")  # fmt: skip
    size = t.shape[dim] // tp.size
    return t.narrow(dim, tp.rank * size, size)


def _vocab_slice(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    rows = vocab_rows(t.shape[0], tp)
    start = min(tp.rank * rows, t.shape[0])
    part = t[start : start + rows]
    if part.shape[0] == rows:
        return part
    padded = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)  # the padding rows: never looked up, logits dropped
    padded[: part.shape[0]] = part
    return padded


# Hub module name -> how its weight is split: rows (column-parallel) or columns (row-parallel).
_ROWS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"}
_COLUMNS = {"o_proj", "down_proj", "w2"}


def shard(name: str, t: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """This rank's slice of the checkpoint tensor ``name`` (None: load zeros, a row-parallel bias off rank 0)."""
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_slice(t, tp)
    if "experts" in parts and tp.expert_parallel:
        return t  # whole experts: the decoder loads only this rank's
    if module in _ROWS:
        return _narrow(t, 0, tp, name)
    if module in _COLUMNS:
        if leaf == "bias":
            return t if tp.rank == 0 else None
        return _narrow(t, 1, tp, name)
    return t  # norms and the MoE router: replicated


def shard_loaders(loaders: dict[str, Loader], tp: TensorParallel) -> dict[str, Loader]:
    """``loaders`` (full Hub tensor -> its place in a one-rank model) fed with this rank's slices instead."""
    if tp.size == 1:
        return loaders

    def sliced(name: str, load: Loader) -> Loader:
        def run(t: torch.Tensor) -> None:
            part = shard(name, t, tp)
            load(torch.zeros_like(t) if part is None else part)

        return run

    return {name: sliced(name, load) for name, load in loaders.items()}
