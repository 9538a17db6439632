"""The asyncio driver of an LLMEngine and the output side of each request.

``AsyncLLMEngine`` runs the synchronous core for the HTTP server: scheduling and bookkeeping on the
event loop, the model step in one worker thread (torch releases the GIL while it computes) so the
loop stays responsive, and one queue per request through which text and token deltas stream back.
Detokenisation and stop strings are applied here, as each step's tokens are delivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import EngineDeadError, EngineError, EngineFailedError, OverloadedError
from engine.llm_engine import EngineStats, LLMEngine
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


@dataclass(slots=True)
class RequestHandle:
    """Returned by submit; pass it to AsyncLLMEngine.stream to read the outputs."""

    seq_id: int
    prompt_tokens: int
    seq: Sequence


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


RESERVE_POLL_SECS = 0.02

# Messages of errors after which the device (and so the engine) cannot be trusted: a CUDA fault
# poisons the context, so every later step would fail too (vLLM's core treats them as fatal).
_FATAL_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "NCCL error",
                  "HIP error", "illegal memory access")


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

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._states: dict[int, RequestState] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        engine.on_blocks_freed = self._wake_up
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

    def check_request(self, num_prompt_tokens: int, params: SamplingParams, max_tokens_given: bool) -> SamplingParams:
        """Refuse (EngineError) a request this engine could not serve, before anything is scheduled."""
        return self.engine.check_request(num_prompt_tokens, params, max_tokens_given)

    def release(self, seq: Sequence) -> None:
        """Free the KV blocks a finished prefill held for a transfer."""
        self.engine.release(seq)

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

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
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
        for seq_id in list(self._states):
            self.abort(seq_id)
        self._executor.shutdown(wait=True)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool, hold_kv: bool = False,
        grammar: Any = None, stream_index: int = 0,
    ) -> RequestHandle:  # fmt: skip
        """Validate and queue a request; raises an EngineError the HTTP layer renders.

        ``grammar``: its structured-output matcher; ``stream_index``: which of a request's n samples
        it is (a seeded request's samples draw from different random streams)."""
        self._check_alive()
        params = self.engine.check_request(len(prompt_ids), params, max_tokens_given)
        seq = self.engine.add_request(prompt_ids, params, hold_kv, grammar=grammar, stream_index=stream_index)
        self._states[seq.seq_id] = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        assert self._wake is not None, "AsyncLLMEngine.start() was not awaited"
        self._wake.set()
        return RequestHandle(seq.seq_id, len(prompt_ids), seq)

    def submit_fork(self, parent: RequestHandle, stream_index: int, grammar: Any = None) -> RequestHandle:
        """Another sample of ``parent``'s request (n > 1) that shares its prompt's KV blocks."""
        seq = self.engine.add_fork(parent.seq, stream_index, grammar)
        self._states[seq.seq_id] = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        return RequestHandle(seq.seq_id, parent.prompt_tokens, seq)

    async def reserve(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool, wait_secs: float = 30.0
    ) -> Sequence:
        """Validate a request whose prompt KV comes from another engine and reserve its blocks.

        A pool that is full now frees blocks as running sequences finish: wait for room, at most
        ``wait_secs``, before answering 503 (check_request already refused what could never fit).
        """
        self._check_alive()
        params = self.engine.check_request(len(prompt_ids), params, max_tokens_given)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_secs
        while True:
            try:
                seq = self.engine.reserve(prompt_ids, params)
                self.engine.flush_kv_events()
                return seq
            except OverloadedError:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(RESERVE_POLL_SECS)
            self._check_alive()

    def fork_prefilled(self, seq: Sequence, stream_index: int, grammar: Any = None) -> RequestHandle:
        """Another sample (n > 1) of a reserved sequence whose prompt KV arrived; call before
        ``submit_prefilled(seq, ...)``, which starts them all."""
        child = self.engine.add_fork_prefilled(seq, stream_index, grammar)
        self._states[child.seq_id] = RequestState(child, IncrementalDetokenizer(self.engine.tokenizer))
        return RequestHandle(child.seq_id, seq.num_prompt_tokens, child)

    def submit_prefilled(self, seq: Sequence, first_token: int, logprob: TokenLogprob | None = None) -> RequestHandle:
        """Continue a reserved sequence whose KV arrived, from ``first_token`` (already an output)."""
        self._check_alive()
        self.engine.commit_prefilled(seq, first_token, logprob)
        self.engine.flush_kv_events()  # the KV that arrived over the relay is now cached here
        state = RequestState(seq, IncrementalDetokenizer(self.engine.tokenizer))
        self._states[seq.seq_id] = state
        self._deliver(state)  # the first token goes out now, before any decode step
        assert self._wake is not None, "AsyncLLMEngine.start() was not awaited"
        self._wake.set()
        return RequestHandle(seq.seq_id, seq.num_prompt_tokens, seq)

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
            self.engine.finish(state.seq, FinishReason.ABORT)

    async def _run(self) -> None:
        """The supervised loop: a failed step fails its own requests and the loop goes on; a fatal
        error (see ``is_fatal``) marks the engine dead and ends it."""
        assert self._wake is not None
        try:
            while self._dead is None:
                if self.engine.scheduler.is_idle():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if not await self._step():
                    if self.engine.held:
                        # Blocks pinned by KV transfers come back soon (or expire): wait, don't fail.
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    self._fail_waiting_head()
        except _Fatal as fatal:
            self._die(fatal.phase, fatal.cause)

    async def _step(self) -> bool:
        """One step, phase by phase; False when nothing could be scheduled. Raises only _Fatal."""
        engine = self.engine
        phase = "schedule"
        batch: ScheduledBatch | None = None
        try:
            batch = engine.schedule_batch()
            if batch is None:
                return False
            phase = "prepare"
            step = engine.prepare(batch)
            phase = "event_flush"
            engine.flush_kv_events()  # the blocks this step writes, reported as it starts (see announce)
            phase = "execute"
            tokens = await asyncio.get_running_loop().run_in_executor(self._executor, engine.execute, step)
            phase = "postprocess"
            engine.postprocess(batch, tokens)
            for seq in batch.seqs:
                state = self._states.get(seq.seq_id)
                if state is not None:
                    self._deliver(state)
            phase = "event_flush"
            engine.flush_kv_events()
        except Exception as exc:
            if is_fatal(exc):
                raise _Fatal(phase, exc) from exc
            # The step's requests fail; the loop, and every other request, carries on.
            seqs = batch.seqs if batch is not None else engine.scheduled_seqs()
            log.exception("engine_step_failed phase=%s requests=%d", phase, len(seqs))
            engine.fail(list(seqs))
            for seq in seqs:
                self._fail(seq.seq_id, EngineFailedError(f"model step failed ({phase}): {exc}"))
        return True

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
