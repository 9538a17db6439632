"""Following the engines' KV cache events (vLLM's ZMQ format) into the global KV index.

One subscription task per worker that advertises an event endpoint, owned by `KvEventHub`:

- where: the worker's `kv_events_endpoint` label (from `--kv-events-endpoints`, a pod annotation
  under discovery, or `POST /workers` labels), else `kv_events_config` in its `/server_info`
  (vLLM's keys; a `*` host is the worker's own host);
- on start it asks the replay socket for everything buffered from sequence 0 (an engine that ran
  before this gateway started, or before it restarted, is caught up as far as its buffer goes);
- each message `[topic, seq, payload]` must follow the last one; a gap is filled from the replay
  socket, and when that cannot be done (no replay endpoint, buffer overrun, timeout) the worker's
  entries are dropped and rebuilt from the events that follow (a re-sync); a sequence that goes
  back with a later timestamp is a restarted engine (its first batch clears everything);
- a worker that leaves the registry loses its task and its entries.

Payloads: msgpack of vLLM's `KVEventBatch` `[ts, events, data_parallel_rank?]`, events array-like
and tagged (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, ...]`, `["BlockRemoved", block_hashes, medium, ...]`, `["AllBlocksCleared"]`); releases
that encode events as maps (`{"type": "BlockStored", ...}`) are read too. Fields after the ones
named here are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from atomesh.config import parse_kv_events_endpoints
from atomesh.kv.index import KvIndex
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import KV_EVENTS_LABEL, Worker, WorkerRole, WorkerState

log = structlog.get_logger("atomesh.kv_events")

ENDPOINT_LABEL = KV_EVENTS_LABEL
END_SEQ = -1


class EventFormatError(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


def _hashable(h: Any) -> Any:
    return h if not isinstance(h, list) else tuple(h)


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):  # map-encoded structs: the tag is the "type" field
        kind = raw.get("type")
        fields: list[Any] = []
        if kind == "BlockStored":
            fields = [raw.get(k) for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "lora_id", "medium")]  # fmt: skip
        elif kind == "BlockRemoved":
            fields = [raw.get("block_hashes"), raw.get("medium")]
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], raw[1:]
    else:
        raise EventFormatError(f"an event must be a tagged array or map, not {type(raw).__name__}")
    try:
        if kind == "BlockStored":
            hashes, parent, tokens, size = fields[0], fields[1], fields[2], fields[3]
            if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
                raise EventFormatError("BlockStored: block_hashes and token_ids must be arrays, block_size > 0")
            return BlockStored(
                [_hashable(h) for h in hashes],
                _hashable(parent),
                tokens,
                size,
                fields[4] if len(fields) > 4 else None,
                fields[5] if len(fields) > 5 else None,
            )
        if kind == "BlockRemoved":
            hashes = fields[0]
            if not isinstance(hashes, list):
                raise EventFormatError("BlockRemoved: block_hashes must be an array")
            return BlockRemoved([_hashable(h) for h in hashes], fields[1] if len(fields) > 1 else None)
    except IndexError:
        raise EventFormatError(f"{kind}: too few fields") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventFormatError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack KVEventBatch (array-like, as vLLM encodes it) -> EventBatch."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventFormatError("a KVEventBatch is [ts, events, data_parallel_rank?]")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise EventFormatError("a KVEventBatch needs a numeric ts and an events array")
    return EventBatch(float(ts), [_event(e) for e in events], rank if isinstance(rank, int) else None)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one worker publishes: PUB address, optional replay (ROUTER) address, topic."""

    pub: str
    replay: str | None = None
    topic: str = ""


def _localize(address: str, host: str) -> str:
    """`tcp://*:5557` (or 0.0.0.0 / ::) as the engine binds it -> the address to connect to."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"):
        if address.startswith(wildcard):
            h = f"[{host}]" if ":" in host else host
            return f"tcp://{h}:{address[len(wildcard) :]}"
    return address


def parse_endpoint_spec(spec: str, host: str, topic: str = "") -> Endpoint:
    """`PUB[,REPLAY]` (as `--kv-events-endpoints` and the pod annotation write it)."""
    pub, _, replay = (p.strip() for p in spec.partition(","))
    for part in (pub, replay):
        if part and not part.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv events endpoint {part!r} must be a ZMQ address like tcp://host:5557")
    if not pub:
        raise ValueError(f"kv events endpoint spec {spec!r} has no PUB address")
    return Endpoint(_localize(pub, host), _localize(replay, host) if replay else None, topic)


def endpoint_of(worker: Worker, configured: Mapping[str, str]) -> Endpoint | None:
    """The worker's event endpoint: configured (flag, label) first, then what /server_info advertises."""
    advertised = worker.server_info.get("kv_events_config")
    topic = ""
    if isinstance(advertised, dict) and isinstance(advertised.get("topic"), str):
        topic = advertised["topic"]
    spec = configured.get(worker.url) or worker.labels.get(ENDPOINT_LABEL)
    if spec:
        return parse_endpoint_spec(spec, worker.host, topic)
    if isinstance(advertised, dict) and advertised.get("publisher", "zmq") == "zmq":
        pub = advertised.get("endpoint")
        replay = advertised.get("replay_endpoint")
        if isinstance(pub, str) and pub:
            return Endpoint(
                _localize(pub, worker.host),
                _localize(replay, worker.host) if isinstance(replay, str) and replay else None,
                topic,
            )
    return None


def parse_endpoint_flags(items: list[str]) -> dict[str, str]:
    """`--kv-events-endpoints WORKER_URL=PUB[,REPLAY] ...` -> {worker url: spec}; bad items raise."""
    return parse_kv_events_endpoints(items)


@dataclass(slots=True)
class FollowStats:
    """Per worker: what its stream did (for /workers and tests)."""

    last_seq: int | None = None
    last_ts: float = 0.0
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    restarts: int = 0
    bad_payloads: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the first catch-up is done


class KvEventHub:
    """Owns one subscription per publishing worker and applies their events to the index."""

    def __init__(
        self,
        index: KvIndex,
        registry: WorkerRegistry,
        roles: tuple[WorkerRole, ...],
        configured: Mapping[str, str] | None = None,
        replay_timeout: float = 1.0,
    ) -> None:
        self.index = index
        self.registry = registry
        self.roles = roles
        self.configured = dict(configured or {})
        self.replay_timeout = replay_timeout
        self.streams: dict[str, FollowStats] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: Any = None
        self._running = False
        registry.subscribe(self._on_state)

    # ------------------------------------------------------------------ ownership
    def start(self) -> None:
        import zmq.asyncio

        if self._running:
            return
        self._ctx = zmq.asyncio.Context()
        self._running = True
        for w in self.registry:
            if w.state is WorkerState.READY:
                self._follow(w)

    async def stop(self) -> None:
        self._running = False
        tasks, self._tasks = list(self._tasks.values()), {}
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def follows(self, worker: Worker) -> bool:
        return self.index.follows(worker.url)

    def _on_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if worker.role not in self.roles:
            return
        if new is WorkerState.READY and self._running:
            self._follow(worker)
        elif new is WorkerState.REMOVED:
            task = self._tasks.pop(worker.url, None)
            if task is not None:
                task.cancel()
            self.index.remove_worker(worker.url)
            self.streams.pop(worker.url, None)
            log.info("kv_events_unfollowed", worker=worker.url)

    def _follow(self, worker: Worker) -> None:
        if worker.url in self._tasks or worker.role not in self.roles:
            return
        try:
            ep = endpoint_of(worker, self.configured)
        except ValueError as e:
            log.warning("kv_events_bad_endpoint", worker=worker.url, error=str(e))
            return
        if ep is None:
            return
        size = worker.server_info.get("block_size")
        self.index.add_worker(worker.url, size if isinstance(size, int) and size > 0 else 16)
        stats = self.streams[worker.url] = FollowStats()
        self._tasks[worker.url] = asyncio.get_running_loop().create_task(
            self._run(worker.url, ep, stats), name=f"kv-events {worker.url}"
        )
        log.info("kv_events_following", worker=worker.url, endpoint=ep.pub, replay=ep.replay)

    # ------------------------------------------------------------------ one stream
    async def _run(self, url: str, ep: Endpoint, stats: FollowStats) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
        sub.connect(ep.pub)
        try:
            # Catch up on what the engine did before we came (its replay buffer), then follow live.
            await self._replay(url, ep, stats, 0, None)
            stats.ready.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    stats.bad_payloads += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                self._on_message(url, ep, stats, seq, frames[2])
                last = stats.last_seq
                if last is not None and seq > last + 1:
                    await self._fill_gap(url, ep, stats, seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken stream must not take the gateway down; the worker falls back
            log.warning("kv_events_stream_failed", worker=url, error=str(e))
            self.index.remove_worker(url)  # scored like a worker without events until it is ready again
            self._tasks.pop(url, None)
        finally:
            stats.ready.set()
            sub.close(linger=0)

    def _on_message(
        self, url: str, ep: Endpoint, stats: FollowStats, seq: int, payload: bytes, live: bool = True
    ) -> None:
        """Apply an in-order message; leave gaps (seq > last + 1) to the caller. ``live``: it came on the
        stream, not from the replay socket (replayed batches rebuild the index but are no news of
        current traffic)."""
        last = stats.last_seq
        if last is not None and seq > last + 1:
            return
        try:
            batch = decode_batch(payload)
        except EventFormatError as e:
            stats.bad_payloads += 1
            log.warning("kv_events_bad_payload", worker=url, seq=seq, error=str(e))
            self._resync(url, stats, seq)
            return
        if last is not None and seq <= last:
            if batch.ts <= stats.last_ts:
                return  # already applied (it came by replay too)
            stats.restarts += 1  # the engine restarted: its numbering starts again
            log.info("kv_events_publisher_restarted", worker=url, seq=seq, last=last)
            self.index.cleared(url)
        self._apply(url, stats, seq, batch, live)

    async def _fill_gap(self, url: str, ep: Endpoint, stats: FollowStats, seq: int, payload: bytes) -> None:
        stats.gaps += 1
        last = stats.last_seq
        assert last is not None
        if ep.replay is not None:
            await self._replay(url, ep, stats, last + 1, seq - 1)
        if stats.last_seq == seq - 1:
            self._on_message(url, ep, stats, seq, payload)
        else:
            self._resync(url, stats, seq)
            self._on_message(url, ep, stats, seq, payload)

    def _resync(self, url: str, stats: FollowStats, seq: int) -> None:
        """Events were lost for good: forget the worker's blocks and rebuild from `seq` on."""
        stats.resyncs += 1
        log.info("kv_events_resync", worker=url, seq=seq, last=stats.last_seq)
        self.index.cleared(url)
        stats.last_seq = seq - 1

    async def _replay(self, url: str, ep: Endpoint, stats: FollowStats, start: int, upto: int | None) -> None:
        """Ask the replay socket for messages from `start` (up to `upto`) and apply those in order."""
        if ep.replay is None:
            return
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ep.replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return
                if upto is not None and seq > upto:
                    continue
                if stats.last_seq is None and seq != start:
                    # The buffer no longer reaches back to `start`: what it holds is still true.
                    stats.last_seq = seq - 1
                if stats.last_seq is not None and seq != stats.last_seq + 1:
                    continue  # not contiguous with what we have (duplicate or lost): skip
                stats.replayed += 1
                self._on_message(url, ep, stats, seq, frames[2], live=False)
        except TimeoutError:
            log.info("kv_events_replay_timeout", worker=url, start=start)
        finally:
            dealer.close(linger=0)

    def _apply(self, url: str, stats: FollowStats, seq: int, batch: EventBatch, live: bool) -> None:
        index = self.index
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                index.stored(url, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, live)
            elif isinstance(ev, BlockRemoved):
                index.removed(url, ev.block_hashes, live)
            else:
                index.cleared(url)
        stats.last_seq = seq
        stats.last_ts = batch.ts
        stats.batches += 1
