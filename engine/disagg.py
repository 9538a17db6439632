"""The engine's side of prefill/decode disaggregation (ATOM's relay; docs/pd.md, docs/kv_transfer.md).

A `kv_producer` (prefill) engine runs a request for one token, keeps its prompt's KV blocks pinned,
and answers with `kv_transfer_params` saying where they are; the decode engine pushes nothing and
asks, over the handshake port, for the blocks to be written into blocks it reserved. A `kv_consumer`
(decode) engine reserves blocks for the prompt, pulls the KV (and the sparse indexer keys) through
Mooncake, then continues from the first token as if it had prefilled the prompt itself.

This module owns the Mooncake agent, the memory backend (direct, or a staging buffer) and the
producer / consumer; the transfer mechanics live in `engine.kv_transfer`. It moves block ids and
never touches a sequence: the engine's facade (`engine.async_engine`) owns each request's transfer,
its blocks and their release, and calls `offer` / `pull` here. What it needs of the engine's KV
memory comes through the narrow `KVMemory` interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.args import KVTransferConfig
from engine.errors import BindError
from engine.kv_transfer import KVConsumer, KVProducer, KVTransferError, KVTransferParams, MooncakeAgent, ReleaseReason
from engine.kv_transfer.backend import MemoryBackend, choose_backend, installed_wheel, parse_backend
from engine.kv_transfer.ipc import IpcMode, IpcPeers, IpcUnavailable, PoolExport
from engine.kv_transfer.layout import view_region
from engine.kv_transfer.staging import SLOTS_PER_TRANSFER, StagingBuffer
from engine.kv_transfer.transport import HostFacts, TransportChoice, choose_transport

log = logging.getLogger("engine.disagg")

PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
# How long decode keeps blocks out of use after a transfer that failed mid-write: the producer
# may still be writing into them until its own write gives up (one batch, bounded by Mooncake).
WRITE_GRACE_SECS = 30.0
# The KV agent writes to itself this often; this many failures in a row (each within the timeout) mean it is dead.
AGENT_PROBE_SECS = 10.0
AGENT_PROBE_TIMEOUT_SECS = 10.0
AGENT_PROBE_FAILURES = 2


class KVMemory(Protocol):
    """What the relay needs of an engine's KV memory: its device, and the cache regions it registers."""

    @property
    def device(self) -> torch.device: ...

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks whose caches ``kv_views`` holds, rank after rank (1 without parallelism)."""
        ...

    def kv_views(self) -> list[torch.Tensor]:
        """One view per region (each layer's K and V, then the indexer caches), blocks first, over the
        blocks the engine hands out (``engine.kv_transfer.layout.region_views``)."""
        ...

    def kv_formats(self) -> list[str]:
        """What a block of each of those regions holds, its element type and shape
        (``engine.kv_transfer.layout.region_formats``): a peer whose blocks differ in it is refused."""
        ...


class HasDevice(Protocol):
    @property
    def device(self) -> torch.device: ...


class RelayConfigError(ValueError):
    """A ``--kv-transfer-config`` the engine's caches cannot honour, found as the relay starts."""


def advertised_host(bind_host: str) -> str:
    """The address peers reach this engine at: the bind address, or this host's name's address."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def transfer_backend(engine: HasDevice, config: KVTransferConfig) -> tuple[MemoryBackend, str] | None:
    """The memory backend this engine's KV relay uses and why (None without a relay).

    Raises ValueError, before serving, for a backend this installation cannot do (``direct`` on
    CUDA with the CPU-only Mooncake wheel).
    """
    if config.kv_role is None:
        return None
    try:
        return choose_backend(parse_backend(config.memory_backend), engine.device.type, installed_wheel())
    except ValueError as exc:
        raise ValueError(f"--kv-transfer-config: {exc}") from None


def ipc_mode(config: KVTransferConfig) -> IpcMode:
    """Whether pulls from producers on this host copy from their mapped pools (``protocol`` ipc, or left out)."""
    if config.protocol == "ipc":
        return IpcMode.FORCED
    return IpcMode.AUTO if config.protocol is None else IpcMode.OFF


def transfer_transport(engine: HasDevice, config: KVTransferConfig, backend: MemoryBackend) -> TransportChoice:
    """The Mooncake transport this engine's relay uses and why; raises ValueError when it cannot work.

    With ``protocol`` ipc Mooncake is chosen as when it is left out: it carries nothing but the agent.
    """
    gpu_direct = engine.device.type == "cuda" and backend is MemoryBackend.DIRECT
    protocol = None if config.protocol == "ipc" else config.protocol
    try:
        return choose_transport(protocol, HostFacts.probe(gpu_direct=gpu_direct))
    except ValueError as exc:
        raise ValueError(f"--kv-transfer-config: {exc}") from None


def check_transfer_support(engine: HasDevice, config: KVTransferConfig) -> None:
    """Refuse, before serving, a KV relay this installation cannot do (raises ValueError)."""
    chosen = transfer_backend(engine, config)
    if chosen is not None:
        transfer_transport(engine, config, chosen[0])


@dataclass(slots=True)
class TransferStats:
    """Counters for /metrics."""

    offered: int = 0
    pulled: int = 0
    pull_failures: dict[str, int] = field(default_factory=dict)
    pull_seconds: float = 0.0
    released: dict[str, int] = field(default_factory=dict)
    pulls_in_flight: int = 0  # gauges, refreshed by Disaggregation.snapshot
    pulls_waiting: int = 0
    early_rounds: int = 0  # decode: rounds copied from early offers before their prefill ended (snapshot)


class Disaggregation:
    """Owns the Mooncake agent and this engine's role in the KV relay."""

    def __init__(
        self, memory: KVMemory, config: KVTransferConfig, bind_host: str, transfer_timeout: float = 30.0
    ) -> None:
        if config.kv_role not in (PRODUCER, CONSUMER):
            raise ValueError(f"kv_role {config.kv_role!r}: this engine is either kv_producer or kv_consumer")
        self.memory = memory
        self.config = config
        self.role = config.kv_role
        self.bind_host = bind_host  # the handshake server listens here (the engine's --host), nowhere else
        self.host = advertised_host(bind_host)
        self.transfer_timeout = transfer_timeout
        self.stats = TransferStats()
        self.agent: MooncakeAgent | None = None
        self.staging: StagingBuffer | None = None
        self.backend: MemoryBackend | None = None
        self.producer: KVProducer | None = None
        self.consumer: KVConsumer | None = None
        self.ipc = ipc_mode(config)
        self._ipc_off_why = f"protocol {config.protocol} asked for"
        if memory.tp_size > 1 and self.ipc is not IpcMode.OFF:
            # Rank 0 holds the other ranks' caches mapped from their processes; mapped memory is not exported again.
            if self.ipc is IpcMode.FORCED:
                raise ValueError("--kv-transfer-config protocol ipc with --tensor-parallel-size > 1 is not supported "
                                 "(the ranks' caches are mapped into rank 0, which cannot export them again); leave "
                                 "protocol out or name tcp / rdma")  # fmt: skip
            self.ipc = IpcMode.OFF
            self._ipc_off_why = "tensor parallel: rank 0 cannot export the caches it maps from the other ranks"
        self.peers: IpcPeers | None = None  # decode: producers mapped over ipc, or pulled through Mooncake
        # Told once when the KV agent stops working (the server marks the engine dead); see _watch_agent.
        self.on_agent_dead: Callable[[BaseException], None] | None = None
        self.probe_secs = AGENT_PROBE_SECS
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        chosen = transfer_backend(self.memory, self.config)
        assert chosen is not None
        self.backend, why = chosen
        views = self.memory.kv_views()
        export = self._export_pools(views) if self.role == PRODUCER else None
        # After the export: on CPU it moved the caches into shared memory.
        regions = [view_region(v, f) for v, f in zip(views, self.memory.kv_formats(), strict=True)]
        transport = transfer_transport(self.memory, self.config, self.backend)
        inflight = self.config.max_inflight_pulls
        if self.backend is MemoryBackend.STAGED:  # two slots per transfer in flight: a pipeline two chunks deep
            try:
                self.staging = StagingBuffer(views, self.config.staging_buffer_mb << 20,
                                             slots=SLOTS_PER_TRANSFER * inflight)  # fmt: skip
            except ValueError as exc:
                mb = self.config.staging_buffer_mb
                raise RelayConfigError(
                    f"--kv-transfer-config: staging_buffer_mb {mb} is cut into {SLOTS_PER_TRANSFER} slots per "
                    f"max_inflight_pulls ({inflight}): {exc}; raise staging_buffer_mb or lower max_inflight_pulls"
                ) from None
        log.info("kv_transfer_transport protocol=%s reason=%r", transport.protocol.value, transport.reason)
        self.agent = MooncakeAgent(self.host, protocol=transport.protocol.value, lanes=self.config.write_lanes)
        self.agent.register(regions if self.staging is None else [self.staging.region])
        if self.role == PRODUCER:
            self.producer = KVProducer(
                self.agent,
                regions,
                host=self.host,
                handshake_port=self.config.handshake_port or 0,
                bind_host=self.bind_host,
                timeout_s=self.transfer_timeout,
                staging=self.staging,
                tp_size=self.memory.tp_size,
                ipc=export,
                ipc_only=self.ipc is IpcMode.FORCED,
            )
            try:
                await self.producer.start()
            except OSError as exc:
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise BindError(
                    f"cannot listen on {self.bind_host}:{self.config.handshake_port} (KV handshake, "
                    f"--kv-transfer-config handshake_port): {reason}"
                ) from exc
        else:
            self.peers = IpcPeers(views, self.ipc, workers=inflight) if self.ipc is not IpcMode.OFF else None
            log.info("kv_transfer_ipc mode=%s reason=%r", self.ipc.value, {
                IpcMode.AUTO: "producers on this host whose pools open are copied from, others pulled through Mooncake",
                IpcMode.FORCED: "asked for (protocol ipc): every producer must share this host",
                IpcMode.OFF: f"{self._ipc_off_why}: every pull goes through Mooncake",
            }[self.ipc])  # fmt: skip
            self.consumer = KVConsumer(self.agent, regions, staging=self.staging, slot_grace_s=WRITE_GRACE_SECS,
                                       max_inflight=inflight, ipc=self.peers,
                                       tp_size=self.memory.tp_size)  # fmt: skip
        staging = ""
        if self.staging:
            host = "pinned" if self.staging.host.is_pinned() else "plain"
            staging = (f" staging_mib={self.staging.nbytes / 2**20:g} slots={self.staging.slots}"
                       f" slot_mib={self.staging.slot_bytes / 2**20:g} host={host}")  # fmt: skip
        log.info("kv_transfer_memory_backend backend=%s%s reason=%r", self.backend.value, staging, why)
        log.info(
            "kv_transfer_ready role=%s engine=%s regions=%d max_inflight_pulls=%d write_lanes=%d",
            self.role,
            self.agent.rpc_address,
            len(regions),
            inflight,
            self.config.write_lanes,
        )
        self._watchdog = asyncio.create_task(self._watch_agent(), name="kv-agent-watchdog")

    def _export_pools(self, views: list[Any]) -> PoolExport | None:
        """Share this producer's KV pools with decode engines of its host (unless a Mooncake protocol is forced)."""
        if self.ipc is IpcMode.OFF:
            log.info("kv_transfer_ipc mode=off reason=%r", self._ipc_off_why)
            return None
        try:
            export = PoolExport(views)
        except IpcUnavailable as exc:
            if self.ipc is IpcMode.FORCED:
                raise RelayConfigError(f"--kv-transfer-config: protocol 'ipc': {exc}") from None
            log.warning("kv_transfer_ipc mode=auto exported=false reason=%r: decode engines pull through Mooncake",
                        str(exc))  # fmt: skip
            return None
        log.info("kv_transfer_ipc mode=%s exported=true host=%s: decode engines on this host copy from its pools",
                 self.ipc.value, export.host.hostname)  # fmt: skip
        return export

    async def _watch_agent(self) -> None:
        """Probe the KV agent (a write to itself) every ``probe_secs``; after AGENT_PROBE_FAILURES failures in
        a row it is dead: a P/D engine without its agent can serve nothing, so the engine is marked dead.

        A failing peer never trips this: the probe touches only our own agent, its listener and transport.
        """
        agent = self.agent
        assert agent is not None
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            await asyncio.sleep(self.probe_secs)
            try:
                await asyncio.wait_for(loop.run_in_executor(None, agent.probe), AGENT_PROBE_TIMEOUT_SECS)
                failures = 0
            except (KVTransferError, TimeoutError) as exc:
                failures += 1
                log.warning("kv_agent_probe_failed failures=%d error=%s", failures, exc)
                if failures >= AGENT_PROBE_FAILURES:
                    if self.on_agent_dead is not None:
                        self.on_agent_dead(exc)
                    return

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        if self.producer is not None:
            await self.producer.close()  # every pending offer ends (CLOSED): its owner frees the blocks
        if self.peers is not None:
            self.peers.close()
        if self.agent is not None:
            self.agent.close()
        if self.staging is not None:
            self.staging.close()

    def snapshot(self) -> TransferStats:
        """The counters with the pull gauges as they are now (for /metrics)."""
        if self.consumer is not None:
            self.stats.pulls_in_flight, self.stats.pulls_waiting = self.consumer.in_flight, self.consumer.waiting
        if self.peers is not None:
            self.stats.early_rounds = self.peers.early_rounds
        return self.stats

    def info(self) -> dict[str, Any]:
        return {
            "kv_role": self.role,
            "handshake_port": self.producer.port if self.producer else None,
            "engine_id": self.agent.rpc_address if self.agent else None,
            "memory_backend": self.backend.value if self.backend else None,
            "protocol": self.agent.protocol if self.agent else None,
            "ipc": self.ipc.value,
            "ipc_peers": self.peers.peers() if self.peers else {},
            "max_inflight_pulls": self.config.max_inflight_pulls,
            "pulls_in_flight": self.consumer.in_flight if self.consumer else 0,
            "pulls_waiting": self.consumer.waiting if self.consumer else 0,
        }

    # -- prefill side --------------------------------------------------------------------------------

    def offer(self, block_ids: Sequence[int], first_token_id: int, prefix_hit_tokens: int,
              on_release: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
        """Pin a finished prefill's prompt blocks for decode to pull; returns its kv_transfer_params.

        ``on_release`` is called once, on the event loop, when the blocks may be freed (pulled, refused,
        expired, or the relay stopped)."""
        assert self.producer is not None, "offer on a relay that is not a kv_producer"

        def released(reason: ReleaseReason) -> None:
            self.stats.released[reason.value] = self.stats.released.get(reason.value, 0) + 1
            on_release()

        params = self.producer.offer(block_ids, first_token_id, released, prefix_cache_hit_tokens=prefix_hit_tokens)
        self.stats.offered += 1
        return params.to_dict()

    def offer_early(self, num_blocks: int, on_release: Callable[[], None]) -> dict[str, Any]:
        """Offer the KV of a prefill still to run (``num_blocks`` blocks); returns its kv_transfer_params.

        Follow with ``progress`` after its steps and ``conclude`` when it ends; ``on_release`` as for ``offer``.
        Unread, it expires after its prefill ended (``KVProducer.offer_early``)."""
        assert self.producer is not None, "offer_early on a relay that is not a kv_producer"

        def released(reason: ReleaseReason) -> None:
            self.stats.released[reason.value] = self.stats.released.get(reason.value, 0) + 1
            on_release()

        params = self.producer.offer_early(num_blocks, released)
        self.stats.offered += 1
        return params.to_dict()

    def progress(self, transfer_id: str, block_ids: Sequence[int], ready: int) -> None:
        """An early offer's prefill ran a step: ``ready`` leading blocks of ``block_ids`` are final."""
        assert self.producer is not None
        self.producer.progress(transfer_id, block_ids, ready)

    def conclude(self, transfer_id: str, block_ids: Sequence[int] = (), first_token_id: int | None = None,
                 error: str | None = None) -> None:  # fmt: skip
        """An early offer's prefill ended, with its first token or an error."""
        assert self.producer is not None
        self.producer.conclude(transfer_id, block_ids, first_token_id, error)

    # -- decode side ---------------------------------------------------------------------------------

    def parse(self, raw: dict[str, Any]) -> KVTransferParams:
        return KVTransferParams.from_dict(raw)

    def abandon(self, params: KVTransferParams) -> None:
        """An early offer given up before its pull (the request failed or was cancelled first): the producer is
        told, so that it stops the prefill."""
        assert self.consumer is not None, "abandon on a relay that is not a kv_consumer"
        self.consumer.abandon(params)

    def dst_may_be_written_if_cancelled(self, params: KVTransferParams) -> bool:
        """Whether a cancelled pull of ``params`` may still see a late write land in its destination blocks
        (direct Mooncake writes), or left nothing to land (ipc copies and staged scatters, which a cancelled pull
        waits for): see ``KVConsumer.dst_may_be_written_if_cancelled``."""
        assert self.consumer is not None, "a pull on a relay that is not a kv_consumer"
        return self.consumer.dst_may_be_written_if_cancelled(params)

    async def pull(self, params: KVTransferParams, dst_block_ids: Sequence[int],
                   after: concurrent.futures.Future[Any] | None = None) -> int | None:  # fmt: skip
        """Have the producer write ``params``' blocks into ``dst_block_ids`` (``SKIP``: held here already),
        nothing landing before ``after`` (the engine's step in flight when they were handed out) ended.
        Returns the first token when the producer sent it with the KV (an early offer), else None.

        Raises KVTransferError (``dst_may_be_written`` says whether a late write may still land in the
        destination blocks), or CancelledError (``dst_may_be_written_if_cancelled`` says the same for it)."""
        assert self.consumer is not None, "pull on a relay that is not a kv_consumer"
        started = time.monotonic()
        try:
            first = await self.consumer.pull(params, dst_block_ids, after)
        except KVTransferError as exc:
            self.stats.pull_failures[exc.reason] = self.stats.pull_failures.get(exc.reason, 0) + 1
            raise
        self.stats.pulled += 1
        self.stats.pull_seconds += time.monotonic() - started
        return first
