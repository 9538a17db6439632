"""Tenants, priority classes and per-tenant rate limits, with SMG's flags and YAML files.

- A request's tenant (SMG's canonical keys): `auth:<id>` when it presents a `--tenant-api-key`,
  `header:<value>` of `--tenant-header-name` with `--trust-tenant-header`, else `anonymous`.
- Its class (`--priority-scheduler-enabled`): `X-SMG-Priority` (system, interactive, default, bulk;
  anything else is default), clamped to the tenant's `max_class` (`tenant_policies` of
  `--priority-scheduler-config`, else `--priority-scheduler-default-max-class`). Within a class the
  body's `priority` (vLLM's meaning: lower first) orders the queue, then arrival.
- Its rate limits (`--tenant-rate-limit-enabled`, `--tenant-rate-limit-config`): a requests-per-minute
  and a tokens-per-minute bucket per tenant (its own policy, else `default_policy`); tokens are
  estimated at admission as the prompt's characters / 4 plus the requested output limit.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import yaml

from atomesh.errors import TooManyRequests

PRIORITY_HEADER = "x-smg-priority"
ANONYMOUS = "anonymous"


class PriorityClass(IntEnum):
    """SMG's service classes; a higher value is served first."""

    BULK = 0
    DEFAULT = 1
    INTERACTIVE = 2
    SYSTEM = 3

    @classmethod
    def named(cls, name: str) -> PriorityClass:
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise ValueError(f"{name!r} is not a priority class (system, interactive, default or bulk)") from None

    @classmethod
    def of_header(cls, value: str | None) -> PriorityClass:
        """The class a header names; unknown or absent: default (a typo never fails a request, as SMG)."""
        if value is None:
            return cls.DEFAULT
        return cls.__members__.get(value.strip().upper(), cls.DEFAULT)


@dataclass(frozen=True, slots=True)
class ClassSettings:
    """One class's queue: its bound, the longest wait, the wait after which it goes first (aging), and
    the admission slots lower classes may not take (SMG's reservation: max(floor, share x slots))."""

    queue_size: int
    queue_timeout_secs: float
    starvation_threshold_secs: float
    reserved_floor: int = 0
    reserved_per_slot: float = 0.0

    def reserved(self, slots: int) -> int:
        return max(self.reserved_floor, math.ceil(self.reserved_per_slot * slots))


# SMG's built-in queue defaults per class. No slot is reserved unless the file says so: SMG's default
# floors (32 system, 128 interactive) would leave a gateway of a few hundred slots none for the others.
DEFAULT_CLASSES: dict[PriorityClass, ClassSettings] = {
    PriorityClass.SYSTEM: ClassSettings(64, 30, 5),
    PriorityClass.INTERACTIVE: ClassSettings(256, 30, 5),
    PriorityClass.DEFAULT: ClassSettings(512, 60, 30),
    PriorityClass.BULK: ClassSettings(1024, 300, 120),
}


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    classes: Mapping[PriorityClass, ClassSettings]
    tenant_max_class: Mapping[str, PriorityClass]
    default_max_class: PriorityClass

    def class_of(self, tenant: str, header: str | None) -> PriorityClass:
        return min(PriorityClass.of_header(header), self.tenant_max_class.get(tenant, self.default_max_class))


def _yaml_mapping(path: Path, flag: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.expanduser().read_text())
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{flag}: {path} is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{flag}: {path} must hold a mapping")
    return loaded


def _number(value: Any, what: str, *, positive: bool = True) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (value <= 0 if positive else value < 0)
    ):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} number, not {value!r}")
    return float(value)


def load_scheduler(path: Path | None, default_max_class: PriorityClass) -> SchedulerSettings:
    """`--priority-scheduler-config`: `classes: {CLASS: {queue_size, queue_timeout_secs,
    starvation_threshold_secs}}` over the built-in defaults, `tenant_policies: {TENANT_KEY: {max_class}}`.
    SMG's reservation and preemption fields are refused (not built)."""
    flag = "--priority-scheduler-config"
    raw = _yaml_mapping(path, flag) if path is not None else {}
    unknown = set(raw) - {"classes", "tenant_policies"}
    if unknown:
        raise ValueError(f"{flag}: unknown keys {sorted(unknown)}")
    classes = dict(DEFAULT_CLASSES)
    for name, spec in (raw.get("classes") or {}).items():
        cls = PriorityClass.named(str(name))
        if not isinstance(spec, dict):
            raise ValueError(f"{flag}: classes.{name} must be a mapping")
        if "can_preempt" in spec:
            raise ValueError(
                f"{flag}: classes.{name}: can_preempt refused: preemption is not built (a request "
                "admitted runs to its end)"
            )
        unknown = set(spec) - {
            "queue_size",
            "queue_timeout_secs",
            "starvation_threshold_secs",
            "reserved_floor",
            "reserved_per_slot",
        }
        if unknown:
            raise ValueError(f"{flag}: classes.{name}: unknown keys {sorted(unknown)}")
        base = classes[cls]
        classes[cls] = ClassSettings(
            int(_number(spec.get("queue_size", base.queue_size), f"classes.{name}.queue_size", positive=False)),
            _number(spec.get("queue_timeout_secs", base.queue_timeout_secs), f"classes.{name}.queue_timeout_secs"),
            _number(
                spec.get("starvation_threshold_secs", base.starvation_threshold_secs),
                f"classes.{name}.starvation_threshold_secs",
            ),
            int(_number(spec.get("reserved_floor", 0), f"classes.{name}.reserved_floor", positive=False)),
            _number(spec.get("reserved_per_slot", 0.0), f"classes.{name}.reserved_per_slot", positive=False),
        )
    tenants: dict[str, PriorityClass] = {}
    for key, spec in (raw.get("tenant_policies") or {}).items():
        if not isinstance(spec, dict) or set(spec) != {"max_class"}:
            raise ValueError(f"{flag}: tenant_policies.{key} must be {{max_class: CLASS}}")
        tenants[str(key)] = PriorityClass.named(str(spec["max_class"]))
    return SchedulerSettings(classes, tenants, default_max_class)


@dataclass(frozen=True, slots=True)
class RatePolicy:
    tokens_per_minute: float
    requests_per_minute: float


@dataclass(frozen=True, slots=True)
class RateLimitSettings:
    default: RatePolicy
    tenants: Mapping[str, RatePolicy]


def _rate_policy(spec: Any, what: str, keyed: bool) -> tuple[str | None, RatePolicy]:
    flag = "--tenant-rate-limit-config"
    if not isinstance(spec, dict):
        raise ValueError(f"{flag}: {what} must be a mapping")
    if spec.get("model_rules"):
        raise ValueError(f"{flag}: {what}.model_rules refused: per-model rate rules are not built")
    unknown = set(spec) - {"tenant_key", "tokens_per_minute", "requests_per_minute", "model_rules"}
    if unknown:
        raise ValueError(f"{flag}: {what}: unknown keys {sorted(unknown)}")
    key = spec.get("tenant_key")
    if keyed != (key is not None):
        raise ValueError(f"{flag}: {what} {'needs' if keyed else 'must not set'} tenant_key")
    if key is not None and str(key).startswith("ip:"):
        raise ValueError(
            f"{flag}: tenant_key {key!r}: tenants by client address are not built (auth:<id>, "
            "header:<value> or anonymous)"
        )
    if key is not None and not (key == ANONYMOUS or str(key).startswith(("auth:", "header:"))):
        raise ValueError(f"{flag}: tenant_key {key!r} is not a tenant key (auth:<id>, header:<value> or anonymous)")
    return key, RatePolicy(
        _number(spec.get("tokens_per_minute"), f"{what}.tokens_per_minute"),
        _number(spec.get("requests_per_minute"), f"{what}.requests_per_minute"),
    )


def load_rate_limits(path: Path) -> RateLimitSettings:
    """`--tenant-rate-limit-config`: `default_policy: {tokens_per_minute, requests_per_minute}` and
    `tenants: [{tenant_key, tokens_per_minute, requests_per_minute}]` (SMG's file)."""
    raw = _yaml_mapping(path, "--tenant-rate-limit-config")
    unknown = set(raw) - {"default_policy", "tenants"}
    if unknown or "default_policy" not in raw:
        raise ValueError("--tenant-rate-limit-config: expected default_policy (and tenants)")
    _, default = _rate_policy(raw["default_policy"], "default_policy", keyed=False)
    tenants: dict[str, RatePolicy] = {}
    for i, spec in enumerate(raw.get("tenants") or []):
        key, policy = _rate_policy(spec, f"tenants[{i}]", keyed=True)
        assert key is not None
        if key in tenants:
            raise ValueError(f"--tenant-rate-limit-config: duplicate tenant_key {key!r}")
        tenants[key] = policy
    return RateLimitSettings(default, tenants)


def parse_tenant_api_keys(items: list[str]) -> dict[str, str]:
    """`--tenant-api-key TENANT_ID:KEY ...` -> {key: tenant id}."""
    out: dict[str, str] = {}
    for item in items:
        tenant, sep, key = item.partition(":")
        if not sep or not tenant or not key:
            raise ValueError("--tenant-api-key: expected TENANT_ID:KEY")
        out[key] = tenant
    return out


class Tenants:
    """Tells a request's tenant from its headers."""

    def __init__(self, api_keys: Mapping[str, str], trust_header: bool, header_name: str) -> None:
        # Compared by digest, so a lookup costs one hash and never times the key's characters.
        self._by_digest = {hashlib.sha256(f"Bearer {k}".encode()).digest(): t for k, t in api_keys.items()}
        self.trust_header = trust_header
        self.header_name = header_name.lower()

    def of(self, headers: Mapping[str, str]) -> str:
        if self._by_digest:
            given = hashlib.sha256((headers.get("authorization") or "").encode("latin-1", "replace")).digest()
            for digest, tenant in self._by_digest.items():
                if hmac.compare_digest(given, digest):
                    return "auth:" + tenant
        if self.trust_header:
            value = headers.get(self.header_name)
            if value:
                return "header:" + value[:128]
        return ANONYMOUS


class _Bucket:
    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, per_minute: float) -> None:
        self.capacity = per_minute  # a minute's worth may come at once
        self.rate = per_minute / 60.0
        self.tokens = per_minute
        self.stamp = time.monotonic()

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now


class TenantRateLimits:
    """A requests bucket and a tokens bucket per tenant; a request takes one request and its estimated
    tokens from both, or neither (429 saying when to retry)."""

    def __init__(self, settings: RateLimitSettings, share: float = 1.0) -> None:
        self.settings = settings
        self.share = share  # of each tenant's rates this process admits (--processes splits them)
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {}

    def take(self, tenant: str, tokens: float) -> None:
        pair = self._buckets.get(tenant)
        if pair is None:
            policy = self.settings.tenants.get(tenant, self.settings.default)
            pair = self._buckets[tenant] = (
                _Bucket(policy.requests_per_minute * self.share),
                _Bucket(policy.tokens_per_minute * self.share),
            )
        requests, budget = pair
        now = time.monotonic()
        requests.refill(now)
        budget.refill(now)
        tokens = min(tokens, budget.capacity)  # one request larger than a minute's budget waits for a full one
        if requests.tokens >= 1 and budget.tokens >= tokens:
            requests.tokens -= 1
            budget.tokens -= tokens
            return
        wait = max((1 - requests.tokens) / requests.rate, (tokens - budget.tokens) / budget.rate, 0.0)
        raise TooManyRequests(
            f"tenant {tenant!r} is over its rate limit (--tenant-rate-limit-config); retry in {wait:.1f}s",
            code="tenant_rate_limited",
        )


def estimated_tokens(body: Mapping[str, Any], text_length: int) -> float:
    """A request's tokens as the rate limit counts them at admission: prompt characters / 4 plus the
    output limit it asked for (max_tokens, max_completion_tokens, max_output_tokens; 256 when none)."""
    limit = next(
        (
            body[k]
            for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool)
        ),
        256,
    )
    return text_length / 4 + limit
