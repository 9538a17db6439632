"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels overlap at their edges.

In a CUDA graph a kernel normally starts only when the one before it has finished and its writes are visible:
every launch pays the drain of the last kernel's slowest programs, then the placement and ramp of its own. At one
token a dense 8B step is ~290 such kernels of a few to ~30 us each, so those edges are a real part of the step.

Where the GPU has it (``engine.kernels.pdl_enabled``; ``ENGINE_PDL=0`` turns it off), the engine's Triton kernels of a
decode step are launched with CUDA's programmatic stream serialisation. Each one, first thing, waits for the kernel
before it to complete with its memory visible (``griddepcontrol.wait``), before it reads anything that kernel may have
written or writes anything at all. It lets the next kernel launch (``griddepcontrol.launch_dependents``) first thing
too (``PDL_EARLY``), or when its programs leave their main loop (``PDL_LOOP``). The next kernel's launch and placement
then overlap this one's last programs instead of following them.

Why it is safe: the wait of kernel ``k`` returns only when kernel ``k-1`` has completed, and ``k-1`` completed only
after its own wait returned, so every kernel before ``k`` is complete. Every program of a PDL kernel runs the wait
(``enter`` comes before any early exit), and a kernel launched the usual way waits for everything before it, as
always. Without ``launch_pdl`` the two instructions do nothing.
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


# ``PDL`` is the kernel's constexpr: engine.kernels.PDL_OFF (0), PDL_EARLY (1) or PDL_LOOP (2).
@triton.jit
def enter(PDL: tl.constexpr):
    """First thing in a kernel: with ``PDL_EARLY`` let the next kernel launch; with either, wait for the one before."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()


@triton.jit
def leave_loop(PDL: tl.constexpr):
    """After a kernel's main loop: with ``PDL_LOOP``, let the next kernel launch."""
    if PDL == 2:
        gdc_launch_dependents()
