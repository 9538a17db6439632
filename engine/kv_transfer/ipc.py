"""KV moved between engines of one host by mapping the producer's pools (protocol ``ipc``).

When prefill and decode share a host, the KV does not need a network transport: the prefill engine
exports its cache tensors once at start (:class:`PoolExport`) and a decode engine maps them on
first contact (:class:`PeerPools`); a pull then is a copy of the request's blocks from the mapped
pools into decode's own blocks, on the device, with no host round trip on CUDA: there one kernel
launch for every region (``engine.kv_transfer.block_copy``), else :func:`copy_blocks` (per layer
group, or per region on CPU).

How a pool is exported, per device kind:

- CUDA: each cache tensor's storage gives a CUDA IPC handle (``UntypedStorage._share_cuda_``, as
  ``torch.multiprocessing`` shares tensors); decode opens it with ``_new_shared_cuda`` on the GPU
  with the same UUID (device indices differ between processes with different
  ``CUDA_VISIBLE_DEVICES``).
- CPU: each storage moves into POSIX shared memory (``share_memory_``, torch's file-descriptor
  strategy) and decode opens the descriptor by name, ``/proc/<pid>/fd/<fd>`` of the producer, then
  maps it (``_new_shared_fd_cpu``). The same transport, handshake and copy therefore run in the
  CPU tests with real engines.

The handshake (``connector``) adds two steps to the push handshake: ``ipc_open`` (decode asks
once per producer; the answer describes the pools, the host and the port of the producer's read
desk) and, for each pull, a write request that names the opened ``ipc_pool``, sent to the read desk
(a thread of the producer's own, not its busy event loop): ``ipc_read`` (the blocks are claimed for
this consumer: they stay pinned), then the consumer copies and says ``ipc_done`` without waiting for
an answer. Whether a producer is usable this way is decided by decode on first contact: same boot id
and hostname, same device kind, and the handles open.

A pull (``IpcPeers.read``) runs whole in one worker thread: the claim over a blocking socket, the
copy on a stream of its own (it does not wait for the engine's step in flight, only, when the
destination blocks were handed out during a step, for that step: an aborted sequence's blocks are
freed while its step may still write them), the ``ipc_done``. The engine's event loop sees the pull
once, when it has landed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.kv_transfer import wire
from engine.kv_transfer.errors import KVTransferError
from engine.kv_transfer.layout import SKIP, block_runs
from engine.kv_transfer.wire import MessageType

if TYPE_CHECKING:
    from engine.kv_transfer.block_copy import RegionTable

log = logging.getLogger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
SHM = Path("/dev/shm")  # where torch's shared CPU storages live (shm_open)


class IpcMode(StrEnum):
    """How a decode engine uses the intra-host path: never, when a producer allows it, or always."""

    OFF = "off"  # protocol tcp / rdma / nvlink*: every pull goes through Mooncake
    AUTO = "auto"  # protocol left out: ipc for producers on this host whose pools open, Mooncake otherwise
    FORCED = "forced"  # protocol ipc: a producer that cannot be mapped fails the pull, naming why


class IpcUnavailable(Exception):
    """A producer's pools cannot be mapped here; the message says why (another host, device, handle)."""


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """What says two processes run on one host (and one kernel): the boot id and the hostname."""

    boot_id: str
    hostname: str

    @classmethod
    def here(cls) -> HostIdentity:
        try:
            boot_id = BOOT_ID.read_text().strip()
        except OSError:
            boot_id = ""
        return cls(boot_id, socket.gethostname())

    def to_wire(self) -> dict[str, str]:
        return {"boot_id": self.boot_id, "hostname": self.hostname}

    @classmethod
    def from_wire(cls, raw: object) -> HostIdentity:
        if not (isinstance(raw, dict) and isinstance(raw.get("boot_id"), str) and isinstance(raw.get("hostname"), str)):
            raise ValueError(f"a host is {{boot_id, hostname}}, got {raw!r:.200}")
        return cls(raw["boot_id"], raw["hostname"])

    def differs(self, other: HostIdentity) -> str | None:
        """Why ``other`` is not this host, or None when it is."""
        if not self.boot_id or self.boot_id != other.boot_id or self.hostname != other.hostname:
            return (f"the producer runs on host {other.hostname!r} (boot id {other.boot_id or '?'}), "
                    f"this engine on {self.hostname!r} (boot id {self.boot_id or '?'})")  # fmt: skip
        return None


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _storages(views: Sequence[torch.Tensor]) -> tuple[list[torch.UntypedStorage], list[int]]:
    """The distinct storages under ``views`` and, per view, the index of its storage."""
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}
    which = []
    for v in views:
        st = v.untyped_storage()
        key = st.data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(st)
        which.append(index[key])
    return storages, which


def _check_shm_room(nbytes: int, shm: Path = SHM) -> None:
    """Refuse to move ``nbytes`` into shared memory that cannot hold them (past its size, pages fault: SIGBUS)."""
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        raise IpcUnavailable(f"{shm} is not usable for shared KV pools: {exc}") from exc
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise IpcUnavailable(
            f"the KV pools need {nbytes / 2**20:.0f} MiB of {shm}, which has {free / 2**20:.0f} MiB "
            "free (a container's default is 64 MiB: raise --shm-size)"
        )


class PoolExport:
    """The producer's KV pools, shared once at start so engines on this host can map them.

    ``views`` are the engine's regions as ``[num_blocks, unit_bytes]`` uint8 views (``layout.region_views``).
    On CPU their storages move into shared memory here (the data is copied once and every tensor on
    those storages follows): compute region addresses only after this. Raises IpcUnavailable when
    ``/dev/shm`` cannot hold them.
    """

    def __init__(self, views: Sequence[torch.Tensor], host: HostIdentity | None = None) -> None:
        if not views:
            raise ValueError("no KV regions to export")
        self.device = views[0].device
        if any(v.device != self.device for v in views):
            raise ValueError("the KV regions span several devices")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"protocol ipc supports cpu and cuda caches, not {self.device.type}")
        self.host = host or HostIdentity.here()
        self.pool_id = secrets.token_hex(8)  # a restarted producer on the same port is a new pool
        storages, which = _storages(views)
        if self.device.type == "cpu":
            _check_shm_room(sum(st.nbytes() for st in storages if not st.is_shared()))
        segments: list[dict[str, Any]] = []
        for st in storages:
            if self.device.type == "cuda":
                share = list(st._share_cuda_())  # type: ignore[no-untyped-call]
                segments.append({"cuda": share, "nbytes": st.nbytes()})
            else:
                st.share_memory_()
                fd, size = st._share_fd_cpu_()
                stat = os.fstat(fd)  # lets the consumer check it opened this very file (same PID namespace)
                segments.append({"path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": int(size),
                                 "file": [stat.st_dev, stat.st_ino]})  # fmt: skip
        regions = []
        for v, seg in zip(views, which, strict=True):
            offset = v.data_ptr() - storages[seg].data_ptr()
            regions.append([seg, offset, v.shape[1], v.shape[0]])
        self._storages = storages  # keep them (and so their handles) alive as long as the export
        self._wire: dict[str, Any] = {
            "pool_id": self.pool_id,
            "host": self.host.to_wire(),
            "device": self.device.type,
            "device_uuid": _device_uuid(self.device) if self.device.type == "cuda" else "",
            "segments": segments,
            "regions": regions,
        }
        log.info("kv_ipc_pools_exported device=%s segments=%d regions=%d pool=%s", self.device, len(segments),
                 len(regions), self.pool_id)  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """The ``ipc_pools`` answer: where the pools are and how to open them."""
        return self._wire


class PeerPools:
    """A producer's pools mapped into this process: one ``[num_blocks, unit_bytes]`` uint8 view per region."""

    def __init__(self, pool_id: str, views: list[torch.Tensor], read_port: int = 0) -> None:
        self.pool_id = pool_id
        self.views = views
        self.read_port = read_port  # the producer's read desk (0: it serves none, pulls are refused)

    @classmethod
    def open(cls, desc: dict[str, Any], device: torch.device, host: HostIdentity) -> PeerPools:
        """Map the pools ``desc`` (an ``ipc_pools`` answer) describes; raises IpcUnavailable saying why not."""
        try:
            theirs = HostIdentity.from_wire(desc.get("host"))
            pool_id, kind = desc["pool_id"], desc["device"]
            segments, regions = desc["segments"], desc["regions"]
            read_port = int(desc.get("read_port", 0))
        except (KeyError, ValueError, AttributeError) as exc:
            raise IpcUnavailable(f"malformed ipc_pools answer: {exc!r}") from exc
        why = host.differs(theirs)
        if why:
            raise IpcUnavailable(why)
        if kind != device.type:
            raise IpcUnavailable(f"the producer's KV is on {kind}, this engine's on {device.type}")
        try:
            opened = [_open_segment(seg, device, desc.get("device_uuid", "")) for seg in segments]
            views = []
            for seg, offset, unit, nblocks in regions:
                flat = opened[seg]
                if offset < 0 or offset + unit * nblocks > flat.numel():
                    raise IpcUnavailable(f"a region [{offset}, +{unit * nblocks}) overruns its segment")
                views.append(flat[offset : offset + unit * nblocks].view(nblocks, unit))
        except IpcUnavailable:
            raise
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise IpcUnavailable(f"the producer's pools do not open here: {exc}") from exc
        return cls(str(pool_id), views, read_port)


def _open_segment(seg: dict[str, Any], device: torch.device, device_uuid: str) -> torch.Tensor:
    """One exported storage, mapped here, as a flat uint8 tensor."""
    nbytes = int(seg["nbytes"])
    if "cuda" in seg:
        if device.type != "cuda":
            raise IpcUnavailable("a CUDA pool cannot be mapped by a CPU engine")
        local = next((i for i in range(torch.cuda.device_count())
                      if _device_uuid(torch.device("cuda", i)) == device_uuid), None)  # fmt: skip
        if local is None:
            raise IpcUnavailable(f"the producer's GPU {device_uuid} is not visible to this engine")
        share = list(seg["cuda"])
        share[0] = local  # the producer's index of that GPU may differ from ours
        storage = torch.UntypedStorage._new_shared_cuda(*share)
    else:
        fd = os.open(seg["path"], os.O_RDWR)  # the producer's descriptor, reopened through /proc
        try:
            stat = os.fstat(fd)
            if [stat.st_dev, stat.st_ino] != list(seg["file"]) or stat.st_size < nbytes:
                raise IpcUnavailable(f"{seg['path']} here is not the producer's shared memory (another PID namespace?)")
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
        finally:
            os.close(fd)  # the mapping keeps the memory
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A ``[..., num_blocks, unit_bytes]`` uint8 tensor as the widest integer rows that fit (indexed copies
    run ~4x faster than on bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        k = dtype.itemsize
        if t.shape[-1] % k == 0 and t.storage_offset() % k == 0 and all(st % k == 0 for st in t.stride()[:-1]):
            return t.view(dtype)
    return t


def _layer_groups(
    src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The regions as ``[regions, num_blocks, unit_bytes]`` tensors, consecutive regions evenly spaced in one
    storage on both sides taken together (K and V of a layer; every layer when the caches are one buffer).

    One copy per group then moves a block of all its regions at once.
    """
    groups: list[tuple[torch.Tensor, torch.Tensor]] = []
    i = 0
    while i < len(src_views):
        j = i + 1
        while j < len(src_views) and _continues(src_views, i, j) and _continues(dst_views, i, j):
            j += 1
        groups.append((_stacked(src_views[i:j]), _stacked(dst_views[i:j])))
        i = j
    return groups


def _continues(views: Sequence[torch.Tensor], first: int, j: int) -> bool:
    """Whether region ``j`` extends the run ``first..j-1`` (same shape and storage, the same step in memory)."""
    a, b = views[j - 1], views[j]
    step = views[first + 1].data_ptr() - views[first].data_ptr() if j > first + 1 else b.data_ptr() - a.data_ptr()
    return (b.shape == a.shape and b.stride() == a.stride() == (a.shape[1], 1) and step > 0
            and b.data_ptr() - a.data_ptr() == step
            and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr())  # fmt: skip


def _stacked(views: Sequence[torch.Tensor]) -> torch.Tensor:
    first = views[0]
    step = views[1].data_ptr() - first.data_ptr() if len(views) > 1 else first.numel()
    return first.as_strided((len(views), *first.shape), (step, *first.stride()))


def copy_blocks(
    src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor], src_ids: Sequence[int],
    dst_ids: Sequence[int], grouped: bool | None = None,
) -> None:  # fmt: skip
    """Copy block ``src_ids[i]`` of every source region into block ``dst_ids[i]`` of its destination; blocking.

    ``grouped`` (default: on CUDA) copies regions in layer groups (``_layer_groups``: a few launches
    instead of two per region, what a GPU wants; on CPU a gather over a group's middle dimension ran
    at half the speed of one per region). Per group or region, one slice copy per run of ids
    consecutive on both sides when the ids are mostly such runs, else one gather and one scatter, on
    the device. On CUDA they run on a stream of their own, beside whatever the engine runs (the
    caller makes sure nothing in flight writes the destination blocks), and the call returns once
    they finished (the caller runs it in a worker thread): the engine's next step, on any stream,
    sees the blocks. A source on another GPU is gathered there and moved over peer-to-peer.
    """
    if not src_ids:
        return
    dst_device = dst_views[0].device
    if grouped is None:
        grouped = dst_device.type == "cuda"
    if grouped:
        groups = _layer_groups(src_views, dst_views)
    else:
        groups = [(s.unsqueeze(0), d.unsqueeze(0)) for s, d in zip(src_views, dst_views, strict=True)]
    if dst_device.type != "cuda":
        _copy_groups(groups, src_ids, dst_ids)
        return
    stream = torch.cuda.Stream(dst_device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        _copy_groups(groups, src_ids, dst_ids)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
    done.synchronize()  # this worker thread waits; the engine's loop and its steps do not


def _copy_groups(groups: Sequence[tuple[torch.Tensor, torch.Tensor]], src_ids: Sequence[int],
                 dst_ids: Sequence[int]) -> None:  # fmt: skip
    runs = block_runs(src_ids, dst_ids)
    if len(runs) * 4 <= len(src_ids):  # mostly consecutive (a fresh pool): a few large copies
        for src, dst in groups:
            for s, d, n in runs:
                dst[:, d : d + n].copy_(src[:, s : s + n], non_blocking=True)
        return
    src_device, dst_device = groups[0][0].device, groups[0][1].device
    src_idx = torch.tensor(list(src_ids), dtype=torch.long).to(src_device)
    dst_idx = torch.tensor(list(dst_ids), dtype=torch.long).to(dst_device)
    for src, dst in groups:
        rows = _wide(src).index_select(1, src_idx).to(dst_device, non_blocking=True)
        _wide(dst).index_copy_(1, dst_idx, rows.view(_wide(dst).dtype))  # same unit_bytes: the same row width


class IpcPeers:
    """Decode side: the producers whose pools are mapped here, and those that need Mooncake instead.

    On first contact with a producer (``host:handshake_port``) it asks for its pools (``ipc_open``)
    and maps them; the outcome is kept per producer. In mode AUTO a producer that cannot be mapped
    (another host, another device kind, a handle that does not open, a producer forced to tcp) is
    pulled through Mooncake from then on; in mode FORCED that fails the pull, naming why.
    """

    def __init__(self, views: Sequence[torch.Tensor], mode: IpcMode, host: HostIdentity | None = None,
                 workers: int = 8) -> None:  # fmt: skip
        if mode is IpcMode.OFF:
            raise ValueError("IpcPeers needs mode auto or forced")
        self.views = list(views)
        self.device = self.views[0].device
        self.mode = mode
        self.host = host or HostIdentity.here()
        self._pools: dict[tuple[str, int], PeerPools] = {}
        self._mooncake: set[tuple[str, int]] = set()  # producers pulled through Mooncake (mode auto)
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        # One thread per pull in flight (the consumer's max_inflight_pulls): each claims, copies and says done.
        self._readers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-ipc-read")
        self._tables: dict[str, RegionTable | None] = {}  # per mapped pool: its one-launch copy, when it has one
        self._tables_lock = threading.Lock()
        self.early_rounds = 0  # rounds of blocks copied from early offers while their prefill ran (for /metrics)
        self._warm_copy()

    def _warm_copy(self) -> None:
        """Compile the one-launch copy now, not in the first pull's TTFT: block 0 onto itself, a no-op.

        On the H200 the first pull of a fresh engine once took ~180 ms, the rest a few ms.
        """
        if self.device.type != "cuda":
            return
        from engine.kv_transfer.block_copy import RegionTable

        try:
            table = RegionTable(self.views, self.views)
        except ValueError:
            return  # this layout copies per layer group: nothing to compile
        started = time.monotonic()
        table.copy([0], [0])
        torch.cuda.synchronize(self.device)
        log.info("kv_ipc_copy warmed in %.0f ms", (time.monotonic() - started) * 1000)

    def close(self) -> None:
        """Stop the reader threads once the reads in flight are done (their callers wait for them anyway)."""
        self._readers.shutdown(wait=False)

    def peers(self) -> dict[str, str]:
        """Each producer contacted so far and its transport (for /kv_transfer_info)."""
        out = {f"{h}:{p}": "ipc" for h, p in self._pools}
        out |= {f"{h}:{p}": "mooncake" for h, p in self._mooncake}
        return out

    def copies_from(self, host: str, port: int) -> bool:
        """Whether pulls from this producer are copies from its mapped pools, never Mooncake writes: always in mode
        FORCED (a producer that cannot be mapped fails the pull); in mode AUTO when its pools are mapped now, which
        also means that no pull from it went through Mooncake before (a producer found to need Mooncake is pulled
        through it from then on, never mapped)."""
        return self.mode is IpcMode.FORCED or (host, port) in self._pools

    def forget(self, host: str, port: int) -> None:
        """Unmap a producer's pools (it went away or restarted); the next pull asks again."""
        pools = self._pools.pop((host, port), None)
        if pools is not None:
            with self._tables_lock:
                self._tables.pop(pools.pool_id, None)

    async def pools_for(self, host: str, port: int) -> PeerPools | None:
        """The producer's mapped pools, or None to pull through Mooncake; raises KVTransferError.

        Raises when the producer is unreachable, and in mode FORCED when its pools cannot be mapped.
        """
        key = (host, port)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent first pulls from one producer map it once
            if key in self._pools:
                return self._pools[key]
            if key in self._mooncake:
                return None
            try:
                pools: PeerPools | None = await self._open(host, port)
            except IpcUnavailable as exc:
                if self.mode is IpcMode.FORCED:
                    raise KVTransferError(f"protocol 'ipc': cannot map the KV pools of the producer at "
                                          f"{host}:{port}: {exc}", reason="ipc_unavailable") from exc  # fmt: skip
                log.info("kv_transfer_peer peer=%s:%d transport=mooncake reason=%r", host, port, str(exc))
                self._mooncake.add(key)
                return None
            assert pools is not None
            log.info("kv_transfer_peer peer=%s:%d transport=ipc pool=%s regions=%d", host, port, pools.pool_id,
                     len(pools.views))  # fmt: skip
            self._pools[key] = pools
            return pools

    async def _open(self, host: str, port: int) -> PeerPools:
        where = f"{host}:{port}"
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise KVTransferError(f"KV producer {where} unreachable: {exc}", reason="unreachable") from exc
        try:
            await wire.send(writer, MessageType.IPC_OPEN, host=self.host.to_wire(), device=self.device.type)
            reply = await wire.recv(reader)
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as exc:
            raise KVTransferError(f"KV producer {where} dropped the ipc_open: {exc!r}",
                                  reason="connection_lost") from exc  # fmt: skip
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if reply.get("type") == MessageType.ERROR:
            raise IpcUnavailable(f"the producer refused: {reply.get('code')}: {reply.get('message', '')}")
        if reply.get("type") != MessageType.IPC_POOLS:
            raise IpcUnavailable(f"the producer answered ipc_open with {reply.get('type')!r}")
        return await asyncio.to_thread(PeerPools.open, reply, self.device, self.host)

    async def read(
        self, pools: PeerPools, host: str, request: dict[str, Any], src_ids: Sequence[int] | None,
        dst_ids: Sequence[int], deadline: float, after: concurrent.futures.Future[Any] | None = None,
        renew_s: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One pull from a mapped producer, in a reader thread: ask its read desk to claim the transfer
        (``request``: the write request), copy ``src_ids`` -> ``dst_ids`` once it did, say ``ipc_done``.

        Returns the desk's answer to the claim: ``ipc_read`` (the blocks are copied) or an ``error``
        (nothing was copied). An early offer (``src_ids`` None; ``dst_ids`` then has one entry per
        source block, ``SKIP`` for those held here) is copied in rounds as its blocks become final;
        its answer is the final round's (``first_token_id``), or an ``error`` when its prefill
        failed. ``deadline`` (``time.monotonic()``) bounds the socket waits; with ``renew_s``, each round of an
        early offer moves it to at least that far ahead (a prefill that moves may run long); ``after``, a
        step in flight when the destination blocks were handed out, is waited for before the copy.
        The copy has finished whenever this returns or raises (a cancelled caller waits for it), so
        a failure never leaves a late write in ``dst_ids``. Raises KVTransferError, OSError (the desk
        unreachable or gone: ``ConnectionRefusedError`` when nothing listens) or wire.WireError.
        """
        if not pools.read_port:
            raise KVTransferError("the producer's ipc answer named no read port (an older engine?)", reason="bad_reply")
        cancelled = threading.Event()  # an early offer's rounds stop waiting on it
        fut = asyncio.get_running_loop().run_in_executor(
            self._readers, self._read, pools, host, request, src_ids, dst_ids, deadline, after, cancelled, renew_s
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled.set()
            await outlast(fut)
            if not fut.cancelled():
                fut.exception()  # retrieved: the cancellation is what the caller sees
            raise

    def _copy(self, pools: PeerPools, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """The copy, blocking: on a GPU one kernel launch for every region (``block_copy``), on its own stream."""
        table = self._table(pools)
        if table is None:
            copy_blocks(pools.views, self.views, src_ids, dst_ids)
            return
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            table.copy(src_ids, dst_ids)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        done.synchronize()  # this reader thread waits; the engine's loop and its steps do not

    def _table(self, pools: PeerPools) -> RegionTable | None:
        """The one-launch copy between ``pools`` and our regions (CUDA, both on one device), built once per pool."""
        if self.device.type != "cuda" or any(v.device != self.device for v in pools.views):
            return None
        with self._tables_lock:
            if pools.pool_id not in self._tables:
                from engine.kv_transfer.block_copy import RegionTable

                try:
                    self._tables[pools.pool_id] = RegionTable(pools.views, self.views)
                except ValueError as exc:
                    log.info("kv_ipc_copy per_layer_group pool=%s reason=%r", pools.pool_id, str(exc))
                    self._tables[pools.pool_id] = None
            return self._tables[pools.pool_id]

    def _check(self, pools: PeerPools, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Refuse a copy the mapped pools and ours cannot do (the producer checked the same, by its regions)."""
        if [v.shape[1] for v in pools.views] != [v.shape[1] for v in self.views]:
            raise KVTransferError(
                "ipc copy: the producer's regions differ from this engine's", reason="region_mismatch"
            )
        for side, views, ids in (("source", pools.views, src_ids), ("destination", self.views, dst_ids)):
            limit = min(v.shape[0] for v in views)
            if any(not 0 <= b < limit for b in ids):
                raise KVTransferError(f"ipc copy: {side} block ids out of range [0, {limit})", reason="block_mismatch")

    def _read(
        self, pools: PeerPools, host: str, request: dict[str, Any], src_ids: Sequence[int] | None,
        dst_ids: Sequence[int], deadline: float, after: concurrent.futures.Future[Any] | None,
        cancelled: threading.Event, renew_s: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        limit = [deadline]

        def left() -> float:
            remaining = limit[0] - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the pull's time ran out")
            return remaining

        def renew() -> None:
            if renew_s is not None:
                limit[0] = max(limit[0], time.monotonic() + renew_s)

        tid = request["transfer_id"]
        with socket.create_connection((host, pools.read_port), timeout=left()) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.send_sync(sock, MessageType.WRITE_REQUEST, **request)
            sock.settimeout(left())
            reply = wire.recv_sync(sock)
            if reply.get("type") != MessageType.IPC_READ:
                return reply  # refused: nothing was claimed, nothing copied
            if reply.get("transfer_id") != tid or reply.get("nonce") != request["nonce"]:
                raise KVTransferError(f"ipc_read for {reply.get('transfer_id')!r}, asked {tid}", reason="bad_reply")
            if src_ids is None:
                if not reply.get("early"):
                    raise KVTransferError(f"the producer read {tid} as a finished offer", reason="bad_reply")
                return self._rounds(sock, pools, tid, dst_ids, left, renew, after, cancelled)
            self._copy_claimed(sock, pools, tid, src_ids, dst_ids, after, left)
            # The producer releases its blocks on this (or on the hang-up): nothing to wait for.
            with contextlib.suppress(OSError):
                wire.send_sync(sock, MessageType.IPC_DONE, transfer_id=tid, status="ok")
            return reply

    def _copy_claimed(
        self, sock: socket.socket, pools: PeerPools, tid: str, src_ids: Sequence[int], dst_ids: Sequence[int],
        after: concurrent.futures.Future[Any] | None, left: Callable[[], float],
    ) -> None:  # fmt: skip
        """Copy blocks of a claimed transfer, once ``after`` (the step in flight an abort freed them during) ended;
        a failed copy tells the producer (which releases its blocks on it) and raises KVTransferError."""
        if after is not None:
            concurrent.futures.wait([after], timeout=left())
            if not after.done():
                raise TimeoutError("the engine's step in flight did not end within the pull's time")
        try:
            self._check(pools, src_ids, dst_ids)
            self._copy(pools, src_ids, dst_ids)
        except (KVTransferError, RuntimeError, ValueError) as exc:
            with contextlib.suppress(OSError):
                wire.send_sync(sock, MessageType.IPC_DONE, transfer_id=tid, status="error", message=str(exc))
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"ipc copy failed: {exc}", reason="write_failed") from exc

    def _rounds(
        self, sock: socket.socket, pools: PeerPools, tid: str, dst_ids: Sequence[int], left: Callable[[], float],
        renew: Callable[[], None], after: concurrent.futures.Future[Any] | None, cancelled: threading.Event,
    ) -> dict[str, Any]:  # fmt: skip
        """An early offer, claimed: copy each round's final blocks as the desk names them, until the last round.
        Each round renews the read's deadline (``renew``).

        Each block is copied once, after the producer said it is final; the copies of a round finish
        before the next round is read, so whenever this returns or raises no copy is running."""
        done = 0  # source blocks 0..done-1 handled (copied, or held here already)
        while True:
            msg = _recv_watching(sock, left, cancelled)
            renew()
            start, src, final = msg.get("start"), msg.get("block_ids"), msg.get("final")
            if (msg.get("type") != MessageType.IPC_READY or msg.get("transfer_id") != tid or start != done
                    or not isinstance(src, list) or done + len(src) > len(dst_ids)):  # fmt: skip
                raise KVTransferError(f"a bad ipc_ready for {tid}: {msg!r:.200}", reason="bad_reply")
            if isinstance(final, dict) and "error" in final:
                with contextlib.suppress(OSError):
                    wire.send_sync(sock, MessageType.IPC_DONE, transfer_id=tid, status="error", message="no prefill")
                return {"type": MessageType.ERROR, "code": "prefill_failed", "transfer_id": tid,
                        "message": f"its prefill failed: {final['error']}"}  # fmt: skip
            pairs = [(int(s), dst_ids[done + i]) for i, s in enumerate(src) if dst_ids[done + i] != SKIP]
            done += len(src)
            if pairs and final is None:
                self.early_rounds += 1  # one reader thread per pull; a lost increment would only undercount
            if pairs:
                self._copy_claimed(sock, pools, tid, [s for s, _ in pairs], [d for _, d in pairs], after, left)
                after = None  # waited for once
            if final is None:
                continue
            if done != len(dst_ids) or not isinstance(final.get("first_token_id"), int):
                raise KVTransferError(f"early offer {tid} ended with {done} of {len(dst_ids)} blocks: {final!r:.200}",
                                      reason="bad_reply")  # fmt: skip
            with contextlib.suppress(OSError):
                wire.send_sync(sock, MessageType.IPC_DONE, transfer_id=tid, status="ok")
            return {"type": MessageType.IPC_READ, "transfer_id": tid, **final}


async def outlast(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` (a copy into this engine's blocks) is done, however often the waiting task is cancelled
    meanwhile (the caller re-raises its own CancelledError after): a cancelled pull must not return while its
    copy may still write the blocks its caller then frees, not even when a second cancellation (the pull's
    ``asyncio.timeout`` firing after the client left, or the reverse) comes during the wait."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([fut])


def _recv_watching(sock: socket.socket, left: Callable[[], float], cancelled: threading.Event) -> dict[str, Any]:
    """The next message, waiting in short slices so a cancelled pull stops waiting for a prefill still running:
    looked at before every round too, not only when none came within a slice (rounds a step apart, faster than a
    slice, once copied a cancelled pull's whole prompt)."""
    while True:
        if cancelled.is_set():
            raise KVTransferError("the pull was cancelled while the prefill ran", reason="cancelled")
        if select.select([sock], [], [], min(0.05, left()))[0]:
            break
    sock.settimeout(left())
    return wire.recv_sync(sock)
