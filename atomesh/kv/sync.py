"""kv_aware's gateway replicas (`--kv-sync-bind`, `--kv-sync-peers`), and a gateway's processes
(`--processes N`), tell each other what they place.

Independent gateway replicas read the same KV events, but each sees the other's requests only once an
engine reports them: at its next load poll (0.1 s) or when it schedules them. Replicas deciding at the
same moment then pile new prefixes onto the same engines. Dynamo's router replicas share their
active-block state for this reason; here each replica publishes, over ZMQ PUB, a snapshot of what it
has in flight on each worker (requests and the new KV blocks they brought) and the blocks of its
latest placement, and subscribes to its peers', whose messages it reads as it decides (and every
``interval``), so that one which arrived a moment before a decision counts in it:

- at every placement and every finished request (so a peer knows within a network hop), and every
  ``interval`` seconds (a message lost to a full queue is made good), message
  ``[sender id, {worker url: [requests, blocks]}, worker url or nil, [block keys]]`` (msgpack);
- a peer's snapshot older than ``stale_after`` seconds counts for nothing (a replica that died or was
  cut off cannot hold load on workers for ever);
- a placement's block keys become a short-lived prediction in this replica's index, as its own are.

Nothing else is shared: each replica keeps its own index from the engines' events.

The processes of one gateway exchange the same messages over the gateway's own pipes instead of ZMQ
(`connect` / `apply`, the `Replica` seam of atomesh.policies.base: the cluster passes them through the
leader), at the same moments; a replica can do both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import structlog

from atomesh.tasks import PeriodicTask

if TYPE_CHECKING:
    from atomesh.workers.registry import WorkerRegistry

log = structlog.get_logger("atomesh.kv_sync")

Snapshot = dict[str, tuple[int, float]]  # worker url -> (requests in flight, new blocks they brought)
MAX_KEYS = 65_536  # block keys accepted in one message (a 1M-token prompt of 16-token blocks)
MAX_DRAIN = 1_000  # messages read in one poll (the receive queue's bound)


class KvPeerSync:
    """One replica's side of the exchange: a PUB socket bound on ``bind``, a SUB socket to each peer, and
    the gateway's other processes once `connect`ed. With none of these it sends and counts nothing."""

    def __init__(self, bind: str | None, peers: list[str], *, interval: float = 0.05, stale_after: float = 1.0) -> None:
        self.bind = bind
        self.peers = list(peers)
        self.stale_after = stale_after
        self.id = os.urandom(8)
        self._views: dict[bytes, tuple[float, Snapshot]] = {}
        self._snapshot: Callable[[], Snapshot] = dict
        self._on_keys: Callable[[str, list[int]], None] = lambda url, keys: None
        self._pub: Any = None
        self._sub: Any = None
        self._ctx: Any = None
        self._noblock = 0
        self._full: type[Exception] = Exception  # zmq.Again once started (zmq is imported at start)
        self._ticker = PeriodicTask("kv-sync", interval, self._tick)
        self._local: Callable[[Any], None] | None = None  # to the gateway's other processes
        self._local_busy = False  # the last message to them had something in flight
        self._started = False
        self.bad = 0  # peer messages that could not be read

    @property
    def active(self) -> bool:
        """Whether there is anyone to exchange with (peers configured, or the gateway's other processes)."""
        return self.bind is not None or bool(self.peers) or self._local is not None

    def attach(self, snapshot: Callable[[], Snapshot], on_keys: Callable[[str, list[int]], None]) -> None:
        """What to publish (the policy's in-flight view) and what to do with a peer's placement keys."""
        self._snapshot, self._on_keys = snapshot, on_keys

    # ------------------------------------------------------------------ the gateway's processes (Replica)
    def connect(self, publish: Callable[[Any], None]) -> None:
        """Send every message to the gateway's other processes too, through ``publish``."""
        self._local = publish
        if self._started and not self._ticker.running:
            self._ticker.start()

    def apply(self, record: Any, registry: WorkerRegistry) -> None:
        """A message another process of this gateway sent."""
        self.receive(record)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._started = True
        if self.bind is None and not self.peers:
            if self._local is not None:
                self._ticker.start()
            return
        import zmq

        self._ctx = zmq.Context()
        self._noblock, self._full = zmq.NOBLOCK, zmq.Again
        if self.bind is not None:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, 1000)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.bind)
        if self.peers:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.RCVHWM, 1000)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            for peer in self.peers:
                self._sub.connect(peer)
        if self._pub is not None or self._sub is not None or self._local is not None:
            self._ticker.start()
        log.info("kv_sync_started", bind=self.bind, peers=self.peers)

    async def stop(self) -> None:
        self._started = False
        await self._ticker.stop()
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ sending
    def placed(self, worker: str, keys: list[int], load: tuple[int, float]) -> None:
        """This replica just placed a request on ``worker`` (``load``: what it has there counting this
        one, which placement charges only after the policy recorded it): tell the peers now."""
        self._send(worker, keys, load)

    def changed(self) -> None:
        """A request of this replica's finished (its worker's in-flight count already lowered): tell
        the peers now, as its client may be sending its next request to one of them."""
        self._send(None, [])

    async def _tick(self) -> None:
        self.poll()
        self._send(None, [], periodic=True)

    def _send(
        self, worker: str | None, keys: list[int], load: tuple[int, float] | None = None, periodic: bool = False
    ) -> None:
        if self._pub is None and self._local is None:
            return
        state = {url: [n, blocks] for url, (n, blocks) in self._snapshot().items()}
        if worker is not None and load is not None:
            state[worker] = [load[0], load[1]]
        payload = msgpack.packb([self.id, state, worker, keys[:MAX_KEYS]])
        # The pipes lose nothing: an idle process that said so once need not repeat it every tick
        # (its view at the others goes stale, which counts as the nothing it has).
        if self._local is not None and (state or not periodic or self._local_busy):
            self._local(payload)
            self._local_busy = bool(state)
        if self._pub is None:
            return
        try:
            self._pub.send(payload, self._noblock)
        except self._full:  # no room: the next snapshot says the same, later
            pass

    # ------------------------------------------------------------------ receiving
    def poll(self) -> None:
        """Read what the peers sent since the last call, without waiting. The policy calls this as it
        decides (a message that arrived a moment before counts, whatever the event loop was doing),
        the ticker every ``interval``."""
        sub = self._sub
        if sub is None:
            return
        for _ in range(MAX_DRAIN):
            try:
                payload = sub.recv(self._noblock)
            except self._full:
                return
            self.receive(payload)

    def receive(self, payload: bytes, now: float | None = None) -> None:
        """One peer message: keep its snapshot, predict its placement's keys."""
        try:
            sender, state, worker, keys = msgpack.unpackb(payload, raw=False)
            snapshot = {str(url): (int(v[0]), float(v[1])) for url, v in state.items()}
            keys = [int(k) for k in keys[:MAX_KEYS]]
        except (msgpack.UnpackException, TypeError, ValueError, IndexError, AttributeError):
            self.bad += 1
            return
        if not isinstance(sender, bytes) or sender == self.id:
            return
        self._views[sender] = (time.monotonic() if now is None else now, snapshot)
        if len(self._views) > 4 * max(16, len(self.peers)):  # senders that restarted (new ids): oldest go
            for old in sorted(self._views, key=lambda s: self._views[s][0])[: len(self._views) // 2]:
                del self._views[old]
        if isinstance(worker, str) and keys:
            self._on_keys(worker, keys)

    def peer_load(self, worker: str, now: float | None = None) -> tuple[int, float]:
        """Requests the peers have in flight on ``worker``, and the new blocks those brought."""
        now = time.monotonic() if now is None else now
        requests, blocks = 0, 0.0
        for at, snapshot in self._views.values():
            if now - at <= self.stale_after:
                n, b = snapshot.get(worker, (0, 0.0))
                requests += n
                blocks += b
        return requests, blocks
