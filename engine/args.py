"""Command-line flags of ``python -m engine.openai_server`` (ATOM's names) and the settings they become.

Every flag ATOM accepts that this engine does not implement is refused with a message naming it;
none is silently ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.flags import json_object_flag
from engine.kv_events import KVEventsConfig, parse_kv_events_config
from engine.spec_decode import SpeculativeConfig, parse_speculative_config, speculative_config

# ATOM flags we know and do not implement: flag -> why.
_REFUSED_FLAGS = {
    "--port": "this engine has no internal engine port (ATOM's --port); use --server-port for HTTP",
    "--enable-dp-attention": "data-parallel attention is not built: every rank attends over every token (tensor "
    "parallel), see --data-parallel-size",
    "--level": "torch.compile levels are not used by this engine (CUDA graphs and Triton kernels instead)",
    "--hf-overrides": "--hf-overrides is not supported",
    "--enable-tbo": "two-batch overlap is not supported",
    "--index-cache-dtype": "the sparse-attention indexer cache is kept in the model dtype; no other is built",
    "--index_cache_dtype": "the sparse-attention indexer cache is kept in the model dtype; no other is built",
    "--chat-template": "--chat-template is not supported; the template comes from the model",
}

# Why -dp > 1 is refused (docs/engine.md says more).
DP_REFUSAL = ("data parallelism (ATOM's DP attention) is not built: each data-parallel rank would need its own "
              "scheduler and KV pool and the gateway its data_parallel_rank; run one engine per GPU group instead, "
              "and for MoE use -tp N --enable-expert-parallel (every rank attends over every token, so expert "
              "dispatch needs no all-to-all)")  # fmt: skip

_PARALLEL_FLAGS = (
    ("pipeline_parallel_size", "--pipeline-parallel-size/-pp"),
    ("decode_context_parallel_size", "--decode-context-parallel-size/-dcp"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size/-pcp"),
)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_CONFIG_KEYS = {"kv_connector", "kv_role", "handshake_port", "proxy_ip", "http_port", "protocol",
                   "memory_backend", "staging_buffer_mb", "max_inflight_pulls", "write_lanes",
                   "early_offer"}  # fmt: skip
MEMORY_BACKENDS = ("auto", "direct", "staged")
# engine.kv_transfer.transport.Transport, plus "ipc" (engine.kv_transfer.ipc: pools mapped between engines of a host)
KV_PROTOCOLS = ("ipc", "tcp", "rdma", "nvlink_intra", "nvlink")
DEFAULT_HANDSHAKE_PORT = 6301


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """The parsed ``--kv-transfer-config`` JSON (ATOM's keys; ``proxy_ip`` accepted and ignored)."""

    kv_role: str | None = None
    kv_connector: str | None = None
    handshake_port: int = DEFAULT_HANDSHAKE_PORT
    http_port: int | None = None
    protocol: str | None = None
    # Where the relay moves KV from (engine.kv_transfer.backend): auto, direct or staged.
    memory_backend: str = "auto"
    staging_buffer_mb: int = 128  # the staged backend's registered buffer, per engine
    # Transfers in flight at once: decode's pulls (each holds two staging slots), prefill's staged writes.
    max_inflight_pulls: int = 8
    write_lanes: int = 2  # Mooncake writes in flight per peer (threads that busy-wait: not more than cores)
    # A producer answers a prefill leg that asks ``early_offer`` at once, its KV read as its prefill runs
    # (docs/pd.md); False: every prefill leg is answered once its prefill ended.
    early_offer: bool = True


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Every engine setting, validated once at start-up."""

    model: str = "smollm2"
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    server_port: int = 8000
    tensor_parallel_size: int = 1  # ranks (processes, GPUs) the model is split across; rank 0 serves HTTP
    enable_expert_parallel: bool = False  # MoE: whole experts per rank instead of every expert split
    data_parallel_size: int = 1
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 1.0
    num_kvcache_blocks: int | None = None
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_waiting_requests: int = 1024
    scheduling_policy: str = "fcfs"  # vLLM's: fcfs, or priority (the request's `priority`, lower first)
    otlp_traces_endpoint: str | None = None  # vLLM's: OTLP/gRPC HOST:PORT for the engine's spans; None: off
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    kv_transfer: KVTransferConfig = KVTransferConfig()
    kv_transfer_timeout: float = 30.0
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    sparse_attention: bool = False
    sparse_topk_blocks: int = 16
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = True  # schedule a decode step while the one before runs (LLMEngine.can_run_ahead)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, ... up to max_num_seqs
    kernels: str = "auto"
    quantization: str | None = None  # "fp8": linear weights to FP8 at load (per channel), activations per token
    load_format: str = "auto"  # "dummy": random weights of the config's shape (speed runs without the checkpoint)
    torch_threads: int | None = None
    log_level: str = "info"
    tool_call_parser: str | None = None  # how tool calls are read from free-form output (vLLM's flag)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser), as vLLM
    exit_on_engine_error: bool = False  # a dead engine ends the process (status 1) instead of answering 503
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; flag names follow ATOM's ``atom.entrypoints.openai_server``."""
    p = argparse.ArgumentParser(
        prog="python -m engine.openai_server",
        description="ATOM-compatible OpenAI server of the atomesh engine (paged KV cache, continuous batching).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        default="smollm2",
        help="GGUF file, safetensors folder, 'smollm2' (embedded SmolLM2-135M-Instruct) or 'tiny-random[:SEED]'",
    )
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--server-port", type=int, default=8000, help="HTTP port")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many ranks (one process and GPU each; gloo on CPU): "
                   "attention and MLP column/row-parallel, vocabulary-parallel embedding and LM head")  # fmt: skip
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models with -tp N: each rank holds num_experts/N whole experts instead of a slice of "
                   "every expert")  # fmt: skip
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="only 1 is supported")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="only 1 is supported (DP attention is not built)")  # fmt: skip
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1, help="only 1 is supported")
    p.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1, help="only 1 is supported")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="CUDA: share of GPU memory for weights + KV"
    )
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="CPU: GiB of KV cache")
    p.add_argument("--num-kvcache-blocks", type=int, default=None, help="exact KV block count (overrides sizing)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-waiting-requests", type=int, default=1024, help="bound of the waiting queue; beyond it: 503")
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OTLP/gRPC collector HOST:PORT: each request's spans (queue, prefill, KV transfer, decode) "
        "under the traceparent it came with (as vLLM)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="waiting prompts in arrival order, or by the request's `priority` (lower first), as vLLM",
    )
    p.add_argument(
        "--enable_chunked_prefill",
        "--enable-chunked-prefill",
        dest="enable_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split prompts longer than the step's token budget over several steps",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="at most this many prompt tokens of one request per step (0: only the budget limits)",
    )
    p.add_argument(
        "--kv_cache_dtype",
        "--kv-cache-dtype",
        dest="kv_cache_dtype",
        choices=["auto", "bf16", "fp16", "fp32", "fp8"],
        default="auto",
        help="KV cache storage dtype; auto = the model dtype",
    )
    p.add_argument(
        "--enable_prefix_caching",
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=True,
    )
    p.add_argument("--kv-transfer-config", default="{}", help="KV transfer config as JSON")
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="prefill side: seconds a finished prefill keeps its KV blocks for decode to pull",
    )
    p.add_argument(
        "--kv-events-config",
        default="{}",
        help='KV cache events as vLLM publishes them, JSON: {"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}',
    )
    p.add_argument(
        "--sparse-attention",
        choices=["off", "on"],
        default="off",
        help="MSA-style block-sparse decode: each step attends to the top-k blocks (by indexer key) "
        "plus the first and the most recent",
    )
    p.add_argument("--sparse-topk-blocks", type=int, default=16, help="blocks chosen by the indexer per decode step")
    p.add_argument(
        "--device",
        type=parse_device,
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N}",
        help="cuda:N runs on GPU N (one engine per GPU: N engines on N GPUs); cuda is cuda:0",
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of requests that bring none")
    p.add_argument("--torch-threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument(
        "--exit-on-engine-error",
        action="store_true",
        help="exit with status 1 when the engine dies (a CUDA fault); without it the server stays up, "
        "/health answers 503 and requests get 503 engine_dead",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs (decode steps launch kernel by kernel)"
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and launch the next decode step while the one before still runs, its input tokens read on "
        "the device (CUDA graphs; steps that need the tokens on the host first, such as penalties, logprobs or "
        "grammars, are not run ahead)",
    )
    p.add_argument(
        "--cudagraph-capture-sizes",
        nargs="+",
        default=None,
        metavar="N",
        help="CUDA: decode batch sizes to capture as graphs, as ATOM ('[1,2,4,8]') or vLLM (1 2 4 8) writes them "
        "(default: 1 2 4 and every multiple of 8 up to --max-num-seqs, at most 512); larger batches run eagerly",
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="the model's ops: fused Triton kernels (auto on CUDA) or plain torch (the exact reference; auto on CPU)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        choices=["fp8"],
        default=None,
        help="fp8: quantize the linear weights of a bf16/fp16 checkpoint to FP8 e4m3 at load (one scale per "
        "output channel; activations per token at run time: ATOM's online PTPC-FP8). FP8 checkpoints "
        "(quantization_config fp8 / compressed-tensors) load as FP8 without it",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="dummy: random weights in the shape of the model's config.json, drawn on the device "
        "(as vLLM's --load-format dummy; speed runs without the checkpoint, the text is noise)",
    )
    p.add_argument(
        "--load_dummy",
        dest="load_format",
        action="store_const",
        const="dummy",
        help="ATOM's spelling of --load-format dummy",
    )
    p.add_argument("--speculative-config", default="{}",
                   help='speculative decoding as vLLM configures it, JSON: {"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} (prompt lookup '
                   'over the prompt and the output so far) or {"method": "eagle3", "model": HEAD_FOLDER, '
                   '"num_speculative_tokens": 3} (an EAGLE-3 draft head); exact under greedy sampling')  # fmt: skip
    p.add_argument("--method", default=None,
                   help="ATOM's spelling of the speculative method: ngram or eagle3 (mtp and dspark are refused: "
                   "not built)")  # fmt: skip
    p.add_argument("--draft-model", default=None,
                   help="ATOM's spelling of the EAGLE-3 head's folder (with --method eagle3)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="ATOM's spelling: draft tokens per step (with --method)")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true", help="accepted: this engine never runs model code")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                   help="how tool calls are parsed from the output of tool_choice auto (vLLM's flag): hermes reads "
                   '<tool_call>{"name": ..., "arguments": ...}</tool_call>')  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice auto (needs --tool-call-parser), as vLLM")  # fmt: skip
    return p


def parse_args(argv: Sequence[str] | None = None) -> EngineArgs:
    """Parse and validate; a bad or unsupported flag exits with status 2 and a message naming it."""
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    tokens = argv
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in _REFUSED_FLAGS:
            parser.error(f"{flag}: {_REFUSED_FLAGS[flag]}")
    ns = parser.parse_args(argv)
    try:
        return validate(ns)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def validate(ns: argparse.Namespace) -> EngineArgs:
    """Turn parsed flags into EngineArgs, refusing values this engine cannot honour."""
    for attr, name in _PARALLEL_FLAGS:
        value = getattr(ns, attr)
        if value != 1:
            raise ValueError(f"{name} {value}: only 1 is supported (this engine runs on one device)")
    if ns.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size/-tp {ns.tensor_parallel_size}: must be at least 1")
    if ns.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size/-dp {ns.data_parallel_size}: {DP_REFUSAL}")
    if ns.enable_expert_parallel and ns.tensor_parallel_size == 1:
        raise ValueError("--enable-expert-parallel needs --tensor-parallel-size > 1 (experts are split across "
                         "the tensor-parallel ranks)")  # fmt: skip
    if ns.block_size <= 0 or ns.block_size & (ns.block_size - 1):
        raise ValueError(f"--block-size {ns.block_size}: must be a positive power of two")
    if not 0.0 < ns.gpu_memory_utilization <= 1.0:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    if ns.kv_cache_memory_gb <= 0:
        raise ValueError("--kv-cache-memory-gb must be positive")
    if ns.num_kvcache_blocks is not None and ns.num_kvcache_blocks <= 0:
        raise ValueError("--num-kvcache-blocks must be positive")
    if ns.long_prefill_token_threshold < 0:
        raise ValueError("--long-prefill-token-threshold must be >= 0")
    for flag in ("max_num_batched_tokens", "max_num_seqs", "max_waiting_requests"):
        if getattr(ns, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if ns.kv_transfer_timeout <= 0:
        raise ValueError("--kv-transfer-timeout must be positive")
    if ns.sparse_topk_blocks < 1:
        raise ValueError("--sparse-topk-blocks must be >= 1")
    if ns.max_model_len is not None and ns.max_model_len < 2:
        raise ValueError("--max-model-len must be at least 2")
    if not 1 <= ns.server_port <= 65535:
        raise ValueError("--server-port must be a TCP port")
    sizes = parse_capture_sizes(ns.cudagraph_capture_sizes) if ns.cudagraph_capture_sizes is not None else None
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    speculative = parse_speculative_config(ns.speculative_config)
    if ns.method is not None or ns.num_speculative_tokens is not None or ns.draft_model is not None:
        if speculative is not None:
            raise ValueError("--method/--num-speculative-tokens/--draft-model and --speculative-config: give one of "
                             "the two spellings")  # fmt: skip
        if ns.method is None:
            raise ValueError("--num-speculative-tokens and --draft-model need --method (ngram or eagle3)")
        speculative = speculative_config(ns.method, ns.num_speculative_tokens, flag="--method", model=ns.draft_model)
    if speculative is not None and ns.sparse_attention == "on":
        raise ValueError("speculative decoding with --sparse-attention on is not supported: verify rows attend to "
                         "their whole context while sparse decode attends to the chosen blocks, so greedy output "
                         "would change")  # fmt: skip
    return EngineArgs(
        model=ns.model,
        served_model_name=ns.served_model_name,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        host=ns.host,
        server_port=ns.server_port,
        tensor_parallel_size=ns.tensor_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel,
        data_parallel_size=ns.data_parallel_size,
        block_size=ns.block_size,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory_gb=ns.kv_cache_memory_gb,
        num_kvcache_blocks=ns.num_kvcache_blocks,
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        max_waiting_requests=ns.max_waiting_requests,
        scheduling_policy=ns.scheduling_policy,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        kv_cache_dtype=ns.kv_cache_dtype,
        enable_prefix_caching=ns.enable_prefix_caching,
        kv_transfer=parse_kv_transfer_config(ns.kv_transfer_config),
        kv_transfer_timeout=ns.kv_transfer_timeout,
        kv_events=parse_kv_events_config(ns.kv_events_config),
        sparse_attention=ns.sparse_attention == "on",
        sparse_topk_blocks=ns.sparse_topk_blocks,
        device=ns.device,
        dtype=ns.dtype,
        seed=ns.seed,
        enforce_eager=ns.enforce_eager,
        async_scheduling=ns.async_scheduling,
        exit_on_engine_error=ns.exit_on_engine_error,
        speculative=speculative,
        cudagraph_capture_sizes=sizes,
        kernels=ns.kernels,
        load_format=ns.load_format,
        quantization=ns.quantization,
        torch_threads=ns.torch_threads,
        log_level=ns.log_level,
    )


def parse_device(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N (a GPU index); raises ValueError (argparse: a usage error)."""
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"invalid device {value!r}: choose auto, cpu, cuda or cuda:N (N a GPU index)")


def parse_capture_sizes(values: Sequence[str]) -> tuple[int, ...]:
    """``--cudagraph-capture-sizes``: ``[1,2,4]`` (ATOM), ``1 2 4`` (vLLM) or ``1,2,4``; sorted, unique."""
    text = " ".join(values).strip().removeprefix("[").removesuffix("]")
    try:
        sizes = sorted({int(x) for x in text.replace(",", " ").split()})
    except ValueError as exc:
        raise ValueError(f"--cudagraph-capture-sizes: {' '.join(values)!r} is not a list of integers") from exc
    if not sizes or sizes[0] < 1:
        raise ValueError("--cudagraph-capture-sizes: give one or more positive batch sizes")
    return tuple(sizes)


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """Parse ``--kv-transfer-config``; refuse unknown keys and roles this engine does not play."""
    raw = json_object_flag("--kv-transfer-config", text, _KV_CONFIG_KEYS)
    role = raw.get("kv_role")
    if role is not None and role not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role {role!r} must be one of {list(KV_ROLES)}")
    connector = raw.get("kv_connector")
    if connector is not None and connector != "mooncake":
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} is not supported (only 'mooncake')")
    port = raw.get("handshake_port", DEFAULT_HANDSHAKE_PORT)
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--kv-transfer-config: handshake_port {port!r} must be a TCP port")
    if role == "kv_both":
        raise ValueError(
            "--kv-transfer-config: kv_role 'kv_both' is not implemented yet; use kv_producer or kv_consumer"
        )
    backend = raw.get("memory_backend", "auto")
    if backend not in MEMORY_BACKENDS:
        raise ValueError(f"--kv-transfer-config: memory_backend {backend!r} must be one of {list(MEMORY_BACKENDS)}")
    protocol = raw.get("protocol")
    if protocol is not None and protocol not in KV_PROTOCOLS:
        raise ValueError(f"--kv-transfer-config: protocol {protocol!r} must be one of {list(KV_PROTOCOLS)}")
    staging_mb = raw.get("staging_buffer_mb", 128)
    if not isinstance(staging_mb, int) or isinstance(staging_mb, bool) or not 1 <= staging_mb <= 65536:
        raise ValueError(f"--kv-transfer-config: staging_buffer_mb {staging_mb!r} must be an integer in 1..65536 (MiB)")
    inflight = _int_in(raw, "max_inflight_pulls", 8, 1, 256)
    lanes = _int_in(raw, "write_lanes", 2, 1, 64)
    early = raw.get("early_offer", True)
    if not isinstance(early, bool):
        raise ValueError(f"--kv-transfer-config: early_offer {early!r} must be true or false")
    if "early_offer" in raw and role == "kv_consumer":
        raise ValueError("--kv-transfer-config: early_offer is the prefill engine's setting (kv_producer or kv_both);"
                         " a kv_consumer follows what its producer offers")  # fmt: skip
    return KVTransferConfig(
        kv_role=role,
        kv_connector=connector,
        handshake_port=port,
        http_port=raw.get("http_port"),
        protocol=raw.get("protocol"),
        memory_backend=backend,
        staging_buffer_mb=staging_mb,
        max_inflight_pulls=inflight,
        write_lanes=lanes,
        early_offer=early,
    )


def _int_in(raw: dict[str, object], key: str, default: int, lo: int, hi: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"--kv-transfer-config: {key} {value!r} must be an integer in {lo}..{hi}")
    return value
