"""``kv_transfer_params``: what prefill returns and decode receives (ATOM's field names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from engine.kv_transfer.errors import KVTransferError


class KVTransferParamsError(KVTransferError):
    """A request carries ``kv_transfer_params`` this engine cannot act on."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_kv_transfer_params"


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """The prefill engine's answer: where the request's KV blocks are and how to ask for them."""

    remote_block_ids: tuple[int, ...]
    remote_engine_id: str  # the producer agent's "ip:rpc_port"
    remote_host: str
    remote_port: int  # the producer agent's rpc port
    remote_handshake_port: int
    transfer_id: str
    first_token_id: int | None  # None in an early offer: the producer sends it when its prefill ends
    prefix_cache_hit_tokens: int = 0
    tp_size: int = 1  # the prefill engine's tensor-parallel size: its KV regions are this many ranks' slices
    dp_rank: int = 0
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    # An early offer (docs/pd.md, "Transfer overlapping prefill"): made when the prefill was queued, before
    # any of it ran. ``remote_block_ids`` is empty then; the producer's read desk names the blocks, how many
    # of them are final as its prefill proceeds, and at the end the first token.
    early: bool = False
    num_blocks: int = 0  # the prompt's blocks (== len(remote_block_ids) unless early)

    @property
    def blocks(self) -> int:
        """How many blocks the transfer carries (the prompt's, early or not)."""
        return self.num_blocks if self.early else len(self.remote_block_ids)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["remote_block_ids"] = list(self.remote_block_ids)
        return d

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVTransferParams:
        """Validate a request's ``kv_transfer_params``; unknown keys are ignored (the gateway may add some)."""
        try:
            ids = raw["remote_block_ids"]
            if not isinstance(ids, list | tuple) or not all(isinstance(b, int) and b >= 0 for b in ids):
                raise ValueError("remote_block_ids must be a list of non-negative ints")
            params = cls(
                remote_block_ids=tuple(ids),
                remote_engine_id=_typed(raw, "remote_engine_id", str),
                remote_host=_typed(raw, "remote_host", str),
                remote_port=_typed(raw, "remote_port", int),
                remote_handshake_port=_typed(raw, "remote_handshake_port", int),
                transfer_id=_typed(raw, "transfer_id", str),
                first_token_id=None if raw.get("early") else _typed(raw, "first_token_id", int),
                prefix_cache_hit_tokens=int(raw.get("prefix_cache_hit_tokens", 0) or 0),
                tp_size=int(raw.get("tp_size", 1) or 1),
                dp_rank=int(raw.get("dp_rank", 0) or 0),
                do_remote_prefill=bool(raw.get("do_remote_prefill", True)),
                do_remote_decode=bool(raw.get("do_remote_decode", False)),
                early=bool(raw.get("early", False)),
                num_blocks=int(raw.get("num_blocks", 0) or 0),
            )
        except KeyError as exc:
            raise KVTransferParamsError(f"kv_transfer_params: missing {exc.args[0]!r}", reason="bad_params") from exc
        except (TypeError, ValueError) as exc:
            raise KVTransferParamsError(f"kv_transfer_params: {exc}", reason="bad_params") from exc
        if params.early and (params.remote_block_ids or params.num_blocks < 1):
            raise KVTransferParamsError("kv_transfer_params: an early offer names num_blocks >= 1 and no block ids",
                                        reason="bad_params")  # fmt: skip
        if params.tp_size < 1:
            raise KVTransferParamsError(f"kv_transfer_params: tp_size {params.tp_size} must be >= 1",
                                        reason="bad_params")  # fmt: skip
        return params


def _typed(raw: Mapping[str, Any], key: str, kind: type) -> Any:
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key} must be {kind.__name__}, got {type(value).__name__}")
    return value
