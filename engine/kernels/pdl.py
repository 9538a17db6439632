"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels overlap at their edges.

In a CUDA graph a kernel normally starts only when the one before it has finished and its writes are visible:
every launch pays the drain of the last kernel's slowest programs, then the ramp of its own first loads. At one
token a dense 8B step is ~290 such kernels of a few to ~30 us each, so those edges are a large part of the step.

With ``ENGINE_PDL=1`` the engine's Triton kernels of a decode step are launched with CUDA's programmatic stream
serialisation, and each one, first thing, (1) lets the next kernel launch (``griddepcontrol.launch_dependents``),
and (2) waits for the kernel before it to complete with its memory visible (``griddepcontrol.wait``) before it
reads anything that kernel may have written or writes anything at all. Between the two, a skinny matmul asks L2
for the first slices of its own weight rows (constant data, nothing a prior kernel writes), so its weight stream
is already under way when its input arrives.

Why it is safe: the wait of kernel ``k`` returns only when kernel ``k-1`` has completed, and ``k-1`` completed only
after its own wait returned, so every kernel before ``k`` is complete. Every program of a PDL kernel runs the wait
(``enter`` comes before any early exit), and a kernel launched the usual way waits for everything before it, as
always. Without ``launch_pdl`` the two instructions do nothing, so the same compiled kernel serves both launches.
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Bytes of one L2 prefetch (a cache line).
LINE = tl.constexpr(128)


@triton.jit
def enter(PDL: tl.constexpr):
    """First thing in a PDL kernel: let the next kernel launch, then wait for the one before to complete."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_rows(rows_ptr, COLS: tl.constexpr):
    """Ask L2 for the first ``COLS`` elements of each row of ``rows_ptr`` (a ``[R, 1]`` tensor of row pointers that
    are all in bounds), one request per 128-byte line. Nothing is loaded into registers."""
    step: tl.constexpr = LINE * 8 // rows_ptr.dtype.element_ty.primitive_bitwidth
    cols = tl.arange(0, COLS // step) * step
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [rows_ptr + cols[None, :]], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


def prefetch_cols(k: int, elem_bytes: int, want: int) -> int:
    """The columns a program prefetches of a ``k``-column weight: ``want`` rounded down to a power of two of whole
    lines, at most ``k`` (0: none)."""
    step = LINE.value // elem_bytes
    cols = min(want, k)
    if cols < step:
        return 0
    return int(triton.next_power_of_2(cols + 1) // 2) if cols & (cols - 1) else cols
