"""The handshake wire format: length-prefixed msgpack maps over one TCP connection per transfer.

Every frame is a 4-byte big-endian length then a msgpack map carrying ``v`` (the version) and
``type``. The consumer sends one ``write_request``; the producer answers with one ``write_done``
(the write ran: ``status`` "ok" or "error") or one ``error`` (refused before writing), then closes.

    write_request: transfer_id, rpc ("ip:port" of the consumer's agent), block_ids (destination),
                   regions ([[base, unit_bytes, num_blocks, format], ...]), nonce; staged consumers add
                   staging ([[address, bytes], [address, bytes]]: the two slots it leased)
    chunk:         (staged) seq, slot (0 or 1: which of the consumer's slots), pieces
                   ([[region, first, count], ...]: pairs first..first+count of each region, end to end)
    chunk_ack:     (staged, consumer -> producer) seq: scattered, the slot may take the next chunk
    write_done:    transfer_id, nonce (echoed), status ("ok" | "error"), message, bytes
    error:         transfer_id, code (a RefusalCode value), message

The intra-host path (``ipc``, see ``engine.kv_transfer.ipc``) adds:

    ipc_open:      (consumer -> producer, once per producer) host ({boot_id, hostname}), device
    ipc_pools:     pool_id, host, device, device_uuid, segments, regions, read_port: how to map the producer's
                   pools, and the port of its read desk (a thread of its own, not the engine's event loop)
    write_request: ... with ipc_pool (the pool_id the consumer mapped), sent to the read port: the consumer
                   copies the blocks itself
    ipc_read:      (producer) transfer_id, nonce (echoed): the blocks are pinned for this consumer, copy them
    ipc_done:      (consumer) transfer_id, status ("ok" | "error"): copied (or not); the producer releases the
                   blocks and answers nothing (the consumer does not wait for it)

An early offer (made when its prefill was queued) is read in rounds: ``ipc_read`` says ``early``, then

    ipc_ready:     (producer, as its prefill proceeds) transfer_id, start, block_ids (source blocks start..,
                   each final: nothing writes it any more), final (None while the prefill runs; at its end
                   {first_token_id} or {error}); the consumer copies each round's blocks, and after the
                   final one says ipc_done
    write_done:    ... for an early offer pulled through Mooncake (written once its prefill ended) adds
                   first_token_id
"""

from __future__ import annotations

import asyncio
import socket
import struct
from enum import StrEnum
from typing import Any

import msgpack

VERSION = 1
MAX_FRAME = 16 << 20  # block ids for a 128K-token prompt are ~100 KB; anything near this is garbage
_LEN = struct.Struct(">I")


class MessageType(StrEnum):
    WRITE_REQUEST = "write_request"
    WRITE_DONE = "write_done"
    ERROR = "error"
    CHUNK = "chunk"
    CHUNK_ACK = "chunk_ack"
    IPC_OPEN = "ipc_open"
    IPC_POOLS = "ipc_pools"
    IPC_READ = "ipc_read"
    IPC_DONE = "ipc_done"
    IPC_READY = "ipc_ready"
    # The consumer gave up an early offer it never started to read (its request was cancelled while the pull
    # waited its turn): the producer releases it, so the engine stops its prefill. Answered with ``abandoned``.
    ABANDON = "abandon"
    ABANDONED = "abandoned"


class RefusalCode(StrEnum):
    """Why a producer refused a write request (the ``code`` of an ``error`` message)."""

    BAD_REQUEST = "bad_request"
    BAD_VERSION = "bad_version"
    UNKNOWN_TRANSFER = "unknown_transfer"
    TRANSFER_CONSUMED = "transfer_consumed"
    REGION_MISMATCH = "region_mismatch"
    BLOCK_MISMATCH = "block_mismatch"
    BACKEND_MISMATCH = "backend_mismatch"
    IPC_UNAVAILABLE = "ipc_unavailable"  # this producer exports no pools, or only ipc and the request is not
    IPC_STALE = "ipc_stale"  # the request names a pool this producer no longer is (it restarted): reopen
    PREFILL_FAILED = "prefill_failed"  # an early offer whose prefill failed or was aborted


class WireError(Exception):
    """A frame that cannot be read: truncated, oversized, not msgpack, or not a versioned map."""


def encode(msg_type: MessageType, **fields: Any) -> bytes:
    body: bytes = msgpack.packb({"v": VERSION, "type": str(msg_type), **fields})
    return _LEN.pack(len(body)) + body


async def send(writer: asyncio.StreamWriter, msg_type: MessageType, **fields: Any) -> None:
    writer.write(encode(msg_type, **fields))
    await writer.drain()


async def recv(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Read one message; raises WireError on a malformed frame, IncompleteReadError on EOF."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    try:
        msg = msgpack.unpackb(await reader.readexactly(n))
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"frame is not msgpack: {exc}") from exc
    if not isinstance(msg, dict) or "type" not in msg or "v" not in msg:
        raise WireError("frame is not a versioned message map")
    return msg


def send_sync(sock: socket.socket, msg_type: MessageType, **fields: Any) -> None:
    """``send`` over a blocking socket (the consumer's ipc reads run in a worker thread)."""
    sock.sendall(encode(msg_type, **fields))


def recv_sync(sock: socket.socket) -> dict[str, Any]:
    """``recv`` over a blocking socket; raises WireError on a malformed frame, ConnectionError on EOF."""
    (n,) = _LEN.unpack(_read_exactly(sock, _LEN.size))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    try:
        msg = msgpack.unpackb(_read_exactly(sock, n))
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"frame is not msgpack: {exc}") from exc
    if not isinstance(msg, dict) or "type" not in msg or "v" not in msg:
        raise WireError("frame is not a versioned message map")
    return msg


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(f"the peer closed the connection {len(buf)} bytes into a {n}-byte read")
        buf += chunk
    return bytes(buf)
