"""The synchronous engine core: scheduler + block manager + model runner, one step at a time.

``LLMEngine`` is what tests and the benchmark drive step by step; ``engine.async_engine`` runs it
for the HTTP server and turns its tokens into text.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.args import EngineArgs
from engine.block_manager import BlockManager, BlockStats
from engine.cuda_graph import default_capture_sizes, default_token_sizes
from engine.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    KVCacheTooSmallError,
    OverloadedError,
)
from engine.kernels import interpret_mode, triton_importable
from engine.kv_events import EventRecorder
from engine.kv_transfer.layout import region_formats, region_views
from engine.model_runner import Launched, ModelRunner, StepInput, kv_cache_dtype
from engine.models.eagle3 import load_eagle3
from engine.models.loader import LoadedModel, load_model
from engine.models.quant import parse_quantization
from engine.models.rope import context_limit
from engine.parallel.group import SINGLE, TensorParallel
from engine.parallel.layers import check_shardable
from engine.parallel.ranks import RankWorkers
from engine.sampler import SampleOutput
from engine.scheduler import QueueFullError, ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus, TokenLogprob
from engine.spec_decode import DraftProposer, EagleDrafter, EagleProposer, NgramProposer, build_drafter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A step handed to the device whose output the host has not taken yet."""

    batch: ScheduledBatch
    launched: Launched


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and gauges for /metrics, read on the event loop."""

    running: int
    waiting: int
    blocks: BlockStats
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    # Speculative decoding (vLLM's spec_decode counters): verify rows, drafts they carried, drafts accepted.
    spec_drafts: int = 0
    steps_ahead: int = 0  # --async-scheduling: steps launched before the output of the one before was on the host
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_length(self) -> float:
        """Tokens a verify row produced on average (accepted drafts + the target's own); 0 before any."""
        return 1.0 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when torch sees a GPU, else the CPU; ``cuda:N`` becomes the current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA device (is this a CPU build of torch?)")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s) "
                "(CUDA_VISIBLE_DEVICES renumbers them from 0)"
            )
        # Kernels, graphs and streams made without a device go to the current one: make it this one.
        torch.cuda.set_device(device)
    return device


def resolve_kernels(name: str, device: torch.device, cache_dtype: torch.dtype, head_dim: int = 64) -> str:
    """``auto``: the Triton kernels on CUDA (torch's for a head size that is not a power of two, which the
    kernels do not tile), plain torch on CPU. An FP8 KV cache runs on both: stored and read with a unit scale."""
    pow2 = head_dim & (head_dim - 1) == 0
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_importable() and pow2 else "torch"
    if name == "triton" and not pow2:
        raise ValueError(f"--kernels triton: head_dim {head_dim} is not a power of two (use --kernels torch)")
    if name == "triton" and device.type != "cuda" and not interpret_mode():
        raise ValueError("--kernels triton needs a CUDA device (or TRITON_INTERPRET=1, for tests)")
    if name == "triton" and not triton_importable():
        raise ValueError("--kernels triton: the triton package is not installed")
    return name


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str = "") -> torch.dtype:
    """``auto``: float32 on CPU (exact, and fast enough for small models); on CUDA the checkpoint's own
    half-precision dtype (bfloat16 or float16), bfloat16 when it has none or is float32."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_runner(args: EngineArgs, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE) -> tuple[ModelRunner, int, list[int]]:  # fmt: skip
    """One rank's model runner, its KV cache allocated and its CUDA graphs captured; with the pool's block count
    (the same on every rank: the smallest any rank can hold) and the captured decode batch sizes.

    Every rank of a tensor-parallel engine runs this at the same time: the CUDA memory profile, the block
    count and the graph captures meet in collectives."""
    cache_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    kernels = resolve_kernels(args.kernels, device, cache_dtype, loaded.config.head_dim)
    max_model_len = args.max_model_len or loaded.config.max_position_embeddings
    runner = ModelRunner(
        loaded.config,
        None if args.load_format == "dummy" else loaded.weights,
        device,
        dtype,
        args.block_size,
        cache_dtype,
        args.seed,
        sparse_topk=args.sparse_topk_blocks if args.sparse_attention else 0,
        kernels=kernels,
        max_model_len=max_model_len,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        quant=parse_quantization(loaded.hf_config, args.quantization),
        tp=tp,
    )
    spec = args.speculative
    if spec is not None and spec.method == "eagle3":
        attach_eagle3(args, loaded, runner, dtype, max_model_len, tp)
    if spec is not None:
        runner.pack_linears()  # verify rows are several rows a step (engine.cpu_packed; CPU only)
    num_blocks = tp.min_int(count_blocks(args, runner), device)
    sizes = capture_sizes(args, runner)
    runner.allocate_kv_cache(num_blocks, scratch=bool(sizes))
    if tp.size > 1 and device.type == "cpu":
        for t in (*runner.kv_caches, *runner.indexer_caches):
            t.share_memory_()  # type: ignore[no-untyped-call]  # rank 0 maps every rank's cache (the KV relay moves them all); before any capture
    if sizes:
        # Steps with prompt tokens too, unless sparse (its decode rows pick blocks per step: eager then).
        tokens = [] if args.sparse_attention else default_token_sizes(args.max_num_batched_tokens)
        runner.capture_graphs(sizes, tokens, args.max_num_seqs)
    return runner, num_blocks, sizes


def attach_eagle3(args: EngineArgs, loaded: LoadedModel, runner: ModelRunner, dtype: torch.dtype,
                  max_model_len: int, tp: TensorParallel) -> None:  # fmt: skip
    """Attach the EAGLE-3 head of --speculative-config method eagle3 to ``runner`` (before its KV cache exists:
    the pool holds the head's one-layer cache too)."""
    spec = args.speculative
    assert spec is not None and spec.model is not None
    if args.kv_transfer.kv_role == "kv_consumer":
        raise ValueError(
            "EAGLE-3 drafts on a kv_consumer are not supported: the head needs the target's hidden "
            "states over the prompt, which stay on the prefill engine (method 'ngram' works there)"
        )
    if tp.size > 1:
        raise ValueError("EAGLE-3 drafts with --tensor-parallel-size > 1 are not supported: the head is not split "
                         "between ranks (method 'ngram' works there)")  # fmt: skip
    drafter = build_drafter(load_eagle3(spec.model, loaded.config), runner.model.embed_tokens.weight,
                            runner.device, dtype, args.block_size, runner.kernels == "triton",
                            max_model_len)  # fmt: skip
    runner.attach_drafter(drafter)


def build_rank_runner(args: EngineArgs, device: torch.device, tp: TensorParallel) -> ModelRunner:
    """The runner of a tensor-parallel rank other than 0, in its own process: it loads --model itself."""
    loaded = load_model(args.model)
    return build_runner(args, loaded, device, resolve_dtype(args.dtype, device, loaded.config.dtype), tp)[0]


def capture_sizes(args: EngineArgs, runner: ModelRunner) -> list[int]:
    """Decode batch sizes to capture as CUDA graphs; none on CPU, with --enforce-eager or torch kernels."""
    # (Without CUDA, only under the Triton interpreter in tests: the graphs' staged inputs then run eagerly.)
    if runner.kernels != "triton" or args.enforce_eager or (runner.device.type != "cuda" and not interpret_mode()):
        return []
    sizes = args.cudagraph_capture_sizes or default_capture_sizes(args.max_num_seqs)
    return sorted(b for b in set(sizes) if b <= args.max_num_seqs) or [min(sizes)]


def count_blocks(args: EngineArgs, runner: ModelRunner) -> int:
    """KV blocks for the pool: --num-kvcache-blocks, else what the GPU (or --kv-cache-memory-gb) holds."""
    if args.num_kvcache_blocks is not None:
        return args.num_kvcache_blocks
    if runner.device.type == "cuda":
        blocks = runner.profile_cuda_blocks(args.gpu_memory_utilization, args.max_num_batched_tokens)
    else:
        blocks = int(args.kv_cache_memory_gb * (1 << 30)) // runner.block_bytes()
    if blocks < 1:
        raise ValueError("no memory is left for the KV cache: raise the memory setting")
    return blocks


class LLMEngine:
    """Owns one model and its KV cache; admits sequences and advances them one step at a time."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.args = args
        if loaded is not None and args.tensor_parallel_size > 1:
            raise ValueError("--tensor-parallel-size > 1: every rank loads --model itself; a model handed to the "
                             "engine in memory cannot be shared with the other ranks")  # fmt: skip
        loaded = loaded if loaded is not None else load_model(args.model)
        self.model_id = loaded.model_id
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.tokenizer.eos_token_ids
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device, loaded.config.dtype)
        max_pos = context_limit(loaded.config)
        self.max_model_len = args.max_model_len or loaded.config.max_position_embeddings
        if self.max_model_len > max_pos:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's context length {max_pos}")
        if args.sparse_attention and loaded.config.any_window:
            raise ValueError("--sparse-attention with a sliding-window model (config.json sliding_window) is not "
                             "supported: the block selection does not know the window")  # fmt: skip
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"--max-num-batched-tokens {args.max_num_batched_tokens} is below --max-model-len "
                f"{self.max_model_len}: with --no-enable_chunked_prefill prompts are prefilled whole, "
                "so it must be at least that"
            )
        # --tensor-parallel-size N: ranks 1..N-1 start now, in their own processes, and build their slices
        # alongside this one (every collective of the build is met by all ranks).
        self.ranks: RankWorkers | None = None
        tp = SINGLE
        if args.tensor_parallel_size > 1:
            check_shardable(loaded.config, args.tensor_parallel_size, args.enable_expert_parallel)  # before spawning
            if args.enable_expert_parallel and not loaded.config.num_experts:
                raise ValueError(f"--enable-expert-parallel: {loaded.config.architecture} has no experts")
            self.ranks = RankWorkers(args, self.device, build_rank_runner)
            tp = self.ranks.tp
        try:
            self.runner, self.num_blocks, sizes = build_runner(args, loaded, self.device, self.dtype, tp)
            if self.ranks is not None:
                self.ranks.collect_caches()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self.kernels = self.runner.kernels
        log.info("engine_built device=%s dtype=%s kernels=%s cuda_graphs=%s tp=%d", self.device, str(self.dtype)
                 .removeprefix("torch."), self.kernels, f"{sizes[0]}..{sizes[-1]}/{len(sizes)}" if sizes else "off",
                 tp.size)  # fmt: skip
        self.block_manager = BlockManager(self.num_blocks, args.block_size, args.enable_prefix_caching)
        # KV cache events (--kv-events-config): collected per step, handed to `kv_events_sink`.
        self.kv_events_sink: Callable[[list[list[Any]]], None] | None = None
        if args.kv_events.enabled:
            self.block_manager.events = EventRecorder(args.block_size, "GPU" if self.device.type == "cuda" else None)
            self.block_manager.events.cleared()  # a (re)started engine holds nothing
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_waiting=args.max_waiting_requests,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                priority=args.scheduling_policy == "priority",
            ),
            self.block_manager,
            self._proposer(),
        )
        self._ids = itertools.count(1)
        # Siblings waiting for their parent's prefill (n > 1): they then share its prompt's blocks.
        self._forks: dict[int, list[Sequence]] = {}
        self._unstarted: set[int] = set()  # their ids
        # Sequences holding blocks outside the scheduler (reserved for, or pinned by, a KV transfer):
        # their blocks come back by `release`, so an engine short of blocks waits for them.
        self.held: set[int] = set()
        self.on_blocks_freed: Callable[[], None] | None = None
        self._requests_finished = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        # --async-scheduling: the step `step` has handed to the device and not finished yet
        self.async_scheduling = args.async_scheduling
        self._inflight: InFlight | None = None
        self.steps_ahead = 0  # steps scheduled before the output of the one before was on the host

    def _proposer(self) -> DraftProposer | None:
        """The draft proposer of --speculative-config (None: no speculation)."""
        spec = self.args.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "eagle3" and self.drafter is not None:
            return EagleProposer(self.drafter, spec.num_speculative_tokens)
        raise ValueError(f"speculative method {spec.method!r} is not implemented")

    @property
    def drafter(self) -> EagleDrafter | None:
        """The runner's EAGLE-3 head (--speculative-config method eagle3), or None."""
        return self.runner.drafter

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of this engine (``--tensor-parallel-size``)."""
        return self.args.tensor_parallel_size

    def kv_views(self) -> list[torch.Tensor]:
        """The KV cache as the relay registers it: one ``[num_blocks, bytes]`` view per region (each layer's
        K and V, then the indexer caches), every tensor-parallel rank's, rank after rank (rank 0 maps them all;
        the peer's rank r pairs with ours). Ids are the pool's: a trailing scratch block is left out."""
        return region_views(*self.transfer_caches(), num_blocks=self.num_blocks)

    def kv_formats(self) -> list[str]:
        """What a block of each ``kv_views`` region holds: its element type and shape (a peer engine whose blocks
        differ, in float16 against bfloat16 or in another block size, is refused rather than read as garbage)."""
        return region_formats(*self.transfer_caches())

    # -- admission ---------------------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, params: SamplingParams, max_tokens_given: bool) -> SamplingParams:
        """Refuse what can never run; resolve an absent max_tokens to what fits. Returns final params."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty")
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length is {limit} "
                "tokens, including at least one generated token"
            )
        pool_tokens = self.num_blocks * self.args.block_size
        if not max_tokens_given:
            params = replace(params, max_tokens=min(limit, pool_tokens) - num_prompt_tokens)
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) is above max_tokens ({params.max_tokens})")
        vocab = self.model_config.vocab_size
        bad = [t for t in (*params.stop_token_ids, *(t for t, _ in params.logit_bias)) if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} (in stop_token_ids or logit_bias) is not in [0, {vocab})")
        total = num_prompt_tokens + params.max_tokens
        if params.max_tokens < 1:
            raise KVCacheTooSmallError(
                f"the prompt ({num_prompt_tokens} tokens) fills the whole KV cache ({pool_tokens} tokens)"
            )
        if total > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; the request asks for {total} "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} to generate)"
            )
        if total > pool_tokens:
            raise KVCacheTooSmallError(
                f"the request needs KV room for {total} tokens but the whole KV cache holds {pool_tokens} "
                f"({self.num_blocks} blocks of {self.args.block_size}); it can never run here"
            )
        return params

    def add_request(self, prompt_ids: list[int], params: SamplingParams, hold_kv: bool = False,
                    grammar: Any = None, stream_index: int = 0) -> Sequence:  # fmt: skip
        """Queue a sequence; ``params`` must have passed check_request. Raises OverloadedError when full.

        ``hold_kv``: keep the blocks when it finishes (a prefill whose KV another engine pulls);
        ``release`` gives them back.
        """
        seq = Sequence(next(self._ids), prompt_ids, params, self.args.block_size)
        seq.hold_kv = hold_kv
        seq.grammar = grammar
        seq.stream_index = stream_index
        try:
            self.scheduler.add(seq)
        except QueueFullError as exc:
            raise OverloadedError(str(exc)) from exc
        self._prompt_tokens += len(prompt_ids)
        return seq

    def add_fork(self, parent: Sequence, stream_index: int, grammar: Any = None) -> Sequence:
        """One more sample of ``parent``'s request (n > 1), sharing its prompt's KV blocks.

        The sibling waits until the parent's prefill has computed the prompt, then takes its full blocks
        by reference (no copy) and computes only the prompt's last, partial block itself (the token
        whose logits start its own generation).
        """
        if parent.num_completion_tokens or parent.status is SequenceStatus.FINISHED:
            raise RuntimeError("a fork must be added before its parent generates")
        child = Sequence(next(self._ids), parent.token_ids, parent.params, self.args.block_size)
        child.grammar = grammar
        child.stream_index = stream_index
        self._forks.setdefault(parent.seq_id, []).append(child)
        self._unstarted.add(child.seq_id)
        return child

    def _start_forks(self, parent: Sequence) -> None:
        for child in self._forks.pop(parent.seq_id, []):
            self._unstarted.discard(child.seq_id)
            if child.status is SequenceStatus.FINISHED:
                continue
            self.block_manager.share(parent, child, (parent.num_prompt_tokens - 1) // self.args.block_size)
            child.prefix_hit_tokens = parent.prefix_hit_tokens
            child.prompt_logprobs = list(parent.prompt_logprobs)  # scored once, by the parent
            self.scheduler.waiting.appendleft(child)  # holds blocks: goes first, as a prompt mid-prefill does

    # -- KV filled from outside (the decode side of prefill/decode disaggregation) -------------------

    def reserve(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Allocate blocks for a prompt whose KV another engine computes; the sequence is not queued.

        Blocks the local prefix cache already holds are shared, not rewritten: the first
        ``seq.num_cached_tokens`` tokens need no transfer. Raises OverloadedError when the pool
        has no room now. Follow with ``commit_prefilled`` once the KV is written, or ``release``.
        """
        seq = Sequence(next(self._ids), prompt_ids, params, self.args.block_size)
        if not self.block_manager.can_allocate(seq):
            raise OverloadedError("no free KV blocks for the transferred prompt right now")
        self.block_manager.allocate(seq)
        seq.prefix_hit_tokens = seq.num_cached_tokens
        self.held.add(seq.seq_id)
        return seq

    def add_fork_prefilled(self, parent: Sequence, stream_index: int, grammar: Any = None) -> Sequence:
        """One more sample of a reserved sequence whose prompt KV another engine wrote (n > 1 in P/D).

        As ``add_fork``: the child takes the parent's full prompt blocks by reference and computes the
        last, partial one itself (its own first token comes from those logits). Called before
        ``commit_prefilled``, while the parent holds its blocks for sure.
        """
        if parent.seq_id not in self.held:
            raise RuntimeError("a prefilled fork must be added before its parent is committed")
        child = Sequence(next(self._ids), parent.token_ids, parent.params, self.args.block_size)
        child.grammar = grammar
        child.stream_index = stream_index
        self.block_manager.share(parent, child, (parent.num_prompt_tokens - 1) // self.args.block_size)
        child.prefix_hit_tokens = parent.prefix_hit_tokens
        child.prompt_logprobs = list(parent.prompt_logprobs)  # scored once, by the prefill engine
        self.scheduler.waiting.appendleft(child)  # holds blocks: goes first, as a prompt mid-prefill does
        return child

    def commit_prefilled(self, seq: Sequence, first_token: int, logprob: TokenLogprob | None = None) -> None:
        """The prompt's KV is in ``seq``'s blocks: continue from ``first_token`` (and its logprob, computed
        by the prefill engine) as if prefilled here."""
        self.held.discard(seq.seq_id)
        self.block_manager.mark_computed(seq, len(seq))
        self._prompt_tokens += seq.num_prompt_tokens
        self._generation_tokens += 1
        reason = self._append(seq, first_token, logprob)
        if reason is not None:
            self.block_manager.deallocate(seq)
            seq.finish_reason = reason
            seq.set_status(SequenceStatus.FINISHED)
            self._requests_finished += 1
            return
        try:
            self.scheduler.add(seq)  # waits with its blocks; its next step computes one token
        except QueueFullError as exc:
            self.block_manager.deallocate(seq)
            raise OverloadedError(str(exc)) from exc

    def release(self, seq: Sequence) -> None:
        """Give back a reservation whose KV never arrived, or the held blocks of a finished prefill."""
        self.held.discard(seq.seq_id)
        if seq.block_table:
            self.block_manager.deallocate(seq)
            if self.on_blocks_freed is not None:
                self.on_blocks_freed()

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` now (stop string, client gone): its blocks are freed at once."""
        seq.drop_pending()  # ended while a step scheduled ahead of its last token's was on the device
        for child in self._forks.pop(seq.seq_id, []) if reason is FinishReason.ABORT else []:
            self.finish(child, reason)  # siblings that never started go with their parent
        if seq.seq_id in self._unstarted:  # a sibling still waiting for its parent's prefill
            self._unstarted.discard(seq.seq_id)
            seq.finish_reason = reason
            seq.set_status(SequenceStatus.FINISHED)
            self._requests_finished += 1
        elif seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, reason)
            self._requests_finished += 1
            if seq.hold_kv and seq.block_table:
                self.held.add(seq.seq_id)  # pinned for a KV transfer until `release`

    # -- one step ----------------------------------------------------------------------------------

    def flush_kv_events(self) -> None:
        """Hand the events recorded since the last flush to the publisher, as one batch."""
        recorder = self.block_manager.events
        if recorder is not None and self.kv_events_sink is not None:
            events = recorder.take()
            if events:
                self.kv_events_sink(events)

    def schedule(self) -> tuple[ScheduledBatch, StepInput] | None:
        batch = self.schedule_batch()
        if batch is None:
            return None
        return batch, self.prepare(batch)

    def schedule_batch(self) -> ScheduledBatch | None:
        """Pick the next step's sequences (blocks allocated, new blocks announced); None when idle."""
        batch = self.scheduler.schedule()
        if batch is not None and self.block_manager.events is not None:
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                # Drafts are not the sequence's tokens (yet): only blocks of its own tokens are announced.
                self.block_manager.announce(seq, min(seq.num_cached_tokens + n, len(seq)))
        return batch

    def prepare(self, batch: ScheduledBatch) -> StepInput:
        """The model inputs of a scheduled batch (token ids, positions, slot mappings, graph staging)."""
        step = self.runner.prepare(batch.seqs, batch.num_new_tokens, batch.num_decodes)
        if self.ranks is not None:
            self.ranks.stage(step, batch.seqs, batch.num_new_tokens, batch.num_decodes)
        return step

    def scheduled_seqs(self) -> list[Sequence]:
        """Every sequence a failed ``schedule_batch`` may have touched: the running ones, the waiting ones
        holding blocks (a prompt mid-chunk, one just allocated) and the next one it would admit (so that
        a fault that recurs fails one request after another instead of spinning)."""
        waiting = self.scheduler.waiting
        holding = [s for s in waiting if s.block_table]
        next_up = next((s for s in waiting if not s.block_table), None)
        return [*self.scheduler.running, *holding, *([next_up] if next_up is not None else [])]

    def launch(self, step: StepInput) -> Launched:
        """Hand a step to the device: a decode step's tokens may stay there (``Launched.result`` waits for them)."""
        if self.ranks is None:
            return self.runner.launch(step)
        return Launched(self.execute(step))

    def can_run_ahead(self, inflight: InFlight) -> bool:
        """Whether the next step can be scheduled and launched before ``inflight``'s tokens reach the host
        (--async-scheduling). It can when nothing the next step does depends on those tokens' values: it is a
        decode step of the same sequences (nothing waits to be admitted, no sequence is preempted for lack of a
        block), served by a decode graph that reads each input id on the device, and no row's sampling looks at
        the tokens so far (penalties), grammar or logprobs. Not when every sequence is known to end with that
        step (its last token by max_tokens or the context limit): the step ahead would be wasted."""
        sched = self.scheduler
        if not self.async_scheduling or inflight.launched.tokens is None or sched.waiting or sched.proposer is not None:
            return False  # (a proposer drafts from the tokens so far: speculative decoding runs one step at a time)
        running = sched.running
        if not running or not self.runner.serves_ahead(len(running)):
            return False
        rows = {s.seq_id for s in inflight.batch.seqs}
        bs = self.block_manager.block_size
        new_blocks = 0
        last = True
        for seq in running:
            p = seq.params
            if seq.seq_id not in rows or p.penalized or p.logprobs is not None or seq.grammar is not None:
                return False
            if len(seq.block_table) * bs <= len(seq):
                new_blocks += 1  # the pending token's step writes the first slot of a new block
            last = last and (seq.num_completion_tokens + 1 >= p.max_tokens or len(seq) + 1 >= self.max_model_len)
        return not last and new_blocks <= self.block_manager.num_free_blocks

    def schedule_ahead(self, inflight: InFlight) -> tuple[ScheduledBatch, StepInput]:
        """The step after ``inflight`` (``can_run_ahead`` said it may be), before its tokens are known: each running
        sequence counts its pending token, and the step reads that token from ``inflight``'s tokens on the device."""
        running = list(self.scheduler.running)
        for seq in running:
            seq.append_pending()
        try:
            batch = self.schedule_batch()
            if batch is None or batch.num_decodes != len(batch.seqs) or batch.seqs != running:
                raise RuntimeError("a step scheduled ahead is not a decode step of the running sequences")
            rows = {s.seq_id: i for i, s in enumerate(inflight.batch.seqs)}
            assert inflight.launched.tokens is not None
            step = self.runner.prepare_ahead(batch.seqs, inflight.launched.tokens, [rows[s.seq_id] for s in running])
        except BaseException:
            for seq in running:
                seq.drop_pending()
            raise
        self.steps_ahead += 1
        return batch, step

    def execute(self, step: StepInput) -> SampleOutput:
        """The model forward and sampling; the only part that may run off the event-loop thread."""
        if self.ranks is None:
            return self.runner.execute(step)
        try:
            self.ranks.launch(step)  # the other ranks prepare the same step and run it beside this one
            return self.runner.execute(step)
        except Exception as exc:
            # A step that failed on one rank leaves the ranks out of step (a collective half met): no later
            # step can be trusted, so the engine stops serving.
            raise EngineDeadError(f"tensor-parallel step failed: {exc}") from exc

    def transfer_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's KV caches and indexer-key caches, rank after rank: what the KV relay registers and moves
        (a decode rank's slice is pulled from the prefill rank of the same index)."""
        if self.ranks is None:
            return self.runner.kv_caches, self.runner.indexer_caches
        kv, idx = list(self.runner.kv_caches), list(self.runner.indexer_caches)
        for rank_kv, rank_idx in self.ranks.caches:
            kv += rank_kv
            idx += rank_idx
        return kv, idx

    def close(self) -> None:
        """Stop the other ranks' processes (tensor parallel); nothing to do with one rank."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def postprocess(self, batch: ScheduledBatch, out: SampleOutput) -> None:
        """Record the step's KV, append sampled tokens, retire sequences that hit EOS or a limit.

        ``out`` has one entry per sequence that reached its end this step (a prefill chunk
        that stops short samples nothing).
        """
        sampled = iter(zip(out.tokens, out.logprobs, strict=True))
        lists = iter(out.token_lists) if out.token_lists is not None else None
        prompt_logprobs = out.prompt_logprobs
        for seq, n, done in zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True):
            if prompt_logprobs:
                seq.prompt_logprobs += prompt_logprobs.get(seq.seq_id, ())
            drafts, seq.draft_tokens = seq.draft_tokens, []
            token, logprob = next(sampled) if done else (None, None)
            tokens = next(lists) if done and lists is not None else None
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted while the step ran
            if drafts and tokens is not None:
                self._accept(seq, drafts, tokens)
                continue
            self.block_manager.mark_computed(seq, seq.num_cached_tokens + n)
            if token is None:
                continue
            self._generation_tokens += 1
            reason = self._append(seq, token, logprob)
            if reason is not None:
                self.finish(seq, reason)

    def _accept(self, seq: Sequence, drafts: list[int], tokens: list[int]) -> None:
        """A verify row's outcome: its accepted drafts and the token after them join ``seq`` (each checked for
        a stop, as if decoded one by one); the KV of the accepted ones is recorded, rejected drafts' blocks
        go back (their KV is past the new end: the next step overwrites it)."""
        self._spec_drafts += 1
        self._spec_draft_tokens += len(drafts)
        self._spec_accepted_tokens += len(tokens) - 1
        computed = len(seq) + len(tokens) - 1  # the last token and the accepted drafts have KV now
        for token in tokens:
            self._generation_tokens += 1
            reason = self._append(seq, token, None)
            if reason is not None:
                self.finish(seq, reason)
                return
        self.block_manager.mark_computed(seq, computed)
        self.block_manager.trim(seq)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> FinishReason | None:
        """Add a sampled token to ``seq`` (its logprob, its grammar's state); why it ends there, if it does."""
        seq.fill(token)
        if seq.num_completion_tokens == 1 and seq.seq_id in self._forks:
            self._start_forks(seq)  # its prompt is computed: the siblings share it now
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.grammar is not None and not seq.grammar.accept(token):
            return FinishReason.STOP  # the grammar is complete: nothing more may follow
        return self.scheduler.check_stop(seq, self.eos_token_ids, self.max_model_len)

    def fail(self, seqs: list[Sequence]) -> None:
        """After a failed step: end its sequences and free their blocks (blocks the step meant to fill were
        never indexed; sequences that finished already keep theirs)."""
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)

    def step(self) -> list[Sequence]:
        """Run one step and take its output; returns the sequences it advanced. With --async-scheduling the next
        step may be launched before this one's tokens are read (``can_run_ahead``): it stays on the device, and
        the next call takes its output."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            scheduled = self.schedule()
            if scheduled is None:
                return []
            batch, step = scheduled
            inflight = InFlight(batch, self.launch(step))
        if self.can_run_ahead(inflight):
            batch, step = self.schedule_ahead(inflight)
            self._inflight = InFlight(batch, self.launch(step))
        self.postprocess(inflight.batch, inflight.launched.result())
        return inflight.batch.seqs

    def drain(self) -> None:
        """Take the output of a step still on the device (``step`` ran one ahead), so that none is."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self.postprocess(inflight.batch, inflight.launched.result())

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generate for every prompt with continuous batching; returns completion token ids in order."""
        seqs = [self.add_request(p, self.check_request(len(p), params, True)) for p in prompts]
        while any(s.status is not SequenceStatus.FINISHED for s in seqs):
            if not self.step():
                raise RuntimeError("the scheduler can make no progress")
        self.drain()
        return [s.completion_ids for s in seqs]

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks=self.block_manager.stats(),
            requests_finished=self._requests_finished,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            preemptions=self.scheduler.num_preemptions,
            spec_drafts=self._spec_drafts,
            steps_ahead=self.steps_ahead,
            spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=self._spec_accepted_tokens,
        )
