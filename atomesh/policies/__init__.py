"""Placement policies, selected by name (`--policy`, `--prefill-policy`, `--decode-policy`)."""

from __future__ import annotations

from collections.abc import Callable

from atomesh.config import GatewayConfig
from atomesh.policies.base import Policy
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.policies.kv_aware import KvAwarePolicy
from atomesh.policies.least_load import LeastLoadPolicy
from atomesh.policies.power_of_two import PowerOfTwoPolicy
from atomesh.policies.prefix_hash import PrefixHashPolicy
from atomesh.policies.random import RandomPolicy
from atomesh.policies.round_robin import RoundRobinPolicy
from atomesh.prompt_tokens import PromptTokenizer, TokenizerUnavailable

PolicyFactory = Callable[[GatewayConfig], Policy]

def _cache_aware(cfg: GatewayConfig) -> CacheAwarePolicy:
    return CacheAwarePolicy(
        cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
        balance_rel_threshold=cfg.balance_rel_threshold, eviction_interval_secs=cfg.eviction_interval_secs,
        max_tree_size=cfg.max_tree_size)


def _kv_aware(cfg: GatewayConfig) -> KvAwarePolicy:
    try:
        tokenizer = PromptTokenizer.from_path(cfg.tokenizer_path) if cfg.tokenizer_path else None
    except (TokenizerUnavailable, ValueError) as e:
        raise PolicyNotAvailable(f"--policy kv_aware: {e}") from None
    return KvAwarePolicy(_cache_aware(cfg), overlap_weight=cfg.kv_overlap_weight, temperature=cfg.kv_temperature,
                         tokenizer=tokenizer)


_FACTORIES: dict[str, PolicyFactory] = {
    "random": lambda cfg: RandomPolicy(),
    "round_robin": lambda cfg: RoundRobinPolicy(),
    "power_of_two": lambda cfg: PowerOfTwoPolicy(),
    "least_load": lambda cfg: LeastLoadPolicy(),
    "cache_aware": _cache_aware,
    "kv_aware": _kv_aware,
    "prefix_hash": lambda cfg: PrefixHashPolicy(prefix_token_count=cfg.prefix_token_count),
}


class PolicyNotAvailable(ValueError):
    """The policy name is valid but not built yet."""


def make_policy(name: str, config: GatewayConfig) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise PolicyNotAvailable(f"--policy {name} is not implemented yet; available: "
                                 f"{', '.join(sorted(_FACTORIES))}") from None
    return factory(config)


__all__ = ["Policy", "PolicyNotAvailable", "make_policy"]
