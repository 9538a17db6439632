"""`consistent_hashing`: SMG's session affinity on a hash ring, with header overrides.

In order (as SMG):

1. `X-SMG-Target-Worker`: that worker, named by its URL or by its 0-based index among the routable
   workers of the pool in registration order (as `GET /workers` lists them); one that is not routable
   is a 503, never a silent fallback.
2. A routing key (`X-SMG-Routing-Key`, else `X-Session-Id`, `X-Routing-Key`, `X-User-Id`): hashed onto
   a ring of virtual nodes; the first worker clockwise owns it, so only the keys of a worker that comes
   or goes move.
3. An implicit key from stable client headers (`Authorization`, else `X-Forwarded-For`, else `Cookie`):
   the same ring, so one client's requests keep to one worker.
4. Otherwise a uniformly random worker.

Load is not looked at: affinity is the point. (prefix_hash is the load-bounded variant.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from atomesh.config import PolicyName
from atomesh.errors import NoWorkerAvailable
from atomesh.policies.base import Decision, Stateless
from atomesh.policies.prefix_hash import VNODES, RingCache
from atomesh.request import RequestView
from atomesh.workers.worker import Worker

TARGET_HEADER = "x-smg-target-worker"
IMPLICIT_KEY_HEADERS = ("authorization", "x-forwarded-for", "cookie")


class ConsistentHashingPolicy(Stateless):
    name = PolicyName.CONSISTENT_HASHING
    select_single = True  # placement asks even with one candidate: X-SMG-Target-Worker may name another

    def __init__(self, vnodes: int = VNODES, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self.rings = RingCache(vnodes)

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        headers = view.headers
        target = headers.get(TARGET_HEADER)
        if target is not None:
            return Decision(_target(candidates, target.strip()), "target_header")
        key = view.routing_key
        if key is not None:
            return Decision(
                self.rings.ring(candidates).owner(xxhash.xxh3_64_intdigest(b"key:" + key.encode())), "routing_key"
            )
        for name in IMPLICIT_KEY_HEADERS:
            value = headers.get(name)
            if value:
                owner = self.rings.ring(candidates).owner(xxhash.xxh3_64_intdigest(b"client:" + value.encode()))
                return Decision(owner, "client_header")
        return Decision(candidates[self._rng.randrange(len(candidates))], "random")


def _target(candidates: Sequence[Worker], target: str) -> Worker:
    if target.isdigit():
        index = int(target)
        if index < len(candidates):
            return candidates[index]
    else:
        url = target.rstrip("/")
        for w in candidates:
            if w.url == url or w.id == target:
                return w
    raise NoWorkerAvailable(f"X-SMG-Target-Worker {target[:200]!r} is not a routable worker of this pool")
