"""Placement policies, selected by name (`--policy`, `--prefill-policy`, `--decode-policy`)."""

from __future__ import annotations

from collections.abc import Callable

from atomesh.config import GatewayConfig
from atomesh.policies.base import Policy
from atomesh.policies.cache_aware import CacheAwarePolicy
from atomesh.policies.consistent_hashing import ConsistentHashingPolicy
from atomesh.policies.dp_sticky import DpStickyPolicy
from atomesh.policies.kv_aware import KvAwarePolicy
from atomesh.policies.least_load import LeastLoadPolicy
from atomesh.policies.power_of_two import PowerOfTwoPolicy
from atomesh.policies.prefix_hash import PrefixHashPolicy
from atomesh.policies.random import RandomPolicy
from atomesh.policies.round_robin import RoundRobinPolicy
from atomesh.prompt_tokens import PromptTokenizer, TokenizerUnavailable
from atomesh.tokenizer import PromptTokens, TokenizerError, tokenizer_file

# A factory gets the config and the gateway's tokenizer (None without --model-path / --tokenizer-path).
PolicyFactory = Callable[[GatewayConfig, PromptTokens | None], Policy]


def _cache_aware(cfg: GatewayConfig) -> CacheAwarePolicy:
    return CacheAwarePolicy(
        cache_threshold=cfg.cache_threshold, balance_abs_threshold=cfg.balance_abs_threshold,
        balance_rel_threshold=cfg.balance_rel_threshold, eviction_interval_secs=cfg.eviction_interval_secs,
        max_tree_size=cfg.max_tree_size)


def _kv_aware(cfg: GatewayConfig) -> KvAwarePolicy:
    # kv_aware renders chats exactly as the engine does, with its own loader of the same files
    # (--tokenizer-path / --model-path, --chat-template); without them the workers' /tokenizer_info.
    tokenizer = None
    if cfg.tokenizer_path or cfg.model_path:
        try:
            template = cfg.chat_template.expanduser().read_text(encoding="utf-8") if cfg.chat_template else None
            tokenizer = PromptTokenizer.from_path(str(tokenizer_file(cfg.model_path, cfg.tokenizer_path)), template)
        except (TokenizerUnavailable, TokenizerError, OSError, ValueError) as e:
            raise PolicyNotAvailable(f"--policy kv_aware: {e}") from None
    return KvAwarePolicy(_cache_aware(cfg), overlap_weight=cfg.kv_overlap_weight, temperature=cfg.kv_temperature,
                         tokenizer=tokenizer)


_FACTORIES: dict[str, PolicyFactory] = {
    "random": lambda cfg, tok: RandomPolicy(),
    "round_robin": lambda cfg, tok: RoundRobinPolicy(),
    "power_of_two": lambda cfg, tok: PowerOfTwoPolicy(),
    "least_load": lambda cfg, tok: LeastLoadPolicy(),
    "cache_aware": lambda cfg, tok: _cache_aware(cfg),
    "kv_aware": lambda cfg, tok: _kv_aware(cfg),
    "prefix_hash": lambda cfg, tok: PrefixHashPolicy(prefix_token_count=cfg.prefix_token_count,
                                                     load_factor=cfg.prefix_hash_load_factor, tokens=tok),
    "consistent_hashing": lambda cfg, tok: ConsistentHashingPolicy(),
    "dp_sticky": lambda cfg, tok: DpStickyPolicy(),
}


class PolicyNotAvailable(ValueError):
    """The policy name is valid but not built yet."""


def make_policy(name: str, config: GatewayConfig, tokens: PromptTokens | None = None) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise PolicyNotAvailable(f"--policy {name} is not implemented yet; available: "
                                 f"{', '.join(sorted(_FACTORIES))}") from None
    return factory(config, tokens)


__all__ = ["Policy", "PolicyNotAvailable", "make_policy"]
