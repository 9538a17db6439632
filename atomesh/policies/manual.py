"""`manual` (SMG): each routing key is pinned to a worker in a table, and stays there.

Unlike consistent_hashing, a worker joining moves no key: a key moves only when its worker stops being
routable (then it gets a new one, and the table keeps the last two, so it returns to the first when
that comes back). A new key goes to a worker chosen by `--assignment-mode` (random, min_load: fewest
requests, min_group: fewest keys); a request without a key is placed the same way and pins nothing.
Keys unused for `--max-idle-secs` are forgotten every `--eviction-interval-secs`. The key is read from
the routing-key headers (`X-SMG-Routing-Key` first, `--routing-key-headers`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from atomesh.config import AssignmentMode, PolicyName
from atomesh.policies.base import CacheStats, Decision, Given, Loads, Needs, Replica, least_loaded, slot_setter
from atomesh.request import RequestView
from atomesh.tasks import PeriodicTask
from atomesh.workers.worker import Worker

MAX_CANDIDATES = 2  # workers remembered per key, latest last (SMG's bound)


@dataclass(slots=True)
class _Pin:
    urls: list[str]
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True, init=False)
class ManualDecision(Decision):
    """The choice, and the key `record` pins to it (None: nothing to pin, the key already points there)."""

    key: str | None

    def __init__(self, worker: Worker, reason: str, key: str | None) -> None:
        Decision.__init__(self, worker, reason)
        _set_key(self, key)  # made per placement: see slot_setter


_set_key = slot_setter(ManualDecision, "key")


class ManualPolicy:
    name = PolicyName.MANUAL
    select_single = True  # a lone worker still gets the key pinned, so it keeps it when others join

    def __init__(
        self,
        assignment: AssignmentMode = AssignmentMode.RANDOM,
        max_idle_secs: float = 14400,
        eviction_interval_secs: float = 60,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.assignment = assignment
        self.max_idle_secs = max_idle_secs
        self._rng = rng or random.Random()
        self._clock = clock
        self.pins: dict[str, _Pin] = {}
        self._keys_held: dict[str, int] = {}  # worker URL -> keys whose latest worker it is (min_group)
        self._eviction = PeriodicTask("manual-eviction", eviction_interval_secs, self.evict)
        # Only min_load compares loads.
        self.needs = Needs(loads=Loads.POLLED if assignment is AssignmentMode.MIN_LOAD else Loads.UNUSED)

    def attach(self, given: Given) -> None:
        pass

    def elsewhere(self, worker: Worker) -> int:
        return 0

    def replicas(self) -> Mapping[str, Replica]:
        return {}

    def export(self) -> CacheStats | None:
        return None

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        key = view.routing_key
        if key is None:
            return ManualDecision(self._new(candidates), "no_routing_key", None)
        pin = self.pins.get(key)
        if pin is not None:
            pin.last_used = self._clock()
            by_url = {w.url: w for w in candidates}
            for url in reversed(pin.urls):  # the latest first
                if url in by_url:
                    # A key back on its older worker makes that one its latest again.
                    return ManualDecision(by_url[url], "pinned", None if url == pin.urls[-1] else key)
            return ManualDecision(self._new(candidates), "pinned_worker_gone", key)
        return ManualDecision(self._new(candidates), "new_key", key)

    def _new(self, candidates: Sequence[Worker]) -> Worker:
        if self.assignment is AssignmentMode.MIN_LOAD:
            return least_loaded(candidates, self._rng.randrange(len(candidates)))
        if self.assignment is AssignmentMode.MIN_GROUP:
            start = self._rng.randrange(len(candidates))
            rotated = [*candidates[start:], *candidates[:start]]  # ties spread at random
            return min(rotated, key=lambda w: self._keys_held.get(w.url, 0))
        return candidates[self._rng.randrange(len(candidates))]

    def record(self, decision: Decision, view: RequestView) -> None:
        key = decision.key if isinstance(decision, ManualDecision) else None
        if key is None:
            return
        url = decision.worker.url
        pin = self.pins.get(key)
        if pin is None:
            self.pins[key] = _Pin([url], self._clock())
        else:
            self._keys_held[pin.urls[-1]] -= 1
            if url in pin.urls:
                pin.urls.remove(url)
            pin.urls.append(url)
            del pin.urls[:-MAX_CANDIDATES]
        self._keys_held[url] = self._keys_held.get(url, 0) + 1

    def evict(self) -> int:
        """Forget keys idle longer than `max_idle_secs`; returns how many."""
        cutoff = self._clock() - self.max_idle_secs
        idle = [k for k, pin in self.pins.items() if pin.last_used < cutoff]
        for k in idle:
            self._keys_held[self.pins.pop(k).urls[-1]] -= 1
        return len(idle)

    def released(self, worker: Worker) -> None:
        pass

    def on_worker_removed(self, worker: Worker) -> None:
        pass  # its keys move when next used (the table keeps their other worker)

    def start(self) -> None:
        self._eviction.start()

    async def stop(self) -> None:
        await self._eviction.stop()
