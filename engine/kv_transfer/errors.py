"""Errors of the KV transfer layer, in the engine's hierarchy (each knows its HTTP status and code)."""

from __future__ import annotations

from engine.errors import EngineError


class KVTransferError(EngineError):
    """A KV transfer failed: refused by the producer, unreachable, timed out, or the write failed.

    ``dst_may_be_written`` is true when the producer may still be writing into the destination
    blocks (the failure came after the write request was sent and before a reply): the engine
    should not hand those blocks to another request until the producer's write deadline passed.
    """

    status = 502
    type = "server_error"
    code = "kv_transfer_failed"

    def __init__(self, message: str, *, reason: str = "failed", dst_may_be_written: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.dst_may_be_written = dst_may_be_written


class KVTransferBusyError(KVTransferError):
    """The producer already holds its maximum number of pending transfers: shed load."""

    status = 503
    code = "kv_transfer_busy"


class TransferEngineError(KVTransferError):
    """The Mooncake transfer engine returned an error code; the message says what it was doing."""

    def __init__(self, what: str, rc: int) -> None:
        super().__init__(f"mooncake: {what} failed (rc={rc})", reason="transfer_engine")
        self.rc = rc
