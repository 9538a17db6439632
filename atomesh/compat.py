"""The command-line flags of SMG (`smg launch`, SGLang Model Gateway 1.13 and its Rust CLI) and of
ATOMesh (`mesh launch`, ROCm/ATOM `atom/mesh/src/cliargs.rs`), and what `atomesh launch` does with each.

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


_NO_TOKENIZING = ("the gateway tokenizes only for prefix_hash keys and kv_aware (whose cache of encoded message "
                  "pieces is fixed at 4,096 entries), with no cache to tune")
_NO_HISTORY = ("atomesh stores no conversations: /v1/responses is relayed to the workers, which keep their own "
               "state")

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
    # --- policy
    _same("--policy", note="random, round_robin, power_of_two, cache_aware, prefix_hash, consistent_hashing "
                           "(SMG), dp_sticky (ATOMesh), least_load; SMG's manual and bucket are refused"),
    _same("--prefill-policy"),
    _same("--decode-policy"),
    _same("--cache-threshold"),
    _alias("--cache-match-threshold", "--cache-threshold", SMG),
    _same("--balance-abs-threshold"),
    _alias("--spill-abs-threshold", "--balance-abs-threshold", SMG),
    _same("--balance-rel-threshold"),
    _alias("--spill-rel-threshold", "--balance-rel-threshold", SMG),
    _same("--eviction-interval-secs", SMG, "default 120 s as ATOMesh (SMG: 60)"),
    _alias("--eviction-interval", "--eviction-interval-secs", ATOMESH),
    _same("--max-tree-size", note="counts prompt characters, as the peers' approximate tree does"),
    _same("--prefix-token-count", ATOMESH),
    _same("--prefix-hash-load-factor", ATOMESH),
    _same("--dp-aware", note="regular mode; each worker must report its dp_size; refused with "
                             "--pd-disaggregation"),
    _refused("--bucket-adjust-interval-secs", SMG, "the bucket policy is not built"),
    _refused("--max-idle-secs", SMG, "the manual policy is not built (consistent_hashing gives key affinity "
                                     "without a key table)"),
    _refused("--assignment-mode", SMG, "the manual policy is not built"),
    _refused("--enable-igw", SMG, "IGW mode (per-model worker groups with their own policies, gRPC workers) is "
                                  "not built; atomesh routes each request among the workers that serve its model"),
    # --- P/D
    _same("--pd-disaggregation"),
    _same("--prefill"),
    _same("--decode"),
    _same("--worker-startup-timeout-secs"),
    _same("--worker-startup-check-interval"),
    _refused("--mini-lb", SMG, "SGLang's mini load balancer is a test tool; atomesh's P/D mode is the gateway"),
    # --- discovery
    _same("--service-discovery", SMG),
    _same("--selector", SMG),
    _same("--service-discovery-port", SMG),
    _same("--service-discovery-namespace", SMG),
    _same("--prefill-selector", SMG),
    _same("--decode-selector", SMG),
    # --- logging and metrics
    _same("--log-dir"),
    _same("--log-level"),
    _same("--json-log", ATOMESH),
    _alias("--log-json", "--json-log", SMG),
    _same("--prometheus-port"),
    _same("--prometheus-host", note="default: --host's address (not every interface when --host is loopback)"),
    _same("--prometheus-duration-buckets"),
    _refused("--enable-trace", SMG, "OpenTelemetry tracing is not built; the x-request-id header and the access "
                                    "log tie a request's lines together"),
    _refused("--otlp-traces-endpoint", SMG, "OpenTelemetry tracing is not built"),
    # --- admission
    _same("--max-concurrent-requests", note="-1 (default): a limit derived from the host's open-file limit; "
                                            "0: no limit"),
    _same("--queue-size"),
    _same("--queue-timeout-secs"),
    _same("--rate-limit-tokens-per-second", note="0 or unset: no token bucket"),
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
    _same("--tokenizer-path"),
    _same("--chat-template"),
    _refused("--tokenizer-cache-enable-l0", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-l0-max-entries", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-enable-l1", BOTH, _NO_TOKENIZING),
    _refused("--tokenizer-cache-l1-max-memory", BOTH, _NO_TOKENIZING),
    # --- parsers: the gateway relays bodies; parsing generated text is the engine's job here
    _refused("--reasoning-parser", BOTH, "the gateway relays answers as the engine writes them; run the engine's "
                                         "own reasoning parser"),
    _refused("--tool-call-parser", BOTH, "the gateway relays answers as the engine writes them; run the engine's "
                                         "own tool-call parser"),
    _refused("--mcp-config-path", SMG, "MCP tool servers are not built"),
    # --- backend and storage
    _same("--backend", note="sglang, vllm or atom (ATOMesh's set; alias --runtime); SMG's openai/anthropic "
                            "proxying is not built"),
    _alias("--runtime", "--backend", ATOMESH),
    _refused("--history-backend", SMG, _NO_HISTORY),
    *(_refused(f, SMG, _NO_HISTORY) for f in (
        "--oracle-wallet-path", "--oracle-tns-alias", "--oracle-connect-descriptor", "--oracle-username",
        "--oracle-password", "--oracle-pool-min", "--oracle-pool-max", "--oracle-pool-timeout-secs",
        "--postgres-db-url", "--postgres-pool-max", "--redis-url", "--redis-pool-max", "--redis-retention-days")),
    # --- TLS
    _same("--tls-cert-path", SMG),
    _same("--tls-key-path", SMG),
    _same("--ca-cert-paths", SMG),
    _same("--client-cert-path", SMG),
    _same("--client-key-path", SMG),
    # --- authentication
    _same("--api-key", note="clients must present it (Bearer); each request's Authorization goes on to a "
                            "worker without a key of its own (POST /workers api_key)"),
    _refused("--control-plane-api-keys", SMG, "use --admin-api-key (one key for the admin routes)"),
    _refused("--control-plane-audit-enabled", SMG, "admin calls are in the access log; no separate audit log"),
    _refused("--jwt-issuer", SMG, "JWT/OIDC authentication is not built; use --api-key / --admin-api-key"),
    _refused("--jwt-audience", SMG, "JWT/OIDC authentication is not built"),
    _refused("--jwt-jwks-uri", SMG, "JWT/OIDC authentication is not built"),
    _refused("--jwt-role-mapping", SMG, "JWT/OIDC authentication is not built"),
)

REFUSED_FLAGS: dict[str, str] = {f.flag: f.note for f in PEER_FLAGS if f.status is Status.REFUSED}
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
        "Every flag of `smg launch` (SGLang Model Gateway 1.13, and the spellings of its Rust CLI) and of",
        "ATOMesh's `mesh launch`, and what `atomesh launch` does with it: **same** (the peer's meaning),",
        "**alias** (the peer's spelling of an atomesh flag), or **refused** (start-up stops with this reason).",
        "",
        "| flag | peer | here | notes |",
        "|---|---|---|---|",
    ]
    for f in PEER_FLAGS:
        lines.append(f"| `{f.flag}` | {f.peers} | {f.status.value} | {f.note} |")
    return "\n".join(lines) + "\n"
