"""Continuous batching: which sequences run in the next step, prefill first, preempting when out of blocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits the scheduler enforces."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting: int


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """The sequences of one model step; all prefill or all decode."""

    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        if self.is_prefill:
            return sum(len(s) - s.num_cached_tokens for s in self.seqs)
        return len(self.seqs)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should shed the request."""


class Scheduler:
    """Owns the waiting and running queues and the block manager's decisions.

    Prefill first: whenever waiting sequences fit (in seats, token budget and blocks) they are
    prefilled together; otherwise every running sequence decodes one token. A decode step that runs
    out of blocks preempts the most recently admitted sequences (their blocks are freed and they go
    back to the head of the waiting queue, to be recomputed; the prefix cache usually makes that cheap).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
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
        batch = self._schedule_prefill() or self._schedule_decode()
        # A decode pass that had to preempt every sequence freed room: re-admit at once.
        return batch or self._schedule_prefill()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) + len(seqs) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.block_table:
                # KV filled from outside (a KV transfer): only the uncached tail is computed.
                new_tokens = len(seq) - seq.num_cached_tokens
                if new_tokens > budget or not self.block_manager.can_append(seq):
                    break
                self.block_manager.may_append(seq)
            else:
                new_tokens = len(seq) - self.block_manager.cached_prefix_len(seq)
                if new_tokens > budget or not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if seq.num_completion_tokens == 0:
                    seq.prefix_hit_tokens = seq.num_cached_tokens
            budget -= new_tokens
            self.waiting.popleft()
            seq.set_status(SequenceStatus.RUNNING)
            seqs.append(seq)
        if not seqs:
            return None
        self.running.extend(seqs)
        return ScheduledBatch(seqs, is_prefill=True)

    def _schedule_decode(self) -> ScheduledBatch | None:
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
        if not seqs:
            return None
        return ScheduledBatch(seqs, is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
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
        self.block_manager.deallocate(seq)
        seq.finish_reason = reason
        seq.set_status(SequenceStatus.FINISHED)

    def check_stop(self, seq: Sequence, eos_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Whether ``seq``'s newest token ends it (EOS, max_tokens, context limit)."""
        if not seq.params.ignore_eos and seq.last_token in eos_ids:
            return FinishReason.STOP
        if seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= max_model_len:
            return FinishReason.LENGTH
        return None
