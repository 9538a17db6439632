"""`--backend vllm`: vLLM's disaggregated prefill (NixlConnector / P2P shape).

Prefill gets `kv_transfer_params` with every remote field null; decode gets what prefill returned.
"""

from __future__ import annotations

from typing import Any

from atomesh.backends.twostep import TwoStepBackend
from atomesh.metrics import Metrics
from atomesh.transport import ChunkHook, Upstream
from atomesh.workers.worker import Worker

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def decode_params(returned: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    return dict(returned)


def make_vllm_backend(upstream: Upstream, metrics: Metrics, on_chunk: ChunkHook | None = None) -> TwoStepBackend:
    return TwoStepBackend("vllm", upstream, metrics, lambda body: dict(PREFILL_PARAMS), decode_params, on_chunk)
