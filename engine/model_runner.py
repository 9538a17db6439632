"""Runs the model on one device: owns the weights and the paged KV cache, turns batches into tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, decode_mask, plan_prefill
from engine.models.llama import LlamaConfig, LlamaForCausalLM
from engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepInput:
    """A batch turned into tensors; built on the event-loop thread, consumed on the model thread.

    Holding only tensors and values (no live Sequence objects) lets a request be aborted while the
    step runs without the step seeing its sequence change.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # which hidden rows produce a next token (one per sequence)
    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for ``--kv_cache_dtype``."""
    if name == "auto":
        return model_dtype
    if name == "bf16":
        return torch.bfloat16
    if name == "fp16":
        return torch.float16
    if name == "fp32":
        return torch.float32
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv cache dtype {name!r}")


class ModelRunner:
    """Weights, KV cache and the forward + sampling of one step, on CPU or one CUDA device."""

    def __init__(
        self,
        model_config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        cache_dtype: torch.dtype,
        seed: int,
        sparse_topk: int = 0,
    ) -> None:
        self.config = model_config
        # > 0: block-sparse decode over this many indexer-chosen blocks, with an indexer-key cache.
        self.sparse_topk = sparse_topk
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.cache_dtype = cache_dtype
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config)
        # Built on the meta device (no throwaway random init), then materialised empty and loaded.
        model = model.to_empty(device=device)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
        self.model = model
        # Buffers (rotary tables) are not in the checkpoint: rebuild them on the real device.
        self._init_rope()
        model.load_hf_state_dict(weights)
        model.to(dtype)
        model.eval()
        self.kv_caches: list[torch.Tensor] = []
        # One [num_blocks, kv_heads, head_dim] tensor per layer, paged with the KV cache's block ids.
        self.indexer_caches: list[torch.Tensor] = []
        self._default_generator = torch.Generator().manual_seed(seed)

    def _init_rope(self) -> None:
        cfg = self.config
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
        )
        freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.int64).float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.model.rope_cos = emb.cos().to(self.device)
        self.model.rope_sin = emb.sin().to(self.device)

    # -- KV cache ----------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes one KV block takes across all layers (K and V, and its indexer keys when sparse)."""
        layers = self.config.num_hidden_layers
        return layers * (2 * self.unit_bytes() + self.indexer_unit_bytes())

    def unit_bytes(self) -> int:
        """Bytes of one block within one layer's K (or V) region: the unit a KV transfer moves."""
        cfg = self.config
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def indexer_unit_bytes(self) -> int:
        """Bytes of one block's indexer keys in one layer (0 without sparse attention)."""
        if not self.sparse_topk:
            return 0
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.config.num_key_value_heads * self.config.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer (K at 0, V at 1)."""
        cfg = self.config
        shape = (2, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(cfg.num_hidden_layers)
        ]
        if self.sparse_topk:
            ishape = (num_blocks, cfg.num_key_value_heads, cfg.head_dim)
            self.indexer_caches = [
                torch.zeros(ishape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)
            ]

    def profile_cuda_blocks(self, gpu_memory_utilization: float, max_tokens: int) -> int:
        """How many KV blocks fit on the GPU after weights and a worst-case step's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # A worst-case prefill against a throwaway cache measures the activations' peak.
        tokens = min(max_tokens, self.config.max_position_embeddings)
        blocks = (tokens + self.block_size - 1) // self.block_size
        self.allocate_kv_cache(blocks)
        seq = Sequence(0, [0] * tokens, SamplingParams(temperature=0.0, max_tokens=1), self.block_size)
        seq.block_table = list(range(blocks))
        self.execute(self.prepare([seq], True, [tokens]))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        self.indexer_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        cache_so_far = blocks * self.block_bytes()
        # Whatever other processes hold (total - free - ours) is outside our budget too.
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * gpu_memory_utilization) - others - (peak - cache_so_far)
        return max(budget // self.block_bytes(), 0)

    # -- one step -----------------------------------------------------------------------------------

    def prepare(self, seqs: Seq[Sequence], is_prefill: bool, num_new_tokens: Seq[int]) -> StepInput:
        """Turn the scheduled sequences into the tensors of one step.

        Each sequence computes ``num_new_tokens`` tokens from its first uncached one; only those
        that reach their last token get a logits row (and a sampled token).
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens: list[int] = []
        cached_lens: list[int] = []
        context_lens: list[int] = []
        sampled: list[Sequence] = []
        logits_rows: list[int] = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_cached_tokens if is_prefill else len(seq) - 1
            end = start + n
            table = np.asarray(seq.block_table, dtype=np.int64)
            pos = np.arange(start, end, dtype=np.int64)
            ids.extend(seq.token_ids[start:end])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            cached_lens.append(start)
            context_lens.append(end)
            if end == len(seq):
                sampled.append(seq)
                logits_rows.append(sum(query_lens) - 1)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        dev = self.device
        groups, cached = plan_prefill(query_lens, cached_lens, dev) if is_prefill else ([], [])
        context = torch.tensor(context_lens, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            context_lens=context,
            query_lens=query_lens,
            cached_lens=cached_lens,
            prefill_groups=groups,
            cached_seqs=cached,
            decode_mask=None if is_prefill else decode_mask(context, max_blocks * bs),
            sparse_topk=self.sparse_topk,
        )
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            params=tuple(s.params for s in sampled),
            generators=tuple(s.generator for s in sampled),
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[int]:
        """Run the forward pass and sample one token per sequence that reached its end."""
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, self.indexer_caches or None)
        if not step.params:
            return []
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return self.sample(logits, step.params, step.generators)

    def sample(
        self,
        logits: torch.Tensor,
        params: Seq[SamplingParams],
        generators: Seq[torch.Generator | None],
    ) -> list[int]:
        """Greedy rows by argmax in one op; sampled rows one by one with their own generator."""
        tokens: list[int] = logits.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return tokens
        rows = logits[sampled].cpu()  # generators live on the CPU
        for row, i in zip(rows, sampled, strict=True):
            gen = generators[i] or self._default_generator
            tokens[i] = sample_row(row, params[i], gen)
        return tokens


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from ``logits [vocab]`` with temperature, top-k and top-p."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop = probs.cumsum(-1) - probs > params.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = scaled.softmax(-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, one RNG call per row.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / noise).argmax())
