"""The global KV index: which worker holds which chain of token blocks, built from the engines' KV events.

Keys are the gateway's own, computed from token ids alone, so they do not depend on the engine's
hash function: block i of a prompt has key ``K_i = K_{i-1} + mix(content(block i), i)`` (mod 2^64),
where ``content`` is a dot product of the block's token ids with fixed random odd multipliers and
``mix`` a splitmix64 finaliser. ``K_i`` names the whole prefix up to block i. A prompt's keys
are a handful of numpy operations over its token array; an event's keys continue the chain from the
key of its parent block, which the index remembers per worker (engine hash -> key, depth).

``holders`` maps a key to a bitmask of workers. A prompt's overlap with a worker is the number of
leading keys whose mask has the worker's bit; the engines free a chain from its tail, so chains
are prefix-closed and a binary search finds each depth in O(log blocks) lookups.

Placements not yet confirmed by events are predicted (``predict``): a burst of requests that share a
new prefix should follow the first one, not scatter before the engine reports the blocks. A
prediction expires after ``predict_ttl`` seconds; by then the engine's events have taken over.

``demand`` is how many blocks a worker was sent or reported stored lately: the new blocks of each
prediction (a placement, this gateway's or a synced peer's, counts at once) and the blocks of each
BlockStored event, new or reused (an exponentially decayed count, ``DEMAND_HALF_LIFE``, of the
events received live; batches replayed from an engine's buffer rebuild the index but say nothing of
current traffic): the KV traffic it is serving. Every gateway replica reads the same events, and
synced replicas each other's placements, so they see about the same demand, which `kv_aware` uses
to place new prompts and to break ties.

``evictions`` is the same kind of count of the blocks a worker's live events reported removed: how
hard its pool is pressed. The keys a worker lost lately are kept too (``lost``, a bounded set per
worker, as ARC keeps ghost entries): a prompt whose next block its holder has just evicted is being
thrashed there, and `kv_aware` may move it to a worker under less pressure.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

U64 = np.uint64
_RNG = np.random.Generator(np.random.PCG64(0x6B76_6964_7820))
_MAX_BLOCK = 1024
DEMAND_HALF_LIFE = 10.0  # seconds (demand and evictions)
LOST_PER_WORKER = 8192  # keys a worker evicted lately, kept to recognise a prompt it keeps losing
# Odd 64-bit multipliers, one per position in a block (block sizes up to _MAX_BLOCK tokens).
_MULT = (_RNG.integers(0, 2**63, size=_MAX_BLOCK, dtype=np.uint64) * U64(2) + U64(1)).astype(np.uint64)
_GOLDEN = U64(0x9E3779B97F4A7C15)
_C1 = U64(0xBF58476D1CE4E5B9)
_C2 = U64(0x94D049BB133111EB)

Tokens = npt.NDArray[np.uint64]


def as_tokens(ids: object) -> Tokens:
    """Token ids as the uint64 array the key functions take."""
    return np.asarray(ids, dtype=np.uint64)


def chain_keys(tokens: Tokens, block_size: int, start_key: int = 0, start_depth: int = 0) -> list[int]:
    """Keys of the full blocks of ``tokens``, continuing a chain at ``start_key`` / ``start_depth``."""
    if not 0 < block_size <= _MAX_BLOCK:
        raise ValueError(f"block size {block_size} out of range 1..{_MAX_BLOCK}")
    n = len(tokens) // block_size
    if n == 0:
        return []
    blocks = tokens[: n * block_size].reshape(n, block_size)
    x = (blocks * _MULT[:block_size]).sum(axis=1, dtype=np.uint64)
    x ^= np.arange(start_depth + 1, start_depth + n + 1, dtype=np.uint64) * _GOLDEN
    x ^= x >> U64(30)
    x *= _C1
    x ^= x >> U64(27)
    x *= _C2
    x ^= x >> U64(31)
    keys = np.cumsum(x, dtype=np.uint64)
    if start_key:
        keys += U64(start_key)
    out: list[int] = keys.tolist()
    return out


def _decayed(value: float, at: float, now: float | None = None) -> float:
    """``value`` as of time.monotonic() ``at``, halved every DEMAND_HALF_LIFE seconds until ``now``."""
    now = time.monotonic() if now is None else now
    return value * math.pow(0.5, (now - at) / DEMAND_HALF_LIFE)


def _add_decayed(value: float, at: float, n: float, now: float | None = None) -> tuple[float, float]:
    """The decayed count ``value`` (as of ``at``) with ``n`` more now: the new (value, at)."""
    now = time.monotonic() if now is None else now
    return _decayed(value, at, now) + n, now


@dataclass(slots=True)
class _WorkerBlocks:
    """One worker's blocks as its events described them: engine hash -> (key, depth), oldest first."""

    bit: int
    block_size: int
    blocks: OrderedDict[object, tuple[int, int]] = field(default_factory=OrderedDict)
    demand: float = 0.0  # blocks predicted or reported stored, decayed (see DEMAND_HALF_LIFE) ...
    demand_at: float = 0.0  # ... as of this time.monotonic()
    evicted: float = 0.0  # blocks reported removed by live events, decayed the same way ...
    evicted_at: float = 0.0  # ... as of this time.monotonic()
    lost: OrderedDict[int, None] = field(default_factory=OrderedDict)  # keys removed lately, oldest first


@dataclass(slots=True)
class IndexStats:
    stored: int = 0
    removed: int = 0
    orphans: int = 0  # stored blocks whose parent was unknown (events missed): not indexed
    trimmed: int = 0  # blocks dropped by the per-worker bound


class KvIndex:
    """Block-chain key -> workers holding it, for every worker that publishes KV events.

    Workers are named by a string (their URL). Memory is bounded: a worker keeps at most
    ``max_blocks_per_worker`` blocks (the oldest go first; an engine's own pool is far smaller).
    """

    def __init__(self, max_blocks_per_worker: int = 1 << 20, predict_ttl: float = 2.0) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError("max_blocks_per_worker must be positive")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.predict_ttl = predict_ttl
        self.holders: dict[int, int] = {}
        self._workers: dict[str, _WorkerBlocks] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._predicted: dict[int, int] = {}
        self._predictions: deque[tuple[float, int, list[int]]] = deque()
        self.stats = IndexStats()

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker: str, block_size: int) -> None:
        """Start following ``worker`` (idempotent; a new block size starts it afresh)."""
        wb = self._workers.get(worker)
        if wb is not None:
            if wb.block_size == block_size:
                return
            self.remove_worker(worker)
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit + 1
        self._workers[worker] = _WorkerBlocks(1 << bit, block_size)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` and everything it held."""
        wb = self._workers.pop(worker, None)
        if wb is None:
            return
        self._clear(wb)
        self._drop_predictions(wb.bit)
        self._free_bits.append(wb.bit.bit_length() - 1)

    def follows(self, worker: str) -> bool:
        return worker in self._workers

    def block_size(self, worker: str) -> int | None:
        wb = self._workers.get(worker)
        return wb.block_size if wb is not None else None

    def bit(self, worker: str) -> int:
        return self._workers[worker].bit

    def blocks_of(self, worker: str) -> int:
        wb = self._workers.get(worker)
        return len(wb.blocks) if wb is not None else 0

    def demand(self, worker: str, now: float | None = None) -> float:
        """Blocks ``worker`` was sent (predictions) or reported stored (new or reused) lately, decayed
        with DEMAND_HALF_LIFE; 0 if not followed."""
        wb = self._workers.get(worker)
        return _decayed(wb.demand, wb.demand_at, now) if wb is not None else 0.0

    def evictions(self, worker: str, now: float | None = None) -> float:
        """Blocks ``worker``'s live events reported removed lately, decayed with DEMAND_HALF_LIFE."""
        wb = self._workers.get(worker)
        return _decayed(wb.evicted, wb.evicted_at, now) if wb is not None else 0.0

    def lost(self, worker: str, key: int) -> bool:
        """Whether ``worker`` held the block named ``key`` and removed it lately (one of its last
        LOST_PER_WORKER removals, not stored again since)."""
        wb = self._workers.get(worker)
        return wb is not None and key in wb.lost

    def __len__(self) -> int:
        return len(self.holders)

    # ------------------------------------------------------------------ events
    def stored(
        self,
        worker: str,
        block_hashes: list[object],
        parent: object | None,
        token_ids: list[int],
        block_size: int,
        live: bool = True,
    ) -> None:
        """A BlockStored event: ``block_hashes`` extend the chain after ``parent`` (None: a first block).
        ``live``: it arrived as it happened (counts for ``demand``), not from a replay buffer."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        if block_size != wb.block_size:
            self.add_worker(worker, block_size)  # the engine's block size wins over what we assumed
            wb = self._workers[worker]
        start_key, start_depth = 0, 0
        if parent is not None:
            entry = wb.blocks.get(parent)
            if entry is None:
                self.stats.orphans += len(block_hashes)
                return
            start_key, start_depth = entry
        n = min(len(block_hashes), len(token_ids) // block_size)
        keys = chain_keys(as_tokens(token_ids[: n * block_size]), block_size, start_key, start_depth)
        holders, bit, blocks = self.holders, wb.bit, wb.blocks
        lost = wb.lost
        for i, (h, key) in enumerate(zip(block_hashes, keys, strict=False)):
            if lost:
                lost.pop(key, None)
            old = blocks.get(h)
            if old is not None:
                blocks.move_to_end(h)
                if old[0] == key:
                    continue
                self._unhold(old[0], bit)
            blocks[h] = (key, start_depth + i + 1)
            holders[key] = holders.get(key, 0) | bit
        self.stats.stored += n
        if live:
            wb.demand, wb.demand_at = _add_decayed(wb.demand, wb.demand_at, n)
        over = len(blocks) - self.max_blocks_per_worker
        for _ in range(max(0, over)):
            _, (key, _) = blocks.popitem(last=False)
            self._unhold(key, bit)
            self.stats.trimmed += 1

    def removed(self, worker: str, block_hashes: list[object], live: bool = True) -> None:
        """A BlockRemoved event (``live``: as it happened, not from a replay buffer)."""
        wb = self._workers.get(worker)
        if wb is None:
            return
        lost = wb.lost
        n = 0
        for h in block_hashes:
            entry = wb.blocks.pop(h, None)
            if entry is not None:
                self._unhold(entry[0], wb.bit)
                lost[entry[0]] = None
                n += 1
        self.stats.removed += n
        for _ in range(len(lost) - LOST_PER_WORKER):
            lost.popitem(last=False)
        if live and n:
            wb.evicted, wb.evicted_at = _add_decayed(wb.evicted, wb.evicted_at, n)

    def cleared(self, worker: str) -> None:
        """AllBlocksCleared, or a re-sync: the worker holds nothing we know of."""
        wb = self._workers.get(worker)
        if wb is not None:
            self._clear(wb)

    # ------------------------------------------------------------------ predictions
    def predict(self, worker: str, keys: list[int], now: float | None = None) -> None:
        """``worker`` was just sent a prompt with these keys: count them as held until ``predict_ttl``,
        and in its demand."""
        wb = self._workers.get(worker)
        if wb is None or not keys:
            return
        now = time.monotonic() if now is None else now
        self._expire(now)
        predicted, bit = self._predicted, wb.bit
        wb.demand, wb.demand_at = _add_decayed(wb.demand, wb.demand_at, len(keys), now)
        for k in keys:
            predicted[k] = predicted.get(k, 0) | bit
        self._predictions.append((now + self.predict_ttl, bit, keys))

    def _expire(self, now: float) -> None:
        q = self._predictions
        while q and q[0][0] <= now:
            _, bit, keys = q.popleft()
            self._unpredict(bit, keys)

    def _unpredict(self, bit: int, keys: list[int]) -> None:
        predicted = self._predicted
        for k in keys:
            m = predicted.get(k, 0) & ~bit
            if m:
                predicted[k] = m
            else:
                predicted.pop(k, None)
        # A key predicted twice for the same worker loses its bit with the first expiry: harmless.

    def _drop_predictions(self, bit: int) -> None:
        for _, b, keys in self._predictions:
            if b == bit:
                self._unpredict(bit, keys)

    # ------------------------------------------------------------------ lookup
    def overlaps(self, keys: list[int], bits: list[int], now: float | None = None) -> list[int]:
        """For each worker bit, how many leading blocks of ``keys`` it holds (or is predicted to)."""
        if not keys or not bits:
            return [0] * len(bits)
        if self._predictions:
            self._expire(time.monotonic() if now is None else now)
        holders, predicted = self.holders, self._predicted
        if predicted:

            def mask(i: int) -> int:
                k = keys[i]
                return holders.get(k, 0) | predicted.get(k, 0)
        else:

            def mask(i: int) -> int:
                return holders.get(keys[i], 0)

        first = mask(0)
        n = len(keys)
        last = mask(n - 1)
        out = []
        for bit in bits:
            if not first & bit:
                out.append(0)
            elif last & bit:
                out.append(n)
            else:  # held at 0, not at n-1: binary search the first block it lacks
                lo, hi = 0, n - 1
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if mask(mid) & bit:
                        lo = mid
                    else:
                        hi = mid
                out.append(hi)
        return out

    # ------------------------------------------------------------------ internals
    def _unhold(self, key: int, bit: int) -> None:
        m = self.holders.get(key, 0) & ~bit
        if m:
            self.holders[key] = m
        else:
            self.holders.pop(key, None)

    def _clear(self, wb: _WorkerBlocks) -> None:
        for key, _ in wb.blocks.values():
            self._unhold(key, wb.bit)
        wb.blocks.clear()
        wb.lost.clear()  # a restarted engine or a re-sync: nothing was evicted
