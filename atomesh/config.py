"""Every gateway setting, validated once at start-up.

`GatewayConfig` is the single source of truth: the `atomesh launch` flags, the `--config FILE.yaml`
keys and the configuration reference in docs/ are all derived from its fields. A field's flag is its
name with dashes (`worker_urls` -> `--worker-urls`); extra spellings live in `FLAG_ALIASES`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from atomesh.compat import FIXED_KEYS, REFUSED_FLAGS, REFUSED_KEYS
from atomesh.cors import check_origin
from atomesh.request import ROUTING_KEY_HEADERS
from atomesh.tenancy import PriorityClass, load_rate_limits, load_scheduler, parse_tenant_api_keys


class ConfigError(ValueError):
    """A setting is invalid; the message is one line meant for the user."""


class BackendKind(StrEnum):
    """The engine family behind the workers (`--backend`): how P/D requests are split between them."""

    SGLANG = "sglang"
    VLLM = "vllm"
    ATOM = "atom"


class DiscoveryProvider(StrEnum):
    KUBERNETES = "kubernetes"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


class PolicyName(StrEnum):
    """A placement policy (`--policy`, `--prefill-policy`, `--decode-policy`).

    The one list of names: config validation and the CLI help read it here, and `atomesh.policies`
    maps every member to its factory (a test checks both ways).
    """

    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"
    KV_AWARE = "kv_aware"
    PREFIX_HASH = "prefix_hash"
    CONSISTENT_HASHING = "consistent_hashing"
    DP_STICKY = "dp_sticky"
    PASSTHROUGH = "passthrough"
    MANUAL = "manual"


class AssignmentMode(StrEnum):
    """How the manual policy places a routing key it has not seen (`--assignment-mode`, SMG's names)."""

    RANDOM = "random"
    MIN_LOAD = "min_load"
    MIN_GROUP = "min_group"


_POLICY_VALUES = tuple(p.value for p in PolicyName)
# Policies of SMG / ATOMesh that atomesh does not build, and why (named in the start-up error).
REFUSED_POLICIES = {
    "bucket": "SMG's bucket policy (prefill workers split into prompt-length ranges whose boundaries move with "
    "the load) is not built; cache_aware or least_load place prefill legs by cache and load"
}
# SMG's `--assignment-mode delegate` (route by the underlying policy, then pin the key) belongs to its
# routing-key override, which is not built.
REFUSED_ASSIGNMENT = {
    "delegate": "the manual policy pins new keys by random, min_load or min_group; "
    "--routing-key-override pins a key to whatever any other policy chose"
}
REFUSED_BACKENDS = {
    "openai": "proxying to OpenAI's API is not built; workers are inference engines (sglang, vllm, atom)",
    "anthropic": "proxying to Anthropic's API is not built; workers are inference engines (sglang, vllm, atom)",
    "tokenspeed": "TokenSpeed workers (over ZMQ) are not built; workers are reached over HTTP",
}
NO_LIMIT = 1e9  # seconds: what a timeout of 0 ("no limit", as SMG) is kept as


class PrefillSpec(BaseModel):
    """One `--prefill URL [BOOTSTRAP_PORT|none]` entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    url: str
    bootstrap_port: int | None = None


MAX_WORKER_URL = 2048  # bytes; a worker URL is a metric label and a log field


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_kv_events_endpoints(items: list[str]) -> dict[str, str]:
    """`--kv-events-endpoints WORKER_URL=PUB[,REPLAY] ...` -> {worker url: "PUB[,REPLAY]"}; bad items raise."""
    out: dict[str, str] = {}
    for item in items:
        url, sep, spec = item.partition("=")
        url = url.strip().rstrip("/")
        pub, _, replay = (p.strip() for p in spec.partition(","))
        if not sep or not urlsplit(url).hostname or not pub:
            raise ValueError(f"--kv-events-endpoints {item!r}: expected WORKER_URL=tcp://host:port[,tcp://host:port]")
        for part in (pub, replay):
            if part and not part.startswith(_ZMQ_SCHEMES):
                raise ValueError(f"--kv-events-endpoints {item!r}: {part!r} must be a ZMQ address like tcp://host:5557")
        out[url] = spec.strip()
    return out


def parse_model_aliases(items: list[str]) -> dict[str, str]:
    """`--model-alias ALIAS=CANONICAL ...` -> {alias: canonical}; bad items raise ValueError."""
    out: dict[str, str] = {}
    for item in items:
        alias, sep, canonical = item.partition("=")
        if not sep or not alias.strip() or not canonical.strip():
            raise ValueError(f"--model-alias {item!r}: expected ALIAS=CANONICAL")
        alias, canonical = alias.strip(), canonical.strip()
        if alias == canonical or out.get(alias, canonical) != canonical:
            raise ValueError(f"--model-alias {item!r}: {alias!r} cannot name two models or itself")
        out[alias] = canonical
    return out


def redact_url(url: str) -> str:
    """The URL with any password in it replaced by `***` (for messages, logs and labels)."""
    return _URL_PASSWORD.sub(r"\1***@", url)


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]*@")


def check_worker_url(url: str) -> str:
    """Return the URL without a trailing slash, or raise ValueError saying what is wrong (the message
    never repeats a password the URL carries)."""
    if len(url.encode("utf-8", "replace")) > MAX_WORKER_URL:
        raise ValueError(f"worker URL is longer than {MAX_WORKER_URL} bytes")
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"worker URL {shown!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {shown!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"worker URL {shown!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"worker URL {shown!r} must not carry credentials (user:password@); give the worker a "
            "key of its own with api_key (POST /workers), or let it take the client's Authorization"
        )
    if any(c.isspace() or ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ValueError(f"worker URL {shown!r} must not contain spaces or control characters")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as e:
        raise ValueError(f"worker URL {shown!r} has an invalid port") from e
    if parts.query or parts.fragment:
        raise ValueError(f"worker URL {shown!r} must not carry a query or fragment")
    return url.rstrip("/")


# Kubernetes names: a label key is `[prefix/]name`, the prefix a DNS subdomain, the name up to 63
# characters; a label value up to 63 characters (may be empty); a namespace a DNS label.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def check_label_key(key: str) -> None:
    """Raise ValueError unless `key` is a valid Kubernetes label or annotation key."""
    prefix, _, name = key.rpartition("/")
    if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"{key!r} is not a valid Kubernetes label key")


def parse_selector(items: list[str]) -> dict[str, str]:
    """`["app=x", "role=prefill,tier=gpu"]` -> `{"app": "x", "role": "prefill", "tier": "gpu"}`.

    Only equality is supported (as in SMG); raises ValueError on anything else."""
    out: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, eq, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key.endswith("!") or value.startswith("="):
                raise ValueError(f"selector {part!r} must be key=value")
            check_label_key(key)
            if not _LABEL_VALUE.fullmatch(value):
                raise ValueError(f"selector {part!r}: {value!r} is not a valid label value")
            if out.get(key, value) != value:
                raise ValueError(f"selector gives {key!r} two values")
            out[key] = value
    return out


def parse_model_id_source(source: str) -> tuple[str, str]:
    """`namespace` -> ("namespace", ""); `label:KEY` / `annotation:KEY` -> ("label" | "annotation", KEY)."""
    if source == "namespace":
        return "namespace", ""
    kind, sep, key = source.partition(":")
    if sep and kind in ("label", "annotation") and key:
        check_label_key(key)
        return kind, key
    raise ValueError(f"{source!r}: expected namespace, label:KEY or annotation:KEY")


PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Port = Annotated[int, Field(ge=1, le=65535)]

DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
DEFAULT_DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class GatewayConfig(BaseModel):
    """All settings of `atomesh launch`; defaults follow SMG / ATOMesh."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # --- server
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: Port = Field(30000, description="Port of the OpenAI-compatible service.")
    worker_urls: list[str] = Field(default_factory=list, description="Regular-mode worker URLs.")
    max_payload_size: int = Field(512 * 1024 * 1024, gt=0, description="Largest request body in bytes (413 above).")
    request_timeout_secs: PositiveFloat = Field(1800, description="Upper bound on one upstream request.")
    http_head_timeout_secs: NonNegFloat = Field(
        10,
        description="A client connection must deliver each request head (the first from connecting, the "
        "next from its first byte) within this; 408 and close after; 0: no limit.",
    )
    http_body_timeout_secs: NonNegFloat = Field(
        30, description="Longest wait for the next piece of a request body; 408 and close after; 0: no limit."
    )
    http_keepalive_timeout_secs: NonNegFloat = Field(
        75, description="An idle keep-alive client connection is closed after this; 0: kept until the client closes it."
    )
    upstream_pool_idle_timeout_secs: NonNegFloat = Field(
        60,
        description="An idle pooled connection to a worker is closed after this (keep it under the "
        "workers' keep-alive timeout; a request that meets a connection the worker closed is "
        "resent once); 0: kept until the worker closes it.",
    )
    shutdown_grace_period_secs: NonNegFloat = Field(
        180, description="On SIGTERM/SIGINT, how long in-flight requests may run before exit."
    )
    api_key: str | None = Field(
        None,
        description="Bearer key every inference and admin route requires (as SMG); health, liveness, "
        "readiness and /v1/models stay open (docs/security.md).",
    )
    admin_api_key: str | None = Field(
        None,
        description="Bearer key of the admin routes only (workers, loads, server info, engine metrics, "
        "cache flush); when set, --api-key no longer opens them.",
    )
    backend: BackendKind = Field(
        BackendKind.SGLANG, description="Engine family: sglang, vllm or atom (alias --runtime)."
    )
    config: Path | None = Field(None, description="YAML file with these settings (flags win over the file).")

    # --- policy
    policy: PolicyName = Field(PolicyName.CACHE_AWARE, description="Worker selection policy.")
    prefill_policy: PolicyName | None = Field(None, description="Policy for the prefill pool (default: --policy).")
    decode_policy: PolicyName | None = Field(None, description="Policy for the decode pool (default: --policy).")
    cache_threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="cache_aware: minimum prefix match ratio to follow the cache; kv_aware: "
        "a prompt whose cached share differs by less than this between workers is new (placed by KV traffic).",
    )
    balance_abs_threshold: int = Field(
        64, ge=0, description="cache_aware: load gap (max - min) above which balancing wins."
    )
    balance_rel_threshold: float = Field(
        1.5, ge=1, description="cache_aware: load ratio (max / min) above which balancing wins."
    )
    eviction_interval_secs: PositiveFloat = Field(120, description="cache_aware: how often the index is pruned.")
    max_tree_size: int = Field(
        2**26,
        gt=0,
        description="cache_aware: prompt characters the prefix index may remember per pool (it "
        "keeps them as chunks; the hard bound of its memory).",
    )
    prefix_token_count: int = Field(256, gt=0, description="prefix_hash: tokens of the prompt hashed.")
    prefix_hash_load_factor: float = Field(
        1.25,
        ge=1,
        description="prefix_hash: a worker above this multiple of the mean load (and 10 requests over "
        "it) is passed over for the next one on the ring.",
    )
    prefix_hash_balance_abs_threshold: int = Field(
        10,
        ge=0,
        description="prefix_hash: the requests over the mean load a worker must also exceed before it "
        "counts as overloaded.",
    )
    max_idle_secs: PositiveFloat = Field(
        14400,
        description="manual: a routing key unused this long is forgotten (checked every --eviction-interval-secs).",
    )
    assignment_mode: AssignmentMode = Field(
        AssignmentMode.RANDOM,
        description="manual: where a new routing key goes: random, min_load (fewest "
        "requests) or min_group (fewest routing keys).",
    )
    routing_key_override: bool = Field(
        False,
        description="Sticky sessions on any policy: a routing key goes back to the worker it was placed on "
        "while that is routable; else the policy decides and the key is pinned to its choice "
        "(alias --sticky-sessions; keys idle --max-idle-secs are forgotten).",
    )
    routing_key_headers: list[str] = Field(
        default_factory=lambda: list(ROUTING_KEY_HEADERS),
        description="Headers a request's routing key (session, user) is read from, first present wins; "
        "consistent_hashing, manual, dp_sticky and prefix_hash read the key.",
    )
    model_alias: list[str] = Field(
        default_factory=list,
        description="`ALIAS=CANONICAL`, repeatable: clients may name a served model ALIAS "
        "too; the request goes on naming CANONICAL (case-sensitive, as SMG).",
    )
    atom_pd_rank_mapping_policy: str | None = Field(
        None,
        description="ATOMesh: how P/D data-parallel ranks map; only `none` (the engines pick their own "
        "ranks) is built.",
    )
    dp_aware: bool = Field(
        False,
        description="Regular mode: also choose a data-parallel rank of the chosen worker (the least busy "
        "one) and send it as `data_parallel_rank`; every worker must report `dp_size` in its "
        "server info (docs/workers.md).",
    )

    # --- kv_aware (docs/placement.md)
    kv_events_endpoints: list[str] = Field(
        default_factory=list,
        description="kv_aware: WORKER_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT] for a worker "
        "whose KV events are not advertised in its /server_info.",
    )
    kv_overlap_weight: float = Field(1.0, ge=0, description="kv_aware: weight of blocks to prefill against KV load.")
    kv_temperature: float = Field(0.0, ge=0, description="kv_aware: 0 = lowest cost wins; above 0 = soft choice.")
    kv_sync_bind: str | None = Field(
        None,
        description="kv_aware: ZMQ address (tcp://HOST:PORT) where this gateway publishes its in-flight "
        "placements to its replicas (docs/placement.md).",
    )
    kv_sync_peers: list[str] = Field(
        default_factory=list,
        description="kv_aware: the other gateway replicas' --kv-sync-bind addresses "
        "(tcp://HOST:PORT ...), whose in-flight placements count as load here.",
    )

    # --- tokenizer (ATOMesh / SMG)
    model_path: str | None = Field(
        None,
        description="Folder (or file) of the served model whose tokenizer the gateway loads at start "
        "(tokenizer.json, or the folder holding it); a Hugging Face model id is refused: "
        "nothing is downloaded.",
    )
    tokenizer_path: str | None = Field(
        None, description="tokenizer.json file or folder holding one; wins over --model-path."
    )
    chat_template: Path | None = Field(
        None, description="Jinja chat template file, checked at start (with --model-path or --tokenizer-path)."
    )

    # --- TLS to workers
    ca_cert_paths: list[Path] = Field(
        default_factory=list,
        description="CA certificates (PEM) that https:// workers are verified against (default: the system's).",
    )
    client_cert_path: Path | None = Field(
        None, description="Client certificate (PEM) presented to https:// workers (mTLS; with --client-key-path)."
    )
    client_key_path: Path | None = Field(None, description="Private key of --client-cert-path.")

    # --- P/D
    pd_disaggregation: bool = Field(False, description="Prefill/decode disaggregated mode.")
    prefill: list[PrefillSpec] = Field(
        default_factory=list, description="`URL [BOOTSTRAP_PORT|none]`, repeatable: a prefill worker."
    )
    decode: list[str] = Field(default_factory=list, description="`URL`, repeatable: a decode worker.")
    worker_startup_timeout_secs: PositiveFloat = Field(
        1800, description="How long start-up waits for command-line workers to become healthy."
    )
    worker_startup_check_interval: PositiveFloat = Field(30, description="Seconds between start-up probes.")
    worker_startup_delay: NonNegFloat = Field(
        0, description="Seconds before the first start-up probe of a worker given at start or added later."
    )
    load_monitor_interval: PositiveFloat | None = Field(
        None,
        description="Seconds between polls of the workers' engine load (only for policies that compare "
        "loads); default 1, 0.1 with kv_aware.",
    )

    # --- logging
    log_level: LogLevel = Field(LogLevel.INFO, description="debug, info, warn or error.")
    log_dir: Path | None = Field(None, description="Also write logs to a rotating file in this folder.")
    json_log: bool = Field(False, description="One JSON object per log line.")
    access_log_sample_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of successful requests written to the access log (one `request` event at info each: "
        "request id, method, path, status, worker, latency_ms, bytes); 4xx/5xx are always written; "
        "0 turns the access log off.",
    )

    # --- tracing
    enable_trace: bool = Field(
        False,
        description="OpenTelemetry spans of each request (admission, attempts, upstream legs) sent over "
        "OTLP/gRPC; the client's traceparent is their parent, workers get the leg's "
        "(docs/deployment.md#tracing; needs the `tracing` extra).",
    )
    otlp_traces_endpoint: str = Field("localhost:4317", description="OTLP/gRPC collector HOST:PORT (--enable-trace).")

    # --- prometheus
    prometheus_port: Port = Field(29000, description="Port of the /metrics server.")
    health_check_port: Port | None = Field(
        None,
        description="Also serve /liveness, /readiness, /health and /health_generate on this port (for "
        "probes; same address as --host, plain HTTP).",
    )
    prometheus_host: str | None = Field(
        None,
        description="Address of the /metrics server (default: the address of --host, so a gateway on "
        "127.0.0.1 does not expose its metrics on every interface).",
    )
    prometheus_duration_buckets: list[PositiveFloat] = Field(
        default_factory=lambda: list(DEFAULT_DURATION_BUCKETS), description="Latency histogram buckets (seconds)."
    )

    # --- requests
    request_id_headers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REQUEST_ID_HEADERS),
        description="Headers a request id is taken from, first match wins.",
    )

    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origins whose browsers may call the gateway (`*`: any): their answers "
        "get CORS headers and their preflights a 204 (as SMG).",
    )

    # --- processes
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="Gateway processes sharing the service port (SO_REUSEPORT): one leader, the rest "
        "followers; admission limits are split between them (docs/performance.md).",
    )

    # --- admission
    max_concurrent_requests: int = Field(
        -1,
        ge=-1,
        description="Requests served at once: -1 derives a limit from the host (a third of the open-"
        "file limit, raised to its hard limit, less 256: each request holds a client and "
        "one or two worker connections), 0 is no limit (as SMG).",
    )
    queue_size: int = Field(100, ge=0, description="Requests that may wait for a slot (429 beyond).")
    queue_timeout_secs: PositiveFloat = Field(60, description="Longest wait for a slot (503 after).")
    rate_limit_tokens_per_second: NonNegFloat | None = Field(
        None,
        description="Token-bucket refill rate for admitted requests (burst = max-concurrent-requests); "
        "unset or 0: no token bucket.",
    )

    # --- priority and tenants (SMG's flags, docs/configuration.md)
    priority_scheduler_enabled: bool = Field(
        False,
        description="Admission serves waiting requests by class (X-SMG-Priority: system, interactive, "
        "default, bulk; clamped to the tenant's max class), then by the body's `priority` "
        "(lower first), then arrival; a waiter past its class's starvation threshold goes first.",
    )
    priority_scheduler_default_max_class: str = Field(
        "default", description="Highest class of a tenant that --priority-scheduler-config does not list."
    )
    priority_scheduler_config: Path | None = Field(
        None,
        description="YAML: `classes` (queue_size, queue_timeout_secs, starvation_threshold_secs, "
        "reserved_floor, reserved_per_slot per class) and `tenant_policies` (TENANT_KEY: "
        "{max_class}), as SMG's.",
    )
    tenant_rate_limit_enabled: bool = Field(
        False, description="Per-tenant requests and tokens per minute (--tenant-rate-limit-config); 429 beyond."
    )
    tenant_rate_limit_config: Path | None = Field(
        None,
        description="YAML: `default_policy` and `tenants` ({tenant_key, tokens_per_minute, "
        "requests_per_minute}), as SMG's; tokens are estimated at admission.",
    )
    tenant_api_key: list[str] = Field(
        default_factory=list,
        description="`TENANT_ID:KEY`, repeatable: a key that also opens inference, as tenant `auth:TENANT_ID`.",
    )
    trust_tenant_header: bool = Field(
        False,
        description="Take a request's tenant from --tenant-header-name (`header:VALUE`) when it has no tenant key.",
    )
    tenant_header_name: str = Field("x-smg-tenant-id", description="The tenant header (--trust-tenant-header).")

    # --- retries
    retry_max_retries: int = Field(5, ge=0, description="Retries after the first attempt.")
    retry_initial_backoff_ms: int = Field(50, ge=0, description="First backoff.")
    retry_max_backoff_ms: int = Field(30000, ge=0, description="Largest backoff.")
    retry_backoff_multiplier: float = Field(1.5, ge=1, description="Backoff growth per retry.")
    retry_jitter_factor: float = Field(0.2, ge=0, le=1, description="Random spread of each backoff (+-).")
    disable_retries: bool = Field(False, description="Never retry.")
    migration_limit: int = Field(
        0,
        ge=0,
        le=100,
        description="Times a stream that already sent tokens may move to another worker when its worker dies "
        "(as Dynamo's; 0: never). The new worker continues from the prompt plus the text sent "
        "(docs/workers.md#mid-stream-migration).",
    )

    # --- circuit breaker
    cb_failure_threshold: int = Field(10, ge=1, description="Consecutive failures that open the breaker.")
    cb_success_threshold: int = Field(3, ge=1, description="Half-open successes that close it.")
    cb_timeout_duration_secs: PositiveFloat = Field(60, description="Open time before a half-open probe.")
    cb_window_duration_secs: PositiveFloat = Field(120, description="Window over which failures count.")
    disable_circuit_breaker: bool = Field(False, description="No circuit breaker.")

    # --- health
    health_failure_threshold: int = Field(3, ge=1, description="Failed checks before a worker is unhealthy.")
    health_success_threshold: int = Field(2, ge=1, description="Passed checks before it is healthy again.")
    health_check_timeout_secs: PositiveFloat = Field(5, description="Timeout of one check.")
    health_check_interval_secs: PositiveFloat = Field(60, description="Seconds between checks.")
    health_check_endpoint: str = Field("/health", description="Path probed on each worker.")
    disable_health_check: bool = Field(False, description="No periodic health checks.")

    # --- TLS
    tls_cert_path: Path | None = Field(None, description="Serve HTTPS with this certificate (with --tls-key-path).")
    tls_key_path: Path | None = Field(None, description="Private key of --tls-cert-path.")

    # --- Kubernetes discovery
    service_discovery: bool = Field(
        False, description="Discover workers from Kubernetes pods (Running, Ready, with an IP) by their labels."
    )
    discovery_provider: DiscoveryProvider | None = Field(
        None,
        description="Where discovery finds workers: kubernetes, the only provider "
        "(naming it turns discovery on, like --service-discovery).",
    )
    selector: list[str] = Field(
        default_factory=list,
        description="`key=value` pod labels of regular workers (all must match; repeat or comma-separate).",
    )
    prefill_selector: list[str] = Field(default_factory=list, description="`key=value` pod labels of prefill workers.")
    decode_selector: list[str] = Field(default_factory=list, description="`key=value` pod labels of decode workers.")
    service_discovery_port: Port = Field(80, description="Port of the engine on each discovered pod.")
    service_discovery_namespace: str | None = Field(
        None, description="Namespace whose pods are watched (default: every namespace, which needs a ClusterRole)."
    )
    bootstrap_port_annotation: str = Field(
        "sglang.ai/bootstrap-port", description="Pod annotation holding a prefill pod's bootstrap port (P/D)."
    )
    model_id_from: str | None = Field(
        None,
        description="Serve each discovered worker also under a model id from its pod: `namespace`, "
        "`label:KEY` or `annotation:KEY`.",
    )

    # ------------------------------------------------------------------ validation
    @field_validator("worker_urls", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return [check_worker_url(u) for u in urls]

    @field_validator("prefill")
    @classmethod
    def _prefill_urls(cls, specs: list[PrefillSpec]) -> list[PrefillSpec]:
        return [PrefillSpec(url=check_worker_url(s.url), bootstrap_port=s.bootstrap_port) for s in specs]

    @field_validator("kv_sync_bind", "kv_sync_peers")
    @classmethod
    def _kv_sync_addresses(cls, value: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        for address in [value] if isinstance(value, str) else value or []:
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            if not address.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"{flag_name(info.field_name or '')} {address!r} must be a ZMQ address tcp://HOST:PORT"
                )
        return value

    @field_validator("kv_events_endpoints")
    @classmethod
    def _kv_endpoints(cls, items: list[str]) -> list[str]:
        parse_kv_events_endpoints(items)
        return items

    @field_validator("policy", "prefill_policy", "decode_policy", mode="before")
    @classmethod
    def _policy(cls, name: Any) -> Any:
        if name in REFUSED_POLICIES:
            raise ValueError(f"policy {name!r} is refused: {REFUSED_POLICIES[name]}")
        if name is not None and name not in _POLICY_VALUES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(_POLICY_VALUES)}")
        return name

    @field_validator("assignment_mode", mode="before")
    @classmethod
    def _assignment(cls, mode: Any) -> Any:
        if mode in REFUSED_ASSIGNMENT:
            raise ValueError(f"assignment mode {mode!r} is refused: {REFUSED_ASSIGNMENT[mode]}")
        return mode

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, backend: Any) -> Any:
        if backend in REFUSED_BACKENDS:
            raise ValueError(f"backend {backend!r} is refused: {REFUSED_BACKENDS[backend]}")
        return backend

    @field_validator("discovery_provider", mode="before")
    @classmethod
    def _provider(cls, provider: Any) -> Any:
        if provider == "file":
            raise ValueError(
                "the file provider is refused: discovery from a JSON manifest (SMG's "
                "--discovery-file) is not built; list the workers with --worker-urls / --prefill / "
                "--decode, or add them with POST /workers"
            )
        return provider

    @field_validator(
        "http_head_timeout_secs",
        "http_body_timeout_secs",
        "http_keepalive_timeout_secs",
        "upstream_pool_idle_timeout_secs",
    )
    @classmethod
    def _zero_is_no_limit(cls, secs: float) -> float:
        return NO_LIMIT if secs == 0 else secs

    @field_validator("routing_key_headers")
    @classmethod
    def _key_headers(cls, headers: list[str]) -> list[str]:
        return [h.strip().lower() for h in headers if h.strip()]

    @field_validator("model_alias")
    @classmethod
    def _aliases(cls, items: list[str]) -> list[str]:
        parse_model_aliases(items)
        return items

    @field_validator("atom_pd_rank_mapping_policy")
    @classmethod
    def _rank_mapping(cls, policy: str | None) -> str | None:
        if policy == "idx2idx":
            raise ValueError(
                "idx2idx is refused: the gateway chooses no data-parallel ranks in P/D mode (each "
                "engine picks its own), so there is no prefill-to-decode rank mapping; use none"
            )
        if policy not in (None, "none"):
            raise ValueError(f"unknown rank mapping policy {policy!r}; ATOMesh's are none and idx2idx")
        return policy

    @field_validator("priority_scheduler_default_max_class")
    @classmethod
    def _max_class(cls, name: str) -> str:
        PriorityClass.named(name)
        return name.strip().lower()

    @field_validator("tenant_api_key")
    @classmethod
    def _tenant_keys(cls, items: list[str]) -> list[str]:
        parse_tenant_api_keys(items)
        return items

    @model_validator(mode="after")
    def _tenancy(self) -> GatewayConfig:
        if self.tenant_rate_limit_enabled:
            if self.tenant_rate_limit_config is None:
                raise ValueError("--tenant-rate-limit-enabled needs --tenant-rate-limit-config")
            load_rate_limits(self.tenant_rate_limit_config)
        if self.priority_scheduler_enabled:
            load_scheduler(
                self.priority_scheduler_config, PriorityClass.named(self.priority_scheduler_default_max_class)
            )
        return self

    @field_validator("health_check_endpoint")
    @classmethod
    def _endpoint(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"health check endpoint {path!r} must start with '/'")
        return path

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        return [check_origin(o) for o in origins]

    @field_validator("request_id_headers")
    @classmethod
    def _headers(cls, headers: list[str]) -> list[str]:
        return [h.lower() for h in headers]

    @field_validator("prometheus_duration_buckets")
    @classmethod
    def _buckets(cls, buckets: list[float]) -> list[float]:
        if not buckets or sorted(set(buckets)) != buckets:
            raise ValueError("buckets must be a non-empty, strictly increasing list")
        return buckets

    @field_validator("selector", "prefill_selector", "decode_selector")
    @classmethod
    def _selectors(cls, items: list[str]) -> list[str]:
        return [f"{k}={v}" for k, v in parse_selector(items).items()]

    @field_validator("service_discovery_namespace")
    @classmethod
    def _namespace(cls, ns: str | None) -> str | None:
        if ns is not None and not _DNS_LABEL.fullmatch(ns):
            raise ValueError(f"{ns!r} is not a Kubernetes namespace name")
        return ns

    @field_validator("bootstrap_port_annotation")
    @classmethod
    def _annotation(cls, key: str) -> str:
        check_label_key(key)
        return key

    @field_validator("model_id_from")
    @classmethod
    def _model_id_from(cls, source: str | None) -> str | None:
        if source is not None:
            parse_model_id_source(source)
        return source

    @model_validator(mode="after")
    def _discovery(self) -> GatewayConfig:
        if self.discovery_provider is not None:
            self.service_discovery = True
        if not self.service_discovery:
            for name in (
                "selector",
                "prefill_selector",
                "decode_selector",
                "service_discovery_namespace",
                "model_id_from",
                "service_discovery_port",
                "bootstrap_port_annotation",
            ):
                if getattr(self, name) != GatewayConfig.model_fields[name].get_default(call_default_factory=True):
                    raise ValueError(f"{flag_name(name)} needs --service-discovery")
            return self
        if self.pd_disaggregation:
            if self.selector:
                raise ValueError(
                    "--selector is for regular mode; use --prefill-selector and --decode-selector "
                    "with --pd-disaggregation"
                )
            if not (self.prefill_selector or self.decode_selector):
                raise ValueError(
                    "--service-discovery with --pd-disaggregation needs --prefill-selector and/or --decode-selector"
                )
            if set(self.prefill_selector) == set(self.decode_selector):
                raise ValueError("--prefill-selector and --decode-selector must differ")
        else:
            for flag, value in (
                ("--prefill-selector", self.prefill_selector),
                ("--decode-selector", self.decode_selector),
            ):
                if value:
                    raise ValueError(f"{flag} needs --pd-disaggregation")
            if not self.selector:
                raise ValueError("--service-discovery needs --selector (the labels of the worker pods)")
        return self

    @model_validator(mode="after")
    def _modes(self) -> GatewayConfig:
        if not self.pd_disaggregation:
            for flag, value in (
                ("--prefill", self.prefill),
                ("--decode", self.decode),
                ("--prefill-policy", self.prefill_policy),
                ("--decode-policy", self.decode_policy),
            ):
                if value:
                    raise ValueError(f"{flag} needs --pd-disaggregation")
        elif self.worker_urls:
            raise ValueError("--worker-urls is for regular mode; use --prefill and --decode with --pd-disaggregation")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("--tls-cert-path and --tls-key-path go together")
        if self.retry_max_backoff_ms < self.retry_initial_backoff_ms:
            raise ValueError("--retry-max-backoff-ms must be >= --retry-initial-backoff-ms")
        if (self.client_cert_path is None) != (self.client_key_path is None):
            raise ValueError("--client-cert-path and --client-key-path go together")
        dp = self.dp_aware or PolicyName.DP_STICKY in (self.policy, self.prefill_policy, self.decode_policy)
        if dp and self.pd_disaggregation:
            raise ValueError(
                "--dp-aware / --policy dp_sticky: data-parallel ranks are chosen in regular mode only; "
                "with --pd-disaggregation the prefill and decode engines pick their own ranks"
            )
        if self.chat_template is not None and self.model_path is None and self.tokenizer_path is None:
            raise ValueError("--chat-template needs --model-path or --tokenizer-path")
        if self.kv_sync_bind is not None or self.kv_sync_peers:
            kv_pool = (self.policy_for("prefill") if self.pd_disaggregation else self.policy) == PolicyName.KV_AWARE
            if not kv_pool:
                raise ValueError(
                    "--kv-sync-bind / --kv-sync-peers share kv_aware's placements: they need --policy "
                    "kv_aware (or --prefill-policy kv_aware with --pd-disaggregation)"
                )
            if self.processes > 1:
                raise ValueError(
                    "--kv-sync-bind / --kv-sync-peers work with one gateway process (every process "
                    "would bind the same address); with --processes the processes share their "
                    "kv_aware placements with each other, not with other replicas"
                )
        return self

    # ------------------------------------------------------------------ helpers
    @property
    def dp_ranks(self) -> bool:
        """Whether the gateway chooses data-parallel ranks (--dp-aware, or the dp_sticky policy)."""
        return self.dp_aware or self.policy == PolicyName.DP_STICKY

    @property
    def metrics_host(self) -> str:
        """Where /metrics listens: --prometheus-host, else --host's address."""
        return self.prometheus_host if self.prometheus_host is not None else self.host

    def policy_for(self, role: str) -> PolicyName:
        """The policy name of one worker pool ("regular", "prefill" or "decode")."""
        if role == "prefill" and self.prefill_policy:
            return self.prefill_policy
        if role == "decode" and self.decode_policy:
            return self.decode_policy
        return self.policy


# Settings a user may give that are not built yet: naming one stops start-up with this reason.
NOT_IMPLEMENTED: dict[str, str] = {}

# Extra flag spellings (ATOMesh / SMG compatibility); each is also a YAML key (without the dashes).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "backend": ("--runtime",),
    "json_log": ("--log-json",),
    "cache_threshold": ("--cache-match-threshold",),
    "balance_abs_threshold": ("--spill-abs-threshold",),
    "balance_rel_threshold": ("--spill-rel-threshold",),
    "eviction_interval_secs": ("--eviction-interval",),
    "model_path": ("--model",),
    "max_idle_secs": ("--sticky-key-idle-secs",),
    "routing_key_override": ("--sticky-sessions",),
    "http_head_timeout_secs": ("--header-read-timeout-secs",),
    "http_body_timeout_secs": ("--stream-body-stall-timeout-secs",),
    "http_keepalive_timeout_secs": ("--idle-connection-timeout-secs",),
}
_ALIAS_KEYS = {a.removeprefix("--").replace("-", "_"): name for name, aliases in FLAG_ALIASES.items() for a in aliases}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = first["loc"]
    msg = str(first["msg"]).removeprefix("Value error, ")
    if not loc:
        return msg
    name = str(loc[0])
    where = flag_name(name) if name in GatewayConfig.model_fields else name
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    return f"{where}: {msg}{shown}"


def load_config(flags: dict[str, Any]) -> GatewayConfig:
    """Build the config from a YAML file (if `config` is given) overlaid with explicit flags.

    `flags` holds only the settings the user gave on the command line. Raises ConfigError with one
    line naming the offending setting.
    """
    values: dict[str, Any] = {}
    path = flags.get("config")
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"--config: {path} is not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of settings")
        for k, v in loaded.items():
            key = str(k).replace("-", "_")
            values[_ALIAS_KEYS.get(key, key)] = v
    values.update(flags)
    for key in FIXED_KEYS & values.keys():
        del values[key]  # a peer's switch for what atomesh always does
    for key in values:
        if key in REFUSED_KEYS:
            flag = REFUSED_KEYS[key]
            raise ConfigError(f"{flag} is refused: {REFUSED_FLAGS[flag]}")
    for name, reason in NOT_IMPLEMENTED.items():
        if name in values and values[name] not in (None, False, [], GatewayConfig.model_fields[name].default):
            raise ConfigError(f"{flag_name(name)}: {reason}")
    try:
        return GatewayConfig.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None
