"""Which memory the KV relay moves: the caches themselves (direct) or a staging buffer (staged).

Chosen once at start from the ``memory_backend`` setting (``auto``, ``direct``, ``staged``), the
caches' device and the Mooncake wheel installed:

- ``direct`` registers the KV and indexer-key caches with Mooncake and writes each run of blocks
  of each region as its own entry. On CUDA that needs the CUDA build of Mooncake
  (``mooncake-transfer-engine``): the CPU-only wheel (``mooncake-transfer-engine-non-cuda``)
  moves host memory only, so ``direct`` on CUDA with it is refused.
- ``staged`` gathers a request's blocks into a bounded registered buffer (pinned host memory on
  CUDA) and moves a few large chunks whatever the block ids (see ``staging``).
- ``auto`` picks ``direct`` on CUDA with the CUDA wheel (GPU memory written in place, GPUDirect
  where the NIC allows), else ``staged``: with the CPU-only wheel on CUDA it is the only way, and on
  CPU it keeps scattered block ids near Mooncake's raw speed where direct writes fall to ~30%
  (figures in docs/kv_transfer.md).
"""

from __future__ import annotations

from enum import StrEnum
from importlib import metadata


class MemoryBackend(StrEnum):
    AUTO = "auto"
    DIRECT = "direct"
    STAGED = "staged"


class MooncakeWheel(StrEnum):
    """The Mooncake distribution installed (both provide the ``mooncake`` package)."""

    CUDA = "mooncake-transfer-engine"
    NON_CUDA = "mooncake-transfer-engine-non-cuda"
    MISSING = "missing"


def installed_wheel() -> MooncakeWheel:
    """The installed Mooncake wheel; the CPU-only one wins if both are (it cannot read GPU memory)."""
    for wheel in (MooncakeWheel.NON_CUDA, MooncakeWheel.CUDA):
        try:
            metadata.distribution(wheel.value)
        except metadata.PackageNotFoundError:
            continue
        return wheel
    return MooncakeWheel.MISSING


def parse_backend(value: object) -> MemoryBackend:
    """``memory_backend`` from a config; raises ValueError naming the choices."""
    try:
        return MemoryBackend(str(value))
    except ValueError:
        raise ValueError(f"memory_backend {value!r} must be one of {[b.value for b in MemoryBackend]}") from None


def choose_backend(requested: MemoryBackend, device_type: str, wheel: MooncakeWheel) -> tuple[MemoryBackend, str]:
    """The backend to use and why (for the start-up log line); raises ValueError when it cannot work."""
    cuda = device_type == "cuda"
    if requested is MemoryBackend.DIRECT:
        if cuda and wheel is not MooncakeWheel.CUDA:
            raise ValueError(
                "memory_backend 'direct' on CUDA needs the CUDA build of Mooncake (pip install "
                f"mooncake-transfer-engine); installed: {wheel.value}, which moves host memory only. "
                "Use memory_backend 'staged' (or 'auto') to move the KV through pinned host memory"
            )
        return requested, "asked for (memory_backend direct): the caches are registered and written in place"
    if requested is MemoryBackend.STAGED:
        return requested, "asked for (memory_backend staged)"
    if cuda and wheel is MooncakeWheel.CUDA:
        return MemoryBackend.DIRECT, "CUDA with the CUDA build of Mooncake: GPU caches registered and written in place"
    if cuda:
        return MemoryBackend.STAGED, (
            f"CUDA with {wheel.value}, which moves host memory only: blocks go through pinned host staging"
        )
    return MemoryBackend.STAGED, "CPU: one staging region keeps scattered block ids near Mooncake's raw speed"
