"""The native stream relay (`atomesh/splice.c`): built with the C compiler on first use, cached, loaded once.

A streamed answer relayed through the interpreter costs one pass of Python callbacks per event (the worker
connection's `data_received`, the parser's `on_body`, the token meter, the client's write: ~15k instructions
on CPython 3.11). `splice.c` does that work in C, once per read of the worker's socket, driven by the event
loop (`Response.splice` in atomesh/httpclient.py). Where it cannot be built (no compiler, no Python headers,
not Linux) the gateway logs why once and relays in Python as before: the answers are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from atomesh.native import build_extension

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_name("splice.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-fvisibility=hidden")
_NAME = "_atomesh_splice"

# Splice.state values (splice.c's enum, in order).
RUNNING, DONE, EOF, READ_ERROR, PROTOCOL_ERROR, CLIENT_ERROR, PAUSED, CALLBACK_ERROR = range(8)


@dataclass(frozen=True, slots=True)
class SpliceBuild:
    """The native relay's module, or why this process cannot have it."""

    module: Any
    why_not: str = ""


def build(cache_dir: Path | None = None) -> SpliceBuild:
    """Compile `splice.c` (once per source and Python; kept under `cache_dir`, by default
    `$XDG_CACHE_HOME/atomesh` or `~/.cache/atomesh`) and import it. Needs Linux and, to build it, a C
    compiler (`$CC`, else `cc`) and the interpreter's headers."""
    module, why_not = build_extension(_SOURCE, _NAME, _FLAGS, what="native relay", cache_dir=cache_dir)
    return SpliceBuild(module, why_not)


def load() -> Any:
    """The native relay's module (`Splice`, `Relayer`), or None (then logged, with the reason): streams are
    relayed in Python."""
    got = build()
    if got.module is None:
        log.warning("native_relay_unavailable", reason=got.why_not)
    return got.module
