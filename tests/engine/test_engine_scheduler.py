"""Scheduler: mixed steps (or prefill first without chunking), seat and token budgets, preemption, bounded queue."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 4


def make(
    num_blocks: int = 64, max_num_seqs: int = 8, max_tokens: int = 64, max_waiting: int = 100, chunked: bool = True
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=64,
        max_waiting=max_waiting,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, BlockManager(num_blocks, BS))


def seq(seq_id: int, n: int) -> Sequence:
    return Sequence(seq_id, [seq_id * 1000 + i for i in range(n)], SamplingParams(max_tokens=100), BS)


def decode_once(s: Scheduler, batch_seqs: list[Sequence]) -> None:
    for x in batch_seqs:
        x.append_token(7)


def test_prefill_first_then_decode_without_chunking() -> None:
    s = make(chunked=False)
    a, b = seq(1, 5), seq(2, 6)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 0 and batch.seqs == [a, b]
    assert batch.num_tokens == 11 and batch.num_new_tokens == [5, 6]
    decode_once(s, batch.seqs)
    batch = s.schedule()
    assert batch is not None and batch.decode_only and batch.seqs == [a, b]
    # A newcomer is prefilled before the running ones decode again.
    c = seq(3, 3)
    s.add(c)
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 0 and batch.seqs == [c]


def test_mixed_steps_decode_the_running_and_prefill_newcomers_together() -> None:
    s = make(max_tokens=10)
    a, b = seq(1, 5), seq(2, 4)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 0 and batch.num_new_tokens == [5, 4]
    decode_once(s, batch.seqs)
    for x in batch.seqs:
        s.block_manager.mark_computed(x, len(x) - 1)
    # A long newcomer: the running two decode and it takes the rest of the budget (a chunk).
    c = seq(3, 20)
    s.add(c)
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 2 and batch.seqs == [a, b, c]
    assert batch.num_new_tokens == [1, 1, 8] and not batch.decode_only
    assert s.waiting[0] is c and list(s.running) == [a, b]


def test_max_num_seqs_limits_the_batch() -> None:
    s = make(max_num_seqs=2)
    seqs = [seq(i, 3) for i in range(1, 4)]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert batch is not None and batch.seqs == seqs[:2]
    assert list(s.waiting) == [seqs[2]]


def test_token_budget_limits_the_prefill_without_chunking() -> None:
    s = make(max_tokens=10, chunked=False)
    a, b = seq(1, 6), seq(2, 6)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.seqs == [a]
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 0 and batch.seqs == [b]


def test_chunked_prefill_splits_a_prompt_over_steps() -> None:
    s = make(max_tokens=10)
    a, b = seq(1, 6), seq(2, 15)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.seqs == [a, b] and batch.num_new_tokens == [6, 4]
    assert list(s.running) == [a] and s.waiting[0] is b  # b continues next step
    for x, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.block_manager.mark_computed(x, x.num_cached_tokens + n)
    batch = s.schedule()
    assert batch is not None and batch.seqs == [a, b] and batch.num_new_tokens == [1, 9]  # a decodes beside
    assert batch.num_decodes == 1
    decode_once(s, [a])
    s.block_manager.mark_computed(a, len(a) - 1)
    s.block_manager.mark_computed(b, 13)
    batch = s.schedule()
    assert batch is not None and batch.seqs == [a, b] and batch.num_new_tokens == [1, 2]
    assert list(s.running) == [a, b] and not s.waiting


def test_waiting_queue_is_bounded() -> None:
    s = make(max_waiting=2)
    s.add(seq(1, 3))
    s.add(seq(2, 3))
    with pytest.raises(QueueFullError):
        s.add(seq(3, 3))


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    s = make(num_blocks=4)
    a, b = seq(1, 8), seq(2, 8)  # two blocks each: the whole pool
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch is not None and batch.seqs == [a, b]
    decode_once(s, batch.seqs)  # both now need a third block
    batch = s.schedule()
    assert batch is not None and batch.decode_only and batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and s.waiting[0] is b
    assert s.num_preemptions == 1
    # When a finishes, b comes back (prefilled again, prompt + generated token).
    s.finish(a, FinishReason.STOP)
    batch = s.schedule()
    assert batch is not None and batch.num_decodes == 0 and batch.seqs == [b]
    assert len(b) == 9


def test_finish_frees_blocks_and_is_idempotent() -> None:
    s = make()
    a = seq(1, 9)
    s.add(a)
    s.schedule()
    assert s.block_manager.num_free_blocks < 64
    s.finish(a, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert s.block_manager.num_free_blocks == 64 and s.is_idle()
    assert a.finish_reason is FinishReason.ABORT


def test_finish_a_waiting_sequence() -> None:
    s = make(max_num_seqs=1)
    a, b = seq(1, 3), seq(2, 3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b, FinishReason.ABORT)
    assert not s.waiting


def test_status_transitions_are_checked() -> None:
    a = seq(1, 3)
    a.set_status(SequenceStatus.FINISHED)
    with pytest.raises(RuntimeError):
        a.set_status(SequenceStatus.RUNNING)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_admits_lower_priority_values_first(policy: str) -> None:
    cfg = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, max_waiting=100, priority=policy == "priority"
    )
    s = Scheduler(cfg, BlockManager(64, BS))
    seqs = [
        Sequence(i, [i * 1000 + t for t in range(5)], SamplingParams(max_tokens=100, priority=p), BS)
        for i, p in ((1, 5), (2, 0), (3, -1), (4, 0))
    ]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert batch is not None
    admitted = [x.seq_id for x in batch.seqs]
    # vLLM's --scheduling-policy priority: lower first, arrival order among equals.
    assert admitted == ([3, 2] if policy == "priority" else [1, 2])
