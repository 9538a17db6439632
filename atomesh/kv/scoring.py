"""kv_aware's decision, in parts composed the way llm-d composes its scheduler: scorers, rules, a picker.

- `overlaps` (the prefix scorer): how many leading blocks of the prompt each candidate holds, from the
  global index of the engines' KV events;
- `LoadEstimate` (the load scorer): the KV blocks each candidate holds for running requests, from this
  gateway's placements, its peers' (`KvPeerSync`) and the engine's own count of the others;
- `relief` and `new_prompt` (rules): a prompt its holder keeps losing, and a prompt nobody holds, are
  placed by where the KV traffic has been least lately instead of by cost;
- `Picker`: Dynamo's cost, lower wins, with its tie-breaks, or a soft choice above temperature 0.

Each part reads the index and the workers and keeps no state but its own (`LoadEstimate`'s averages,
`Picker`'s random source); `atomesh.policies.kv_aware` wires them together.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Sequence

from atomesh.kv.index import KvIndex, Tokens, chain_keys
from atomesh.kv.sync import KvPeerSync, Snapshot
from atomesh.workers.worker import Worker

RECENT = 256  # per worker: new-block counts of the latest placements (estimates active KV)
RELIEF = 0.5  # a thrashed prompt moves to workers evicting at most this share of what its holder evicts
DEFAULT_BLOCK = 16  # a followed worker whose first event has not said its block size yet


def overlaps(
    index: KvIndex,
    followed: Sequence[Worker],
    ids: Tokens,
    keys_by_size: dict[int, list[int]],
    overlap: dict[str, int],
    total: dict[str, int],
) -> None:
    """The prefix scorer: fills `keys_by_size` (the prompt's block keys, per block size in use) and, per
    followed worker, `overlap` (leading blocks it holds) and `total` (the prompt's blocks there)."""
    by_size: dict[int, list[Worker]] = {}
    for w in followed:
        by_size.setdefault(index.block_size(w.url) or DEFAULT_BLOCK, []).append(w)
    for size, group in by_size.items():
        keys = keys_by_size[size] = chain_keys(ids, size)
        for w, o in zip(group, index.overlaps(keys, [index.bit(w.url) for w in group]), strict=True):
            overlap[w.url] = o
            total[w.url] = len(keys)


class LoadEstimate:
    """The load scorer: ``active_w``, the KV blocks worker w holds for running requests.

    This gateway's in-flight requests on w count the new blocks each brought (a shared cached prefix
    counts once); the peer replicas' and the gateway's other processes' in-flight requests count what
    they said (`KvPeerSync`); requests the engine reported at its last poll beyond all of those (other
    clients) count as the new blocks of an average placement of this gateway's each.
    """

    def __init__(self, sync: KvPeerSync) -> None:
        self.sync = sync
        self._recent: dict[str, deque[int]] = {}
        self.mean_blocks = 0.0  # moving average of prompt blocks
        self.mean_new = 0.0  # moving average of the blocks a placement had to compute (not cached)
        self._placed = 0

    def own(self, w: Worker, placing: int = 0) -> float:
        """The new blocks this gateway's in-flight requests on ``w`` brought (``placing``: requests
        recorded but not yet counted in flight)."""
        recent = self._recent.get(w.url)
        mine = w.in_flight + placing
        return float(sum(itertools.islice(reversed(recent), mine))) if recent and mine > 0 else 0.0

    def active(self, w: Worker) -> float:
        active = self.own(w)
        extra = w.foreign_load  # beyond this gateway's requests and the peers' (see KvAwarePolicy.elsewhere)
        if self.sync.active:  # what the peers said they have there, known exactly
            active += self.sync.peer_load(w.url)[1]
        if extra > 0:  # requests the engine runs for others (other gateway replicas, direct clients):
            # their prompts are unknown here, so each counts as the blocks an average placement of
            # ours had to compute (other replicas place the same traffic the same way).
            active += extra * self.mean_new
        return active

    def placed(self, w: Worker, blocks: int, new: int) -> None:
        """A placement on ``w`` of a prompt of ``blocks`` blocks, ``new`` of them not cached there."""
        self._recent.setdefault(w.url, deque(maxlen=RECENT)).append(new)
        # The first prompt sets the averages (from 0 they would take dozens of requests to mean anything).
        if self._placed == 0:
            self.mean_blocks, self.mean_new = float(blocks), float(new)
        else:
            self.mean_blocks += (blocks - self.mean_blocks) * 0.05
            self.mean_new += (new - self.mean_new) * 0.05
        self._placed += 1

    def snapshot(self, workers: Sequence[Worker]) -> Snapshot:
        """What this gateway has in flight, for its peers: worker url -> (requests, new blocks)."""
        return {w.url: (w.in_flight, self.own(w)) for w in workers if w.in_flight > 0}

    def forget(self, w: Worker) -> None:
        self._recent.pop(w.url, None)


def relief(
    index: KvIndex,
    followed: Sequence[Worker],
    overlap: dict[str, int],
    total: dict[str, int],
    keys_by_size: dict[int, list[int]],
) -> list[Worker] | None:
    """The relief rule: the workers to move the prompt to when its holder (the longest overlap) is
    thrashing it: the holder removed the block after what it still holds lately, has evicted at least
    the prompt's blocks lately, and some candidates evict at most RELIEF times as fast. None otherwise.
    Left where it is, every turn of a conversation would compute again what the last one lost."""
    holder = max(followed, key=lambda w: overlap[w.url])
    o, n = overlap[holder.url], total[holder.url]
    if o == 0 or o >= n:
        return None
    keys = keys_by_size[index.block_size(holder.url) or DEFAULT_BLOCK]
    if not index.lost(holder.url, keys[o]):
        return None
    pressure = index.evictions(holder.url)
    if pressure < n:
        return None
    calmer = [w for w in followed if index.evictions(w.url) <= RELIEF * pressure]
    return calmer or None


def is_new(candidates: Sequence[Worker], overlap: dict[str, int], total: dict[str, int], threshold: float) -> bool:
    """The new-prompt rule's test: no candidate holds a real part of the prompt (the overlaps differ by
    less than ``threshold`` of its blocks: a chat template's first blocks, held everywhere, tell the
    workers apart by nothing)."""
    held = [overlap[w.url] for w in candidates]
    return max(held) - min(held) < threshold * max(total[w.url] for w in candidates)


class Picker:
    """Chooses among scored candidates: the lowest cost, a new or relieved prompt by KV traffic, or a
    soft choice at temperature > 0 (probability ∝ exp(-cost' / temperature), costs scaled to 0..1)."""

    def __init__(self, index: KvIndex, temperature: float = 0.0, seed: int | None = None) -> None:
        self.index = index
        self.temperature = temperature
        self._rng = random.Random(seed)

    def soft(self, candidates: Sequence[Worker], costs: list[float]) -> Worker | None:
        """At temperature > 0, a worker drawn by cost; None at 0 or when every cost is the same."""
        if self.temperature <= 0:
            return None
        lo, hi = min(costs), max(costs)
        span = hi - lo
        if span <= 0:
            return None
        weights = [math.exp(-((c - lo) / span) / self.temperature) for c in costs]
        return self._rng.choices(list(candidates), weights)[0]

    def cheapest(self, candidates: Sequence[Worker], costs: list[float], actives: list[float]) -> Worker:
        """The lowest cost; ties: the lower ``active``, then the least KV traffic lately, then at random
        (replicas deciding at the same moment should not all pick the same worker)."""
        best = min(zip(costs, actives, strict=True))
        tied = [i for i in range(len(candidates)) if (costs[i], actives[i]) == best]
        if len(tied) == 1:
            return candidates[tied[0]]
        demand = [self.index.demand(candidates[i].url) for i in tied]
        floor = min(demand) + 1.0
        light = [i for i, d in zip(tied, demand, strict=True) if d <= floor]
        return candidates[light[0] if len(light) == 1 else self._rng.choice(light)]

    def new_prompt(self, candidates: Sequence[Worker], actives: list[float], mean_new: float) -> int:
        """Where a prompt nobody holds goes (the new-prompt rule; also the relief rule's, among the calmer
        workers). Where it goes decides where its follow-ups go, so it goes where the KV traffic has
        been least lately (``KvIndex.demand``: blocks stored, from the engines' events and from
        placements, this replica's and its peers'), within one average placement's new blocks of the
        least; among those to the least in-flight work, then at random. Spread by traffic, not by the
        moment's idleness: a worker that happens to be free when a conversation starts is not given
        more conversations than the others (and, as every replica reads the same events and
        placements, two replicas spread alike). Returns the index into ``candidates``."""
        demand = [self.index.demand(w.url) for w in candidates]
        floor = min(demand) + max(1.0, mean_new)
        light = [i for i, d in enumerate(demand) if d <= floor]
        least = min(actives[i] for i in light)
        light = [i for i in light if actives[i] == least]
        return light[0] if len(light) == 1 else self._rng.choice(light)
