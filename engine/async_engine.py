"""The asyncio driver of an LLMEngine and the output side of each request.

``AsyncLLMEngine`` runs the synchronous core for the HTTP server: scheduling and bookkeeping on the
event loop, the model step in one worker thread (torch releases the GIL while it computes) so the
loop stays responsive, and one queue per request through which text and token deltas stream back.
Detokenisation and stop strings are applied here, as each step's tokens are delivered.

It is also the engine's whole face for prefill/decode disaggregation: ``check`` reads a request's
``kv_transfer_params`` once, and ``open`` runs it as what it is, colocated, a prefill for a remote
decode (``prefill_for_remote_decode``) or a decode from remote KV (``decode_from_remote_kv``). Those
verbs own the reserve, pull, commit and release of the request's blocks; each request's transfer
lives in one ``Transfer`` here (its phase, its blocks, its grace timer), and the relay
(``engine.disagg``) only moves block ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.disagg import CONSUMER, PRODUCER, WRITE_GRACE_SECS, Disaggregation
from engine.errors import EngineDeadError, EngineError, EngineFailedError, InvalidRequestError, OverloadedError
from engine.kv_transfer import SKIP, KVTransferError, KVTransferParams
from engine.llm_engine import EngineStats, InFlight, LLMEngine
from engine.model_runner import StepInput
from engine.sampler import SampleOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step adds to one request: a text delta, and on the last one why it ended."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: EngineError | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of ``token_ids``, when the request asked for them
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first output, when the request asked for them
    admitted_at: float | None = None  # time.monotonic() when it was first given blocks (None: its KV came over)


@dataclass(slots=True)
class RequestState:
    """The output side of one request: detokenizer, stop strings, the queue its handler reads."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    text: str = ""  # all text decoded so far
    emitted: int = 0  # how much of ``text`` was sent
    tokens_sent: int = 0
    logprobs_sent: int = 0
    prompt_sent: bool = False
    done: bool = False


@dataclass(frozen=True, slots=True)
class RequestHandle:
    """One sequence of a request (an opaque ticket): pass it to AsyncLLMEngine.stream to read its outputs."""

    seq_id: int
    prompt_tokens: int


class Role(enum.Enum):
    """What a request asks of this engine in prefill/decode disaggregation (its ``kv_transfer_params``)."""

    COLOCATED = None
    PREFILL_FOR_REMOTE_DECODE = PRODUCER  # the engine role it needs, as --kv-transfer-config names it
    DECODE_FROM_REMOTE_KV = CONSUMER


@dataclass(frozen=True, slots=True)
class Admission:
    """A request this engine checked, once, and will serve: final params and what P/D brought along."""

    prompt_ids: list[int]
    params: SamplingParams
    role: Role
    kv: KVTransferParams | None = None  # decode from remote KV: where the prompt's KV is
    first_logprob: TokenLogprob | None = None  # ... and the prefill engine's scores, reported as ours
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Prefill for a remote decode, offered before it runs (the gateway asked ``early_offer`` and nothing the
    # decode engine needs comes from the prefill but its first token and KV): answered at once.
    early_offer: bool = False


class Phase(enum.Enum):
    """Where one request's KV transfer is, seen from this engine."""

    PREFILLING = "prefilling"  # prefill side: computing the prompt whose KV it will offer
    OFFERED = "offered"  # prefill side: blocks pinned until the decode engine pulled them (or never will)
    RESERVED = "reserved"  # decode side: blocks allocated, the KV not here yet
    PULLING = "pulling"
    LANDED = "landed"  # decode side: the KV is in its blocks, the first token not yet committed
    GRACE = "grace"  # decode side: a failed pull; blocks kept out of use while a late write may land
    COMMITTED = "committed"  # decode side: the KV landed, the sequence decodes like any other
    RELEASED = "released"  # its blocks went back (or, committed, became the sequence's)


_PHASES = {
    Phase.PREFILLING: {Phase.OFFERED, Phase.RELEASED},
    Phase.OFFERED: {Phase.RELEASED},
    Phase.RESERVED: {Phase.PULLING, Phase.COMMITTED, Phase.RELEASED},
    Phase.PULLING: {Phase.LANDED, Phase.GRACE, Phase.RELEASED},
    Phase.LANDED: {Phase.COMMITTED, Phase.RELEASED},
    Phase.GRACE: {Phase.RELEASED},
    Phase.COMMITTED: set(),
    Phase.RELEASED: set(),
}


@dataclass(slots=True)
class Transfer:
    """One request's KV transfer on this engine: the only place its state lives."""

    seq: Sequence
    phase: Phase
    grace: asyncio.TimerHandle | None = None  # GRACE: when the blocks go back
    # RESERVED: the step in flight when the blocks were handed out, when an abort during it freed some of them
    # (it may still write them): the pull lands nothing before it ended. None: nothing to wait for.
    after: concurrent.futures.Future[Any] | None = None
    # An early offer: told (on the event loop) when its prefill has produced the first token.
    on_prefilled: Callable[[Sequence], None] | None = None

    def move(self, new: Phase) -> None:
        """The one place a transfer's phase changes; refuses a move its life cycle does not allow."""
        if new not in _PHASES[self.phase]:
            raise RuntimeError(f"KV transfer of sequence {self.seq.seq_id}: {self.phase.value} -> {new.value}")
        self.phase = new


class Generation:
    """The sequences of one request on this engine (``handles``), and what it hands on when it ends."""

    def __init__(self, engine: AsyncLLMEngine, handles: list[RequestHandle], transfer: Transfer | None = None,
                 pulled_at: float | None = None, reserved_at: float | None = None,
                 early_params: dict[str, Any] | None = None) -> None:  # fmt: skip
        self._engine = engine
        self.handles = tuple(handles)
        self._transfer = transfer
        self.pulled_at = pulled_at  # decode from remote KV: when the prompt's KV had landed
        self.reserved_at = reserved_at  # ... and when blocks for it had been reserved
        # An early offer's kv_transfer_params: the answer, at once; the prefill runs on, owned by its transfer.
        self.early_params = early_params

    def hand_over(self) -> dict[str, Any] | None:
        """Once its outputs are read: a prefill for a remote decode offers its prompt's KV and returns the
        ``kv_transfer_params`` for the answer; anything else hands nothing on (None)."""
        transfer = self._transfer
        if transfer is None or transfer.phase is not Phase.PREFILLING:
            return None
        return self._engine._offer(transfer)

    def on_prefilled(self, callback: Callable[[Sequence], None]) -> None:
        """An early offer: call ``callback`` once its prefill produced the first token (for the server's metrics)."""
        assert self._transfer is not None and self.early_params is not None, "only an early offer is prefilled later"
        self._transfer.on_prefilled = callback

    def close(self) -> None:
        """Whatever ended the request (done, client gone, error): its blocks go now, except those offered."""
        for h in self.handles:
            self._engine.abort(h.seq_id)
        if self._transfer is not None and self._transfer.phase is Phase.PREFILLING:
            self._engine.release(self._transfer)  # held blocks nobody will pull


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine is, fixed once it is built (the server's /server_info, /v1/models and checks)."""

    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    device: str
    dtype: str  # "float32", "bfloat16", ...
    kv_cache_dtype: str


# Messages of errors after which the device (and so the engine) cannot be trusted: a CUDA fault
# poisons the context, so every later step would fail too (vLLM's core treats them as fatal).
_FATAL_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "device-side assert",
    "NCCL error",
    "HIP error",
    "illegal memory access",
)


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the engine unusable (the engine dies) rather than failing one step.

    An EngineDeadError (what a component raises to say the engine cannot go on), torch's
    AcceleratorError, or a RuntimeError naming a device fault. Out of memory is not fatal: the step's requests fail, the
    memory comes back.
    """
    if isinstance(exc, EngineDeadError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _FATAL_MARKERS)


class _Fatal(Exception):
    """Carries a fatal error and the phase it happened in out of a step, to end the loop."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(phase)
        self.phase = phase
        self.cause = cause


class AsyncLLMEngine:
    """Drives an LLMEngine from asyncio: one loop task, one model thread, one queue per request."""

    def __init__(self, engine: LLMEngine, relay: Disaggregation | None = None) -> None:
        self.engine = engine
        self.relay = relay  # this engine's side of the KV relay (--kv-transfer-config), started and stopped here
        self._states: dict[int, RequestState] = {}
        self._transfers: dict[int, Transfer] = {}  # by sequence id, until released or committed
        self._early: dict[int, tuple[Transfer, str]] = {}  # early offers whose prefill runs: (transfer, its id)
        self._admitting: dict[int, asyncio.Future[None]] = {}  # early offers' legs, answered once admitted to a step
        # Broadcast to reservations waiting for room: replaced (after being set) each time blocks come back.
        self._freed = asyncio.Event()
        self._reservations_waiting = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        # Done once the device work of the newest step launched has ended (see _launch); None before the first
        self._executing: concurrent.futures.Future[Any] | None = None
        self._inflight: InFlight | None = None  # a step scheduled ahead (--async-scheduling), its output not taken
        # Blocks an abort freed while that step ran: it may still write them, so KV pulled into them waits for it.
        self._freed_in_step: set[int] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        engine.on_blocks_freed = self._blocks_freed
        if relay is not None:
            relay.on_agent_dead = lambda exc: self.die("kv_agent", exc)
        self.info = EngineInfo(
            model_id=engine.model_id,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            eos_token_ids=engine.eos_token_ids,
            num_blocks=engine.num_blocks,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            kv_cache_dtype=str(engine.runner.cache_dtype).removeprefix("torch."),
        )

    # The server's view of the core: these, the request methods below, and nothing else.

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """Counters and gauges for /metrics."""
        return self.engine.stats()

    def flush_prefix_cache(self) -> int:
        """Forget the prefix cache's free blocks (blocks in use keep theirs); returns how many."""
        flushed = self.engine.block_manager.flush()
        self.engine.flush_kv_events()  # subscribers learn the blocks are gone
        return flushed

    def publish_kv_events(self, sink: Callable[[list[list[Any]]], None] | None) -> None:
        """Send KV cache events to ``sink`` from now on (None: stop); a new sink first learns the cache is empty."""
        self.engine.kv_events_sink = sink
        if sink is not None:
            self.engine.flush_kv_events()  # AllBlocksCleared: this engine starts empty

    def _blocks_freed(self) -> None:
        """Blocks came back: the loop may schedule what waits for them, reservations may try again."""
        if self._wake is not None:
            self._wake.set()
        if self._reservations_waiting:
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()

    async def start(self) -> None:
        """Start the KV relay (if any: a router reads /kv_transfer_info at registration), then the loop."""
        if self.relay is not None:
            await self.relay.start()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._inflight = None  # a step scheduled ahead: its sequences end below, its output is not wanted
        for seq_id in list(self._states):
            self.abort(seq_id)
        if self.relay is not None:
            await self.relay.stop()  # pending offers end: their blocks come back through release
        for transfer in list(self._transfers.values()):
            self.release(transfer)  # nothing writes into them once the relay is gone
        self._executor.shutdown(wait=True)

    # -- requests ------------------------------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool,
              kv_transfer_params: dict[str, Any] | None = None) -> Admission:  # fmt: skip
        """Refuse (EngineError) a request this engine could not serve, before anything runs; the one check.

        ``kv_transfer_params`` with ``do_remote_decode`` make it a prefill for a remote decode (this engine
        must be a kv_producer), with ``do_remote_prefill`` a decode from remote KV (a kv_consumer)."""
        self._check_alive()
        raw = kv_transfer_params or {}
        role = (Role.PREFILL_FOR_REMOTE_DECODE if raw.get("do_remote_decode")
                else Role.DECODE_FROM_REMOTE_KV if raw.get("do_remote_prefill") else Role.COLOCATED)  # fmt: skip
        if role is not Role.COLOCATED and (self.relay is None or self.relay.role != role.value):
            have = self.relay.role if self.relay is not None else "none"
            raise InvalidRequestError(
                f"kv_transfer_params need a {role.value} engine; this one's kv_role is {have} (--kv-transfer-config)"
            )
        n = len(prompt_ids)
        if role is Role.PREFILL_FOR_REMOTE_DECODE:
            # The gateway sends the prefill leg max_tokens 1: min_tokens only bans EOS for that first token here.
            params = replace(params, min_tokens=min(params.min_tokens, 1))
            decode_limit = raw.get("decode_max_tokens")
            if isinstance(decode_limit, int) and not isinstance(decode_limit, bool):  # what the decode leg will ask
                self.engine.check_request(n, replace(params, max_tokens=decode_limit), True)
        params = self.engine.check_request(n, params, max_tokens_given)
        if role is not Role.DECODE_FROM_REMOTE_KV:
            early = (role is Role.PREFILL_FOR_REMOTE_DECODE and raw.get("early_offer") is True
                     and self.relay is not None and self.relay.config.early_offer
                     and params.logprobs is None and params.prompt_logprobs is None)  # fmt: skip
            return Admission(prompt_ids, params, role, early_offer=early)
        assert self.relay is not None
        return Admission(prompt_ids, params, role, self.relay.parse(raw), _first_logprob(raw, params),
                         tuple(_prompt_logprobs(raw, params)))  # fmt: skip

    async def open(self, request: Admission, n: int = 1,
                   matcher: Callable[[], Any] | None = None) -> Generation:  # fmt: skip
        """Run a checked request as what it is: colocated, a prefill for a remote decode, or a decode from
        remote KV; ``n`` samples, each with its own structured-output matcher from ``matcher``."""
        if request.role is Role.PREFILL_FOR_REMOTE_DECODE:
            return await self.prefill_for_remote_decode(request, matcher)
        if request.role is Role.DECODE_FROM_REMOTE_KV:
            return await self.decode_from_remote_kv(request, n, matcher)
        return self.generate(request, n, matcher)

    def generate(self, request: Admission, n: int = 1, matcher: Callable[[], Any] | None = None) -> Generation:
        """Queue a request's ``n`` samples (the others share the first one's prompt KV once computed)."""
        handles: list[RequestHandle] = []
        try:
            for i in range(n):
                grammar = matcher() if matcher is not None else None
                if i == 0:
                    handles.append(self._submit(request.prompt_ids, request.params, grammar=grammar))
                else:
                    handles.append(self._fork(handles[0], i, grammar))
        except BaseException:
            for h in handles:
                self.abort(h.seq_id)
            raise
        return Generation(self, handles)

    async def prefill_for_remote_decode(self, request: Admission,
                                        matcher: Callable[[], Any] | None = None) -> Generation:  # fmt: skip
        """Compute the prompt (and its first token), keeping its KV blocks for a decode engine to pull:
        ``Generation.hand_over`` offers them once the outputs are read; ``close`` frees them if never offered.

        An early offer is answered once its prefill is admitted to a step (``_answer_admitted``), not while it
        queues: the queue is waited out before the answer, as for an offer made after its prefill, so a decode
        engine's pull places only ever wait for prefills that run; and the offer expires only after its prefill
        ended. Answered at once, and expiring from the offer, a burst larger than a step failed nearly whole: the
        offers of prefills still queued or in a long step expired, while the decode engine's pull places were held
        by pulls waiting for them (docs/pd.md)."""
        grammar = matcher() if matcher is not None else None
        handle = self._submit(request.prompt_ids, request.params, hold_kv=True, grammar=grammar)
        transfer = Transfer(self._states[handle.seq_id].seq, Phase.PREFILLING)
        self._transfers[handle.seq_id] = transfer
        if not request.early_offer:
            return Generation(self, [handle], transfer)
        params = self._offer_early(transfer)
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._admitting[handle.seq_id] = admitted
        try:
            await admitted
        except BaseException:
            self._admitting.pop(handle.seq_id, None)
            if self._early.get(handle.seq_id) is not None and self.relay is not None:  # no decode engine will read it
                self.relay.conclude(params["transfer_id"], error="the prefill leg went before its answer")
            raise
        return Generation(self, [], transfer, early_params=params)

    def _offer_early(self, transfer: Transfer) -> dict[str, Any]:
        """Offer a queued prefill's KV now, expiring only after the prefill ended: the decode engine reads its
        blocks as they become final (``_advance_early`` after each step), the first token when it ends. Nobody
        streams its outputs."""
        assert self.relay is not None
        seq = transfer.seq
        del self._states[seq.seq_id]
        bs = seq.block_size
        try:
            params = self.relay.offer_early((seq.num_prompt_tokens + bs - 1) // bs, lambda: self.release(transfer))
        except BaseException:
            self._stop_prefill(seq)
            self.release(transfer)
            raise
        transfer.move(Phase.OFFERED)
        self._early[seq.seq_id] = (transfer, params["transfer_id"])
        return params

    def _answer_admitted(self, batch: ScheduledBatch) -> None:
        """Answer the legs of the early offers whose prefills ``batch`` admits."""
        for seq in batch.seqs:
            admitted = self._admitting.pop(seq.seq_id, None)
            if admitted is not None and not admitted.done():
                admitted.set_result(None)

    def _advance_early(self, seq: Sequence) -> None:
        """After a step of an early offer's prefill: tell the relay which blocks are final, or how it ended."""
        transfer, tid = self._early[seq.seq_id]
        assert self.relay is not None
        bs = seq.block_size
        blocks = seq.block_table[: (seq.num_prompt_tokens + bs - 1) // bs]
        if seq.status is not SequenceStatus.FINISHED:
            self.relay.progress(tid, blocks, min(seq.num_cached_tokens, seq.num_prompt_tokens) // bs)
            return
        del self._early[seq.seq_id]
        if seq.finish_reason is FinishReason.ABORT or not seq.completion_ids:
            self.relay.conclude(tid, error="the prefill was aborted")
        else:
            self.relay.conclude(tid, blocks, seq.completion_ids[0])
            if transfer.on_prefilled is not None:
                transfer.on_prefilled(seq)

    def _refuse_admission(self, seq_id: int, why: str) -> None:
        """An early offer's leg still waiting for its prefill's admission gets ``why`` as its error."""
        admitted = self._admitting.pop(seq_id, None)
        if admitted is not None and not admitted.done():
            admitted.set_exception(EngineFailedError(why))

    def _end_early(self, seq_id: int, why: str) -> None:
        """An early offer's prefill failed (its step, or the engine): the decode engine is told so, or its leg
        before it was answered."""
        self._refuse_admission(seq_id, why)
        entry = self._early.pop(seq_id, None)
        if entry is not None and self.relay is not None:
            self.relay.conclude(entry[1], error=why)

    def _stop_prefill(self, seq: Sequence) -> None:
        """Abort a prefill still running (its early offer ended: pulled, refused, expired, or closed)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if self._executing is not None and not self._executing.done():
            self._freed_in_step.update(seq.block_table)
        self.engine.finish(seq, FinishReason.ABORT)
        self._blocks_freed()

    async def decode_from_remote_kv(self, request: Admission, n: int = 1, matcher: Callable[[], Any] | None = None,
                                    wait_secs: float = 30.0) -> Generation:  # fmt: skip
        """Reserve blocks for the prompt (waiting for room, at most ``wait_secs``), pull its KV from the
        prefill engine, and continue from the first token it sampled; ``n`` samples fork from that KV.

        Raises before any output (so before any byte is sent): OverloadedError when no room came,
        KVTransferError when the pull failed (the blocks go back, after a grace period when a late write
        may still land in them; likewise when the pull is cancelled)."""
        assert self.relay is not None and request.kv is not None, "decode_from_remote_kv needs a checked request"
        kv = request.kv
        try:
            transfer = await self.reserve(request, wait_secs)
        except BaseException:  # no room, or the client left while waiting for it: an early offer's prefill stops
            self.relay.abandon(kv)
            raise
        reserved_at = time.monotonic()
        seq = transfer.seq
        seq.prompt_logprobs = list(request.prompt_logprobs)  # the prefill engine scored the prompt; forks copy them
        seq.grammar = matcher() if matcher is not None else None
        bs = seq.block_size
        needed = (seq.num_prompt_tokens + bs - 1) // bs
        if kv.blocks != needed:
            self.release(transfer)
            self.relay.abandon(kv)
            raise InvalidRequestError(
                f"kv_transfer_params carry {kv.blocks} blocks but this prompt needs {needed} "
                "here: prefill and decode must run the same model and tokenizer"
            )
        have = seq.num_cached_tokens // bs  # leading blocks the local prefix cache already holds
        transfer.move(Phase.PULLING)
        try:
            sent = await self.relay.pull(kv, [SKIP if i < have else seq.block_table[i] for i in range(needed)],
                                         transfer.after)  # fmt: skip
        except BaseException as exc:
            # The blocks go back at once unless the producer may still write into them (a direct Mooncake write
            # in flight): then only after WRITE_GRACE_SECS. A cancelled ipc copy or staged scatter has ended by now.
            if isinstance(exc, asyncio.CancelledError):
                late = self.relay.dst_may_be_written_if_cancelled(kv)
            else:
                late = isinstance(exc, KVTransferError) and exc.dst_may_be_written
            self.release(transfer, WRITE_GRACE_SECS if late else 0.0)
            raise
        transfer.move(Phase.LANDED)
        pulled_at = time.monotonic()
        # n > 1 (or best_of): the other samples fork from the transferred prompt KV before the first
        # continues (it may finish at once and free it); each samples its own first token.
        forks: list[RequestHandle] = []
        try:
            for i in range(1, n):
                forks.append(self._fork_prefilled(seq, i, matcher() if matcher is not None else None))
            first_token = kv.first_token_id if kv.first_token_id is not None else sent
            assert first_token is not None, "an early offer's pull returns its first token"
            first = self.commit(transfer, first_token, request.first_logprob)
        except BaseException:
            for h in forks:
                self.abort(h.seq_id)
            self.release(transfer)  # a no-op once committed: the sequence's own blocks went with it
            raise
        return Generation(self, [first, *forks], pulled_at=pulled_at, reserved_at=reserved_at)

    async def reserve(self, request: Admission, wait_secs: float = 30.0) -> Transfer:
        """Reserve blocks for a prompt whose KV comes from another engine.

        A pool that is full now frees blocks as running sequences finish: wait for that (woken when blocks
        come back, never polling), at most ``wait_secs``, before refusing with OverloadedError (``check``
        already refused what could never fit)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_secs
        while True:
            self._check_alive()
            freed = self._freed
            try:
                seq = self.engine.reserve(request.prompt_ids, request.params)
            except OverloadedError:
                left = deadline - loop.time()
                if left <= 0:
                    raise
                self._reservations_waiting += 1
                try:
                    await asyncio.wait_for(freed.wait(), left)
                except TimeoutError:
                    pass  # one last try, then the refusal
                finally:
                    self._reservations_waiting -= 1
                continue
            self.engine.flush_kv_events()
            running = self._executing
            unsafe = running is not None and not running.done() and not self._freed_in_step.isdisjoint(seq.block_table)
            transfer = Transfer(seq, Phase.RESERVED, after=running if unsafe else None)
            self._transfers[seq.seq_id] = transfer
            return transfer

    def commit(self, transfer: Transfer, first_token: int, logprob: TokenLogprob | None = None) -> RequestHandle:
        """Continue a reserved sequence whose KV arrived, from ``first_token`` (already an output)."""
        self._check_alive()
        seq = transfer.seq
        transfer.move(Phase.COMMITTED)
        del self._transfers[seq.seq_id]
        self.engine.commit_prefilled(seq, first_token, logprob)
        self.engine.flush_kv_events()  # the KV that arrived over the relay is now cached here
        state = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        self._states[seq.seq_id] = state
        self._deliver(state)  # the first token goes out now, before any decode step
        assert self._wake is not None, "AsyncLLMEngine.start() was not awaited"
        self._wake.set()
        return RequestHandle(seq.seq_id, seq.num_prompt_tokens)

    def _offer(self, transfer: Transfer) -> dict[str, Any]:
        """A finished prefill's prompt blocks, offered to the decode engine: its ``kv_transfer_params``."""
        assert self.relay is not None
        seq = transfer.seq
        if not seq.completion_ids:
            raise EngineFailedError("the prefill produced no token to hand over")
        blocks = seq.block_table[: (seq.num_prompt_tokens + seq.block_size - 1) // seq.block_size]
        params = self.relay.offer(blocks, seq.completion_ids[0], seq.prefix_hit_tokens, lambda: self.release(transfer))
        transfer.move(Phase.OFFERED)
        if seq.logprobs:
            params["first_token_logprob"] = _logprob_dict(seq.logprobs[0])
        if seq.params.prompt_logprobs is not None:  # the decode engine reports them as its own
            params["prompt_logprobs"] = [_logprob_dict(lp) for lp in seq.prompt_logprobs]
        return params

    def release(self, transfer: Transfer, after: float = 0.0) -> None:
        """Give a transfer's blocks back, now or ``after`` seconds (GRACE: a late write may land in them)."""
        if transfer.phase in (Phase.RELEASED, Phase.COMMITTED):
            return
        if after > 0 and transfer.phase is not Phase.GRACE:
            transfer.move(Phase.GRACE)
            transfer.grace = asyncio.get_running_loop().call_later(after, self.release, transfer)
            return
        if transfer.grace is not None:
            transfer.grace.cancel()
        transfer.move(Phase.RELEASED)
        self._transfers.pop(transfer.seq.seq_id, None)
        if self._early.pop(transfer.seq.seq_id, None) is not None:
            self._stop_prefill(transfer.seq)  # an early offer that ended before its prefill did
            self._refuse_admission(transfer.seq.seq_id, "the prefill's KV offer ended before the prefill ran")
        self.engine.release(transfer.seq)  # tells _blocks_freed

    def submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool) -> RequestHandle:
        """Check and queue a plain request of one sequence (the server's /health_generate; tests)."""
        return self.generate(self.check(prompt_ids, params, max_tokens_given)).handles[0]

    def _submit(self, prompt_ids: list[int], params: SamplingParams, hold_kv: bool = False, grammar: Any = None,
                stream_index: int = 0) -> RequestHandle:  # fmt: skip
        """Queue a checked request; raises OverloadedError when the queue is full.

        ``grammar``: its structured-output matcher; ``stream_index``: which of a request's n samples
        it is (a seeded request's samples draw from different random streams)."""
        self._check_alive()
        seq = self.engine.add_request(prompt_ids, params, hold_kv, grammar=grammar, stream_index=stream_index)
        self._states[seq.seq_id] = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        assert self._wake is not None, "AsyncLLMEngine.start() was not awaited"
        self._wake.set()
        return RequestHandle(seq.seq_id, len(prompt_ids))

    def _fork(self, parent: RequestHandle, stream_index: int, grammar: Any = None) -> RequestHandle:
        """Another sample of ``parent``'s request (n > 1) that shares its prompt's KV blocks."""
        seq = self.engine.add_fork(self._states[parent.seq_id].seq, stream_index, grammar)
        self._states[seq.seq_id] = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        return RequestHandle(seq.seq_id, parent.prompt_tokens)

    def _fork_prefilled(self, seq: Sequence, stream_index: int, grammar: Any = None) -> RequestHandle:
        """Another sample (n > 1) of a reserved sequence whose prompt KV arrived; before ``commit``."""
        child = self.engine.add_fork_prefilled(seq, stream_index, grammar)
        self._states[child.seq_id] = RequestState(child, IncrementalDetokenizer(self.engine.tokenizer))
        return RequestHandle(child.seq_id, seq.num_prompt_tokens)

    async def stream(self, handle: RequestHandle) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the last; leaving early (client gone) aborts it."""
        state = self._states.get(handle.seq_id)
        if state is None:
            raise EngineFailedError("unknown request")
        try:
            while True:
                out = await state.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self.abort(handle.seq_id)

    def abort(self, seq_id: int) -> None:
        """Forget a request and free its blocks now; a no-op when it already finished."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            if self._executing is not None and not self._executing.done():
                self._freed_in_step.update(state.seq.block_table)
            self.engine.finish(state.seq, FinishReason.ABORT)
            self._blocks_freed()

    async def _run(self) -> None:
        """The supervised loop: a failed step fails its own requests and the loop goes on; a fatal
        error (see ``is_fatal``) marks the engine dead and ends it."""
        assert self._wake is not None
        try:
            while self._dead is None:
                if self._inflight is None and self.engine.scheduler.is_idle():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                free = self.engine.block_manager.num_free_blocks
                stepped = await self._step()
                if self.engine.block_manager.num_free_blocks > free:
                    self._blocks_freed()  # sequences finished: waiting reservations may fit now
                if not stepped:
                    if self.engine.held:
                        # Blocks pinned by KV transfers come back soon (or expire): wait, don't fail.
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    self._fail_waiting_head()
        except _Fatal as fatal:
            self._die(fatal.phase, fatal.cause)

    async def _step(self) -> bool:
        """One step, phase by phase; False when nothing could be scheduled. Raises only _Fatal.

        With --async-scheduling the step after it may be launched before its output is taken
        (``LLMEngine.can_run_ahead``): that one stays on the device, and the next call takes its output."""
        engine = self.engine
        phase = "schedule"
        current, self._inflight = self._inflight, None
        launched: list[tuple[InFlight, concurrent.futures.Future[Any]]] = []
        if current is not None:
            assert self._executing is not None
            launched.append((current, self._executing))
        batch: ScheduledBatch | None = current.batch if current is not None else None
        try:
            if current is None:
                batch = engine.schedule_batch()
                if batch is None:
                    return False
                self._answer_admitted(batch)
                phase = "prepare"
                step = engine.prepare(batch)
                phase = "event_flush"
                engine.flush_kv_events()  # the blocks this step writes, reported as it starts (see announce)
                phase = "execute"
                current = await self._launch(batch, step, launched)
            ahead: InFlight | None = None
            freed_before = set(self._freed_in_step)  # their sequences ended: no step scheduled from now has them
            if engine.can_run_ahead(current):
                phase = "schedule"
                ahead_batch, ahead_step = engine.schedule_ahead(current)
                phase = "event_flush"
                engine.flush_kv_events()
                phase = "execute"
                ahead = await self._launch(ahead_batch, ahead_step, launched)
            phase = "execute"
            tokens = await self._result(launched[0])
            # Nothing on the device writes them any more, but the step ahead may write blocks freed since it was
            # scheduled (an abort while it was being handed over).
            self._freed_in_step = self._freed_in_step - freed_before if ahead is not None else set()
            phase = "postprocess"
            engine.postprocess(current.batch, tokens)
            for seq in current.batch.seqs:
                state = self._states.get(seq.seq_id)
                if state is not None:
                    self._deliver(state)
                elif seq.seq_id in self._early:
                    self._advance_early(seq)
            phase = "event_flush"
            engine.flush_kv_events()
            self._inflight = ahead
        except Exception as exc:
            if is_fatal(exc):
                for _, done in launched:  # nothing more runs: transfers waiting for these steps go on (and fail)
                    if not done.done():
                        done.set_result(None)
                raise _Fatal(phase, exc) from exc
            # The step's requests fail (with a step scheduled ahead of it, the same sequences), once nothing on
            # the device writes their blocks any more; the loop, and every other request, carries on.
            for pair in launched:
                if not pair[1].done():
                    with contextlib.suppress(Exception):
                        await self._result(pair)
            self._freed_in_step.clear()
            seqs = batch.seqs if batch is not None else engine.scheduled_seqs()
            log.exception("engine_step_failed phase=%s requests=%d", phase, len(seqs))
            engine.fail(list(seqs))
            for seq in seqs:
                self._fail(seq.seq_id, EngineFailedError(f"model step failed ({phase}): {exc}"))
                self._end_early(seq.seq_id, f"model step failed ({phase}): {exc}")
        return True

    async def _launch(self, batch: ScheduledBatch, step: StepInput,
                      launched: list[tuple[InFlight, concurrent.futures.Future[Any]]]) -> InFlight:  # fmt: skip
        """Hand ``step`` to the device (on the model thread). Until its output is taken, ``_executing`` is the
        future that says its device work has ended: blocks freed meanwhile may still be written by it."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._executing = done
        try:
            inflight = InFlight(batch, await asyncio.wrap_future(self._executor.submit(self.engine.launch, step)))
        except BaseException:
            done.set_result(None)  # it ran to its end (or never ran): a failure of the step
            raise
        launched.append((inflight, done))
        return inflight

    async def _result(self, pair: tuple[InFlight, concurrent.futures.Future[Any]]) -> SampleOutput:
        """A launched step's output, once the device has produced it (waited for on the model thread)."""
        inflight, done = pair
        try:
            return await asyncio.wrap_future(self._executor.submit(inflight.launched.result))
        finally:
            if not done.done():
                done.set_result(None)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine stopped serving, once a fatal error ended its loop; None while it serves."""
        return self._dead

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback`` once if the engine dies (the server's /health and --exit-on-engine-error)."""
        self._death_callbacks.append(callback)

    def die(self, phase: str, cause: BaseException) -> None:
        """A component the engine cannot serve without has failed (``phase`` names it): the engine is dead."""
        if self._dead is None:
            self._die(phase, cause)
            if self._wake is not None:
                self._wake.set()  # the loop sees it and ends

    def _die(self, phase: str, cause: BaseException) -> None:
        """The engine can serve nothing more: every request gets an error, new ones are refused (503)."""
        self._dead = EngineDeadError(f"the engine failed and serves no more requests ({phase}): {cause}")
        log.critical("engine_dead phase=%s requests=%d error=%s", phase, len(self._states), cause,
                     exc_info=(type(cause), cause, cause.__traceback__))  # fmt: skip
        for seq_id in list(self._states):
            self._fail(seq_id, self._dead)
        for seq_id in list(self._early):
            self._end_early(seq_id, str(self._dead))
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()  # waiting reservations see the engine is dead
        for callback in self._death_callbacks:
            callback(self._dead)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _fail_waiting_head(self) -> None:
        # Admission guarantees a lone sequence fits, so this means blocks leaked: fail loudly
        # instead of spinning.
        seq = self.engine.scheduler.waiting[0]
        log.error("sequence_unschedulable seq_id=%d reason=idle_engine", seq.seq_id)
        self.engine.finish(seq, FinishReason.ABORT)
        self._fail(seq.seq_id, EngineFailedError("the request could not be scheduled"))
        self._end_early(seq.seq_id, "the request could not be scheduled")

    def _fail(self, seq_id: int, error: EngineError) -> None:
        state = self._states.get(seq_id)
        if state is None or state.done:
            return
        state.done = True
        seq = state.seq
        state.queue.put_nowait(
            RequestOutput("", (), True, "abort", seq.num_prompt_tokens, seq.num_completion_tokens, 0, error)
        )

    def _deliver(self, state: RequestState) -> None:
        seq = state.seq
        if state.done:
            return
        ids = seq.completion_ids
        new_ids = tuple(ids[state.tokens_sent :])
        state.tokens_sent = len(ids)
        new_logprobs = tuple(seq.logprobs[state.logprobs_sent :])
        state.logprobs_sent = len(seq.logprobs)
        prompt_logprobs = tuple(seq.prompt_logprobs) if not state.prompt_sent else ()
        if isinstance(seq.stop_reason, int):
            ids = ids[:-1]  # a stop token's own text is not part of the output (as vLLM)
        state.text += state.detokenizer.step(ids)
        # min_tokens holds back stop strings too, until that many tokens are out.
        stops = seq.params.stop if seq.num_completion_tokens > seq.params.min_tokens else ()
        finished = seq.status is SequenceStatus.FINISHED
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        end = len(state.text)
        if finished and seq.finish_reason is not FinishReason.ABORT:
            state.text += state.detokenizer.flush(ids)
            end = len(state.text)
        if stops:
            # Search only where a new match can start: the held-back tail plus the new text.
            start = max(0, state.emitted - max(len(s) for s in stops) + 1)
            hits = [(i, s) for i, s in ((state.text.find(s, start), s) for s in stops) if i >= 0]
            if hits:
                end, seq.stop_reason = min(hits)
                if seq.params.include_stop_str_in_output:
                    end += len(seq.stop_reason)
                state.text = state.text[:end]
                self.engine.finish(seq, FinishReason.STOP)
                finished, reason = True, FinishReason.STOP.value
            elif not finished:
                end -= _partial_stop_len(state.text, stops)
        delta = state.text[state.emitted : end]
        state.emitted = max(state.emitted, end)
        if not delta and not new_ids and not finished:
            return
        state.prompt_sent = True
        if finished:
            state.done = True
        state.queue.put_nowait(
            RequestOutput(
                delta,
                new_ids,
                finished,
                reason if finished else None,
                seq.num_prompt_tokens,
                seq.num_completion_tokens,
                seq.prefix_hit_tokens,
                logprobs=new_logprobs,
                stop_reason=seq.stop_reason if finished else None,
                prompt_logprobs=prompt_logprobs,
                admitted_at=seq.admitted_at,
            )
        )


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def _logprob_dict(lp: TokenLogprob) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


def _prompt_logprobs(kv: dict[str, Any], params: SamplingParams) -> list[TokenLogprob]:
    """The prompt's scores the prefill engine computed (prompt_logprobs, or echo with logprobs, in P/D)."""
    if params.prompt_logprobs is None:
        return []
    raw = kv.get("prompt_logprobs")
    if not isinstance(raw, list):
        raise InvalidRequestError(
            "prompt_logprobs in P/D need kv_transfer_params.prompt_logprobs from the prefill "
            "engine (was its request sent with prompt_logprobs?)"
        )
    try:
        return [TokenLogprob(int(r["token_id"]), float(r["logprob"]), int(r["rank"]),
                             tuple((int(t), float(v)) for t, v in r["top"])[: params.prompt_logprobs])
                for r in raw]  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"kv_transfer_params.prompt_logprobs: {exc}") from exc


def _first_logprob(kv: dict[str, Any], params: SamplingParams) -> TokenLogprob | None:
    """The prefill engine's logprob of the first token, which the decode side reports as its own."""
    if params.logprobs is None:
        return None
    raw = kv.get("first_token_logprob")
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            "logprobs in P/D need kv_transfer_params.first_token_logprob from the prefill "
            "engine (was its request sent with logprobs?)"
        )
    try:
        top = tuple((int(t), float(v)) for t, v in raw["top"])[: params.logprobs]
        return TokenLogprob(int(raw["token_id"]), float(raw["logprob"]), int(raw["rank"]), top)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"kv_transfer_params.first_token_logprob: {exc}") from exc
