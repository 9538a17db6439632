"""Placement policies, selected by name (`--policy`, `--prefill-policy`, `--decode-policy`).

The names are `config.PolicyName`; `FACTORIES` builds one policy per name from the config (a test
checks that every name has a factory and every factory a name).
"""

from __future__ import annotations

from collections.abc import Callable

from atomesh.config import GatewayConfig, PolicyName
from atomesh.policies.base import Decision, Policy, least_loaded
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.policies.least_load import LeastLoadPolicy
from atomesh.policies.power_of_two import PowerOfTwoPolicy
from atomesh.policies.prefix_hash import PrefixHashPolicy
from atomesh.policies.random import RandomPolicy
from atomesh.policies.round_robin import RoundRobinPolicy

PolicyFactory = Callable[[GatewayConfig], Policy]

FACTORIES: dict[PolicyName, PolicyFactory] = {
    PolicyName.RANDOM: lambda cfg: RandomPolicy(),
    PolicyName.ROUND_ROBIN: lambda cfg: RoundRobinPolicy(),
    PolicyName.POWER_OF_TWO: lambda cfg: PowerOfTwoPolicy(),
    PolicyName.LEAST_LOAD: lambda cfg: LeastLoadPolicy(),
    PolicyName.CACHE_AWARE: lambda cfg: CacheAwarePolicy(
        cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
        balance_rel_threshold=cfg.balance_rel_threshold, eviction_interval_secs=cfg.eviction_interval_secs,
        max_tree_size=cfg.max_tree_size),
    PolicyName.PREFIX_HASH: lambda cfg: PrefixHashPolicy(prefix_token_count=cfg.prefix_token_count),
}


class PolicyNotAvailable(ValueError):
    """The policy name has no factory (a name added to `PolicyName` without one)."""


def make_policy(name: PolicyName, config: GatewayConfig) -> Policy:
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise PolicyNotAvailable(f"--policy {name} is not implemented yet; available: "
                                 f"{', '.join(sorted(FACTORIES))}") from None
    return factory(config)


__all__ = ["FACTORIES", "Decision", "Policy", "PolicyName", "PolicyNotAvailable", "least_loaded", "make_policy"]
