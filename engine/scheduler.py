"""Continuous batching: which sequences run in the next step, prefill first, preempting when out of blocks."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.spec_decode import DraftProposer, can_speculate


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits the scheduler enforces."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: at most this many prompt tokens of one sequence per step
    priority: bool = False  # --scheduling-policy priority: new prompts by params.priority, then arrival


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """The sequences of one model step and how many tokens each computes.

    The first ``num_decodes`` sequences decode one token each; then come verify rows (speculative decoding:
    a running sequence's last token and its ``draft_tokens``, ``1 + len(draft_tokens)`` tokens); the rest
    compute prompt tokens (a whole prompt or a chunk of one). A prefill chunk that stops short of the
    sequence's end samples nothing; the sequence stays at the head of the waiting queue and its next
    chunk follows in the next step.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int
    # Which sequences reach their end in this step and so sample a token, fixed when it is scheduled: a sequence
    # that ends while its step runs (an abort) loses its blocks and its count of computed tokens, and the step's
    # output still holds its row. A pending token (a step scheduled ahead counted it) is not one this step computes.
    samples: tuple[bool, ...] = field(init=False)

    def __post_init__(self) -> None:
        samples = tuple(s.num_cached_tokens + n == len(s) - s.ahead + len(s.draft_tokens)
                        for s, n in zip(self.seqs, self.num_new_tokens, strict=True))  # fmt: skip
        object.__setattr__(self, "samples", samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.seqs)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should shed the request."""


class Scheduler:
    """Owns the waiting and running queues and the block manager's decisions.

    With chunked prefill (the default) every step is mixed, as in vLLM: each running sequence
    decodes one token, and waiting prompts fill what is left of the token budget, a long one in
    chunks over several steps, so a long prompt never stalls the running streams. Without it, steps
    are prefill first: whenever waiting prompts fit (in seats, token budget and blocks) they are
    prefilled together, otherwise every running sequence decodes. A decode that runs out of blocks
    preempts the most recently admitted sequences (their blocks are freed and they go back to the
    head of the waiting queue, to be recomputed; the prefix cache usually makes that cheap).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 proposer: DraftProposer | None = None) -> None:  # fmt: skip
        self.config = config
        self.block_manager = block_manager
        self.proposer = proposer  # speculative decoding: drafts for the running sequences
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch; None when there is nothing to run."""
        self._admit_transferred()
        if self.config.enable_chunked_prefill:
            decodes = self._schedule_decode()
            counts, plain = self._draft(decodes)
            seqs, chunks = self._schedule_prefill(self.config.max_num_batched_tokens - sum(counts))
            if not decodes and not seqs:
                return None
            return ScheduledBatch(decodes + seqs, counts + chunks, plain)
        seqs, chunks = self._schedule_prefill(self.config.max_num_batched_tokens)
        if seqs:
            return ScheduledBatch(seqs, chunks, 0)
        decodes = self._schedule_decode()
        if decodes:
            counts, plain = self._draft(decodes)
            return ScheduledBatch(decodes, counts, plain)
        # A decode pass that had to preempt every sequence freed room: re-admit at once.
        seqs, chunks = self._schedule_prefill(self.config.max_num_batched_tokens)
        return ScheduledBatch(seqs, chunks, 0) if seqs else None

    def _admit_transferred(self) -> None:
        # KV filled from outside (a transfer) up to its first token: what is left is a decode step,
        # so it joins the decoders (the same attention, sparse or dense, as if this engine had
        # prefilled it).
        for seq in [s for s in self.waiting if s.block_table and s.num_completion_tokens]:
            if len(self.running) >= self.config.max_num_seqs:
                return
            if len(seq) - seq.num_cached_tokens == 1:
                if seq.admitted_at is None:  # admitted to a step (a P/D decode: its first step, for the TTFT split)
                    seq.admitted_at = time.monotonic()
                self.waiting.remove(seq)
                seq.set_status(SequenceStatus.RUNNING)
                self.running.append(seq)

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], list[int]]:
        cfg = self.config
        seqs: list[Sequence] = []
        chunks: list[int] = []
        # Sequences that already hold blocks (a prompt mid-chunk) go first: they need at most one
        # more block, and the blocks they hold may be what the others are waiting for.
        fresh = [s for s in self.waiting if not s.block_table]
        if self.config.priority:
            fresh.sort(key=lambda s: s.params.priority)  # stable: arrival order within a priority
        order = [s for s in self.waiting if s.block_table] + fresh
        for seq in order:
            # Admitted sequences join ``running`` at once, so it alone counts the seats taken.
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if seq.block_table:
                # A prompt mid-way through chunked prefill: blocks are held, only the uncomputed
                # tail remains.
                if not self.block_manager.can_append(seq):
                    break
                self.block_manager.may_append(seq)
            else:
                if not cfg.enable_chunked_prefill and len(seq) - self.block_manager.cached_prefix_len(seq) > budget:
                    break
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if seq.num_completion_tokens == 0:
                    seq.prefix_hit_tokens = seq.num_cached_tokens
                if seq.admitted_at is None:
                    seq.admitted_at = time.monotonic()
            remaining = len(seq) - seq.num_cached_tokens
            chunk = min(remaining, budget)
            if cfg.long_prefill_token_threshold > 0:
                chunk = min(chunk, cfg.long_prefill_token_threshold)
            budget -= chunk
            seqs.append(seq)
            chunks.append(chunk)
            if chunk < remaining:
                break  # stays waiting, holding its blocks; its next chunk goes first next step
            self.waiting.remove(seq)
            seq.set_status(SequenceStatus.RUNNING)
            self.running.append(seq)
        return seqs, chunks

    def _schedule_decode(self) -> list[Sequence]:
        seqs: list[Sequence] = []
        candidates = list(self.running)
        while candidates:
            seq = candidates.pop(0)
            while not self.block_manager.can_append(seq):
                # Take room from the newest sequence; if that is ``seq`` itself, it waits.
                victim = candidates.pop() if candidates else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                seqs.append(seq)
        return seqs

    def _draft(self, decodes: list[Sequence]) -> tuple[list[int], int]:
        """Give the decoding sequences their drafts (speculative decoding), reordering ``decodes`` in place:
        plain decodes first, verify rows after them. Returns the tokens each computes and how many are plain.

        Drafts never preempt anyone: a sequence whose drafts find no free block decodes one token."""
        if self.proposer is None:
            return [1] * len(decodes), len(decodes)
        cfg = self.config
        budget = cfg.max_num_batched_tokens - len(decodes)
        plain: list[Sequence] = []
        verify: list[Sequence] = []
        for seq in decodes:
            seq.draft_tokens = []
            if budget > 0 and can_speculate(seq):
                # The step adds len(drafts) + 1 tokens at most: within max_tokens and the context limit.
                room = min(seq.params.max_tokens - seq.num_completion_tokens, cfg.max_model_len - len(seq)) - 1
                drafts = self.proposer.propose(seq, min(room, budget)) if room > 0 else []
                if drafts and self.block_manager.can_reserve(seq, len(seq) + len(drafts)):
                    self.block_manager.reserve(seq, len(seq) + len(drafts))
                    seq.draft_tokens = drafts
                    budget -= len(drafts)
                    verify.append(seq)
                    continue
            plain.append(seq)
        decodes[:] = plain + verify
        return [1] * len(plain) + [1 + len(s.draft_tokens) for s in verify], len(plain)

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_tokens = []
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.set_status(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire ``seq`` (done or aborted) and free its blocks at once; safe to call twice."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if not (seq.hold_kv and reason is not FinishReason.ABORT):
            self.block_manager.deallocate(seq)  # held blocks go with LLMEngine.release
        seq.finish_reason = reason
        seq.set_status(SequenceStatus.FINISHED)

    def check_stop(self, seq: Sequence, eos_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Whether ``seq``'s newest token ends it (EOS, a stop token, max_tokens, context limit)."""
        params = seq.params
        last = seq.last_token
        generated = seq.num_completion_tokens
        if generated > params.min_tokens:  # min_tokens holds back every stop
            if params.stop_token_ids and last in params.stop_token_ids:
                seq.stop_reason = last
                return FinishReason.STOP
            if not params.ignore_eos and last in eos_ids:
                return FinishReason.STOP
        if generated >= params.max_tokens or len(seq) >= max_model_len:
            return FinishReason.LENGTH
        return None
