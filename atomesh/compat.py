"""The command-line flags of SMG (`smg launch` of pip `smg==1.13.0`, every spelling its help lists) and of
ATOMesh (`mesh launch`, ROCm/ATOM `atom/mesh/src/cliargs.rs` on main), and what `atomesh launch` does with
each.

Every peer flag is here: implemented with the peer's meaning (under the same name or an alias), or
refused at start-up with a line that names it and says why. docs/configuration.md prints this table
(`atomesh config-reference`); a test checks it against `smg launch --help` and the launch options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

SMG = "SMG"
ATOMESH = "ATOMesh"
BOTH = "SMG, ATOMesh"


class Status(StrEnum):
    SAME = "same"  # the same flag with the peer's meaning
    ALIAS = "alias"  # the peer's spelling of an atomesh flag
    REFUSED = "refused"  # start-up stops with `note`
    FIXED = "fixed"  # a switch whose setting is atomesh's only behaviour: accepted, changes nothing


@dataclass(frozen=True, slots=True)
class PeerFlag:
    flag: str
    peers: str
    status: Status
    note: str = ""  # the refusal's reason, or how atomesh reads the flag where that needs saying


def _same(flag: str, peers: str = BOTH, note: str = "") -> PeerFlag:
    return PeerFlag(flag, peers, Status.SAME, note)


def _alias(flag: str, of: str, peers: str) -> PeerFlag:
    return PeerFlag(flag, peers, Status.ALIAS, f"same as `{of}`")


def _refused(flag: str, peers: str, why: str) -> PeerFlag:
    return PeerFlag(flag, peers, Status.REFUSED, why)


def _fixed(flag: str, peers: str, why: str) -> PeerFlag:
    return PeerFlag(flag, peers, Status.FIXED, why)


_NO_TOKENIZING = (
    "the gateway tokenizes only for prefix_hash keys and kv_aware (whose cache of encoded message "
    "pieces is fixed at 4,096 entries), with no cache to tune"
)
_NO_HISTORY = (
    "atomesh stores no conversations or responses: /v1/responses is relayed to the workers, which keep their own state"
)
_NO_MEDIA = (
    "the gateway relays media in request bodies untouched; fetching and preprocessing images is the engine's job here"
)
_NO_MESH = (
    "SMG's HA mesh (routers gossiping workers and policy state) is not built; gateway replicas share "
    "kv_aware placements with --kv-sync-bind / --kv-sync-peers, and --processes shares one port"
)
_NO_EPD = "encode-prefill-decode (EPD) disaggregation is not built; P/D is (--pd-disaggregation)"
_NO_OVERLOAD = (
    "no per-worker overload veto from engine queue or KV usage: the circuit breaker and health checks "
    "take failing workers out, and load-aware policies (least_load, power_of_two, cache_aware) steer "
    "around busy ones"
)
_NO_LIVENESS = (
    "no contact-time liveness veto: a worker leaves routing through its circuit breaker (failed "
    "requests) or health checks"
)
_NO_WARMUP = "cache_aware's warm-up slice for new or emptied workers is not built"
_CACHE_TREE = (
    "cache_aware here keeps one approximate prefix index of prompt characters (no engine KV events, no "
    "token-usage signals); kv_aware follows the engines' KV events"
)
_NO_LEAST_LOAD_MODEL = (
    "least_load here compares in-flight requests (or the engine's polled running + waiting "
    "count, if higher), with no throughput or KV-pressure model"
)
_NO_PD_ADMISSION = (
    "no separate prefill admission or decode-window gate: one admission queue covers the whole "
    "request, and P/D legs are bounded by --request-timeout-secs"
)
_NO_RL = "the RL control plane (/v1/rl) is not built"
_NO_WASM = "WebAssembly modules and storage hooks are not built"
_NO_JOBS = (
    "there is no control-plane job queue: a worker added or removed (POST/DELETE /workers, discovery) is "
    "registered by its own task at once"
)
_NO_ZMQ = "workers are reached over HTTP only (no ZMQ/gRPC engine workers)"
_PARSERS = "the gateway relays answers as the engine writes them; run the engine's own parsers"

PEER_FLAGS: tuple[PeerFlag, ...] = (
    # --- workers and server
    _same("--host"),
    _same("--port"),
    _same("--worker-urls"),
    _same("--max-payload-size"),
    _same("--request-timeout-secs"),
    _same("--shutdown-grace-period-secs"),
    _same("--request-id-headers"),
    _same("--cors-allowed-origins", SMG),
    _same("--upstream-pool-idle-timeout-secs", SMG, "default 60 s (SMG: 3); 0 keeps idle connections"),
    _refused("--upstream-http2", SMG, "the gateway speaks HTTP/1.1 to workers (keep-alive pool); HTTP/2 is not built"),
    _same(
        "--health-check-port",
        SMG,
        "a listener of its own, in the same event loop (SMG: an isolated runtime); the probes stay on --port too",
    ),
    _alias("--header-read-timeout-secs", "--http-head-timeout-secs", SMG),
    _alias("--idle-connection-timeout-secs", "--http-keepalive-timeout-secs", SMG),
    _alias("--stream-body-stall-timeout-secs", "--http-body-timeout-secs", SMG),
    _refused(
        "--max-buffered-request-bytes",
        SMG,
        "atomesh reads every request body whole (it parses each one to "
        "place it), bounded by --max-payload-size; nothing is streamed "
        "unbuffered",
    ),
    _refused("--sse-keepalive-secs", SMG, "SSE keep-alive comments are not built: streams carry what the engine sends"),
    _refused("--jemalloc-prof-dir", SMG, "a Python process has no jemalloc heap profile"),
    _refused("--job-queue-capacity", SMG, _NO_JOBS),
    _refused("--job-queue-concurrency", SMG, _NO_JOBS),
    # --- policy
    _same(
        "--policy",
        note="random, round_robin, power_of_two, least_load, cache_aware, prefix_hash, "
        "consistent_hashing, passthrough, manual (SMG), dp_sticky (ATOMesh), kv_aware; SMG's "
        "bucket is refused",
    ),
    _same("--prefill-policy"),
    _same("--decode-policy"),
    _refused("--encode-policy", SMG, _NO_EPD),
    _same("--cache-threshold"),
    _alias("--cache-match-threshold", "--cache-threshold", SMG),
    _same("--balance-abs-threshold"),
    _alias("--spill-abs-threshold", "--balance-abs-threshold", SMG),
    _same("--balance-rel-threshold"),
    _alias("--spill-rel-threshold", "--balance-rel-threshold", SMG),
    _same("--eviction-interval-secs", SMG, "default 120 s as ATOMesh (SMG: 60)"),
    _alias("--eviction-interval", "--eviction-interval-secs", ATOMESH),
    _same("--max-tree-size", note="counts prompt characters, as the peers' approximate tree does"),
    _same("--prefix-token-count"),
    _same("--prefix-hash-load-factor"),
    _same("--prefix-hash-balance-abs-threshold", SMG),
    _same("--max-idle-secs", SMG, "the manual policy's key table and --routing-key-override's pins"),
    _alias("--sticky-key-idle-secs", "--max-idle-secs", SMG),
    _same(
        "--assignment-mode",
        SMG,
        "manual's random, min_load, min_group; delegate is refused (with "
        "--routing-key-override every policy's choice is pinned)",
    ),
    _same("--routing-key-headers", SMG, "default x-smg-routing-key x-session-id x-routing-key x-user-id"),
    _same(
        "--routing-key-override",
        SMG,
        "a key's pin is what the policy chose (SMG's delegate); the request-id "
        "lineage fallback is not built: a request without a routing key is placed "
        "by the policy",
    ),
    _alias("--sticky-sessions", "--routing-key-override", SMG),
    _same("--dp-aware", note="regular mode; each worker must report its dp_size; refused with --pd-disaggregation"),
    _refused(
        "--dp-minimum-tokens-scheduler",
        SMG,
        "data-parallel ranks are chosen by in-flight requests "
        "(--dp-aware) or by routing key (dp_sticky), not by tokens",
    ),
    _same(
        "--atom-pd-rank-mapping-policy",
        ATOMESH,
        "none (the engines pick their ranks); idx2idx is refused: no ranks are chosen in P/D mode. "
        "Tensor-parallel engines need no mapping from the gateway: decode rank r pulls from prefill rank r "
        "inside the engines ([engine.md](engine.md#tensor-and-expert-parallelism))",
    ),
    _refused("--bucket-adjust-interval-secs", SMG, "the bucket policy is not built"),
    _refused(
        "--power-of-two-load-metric",
        SMG,
        "power_of_two compares each worker's load (in-flight requests, or "
        "the engine's polled running + waiting count if higher); the "
        "metric is not selectable",
    ),
    _refused("--least-load-kv-pressure-weight", SMG, _NO_LEAST_LOAD_MODEL),
    _refused("--least-load-default-throughput", SMG, _NO_LEAST_LOAD_MODEL),
    _refused("--least-load-mean-prefill-tokens", SMG, _NO_LEAST_LOAD_MODEL),
    _refused("--least-load-max-waiting-requests", SMG, _NO_LEAST_LOAD_MODEL),
    _refused("--balance-token-usage-threshold", SMG, _CACHE_TREE),
    _refused("--overload-token-usage-threshold", SMG, _CACHE_TREE),
    _refused("--kv-index", SMG, _CACHE_TREE),
    _refused("--block-size", SMG, _CACHE_TREE + "; kv_aware reads each engine's block size from its /server_info"),
    _refused("--cache-boundaries", SMG, _CACHE_TREE),
    _refused("--cache-index", SMG, _CACHE_TREE),
    _refused("--cache-ttl-secs", SMG, _CACHE_TREE + "; entries leave by --max-tree-size and --eviction-interval-secs"),
    _refused("--selection-policy", SMG, _CACHE_TREE),
    _refused(
        "--selection-accounting-ttl-ms",
        SMG,
        _CACHE_TREE + "; placements count as load from the moment they are made until their last byte",
    ),
    _refused("--overlap-decay", SMG, _CACHE_TREE + "; kv_aware weighs overlap against load (--kv-overlap-weight)"),
    _refused("--selection-temperature", SMG, _CACHE_TREE + "; kv_aware has --kv-temperature"),
    _refused("--worker-overload-waiting-requests", SMG, _NO_OVERLOAD),
    _refused("--worker-overload-token-usage", SMG, _NO_OVERLOAD),
    _refused("--worker-overload-protection", SMG, _NO_OVERLOAD),
    _fixed("--disable-worker-overload-protection", SMG, "there is no overload veto to switch off"),
    _refused("--worker-overload-shed", SMG, _NO_OVERLOAD),
    _refused("--worker-stall-secs", SMG, _NO_LIVENESS),
    _refused("--worker-wedge-secs", SMG, _NO_LIVENESS),
    _refused("--worker-stale-secs", SMG, _NO_LIVENESS),
    *(
        _refused(f, SMG, _NO_WARMUP)
        for f in (
            "--worker-warmup-secs",
            "--worker-warmup-share",
            "--worker-warmup-blocks",
            "--worker-warmup-thin-ratio",
            "--worker-warmup-divert-every",
        )
    ),
    _refused(
        "--enable-igw",
        SMG,
        "IGW mode (per-model worker groups with their own policies, gRPC workers) is "
        "not built; atomesh routes each request among the workers that serve its model",
    ),
    _same("--load-monitor-interval", SMG, "default 1 s (0.1 s with kv_aware; SMG: 10)"),
    _fixed("--disable-load-monitoring", SMG, "loads are polled only while a load-aware policy needs them"),
    # --- P/D and EPD
    _same("--pd-disaggregation"),
    _same("--prefill"),
    _same("--decode"),
    _same("--worker-startup-timeout-secs"),
    _same("--worker-startup-check-interval"),
    _same("--worker-startup-delay", SMG),
    _refused(
        "--mini-lb",
        "SGLang router 0.3",
        "SGLang's mini load balancer is a test tool; atomesh's P/D mode is the gateway",
    ),
    _refused("--epd-disaggregation", SMG, _NO_EPD),
    _refused("--encode", SMG, _NO_EPD),
    _refused("--prefill-max-inflight-requests-per-worker", SMG, _NO_PD_ADMISSION),
    _refused("--prefill-queue-size", SMG, _NO_PD_ADMISSION),
    _refused("--prefill-queue-timeout-secs", SMG, _NO_PD_ADMISSION),
    _refused("--pd-admission-wait-secs", SMG, _NO_PD_ADMISSION),
    # --- discovery
    _same("--service-discovery", SMG),
    _same("--discovery-provider", SMG, "kubernetes; file is refused"),
    _refused("--discovery-file", SMG, "the file discovery provider is not built"),
    _refused("--discovery-check-interval-secs", SMG, "the file discovery provider is not built"),
    _same("--selector", SMG),
    _same("--service-discovery-port", SMG),
    _same("--service-discovery-namespace", SMG),
    _same("--prefill-selector", SMG),
    _same("--decode-selector", SMG),
    _refused("--encode-selector", SMG, _NO_EPD),
    _refused("--router-selector", SMG, _NO_MESH),
    _same("--model-id-from", SMG),
    _same("--model-alias", SMG, "vendor contract profiles (kimi-*, minimax-*) are not built: an alias only names"),
    _refused(
        "--kv-connector-annotation",
        SMG,
        "per-pod vLLM KV connector selection is not built; P/D takes --backend for every worker",
    ),
    _refused("--kv-engine-id-annotation", SMG, "per-pod vLLM KV engine ids are not built"),
    _refused(
        "--remove-unhealthy-workers",
        SMG,
        "an unhealthy worker stays registered and is probed until it recovers; discovery removes pods that go away",
    ),
    _refused(
        "--worker-auto-recovery",
        SMG,
        "an unhealthy worker stays registered and is probed until it recovers; discovery removes pods that go away",
    ),
    _fixed(
        "--no-remove-unhealthy-workers", SMG, "an unhealthy worker stays registered and is probed until it recovers"
    ),
    _fixed("--no-worker-auto-recovery", SMG, "an unhealthy worker stays registered and is probed until it recovers"),
    # --- logging and metrics
    _same("--log-dir"),
    _same("--log-level"),
    _same("--json-log", ATOMESH),
    _alias("--log-json", "--json-log", SMG),
    _same("--prometheus-port"),
    _same("--prometheus-host", note="default: --host's address (not every interface when --host is loopback)"),
    _same("--prometheus-duration-buckets"),
    _same(
        "--enable-trace",
        SMG,
        "spans per request, admission, attempt and upstream leg; W3C traceparent in "
        "and out (the `tracing` extra: grpcio; atomesh writes the OTLP protobuf itself)",
    ),
    _same("--otlp-traces-endpoint", SMG, "OTLP/gRPC HOST:PORT, default localhost:4317"),
    _refused("--log-mm-timing", SMG, _NO_MEDIA),
    # --- admission
    _same(
        "--max-concurrent-requests", note="-1 (default): a limit derived from the host's open-file limit; 0: no limit"
    ),
    _same("--queue-size"),
    _same("--queue-timeout-secs"),
    _same("--rate-limit-tokens-per-second", note="0 or unset: no token bucket"),
    _refused("--max-background-responses", SMG, _NO_HISTORY),
    _same(
        "--priority-scheduler-enabled",
        SMG,
        "classes served in order with aging and slot reservations; "
        "preemption is not built (can_preempt refused in the YAML)",
    ),
    _same("--priority-scheduler-default-max-class", SMG),
    _same(
        "--priority-scheduler-config",
        SMG,
        "classes: queue_size, queue_timeout_secs, "
        "starvation_threshold_secs, reserved_floor, reserved_per_slot (none "
        "by default); tenant_policies: max_class",
    ),
    _refused(
        "--priority-scheduler-tenant-metric-top-n",
        SMG,
        "per-tenant scheduler metrics are not built: there are no tenant labels to cap",
    ),
    _same("--tenant-rate-limit-enabled", SMG),
    _same(
        "--tenant-rate-limit-config",
        SMG,
        "default_policy and tenants; tokens are estimated at admission "
        "(prompt characters / 4 + the output limit), not settled; "
        "model_rules are refused",
    ),
    _same(
        "--tenant-api-key", SMG, "no stored responses to scope: the key names the tenant for priority and rate limits"
    ),
    _same("--trust-tenant-header", SMG),
    _same("--tenant-header-name", SMG),
    _refused("--storage-context-headers", SMG, _NO_HISTORY),
    # --- retries, breaker, health
    _same("--retry-max-retries"),
    _same("--retry-initial-backoff-ms"),
    _same("--retry-max-backoff-ms"),
    _same("--retry-backoff-multiplier"),
    _same("--retry-jitter-factor"),
    _same("--disable-retries"),
    _same("--cb-failure-threshold"),
    _same("--cb-success-threshold"),
    _same("--cb-timeout-duration-secs"),
    _same("--cb-window-duration-secs"),
    _same("--disable-circuit-breaker"),
    _same("--health-failure-threshold"),
    _same("--health-success-threshold"),
    _same("--health-check-timeout-secs"),
    _same("--health-check-interval-secs"),
    _same("--health-check-endpoint"),
    _same("--disable-health-check"),
    # --- tokenizer
    _same("--model-path", note="a local folder or file; a Hugging Face id is refused (nothing is downloaded)"),
    _alias("--model", "--model-path", SMG),
    _same("--tokenizer-path"),
    _same("--chat-template"),
    _fixed("--disable-tokenizer-autoload", SMG, "a tokenizer is loaded only from --model-path / --tokenizer-path"),
    _refused("--tokenizer-cache-enable-l0", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-l0-max-entries", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-l0-max-memory", SMG, _NO_TOKENIZING),
    _refused("--tokenizer-cache-enable-l1", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-l1-max-memory", BOTH, _NO_TOKENIZING),
    # --- parsers: the gateway relays bodies; parsing generated text is the engine's job here
    _refused("--reasoning-parser", BOTH, _PARSERS),
    _refused("--tool-call-parser", BOTH, _PARSERS),
    _refused("--parser", SMG, _PARSERS),
    _refused("--mcp-config-path", SMG, "MCP tool servers are not built"),
    # --- multimodal
    *(
        _refused(f, SMG, _NO_MEDIA)
        for f in (
            "--multimodal-tensor-transport",
            "--multimodal-shm-min-bytes",
            "--multimodal-max-inflight-bytes",
            "--mm-per-request-image-limit",
            "--mm-processing",
            "--mm-pixel-cache-mb",
            "--mm-pixel-rdma",
            "--mm-allowed-media-domains",
            "--mm-allow-private-media-hosts",
            "--rdma-listen-ip",
            "--rdma-slot-ttl-s",
        )
    ),
    # --- backend and storage
    _same(
        "--backend",
        note="sglang, vllm or atom (ATOMesh's set; alias --runtime); SMG's openai, anthropic and "
        "tokenspeed are refused",
    ),
    _alias("--runtime", "--backend", ATOMESH),
    _refused("--zmq-engine-count", SMG, _NO_ZMQ),
    _refused("--enable-wasm", SMG, _NO_WASM),
    _refused("--storage-hook-wasm-path", SMG, _NO_WASM),
    _refused("--history-backend", SMG, _NO_HISTORY),
    *(
        _refused(f, SMG, _NO_HISTORY)
        for f in (
            "--history-memory-max-responses",
            "--history-memory-max-items",
            "--history-memory-retention-secs",
            "--schema-config",
            "--oracle-wallet-path",
            "--oracle-tns-alias",
            "--oracle-connect-descriptor",
            "--oracle-username",
            "--oracle-password",
            "--oracle-external-auth",
            "--oracle-pool-min",
            "--oracle-pool-max",
            "--oracle-pool-timeout-secs",
            "--postgres-db-url",
            "--postgres-pool-max",
            "--postgres-op-timeout-secs",
            "--redis-url",
            "--redis-pool-max",
            "--redis-retention-days",
            "--redis-op-timeout-secs",
        )
    ),
    # --- TLS
    _same("--tls-cert-path"),
    _same("--tls-key-path"),
    _same("--ca-cert-paths", SMG),
    _same("--client-cert-path", SMG),
    _same("--client-key-path", SMG),
    # --- authentication
    _same(
        "--api-key",
        note="clients must present it (Bearer); each request's Authorization goes on to a "
        "worker without a key of its own (POST /workers api_key)",
    ),
    _refused("--control-plane-api-keys", SMG, "use --admin-api-key (one key for the admin routes)"),
    _refused("--control-plane-audit-enabled", SMG, "admin calls are in the access log; no separate audit log"),
    _refused("--jwt-issuer", SMG, "JWT/OIDC authentication is not built; use --api-key / --admin-api-key"),
    _refused("--jwt-audience", SMG, "JWT/OIDC authentication is not built"),
    _refused("--jwt-jwks-uri", SMG, "JWT/OIDC authentication is not built"),
    _refused("--jwt-role-mapping", SMG, "JWT/OIDC authentication is not built"),
    # --- RL control plane and mesh
    _refused("--enable-rl", SMG, _NO_RL),
    _refused("--rl-control-timeout-secs", SMG, _NO_RL),
    _refused("--rl-fanout-concurrency", SMG, _NO_RL),
    *(
        _refused(f, SMG, _NO_MESH)
        for f in (
            "--enable-mesh",
            "--mesh-server-name",
            "--mesh-host",
            "--mesh-advertise-host",
            "--mesh-port",
            "--mesh-peer-urls",
            "--mesh-tls-ca-cert",
            "--mesh-tls-cert",
            "--mesh-tls-key",
        )
    ),
)

REFUSED_FLAGS: dict[str, str] = {f.flag: f.note for f in PEER_FLAGS if f.status is Status.REFUSED}
# Switches accepted and dropped before parsing: what they ask for is how atomesh always works.
FIXED_FLAGS: frozenset[str] = frozenset(f.flag for f in PEER_FLAGS if f.status is Status.FIXED)
FIXED_KEYS: frozenset[str] = frozenset(f.removeprefix("--").replace("-", "_") for f in FIXED_FLAGS)
# The same, as `--config FILE.yaml` keys.
REFUSED_KEYS: dict[str, str] = {f.removeprefix("--").replace("-", "_"): f for f in REFUSED_FLAGS}


def refused_flag(argv: Sequence[str]) -> str | None:
    """The refusal line for the first peer flag in `argv` that atomesh does not build, or None."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        why = REFUSED_FLAGS.get(flag)
        if why is not None:
            return f"{flag} is refused: {why} (docs/configuration.md lists every SMG / ATOMesh flag)"
    return None


def peer_table_markdown() -> str:
    """The table of docs/configuration.md: each peer flag and its status here."""
    lines = [
        "## SMG and ATOMesh flags",
        "",
        "Every flag of `smg launch` (SMG 1.13.0, pip `smg==1.13.0`: every spelling its `smg launch --help` lists;",
        "a test reads that help and fails on any flag missing here) and of ATOMesh's `mesh launch`, and what",
        "`atomesh launch` does with it: **same** (the peer's meaning), **alias** (the peer's spelling of an",
        "atomesh flag), **fixed** (a switch asking for what atomesh always does: accepted, changes nothing), or",
        "**refused** (start-up stops with a line naming the flag and this reason).",
        "",
        "| flag | peer | here | notes |",
        "|---|---|---|---|",
    ]
    for f in PEER_FLAGS:
        lines.append(f"| `{f.flag}` | {f.peers} | {f.status.value} | {f.note} |")
    return "\n".join(lines) + "\n"
