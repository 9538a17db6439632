"""Placement policies, selected by name (`--policy`, `--prefill-policy`, `--decode-policy`).

The names are `config.PolicyName`; `FACTORIES` builds one policy per name from the config (a test
checks that every name has a factory and every factory a name). What a policy needs beyond the config
and the gateway's tokenizer it declares (`Policy.needs`) and is given at start-up (`Policy.attach`).
"""

from __future__ import annotations

from collections.abc import Callable

from atomesh.config import GatewayConfig, PolicyName
from atomesh.kv.sync import KvPeerSync
from atomesh.kv.tokens import PromptTokenizer, TokenizerError
from atomesh.policies.base import CacheStats, Decision, Given, Loads, Needs, Policy, Replica, least_loaded
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.policies.consistent_hashing import ConsistentHashingPolicy
from atomesh.policies.dp_sticky import DpStickyPolicy
from atomesh.policies.kv_aware import KvAwarePolicy
from atomesh.policies.least_load import LeastLoadPolicy
from atomesh.policies.manual import ManualPolicy
from atomesh.policies.passthrough import PassthroughPolicy
from atomesh.policies.power_of_two import PowerOfTwoPolicy
from atomesh.policies.prefix_hash import PrefixHashPolicy
from atomesh.policies.random import RandomPolicy
from atomesh.policies.round_robin import RoundRobinPolicy

# A factory gets the config and the gateway's tokenizer (None without --model-path / --tokenizer-path).
PolicyFactory = Callable[[GatewayConfig, PromptTokenizer | None], Policy]


def _cache_aware(cfg: GatewayConfig) -> CacheAwarePolicy:
    return CacheAwarePolicy(
        cache_threshold=cfg.cache_threshold,
        balance_abs_threshold=cfg.balance_abs_threshold,
        balance_rel_threshold=cfg.balance_rel_threshold,
        eviction_interval_secs=cfg.eviction_interval_secs,
        max_tree_size=cfg.max_tree_size,
    )


def _tokens(cfg: GatewayConfig, tokens: PromptTokenizer | None) -> PromptTokenizer | None:
    """The gateway's tokenizer, or (a policy made on its own, as tests and benchmarks do) the one the
    config names; None when it names none."""
    if tokens is not None or not (cfg.tokenizer_path or cfg.model_path):
        return tokens
    try:
        return PromptTokenizer.from_files(cfg.model_path, cfg.tokenizer_path, cfg.chat_template)
    except TokenizerError as e:
        raise PolicyNotAvailable(str(e)) from None


def make_kv_aware(cfg: GatewayConfig, tokens: PromptTokenizer | None = None) -> KvAwarePolicy:
    """kv_aware from the config, typed as itself (benchmarks read its parts). Without a tokenizer
    (given, or named by --tokenizer-path / --model-path) it asks a worker for its /tokenizer_info."""
    sync = KvPeerSync(cfg.kv_sync_bind, cfg.kv_sync_peers) if cfg.kv_sync_bind or cfg.kv_sync_peers else None
    return KvAwarePolicy(
        _cache_aware(cfg),
        overlap_weight=cfg.kv_overlap_weight,
        temperature=cfg.kv_temperature,
        new_threshold=cfg.cache_threshold,
        tokenizer=_tokens(cfg, tokens),
        sync=sync,
    )


FACTORIES: dict[PolicyName, PolicyFactory] = {
    PolicyName.RANDOM: lambda cfg, tok: RandomPolicy(),
    PolicyName.ROUND_ROBIN: lambda cfg, tok: RoundRobinPolicy(),
    PolicyName.POWER_OF_TWO: lambda cfg, tok: PowerOfTwoPolicy(),
    PolicyName.LEAST_LOAD: lambda cfg, tok: LeastLoadPolicy(),
    PolicyName.CACHE_AWARE: lambda cfg, tok: _cache_aware(cfg),
    PolicyName.KV_AWARE: make_kv_aware,
    PolicyName.PREFIX_HASH: lambda cfg, tok: PrefixHashPolicy(
        prefix_token_count=cfg.prefix_token_count,
        load_factor=cfg.prefix_hash_load_factor,
        abs_slack=cfg.prefix_hash_balance_abs_threshold,
        tokens=_tokens(cfg, tok),
    ),
    PolicyName.CONSISTENT_HASHING: lambda cfg, tok: ConsistentHashingPolicy(),
    PolicyName.DP_STICKY: lambda cfg, tok: DpStickyPolicy(),
    PolicyName.PASSTHROUGH: lambda cfg, tok: PassthroughPolicy(),
    PolicyName.MANUAL: lambda cfg, tok: ManualPolicy(
        cfg.assignment_mode, cfg.max_idle_secs, cfg.eviction_interval_secs
    ),
}


class PolicyNotAvailable(ValueError):
    """The policy name has no factory (a name added to `PolicyName` without one)."""


def make_policy(name: PolicyName, config: GatewayConfig, tokens: PromptTokenizer | None = None) -> Policy:
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise PolicyNotAvailable(
            f"--policy {name} is not implemented yet; available: {', '.join(sorted(FACTORIES))}"
        ) from None
    return factory(config, tokens)


__all__ = [
    "FACTORIES",
    "CacheStats",
    "Decision",
    "Given",
    "Loads",
    "Needs",
    "Policy",
    "PolicyName",
    "PolicyNotAvailable",
    "Replica",
    "least_loaded",
    "make_kv_aware",
    "make_policy",
]
