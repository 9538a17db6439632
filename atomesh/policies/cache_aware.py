"""`cache_aware`: send a request where its prompt prefix was sent before, unless the fleet is imbalanced.

Decision (SMG's cache-aware policy; docs/placement.md):

1. The candidates' loads are imbalanced when `max - min > --balance-abs-threshold` AND
   `max > --balance-rel-threshold * min`: the least-loaded worker wins (shortest queue).
2. Otherwise the longest indexed prefix of the request's locality text (a chat's whole conversation)
   is looked up. If the matched share of the text is above `--cache-threshold`, the least-loaded
   worker among those holding that prefix wins, unless it is itself overloaded against the fleet
   mean (both thresholds, as SMG's per-request gate), in which case the request spills to the
   least-loaded worker, which then becomes a second holder of the prefix.
3. Below the threshold (a new prefix) the least-loaded worker wins, ties broken by the smallest share
   of the index (the worker holding the least cached text).

`select` only decides: it returns a `PrefixDecision` carrying the text's hashes, and `record`, which
placement calls once the whole plan exists, records the chosen worker as holding the whole text
(and counts the hit or miss). A P/D plan that fails on its decode leg therefore leaves no trace.

The index (`PrefixIndex`) is not a character radix tree: the text is cut into fixed chunks of
`chunk_chars` bytes (UTF-8), each chunk hashed with xxh3 seeded by its position and the hashes
xor-accumulated, so hash i identifies the whole prefix up to chunk i (a chain). A dict maps each
prefix hash to the few workers that hold it (most recent last), kept in LRU order with a hard entry
budget shared by all workers: `--max-tree-size` counts characters, as SMG's tree does, so the budget
is `max_tree_size // chunk_chars` entries. Cost per request: one pass of C-level hashing over the
text, a binary search for the match (entries are touched deepest first, so the shallow, shared ones
are evicted last and each chain stays a prefix-closed run), and one LRU touch per chunk.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import structlog
import xxhash

from atomesh.config import PolicyName
from atomesh.policies.base import CacheStats, Decision, Given, Needs, Replica, least_loaded, slot_setter
from atomesh.request import RequestView
from atomesh.tasks import PeriodicTask
from atomesh.workers.worker import Worker, WorkerState

if TYPE_CHECKING:
    from atomesh.workers.registry import WorkerRegistry

log = structlog.get_logger("atomesh.policies")

DEFAULT_CHUNK_CHARS = 256
MAX_HOLDERS = 4
# The periodic sweep trims the index to this share of its budget, leaving headroom so that a burst of
# new prompts between sweeps does not evict at the hard limit on every request.
LOW_WATER = 0.9

_xxh = xxhash.xxh3_64_intdigest
Holders = tuple[Worker, ...]


def chunk_hashes(text: str, chunk: int) -> tuple[list[int], int]:
    """Chained prefix hashes of `text` cut into `chunk`-byte pieces (the last may be shorter), and its size."""
    data = text.encode()
    n = len(data)
    if n == 0:
        return [], 0
    full, tail = divmod(n, chunk)
    pieces: list[bytes] = list(_splitter(chunk, full).unpack_from(data)) if full else []
    if tail:
        pieces.append(data[full * chunk :])
    return list(accumulate(map(_xxh, pieces, range(len(pieces))), operator.xor)), n


@functools.lru_cache(maxsize=512)
def _splitter(chunk: int, count: int) -> struct.Struct:
    # One C call cuts the text into `count` chunks: five times faster than slicing in a loop.
    return struct.Struct(f"{chunk}s" * count)


class PrefixIndex:
    """Which workers were sent which prompt prefixes: chained chunk hashes -> holders, LRU, hard budget."""

    def __init__(
        self, max_entries: int, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_holders: int = MAX_HOLDERS
    ) -> None:
        if max_entries < 1 or chunk_chars < 1 or max_holders < 1:
            raise ValueError("max_entries, chunk_chars and max_holders must be positive")
        self.max_entries = max_entries
        self.chunk_chars = chunk_chars
        self.max_holders = max_holders
        self._entries: OrderedDict[int, Holders] = OrderedDict()
        self._share: dict[Worker, int] = {}  # entries each worker holds
        self._single: dict[Worker, Holders] = {}  # one shared 1-tuple per worker
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def share(self, worker: Worker) -> int:
        return self._share.get(worker, 0)

    def hashes(self, text: str) -> tuple[list[int], int]:
        return chunk_hashes(text, self.chunk_chars)

    def holders(self, h: int) -> Holders:
        return self._entries.get(h, ())

    def match(self, hashes: Sequence[int], ok: Callable[[Holders], bool]) -> int:
        """Number of leading chunks whose entry exists and passes `ok` (binary search on the chain)."""
        get = self._entries.get
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            v = get(hashes[mid - 1])
            if v is not None and ok(v):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def matched_chars(self, depth: int, size: int) -> int:
        return min(depth * self.chunk_chars, size)

    def insert(self, hashes: Sequence[int], worker: Worker, held: int = 0) -> None:
        """Record that `worker` now holds the whole chain; it is known to hold the first `held` entries."""
        if len(hashes) > self.max_entries:  # a text larger than the whole budget keeps its head
            hashes = hashes[: self.max_entries]
            held = min(held, len(hashes))
        entries = self._entries
        get = entries.get
        touch = entries.move_to_end
        single = self._single.get(worker)
        if single is None:
            single = self._single[worker] = (worker,)
        added = 0
        # Deepest first, so that the shallow (shared) part of the chain ends most recently used.
        for i in range(len(hashes) - 1, held - 1, -1):
            h = hashes[i]
            v = get(h)
            if v is None:
                entries[h] = single
                added += 1
                if len(entries) > self.max_entries:
                    self._evict_one()
            elif worker not in v:
                if len(v) >= self.max_holders:
                    dropped = v[0]
                    self._share[dropped] -= 1
                    v = v[1:]
                entries[h] = (*v, worker)
                added += 1
                touch(h)
            else:
                touch(h)
        if added:
            self._share[worker] = self._share.get(worker, 0) + added
        if held:
            try:
                deque(map(touch, reversed(hashes[:held])), maxlen=0)
            except KeyError:
                # An entry of the held run was evicted by this very insertion: re-record the run.
                self.insert(hashes[:held], worker, 0)

    def _evict_one(self) -> None:
        _, v = self._entries.popitem(last=False)
        for w in v:
            self._share[w] -= 1
        self.evictions += 1

    def trim(self, target: int) -> int:
        """Evict least recently used entries down to `target`; returns how many went."""
        n = 0
        while len(self._entries) > target:
            self._evict_one()
            n += 1
        return n

    def remove_worker(self, worker: Worker) -> int:
        """Forget everything `worker` holds; returns the entries that went with it."""
        if worker not in self._share:
            return 0
        entries = self._entries
        gone = 0
        for h, v in list(entries.items()):
            if worker in v:
                rest = tuple(w for w in v if w is not worker)
                if rest:
                    # Keep the entry's LRU position: assignment to an existing key does not move it.
                    entries[h] = self._single.get(rest[0], rest) if len(rest) == 1 else rest
                else:
                    del entries[h]
                    gone += 1
        del self._share[worker]
        self._single.pop(worker, None)
        return gone


# Why cache_aware chose a worker (`Decision.reason`); only PREFIX_HIT counts as a hit.
IMBALANCED = "imbalanced"
PREFIX_HIT = "prefix_hit"
HOLDER_OVERLOADED = "holder_overloaded"
NEW_PREFIX = "new_prefix"


@dataclass(frozen=True, slots=True, init=False)
class PrefixDecision(Decision):
    """A cache-aware choice and what recording it takes: the text's chained chunk hashes (not to be
    mutated) and how many leading entries the worker is known to hold already."""

    hashes: list[int]
    held: int

    def __init__(self, worker: Worker, reason: str, hashes: list[int], held: int) -> None:
        _set_worker(self, worker)  # as Decision.__init__ does, for the same reason
        _set_reason(self, reason)
        _set_hashes(self, hashes)
        _set_held(self, held)


_set_worker, _set_reason = slot_setter(Decision, "worker"), slot_setter(Decision, "reason")
_set_hashes, _set_held = slot_setter(PrefixDecision, "hashes"), slot_setter(PrefixDecision, "held")


class CacheAwarePolicy:
    name = PolicyName.CACHE_AWARE
    select_single = False
    needs = Needs()

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_secs: float = 120,
        max_tree_size: int = 2**26,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.eviction_interval_secs = eviction_interval_secs
        self.index = PrefixIndex(max(1, max_tree_size // chunk_chars), chunk_chars)
        self.hits = 0  # placements recorded on a worker that held their prefix
        self.misses = 0
        self._eviction = PeriodicTask("cache-aware-eviction", eviction_interval_secs, self.evict)
        # Called with every placement recorded here, for the gateway's other processes (`replicas`).
        self._publish: Callable[[Any], None] | None = None

    # ------------------------------------------------------------------ what the gateway gives and reads
    def attach(self, given: Given) -> None:
        pass

    def elsewhere(self, worker: Worker) -> int:
        return 0

    def replicas(self) -> Mapping[str, Replica]:
        """The index: every process records the placements of the others too."""
        return {"prefix_index": self}

    def connect(self, publish: Callable[[Any], None]) -> None:
        self._publish = publish

    def apply(self, record: Any, registry: WorkerRegistry) -> None:
        """Another process's placement `(worker url, the prompt's chained prefix hashes)`."""
        url, hashes = record
        worker = registry.by_url(url)
        if worker is not None and worker.state is not WorkerState.DRAINING:
            self.index.insert(hashes, worker, self.held(hashes, worker))

    def export(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, len(self.index))

    # ------------------------------------------------------------------ decision
    def select(self, candidates: Sequence[Worker], view: RequestView) -> PrefixDecision:
        hashes, size = self.index.hashes(view.locality_text)
        loads = [w.load for w in candidates]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            return self._least_loaded(candidates, hashes, IMBALANCED)
        pool = set(candidates)
        depth = self.index.match(hashes, lambda v: not pool.isdisjoint(v))
        if depth and self.index.matched_chars(depth, size) > self.cache_threshold * size:
            holders = [w for w in self.index.holders(hashes[depth - 1]) if w in pool]
            # Among equally loaded holders the most recent one (holders are oldest first).
            worker = least_loaded(holders[::-1])
            avg = sum(loads) / len(loads)
            load = worker.load
            if load > avg * self.rel_threshold and load > avg + self.abs_threshold:
                return self._least_loaded(candidates, hashes, HOLDER_OVERLOADED)
            return PrefixDecision(worker, PREFIX_HIT, hashes, depth)
        return self._least_loaded(candidates, hashes, NEW_PREFIX)

    def record(self, decision: Decision, view: RequestView) -> None:
        worker = decision.worker
        if isinstance(decision, PrefixDecision):
            hashes, held = decision.hashes, decision.held
            if decision.reason == PREFIX_HIT:
                self.hits += 1
            else:
                self.misses += 1
        else:  # the only candidate, placement did not ask select: still a hit or a miss for the hit ratio
            hashes, size = self.index.hashes(view.locality_text)
            held = self.held(hashes, worker)
            if held and self.index.matched_chars(held, size) > self.cache_threshold * size:
                self.hits += 1
            else:
                self.misses += 1
        self.index.insert(hashes, worker, held)
        if self._publish is not None:
            self._publish((worker.url, hashes))

    def released(self, worker: Worker) -> None:
        pass

    def on_worker_removed(self, worker: Worker) -> None:
        gone = self.index.remove_worker(worker)
        log.debug("cache_index_worker_removed", worker=worker.url, entries=gone)

    def held(self, hashes: Sequence[int], worker: Worker) -> int:
        """How many leading entries of the chain `hashes` the index says `worker` holds."""
        return self.index.match(hashes, lambda v: worker in v)

    def _least_loaded(self, candidates: Sequence[Worker], hashes: list[int], reason: str) -> PrefixDecision:
        # Among equally loaded workers the one holding the least of the index.
        worker = least_loaded(candidates, tiebreak=self.index.share)
        return PrefixDecision(worker, reason, hashes, self.held(hashes, worker))

    # ------------------------------------------------------------------ eviction task
    def evict(self) -> int:
        """One eviction pass: trim the index to its low-water mark."""
        gone = self.index.trim(int(self.index.max_entries * LOW_WATER))
        if gone:
            log.debug("cache_index_evicted", entries=gone, size=len(self.index))
        return gone

    def start(self) -> None:
        self._eviction.start()

    async def stop(self) -> None:
        await self._eviction.stop()
