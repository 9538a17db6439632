"""Paged KV blocks: allocation, reference counts and prefix caching by hash chains over full blocks."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from typing import cast

from engine.kv_events import EventRecorder
from engine.sequence import Sequence

_REF_COUNT = attrgetter("ref_count")
_TOKENS = attrgetter("token_ids")
_UINT64 = (1 << 64) - 1


def block_hash(token_ids: Tokens[int], prefix_hash: int | None) -> int:
    """Hash of a full block that also covers every block before it (through ``prefix_hash``).

    Two blocks share a hash only when their whole prefixes match, so one dict lookup per block
    finds the longest cached prefix.
    """
    return chain_hashes([tuple(token_ids)], prefix_hash)[0]


def chain_hashes(blocks: Iterable[tuple[int, ...]], prefix_hash: int | None) -> list[int]:
    """``block_hash`` of consecutive full ``blocks``, chained from ``prefix_hash`` (the hash of the block
    before the first; None before a sequence's first block).

    Python's own hash of the blocks' token tuples: it runs in C over the tuples the prefix cache keeps
    anyway (one call per block), and ints and tuples of ints hash alike in every process (no
    PYTHONHASHSEED). Packing the tokens into bytes for xxhash cost as much as hashing them. Not a
    cryptographic hash: a hit also compares the block's tokens. Kept unsigned 64-bit, as the KV events'
    consumers read block hashes (vLLM's).
    """
    rest = iter(blocks)
    head: list[int] = []
    prev = prefix_hash
    if prev is None:
        for first in rest:  # a bare tuple: a shape no chained block (a pair) hashes from
            prev = hash(first) & _UINT64
            head.append(prev)
            break
    return head + [prev := hash((prev, block)) & _UINT64 for block in rest]


class Block:
    """One KV cache block: who uses it (``ref_count``) and, once full, which tokens it holds."""

    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockStats:
    """A snapshot of pool usage and prefix-cache effectiveness (for /metrics)."""

    total: int
    free: int
    cached: int  # blocks that carry a prefix hash (in use or reusable)
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    evicted: int = 0  # cached blocks whose KV was dropped to hand their memory to another sequence

    @property
    def used(self) -> int:
        return self.total - self.free

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockManager:
    """Hands out KV blocks to sequences and keeps freed full blocks findable by their prefix hash.

    Free blocks sit in LRU order: a freed block keeps its hash (its KV stays valid) until the pool
    runs short and it is handed out again, at which point its hash entry is dropped. So the hash
    index never holds more entries than there are blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._evicted = 0
        # Set when --kv-events-config publishes: blocks entering / leaving the hash index are reported.
        self.events: EventRecorder | None = None
        # Blocks reported as stored when a step was scheduled to write them (`announce`), not yet indexed:
        # block id -> the hash reported; how many pending blocks report each hash; hashes reported
        # removed (evicted elsewhere) while still pending here, which `mark_computed` reports again.
        self._announced: dict[int, int] = {}
        self._pending: Counter[int] = Counter()
        self._voided: set[int] = set()
        # The last prefix lookup, (sequence, index version, hits): the scheduler asks whether a sequence
        # fits and then allocates it, and the answer holds until the hash index changes.
        self._index_version = 0
        self._lookup: tuple[Sequence, int, int, list[int]] | None = None
        # slice(i * block_size, (i + 1) * block_size) for i = 0, 1, ...: the cuts of a run of tokens into blocks.
        self._cuts: list[slice] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> BlockStats:
        return BlockStats(
            total=len(self.blocks),
            free=len(self._free),
            cached=len(self._hash_to_block),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            evicted=self._evicted,
        )

    # -- prefix lookup ---------------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hashes of ``seq``'s first ``num_blocks`` full blocks, each computed once per sequence (and
        their token tuples, ``seq.full_blocks``, cut once)."""
        known = seq.block_hashes
        if len(known) < num_blocks:
            bs, first = self.block_size, len(known)
            if num_blocks * bs > len(seq):
                raise RuntimeError(f"sequence {seq.seq_id} has no {num_blocks} full blocks to hash")
            count = num_blocks - first
            if len(self._cuts) < count:
                self._cuts += [slice(i * bs, (i + 1) * bs) for i in range(len(self._cuts), 2 * count)]
            tokens = seq.token_ids if first == 0 else seq.token_ids[first * bs :]
            blocks = list(map(tuple, map(tokens.__getitem__, islice(self._cuts, count))))
            seq.full_blocks += blocks
            known += chain_hashes(blocks, known[-1] if known else None)
        return known

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``.

        At least the last token is always left to compute: its logits start the generation.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt_logprobs need the logits of every prompt token: computed, not cached
        last = self._lookup
        if last is not None and last[0] is seq and last[1] == len(seq) and last[2] == self._index_version:
            return last[3]
        n = (len(seq) - 1) // self.block_size
        hashes, index = self._hashes(seq, n), self._hash_to_block
        if n == 0 or hashes[0] not in index:
            hits: list[int] = []  # a prompt never seen: one lookup
        else:
            found = list(map(index.get, islice(hashes, n)))  # one pass, in C
            cut = found.index(None) if None in found else n
            hits = cast("list[int]", found[:cut])  # the ids before the first block not cached
        # Compare tokens too: a hash collision must never serve another prompt's KV.
        held = list(map(_TOKENS, map(self.blocks.__getitem__, hits)))
        if held != seq.full_blocks[: len(hits)]:
            hits = hits[: next(i for i, (a, b) in enumerate(zip(held, seq.full_blocks, strict=False)) if a != b)]
        self._lookup = (seq, len(seq), self._index_version, hits)
        return hits

    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the prefix cache holds right now."""
        return len(self._cached_prefix(seq)) * self.block_size

    # -- allocation ------------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence) -> int:
        """Free blocks that allocating ``seq`` now would consume (cache hits in use cost nothing)."""
        return self._blocks_needed(seq, self._cached_prefix(seq))

    def _blocks_needed(self, seq: Sequence, hits: list[int]) -> int:
        in_use = len(hits) - list(map(_REF_COUNT, map(self.blocks.__getitem__, hits))).count(0)
        return seq.num_blocks - in_use

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks; sets num_cached_tokens.

        New blocks enter the prefix index only through ``mark_computed``, once their KV is written
        (by a step, a later prefill chunk, or a KV transfer), so a lookup never finds a block
        whose KV is not there yet.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        hits = self._cached_prefix(seq)
        if self._blocks_needed(seq, hits) > len(self._free):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        free, events, parent = self._free, self.events, None
        for block in map(self.blocks.__getitem__, hits):
            if block.ref_count == 0:
                del free[block.block_id]
            block.ref_count += 1
            if events is not None and block.hash is not None:
                events.stored(block.hash, parent, block.token_ids)  # a reuse: subscribers see it is hot
                parent = block.hash
        seq.block_table += hits
        seq.block_table += self._take_free_blocks(seq.num_blocks - len(hits))
        seq.num_cached_tokens = len(hits) * self.block_size
        self._prefix_queries += len(seq)
        self._prefix_hits += seq.num_cached_tokens

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that the KV of ``seq``'s first ``num_tokens`` tokens is written; index full blocks."""
        first, end = seq.num_cached_tokens // self.block_size, num_tokens // self.block_size
        seq.num_cached_tokens = num_tokens
        if not self.enable_prefix_caching or first >= end:
            return
        blocks, table = self.blocks, seq.block_table
        if first > 0 and blocks[table[first - 1]].hash is None:
            return  # the chain is broken (e.g. an index entry was evicted): nothing later can hit
        hashes, tokens = self._hashes(seq, end), seq.full_blocks
        index, events = self._hash_to_block, self.events
        for i in range(first, end):  # each block indexed leaves the chain whole for the next
            block = blocks[table[i]]
            if block.hash is not None:
                continue  # a prefix-cache hit: already indexed
            h = block.hash = hashes[i]
            block.token_ids = tokens[i]
            index[h] = block.block_id
            if events is not None and (not self._announced or self._settle(block) != h):
                events.stored(h, hashes[i - 1] if i > 0 else None, block.token_ids)  # not reported when scheduled
        self._index_version += 1

    def announce(self, seq: Sequence, num_tokens: int) -> None:
        """Report as stored the full blocks that the step about to run writes for ``seq`` (up to
        ``num_tokens``), as vLLM's scheduler reports them when it schedules them: a router learns
        where a prefix is going while it is being computed, not a step later.

        Only the events go out early: the hash index still takes a block when its KV is written
        (``mark_computed``). A block reported here that is never written (the request ended, the step
        failed) is reported removed when it is freed, unless another block holds that prefix.
        """
        if self.events is None or not self.enable_prefix_caching:
            return
        first, end = seq.num_cached_tokens // self.block_size, num_tokens // self.block_size
        if first >= end:
            return  # no block fills up in this step (most decode steps)
        prev: int | None = None
        if first > 0:
            before = self.blocks[seq.block_table[first - 1]]
            prev = before.hash if before.hash is not None else self._announced.get(before.block_id)
            if prev is None:
                return  # the chain is broken: nothing after it can be found
        hashes = self._hashes(seq, end)
        for i in range(first, end):
            block = self.blocks[seq.block_table[i]]
            known = block.hash if block.hash is not None else self._announced.get(block.block_id)
            if known is None:
                known = hashes[i]
                self._announced[block.block_id] = known
                self._pending[known] += 1
                self.events.stored(known, prev, seq.full_blocks[i])
            prev = known

    def _settle(self, block: Block) -> int | None:
        """Drop ``block``'s early report; the hash it reported if nothing reported it removed since."""
        h = self._announced.pop(block.block_id, None)
        if h is None:
            return None
        voided = h in self._voided
        self._pending[h] -= 1
        if self._pending[h] <= 0:
            del self._pending[h]
            self._voided.discard(h)
        return None if voided else h

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give ``child`` the first ``num_blocks`` (full, computed) blocks of ``parent``: one more reference
        each, no copy. The child computes what follows into blocks of its own."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already has blocks")
        for block_id in parent.block_table[:num_blocks]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        if not child.block_hashes:  # the same tokens: the same hashes
            child.block_hashes = parent.block_hashes[:num_blocks]
            child.full_blocks = parent.full_blocks[:num_blocks]
        child.num_cached_tokens = num_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; full ones stay findable by hash until the pool reuses them."""
        # Reverse order: a prompt's first blocks are freed last, so they are evicted last.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                h = self._settle(block) if self._announced else None
                if h is not None and h not in self._hash_to_block and h not in self._pending:
                    assert self.events is not None
                    self.events.removed(h)  # reported early, never written, and no other block holds it
                self._free[block_id] = None
        seq.block_table.clear()
        seq.table_epoch += 1
        seq.num_cached_tokens = 0

    def invalidate(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and forget their hashes: their KV may never have been written."""
        self._forget(map(self.blocks.__getitem__, seq.block_table))
        self.deallocate(seq)

    def flush(self) -> int:
        """Forget the prefix hashes of every free block (SGLang's /flush_cache); returns how many.

        Blocks in use keep theirs: the sequences holding them still read that KV."""
        cached = [block for block in map(self.blocks.__getitem__, self._free) if block.hash is not None]
        self._forget(cached)
        return len(cached)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step of ``seq`` (writing its last token's KV) has room."""
        return len(seq.block_table) >= seq.num_blocks or len(self._free) > 0

    def may_append(self, seq: Sequence) -> None:
        """Before a step: add a block if the tokens to compute spill past the block table."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free().block_id)

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether blocks for ``num_tokens`` tokens of ``seq`` (a verify step's drafts past its end) are to be had."""
        need = (num_tokens + self.block_size - 1) // self.block_size - len(seq.block_table)
        return need <= len(self._free)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Before a verify step: blocks for ``num_tokens`` tokens (its last token and the drafts after it)."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free().block_id)

    def trim(self, seq: Sequence) -> None:
        """After a verify step: give back the blocks past ``seq``'s tokens (held for drafts that were rejected).

        They were taken fresh for this step and never indexed, so they go to the front of the free list:
        nothing worth keeping is in them."""
        if len(seq.block_table) > seq.num_blocks:
            seq.table_epoch += 1
        while len(seq.block_table) > seq.num_blocks:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    # -- internals -------------------------------------------------------------------------------

    def _take_free_blocks(self, count: int) -> list[int]:
        """``count`` blocks off the cold end of the free list, each with one reference; a block that
        still held a cached prefix loses it (counted as evicted when the index lost an entry)."""
        free = self._free
        if count > len(free):
            raise RuntimeError("KV block pool exhausted")
        taken = list(islice(free, count))
        deque(map(free.pop, taken), maxlen=0)
        cached = []
        for block in map(self.blocks.__getitem__, taken):
            block.ref_count = 1
            if block.hash is not None:
                cached.append(block)
        if cached:
            self._evicted += self._forget(cached)  # reusable prefixes lost: the pool ran short
        return taken

    def _take_free(self) -> Block:
        return self.blocks[self._take_free_blocks(1)[0]]

    def _forget(self, blocks: Iterable[Block]) -> int:
        """Drop the prefix hashes of ``blocks``; how many entries the hash index lost (blocks that were findable)."""
        index, events, dropped = self._hash_to_block, self.events, 0
        for block in blocks:
            h = block.hash
            if h is None:
                continue
            if index.get(h) == block.block_id:
                del index[h]
                dropped += 1
                if events is not None:
                    events.removed(h)
                    if h in self._pending:
                        self._voided.add(h)  # a block still being written reports it stored again
            block.hash = None
            block.token_ids = ()
        if dropped:
            self._index_version += 1
        return dropped
