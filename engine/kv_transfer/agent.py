"""The seam between the connector and a transport: something that writes local memory into a peer's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.kv_transfer.layout import Region, WriteOp


class TransferAgent(Protocol):
    """A one-sided memory writer (Mooncake's ``TransferEngine`` behind :class:`MooncakeAgent`)."""

    @property
    def rpc_address(self) -> str:
        """How peers address this agent (``"ip:rpc_port"``); ATOM's ``remote_engine_id``."""
        ...

    def register(self, regions: Sequence[Region]) -> None:
        """Make ``regions`` readable and writable by peers; call once before any transfer."""
        ...

    async def write(self, peer: str, ops: Sequence[WriteOp]) -> None:
        """Write every op (local ``src`` -> ``peer``'s ``dst``); raises KVTransferError on failure."""
        ...

    def close(self) -> None:
        """Unregister memory and stop the agent's threads."""
        ...
