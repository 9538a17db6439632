"""Which Mooncake transport moves the KV (``protocol``): chosen once at start, from what this host can do.

Mooncake picks its transport per engine at ``initialize``, before any peer is known, so the choice
rests on this host alone:

- ``rdma`` where the kernel lists an RDMA device (``/sys/class/infiniband``), unless
  ``MC_FORCE_TCP`` is set: GPUDirect when the caches are GPU memory and the NIC allows it;
- ``tcp`` otherwise (Mooncake would fall back to it by itself, after an error-level line);
- ``nvlink_intra`` (Mooncake's ``IntraNodeNvlinkTransport``: CUDA IPC between processes of one
  host) and ``nvlink`` (multi-node NVLink) only when ``protocol`` asks for them: neither pip wheel
  is built with them (``USE_INTRA_NODE_NVLINK``, ``USE_MNNVL``: ``nvlink`` answers "requires
  -DUSE_MNNVL=ON" on the H200), a peer on another
  host cannot be reached through them, and both need the KV written in place on the GPU
  (``memory_backend`` direct). With a pip wheel installed they are refused at start, naming the
  build they need; with a source build, Mooncake's ``initialize`` decides.

``auto`` therefore never picks an intra-node transport; ``protocol`` forces any one of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine.kv_transfer.backend import MooncakeWheel, installed_wheel

RDMA_DEVICES = Path("/sys/class/infiniband")  # one entry per RDMA device the kernel knows


class Transport(StrEnum):
    TCP = "tcp"
    RDMA = "rdma"
    NVLINK_INTRA = "nvlink_intra"
    NVLINK = "nvlink"


PROTOCOLS = tuple(t.value for t in Transport)
# What each intra-node transport needs compiled into Mooncake (the define its transports.cpp tests).
_BUILD_FLAG = {Transport.NVLINK_INTRA: "USE_INTRA_NODE_NVLINK", Transport.NVLINK: "USE_MNNVL"}


def has_rdma_device(devices: Path = RDMA_DEVICES) -> bool:
    try:
        return any(devices.iterdir())
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the transport choice depends on; ``gpu_direct`` None when the caller does not know the caches."""

    rdma_device: bool
    force_tcp: bool
    wheel: MooncakeWheel
    gpu_direct: bool | None = None  # the KV is GPU memory written in place (CUDA and memory_backend direct)

    @classmethod
    def probe(cls, gpu_direct: bool | None = None, devices: Path = RDMA_DEVICES) -> HostFacts:
        return cls(rdma_device=has_rdma_device(devices),
                   force_tcp=os.environ.get("MC_FORCE_TCP", "") not in ("", "0"),
                   wheel=installed_wheel(), gpu_direct=gpu_direct)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TransportChoice:
    """The transport and why (the start-up log line says both)."""

    protocol: Transport
    reason: str


def parse_protocol(value: object) -> Transport | None:
    """``protocol`` from a config (None: choose); raises ValueError naming the choices."""
    if value is None:
        return None
    try:
        return Transport(str(value))
    except ValueError:
        raise ValueError(f"protocol {value!r} must be one of {list(PROTOCOLS)}") from None


def choose_transport(requested: Transport | str | None, facts: HostFacts) -> TransportChoice:
    """The transport to initialize Mooncake with; raises ValueError for one this installation cannot run."""
    asked = parse_protocol(requested)
    if asked in _BUILD_FLAG:
        assert asked is not None
        if facts.wheel is not MooncakeWheel.MISSING:
            raise ValueError(
                f"protocol {asked.value!r} needs Mooncake built from source with {_BUILD_FLAG[asked]}; "
                f"the installed pip wheel ({facts.wheel.value}) is built without it. "
                "Use protocol 'tcp' or 'rdma' (or leave it out)"
            )
        if facts.gpu_direct is False:
            raise ValueError(
                f"protocol {asked.value!r} moves GPU memory in place: it needs CUDA caches and memory_backend 'direct'"
            )
        return TransportChoice(asked, f"asked for (protocol {asked.value}): GPU to GPU within this host")
    if facts.force_tcp:
        return TransportChoice(Transport.TCP, "MC_FORCE_TCP is set")
    if asked is Transport.TCP:
        return TransportChoice(Transport.TCP, "asked for (protocol tcp)")
    if facts.rdma_device:
        why = "asked for (protocol rdma)" if asked is Transport.RDMA else "an RDMA device is present"
        return TransportChoice(Transport.RDMA, why)
    if asked is Transport.RDMA:
        return TransportChoice(Transport.TCP, "asked for rdma, but this host has no RDMA device: tcp instead")
    return TransportChoice(Transport.TCP, "no RDMA device on this host")
