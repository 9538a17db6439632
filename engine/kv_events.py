"""KV cache events in vLLM's wire format: what the prefix cache stores and evicts, for KV-aware routers.

``--kv-events-config`` takes vLLM's JSON (``enable_kv_cache_events``, ``publisher``, ``endpoint``,
``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``). Each engine step's
events go out as ZMQ PUB multipart messages ``[topic, seq (8-byte big-endian), payload]``, one as the
step starts (the blocks it is about to write) and one once it has run; the
payload is msgpack of vLLM's array-like structs (the layout of vLLM's
``examples/online_serving/kv_events_subscriber.py``):

- ``KVEventBatch = [ts, [event, ...], data_parallel_rank]``
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

A ROUTER socket on ``replay_endpoint`` answers ``[b"", start_seq]`` with every buffered message from
``start_seq`` on, each as ``[b"", seq, payload]``, then ``[b"", -1, b""]``. The first batch after start
is ``AllBlocksCleared``: a subscriber that follows a restarted engine forgets what it held.

Prefix-cache reuse is reported too: a prompt served from cached blocks re-announces them as
``BlockStored`` (vLLM's newer releases report reuse the same way), so a subscriber that joined late
learns the hot blocks, and its view of recency follows the engine's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import BindError
from engine.flags import json_object_flag

log = logging.getLogger("engine.kv_events")

_CONFIG_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                "max_queue_size", "topic"}  # fmt: skip
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """The parsed ``--kv-events-config`` (vLLM's keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse ``--kv-events-config``; refuse unknown keys and publishers this engine does not have."""
    raw = json_object_flag("--kv-events-config", text, _CONFIG_KEYS)
    enabled = raw.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
    # vLLM picks zmq when events are enabled and no publisher is named.
    publisher = raw.get("publisher", "zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher {publisher!r} must be 'zmq' or 'null'")
    for key in ("endpoint", "replay_endpoint", "topic"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"--kv-events-config: {key} must be a string")
    for key in ("endpoint", "replay_endpoint"):
        value = raw.get(key)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: {key} {value!r} must be a ZMQ address (tcp://host:port)")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        value = raw.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--kv-events-config: {key} must be a positive integer")
    defaults = KVEventsConfig()
    return KVEventsConfig(
        enable_kv_cache_events=enabled,
        publisher=publisher,
        endpoint=raw.get("endpoint", defaults.endpoint),
        replay_endpoint=raw.get("replay_endpoint"),
        buffer_steps=raw.get("buffer_steps", defaults.buffer_steps),
        hwm=raw.get("hwm", defaults.hwm),
        max_queue_size=raw.get("max_queue_size", defaults.max_queue_size),
        topic=raw.get("topic", defaults.topic),
    )


# -- events (plain tuples in vLLM's field order) ----------------------------------------------------


def block_stored(
    hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int, medium: str | None
) -> list[Any]:
    """vLLM's ``BlockStored``: consecutive blocks of one chain, ``parent`` the block before the first."""
    return ["BlockStored", list(hashes), parent, list(token_ids), block_size, None, medium]


def block_removed(hashes: Sequence[int], medium: str | None) -> list[Any]:
    return ["BlockRemoved", list(hashes), medium]


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[list[Any]], data_parallel_rank: int | None = 0) -> bytes:
    """msgpack of vLLM's array-like ``KVEventBatch``."""
    import msgpack

    body: list[Any] = [ts, events]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return bytes(msgpack.packb(body, use_bin_type=True))


class EventRecorder:
    """Collects the block manager's events between flushes, merging runs of one kind.

    The block manager calls ``stored`` / ``removed`` as blocks enter and leave its hash index;
    the engine loop calls ``take`` as a step starts (the blocks it is about to write) and once it has run,
    and publishes what it gets each time as one batch.
    """

    def __init__(self, block_size: int, medium: str | None) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[list[Any]] = []
        # The open BlockStored run: (its event, the hash of its last block).
        self._run_tail: int | None = None

    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int]) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockStored" and parent is not None and parent == self._run_tail:
            last[1].append(block_hash)
            last[3].extend(token_ids)
        else:
            self._events.append(block_stored([block_hash], parent, token_ids, self.block_size, self.medium))
        self._run_tail = block_hash

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(block_hash)
        else:
            self._events.append(block_removed([block_hash], self.medium))
        self._run_tail = None

    def cleared(self) -> None:
        self._events.append(all_blocks_cleared())
        self._run_tail = None

    def take(self) -> list[list[Any]]:
        events, self._events = self._events, []
        self._run_tail = None
        return events


class ZmqEventPublisher:
    """PUB socket plus a replay ROUTER, served by one thread; batches queue without blocking the engine.

    Sequence numbers are given when a batch is queued: a batch dropped because the queue is full
    leaves a gap that subscribers see, and the replay buffer cannot fill it, so they re-sync.
    """

    def __init__(self, config: KVEventsConfig, bind_host: str = "*") -> None:
        """``bind_host``: what a ``*`` in the endpoints binds to (the engine's --host)."""
        import zmq

        self.config = config
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        # vLLM's rule: a wildcard or ipc/inproc address is bound, any other is connected to.
        if "*" in config.endpoint or "::" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
            _bind(self._pub, bind_address(config.endpoint, bind_host), "KV events endpoint")
        else:
            self._pub.connect(config.endpoint)
        self._replay: Any = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, bind_address(config.replay_endpoint, bind_host), "KV events replay_endpoint")
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[list[Any]]) -> None:
        """Queue one batch (called from the engine loop; never blocks)."""
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, encode_batch(time.time(), events)))
        except queue.Full:
            self.dropped += 1
            log.warning("kv_events_dropped batch=%d reason=queue_full", seq)  # subscribers re-sync

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=2.0)
        except queue.Full:
            pass  # the thread is stuck or gone; the sockets close below all the same
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                # Everything published before the request goes out first, so the answer holds it: a
                # subscriber that just connected may miss it on the PUB socket (ZMQ's slow joiner).
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._send(item)
                self._answer_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if item is None:
                return
            self._send(item)

    def _send(self, item: tuple[int, bytes]) -> None:
        seq, payload = item
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append(item)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv_events_bad_replay_request frames=%d", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bind(sock: Any, address: str, what: str) -> None:
    """Bind a ZMQ socket; a failure names the address and its use (ZMQ's own message names neither)."""
    import zmq

    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise BindError(
            f"cannot listen on {address.removeprefix('tcp://')} ({what}, --kv-events-config): {exc.strerror}"
        ) from exc


def bind_address(endpoint: str, host: str) -> str:
    """``endpoint`` with its ``*`` host replaced by ``host`` (the engine's --host), unless that is a wildcard
    too: an engine asked to listen on one address listens on no other."""
    if host in ("", "*", "0.0.0.0", "::") or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.removeprefix('tcp://*:')}"


def advertised(config: KVEventsConfig) -> dict[str, Any]:
    """What /server_info advertises: the addresses and topic a subscriber needs (``*`` = this host)."""
    return {"publisher": config.publisher, "endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint,
            "topic": config.topic}  # fmt: skip
