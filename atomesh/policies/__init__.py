"""Placement policies, selected by name (`--policy`, `--prefill-policy`, `--decode-policy`)."""

from __future__ import annotations

from collections.abc import Callable

from atomesh.config import GatewayConfig
from atomesh.policies.base import Policy
from atomesh.policies.random import RandomPolicy
from atomesh.policies.round_robin import RoundRobinPolicy

PolicyFactory = Callable[[GatewayConfig], Policy]

_FACTORIES: dict[str, PolicyFactory] = {
    "random": lambda cfg: RandomPolicy(),
    "round_robin": lambda cfg: RoundRobinPolicy(),
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
