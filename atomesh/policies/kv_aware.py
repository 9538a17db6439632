"""`kv_aware`: place a request where the engines report holding its prompt's KV, weighed against load.

Per request, over the candidates that publish KV events (atomesh.kv.events):

1. The prompt's token ids, as the engine will see them (atomesh.kv.tokens: the engine's
   tokenizer and chat template), cut into the engine's blocks and keyed (atomesh.kv.index).
2. ``overlap_w``: how many leading blocks worker w holds, from the global index built from the
   engines' own events (so evictions, and blocks cached by traffic from other gateways, count):
   the prefix scorer, `atomesh.kv.scoring.overlaps`.
3. Dynamo's cost, lower wins::

       cost_w = overlap_weight * prefill_blocks_w + decode_blocks_w
       prefill_blocks_w = n - overlap_w               (blocks this request must compute on w)
       decode_blocks_w  = active_w + n - overlap_w    (KV blocks w holds for running requests after it)

   ``active_w`` is estimated from this gateway's in-flight requests on w (the new blocks each
   brought; a shared cached prefix counts once), what its peer replicas (``--kv-sync-peers``) and
   the gateway's other processes (``--processes``) said they have there, plus the requests the
   engine reported at its last load poll beyond all of those (other clients), each counted as the
   new blocks of an average placement of this gateway's: the load scorer, `LoadEstimate`.
4. At temperature 0, a new prompt (no candidate holds a real part of it: the overlaps differ by less than
   ``new_threshold``, --cache-threshold, of its blocks) skips the cost: it goes where the KV traffic
   has been least lately (``Picker.new_prompt``), since where it goes decides where its follow-ups go.
   So does a prompt its holder is thrashing (``relief``): the holder has just evicted the block
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
yet, the whole decision is cache_aware's. `record` reads only what `select` decided (`KvDecision`),
so kv_aware decides even for a lone candidate (`select_single`): a placement made without
it (a sticky routing key) is recorded in cache_aware's index only, until the engine's events say.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from atomesh.config import PolicyName
from atomesh.kv.index import KvIndex
from atomesh.kv.scoring import LoadEstimate, Picker, is_new, overlaps, relief
from atomesh.kv.sync import KvPeerSync, Snapshot
from atomesh.kv.tokens import PromptTokenizer, TokenizerFetch
from atomesh.policies.base import CacheStats, Decision, Given, Loads, Needs, Replica, slot_setter
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.request import RequestView
from atomesh.workers.worker import Worker

if TYPE_CHECKING:
    from atomesh.kv.events import KvEventHub

log = structlog.get_logger("atomesh.policies")
_stdlog = logging.getLogger("atomesh.policies")


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
    select_single = True  # a lone candidate too: `record` predicts its blocks from the decision's keys
    needs = Needs(loads=Loads.FRESH, kv_events=True, upstream=True)

    def __init__(
        self,
        fallback: CacheAwarePolicy,
        *,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        new_threshold: float = 0.3,
        tokenizer: PromptTokenizer | None = None,
        index: KvIndex | None = None,
        seed: int | None = None,
        sync: KvPeerSync | None = None,
    ) -> None:
        self.fallback = fallback
        self.overlap_weight = overlap_weight
        self.new_threshold = new_threshold
        self.tokenizer = tokenizer
        self.index = index or KvIndex()
        self.hub: KvEventHub | None = None
        # Other gateway replicas' (--kv-sync-peers) and processes' (--processes) in-flight placements.
        self.sync = sync or KvPeerSync(None, [])
        self.sync.attach(self._snapshot, self._peer_placed)
        self.load = LoadEstimate(self.sync)
        self.picker = Picker(self.index, temperature, seed)
        self.fetch: TokenizerFetch | None = None  # asks a worker for its tokenizer when none was configured
        self.decisions = 0  # decided from events
        self.fallbacks = 0  # decided by cache_aware
        self.reliefs = 0  # moved off a holder that was thrashing the prompt (relief)
        self.hit_blocks = 0  # blocks of chosen workers' overlaps
        self.prompt_blocks = 0

    # ------------------------------------------------------------------ what the gateway gives and reads
    def attach(self, given: Given) -> None:
        """Follow the KV events of the pool's workers (the hub's index becomes this policy's) and ask a
        worker for its tokenizer when none was configured."""
        if given.hub is not None:
            self.hub = given.hub
            self.index = self.picker.index = given.hub.index
        if given.hub is not None and given.upstream is not None:
            self.fetch = TokenizerFetch(
                given.upstream, given.registry, given.hub.roles, self._tokenizer_fetched, lambda: self.tokenizer is None
            )

    def _tokenizer_fetched(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer

    def elsewhere(self, worker: Worker) -> int:
        """Requests the peer replicas and the gateway's other processes said they have in flight on
        ``worker``; the load poller leaves them out of the engine's foreign load."""
        return self.sync.peer_load(worker.url)[0] if self.sync.active else 0

    def replicas(self) -> Mapping[str, Replica]:
        """The gateway's processes exchange their in-flight placements (as replicas do over --kv-sync-*),
        and cache_aware's index, which scores workers without events."""
        return {"kv_placements": self.sync, **self.fallback.replicas()}

    def export(self) -> CacheStats:
        return self.fallback.export()

    def start(self) -> None:
        self.fallback.start()
        self.sync.start()
        if self.hub is not None:
            self.hub.start()
        if self.fetch is not None:
            self.fetch.start()

    async def stop(self) -> None:
        if self.fetch is not None:
            await self.fetch.stop()
        if self.hub is not None:
            await self.hub.stop()
        await self.sync.stop()
        await self.fallback.stop()

    # ------------------------------------------------------------------ decision
    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        tok, index = self.tokenizer, self.index
        if self.sync.active:
            self.sync.poll()  # the peers' latest placements and releases
        followed = [w for w in candidates if index.follows(w.url)]
        ids = tok.ids(view) if followed and tok is not None else None
        if ids is None:
            self.fallbacks += 1
            return self.fallback.select(candidates, view)
        keys_by_size: dict[int, list[int]] = {}
        overlap: dict[str, int] = {}
        total: dict[str, int] = {}
        overlaps(index, followed, ids, keys_by_size, overlap, total)
        others = [w for w in candidates if w.url not in overlap]
        if others:  # no events from these: cache_aware's approximate index stands in
            fallback = self.fallback
            hashes, size_chars = fallback.index.hashes(view.locality_text)
            n = len(keys_by_size[next(iter(keys_by_size))])
            for w in others:
                held = fallback.index.matched_chars(fallback.held(hashes, w), size_chars) if hashes else 0
                overlap[w.url] = int(n * held / size_chars) if size_chars else 0
                total[w.url] = n
        moved = relief(index, followed, overlap, total, keys_by_size)
        worker = self._choose(candidates, overlap, total, moved)
        if _stdlog.isEnabledFor(logging.DEBUG):
            log.debug(
                "kv_aware_decision",
                chosen=worker.url,
                blocks=total[worker.url],
                relief=[w.url for w in moved] if moved else None,
                evictions={w.url: round(self.index.evictions(w.url)) for w in followed},
                overlap={w.url: overlap[w.url] for w in candidates},
                active={w.url: self.load.active(w) for w in candidates},
                in_flight={w.url: w.in_flight for w in candidates},
                foreign={w.url: w.foreign_load for w in candidates},
                peers={w.url: self.sync.peer_load(w.url)[0] for w in candidates} if self.sync.active else None,
            )
        new = {w.url: total[w.url] - overlap[w.url] for w in candidates}
        self.decisions += 1
        self.hit_blocks += overlap[worker.url]
        self.prompt_blocks += total[worker.url]
        return KvDecision(worker, "kv_overlap" if overlap[worker.url] else "kv_cost", keys_by_size, new)

    def _choose(
        self,
        candidates: Sequence[Worker],
        overlap: dict[str, int],
        total: dict[str, int],
        moved: list[Worker] | None = None,
    ) -> Worker:
        """Dynamo's cost per candidate, then the picker: a soft choice, the relief or new-prompt rule, or
        the cheapest."""
        ow = self.overlap_weight
        costs: list[float] = []
        actives: list[float] = []
        for w in candidates:
            new = total[w.url] - overlap[w.url]
            active = self.load.active(w)
            costs.append(ow * new + active + new)
            actives.append(active)
        picker = self.picker
        soft = picker.soft(candidates, costs)
        if soft is not None:
            return soft
        if moved:  # its holder keeps losing it: placed as new, among the workers under less pressure
            self.reliefs += 1
            idx = [i for i, w in enumerate(candidates) if w in moved]
            chosen = picker.new_prompt([candidates[i] for i in idx], [actives[i] for i in idx], self.load.mean_new)
            return candidates[idx[chosen]]
        if is_new(candidates, overlap, total, self.new_threshold):
            return candidates[picker.new_prompt(candidates, actives, self.load.mean_new)]
        return picker.cheapest(candidates, costs, actives)

    def record(self, decision: Decision, view: RequestView) -> None:
        worker = decision.worker
        if not isinstance(decision, KvDecision):
            # cache_aware decided (no event-publishing candidate, or no tokenizer yet), or placement did
            # without asking (a sticky routing key): cache_aware's index learns it; the engine's events
            # will say what the worker holds.
            self.fallback.record(decision, view)
            return
        keys_by_size, new = decision.keys_by_size, decision.new
        size = self.index.block_size(worker.url)
        if size is not None and size in keys_by_size:
            keys = keys_by_size[size]
            # Only what it does not hold yet: the held prefix is in the index already.
            fresh = keys[len(keys) - new.get(worker.url, len(keys)) :]
            self.index.predict(worker.url, fresh)
        else:  # a worker without events: keep cache_aware's index, which scores it, up to date
            self.fallback.record(Decision(worker, "kv_no_events"), view)
        blocks = new.get(worker.url, 0)
        self.load.placed(worker, len(keys_by_size[next(iter(keys_by_size))]), blocks)
        if self.sync.active and size is not None and size in keys_by_size:
            keys = keys_by_size[size]
            self.sync.placed(
                worker.url,
                keys[len(keys) - blocks :] if blocks else [],
                (worker.in_flight + 1, self.load.own(worker, placing=1)),
            )

    def _snapshot(self) -> Snapshot:
        return self.load.snapshot(list(self.hub.registry)) if self.hub is not None else {}

    def _peer_placed(self, url: str, keys: list[int]) -> None:
        self.index.predict(url, keys)  # as our own placements: until the engine's events confirm them

    def released(self, worker: Worker) -> None:
        if self.sync.active:  # the peers stop counting it at once, not at the next tick
            self.sync.changed()

    def on_worker_removed(self, worker: Worker) -> None:
        self.load.forget(worker)
        self.fallback.on_worker_removed(worker)
