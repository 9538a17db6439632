"""The sender's compiled OTLP encoder (`atomesh/otlp_encode.c`), built with the C compiler on first use.

`atomesh.otlp.SpanEncoder` writes a frame's spans in Python at about 1 us a span; the same encoder in C
takes a few tens of nanoseconds, which is most of what the sender process costs a request. The library is
compiled once per source (with `$CC`, else `cc`) and kept under `$XDG_CACHE_HOME/atomesh` (else
`~/.cache/atomesh`); without a compiler, or when the build fails, `build_encoder` says why and the sender
keeps the Python encoder (it logs the reason once). Both write the same bytes for the same frame.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from atomesh.native import build_library

_SOURCE = Path(__file__).with_name("otlp_encode.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off")  # the times round as Python's do (otlp_encode.c)


class NativeEncoder:
    """`atomesh/otlp_encode.c` loaded: a frame in, its ExportTraceServiceRequests out."""

    def __init__(self, library: Path, resource: bytes, scope: bytes) -> None:
        lib = ctypes.CDLL(str(library))
        p, n, v = ctypes.c_char_p, ctypes.c_long, ctypes.c_void_p
        lib.atomesh_otlp_encode.argtypes = [p, n, p, n, p, n, n, v, n, v, v, n]
        lib.atomesh_otlp_encode.restype = n
        self._encode = lib.atomesh_otlp_encode
        self._resource, self._scope = resource, scope
        self._out = bytearray(1 << 16)  # grown when a frame needs more; reused
        self._starts = (ctypes.c_long * 16)()  # each export call's bytes in `_out`; grown as needed
        self._ends = (ctypes.c_long * 16)()

    def export_requests(self, frame: bytes, max_spans: int) -> list[bytes] | None:
        """The frame's records (a `marshal`led list) as ExportTraceServiceRequests of at most `max_spans`
        spans each, or None when the frame is not a list of records as `atomesh.otlp` describes them."""
        while True:
            out = self._out
            buffer = (ctypes.c_char * len(out)).from_buffer(out)
            n = self._encode(frame, len(frame), self._resource, len(self._resource), self._scope, len(self._scope),
                             max_spans, buffer, len(out), self._starts, self._ends, len(self._starts))  # fmt: skip
            del buffer  # the bytearray may be resized only once no ctypes array holds it
            if n >= 0:
                starts, ends = self._starts, self._ends
                view = memoryview(out)  # one copy of each request (a bytearray's slice would be a second)
                return [bytes(view[starts[k] : ends[k]]) for k in range(n)]
            if n == -2:
                return None
            if n == -3:
                self._starts = (ctypes.c_long * (2 * len(self._starts)))()
                self._ends = (ctypes.c_long * len(self._starts))()
            else:
                self._out = bytearray(2 * len(out))


@dataclass(frozen=True, slots=True)
class EncoderBuild:
    """The compiled encoder's library, or why this process cannot have it."""

    library: Path | None
    why_not: str = ""


def build_encoder(cache_dir: Path | None = None) -> EncoderBuild:
    """Compile `atomesh/otlp_encode.c` (once per source and flags, `atomesh.native`; kept under `cache_dir`,
    by default `$XDG_CACHE_HOME/atomesh` or `~/.cache/atomesh`)."""
    library, why_not = build_library(_SOURCE, _FLAGS, cache_dir=cache_dir, what="encoder's library")
    return EncoderBuild(library, why_not)
