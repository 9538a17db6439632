"""`prefix_hash`: consistent hashing of a routing key or of the prompt's first tokens, with bounded load.

The key is the request's routing key header (`x-smg-routing-key`, `x-session-id`, `x-routing-key`,
`x-user-id`) when it has one, else the first `--prefix-token-count` tokens of the prompt: real tokens
when the gateway has a tokenizer (`--model-path` / `--tokenizer-path`, chat messages rendered with the
chat template), else approximated as 4 characters per token (as SMG does for text). The key is
hashed (xxh3) onto a ring of virtual nodes (`VNODES` per worker); the first worker clockwise owns
it. Adding or removing a worker moves only the keys of the arcs it gains or loses. As in SMG, a
worker whose load is above `max(avg * load_factor, avg + abs_slack)` is passed over for the next
distinct worker on the ring, and when every worker is above the bound the least loaded one is taken.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence

import xxhash

from atomesh.config import PolicyName
from atomesh.kv.tokens import PromptTokenizer
from atomesh.policies.base import Decision, Stateless, least_loaded
from atomesh.request import RequestView
from atomesh.workers.worker import Worker

CHARS_PER_TOKEN = 4
VNODES = 160


class HashRing:
    """Virtual-node ring over a fixed worker set; placement of a key depends only on the URLs."""

    def __init__(self, workers: Sequence[Worker], vnodes: int = VNODES) -> None:
        points: list[tuple[int, int]] = []
        for i, w in enumerate(workers):
            for v in range(vnodes):
                points.append((xxhash.xxh3_64_intdigest(f"{w.url}#{v}".encode()), i))
        points.sort()
        self.workers = tuple(workers)
        self._keys = [p for p, _ in points]
        self._owners = [i for _, i in points]

    def walk(self, key_hash: int) -> list[Worker]:
        """Distinct workers in ring order starting at the owner of `key_hash`."""
        n = len(self._keys)
        start = bisect.bisect_left(self._keys, key_hash) % n
        seen: list[int] = []
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.workers):
                    break
        return [self.workers[i] for i in seen]

    def owner(self, key_hash: int) -> Worker:
        start = bisect.bisect_left(self._keys, key_hash) % len(self._keys)
        return self.workers[self._owners[start]]


class RingCache:
    """The ring of the current candidate set, rebuilt only when that set changes (churn, health,
    breakers, retries' exclusions)."""

    def __init__(self, vnodes: int = VNODES) -> None:
        self.vnodes = vnodes
        self._ring: HashRing | None = None
        self._key: tuple[str, ...] = ()

    def ring(self, candidates: Sequence[Worker]) -> HashRing:
        key = tuple(sorted(w.url for w in candidates))
        if self._ring is None or key != self._key:
            self._ring = HashRing(sorted(candidates, key=lambda w: w.url), self.vnodes)
            self._key = key
        return self._ring


class PrefixHashPolicy(Stateless):
    name = PolicyName.PREFIX_HASH

    def __init__(
        self,
        prefix_token_count: int = 256,
        load_factor: float = 1.25,
        abs_slack: int = 10,
        vnodes: int = VNODES,
        tokens: PromptTokenizer | None = None,
    ) -> None:
        self.prefix_tokens = prefix_token_count
        self.prefix_chars = prefix_token_count * CHARS_PER_TOKEN
        self.tokens = tokens  # with --model-path / --tokenizer-path: real tokens instead of characters
        self.load_factor = load_factor
        self.abs_slack = abs_slack
        self.rings = RingCache(vnodes)

    def key_hash(self, view: RequestView) -> int:
        key = view.routing_key
        if key is not None:
            return xxhash.xxh3_64_intdigest(b"key:" + key.encode())
        if self.tokens is not None:
            ids = self.tokens.first(view, self.prefix_tokens)
            return xxhash.xxh3_64_intdigest(array("q", ids).tobytes())
        return xxhash.xxh3_64_intdigest(view.locality_text[: self.prefix_chars].encode())

    def select(self, candidates: Sequence[Worker], view: RequestView) -> Decision:
        ring = self.rings.ring(candidates)
        h = self.key_hash(view)
        owner = ring.owner(h)
        total = sum(w.load for w in candidates)
        if total == 0:
            return Decision(owner, "ring_owner")
        avg = (total + 1) / len(candidates)
        bound = max(avg * self.load_factor, avg + self.abs_slack)
        if owner.load <= bound:
            return Decision(owner, "ring_owner")
        for w in ring.walk(h)[1:]:
            if w.load <= bound:
                return Decision(w, "ring_next")
        return Decision(least_loaded(candidates), "all_over_bound")
