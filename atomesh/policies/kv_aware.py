"""`kv_aware`: place a request where the engines report holding its prompt's KV, weighed against load.

Per request, over the candidates that publish KV events (atomesh.workers.kv_events):

1. The prompt's token ids, as the engine will see them (atomesh.prompt_tokens: the engine's
   tokenizer and chat template), cut into the engine's blocks and keyed (atomesh.kv_index).
2. ``overlap_w``: how many leading blocks worker w holds, from the global index built from the
   engines' own events (so evictions, and blocks cached by traffic from other gateways, count).
3. Dynamo's cost, lower wins::

       cost_w = overlap_weight * prefill_blocks_w + decode_blocks_w
       prefill_blocks_w = n - overlap_w               (blocks this request must compute on w)
       decode_blocks_w  = active_w + n - overlap_w    (KV blocks w holds for running requests after it)

   ``active_w`` is estimated from this gateway's in-flight requests on w (the new blocks each
   brought; a shared cached prefix counts once), what its peer replicas said they have there
   (``--kv-sync-peers``), plus the requests the engine reported at its last load poll beyond all
   of those (other clients), each counted as the new blocks of an average placement of this
   gateway's.
4. At temperature 0, a new prompt (no candidate holds a real part of it: the overlaps differ by less than
   ``new_threshold``, --cache-threshold, of its blocks) skips the cost: it goes where the KV traffic
   has been least lately (``_place_new``), since where it goes decides where its follow-ups go.
   So does a prompt its holder is thrashing (``_relief``): the holder has just evicted the block
   after the part it still holds, and evicts blocks at least twice as fast lately as some other
   candidate; it goes as a new prompt would, among those calmer workers. Left where it is, every
   turn of a conversation would compute again what the last one lost.
5. ``temperature`` 0: the lowest cost (ties: lower ``active_w``, then the least KV traffic lately,
   then at random). Above 0: a soft choice, probability ∝ exp(-cost' / temperature) with costs
   scaled to 0..1 (Dynamo's form).

The chosen worker is predicted to hold the prompt's blocks for a couple of seconds, until its own
events say so, so that a burst sharing a new prefix follows the first request instead of
scattering. Workers without events are scored through cache_aware's approximate index
(overlap = its matched share of the prompt); with no event-publishing candidate, or no tokenizer
yet, the whole decision is cache_aware's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import structlog

from atomesh.config import PolicyName
from atomesh.kv_index import KvIndex, chain_keys
from atomesh.policies.base import Decision, slot_setter
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.policies.kv_sync import KvPeerSync, Snapshot
from atomesh.prompt_tokens import PromptTokenizer, TokenizerUnavailable
from atomesh.request import RequestView
from atomesh.transport import Upstream
from atomesh.workers.kv_events import KvEventHub
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState

log = structlog.get_logger("atomesh.policies")
_stdlog = logging.getLogger("atomesh.policies")

RECENT = 256  # per worker: new-block counts of the latest placements (estimates active KV)
RELIEF = 0.5  # a thrashed prompt moves to workers evicting at most this share of what its holder evicts


@dataclass(frozen=True, slots=True, init=False)
class KvDecision(Decision):
    """A choice made from the engines' events: the prompt's block keys (per block size) and how many
    blocks each candidate would have had to compute, for `record`."""

    keys_by_size: dict[int, list[int]]
    new: dict[str, int]

    def __init__(self, worker: Worker, reason: str, keys_by_size: dict[int, list[int]], new: dict[str, int]) -> None:
        Decision.__init__(self, worker, reason)
        _set_keys(self, keys_by_size)  # made per placement: see slot_setter
        _set_new(self, new)


_set_keys, _set_new = slot_setter(KvDecision, "keys_by_size"), slot_setter(KvDecision, "new")


class KvAwarePolicy:
    """Cost = overlap_weight * blocks to prefill + KV load, from the engines' KV events."""

    name = PolicyName.KV_AWARE
    select_single = False

    def __init__(self, fallback: CacheAwarePolicy, *, overlap_weight: float = 1.0, temperature: float = 0.0,
                 new_threshold: float = 0.3,
                 tokenizer: PromptTokenizer | None = None, index: KvIndex | None = None,
                 seed: int | None = None, sync: KvPeerSync | None = None) -> None:
        self.fallback = fallback
        self.overlap_weight = overlap_weight
        self.new_threshold = new_threshold
        self.temperature = temperature
        self.tokenizer = tokenizer
        self.index = index or KvIndex()
        self.hub: KvEventHub | None = None
        self.sync = sync  # other gateway replicas' in-flight placements (--kv-sync-peers)
        if sync is not None:
            sync.attach(self._snapshot, self._peer_placed)
        self._upstream: Upstream | None = None
        self._rng = random.Random(seed)
        self._recent: dict[str, deque[int]] = {}
        self._mean_blocks = 0.0  # moving average of prompt blocks
        self._mean_new = 0.0  # moving average of the blocks a placement had to compute (not cached)
        self._placed = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.decisions = 0  # decided from events
        self.fallbacks = 0  # decided by cache_aware
        self.reliefs = 0  # moved off a holder that was thrashing the prompt (_relief)
        self.hit_blocks = 0  # blocks of chosen workers' overlaps
        self.prompt_blocks = 0

    # ------------------------------------------------------------------ wiring
    def watch(self, registry: WorkerRegistry, upstream: Upstream, roles: tuple[WorkerRole, ...],
              endpoints: Mapping[str, str]) -> None:
        """Follow the KV events of the workers in `roles` (the gateway calls this once)."""
        self.hub = KvEventHub(self.index, registry, roles, endpoints)
        self._upstream = upstream
        registry.subscribe(self._on_state)

    def _on_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if (new is WorkerState.READY and self.tokenizer is None and self._upstream is not None
                and self.hub is not None and worker.role in self.hub.roles and not self._tasks):
            with contextlib.suppress(RuntimeError):  # no running loop: start() picks it up
                t = asyncio.get_running_loop().create_task(self._fetch_tokenizer(worker), name="kv-aware-tokenizer")
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _fetch_tokenizer(self, worker: Worker) -> None:
        assert self._upstream is not None
        try:
            info = await self._upstream.get_json(worker.url + "/tokenizer_info", 10.0,
                                                 self._upstream.worker_headers(worker))
            if isinstance(info, dict) and self.tokenizer is None:
                self.tokenizer = await asyncio.to_thread(PromptTokenizer.from_info, info)
                log.info("kv_aware_tokenizer_loaded", worker=worker.url, kind=info.get("kind"))
        except (TokenizerUnavailable, KeyError, ValueError) as e:
            log.warning("kv_aware_tokenizer_unavailable", worker=worker.url, error=str(e))
        except Exception as e:  # the worker does not serve /tokenizer_info: cache_aware decides meanwhile
            log.warning("kv_aware_tokenizer_unavailable", worker=worker.url, error=str(e))

    def start(self) -> None:
        self.fallback.start()
        if self.sync is not None:
            self.sync.start()
        if self.hub is not None:
            self.hub.start()
            if self.tokenizer is None:
                for w in self.hub.registry:
                    if w.state is WorkerState.READY:
                        self._on_state(w, None, WorkerState.READY)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.hub is not None:
            await self.hub.stop()
        if self.sync is not None:
            await self.sync.stop()
        await self.fallback.stop()

    # ------------------------------------------------------------------ decision
    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        tok, index = self.tokenizer, self.index
        if self.sync is not None:
            self.sync.poll()  # the peers' latest placements and releases
        followed = [w for w in candidates if index.follows(w.url)]
        ids = tok.ids(view) if followed and tok is not None else None
        if ids is None:
            self.fallbacks += 1
            return self.fallback.select(candidates, view)
        keys_by_size: dict[int, list[int]] = {}
        overlap: dict[str, int] = {}
        total: dict[str, int] = {}
        by_size: dict[int, list[Worker]] = {}
        for w in followed:
            by_size.setdefault(index.block_size(w.url) or 16, []).append(w)
        for size, group in by_size.items():
            keys = keys_by_size[size] = chain_keys(ids, size)
            for w, o in zip(group, index.overlaps(keys, [index.bit(w.url) for w in group]), strict=True):
                overlap[w.url] = o
                total[w.url] = len(keys)
        others = [w for w in candidates if w.url not in overlap]
        if others:  # no events from these: cache_aware's approximate index stands in
            hashes, size_chars = self.fallback.index.hashes(view.locality_text)
            n = len(keys_by_size[next(iter(keys_by_size))])
            for w in others:
                held = self.fallback.index.matched_chars(self.fallback._held(hashes, w), size_chars) if hashes else 0
                overlap[w.url] = int(n * held / size_chars) if size_chars else 0
                total[w.url] = n
        relief = self._relief(followed, overlap, total, keys_by_size)
        worker = self._choose(candidates, overlap, total, relief)
        if _stdlog.isEnabledFor(logging.DEBUG):
            log.debug("kv_aware_decision", chosen=worker.url, blocks=total[worker.url],
                      relief=[w.url for w in relief] if relief else None,
                      evictions={w.url: round(self.index.evictions(w.url)) for w in followed},
                      overlap={w.url: overlap[w.url] for w in candidates},
                      active={w.url: self._active(w) for w in candidates},
                      in_flight={w.url: w.in_flight for w in candidates},
                      foreign={w.url: w.foreign_load for w in candidates},
                      peers={w.url: self.sync.peer_load(w.url)[0] for w in candidates} if self.sync else None)
        new = {w.url: total[w.url] - overlap[w.url] for w in candidates}
        self.decisions += 1
        self.hit_blocks += overlap[worker.url]
        self.prompt_blocks += total[worker.url]
        return KvDecision(worker, "kv_overlap" if overlap[worker.url] else "kv_cost", keys_by_size, new)

    def _own(self, w: Worker, placing: int = 0) -> float:
        """The new blocks this gateway's in-flight requests on ``w`` brought (``placing``: requests
        recorded but not yet counted in flight)."""
        recent = self._recent.get(w.url)
        mine = w.in_flight + placing
        return float(sum(itertools.islice(reversed(recent), mine))) if recent and mine > 0 else 0.0

    def _snapshot(self) -> Snapshot:
        if self.hub is None:
            return {}
        return {w.url: (w.in_flight, self._own(w)) for w in self.hub.registry if w.in_flight > 0}

    def _peer_placed(self, url: str, keys: list[int]) -> None:
        self.index.predict(url, keys)  # as our own placements: until the engine's events confirm them

    def peer_requests(self, w: Worker) -> int:
        """Requests the peer replicas (--kv-sync-peers) said they have in flight on ``w``; the load
        poller leaves them out of the engine's foreign load."""
        return self.sync.peer_load(w.url)[0] if self.sync is not None else 0

    def _active(self, w: Worker) -> float:
        active = self._own(w)
        extra = w.foreign_load  # beyond this gateway's requests and the peers' (see peer_requests)
        if self.sync is not None:  # what the peer replicas said they have there, known exactly
            active += self.sync.peer_load(w.url)[1]
        if extra > 0:  # requests the engine runs for others (other gateway replicas, direct clients):
            # their prompts are unknown here, so each counts as the blocks an average placement of
            # ours had to compute (other replicas place the same traffic the same way).
            active += extra * self._mean_new
        return active

    def _relief(self, followed: list[Worker], overlap: dict[str, int], total: dict[str, int],
                keys_by_size: dict[int, list[int]]) -> list[Worker] | None:
        """The workers to move the prompt to when its holder (the longest overlap) is thrashing it: the
        holder removed the block after what it still holds lately, has evicted at least the prompt's
        blocks lately, and some candidates evict at most RELIEF times as fast. None otherwise."""
        index = self.index
        holder = max(followed, key=lambda w: overlap[w.url])
        o, n = overlap[holder.url], total[holder.url]
        if o == 0 or o >= n:
            return None
        keys = keys_by_size[index.block_size(holder.url) or 16]
        if not index.lost(holder.url, keys[o]):
            return None
        pressure = index.evictions(holder.url)
        if pressure < n:
            return None
        calmer = [w for w in followed if index.evictions(w.url) <= RELIEF * pressure]
        return calmer or None

    def _choose(self, candidates: Sequence[Worker], overlap: dict[str, int], total: dict[str, int],
                relief: list[Worker] | None = None) -> Worker:
        ow = self.overlap_weight
        costs: list[float] = []
        actives: list[float] = []
        for w in candidates:
            new = total[w.url] - overlap[w.url]
            active = self._active(w)
            costs.append(ow * new + active + new)
            actives.append(active)
        n = len(candidates)
        if self.temperature > 0:
            lo, hi = min(costs), max(costs)
            span = hi - lo
            if span > 0:
                weights = [math.exp(-((c - lo) / span) / self.temperature) for c in costs]
                return self._rng.choices(list(candidates), weights)[0]
        if relief:  # its holder keeps losing it: placed as new, among the workers under less pressure
            self.reliefs += 1
            idx = [i for i, w in enumerate(candidates) if w in relief]
            return candidates[idx[self._place_new([candidates[i] for i in idx], [actives[i] for i in idx])]]
        held = [overlap[w.url] for w in candidates]
        if max(held) - min(held) < self.new_threshold * max(total[w.url] for w in candidates):
            return candidates[self._place_new(candidates, actives)]
        best = min(zip(costs, actives, strict=True))
        tied = [i for i in range(n) if (costs[i], actives[i]) == best]
        if len(tied) == 1:
            return candidates[tied[0]]
        # Equal costs: the least KV traffic lately, then at random (replicas deciding at the same
        # moment should not all pick the same worker).
        demand = [self.index.demand(candidates[i].url) for i in tied]
        floor = min(demand) + 1.0
        light = [i for i, d in zip(tied, demand, strict=True) if d <= floor]
        return candidates[light[0] if len(light) == 1 else self._rng.choice(light)]

    def _place_new(self, candidates: Sequence[Worker], actives: list[float]) -> int:
        """A prompt no candidate holds a real part of (the overlaps differ by less than ``new_threshold``
        of its blocks: a chat template's first blocks, held everywhere, tell the workers apart by
        nothing). Where it goes decides where its follow-ups go, so it goes where the KV traffic has
        been least lately (``KvIndex.demand``: blocks stored, from the engines' events and from
        placements, this replica's and its peers'), within one average placement's new blocks of the
        least; among those to the least in-flight work, then at random. Spread by traffic, not by the
        moment's idleness: a worker that happens to be free when a conversation starts is not given
        more conversations than the others (and, as every replica reads the same events and
        placements, two replicas spread alike)."""
        demand = [self.index.demand(w.url) for w in candidates]
        floor = min(demand) + max(1.0, self._mean_new)
        light = [i for i, d in enumerate(demand) if d <= floor]
        least = min(actives[i] for i in light)
        light = [i for i in light if actives[i] == least]
        return light[0] if len(light) == 1 else self._rng.choice(light)

    def record(self, decision: Decision, view: RequestView) -> None:
        worker = decision.worker
        if not isinstance(decision, KvDecision):
            # cache_aware decided (or placement took a lone candidate): keep its index warm, and predict
            # the blocks an event-publishing worker is about to hold.
            self.fallback.record(decision, view)
            if self.index.follows(worker.url) and self.tokenizer is not None:
                ids = self.tokenizer.ids(view)
                size = self.index.block_size(worker.url)
                if ids is not None and size:
                    self.index.predict(worker.url, chain_keys(ids, size))
            return
        keys_by_size, new = decision.keys_by_size, decision.new
        size = self.index.block_size(worker.url)
        if size is not None and size in keys_by_size:
            keys = keys_by_size[size]
            # Only what it does not hold yet: the held prefix is in the index already.
            fresh = keys[len(keys) - new.get(worker.url, len(keys)):]
            self.index.predict(worker.url, fresh)
        else:  # a worker without events: keep cache_aware's index, which scores it, up to date
            self.fallback.record(Decision(worker, "kv_no_events"), view)
        blocks = new.get(worker.url, 0)
        self._recent.setdefault(worker.url, deque(maxlen=RECENT)).append(blocks)
        n = len(keys_by_size[next(iter(keys_by_size))])
        # The first prompt sets the averages (from 0 they would take dozens of requests to mean anything).
        if self._placed == 0:
            self._mean_blocks, self._mean_new = float(n), float(blocks)
        else:
            self._mean_blocks += (n - self._mean_blocks) * 0.05
            self._mean_new += (blocks - self._mean_new) * 0.05
        self._placed += 1
        if self.sync is not None and size is not None and size in keys_by_size:
            keys = keys_by_size[size]
            self.sync.placed(worker.url, keys[len(keys) - blocks:] if blocks else [],
                             (worker.in_flight + 1, self._own(worker, placing=1)))

    def released(self, worker: Worker) -> None:
        if self.sync is not None:  # the peers stop counting it at once, not at the next tick
            self.sync.changed()

    def on_worker_removed(self, worker: Worker) -> None:
        self._recent.pop(worker.url, None)
        self.fallback.on_worker_removed(worker)

    # ------------------------------------------------------------------ metrics
    @property
    def followed(self) -> Collection[str]:
        return self.hub.streams.keys() if self.hub is not None else ()
