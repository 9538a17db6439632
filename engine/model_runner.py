"""Runs the model on one device: owns the weights and the paged KV cache, turns batches into tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.attention import AttentionMetadata, decode_mask, kv_cache_shape, plan_prefill
from engine.cpu_packed import PackedCpuOps, build_cpu_gemm
from engine.cuda_graph import DecodeGraphs, MixedGraphs, forward_target
from engine.kernels import decode_splits
from engine.kernels.ops import TritonOps
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.loader import WeightSource
from engine.models.moe import SparseMoE
from engine.models.quant import Fp8Linear, QuantSpec
from engine.parallel.group import SINGLE, TensorParallel
from engine.sampler import SampleOutput, Sampler, SampleRow, sample_row, token_logprobs
from engine.sequence import SamplingParams, Sequence, TokenLogprob
from engine.spec_decode import EagleDrafter, EagleRows, accept_greedy, can_speculate, rejection_sample

log = logging.getLogger(__name__)

# GPU memory kept out of the KV pool beyond the measured peak: graph pools, allocator fragmentation.
GRAPH_AND_SLACK_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class DecodeGraphStep:
    """A decode-only step that a captured decode graph serves: its inputs are staged in ``graph``'s buffers."""

    graph: DecodeGraphs
    rows: tuple[SampleRow, ...]  # how to sample each sequence's next token
    bitmask: torch.Tensor | None = None  # structured-output token masks of ``bitmask_rows``
    bitmask_rows: tuple[int, ...] = ()
    drafts: tuple[tuple[int, ...], ...] = ()  # never any: verify rows are not decodes
    # Scheduled ahead: the step before's sampled tokens, still on the device, that its input ids are taken from
    # (the rows staged in the graph's ``feed``)
    fed: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class MixedGraphStep:
    """A step with prompt tokens (or verify rows) that a captured mixed-step graph serves, staged in ``graph``."""

    graph: MixedGraphs
    rows: tuple[SampleRow, ...]
    bitmask: torch.Tensor | None = None
    bitmask_rows: tuple[int, ...] = ()
    # Speculative decoding: each sampled row's drafts, when any row has some. A verify row has
    # ``1 + len(drafts)`` logits rows (its last token's and each draft's), in order.
    drafts: tuple[tuple[int, ...], ...] = ()
    eagle: EagleRows | None = None  # an EAGLE-3 head drafts for (and learns from) this step's sequences


@dataclass(frozen=True, slots=True)
class EagerStep:
    """A step run eagerly: the model's input tensors, its attention metadata and what to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # which hidden rows produce a next token (one per sampled row, 1 + k per verify row)
    rows: tuple[SampleRow, ...]
    bitmask: torch.Tensor | None = None
    bitmask_rows: tuple[int, ...] = ()
    # prompt_logprobs: the hidden rows that score prompt tokens, those tokens, and per sequence
    # (seq_id, how many of the rows, top k)
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    prompt_seqs: tuple[tuple[int, int, int], ...] = ()
    drafts: tuple[tuple[int, ...], ...] = ()
    eagle: EagleRows | None = None  # an EAGLE-3 head drafts for (and learns from) this step's sequences


# One step's inputs, built on the event-loop thread, consumed on the model thread. Holding only tensors and
# values (no live Sequence objects) lets a request be aborted while the step runs without the step seeing
# its sequence change.
StepInput = DecodeGraphStep | MixedGraphStep | EagerStep


class Launched:
    """A step handed to the device: its output, or (a decode step whose tokens a step scheduled ahead reads) its
    tokens on the device and their copy to the host under way, waited for by ``result``."""

    __slots__ = ("_event", "_host", "_out", "tokens")

    def __init__(self, out: SampleOutput | None = None, tokens: torch.Tensor | None = None) -> None:
        self._out = out
        self.tokens = tokens  # None: the step's output is on the host already (nothing can be scheduled ahead of it)
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if tokens is not None:
            if tokens.is_cuda:
                self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self._host.copy_(tokens, non_blocking=True)
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._event.record()
            else:
                self._host = tokens

    def result(self) -> SampleOutput:
        """The step's output, once the device has produced it (blocks until then)."""
        if self._out is None:
            assert self._host is not None
            if self._event is not None:
                self._event.synchronize()
            tokens: list[int] = self._host.tolist()
            self._out = SampleOutput(tokens, [None] * len(tokens))
        return self._out


@dataclass(slots=True)
class _FlatBatch:
    """The scheduled sequences laid end to end: every new token's id, position and cache slot, and which
    hidden rows are sampled (what both a mixed-step graph and an eager step are made from)."""

    ids: list[int]
    positions: np.ndarray
    slots: np.ndarray
    query_lens: list[int]
    cached_lens: list[int]
    context_lens: list[int]
    sampled: list[Sequence]
    logits_rows: list[int]
    prompt_rows: list[int]  # hidden rows whose logits score the next prompt token (prompt_logprobs)
    prompt_targets: list[int]
    prompt_seqs: list[tuple[int, int, int]]  # (seq_id, rows, top k)
    drafts: tuple[tuple[int, ...], ...]  # per sampled sequence, when any has drafts (verify rows); else ()
    sampled_at: list[int] = field(default_factory=list)  # per sequence: its sampled row, -1 for none (EAGLE-3)
    next_token: list[int] = field(default_factory=list)  # per sequence: the token after its chunk, -1 past its end


def sample_rows(seqs: Seq[Sequence], vocab_size: int) -> tuple[tuple[SampleRow, ...], torch.Tensor | None,
                                                               tuple[int, ...]]:  # fmt: skip
    """How to sample the next token of each of ``seqs``, and their grammar masks (filled now, before the
    step, from each matcher's state)."""
    rows = tuple(sample_row(s) for s in seqs)
    constrained = tuple(i for i, s in enumerate(seqs) if s.grammar is not None)
    if not constrained:
        return rows, None, ()
    from engine.structured import fill_bitmasks

    return rows, fill_bitmasks(len(seqs), vocab_size, [(i, seqs[i].grammar) for i in constrained]), constrained


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


def random_weights(model: DecoderForCausalLM, seed: int) -> None:
    """``--load-format dummy``: draw every weight on its device (norms 1, the rest N(0, 0.02), as transformers
    initialises): the real model's speed without its checkpoint (its text is noise)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        fp8: set[str] = set()
        for mname, module in model.named_modules():
            if isinstance(module, Fp8Linear):  # drawn in bf16, then quantized as a checkpoint's would be
                w = torch.empty(module.out_features, module.in_features, dtype=torch.bfloat16, device=device)
                module.load_rows(0, w.normal_(0.0, 0.02, generator=gen))
                fp8 |= {f"{mname}.weight", f"{mname}.weight_scale"}
        for name, p in model.named_parameters():
            if name in fp8:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


class ModelRunner:
    """Weights, KV cache and the forward + sampling of one step, on CPU or one CUDA device."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: WeightSource | None,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        cache_dtype: torch.dtype,
        seed: int,
        sparse_topk: int = 0,
        kernels: str = "torch",
        max_model_len: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        quant: QuantSpec | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = model_config
        self.tp = tp
        self.kv_heads = model_config.num_key_value_heads // tp.size  # this rank's KV heads (all of them at tp 1)
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        # > 0: block-sparse decode over this many indexer-chosen blocks, with an indexer-key cache.
        self.sparse_topk = sparse_topk
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.cache_dtype = cache_dtype
        if kernels not in ("torch", "triton"):
            raise ValueError(f"unknown kernels {kernels!r}")
        with torch.device("meta"):
            model = DecoderForCausalLM(model_config, quant, tp)
        # Built on the meta device (no throwaway random init), given the serving dtype there (free), then
        # materialised empty on the device and filled tensor by tensor: no copy of the model in another dtype.
        model = model.to(dtype).to_empty(device=device)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
        self.model = model
        model.init_rope(device, self.max_model_len)
        if weights is None:
            random_weights(model, seed)
        else:
            model.load_weights(weights())
        model.eval()
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.kernels = kernels  # the fused MoE kernel with the Triton ops, the torch reference otherwise
        if kernels == "triton":
            model.ops = TritonOps()
        self.kernels = kernels
        self.kv_caches: list[torch.Tensor] = []
        # One [num_blocks, kv_heads, head_dim] tensor per layer, paged with the KV cache's block ids.
        self.indexer_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.sampler = Sampler(eos_token_ids, seed)
        self.drafter: EagleDrafter | None = None

    def attach_drafter(self, drafter: EagleDrafter) -> None:
        """Speculate with an EAGLE-3 head (before the KV cache is allocated): the target hands it its hidden
        states at the layers the head reads, in eager steps and from the mixed-step graphs."""
        self.drafter = drafter
        self.model.aux_layers = frozenset(drafter.head.config.aux_layer_ids)

    def pack_linears(self) -> None:
        """Speculating on the CPU with the torch ops: linears over several rows (verify rows) read weights packed
        once (``engine.cpu_packed``): for its native kernel when torch runs on one thread and the kernel builds,
        else for oneDNN; nothing elsewhere."""
        if self.device.type != "cpu" or self.kernels != "torch":
            return
        gemm = None
        if torch.get_num_threads() == 1:  # the native kernel runs on one thread; oneDNN uses torch's threads
            build = build_cpu_gemm()
            gemm = build.gemm
            if gemm is None:
                log.warning("cpu_gemm_unavailable packing=onednn reason=%s", build.why_not)
        ops = PackedCpuOps(self.model, gemm)
        self.model.ops = ops
        if self.drafter is not None:
            self.drafter.head.ops = PackedCpuOps(self.drafter.head, gemm)
        log.info("cpu_linears_packed count=%d kind=%s", ops.num_packed, ops.kind)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states an attached EAGLE-3 head reads, in its ``fc``'s order."""
        return self.drafter.head.config.aux_layer_ids if self.drafter is not None else ()

    # -- KV cache ----------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes one KV block takes across all layers (K and V, and its indexer keys when sparse)."""
        layers = self.config.num_hidden_layers
        draft = 2 * self.drafter.unit_bytes(self.cache_dtype) if self.drafter is not None else 0
        return layers * (2 * self.unit_bytes() + self.indexer_unit_bytes()) + draft

    def unit_bytes(self) -> int:
        """Bytes of one block within one layer's K (or V) region: the unit a KV transfer moves."""
        cfg = self.config
        elem = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.block_size * self.kv_heads * cfg.head_dim * elem

    def indexer_unit_bytes(self) -> int:
        """Bytes of one block's indexer keys in one layer (0 without sparse attention)."""
        if not self.sparse_topk:
            return 0
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.kv_heads * self.config.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, scratch: bool = False) -> None:
        """One ``[2, num_blocks, kv_heads, block_size, head_dim]`` tensor per layer (K at 0, V at 1; see
        ``engine.attention.kv_cache_shape``).

        ``scratch``: one more block after the pool (id ``num_blocks``, never handed out), where the
        padding rows of a captured decode graph write.
        """
        cfg = self.config
        self.num_blocks = num_blocks
        num_blocks += 1 if scratch else 0
        shape = kv_cache_shape(num_blocks, self.block_size, self.kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(cfg.num_hidden_layers)
        ]
        if self.drafter is not None:
            self.drafter.allocate(num_blocks, self.cache_dtype)
        if self.sparse_topk:
            ishape = (num_blocks, self.kv_heads, cfg.head_dim)
            self.indexer_caches = [
                torch.zeros(ishape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)
            ]

    def profile_cuda_blocks(self, gpu_memory_utilization: float, max_tokens: int) -> int:
        """How many KV blocks fit on the GPU after weights and a worst-case step's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # A worst-case prefill against a throwaway cache measures the activations' peak.
        tokens = min(max_tokens, self.max_model_len)
        blocks = (tokens + self.block_size - 1) // self.block_size
        self.allocate_kv_cache(blocks)
        seq = Sequence(0, [0] * tokens, SamplingParams(temperature=0.0, max_tokens=1), self.block_size)
        seq.block_table = list(range(blocks))
        self.execute(self.prepare([seq], [tokens], 0))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        self.indexer_caches = []
        if self.drafter is not None:
            self.drafter.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        cache_so_far = blocks * self.block_bytes()
        # This engine's share of the whole GPU (as vLLM's per-instance limit: engines sharing a GPU each
        # take theirs), less what it needs besides the cache; never more than is free now, with room left
        # for the CUDA graphs' pool and the allocator's slack.
        ours = int(total * gpu_memory_utilization) - (peak - cache_so_far)
        available = free - (peak - cache_so_far) - GRAPH_AND_SLACK_BYTES
        return max(min(ours, available) // self.block_bytes(), 0)

    # -- CUDA graphs ------------------------------------------------------------------------------

    def capture_graphs(self, sizes: Seq[int], token_sizes: Seq[int], max_num_seqs: int) -> None:
        """Capture the decode step for each batch size in ``sizes`` and the steps with prompt tokens for each
        token count in ``token_sizes`` (after allocate_kv_cache(scratch=True)). Without CUDA (the Triton
        interpreter, in tests) the same staged inputs run eagerly."""
        if self.kernels != "triton":
            raise ValueError("CUDA graphs need the Triton kernels")
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.indexer_caches,
            sorted(set(sizes)),
            self.block_size,
            self.num_blocks,
            self.max_model_len,
            self.sparse_topk,
        )
        self.graphs.capture_all()
        if token_sizes:
            self.mixed_graphs = MixedGraphs(
                self.model,
                self.kv_caches,
                sorted(set(token_sizes)),
                max_num_seqs,
                self.block_size,
                self.num_blocks,
                self.max_model_len,
                self.aux_layers,
            )
            self.mixed_graphs.capture_all()

    # -- one step -----------------------------------------------------------------------------------

    def prepare(self, seqs: Seq[Sequence], num_new_tokens: Seq[int], num_decodes: int) -> StepInput:
        """Turn the scheduled sequences into the inputs of one step, of the kind that serves it.

        The first ``num_decodes`` sequences decode one token; the others compute ``num_new_tokens``
        prompt tokens (or a verify row's drafts) from their first uncached one, and only those that reach
        their last token get a logits row (and a sampled token).
        """
        # An EAGLE-3 step reads the target's hidden states, which the mixed-step graphs hand out (not the decode
        # graphs: a step where every speculating sequence decodes one token replays a mixed-step graph too).
        eagle = self.drafter is not None and any(can_speculate(s) for s in seqs)
        graphs = None if eagle else self.graphs
        if graphs is not None and num_decodes == len(seqs) and graphs.fits(len(seqs)) and (
                not self.indexer_caches or self.sparse_topk == graphs.sparse_topk):  # fmt: skip
            return self._decode_graph_step(graphs, seqs)
        flat = self._flatten(seqs, num_new_tokens)
        mixed = self.mixed_graphs
        # Verify rows replay the graphs of steps with prompt tokens too: their 1 + k logits rows each fit in the
        # graph's logits rows (one per seat) as long as there are no more of them than seats.
        if (mixed is not None and not self.indexer_caches and not flat.prompt_rows
                and mixed.fits(len(flat.ids), len(seqs)) and len(flat.logits_rows) <= mixed.max_seqs):  # fmt: skip
            return self._mixed_graph_step(mixed, seqs, flat, eagle)
        return self._eager_step(seqs, flat, num_decodes, eagle)

    def serves_ahead(self, num_seqs: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences can be scheduled ahead: a decode graph serves it (the
        input ids are then read on the device from the step before's tokens)."""
        graphs = self.graphs
        return graphs is not None and self.drafter is None and graphs.fits(num_seqs) and (
            not self.indexer_caches or self.sparse_topk == graphs.sparse_topk)  # fmt: skip

    def prepare_ahead(self, seqs: Seq[Sequence], fed: torch.Tensor, feed: Seq[int]) -> DecodeGraphStep:
        """A decode step of ``seqs`` whose last tokens are pending: sequence i's input id is ``fed[feed[i]]``, a token
        the step before (still on the device) samples."""
        graphs = self.graphs
        assert graphs is not None and self.serves_ahead(len(seqs))
        graphs.stage(seqs, feed)
        rows, mask, masked = sample_rows(seqs, self.config.vocab_size)
        return DecodeGraphStep(graphs, rows, mask, masked, fed=fed)

    def launch(self, step: StepInput) -> Launched:
        """Hand ``step`` to the device. A decode step of rows that need no logprobs or grammar returns as soon as
        its work is queued, its tokens left on the device for a step scheduled ahead; any other step runs to its
        end (``execute``)."""
        if (isinstance(step, DecodeGraphStep) and step.bitmask is None
                and all(r.params.logprobs is None for r in step.rows)):  # fmt: skip
            logits, greedy, _ = step.graph.replay(len(step.rows), step.fed)
            return Launched(tokens=self.sampler.tokens(logits, step.rows, greedy))
        return Launched(self.execute(step))

    def _decode_graph_step(self, graphs: DecodeGraphs, seqs: Seq[Sequence]) -> DecodeGraphStep:
        graphs.stage(seqs)
        rows, mask, masked = sample_rows(seqs, self.config.vocab_size)
        return DecodeGraphStep(graphs, rows, mask, masked)

    def _flatten(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> _FlatBatch:
        bs = self.block_size
        rows = sum(num_new_tokens)
        positions, slots = np.empty(rows, np.int64), np.empty(rows, np.int64)
        flat = _FlatBatch([], positions, slots, [], [], [], [], [], [], [], [], ())
        drafts: list[tuple[int, ...]] = []
        total = 0  # hidden rows so far
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_cached_tokens
            end = start + n
            extra = seq.draft_tokens[: max(end - len(seq), 0)]  # a verify row: the drafts after its last token
            if n == 1 and not extra:  # a decode row: its one slot, without turning its block table into an array
                positions[total] = start
                slots[total] = seq.block_table[start // bs] * bs + start % bs
                flat.ids.append(seq.token_ids[start])
            else:
                pos = np.arange(start, end, dtype=np.int64)
                positions[total : total + n] = pos
                slots[total : total + n] = np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs
                flat.ids.extend(seq.token_ids[start:end])
            flat.ids.extend(extra)
            flat.query_lens.append(n)
            flat.cached_lens.append(start)
            flat.context_lens.append(end)
            k = seq.params.prompt_logprobs
            if k is not None:
                # Positions p score token p + 1; those already scored (a preempted prompt) are skipped.
                first, last = max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    base = total - start
                    flat.prompt_rows += range(base + first, base + last)
                    flat.prompt_targets += seq.token_ids[first + 1 : last + 1]
                    flat.prompt_seqs.append((seq.seq_id, last - first, k))
            total += n
            flat.next_token.append(seq.token_ids[end] if end < len(seq) else -1)
            flat.sampled_at.append(len(flat.sampled) if end == len(seq) + len(extra) else -1)
            if end == len(seq) + len(extra):
                flat.sampled.append(seq)
                flat.logits_rows.extend(range(total - 1 - len(extra), total))
                drafts.append(tuple(extra))
        flat.drafts = tuple(drafts) if any(drafts) else ()
        return flat

    def _mixed_graph_step(self, mixed: MixedGraphs, seqs: Seq[Sequence], flat: _FlatBatch,
                          eagle: bool) -> MixedGraphStep:  # fmt: skip
        mixed.stage(np.asarray(flat.ids, dtype=np.int32), flat.positions, flat.slots, flat.query_lens,
                    flat.context_lens, seqs, flat.logits_rows)  # fmt: skip
        rows, mask, masked = sample_rows(flat.sampled, self.config.vocab_size)
        return MixedGraphStep(mixed, rows, mask, masked, flat.drafts, _eagle_rows(seqs, flat) if eagle else None)

    def _eager_step(self, seqs: Seq[Sequence], flat: _FlatBatch, num_decodes: int, eagle: bool) -> EagerStep:
        bs = self.block_size
        query_lens, context_lens = flat.query_lens, flat.context_lens
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        dev = self.device
        # The Triton kernels take 32-bit indices; torch's indexing wants 64-bit ones.
        idx = torch.int32 if self.kernels == "triton" else torch.int64
        context = torch.tensor(context_lens, dtype=idx, device=dev)
        decode_width = max((len(s.block_table) for s in seqs[:num_decodes]), default=0)
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping=torch.from_numpy(flat.slots).to(device=dev, dtype=idx),
            block_tables=torch.from_numpy(tables).to(device=dev, dtype=idx),
            context_lens=context,
            query_lens=query_lens,
            cached_lens=flat.cached_lens,
            max_query_len=max(query_lens),
            max_context=max(context_lens),
            sparse_topk=self.sparse_topk,
        )
        if self.kernels == "triton":
            starts = np.zeros(len(seqs) + 1, dtype=np.int32)
            np.cumsum(query_lens, out=starts[1:])
            meta.query_start = torch.from_numpy(starts).to(dev)
            if num_decodes == len(seqs):
                meta.num_splits = decode_splits(
                    len(seqs), self.kv_heads, meta.max_context, dev, self.cache_dtype.itemsize == 1
                )
        else:
            meta.prefill_groups, meta.cached_seqs = plan_prefill(query_lens, flat.cached_lens, dev, first=num_decodes)
            meta.decode_width = decode_width
            if num_decodes:
                meta.decode_mask = decode_mask(context[:num_decodes], decode_width * bs)
        rows, mask, masked = sample_rows(flat.sampled, self.config.vocab_size)
        prompt = bool(flat.prompt_rows)
        return EagerStep(
            input_ids=torch.tensor(flat.ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(flat.positions).to(device=dev, dtype=idx),
            meta=meta,
            logits_indices=torch.tensor(flat.logits_rows, dtype=torch.int64, device=dev),
            rows=rows,
            bitmask=mask,
            bitmask_rows=masked,
            prompt_rows=torch.tensor(flat.prompt_rows, dtype=torch.int64, device=dev) if prompt else None,
            prompt_targets=torch.tensor(flat.prompt_targets, dtype=torch.int64, device=dev) if prompt else None,
            prompt_seqs=tuple(flat.prompt_seqs),
            drafts=flat.drafts,
            eagle=_eagle_rows(seqs, flat) if eagle else None,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> SampleOutput:
        """Run the forward pass and sample one token per sequence that reached its end (or the tokens of each
        verify row); an EAGLE-3 head drafts before the target's pass and catches up after it."""
        eagle = None
        if isinstance(step, EagerStep | MixedGraphStep) and step.eagle is not None:
            eagle = step.eagle
            step = self._draft(step, eagle)
        if isinstance(step, EagerStep):
            out, aux = self._execute_eager(step)
        elif step.drafts:  # a verify step replayed: every logits row of its verify rows
            logits, _, aux = step.graph.replay(sum(1 + len(d) for d in step.drafts))
            out = self._verify(logits, step, {})
        else:
            if isinstance(step, DecodeGraphStep):
                logits, greedy, aux = step.graph.replay(len(step.rows), step.fed)
            else:
                logits, greedy, aux = step.graph.replay(len(step.rows))
            out = self.sampler.sample(logits, step.rows, greedy, step.bitmask, step.bitmask_rows)
        if eagle is not None:
            assert self.drafter is not None and aux is not None
            self.drafter.catch_up(eagle, aux, out.token_lists if out.token_lists is not None else
                                  [[t] for t in out.tokens])  # fmt: skip
        return out

    def _execute_eager(self, step: EagerStep) -> tuple[SampleOutput, torch.Tensor | None]:
        aux_layers = self.aux_layers if step.eagle is not None else ()
        hidden, aux = forward_target(self.model, step.input_ids, step.positions, self.kv_caches, step.meta,
                                     self.indexer_caches, aux_layers)  # fmt: skip
        prompt: dict[int, list[TokenLogprob]] = {}
        if step.prompt_rows is not None and step.prompt_targets is not None:
            scores = token_logprobs(self.model.compute_logits(hidden[step.prompt_rows]).float(), step.prompt_targets,
                                    [k for _, rows, k in step.prompt_seqs for _ in range(rows)])  # fmt: skip
            at = 0
            for seq_id, rows, _ in step.prompt_seqs:
                prompt[seq_id] = scores[at : at + rows]
                at += rows
        if not step.rows:
            return SampleOutput([], [], prompt), aux
        logits = self.model.compute_logits(hidden[step.logits_indices])
        if step.drafts:
            return self._verify(logits, step, prompt), aux
        sampled = self.sampler.sample(logits, step.rows, None, step.bitmask, step.bitmask_rows)
        return SampleOutput(sampled.tokens, sampled.logprobs, prompt), aux

    def _draft(self, step: EagerStep | MixedGraphStep, rows: EagleRows) -> EagerStep | MixedGraphStep:
        """An EAGLE-3 step: the head proposes the drafts the scheduler made room for; they replace the
        placeholders in the step's inputs (the eager step's tensor, or the graph's staged ids before the replay)."""
        assert self.drafter is not None
        drafted = self.drafter.draft(rows)
        at = [rows.starts[i] + 1 + j for i, d in enumerate(drafted) for j in range(len(d))]
        if not at:
            return step
        values = [t for d in drafted for t in d]
        if isinstance(step, MixedGraphStep):
            step.graph.write_ids(at, values)
        else:
            dev = step.input_ids.device
            step.input_ids[torch.tensor(at, device=dev)] = torch.tensor(values, dtype=step.input_ids.dtype,
                                                                        device=dev)  # fmt: skip
        by_row = [tuple(drafted[i]) for i in range(len(drafted)) if rows.sampled[i] >= 0]
        return replace(step, drafts=tuple(by_row))

    def _verify(self, logits: torch.Tensor, step: StepInput, prompt: dict[int, list[TokenLogprob]]) -> SampleOutput:
        """A step with verify rows: the tokens each row produces (see engine.spec_decode).

        Rows without drafts sample as in any step; greedy verify rows keep drafts that equal the target's
        argmax; sampled ones go through the rejection sampler."""
        rows, drafts = step.rows, step.drafts
        ends = np.cumsum([1 + len(d) for d in drafts]) - 1
        out: list[list[int]] = [[] for _ in rows]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        normal = [i for i, d in enumerate(drafts) if not d]
        if normal:
            at = {row: j for j, row in enumerate(normal)}
            masked = [i for i in step.bitmask_rows if i in at]
            bitmask = step.bitmask[normal] if step.bitmask is not None else None
            sampled = self.sampler.sample(logits[ends[normal].tolist()], [rows[i] for i in normal], None, bitmask,
                                          [at[i] for i in masked])  # fmt: skip
            for j, i in enumerate(normal):
                out[i] = [sampled.tokens[j]]
                logprobs[i] = sampled.logprobs[j]
        greedy = [i for i, d in enumerate(drafts) if d and rows[i].params.greedy]
        if greedy:
            best = logits.argmax(dim=-1).tolist()
            for i in greedy:
                out[i] = accept_greedy(best[ends[i] - len(drafts[i]) : ends[i] + 1], drafts[i])
        drawn = [i for i, d in enumerate(drafts) if d and not rows[i].params.greedy]
        if drawn:
            k = max(len(drafts[i]) for i in drawn)
            # Each row's places padded to k + 1 by repeating its last (the padding is never reached).
            index = [ends[i] - len(drafts[i]) + min(j, len(drafts[i])) for i in drawn for j in range(k + 1)]
            params = [rows[i] for i in drawn for _ in range(k + 1)]
            probs = self.sampler.target_probs(logits[index], params).view(len(drawn), k + 1, -1)
            dev = logits.device
            tokens = torch.tensor([[*drafts[i], *[0] * (k - len(drafts[i]))] for i in drawn], device=dev)
            counts = torch.tensor([len(drafts[i]) for i in drawn], device=dev)
            for i, toks in zip(drawn, rejection_sample(probs, tokens, counts, None, self.sampler.generator(dev)),
                               strict=True):  # fmt: skip
                out[i] = toks
        return SampleOutput([t[0] for t in out], logprobs, prompt, out)


def _eagle_rows(seqs: Seq[Sequence], flat: _FlatBatch) -> EagleRows:
    """Where the step's sequences sit in its flattened tokens, for the EAGLE-3 head."""
    starts = np.zeros(len(seqs), dtype=np.int64)
    np.cumsum(flat.query_lens[:-1], out=starts[1:])
    return EagleRows(
        seq_ids=tuple(s.seq_id for s in seqs), starts=tuple(starts.tolist()), lens=tuple(flat.query_lens),
        ids=np.asarray(flat.ids, dtype=np.int64), positions=flat.positions, slots=flat.slots,
        tables=tuple(list(s.block_table) for s in seqs), speculate=tuple(can_speculate(s) for s in seqs),
        sampled=tuple(flat.sampled_at), next_token=tuple(flat.next_token),
        num_drafts=tuple(len(s.draft_tokens) for s in seqs),
    )  # fmt: skip
