"""`--backend atom`: ATOM's relay. Prefill (one token, KV kept for transfer), then decode pulls the KV.

Decode receives prefill's `kv_transfer_params` (block ids, engine id, handshake port, transfer id,
first token) plus the prefill side's data/tensor-parallel shape, as ATOMesh sends it.
"""

from __future__ import annotations

from typing import Any

from atomesh.backends.twostep import TwoStepBackend
from atomesh.metrics import Metrics
from atomesh.transport import ChunkHook, Upstream
from atomesh.workers.worker import Worker

# early_offer: an engine that can answers at once, before its prefill runs, so the decode leg (and its
# KV reads) overlap the prefill (docs/pd.md); one that cannot, or will not, answers after it as before.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "early_offer": True}


def prefill_params(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params; they carry the client's own token limit as
    ``decode_max_tokens`` (the leg itself runs for one token), so that the prefill engine refuses a
    request that cannot fit its context before it computes or pins anything."""
    limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if isinstance(limit, int) and not isinstance(limit, bool):
        return {**PREFILL_PARAMS, "decode_max_tokens": limit}
    return dict(PREFILL_PARAMS)


def decode_params(returned: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    info = prefill.kv_transfer_info
    return {
        **returned,
        "remote_dp_size": info.get("dp_size", 1),
        "remote_tp_size": info.get("tp_size", returned.get("tp_size", 1)),
        "remote_dp_rank": returned.get("dp_rank", 0),
    }


def make_atom_backend(upstream: Upstream, metrics: Metrics, on_chunk: ChunkHook | None = None) -> TwoStepBackend:
    return TwoStepBackend("atom", upstream, metrics, prefill_params, decode_params, on_chunk)
