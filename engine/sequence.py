"""One generation request as the scheduler sees it: tokens, KV blocks, sampling settings, state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: waiting for KV blocks, running, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence stopped; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client gone or engine error


_ALLOWED = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.FINISHED: set(),
}


def check_transition(old: SequenceStatus, new: SequenceStatus) -> None:
    """Refuse a status change the life cycle does not allow (running -> waiting is a preemption)."""
    if new not in _ALLOWED[old]:
        raise RuntimeError(f"sequence cannot go from {old.value} to {new.value}")


# Below this temperature a request samples greedily (vLLM's threshold): dividing logits by a
# temperature that small overflows them to inf and softmax to NaN.
GREEDY_TEMPERATURE = 1e-5

# Stands for a token a step still on the device is sampling (Sequence.append_pending): never a real id, so a
# step that read it from the host instead of the device would fail at the embedding.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated at the HTTP edge."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    priority: int = 0  # --scheduling-policy priority: lower is admitted first (vLLM's meaning)
    # Derived once: greedy, nothing shaping the logits, no logprobs. A batch of such rows costs one
    # argmax, and the per-step bookkeeping skips everything else (the decode hot path).
    plain: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plain = self.greedy and not self.shapes_logits and self.logprobs is None and self.prompt_logprobs is None
        object.__setattr__(self, "plain", plain)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the tokens so far change the logits (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature / top-k / top-p / min-p touches this request's logits."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled (or prompt) token's log-probability and the most likely alternatives at its place."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class Sequence:
    """A prompt and its generated tokens, with the KV blocks that hold them.

    ``block_table`` lists the cache block ids in token order; ``num_cached_tokens`` counts the leading
    tokens whose KV is already in the cache (a prefix-cache hit, or filled by a KV transfer) and so
    need no prefill compute.
    """

    __slots__ = (
        "admitted_at",
        "ahead",
        "block_hashes",
        "block_size",
        "block_table",
        "cumulative_logprob",
        "draft_tokens",
        "finish_reason",
        "full_blocks",
        "grammar",
        "hold_kv",
        "logprobs",
        "num_cached_tokens",
        "num_prompt_tokens",
        "params",
        "plain_row",
        "prefix_hit_tokens",
        "prompt_logprobs",
        "seq_id",
        "status",
        "stop_reason",
        "stream_index",
        "table_epoch",
        "token_ids",
    )

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, block_size: int) -> None:
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.prefix_hit_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.admitted_at: float | None = None  # time.monotonic() when the scheduler first gave it blocks or a step
        self.block_table: list[int] = []
        # Bumped whenever the block table loses entries (freed, trimmed): between two equal epochs the table only
        # grew, which is what a copy of its prefix (a CUDA graph's staged row) relies on.
        self.table_epoch = 0
        self.block_size = block_size
        # The prefix-cache hashes of its full blocks so far, in order, and those blocks' token ids (the
        # tuples the hashes cover, which a cached block keeps to be compared): computed once (by the
        # block manager, as they are first needed), since the tokens of a full block never change.
        self.block_hashes: list[int] = []
        self.full_blocks: list[tuple[int, ...]] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # A prefill for another engine (kv_producer): its blocks outlive it until the KV was pulled.
        self.hold_kv = False
        # What ended it besides EOS or the length: the stop string or stop token id (vLLM's stop_reason).
        self.stop_reason: str | int | None = None
        # Which random stream a seeded request draws from: (seed, stream_index, step) picks each draw,
        # so one sample of n, a preempted sequence or a P/D decode continues the same stream.
        self.stream_index = 0
        self.logprobs: list[TokenLogprob] = []  # one per completion token, when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1.., when params.prompt_logprobs is set
        self.cumulative_logprob = 0.0
        self.plain_row: Any = None  # engine.sampler.SampleRow of a plain request, made once
        self.grammar: Any = None  # a structured-output matcher (engine.structured.GrammarState)
        # Speculative decoding: the tokens proposed to follow this sequence, verified in the step being run
        # (set when it is scheduled, cleared once the step's output is in).
        self.draft_tokens: list[int] = []
        # Scheduling a step ahead: the last of ``token_ids`` is PENDING_TOKEN, the token a step still on the
        # device samples (the next step reads it there); the step's output replaces it (``fill``).
        self.ahead = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token so far."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        """The token ids that block ``i`` of this sequence holds (the last one may be partial)."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def set_status(self, new: SequenceStatus) -> None:
        check_transition(self.status, new)
        self.status = new

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending(self) -> None:
        """Count the token a step in flight is sampling, before it is known (see ``ahead``)."""
        assert not self.ahead
        self.token_ids.append(PENDING_TOKEN)
        self.ahead = True

    def fill(self, token_id: int) -> None:
        """The pending token, now known: it takes its place (``append_token`` when none is pending)."""
        if not self.ahead:
            self.append_token(token_id)
            return
        self.token_ids[-1] = token_id
        self.ahead = False

    def drop_pending(self) -> None:
        """Forget the pending token (the sequence ended before its step's output came in)."""
        if self.ahead:
            self.token_ids.pop()
            self.ahead = False
