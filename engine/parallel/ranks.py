"""The processes of a tensor-parallel engine: rank 0 (the server's own process) and ranks 1..N-1.

Rank 0 serves HTTP, schedules and samples; the other ranks only execute. Each rank loads its slice of
the model and owns its slice of the KV cache. Per step, rank 0 sends every other rank, over a pipe, the
scheduled sequences' state (``StepOrder``: token ids, block tables, cached lengths); each rank turns
it into model inputs with the same ``ModelRunner.prepare`` (so a CUDA graph replay stages the same
buffers on every rank) and runs the same forward, meeting the others in its collectives. The sampled
token is rank 0's; the other ranks' samplers run on the same logits and their result is dropped.

The KV relay of a P/D engine runs in rank 0: every rank hands rank 0 its KV cache tensors once at
start (shared memory on CPU, CUDA IPC on GPUs), so rank 0 registers and moves all of them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing  # registers the tensor reductions: tensors cross the pipes as shared memory / IPC

from engine.parallel.group import COLLECTIVE_TIMEOUT, TensorParallel, join_group, leave_group
from engine.sequence import SamplingParams, Sequence

if TYPE_CHECKING:
    from engine.args import EngineArgs
    from engine.model_runner import ModelRunner

# Builds the runner of one rank other than 0 on its device (engine.llm_engine.build_rank_runner): handed in, so that
# this module does not import the engine that starts it.
RankBuilder = Callable[["EngineArgs", torch.device, TensorParallel], "ModelRunner"]

log = logging.getLogger(__name__)

JOIN_SECS = 10.0  # how long closing waits for a rank to exit before it is terminated
MAX_STAGED = 4  # prepared steps remembered until executed (the loop runs one at a time; the rest were abandoned)


@dataclass(frozen=True, slots=True)
class SeqState:
    """What ``ModelRunner.prepare`` reads of one scheduled sequence, sent to the other ranks."""

    seq_id: int
    # The tokens from the first uncached one on: all that prepare reads (a decode sends one token, not the whole
    # context). The cached ones before them are zeros on the other ranks; only rank 0's sampler would read them.
    tokens: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    block_table: list[int]
    draft_tokens: list[int]
    prompt_scored: int  # prompt tokens already given logprobs (prompt_logprobs of a preempted request)
    params: SamplingParams
    stream_index: int

    @classmethod
    def of(cls, seq: Sequence) -> SeqState:
        return cls(seq.seq_id, seq.token_ids[seq.num_cached_tokens :], seq.num_prompt_tokens, seq.num_cached_tokens,
                   list(seq.block_table), list(seq.draft_tokens), len(seq.prompt_logprobs), seq.params,
                   seq.stream_index)  # fmt: skip

    def sequence(self, block_size: int) -> Sequence:
        """A sequence equal to the scheduled one in everything ``prepare`` reads (no grammar: rank 0 samples)."""
        seq = Sequence(self.seq_id, [0] * self.num_prompt_tokens, self.params, block_size)
        seq.token_ids = [0] * self.num_cached_tokens + self.tokens
        seq.num_cached_tokens = self.num_cached_tokens
        seq.block_table = list(self.block_table)
        seq.draft_tokens = list(self.draft_tokens)
        seq.prompt_logprobs = [None] * self.prompt_scored  # type: ignore[list-item]  # only its length is read
        seq.stream_index = self.stream_index
        return seq


@dataclass(frozen=True, slots=True)
class StepOrder:
    """One step for the other ranks: ``prepare``'s arguments."""

    seqs: tuple[SeqState, ...]
    num_new_tokens: tuple[int, ...]
    num_decodes: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank``: the CPU for all, or the GPU ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class RankWorkers:
    """Rank 0's side: starts ranks 1..N-1, joins their group, sends them each step, stops them."""

    def __init__(self, args: EngineArgs, device: torch.device, build: RankBuilder) -> None:
        size = args.tensor_parallel_size
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise ValueError(f"--tensor-parallel-size {size} from {device}: torch sees {torch.cuda.device_count()} "
                             "GPU(s); ranks take consecutive GPUs")  # fmt: skip
        fd, self._store = tempfile.mkstemp(prefix="engine-tp-")  # the group's rendezvous file
        os.close(fd)
        os.unlink(self._store)  # the file store creates it; a stale one would hold a previous group's keys
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied threads, CUDA-safe
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(args, device, rank, self._store, theirs, build),
                               name=f"engine-tp-rank{rank}", daemon=True)  # fmt: skip
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._orders: dict[int, StepOrder] = {}
        self.caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        try:
            self.tp: TensorParallel = join_group(0, size, self._store, device, args.enable_expert_parallel)
        except BaseException:
            self.close()
            raise
        log.info("tensor_parallel_group size=%d expert_parallel=%s backend=%s", size, self.tp.expert_parallel,
                 "nccl" if device.type == "cuda" else "gloo")  # fmt: skip

    def collect_caches(self) -> None:
        """Receive every other rank's KV and indexer-key caches (after they allocated them)."""
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(COLLECTIVE_TIMEOUT.total_seconds()):
                raise RuntimeError(f"tensor-parallel rank {rank} did not hand over its KV cache in "
                                   f"{COLLECTIVE_TIMEOUT}")  # fmt: skip
            msg = conn.recv()
            if isinstance(msg, str):
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {msg}")
            self.caches.append(msg)

    def stage(self, step: object, seqs: Seq[Sequence], num_new_tokens: Seq[int], num_decodes: int) -> None:
        """Remember what ``step`` was prepared from (on the event-loop thread, while the sequences are as scheduled)."""
        while len(self._orders) >= MAX_STAGED:  # a step prepared but never executed (its step failed in between)
            del self._orders[next(iter(self._orders))]
        self._orders[id(step)] = StepOrder(tuple(SeqState.of(s) for s in seqs), tuple(num_new_tokens), num_decodes)

    def launch(self, step: object) -> None:
        """Send ``step`` to the other ranks, which run it while rank 0 does."""
        order = self._orders.pop(id(step))
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (status {proc.exitcode})")
            conn.send(order)

    def close(self) -> None:
        """Tell the other ranks to exit, wait for them (terminate the ones that do not), leave the group."""
        self.caches = []
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass  # that rank is gone already
        for proc in self._procs:
            proc.join(JOIN_SECS)
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_SECS)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        leave_group()
        if os.path.exists(self._store):
            os.unlink(self._store)


def rank_main(args: EngineArgs, device0: torch.device, rank: int, store: str, conn: Connection,
              build: RankBuilder) -> None:  # fmt: skip
    """A rank other than 0: build this rank's slice beside rank 0 (whose device is ``device0``), then run the steps
    it sends until told to stop (``None``) or until rank 0 is gone (the pipe closes)."""
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: "
                        "%(message)s")  # fmt: skip
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        device = rank_device(device0, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = join_group(rank, args.tensor_parallel_size, store, device, args.enable_expert_parallel)
        runner = build(args, device, tp)
        conn.send((runner.kv_caches, runner.indexer_caches))
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed to start", rank)
        conn.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc
    with torch.inference_mode():
        while True:
            try:
                order = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if order is None:
                break
            seqs = [s.sequence(args.block_size) for s in order.seqs]
            runner.execute(runner.prepare(seqs, order.num_new_tokens, order.num_decodes))
    leave_group()
