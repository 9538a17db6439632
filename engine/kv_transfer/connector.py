"""The push handshake of PROTOCOLS.md §4: KVProducer (prefill side) and KVConsumer (decode side).

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
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from engine.kv_transfer import wire
from engine.kv_transfer.agent import TransferAgent
from engine.kv_transfer.errors import KVTransferBusyError, KVTransferError
from engine.kv_transfer.layout import Region, WriteOp, batches, check_compatible, plan_writes, spans
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.wire import MessageType, RefusalCode

log = logging.getLogger(__name__)


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
    ) -> None:
        self._agent = agent
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
        self._consumed: OrderedDict[str, None] = OrderedDict()  # recent ids, for a clear refusal
        self._verified: OrderedDict[tuple[str, int, int], None] = OrderedDict()  # (peer, span) written once
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._port = handshake_port
        self._released = dict.fromkeys(ReleaseReason, 0)
        self._bytes_written = 0

    @property
    def port(self) -> int:
        """The handshake port actually bound (differs from the one asked for when that was 0)."""
        return self._port

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def stats(self) -> ProducerStats:
        return ProducerStats(len(self._pending), dict(self._released), self._bytes_written)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._bind_host, self._handshake_port)
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("kv_producer_listening port=%d rpc=%s", self._port, self._agent.rpc_address)

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
            dp_rank=self._dp_rank,
        )

    async def close(self) -> None:
        """Stop serving, cancel requests in flight, and release every pending transfer (CLOSED)."""
        server, self._server = self._server, None  # offer() refuses from now on
        if server is not None:
            server.close()
            await server.wait_closed()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for pending in list(self._pending.values()):
            self._finish(pending, ReleaseReason.CLOSED)

    # -- internals --------------------------------------------------------------------------

    def _expire(self, tid: str) -> None:
        pending = self._pending.get(tid)
        if pending is not None and pending.state is TransferState.PENDING:
            log.warning("kv_transfer_expired transfer_id=%s blocks=%d", tid, len(pending.block_ids))
            self._finish(pending, ReleaseReason.EXPIRED)

    def _finish(self, pending: PendingTransfer, reason: ReleaseReason) -> None:
        pending.state = transition(pending.state, TransferState.DONE)
        if pending.timer is not None:
            pending.timer.cancel()
        del self._pending[pending.transfer_id]
        self._consumed[pending.transfer_id] = None
        self._released[reason] += 1
        while len(self._consumed) > 4 * self.max_pending:
            self._consumed.popitem(last=False)
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
            msg_type, fields = await self._handle(msg, wanted=lambda: not reader.at_eof())
            await wire.send(writer, msg_type, **fields)
        except (wire.WireError, asyncio.IncompleteReadError, TimeoutError, ConnectionError) as exc:
            log.debug("kv_handshake_dropped error=%r", exc)
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(
        self, msg: dict[str, Any], wanted: Callable[[], bool] = lambda: True
    ) -> tuple[MessageType, dict[str, Any]]:
        tid = msg.get("transfer_id")

        def refuse(code: RefusalCode, message: str) -> tuple[MessageType, dict[str, Any]]:
            log.warning("kv_transfer_refused transfer_id=%s code=%s reason=%s", tid, code, message)
            return MessageType.ERROR, {"transfer_id": tid, "code": str(code), "message": message}

        if msg.get("v") != wire.VERSION:
            return refuse(
                RefusalCode.BAD_VERSION, f"wire version {msg.get('v')!r} (this producer speaks {wire.VERSION})"
            )
        if msg.get("type") != MessageType.WRITE_REQUEST:
            return refuse(RefusalCode.BAD_REQUEST, f"expected write_request, got {msg.get('type')!r}")
        try:
            rpc, nonce = msg["rpc"], msg["nonce"]
            dst_ids = [int(b) for b in msg["block_ids"]]
            dst_regions = [Region.from_wire(r) for r in msg["regions"]]
            if not isinstance(tid, str) or not isinstance(rpc, str) or not isinstance(nonce, str):
                raise TypeError("transfer_id, rpc and nonce must be strings")
        except (KeyError, TypeError, ValueError) as exc:
            return refuse(RefusalCode.BAD_REQUEST, f"malformed write_request: {exc!r}")
        pending = self._pending.get(tid)
        if pending is None:
            if tid in self._consumed:
                return refuse(RefusalCode.TRANSFER_CONSUMED, f"transfer {tid} was already consumed or expired")
            return refuse(RefusalCode.UNKNOWN_TRANSFER, f"unknown transfer {tid}")
        if pending.state is not TransferState.PENDING:
            return refuse(RefusalCode.TRANSFER_CONSUMED, f"transfer {tid} is already being written")
        # From here the request names a live transfer: whatever happens consumes it.
        why = check_compatible(self._regions, dst_regions)
        if why:
            self._finish(pending, ReleaseReason.REFUSED)
            return refuse(RefusalCode.REGION_MISMATCH, why)
        try:
            ops = plan_writes(self._regions, dst_regions, pending.block_ids, dst_ids)
        except ValueError as exc:
            self._finish(pending, ReleaseReason.REFUSED)
            return refuse(RefusalCode.BLOCK_MISMATCH, str(exc))
        pending.state = transition(pending.state, TransferState.WRITING)
        if pending.timer is not None:
            pending.timer.cancel()
        nbytes = sum(op.nbytes for op in ops)
        reason = ReleaseReason.WRITE_FAILED
        try:
            await self._write(rpc, dst_regions, ops, wanted)
            reason = ReleaseReason.WRITTEN
            self._bytes_written += nbytes
            return MessageType.WRITE_DONE, {
                "transfer_id": tid,
                "nonce": nonce,
                "status": "ok",
                "message": "",
                "bytes": nbytes,
            }
        except Exception as exc:  # KVTransferError, or the agent closing under us: answer, never hang
            log.warning("kv_transfer_write_failed transfer_id=%s peer=%s error=%s", tid, rpc, exc)
            return MessageType.WRITE_DONE, {
                "transfer_id": tid,
                "nonce": nonce,
                "status": "error",
                "message": str(exc),
                "bytes": 0,
            }
        finally:
            self._finish(pending, reason)

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
        for batch in itertools.chain(([op] for op in probes.values()), batches(rest, self.batch_entries)):
            if not wanted():
                raise KVTransferError("the consumer hung up; write abandoned", reason="abandoned")
            await self._agent.write(peer, batch)
        for key in new_spans:
            self._verified[key] = None
        while len(self._verified) > 4096:
            self._verified.popitem(last=False)


class KVConsumer:
    """Decode side: asks a producer to push a request's blocks into this engine's regions."""

    def __init__(self, agent: TransferAgent, regions: Sequence[Region], *, timeout_s: float = 60.0) -> None:
        self._agent = agent
        self._regions = tuple(regions)
        self.timeout_s = timeout_s

    async def pull(self, params: KVTransferParams | Mapping[str, Any], dst_block_ids: Sequence[int]) -> None:
        """Return once the producer wrote ``params.remote_block_ids`` into ``dst_block_ids`` (same order).

        A destination id of ``layout.SKIP`` (-1) skips that block (decode already holds it).

        Raises KVTransferParamsError on bad params, KVTransferError on refusal, unreachable
        producer, timeout, failed write or a reply that does not match the request.
        """
        p = params if isinstance(params, KVTransferParams) else KVTransferParams.from_dict(params)
        if len(dst_block_ids) != len(p.remote_block_ids):
            raise KVTransferError(
                f"{len(dst_block_ids)} destination blocks for {len(p.remote_block_ids)} remote blocks",
                reason="block_mismatch",
            )
        nonce = secrets.token_hex(16)
        sent = False
        where = f"{p.remote_host}:{p.remote_handshake_port}"
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    reader, writer = await asyncio.open_connection(p.remote_host, p.remote_handshake_port)
                except OSError as exc:
                    raise KVTransferError(f"KV producer {where} unreachable: {exc}", reason="unreachable") from exc
                try:
                    await wire.send(
                        writer,
                        MessageType.WRITE_REQUEST,
                        transfer_id=p.transfer_id,
                        rpc=self._agent.rpc_address,
                        block_ids=[int(b) for b in dst_block_ids],  # numpy ints do not pack
                        regions=[r.to_wire() for r in self._regions],
                        nonce=nonce,
                    )
                    sent = True
                    reply = await wire.recv(reader)
                finally:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()
        except TimeoutError as exc:
            raise KVTransferError(
                f"KV transfer {p.transfer_id} from {where} timed out after {self.timeout_s:g} s",
                reason="timeout",
                dst_may_be_written=sent,
            ) from exc
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as exc:
            raise KVTransferError(
                f"KV producer {where} dropped transfer {p.transfer_id}: {exc!r}",
                reason="connection_lost",
                dst_may_be_written=sent,
            ) from exc
        _check_reply(reply, p.transfer_id, nonce, where)


def _check_reply(reply: dict[str, Any], tid: str, nonce: str, where: str) -> None:
    kind = reply.get("type")
    if kind == MessageType.ERROR:
        code = str(reply.get("code", "error"))
        raise KVTransferError(
            f"KV producer {where} refused transfer {tid}: {code}: {reply.get('message', '')}", reason=code
        )
    if kind != MessageType.WRITE_DONE:
        raise KVTransferError(
            f"KV producer {where} sent {kind!r} for transfer {tid}", reason="bad_reply", dst_may_be_written=True
        )
    if reply.get("nonce") != nonce or reply.get("transfer_id") != tid:
        raise KVTransferError(
            f"KV producer {where} answered transfer {tid} with a mismatched nonce or transfer id",
            reason="nonce_mismatch",
            dst_may_be_written=True,
        )
    if reply.get("status") != "ok":
        raise KVTransferError(
            f"KV write for transfer {tid} failed at {where}: {reply.get('message', '')}", reason="write_failed"
        )
