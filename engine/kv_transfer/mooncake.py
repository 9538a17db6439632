"""MooncakeAgent: Mooncake's Python ``TransferEngine`` as an asyncio-friendly :class:`TransferAgent`.

The only module that imports ``mooncake``, and only when an agent is built, so the engine runs
without the wheel when no KV transfer is configured.

Why it looks the way it does (measured on mooncake-transfer-engine 0.3.13, TCP on loopback):

- ``initialize(host, "P2PHANDSHAKE", protocol, device)`` takes positional arguments only; peers
  are addressed ``"ip:" + str(get_rpc_port())``. Protocol ``"rdma"`` falls back to TCP when no RDMA
  device is found, but logs an error on the way: :func:`choose_protocol` (``transport``) asks for TCP
  itself when the host has no RDMA device (or ``MC_FORCE_TCP`` is set), so the log says what is
  really used.
- The synchronous calls release the GIL but busy-wait: each peer gets ``lanes`` worker threads, so
  up to ``lanes`` batches to one peer are in flight at once (several requests' transfers, or one
  request's chunks) and the event loop never blocks. Busy-waiting threads compete for cores: on a
  2-core machine 8 MiB writes gave 0.73 GB/s with one lane, 1.00 with two, 0.3 with four or eight;
  hence ``lanes`` 2 by default (``write_lanes`` in ``--kv-transfer-config``).
- More than ~1024 entries queued to one peer fail with -1 ("queue-full"), and the peer's queue
  stays full for a moment afterwards: batches stay at ``max_batch`` (512, at most 1024 / lanes)
  entries.
- A write to an address outside the peer's registered memory fails with -1 at once; a dead peer
  fails at once on loopback (connection refused), else after ``MC_TRANSFER_TIMEOUT`` (>= 5 s).
- A *batch* whose entries the peer rejects returns -1 at once but wedges that peer's lane while
  the rest of the batch fails slowly (~0.3 s per entry: 128 rejected entries stall every write to
  the peer for ~30 s). A rejected single write does not. Hence the connector's probes.
- ``initialize_ext`` + ``allocate_managed_buffer`` segfault: not used.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from engine.kv_transfer import transport
from engine.kv_transfer.errors import KVTransferError, TransferEngineError
from engine.kv_transfer.layout import Region, WriteOp, batches, spans
from engine.kv_transfer.transport import PROTOCOLS, HostFacts, Transport, choose_transport

log = logging.getLogger(__name__)

MAX_BATCH = 512  # entries per batch_transfer_sync_write; Mooncake's per-peer queue holds 1024
QUEUE_ENTRIES = 1024  # Mooncake's per-peer queue: lanes x max_batch stays within it
DEFAULT_LANES = 2  # writes in flight per peer; more busy-wait threads than cores slow every write down
KV_PROTOCOLS = PROTOCOLS
RDMA_DEVICES = transport.RDMA_DEVICES  # kept for callers that point it elsewhere (tests)


def has_rdma_device() -> bool:
    return transport.has_rdma_device(RDMA_DEVICES)


def choose_protocol(requested: str | None) -> str:
    """The protocol the transfer engine really uses (see ``transport``): RDMA when asked for (or unset)
    and a device exists, else TCP; an intra-node one only when asked for and built in."""
    choice = choose_transport(requested, replace(HostFacts.probe(), rdma_device=has_rdma_device()))
    if requested == "rdma" and choice.protocol is Transport.TCP and not choice.reason.startswith("MC_FORCE_TCP"):
        log.warning("kv_transfer_protocol_fallback asked=rdma using=tcp reason=no_rdma_device")
    return choice.protocol.value


def _transfer_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the wheel is optional: only KV transfer needs it
        raise KVTransferError(
            "KV transfer needs Mooncake: pip install mooncake-transfer-engine "
            "(or mooncake-transfer-engine-non-cuda on a machine without CUDA, plus Debian's libibverbs1)",
            reason="mooncake_missing",
        ) from exc
    return TransferEngine


# Lines Mooncake writes while it starts that are no fault: its descriptor is looked up before it is
# published, the topology scan reports the RDMA devices it did not find, the allocator notice.
_EXPECTED_AT_START = (
    "Local segment descriptor not found",
    "No RDMA devices found",
    "Using default malloc/free",
    "Logging before InitGoogleLogging",
)
_GLOG_LEVELS = {"I": logging.DEBUG, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def _initialize(engine: Any, host: str, protocol: str, device_name: str) -> int:
    """`engine.initialize`, with what Mooncake prints meanwhile passed through our log at its real weight.

    Mooncake logs (glog, straight to file descriptor 2) an error-level line on every start, and a
    warning about missing RDMA devices even for TCP; those go to debug, anything else keeps its level."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            rc: int = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode("utf-8", "replace").splitlines()
    for line in lines:
        if not line.strip():
            continue
        level = _GLOG_LEVELS.get(line[:1], logging.INFO)
        if any(s in line for s in _EXPECTED_AT_START):
            level = logging.DEBUG
        log.log(level, "mooncake: %s", line)
    return rc


PROBE_BYTES = 64  # the agent's self-probe buffer


class MooncakeAgent:
    """One Mooncake transfer engine on ``host``: registers regions and writes into peers' memory."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str | None = None,
        device_name: str = "",
        max_batch: int = MAX_BATCH,
        lanes: int = DEFAULT_LANES,
    ) -> None:
        if not 0 < max_batch <= QUEUE_ENTRIES:
            raise ValueError(f"max_batch must be in 1..{QUEUE_ENTRIES} (Mooncake's per-peer queue limit)")
        if not 0 < lanes <= 64:
            raise ValueError("lanes must be in 1..64")
        protocol = self.protocol = choose_protocol(protocol)
        self.host = host
        self.lanes = lanes
        self.max_batch = min(max_batch, QUEUE_ENTRIES // lanes)
        self._engine = _transfer_engine_class()()
        rc = _initialize(self._engine, host, protocol, device_name)
        if rc != 0:
            if protocol in (Transport.NVLINK_INTRA, Transport.NVLINK):
                raise KVTransferError(
                    f"Mooncake could not start protocol {protocol!r} (rc={rc}): is it built with "
                    "that transport, and are the caches on a GPU?",
                    reason="transfer_engine",
                )
            raise TransferEngineError(f"initialize({host!r}, P2PHANDSHAKE, {protocol!r})", rc)
        self._rpc_address = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False
        # A few bytes of our own, registered, that probe() writes to itself.
        self._probe = ctypes.create_string_buffer(PROBE_BYTES)
        self.register([Region(ctypes.addressof(self._probe), PROBE_BYTES, 1)])
        log.info("mooncake_agent_started rpc=%s protocol=%s lanes=%d", self._rpc_address, protocol, lanes)

    @property
    def rpc_address(self) -> str:
        return self._rpc_address

    def register(self, regions: Sequence[Region]) -> None:
        """Register each region's memory; regions that share one buffer are registered once."""
        for base, end in spans(regions):
            rc = self._engine.register_memory(base, end - base)
            if rc != 0:
                raise TransferEngineError(f"register_memory(0x{base:x}, {end - base})", rc)
            self._registered.append(base)

    async def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """Write ``ops`` into ``peer`` in batches of at most ``max_batch``, one after another, on one of the
        peer's lanes (other calls' batches run on the other lanes meanwhile)."""
        if self._closed:
            raise KVTransferError("the Mooncake agent is closed", reason="closed")
        executor = self._executor(peer)
        loop = asyncio.get_running_loop()
        for batch in batches(ops, self.max_batch):
            await loop.run_in_executor(executor, self.write_blocking, peer, batch)

    def write_blocking(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """One synchronous batch (at most 1024 entries); for threads and benchmarks, never the event loop."""
        if not ops:
            return
        if len(ops) == 1:
            op = ops[0]
            rc = self._engine.transfer_sync_write(peer, op.src, op.dst, op.nbytes)
        else:
            rc = self._engine.batch_transfer_sync_write(
                peer, [o.src for o in ops], [o.dst for o in ops], [o.nbytes for o in ops]
            )
        if rc != 0:
            total = sum(o.nbytes for o in ops)
            raise TransferEngineError(f"write of {len(ops)} entries ({total} bytes) to {peer}", rc)

    def probe(self) -> None:
        """Write a few bytes of this agent's own buffer to itself, through its own RPC listener and transport.

        Raises when the agent cannot move data at all: a failure on our side, never a peer's (blocking; for a
        thread, never the event loop).
        """
        if self._closed:
            raise KVTransferError("the Mooncake agent is closed", reason="closed")
        base = ctypes.addressof(self._probe)
        self.write_blocking(self._rpc_address, [WriteOp(base, base + PROBE_BYTES // 2, PROBE_BYTES // 2)])

    def close(self) -> None:
        """Stop the peer threads (after their current batch) and unregister all memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executors, self._executors = list(self._executors.values()), {}
        for ex in executors:
            ex.shutdown(wait=True)
        for base in self._registered:
            rc = self._engine.unregister_memory(base)
            if rc != 0:
                log.warning("mooncake_unregister_failed base=0x%x rc=%d", base, rc)
        self._registered.clear()

    def _executor(self, peer: str) -> ThreadPoolExecutor:
        with self._lock:
            ex = self._executors.get(peer)
            if ex is None:
                ex = self._executors[peer] = ThreadPoolExecutor(self.lanes, thread_name_prefix=f"mooncake-{peer}")
            return ex
