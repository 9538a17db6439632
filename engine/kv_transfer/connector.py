"""The push handshake (docs/kv_transfer.md): KVProducer (prefill side) and KVConsumer (decode side).

Prefill computes a request's KV, then ``producer.offer(block_ids, first_token_id, on_release)``
pins the blocks and returns the ``kv_transfer_params`` to put in the HTTP answer. Decode, given a
request with those params, allocates blocks and awaits ``consumer.pull(params, dst_block_ids)``:
it connects to prefill's handshake port and sends a ``write_request`` (see ``wire``); prefill
writes its blocks into decode's memory through the transfer agent and answers ``write_done``;
``pull`` returns once the nonce matches and the status is ok, and decode starts from
``first_token_id``.

Every offered transfer ends exactly once, with ``on_release(reason)`` called on the event loop:
WRITTEN, WRITE_FAILED, REFUSED (a request named it but did not match), EXPIRED (no decode came
within ``timeout_s``) or CLOSED (the producer shut down). A transfer id is single-use; a
second request for it is refused.

Both sides use one memory backend (chosen at start, see ``backend``): *direct* (no staging
buffer: prefill writes its cache blocks straight into decode's) or *staged* (a
``StagingBuffer`` on each side: prefill gathers chunks into its buffer, writes them into the two
slots decode leased, decode scatters each chunk and acknowledges it; see ``staging``). A request
whose backend differs from the producer's is refused (``backend_mismatch``).

Nothing is serialised across requests: every handshake connection is its own task on the
producer, the consumer lets ``max_inflight`` pulls talk to producers at once (more wait their turn,
within their timeout), the agent has several lanes per peer, a direct write keeps
``pipeline_depth`` batches in flight and a staged one gathers, writes and scatters its chunks in a
pipeline two slots deep.

Between engines of one host the KV need not cross a network transport (``ipc``): a producer
given a ``PoolExport`` answers ``ipc_open`` with its mapped-once pools and the port of its *read
desk*, and a consumer given ``IpcPeers`` pulls from a producer it could map by asking the desk with
``ipc_pool``: the desk claims the transfer (``ipc_read``: the blocks stay pinned, expiry cannot take
them), the consumer copies them itself and says ``ipc_done`` without waiting for an answer; the
release reasons and refusals are the push handshake's. The desk is a thread with its own event loop,
so a pull never waits for the prefill engine's loop (busy with its steps and streams); only the
release of the blocks goes back to that loop.

An *early offer* (``offer_early``) is made before its prefill runs: the engine then tells the producer
after each step which blocks are final (``progress``) and at the end the first token or the failure
(``conclude``). An ipc read of it is a series of rounds from the desk (``ipc_ready``), each naming the
blocks that became final, the last one carrying the first token; a Mooncake pull of it waits for the
end and is written whole, ``write_done`` carrying the first token. ``pull`` returns that token.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from engine.kv_transfer import wire
from engine.kv_transfer.agent import TransferAgent
from engine.kv_transfer.desk import Desk
from engine.kv_transfer.errors import KVTransferBusyError, KVTransferError
from engine.kv_transfer.ipc import IpcPeers, PoolExport, outlast
from engine.kv_transfer.layout import SKIP, Region, WriteOp, batches, check_compatible, pair_blocks, plan_writes, spans
from engine.kv_transfer.params import KVTransferParams, KVTransferParamsError
from engine.kv_transfer.staging import SLOTS_PER_TRANSFER, StagingBuffer, check_chunk, plan_chunks
from engine.kv_transfer.wire import MessageType, RefusalCode

log = logging.getLogger(__name__)
# A staged early offer waits for its prefill to end: this often it also looks whether the consumer hung up.
HANGUP_POLL_S = 0.05
ABANDON_TIMEOUT_S = 2.0  # a consumer's `abandon` of an early offer it gave up, sent and answered within this


class ReleaseReason(StrEnum):
    """Why the producer gave an offered transfer's blocks back."""

    WRITTEN = "written"
    WRITE_FAILED = "write_failed"
    REFUSED = "refused"
    EXPIRED = "expired"
    CLOSED = "closed"


class TransferState(Enum):
    PENDING = "pending"  # offered, waiting for decode's write request
    WRITING = "writing"  # a write request is being served
    DONE = "done"  # released; the id is consumed


_ALLOWED = {
    TransferState.PENDING: {TransferState.WRITING, TransferState.DONE},
    TransferState.WRITING: {TransferState.DONE},
    TransferState.DONE: set(),
}


def transition(current: TransferState, new: TransferState) -> TransferState:
    """The one place a transfer's state changes; refuses anything but PENDING -> WRITING -> DONE."""
    if new not in _ALLOWED[current]:
        raise RuntimeError(f"transfer state {current.value} -> {new.value} is not allowed")
    return new


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """Counters since start, for /metrics: transfers ended per reason, and bytes written."""

    pending: int
    released: dict[ReleaseReason, int]
    bytes_written: int


@dataclass(slots=True)
class PendingTransfer:
    """An offered transfer: the pinned source blocks and who to tell when they are free again."""

    transfer_id: str
    block_ids: tuple[int, ...]
    on_release: Callable[[ReleaseReason], None]
    timer: asyncio.TimerHandle | None = None
    state: TransferState = field(default=TransferState.PENDING)
    # An early offer (``offer_early``): its prefill runs while the consumer reads. ``block_ids`` are known
    # once it was admitted, ``ready`` leading ones are final, and ``final`` is set when it ends:
    # {"first_token_id": ...} or {"error": ...}. Every change wakes ``watchers`` (thread-safe callables).
    early: bool = False
    num_blocks: int = 0
    ready: int = 0
    final: dict[str, Any] | None = None
    watchers: list[Callable[[], None]] = field(default_factory=list)


class _Channel:
    """The producer's end of one handshake connection (a staged transfer talks over it while writing)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_timeout: float) -> None:
        self.reader = reader
        self.writer = writer
        self.read_timeout = read_timeout

    def wanted(self) -> bool:
        """False once the consumer hung up (it gave up: timed out or was cancelled)."""
        return not self.reader.at_eof()

    async def send(self, msg_type: MessageType, **fields: Any) -> None:
        await wire.send(self.writer, msg_type, **fields)

    async def recv(self) -> dict[str, Any]:
        async with asyncio.timeout(self.read_timeout):
            return await wire.recv(self.reader)


class KVProducer:
    """Prefill side: offers pinned blocks and writes them into a consumer's memory when asked.

    ``host`` is the address decode engines use to reach this engine (it goes into the params);
    the handshake server listens on ``bind_host:handshake_port`` (port 0: any free port, see
    ``port``). Use from one event loop: ``await start()``, ``offer(...)``, ``await close()``.
    """

    def __init__(
        self,
        agent: TransferAgent,
        regions: Sequence[Region],
        *,
        host: str,
        handshake_port: int,
        bind_host: str = "0.0.0.0",
        timeout_s: float = 30.0,
        max_pending: int = 1024,
        batch_entries: int = 512,
        request_read_timeout_s: float = 10.0,
        dp_rank: int = 0,
        staging: StagingBuffer | None = None,
        pipeline_depth: int = 2,
        tp_size: int = 1,
        ipc: PoolExport | None = None,
        ipc_only: bool = False,
    ) -> None:
        if pipeline_depth < 1:
            raise ValueError("pipeline_depth must be >= 1")
        self.tp_size = tp_size  # told to the consumer in the params: its regions are this many ranks' slices
        self._agent = agent
        self._staging = staging
        self._ipc = ipc
        self._ipc_only = ipc_only  # protocol ipc: refuse pulls that would go through Mooncake
        self.pipeline_depth = pipeline_depth
        self._regions = tuple(regions)
        self._host = host
        self._handshake_port = handshake_port
        self._bind_host = bind_host
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.batch_entries = batch_entries
        self._read_timeout = request_read_timeout_s
        self._dp_rank = dp_rank
        self._pending: dict[str, PendingTransfer] = {}
        # Recent ids (and why an early offer's prefill failed), for a clear refusal.
        self._consumed: OrderedDict[str, str] = OrderedDict()
        self._verified: OrderedDict[tuple[str, int, int], None] = OrderedDict()  # (peer, span) written once
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._port = handshake_port
        self._released = dict.fromkeys(ReleaseReason, 0)
        self._bytes_written = 0
        # The transfer table is shared with the ipc read desk's thread: every lookup and state change under it.
        self._lock = threading.Lock()
        self._desk: Desk | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        """The handshake port actually bound (differs from the one asked for when that was 0)."""
        return self._port

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def backend(self) -> str:
        """``"staged"`` with a staging buffer, else ``"direct"``."""
        return "direct" if self._staging is None else "staged"

    def stats(self) -> ProducerStats:
        return ProducerStats(len(self._pending), dict(self._released), self._bytes_written)

    @property
    def read_port(self) -> int:
        """The ipc read desk's port (0 without exported pools)."""
        return self._desk.port if self._desk is not None else 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._ipc is not None:
            self._desk = Desk(self._serve_read, self._bind_host)
            await asyncio.to_thread(self._desk.start)
        try:
            self._server = await asyncio.start_server(self._serve, self._bind_host, self._handshake_port)
        except OSError:
            if self._desk is not None:
                self._desk.close()
            raise
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("kv_producer_listening port=%d rpc=%s read_port=%d", self._port, self._agent.rpc_address,
                 self.read_port)  # fmt: skip

    def offer(
        self,
        block_ids: Sequence[int],
        first_token_id: int,
        on_release: Callable[[ReleaseReason], None],
        *,
        prefix_cache_hit_tokens: int = 0,
    ) -> KVTransferParams:
        """Pin ``block_ids`` for one decode engine to fetch; returns the params for the HTTP answer.

        ``on_release`` is called exactly once, on this event loop, when the blocks may be freed.
        Raises KVTransferBusyError when ``max_pending`` transfers are already waiting.
        """
        if self._server is None:
            raise KVTransferError("the KV producer is not running", reason="closed")
        if len(self._pending) >= self.max_pending:
            raise KVTransferBusyError(f"{len(self._pending)} KV transfers already pending", reason="busy")
        tid = uuid.uuid4().hex
        pending = PendingTransfer(tid, tuple(int(b) for b in block_ids), on_release)
        pending.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, tid)
        with self._lock:
            self._pending[tid] = pending
        rpc_port = int(self._agent.rpc_address.rsplit(":", 1)[1])
        return KVTransferParams(
            remote_block_ids=pending.block_ids,
            remote_engine_id=self._agent.rpc_address,
            remote_host=self._host,
            remote_port=rpc_port,
            remote_handshake_port=self._port,
            transfer_id=tid,
            first_token_id=int(first_token_id),
            prefix_cache_hit_tokens=int(prefix_cache_hit_tokens),
            tp_size=self.tp_size,
            dp_rank=self._dp_rank,
        )

    def offer_early(self, num_blocks: int, on_release: Callable[[ReleaseReason], None]) -> KVTransferParams:
        """Offer the KV of a prefill that has not run yet (``num_blocks`` blocks); returns its params.

        The engine then tells its progress (``progress``) and its end (``conclude``); a consumer reading
        over ipc copies each block once it is final, one pulling through Mooncake is written to once the
        prefill ended. ``on_release`` as for ``offer`` (the engine stops a prefill still running then).
        Unread, it expires ``timeout_s`` after its prefill ended (``conclude``), not after the offer: a queued or
        long prefill is not a consumer that failed to come (the engine ends the offer itself should the prefill
        never end, and answers the prefill leg once the prefill is admitted to a step).
        """
        if self._server is None:
            raise KVTransferError("the KV producer is not running", reason="closed")
        if len(self._pending) >= self.max_pending:
            raise KVTransferBusyError(f"{len(self._pending)} KV transfers already pending", reason="busy")
        tid = uuid.uuid4().hex
        pending = PendingTransfer(tid, (), on_release, early=True, num_blocks=int(num_blocks))  # no clock yet
        with self._lock:
            self._pending[tid] = pending
        rpc_port = int(self._agent.rpc_address.rsplit(":", 1)[1])
        return KVTransferParams(
            remote_block_ids=(),
            remote_engine_id=self._agent.rpc_address,
            remote_host=self._host,
            remote_port=rpc_port,
            remote_handshake_port=self._port,
            transfer_id=tid,
            first_token_id=None,
            tp_size=self.tp_size,
            dp_rank=self._dp_rank,
            early=True,
            num_blocks=int(num_blocks),
        )

    def progress(self, tid: str, block_ids: Sequence[int], ready: int) -> None:
        """An early offer's prefill ran a step: its blocks, of which the first ``ready`` are final."""
        self._advance(tid, tuple(int(b) for b in block_ids), ready, None)

    def conclude(self, tid: str, block_ids: Sequence[int] = (), first_token_id: int | None = None,
                 error: str | None = None) -> None:  # fmt: skip
        """An early offer's prefill ended: with its first token (every block final), or with ``error``.

        A failed one that no consumer claimed yet ends now (its blocks go back); a claimed one ends when
        its consumer heard of the failure."""
        final: dict[str, Any] = {"error": error} if error is not None else {"first_token_id": int(first_token_id or 0)}
        ids = tuple(int(b) for b in block_ids) if error is None else None
        pending = self._advance(tid, ids, len(ids) if ids is not None else None, final)
        if pending is not None:  # an early offer's clock starts once its prefill ended
            pending.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, tid)
        if pending is not None and error is not None:
            with self._lock:
                unclaimed = pending.state is TransferState.PENDING
                if unclaimed:
                    pending.state = transition(pending.state, TransferState.WRITING)
            if unclaimed:
                self._finish(pending, ReleaseReason.WRITE_FAILED, why=f"its prefill failed: {error}")

    def _advance(self, tid: str, block_ids: tuple[int, ...] | None, ready: int | None,
                 final: dict[str, Any] | None) -> PendingTransfer | None:  # fmt: skip
        with self._lock:
            pending = self._pending.get(tid)
            if pending is None or pending.final is not None:
                return None
            if block_ids is not None:
                pending.block_ids = block_ids
            if ready is not None:
                pending.ready = max(pending.ready, ready)
            pending.final = final
            watchers = list(pending.watchers)
        for wake in watchers:
            wake()
        return pending

    async def close(self) -> None:
        """Stop serving, cancel requests in flight, and release every pending transfer (CLOSED)."""
        server, self._server = self._server, None  # offer() refuses from now on
        if server is not None:
            server.close()
            await server.wait_closed()
        desk, self._desk = self._desk, None
        if desk is not None:
            await asyncio.to_thread(desk.close)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for pending in list(self._pending.values()):
            self._finish(pending, ReleaseReason.CLOSED)

    # -- internals --------------------------------------------------------------------------

    def _expire(self, tid: str) -> None:
        with self._lock:  # the read desk may be claiming it right now
            pending = self._pending.get(tid)
            if pending is None or pending.state is not TransferState.PENDING:
                return
            pending.state = transition(pending.state, TransferState.WRITING)
        log.warning("kv_transfer_expired transfer_id=%s blocks=%d", tid, len(pending.block_ids))
        self._finish(pending, ReleaseReason.EXPIRED)

    def _claim(self, pending: PendingTransfer) -> bool:
        """PENDING -> WRITING, once: from then on only this claimant ends the transfer (expiry cannot)."""
        with self._lock:
            if pending.state is not TransferState.PENDING:
                return False
            pending.state = transition(pending.state, TransferState.WRITING)
            return True

    def _finish(self, pending: PendingTransfer, reason: ReleaseReason, nbytes: int = 0, why: str = "") -> None:
        """End a transfer (on the engine's loop): its blocks go back through ``on_release``; a no-op once ended
        (close() may have ended it while the read desk's last word was on its way)."""
        with self._lock:
            if pending.state is TransferState.DONE:
                return
            pending.state = transition(pending.state, TransferState.DONE)
            del self._pending[pending.transfer_id]
            self._consumed[pending.transfer_id] = why
            while len(self._consumed) > 4 * self.max_pending:
                self._consumed.popitem(last=False)
        if pending.timer is not None:
            pending.timer.cancel()
        self._released[reason] += 1
        self._bytes_written += nbytes
        try:
            pending.on_release(reason)
        except Exception:  # the engine's callback must not break the handshake server
            log.exception("kv_release_callback_failed transfer_id=%s", pending.transfer_id)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with asyncio.timeout(self._read_timeout):
                msg = await wire.recv(reader)
            msg_type, fields = await self._handle(msg, _Channel(reader, writer, self._read_timeout))
            await wire.send(writer, msg_type, **fields)
        except (wire.WireError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            log.debug("kv_handshake_dropped error=%r", exc)
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, msg: dict[str, Any], channel: _Channel) -> tuple[MessageType, dict[str, Any]]:
        tid = msg.get("transfer_id")
        if msg.get("v") != wire.VERSION:
            return _refuse(tid, RefusalCode.BAD_VERSION, _version_mismatch(msg))
        if msg.get("type") == MessageType.IPC_OPEN:
            if self._ipc is None:
                why = "this prefill engine shares no KV pools (its protocol is forced to a Mooncake one)"
                return _refuse(tid, RefusalCode.IPC_UNAVAILABLE, why)
            return MessageType.IPC_POOLS, {**self._ipc.describe(), "read_port": self.read_port}
        if msg.get("type") == MessageType.ABANDON:
            return self._abandon(tid)
        if msg.get("type") != MessageType.WRITE_REQUEST:
            return _refuse(tid, RefusalCode.BAD_REQUEST, f"expected write_request, got {msg.get('type')!r}")
        try:
            rpc, nonce = msg["rpc"], msg["nonce"]
            dst_ids = [int(b) for b in msg["block_ids"]]
            dst_regions = [Region.from_wire(r) for r in msg["regions"]]
            if not isinstance(tid, str) or not isinstance(rpc, str) or not isinstance(nonce, str):
                raise TypeError("transfer_id, rpc and nonce must be strings")
            remote_slots = _slots_from_wire(msg["staging"]) if msg.get("staging") is not None else None
        except (KeyError, TypeError, ValueError) as exc:
            return _refuse(tid, RefusalCode.BAD_REQUEST, f"malformed write_request: {exc!r}")
        if msg.get("ipc_pool") is not None:
            why = f"ipc reads go to this producer's read desk (port {self.read_port}), not the handshake port"
            return _refuse(tid, RefusalCode.BAD_REQUEST, why)
        try:
            pending = self._take(tid)
        except _Refusal as refusal:
            return refusal.reply
        # From here the request names a live transfer, claimed: whatever happens consumes it.
        if self._ipc_only:
            self._finish(pending, ReleaseReason.REFUSED)
            return _refuse(tid, RefusalCode.IPC_UNAVAILABLE,
                           "this prefill engine's protocol is 'ipc': only decode engines on its host, mapping its "
                           "KV pools, can pull from it")  # fmt: skip
        if (remote_slots is None) != (self._staging is None):
            self._finish(pending, ReleaseReason.REFUSED)
            theirs = "direct" if remote_slots is None else "staged"
            return _refuse(tid, RefusalCode.BACKEND_MISMATCH,
                           f"this producer's KV memory backend is {self.backend}, the consumer's is {theirs}: "
                           "give both engines the same memory_backend")  # fmt: skip
        first_token: dict[str, Any] = {}
        if pending.early:  # written whole, once its prefill ended (chunk by chunk only over ipc: docs/pd.md)
            final = await self._until_final(pending, channel.wanted)
            if final is None:
                # The consumer gave up (its request was cancelled or timed out) while the prefill ran: release the
                # offer now, so that the engine stops the prefill (the answer goes nowhere).
                self._finish(pending, ReleaseReason.WRITE_FAILED)
                return _refuse(tid, RefusalCode.PREFILL_FAILED, f"transfer {tid}: the consumer hung up while its "
                               "prefill ran")  # fmt: skip
            if "error" in final:
                self._finish(pending, ReleaseReason.WRITE_FAILED)
                return _refuse(tid, RefusalCode.PREFILL_FAILED, f"transfer {tid}: its prefill failed: {final['error']}")
            first_token = {"first_token_id": final["first_token_id"]}
        try:
            src, dst = self._check_blocks(pending, dst_regions, dst_ids, self._finish)
        except _Refusal as refusal:
            return refusal.reply
        ops = plan_writes(self._regions, dst_regions, src, dst) if remote_slots is None else []
        if pending.timer is not None:
            pending.timer.cancel()
        nbytes = len(src) * sum(r.unit_bytes for r in self._regions)
        try:
            if remote_slots is None:
                await self._write(rpc, dst_regions, ops, channel.wanted)
            else:
                await self._write_staged(tid, rpc, remote_slots, src, channel)
        except Exception as exc:  # KVTransferError, or the agent closing under us: answer, never hang
            log.warning("kv_transfer_write_failed transfer_id=%s peer=%s error=%s", tid, rpc, exc)
            self._finish(pending, ReleaseReason.WRITE_FAILED)
            return MessageType.WRITE_DONE, {"transfer_id": tid, "nonce": nonce, "status": "error",
                                            "message": str(exc), "bytes": 0}  # fmt: skip
        except BaseException:
            self._finish(pending, ReleaseReason.WRITE_FAILED)
            raise
        self._finish(pending, ReleaseReason.WRITTEN, nbytes)
        return MessageType.WRITE_DONE, {"transfer_id": tid, "nonce": nonce, "status": "ok", "message": "",
                                        "bytes": nbytes, **first_token}  # fmt: skip

    @contextlib.contextmanager
    def _watch(self, pending: PendingTransfer) -> Iterator[asyncio.Event]:
        """An event set (from whichever thread moves it) each time ``pending`` moves; unregistered on exit."""
        moved = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:
            loop.call_soon_threadsafe(moved.set)

        with self._lock:
            pending.watchers.append(wake)
        try:
            yield moved
        finally:
            with self._lock:
                pending.watchers.remove(wake)

    async def _until_final(self, pending: PendingTransfer, wanted: Callable[[], bool]) -> dict[str, Any] | None:
        """An early offer's end, however long its prefill runs (it always ends: done, failed, stopped, or the
        engine died); None when the consumer hung up meanwhile (``wanted()`` false: looked at every
        ``HANGUP_POLL_S``), which bounds its own wait."""
        with self._watch(pending) as moved:
            while True:
                with self._lock:
                    moved.clear()
                    final = pending.final
                if final is not None:
                    return final
                if not wanted():
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(moved.wait(), HANGUP_POLL_S)

    def _abandon(self, tid: object) -> tuple[MessageType, dict[str, Any]]:
        """The consumer gave up an early offer before reading it: release it (REFUSED), so that the engine stops
        its prefill. An offer already claimed by a read is left to that read (it sees the hang-up itself)."""
        with self._lock:
            pending = self._pending.get(tid) if isinstance(tid, str) else None
        if pending is not None and pending.early and self._claim(pending):
            log.info("kv_transfer_abandoned transfer_id=%s: the consumer gave it up before reading", tid)
            self._finish(pending, ReleaseReason.REFUSED)
            return MessageType.ABANDONED, {"transfer_id": tid, "released": True}
        return MessageType.ABANDONED, {"transfer_id": tid, "released": False}

    def _take(self, tid: object) -> PendingTransfer:
        """Claim the transfer a request names (thread-safe); raises _Refusal when it is unknown or taken."""
        with self._lock:
            pending = self._pending.get(tid) if isinstance(tid, str) else None
            consumed = isinstance(tid, str) and tid in self._consumed
        if pending is None:
            why = self._consumed.get(tid, "") if consumed and isinstance(tid, str) else ""
            if why:
                raise _Refusal(tid, RefusalCode.PREFILL_FAILED, f"transfer {tid}: {why}")
            if consumed:
                raise _Refusal(tid, RefusalCode.TRANSFER_CONSUMED, f"transfer {tid} was already consumed or expired")
            raise _Refusal(tid, RefusalCode.UNKNOWN_TRANSFER, f"unknown transfer {tid}")
        if not self._claim(pending):
            raise _Refusal(tid, RefusalCode.TRANSFER_CONSUMED, f"transfer {tid} is already being written")
        return pending

    def _check_blocks(
        self,
        pending: PendingTransfer,
        dst_regions: Sequence[Region],
        dst_ids: Sequence[int],
        release: Callable[[PendingTransfer, ReleaseReason], None],
    ) -> tuple[list[int], list[int]]:
        """The block pairs of a claimed transfer; raises _Refusal having ended it (``release``, REFUSED)."""
        why = check_compatible(self._regions, dst_regions)
        if why:
            release(pending, ReleaseReason.REFUSED)
            raise _Refusal(pending.transfer_id, RefusalCode.REGION_MISMATCH, why)
        try:
            return pair_blocks(self._regions, dst_regions, pending.block_ids, dst_ids)
        except ValueError as exc:
            release(pending, ReleaseReason.REFUSED)
            raise _Refusal(pending.transfer_id, RefusalCode.BLOCK_MISMATCH, str(exc)) from None

    # -- the ipc read desk (its own thread and event loop: never the engine's) --------------------

    async def _serve_read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One ipc read: claim the transfer, say ``ipc_read``, wait for ``ipc_done`` (or the hang-up), release.

        Runs on the desk's thread: the release (and its callback into the engine) goes to the engine's loop.
        """
        try:
            async with asyncio.timeout(self._read_timeout):
                msg = await wire.recv(reader)
        except (wire.WireError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            log.debug("kv_read_dropped error=%r", exc)
            return
        try:
            pending, nbytes = self._claim_read(msg)
        except _Refusal as refusal:
            with contextlib.suppress(ConnectionError):
                await wire.send(writer, refusal.reply[0], **refusal.reply[1])
            return
        reason, nbytes_done = ReleaseReason.WRITE_FAILED, 0
        answer: asyncio.Future[dict[str, Any]] | None = None
        try:
            early = {"early": True} if pending.early else {}  # an early offer's rounds follow
            await wire.send(writer, MessageType.IPC_READ, transfer_id=pending.transfer_id, nonce=msg["nonce"], **early)
            answer = asyncio.ensure_future(wire.recv(reader))  # the consumer's last word (or its hang-up)
            if pending.early:
                # Until its prefill ended (it always does: done, failed, stopped, or the engine died) or the consumer
                # hung up; a prefill's length is not a consumer's silence (the consumer bounds the silence itself).
                await self._feed(pending, writer, answer)
                nbytes = len(pending.block_ids) * sum(r.unit_bytes for r in self._regions)
            async with asyncio.timeout(self.timeout_s):
                done = await answer
            if (done.get("type") == MessageType.IPC_DONE and done.get("transfer_id") == pending.transfer_id
                    and done.get("status") == "ok" and (pending.final or {}).get("error") is None):  # fmt: skip
                reason, nbytes_done = ReleaseReason.WRITTEN, nbytes
            else:
                log.warning("kv_transfer_write_failed transfer_id=%s reply=%.200r", pending.transfer_id, done)
        except (wire.WireError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            log.warning("kv_transfer_write_failed transfer_id=%s error=%r: the consumer hung up before it copied",
                        pending.transfer_id, exc)  # fmt: skip
        finally:
            if answer is not None and not answer.done():
                answer.cancel()
            elif answer is not None and not answer.cancelled():
                answer.exception()  # retrieved: a hang-up before the end was handled above
            self._release_from_desk(pending, reason, nbytes_done)

    async def _feed(self, pending: PendingTransfer, writer: asyncio.StreamWriter,
                    answer: asyncio.Future[dict[str, Any]]) -> None:  # fmt: skip
        """An early offer's rounds: each time more of its blocks are final, say which (``ipc_ready``); the last
        round carries the prefill's end. Returns after it; raises ConnectionError when the consumer hung up
        (or spoke) before (the caller releases the transfer, and the engine stops its prefill)."""
        sent = 0
        with self._watch(pending) as moved:
            while True:
                with self._lock:
                    moved.clear()
                    ids, ready, final = pending.block_ids, pending.ready, pending.final
                if final is not None or ready > sent:
                    if final is None:
                        upto = ready  # the blocks final so far
                    elif "error" in final:
                        upto = sent  # a failed prefill: nothing more to copy
                    else:
                        upto = len(ids)  # the prefill ended: the rest, the last partial block included
                    await wire.send(writer, MessageType.IPC_READY, transfer_id=pending.transfer_id, start=sent,
                                    block_ids=list(ids[sent:upto]), final=final)  # fmt: skip
                    sent = upto
                    if final is not None:
                        return
                waiter: asyncio.Future[Any] = asyncio.ensure_future(moved.wait())
                await asyncio.wait([waiter, answer], return_when=asyncio.FIRST_COMPLETED)
                if answer.done():
                    waiter.cancel()
                    raise ConnectionResetError("the consumer hung up (or gave up) while the prefill ran")

    def _claim_read(self, msg: dict[str, Any]) -> tuple[PendingTransfer, int]:
        """The transfer an ipc read request names, claimed, and its size; raises _Refusal."""
        tid = msg.get("transfer_id")
        if msg.get("v") != wire.VERSION:
            raise _Refusal(
                tid, RefusalCode.BAD_VERSION, f"wire version {msg.get('v')!r} (this producer speaks {wire.VERSION})"
            )
        try:
            if msg.get("type") != MessageType.WRITE_REQUEST:
                raise TypeError(f"expected write_request, got {msg.get('type')!r}")
            nonce, ipc_pool = msg["nonce"], msg["ipc_pool"]
            dst_ids = [int(b) for b in msg["block_ids"]]
            dst_regions = [Region.from_wire(r) for r in msg["regions"]]
            if not isinstance(tid, str) or not isinstance(nonce, str) or not isinstance(ipc_pool, str):
                raise TypeError("transfer_id, nonce and ipc_pool must be strings")
        except (KeyError, TypeError, ValueError) as exc:
            raise _Refusal(tid, RefusalCode.BAD_REQUEST, f"malformed ipc read: {exc!r}") from None
        if self._ipc is None or ipc_pool != self._ipc.pool_id:
            # Not consumed: the consumer maps the pools again (the producer restarted) and asks again.
            raise _Refusal(
                tid, RefusalCode.IPC_STALE, f"ipc pool {ipc_pool} is not this producer's: map its pools again"
            )
        pending = self._take(tid)
        if pending.early:  # its blocks are paired round by round, as they become final
            why = check_compatible(self._regions, dst_regions)
            if why or len(dst_ids) != pending.num_blocks:
                self._release_from_desk(pending, ReleaseReason.REFUSED)
                code = RefusalCode.REGION_MISMATCH if why else RefusalCode.BLOCK_MISMATCH
                raise _Refusal(tid, code, why or f"{len(dst_ids)} destination blocks for {pending.num_blocks}")
            return pending, 0
        src, _ = self._check_blocks(pending, dst_regions, dst_ids, self._release_from_desk)
        return pending, len(src) * sum(r.unit_bytes for r in self._regions)

    def _release_from_desk(self, pending: PendingTransfer, reason: ReleaseReason, nbytes: int = 0) -> None:
        """End a transfer the desk claimed: on the engine's loop, where its blocks' owner lives."""
        loop = self._loop
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # the engine's loop is closed: the engine is gone
            loop.call_soon_threadsafe(self._finish, pending, reason, nbytes)

    async def _write(
        self, peer: str, dst_regions: Sequence[Region], ops: Sequence[WriteOp], wanted: Callable[[], bool]
    ) -> None:
        """Write ``ops``; the first write into each destination span not yet seen for ``peer`` goes alone.

        Before each batch, ``wanted()`` says whether the consumer is still there; once it hung up
        (timed out) the rest is abandoned, so at most one batch lands after the consumer gave up.

        A batch the peer rejects wedges Mooncake's lane to it for up to MC_TRANSFER_TIMEOUT, a single
        rejected write does not: so a consumer announcing memory it did not register costs one
        failed write, and batches only ever target memory that already took a write.
        """
        span_list = spans(dst_regions)
        starts = [start for start, _ in span_list]
        todo = {i for i, (start, end) in enumerate(span_list) if (peer, start, end) not in self._verified}
        probes: dict[int, WriteOp] = {}  # op index -> op: the first op into each unverified span
        new_spans: list[tuple[str, int, int]] = []
        for i, op in enumerate(ops):
            if not todo:
                break
            k = bisect.bisect_right(starts, op.dst) - 1
            if k in todo:
                todo.discard(k)
                probes[i] = op
                new_spans.append((peer, *span_list[k]))
        rest = [op for i, op in enumerate(ops) if i not in probes]
        for probe in probes.values():
            if not wanted():
                raise KVTransferError("the consumer hung up; write abandoned", reason="abandoned")
            await self._agent.write(peer, [probe])
        await self._pipeline(peer, batches(rest, self.batch_entries), wanted)
        for key in new_spans:
            self._verified[key] = None
        while len(self._verified) > 4096:
            self._verified.popitem(last=False)

    async def _pipeline(self, peer: str, todo: Iterable[Sequence[WriteOp]], wanted: Callable[[], bool]) -> None:
        """Write the batches with up to ``pipeline_depth`` of them in flight (on the agent's lanes).

        Returns (or raises the first failure) only once no write of this transfer is running: the
        consumer is told the outcome only when nothing more can land in its blocks.
        """
        running: set[asyncio.Future[None]] = set()
        try:
            for batch in todo:
                while len(running) >= self.pipeline_depth:
                    done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    _reap(done)  # the first failure stops the rest
                if not wanted():
                    raise KVTransferError("the consumer hung up; write abandoned", reason="abandoned")
                running.add(asyncio.ensure_future(self._agent.write(peer, batch)))
            while running:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                _reap(done)
        finally:
            if running:
                await asyncio.wait(running)
                for fut in running:  # retrieved: their errors are the first failure's consequences
                    if not fut.cancelled():
                        fut.exception()

    async def _write_staged(
        self, tid: str, peer: str, remote_slots: Sequence[tuple[int, int]], src: Sequence[int], channel: _Channel
    ) -> None:
        """Move ``src`` blocks of every region through the staging buffers, chunk by chunk.

        Gathers chunk ``c + 1`` into one local slot while Mooncake writes chunk ``c`` from the other
        into the consumer's slot ``c % 2``; before reusing a consumer slot, waits for its ack (the
        consumer scattered what it held). Once the consumer hung up the rest is abandoned.
        """
        staging = self._staging
        assert staging is not None
        chunk_bytes = min(staging.slot_bytes, *(size for _, size in remote_slots))
        chunks = plan_chunks(staging.unit_bytes, len(src), chunk_bytes)
        if not chunks:
            return
        local = await staging.pool.acquire(SLOTS_PER_TRANSFER)
        gathering: asyncio.Future[Any] | None = None
        try:
            ids = await staging.run(staging.index, src)
            gathering = asyncio.ensure_future(staging.run(staging.gather, chunks[0], local[0], ids))
            acked = 0
            for c, chunk in enumerate(chunks):
                assert gathering is not None  # chunk c's gather, started in the previous round
                await gathering
                gathering = None
                if c + 1 < len(chunks):  # its local slot's last write (chunk c - 1) has finished
                    nxt = chunks[c + 1]
                    gathering = asyncio.ensure_future(staging.run(staging.gather, nxt, local[(c + 1) % 2], ids))
                while acked < c - 1:  # the consumer's slot c % 2 held chunk c - 2
                    await self._expect_ack(channel, tid, acked)
                    acked += 1
                if not channel.wanted():
                    raise KVTransferError("the consumer hung up; write abandoned", reason="abandoned")
                slot = c % 2
                await self._agent.write(peer, [WriteOp(staging.slot_address(local[slot]), remote_slots[slot][0],
                                                       chunk.nbytes)])  # fmt: skip
                await channel.send(MessageType.CHUNK, transfer_id=tid, seq=c, slot=slot,
                                   pieces=[p.to_wire() for p in chunk.pieces])  # fmt: skip
            while acked < len(chunks):
                await self._expect_ack(channel, tid, acked)
                acked += 1
        finally:
            if gathering is not None:  # never hand a slot back while a copy still fills it
                await asyncio.wait([gathering])
            staging.pool.release(local)

    @staticmethod
    async def _expect_ack(channel: _Channel, tid: str, seq: int) -> None:
        try:
            msg = await channel.recv()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, wire.WireError) as exc:
            raise KVTransferError(f"the consumer hung up before acknowledging chunk {seq}: {exc!r}",
                                  reason="abandoned") from exc  # fmt: skip
        if msg.get("type") != MessageType.CHUNK_ACK or msg.get("seq") != seq or msg.get("transfer_id") != tid:
            raise KVTransferError(f"expected chunk_ack {seq} for {tid}, got {msg!r:.200}", reason="bad_reply")


def _refuse(tid: object, code: RefusalCode, message: str) -> tuple[MessageType, dict[str, Any]]:
    log.warning("kv_transfer_refused transfer_id=%s code=%s reason=%s", tid, code, message)
    return MessageType.ERROR, {"transfer_id": tid, "code": str(code), "message": message}


def _version_mismatch(msg: dict[str, Any]) -> str:
    return f"wire version {msg.get('v')!r} (this producer speaks {wire.VERSION})"


class _Refusal(Exception):
    """A request the producer refuses; ``reply`` is the ``error`` message to answer with."""

    def __init__(self, tid: object, code: RefusalCode, message: str) -> None:
        super().__init__(message)
        self.reply = _refuse(tid, code, message)


def _reap(done: set[asyncio.Future[None]]) -> None:
    """Raise the first failure among finished writes (every one's outcome retrieved, none left unseen)."""
    errors = [fut.exception() for fut in done if not fut.cancelled()]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _slots_from_wire(raw: object) -> list[tuple[int, int]]:
    """A staged write request's two consumer slots, ``[[address, bytes], [address, bytes]]``."""
    if not (isinstance(raw, list | tuple) and len(raw) == SLOTS_PER_TRANSFER):
        raise ValueError(f"staging must list {SLOTS_PER_TRANSFER} slots, got {raw!r:.200}")
    slots = []
    for item in raw:
        if not (isinstance(item, list | tuple) and len(item) == 2 and all(type(x) is int and x > 0 for x in item)):
            raise ValueError(f"a staging slot is [address, bytes], got {item!r}")
        slots.append((item[0], item[1]))
    return slots


class KVConsumer:
    """Decode side: asks a producer to push a request's blocks into this engine's regions.

    With a ``staging`` buffer (the staged backend) each pull leases two of its slots, the producer
    writes chunks into them and this side scatters each chunk into ``dst_block_ids`` itself; a
    failed pull then never leaves a late write in the destination blocks (only the slots are held
    back for ``slot_grace_s``, when the producer may still be writing into them).
    """

    def __init__(
        self,
        agent: TransferAgent,
        regions: Sequence[Region],
        *,
        timeout_s: float = 60.0,
        staging: StagingBuffer | None = None,
        slot_grace_s: float = 30.0,
        max_inflight: int = 8,
        tp_size: int = 1,
        ipc: IpcPeers | None = None,
    ) -> None:
        self.tp_size = tp_size  # this engine's tensor-parallel size; a producer's must equal it
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if staging is not None and staging.slots < SLOTS_PER_TRANSFER * max_inflight:
            log.warning(
                "kv_consumer_slots_short slots=%d max_inflight=%d: pulls will wait for staging slots",
                staging.slots,
                max_inflight,
            )
        self._agent = agent
        self._regions = tuple(regions)
        self.timeout_s = timeout_s
        self._staging = staging
        self._ipc = ipc
        self.slot_grace_s = slot_grace_s
        self.max_inflight = max_inflight
        self._gate = asyncio.Semaphore(max_inflight)
        self._in_flight = 0
        self._waiting = 0
        self._abandons: set[asyncio.Task[None]] = set()  # `abandon` messages on their way (a cancelled pull's)

    @property
    def in_flight(self) -> int:
        """Pulls talking to a producer now (at most ``max_inflight``)."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Pulls waiting for one of the ``max_inflight`` places."""
        return self._waiting

    @property
    def backend(self) -> str:
        return "direct" if self._staging is None else "staged"

    async def pull(self, params: KVTransferParams | Mapping[str, Any], dst_block_ids: Sequence[int],
                   after: concurrent.futures.Future[Any] | None = None) -> int | None:  # fmt: skip
        """Return once the producer wrote ``params.remote_block_ids`` into ``dst_block_ids`` (same order).

        Returns the first token the producer sent with the KV (an early offer's, whose params had none), else None.

        A destination id of ``layout.SKIP`` (-1) skips that block (decode already holds it). At most
        ``max_inflight`` pulls run at once; the others wait, and the wait counts against ``timeout_s``.
        ``after``: the engine's step in flight when ``dst_block_ids`` were handed out (blocks an abort
        freed during a step may still be written by it); nothing lands in them before it ended.

        Raises KVTransferParamsError on bad params, KVTransferError on refusal, unreachable
        producer, timeout, failed write or a reply that does not match the request; a CancelledError
        is re-raised as it came (``dst_may_be_written_if_cancelled`` says whether a late write may follow).
        """
        p = params if isinstance(params, KVTransferParams) else KVTransferParams.from_dict(params)
        try:
            return await self._pull(p, dst_block_ids, after)
        except asyncio.CancelledError:
            self.abandon(p)  # the producer may never have heard of us (the pull waited its turn)
            raise

    def dst_may_be_written_if_cancelled(self, p: KVTransferParams) -> bool:
        """Whether a pull of ``p`` that was cancelled may still see the producer write into its destination
        blocks after the CancelledError reached the caller (who should then hold them back until the producer's
        write deadline passed, as for a KVTransferError's ``dst_may_be_written``), rather than leave nothing to
        land (they can be reused at once). Per path:

        - staged: no. The producer writes only into the two staging slots the pull announced (``_pull`` holds
          them back itself); the blocks are written by this side's scatter from a slot, which a cancelled pull
          waits for (``_copy``).
        - ipc: no. This side copies from the producer's mapped pools in a reader thread, which a cancelled pull
          waits for (``IpcPeers.read``); the producer writes nothing.
        - direct Mooncake: yes. The producer writes straight into the blocks, and a cancelled pull can neither
          stop nor wait for that write. Conservatively also before the write request went out, and for a
          producer not yet known to be on the ipc path (cancelled while first contacting it).
        """
        if self._staging is not None:
            return False
        return self._ipc is None or not self._ipc.copies_from(p.remote_host, p.remote_handshake_port)

    def abandon(self, p: KVTransferParams) -> None:
        """Tell the producer of an early offer this engine gives up before reading it (cancelled, or refused
        before its pull), so that it stops the prefill rather than run it to the end and let it expire. Best
        effort, in the background; nothing for an offer that is not early."""
        if p.early:
            task = asyncio.get_running_loop().create_task(self._abandon_offer(p))
            self._abandons.add(task)
            task.add_done_callback(self._abandons.discard)

    async def _abandon_offer(self, p: KVTransferParams) -> None:
        """Say ``abandon`` for an early offer this engine gave up (best effort, within ABANDON_TIMEOUT_S)."""
        try:
            async with asyncio.timeout(ABANDON_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(p.remote_host, p.remote_handshake_port)
                try:
                    await wire.send(writer, MessageType.ABANDON, transfer_id=p.transfer_id)
                    await wire.recv(reader)
                finally:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
        except (OSError, TimeoutError, wire.WireError, asyncio.IncompleteReadError) as exc:
            log.info("kv_transfer_abandon_unsent transfer_id=%s error=%r (the offer expires on its own)",
                     p.transfer_id, exc)  # fmt: skip

    async def _pull(self, p: KVTransferParams, dst_block_ids: Sequence[int],
                    after: concurrent.futures.Future[Any] | None) -> int | None:  # fmt: skip
        if p.tp_size != self.tp_size:
            # Rank r's regions hold KV heads [r * H / tp, (r + 1) * H / tp): only equal sizes pair rank to rank.
            raise KVTransferParamsError(
                f"kv_transfer_params: the prefill engine runs tensor-parallel size {p.tp_size}, this decode engine "
                f"{self.tp_size}; unequal tensor parallelism between prefill and decode is not supported (each "
                "decode rank takes its KV heads from the prefill rank of the same index)",
                reason="tp_mismatch",
            )
        if len(dst_block_ids) != p.blocks:
            raise KVTransferError(
                f"{len(dst_block_ids)} destination blocks for {p.blocks} remote blocks", reason="block_mismatch"
            )
        if self._ipc is not None:
            final = await self._pull_ipc(p, dst_block_ids, after)
            if final is not None:
                token = final.get("first_token_id")
                return token if isinstance(token, int) and p.early else None
        if after is not None:
            settled = asyncio.wrap_future(after)
            await asyncio.wait([settled])
            if not settled.cancelled():
                settled.exception()  # the step's own failure is its requests' business, not this pull's
        staged = self._staging is not None
        nonce = secrets.token_hex(16)
        sent = False
        slots: list[int] = []
        late_writes = True  # until the producer answered, it may still write into what we announced
        where = f"{p.remote_host}:{p.remote_handshake_port}"
        try:
            async with asyncio.timeout(self.timeout_s), self._place():
                if self._staging is not None:
                    slots = await self._staging.pool.acquire(SLOTS_PER_TRANSFER)
                try:
                    reader, writer = await asyncio.open_connection(p.remote_host, p.remote_handshake_port)
                except OSError as exc:
                    raise KVTransferError(f"KV producer {where} unreachable: {exc}", reason="unreachable") from exc
                try:
                    fields: dict[str, Any] = {
                        "transfer_id": p.transfer_id,
                        "rpc": self._agent.rpc_address,
                        "block_ids": [int(b) for b in dst_block_ids],  # numpy ints do not pack
                        "regions": [r.to_wire() for r in self._regions],
                        "nonce": nonce,
                    }
                    if self._staging is not None:
                        fields["staging"] = [[self._staging.slot_address(s), self._staging.slot_bytes] for s in slots]
                    await wire.send(writer, MessageType.WRITE_REQUEST, **fields)
                    sent = True
                    reply = await wire.recv(reader)
                    if self._staging is not None:
                        reply = await self._receive_chunks(reply, reader, writer, p.transfer_id, slots, dst_block_ids)
                    late_writes = False
                finally:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
        except TimeoutError as exc:
            raise KVTransferError(
                f"KV transfer {p.transfer_id} from {where} timed out after {self.timeout_s:g} s",
                reason="timeout",
                dst_may_be_written=sent and not staged,
            ) from exc
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as exc:
            raise KVTransferError(
                f"KV producer {where} dropped transfer {p.transfer_id}: {exc!r}",
                reason="connection_lost",
                dst_may_be_written=sent and not staged,
            ) from exc
        finally:
            if self._staging is not None and slots:
                self._staging.pool.release(slots, self.slot_grace_s if sent and late_writes else 0.0)
        _check_reply(reply, p.transfer_id, nonce, where, dst_may_be_written=not staged)
        if not p.early:
            return None
        token = reply.get("first_token_id")
        if not isinstance(token, int):
            raise KVTransferError(f"KV producer {where} ended early offer {p.transfer_id} without its first token",
                                  reason="bad_reply")  # fmt: skip
        return token

    async def _pull_ipc(self, p: KVTransferParams, dst_block_ids: Sequence[int],
                        after: concurrent.futures.Future[Any] | None) -> dict[str, Any] | None:  # fmt: skip
        """Pull by copying from the producer's mapped pools; returns the producer's last word (an early
        offer's carries its first token), or None when this producer needs Mooncake.

        The copy has finished whenever this returns or raises (a cancelled pull waits for it), so a
        failure never leaves a late write in ``dst_block_ids``.
        """
        ipc = self._ipc
        assert ipc is not None
        where = f"{p.remote_host}:{p.remote_handshake_port}"
        pairs = [] if p.early else [(s, int(d)) for s, d in zip(p.remote_block_ids, dst_block_ids, strict=True)
                                    if d != SKIP]  # fmt: skip
        for attempt in range(2):  # a second time only when the producer restarted under the same address
            nonce = secrets.token_hex(16)
            deadline = time.monotonic() + self.timeout_s
            try:
                async with asyncio.timeout(self.timeout_s) as within:
                    pools = await ipc.pools_for(p.remote_host, p.remote_handshake_port)
                    if pools is None:
                        return None
                    request = {"transfer_id": p.transfer_id, "rpc": self._agent.rpc_address,
                               "block_ids": [int(b) for b in dst_block_ids],
                               "regions": [r.to_wire() for r in self._regions], "nonce": nonce,
                               "ipc_pool": pools.pool_id}  # fmt: skip
                    async with self._place():
                        if p.early:  # paired round by round, as the producer's blocks become final
                            within.reschedule(None)  # the read renews its deadline on every round
                            reply = await ipc.read(pools, p.remote_host, request, None,
                                                   [int(d) for d in dst_block_ids], deadline, after,
                                                   renew_s=self.timeout_s)  # fmt: skip
                        else:
                            reply = await ipc.read(pools, p.remote_host, request, [s for s, _ in pairs],
                                                   [d for _, d in pairs], deadline, after)  # fmt: skip
            except TimeoutError as exc:
                raise KVTransferError(f"KV transfer {p.transfer_id} from {where} timed out after {self.timeout_s:g} s",
                                      reason="timeout") from exc  # fmt: skip
            except ConnectionRefusedError as exc:
                ipc.forget(p.remote_host, p.remote_handshake_port)  # its read desk is gone: restarted, or dead
                if attempt == 0:
                    continue  # ipc_open again: a restarted producer answers, a dead one is unreachable
                raise KVTransferError(f"KV producer {where} unreachable: {exc}", reason="unreachable") from exc
            except (OSError, wire.WireError) as exc:
                ipc.forget(p.remote_host, p.remote_handshake_port)  # it may be gone: drop the mapping
                raise KVTransferError(f"KV producer {where} dropped transfer {p.transfer_id}: {exc!r}",
                                      reason="connection_lost") from exc  # fmt: skip
            if reply.get("type") == MessageType.ERROR and reply.get("code") == RefusalCode.IPC_STALE and attempt == 0:
                ipc.forget(p.remote_host, p.remote_handshake_port)
                continue
            if reply.get("type") == MessageType.ERROR:
                code = str(reply.get("code", "error"))
                raise KVTransferError(f"KV producer {where} refused transfer {p.transfer_id}: {code}: "
                                      f"{reply.get('message', '')}", reason=code)  # fmt: skip
            return reply
        raise AssertionError("unreachable: the second attempt returns or raises")

    @contextlib.asynccontextmanager
    async def _place(self) -> AsyncIterator[None]:
        """One of the ``max_inflight`` places (waiting counts against the pull's timeout)."""
        self._waiting += 1
        try:
            await self._gate.acquire()
        finally:
            self._waiting -= 1
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            self._gate.release()

    async def _receive_chunks(
        self,
        msg: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        tid: str,
        slots: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> dict[str, Any]:
        """Scatter each chunk the producer announces, acknowledge it; returns the producer's final message."""
        staging = self._staging
        assert staging is not None
        dst = [int(b) for b in dst_block_ids if b != SKIP]
        ids: Any = None
        while msg.get("type") == MessageType.CHUNK:
            seq, slot = msg.get("seq"), msg.get("slot")
            try:
                if msg.get("transfer_id") != tid or type(seq) is not int or slot not in (0, 1):
                    raise ValueError(f"chunk header {seq!r}/{slot!r} for {msg.get('transfer_id')!r}")
                chunk = check_chunk(msg.get("pieces"), staging.unit_bytes, len(dst), staging.slot_bytes)
            except ValueError as exc:
                raise KVTransferError(f"KV producer sent a bad chunk for {tid}: {exc}", reason="bad_reply") from exc
            if ids is None:
                ids = await _copy(staging, staging.index, dst)
            await _copy(staging, staging.scatter, chunk, slots[slot], ids)
            await wire.send(writer, MessageType.CHUNK_ACK, transfer_id=tid, seq=seq)
            msg = await wire.recv(reader)
        return msg


async def _copy(staging: StagingBuffer, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a staging copy; if we are cancelled meanwhile, wait for it (it may be writing our blocks)."""
    fut = asyncio.ensure_future(staging.run(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await outlast(fut)
        raise


def _check_reply(reply: dict[str, Any], tid: str, nonce: str, where: str, *, dst_may_be_written: bool = True) -> None:
    kind = reply.get("type")
    if kind == MessageType.ERROR:
        code = str(reply.get("code", "error"))
        raise KVTransferError(
            f"KV producer {where} refused transfer {tid}: {code}: {reply.get('message', '')}", reason=code
        )
    if kind != MessageType.WRITE_DONE:
        raise KVTransferError(
            f"KV producer {where} sent {kind!r} for transfer {tid}",
            reason="bad_reply",
            dst_may_be_written=dst_may_be_written,
        )
    if reply.get("nonce") != nonce or reply.get("transfer_id") != tid:
        raise KVTransferError(
            f"KV producer {where} answered transfer {tid} with a mismatched nonce or transfer id",
            reason="nonce_mismatch",
            dst_may_be_written=dst_may_be_written,
        )
    if reply.get("status") != "ok":
        raise KVTransferError(
            f"KV write for transfer {tid} failed at {where}: {reply.get('message', '')}", reason="write_failed"
        )
