"""`dp_sticky` (ATOMesh): a session keeps to one worker and to one data-parallel rank of it.

The worker is chosen as by consistent_hashing (target header, routing key, stable client headers,
else random); placement then keeps the routing key on one rank of that worker (the key's hash modulo
the worker's `dp_size`), so a conversation finds its prefix in that rank's cache. A request without
a routing key goes to the worker's least busy rank. The policy turns on data-parallel ranks
(`--dp-aware`): every worker must report its `dp_size`.
"""

from __future__ import annotations

from atomesh.policies.consistent_hashing import ConsistentHashingPolicy


class DpStickyPolicy(ConsistentHashingPolicy):
    name = "dp_sticky"
