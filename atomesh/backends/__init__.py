"""How a Plan becomes upstream calls: one module per engine family, one Protocol for all."""

from __future__ import annotations

from typing import Protocol

from atomesh.placement import Plan
from atomesh.request import RequestView
from atomesh.transport import Exchange


class Backend(Protocol):
    """Runs a placed request against its worker(s) and relays the answer to the client.

    Raises UpstreamError (with `.worker` set to the worker at fault) on failures; the router decides
    about retries. Must close every upstream leg it opened, on every path.
    """

    async def forward(self, exchange: Exchange, view: RequestView, plan: Plan) -> None: ...
