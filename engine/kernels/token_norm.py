"""A decode step's RMS norms (with the residual add before them) in CUDA C++ (``token_norm.cu``), compiled by NVRTC.

The Triton kernel it replaces (``triton_ops._rms_norm_kernel``) reads the norm's weight after its PDL wait, a round
trip to HBM on every norm's critical path (the weight stream of the matmul before evicts it from L2); this one asks
for the weight before the wait, while the kernel before still runs. Same roundings as the Triton kernel.
``supports`` says whether a call qualifies; ``triton_ops.rms_norm`` and ``add_rms_norm`` dispatch to it.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from engine.kernels import nvrtc, pdl_launch

_SOURCE = Path(__file__).with_name("token_norm.cu")
CHUNK_VALUES = 8  # 16-bit values in a thread's 16-byte chunk
MAX_THREADS = 512
MAX_ROWS = 64  # rows of a decode step at most; larger batches keep the Triton kernel
# As token_gemv.PIN_LOADS: the weight's loads before the wait in the compiled code too.
PIN_LOADS = 1


def enabled() -> bool:
    """``ENGINE_TOKEN_NORM``: ``cuda`` (unset) runs a decode step's RMS norms on this kernel, ``triton`` on Triton's."""
    return nvrtc.use_cuda_kernel("ENGINE_TOKEN_NORM")


def vec_for(n: int) -> int:
    """16-byte chunks of a row a thread: the fewest that keep a block within ``MAX_THREADS`` threads of whole warps
    (0: none does)."""
    if n % (32 * CHUNK_VALUES):
        return 0
    chunks = n // CHUNK_VALUES
    return next((v for v in range(1, 9) if chunks % v == 0 and chunks // v <= MAX_THREADS and chunks // v % 32 == 0),
                0)  # fmt: skip


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def supports(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """CUDA, 16-bit rows ``[rows, N]`` (up to ``MAX_ROWS``) of whole runs of 16-byte chunks a thread, a weight of
    their dtype; with a residual, ``x`` may be ``[rows, parts, N]`` in the residual's dtype or float32."""
    ref = residual if residual is not None else x
    if not (ref.is_cuda and ref.dim() == 2 and ref.dtype in (torch.bfloat16, torch.float16)):
        return False
    rows, n = ref.shape
    parts_ok = x.dim() == 2 and x.dtype == ref.dtype
    if residual is not None and x.dim() == 3:
        parts_ok = x.shape[1] > 1 and x.dtype in (ref.dtype, torch.float32)
    return (
        parts_ok and 0 < rows <= MAX_ROWS and x.shape[0] == rows and x.shape[-1] == n and weight.dtype == ref.dtype
        and weight.shape == (n,) and vec_for(n) > 0 and all(_aligned(t) for t in (x, ref, weight))
    )  # fmt: skip


def threads_for(n: int) -> int:
    """A block's threads for rows of ``n`` columns (``supports``'s rows)."""
    return n // (CHUNK_VALUES * vec_for(n))


def defines(n: int, bf16: bool, has_res: bool, parts: int, x_f32: bool, pdl: bool, *, pin: int) -> dict[str, int]:
    """The compile-time constants of a launch (token_norm.cu's header); ``pin`` as ``PIN_LOADS``."""
    return {"N": n, "VEC": vec_for(n), "THREADS": threads_for(n), "BF16": int(bf16), "HAS_RES": int(has_res),
            "PARTS": parts, "X_F32": int(x_f32), "PDL": int(pdl), "PIN": int(bool(pin)), "EARLY": 1}  # fmt: skip


@cache
def _kernel(device: int, *args: object, **kwargs: int) -> nvrtc.Kernel:
    return nvrtc.build(_SOURCE, "token_norm", device, defines(*args, **kwargs))  # type: ignore[arg-type]


def token_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(weight * rmsnorm(residual + x), residual + x)`` (without a residual: of ``x``, and ``x`` itself); see
    ``supports`` for the shapes."""
    ref = residual if residual is not None else x
    rows, n = ref.shape
    out = torch.empty_like(ref)
    res_out = torch.empty_like(ref) if residual is not None else x
    parts = x.shape[1] if x.dim() == 3 else 1
    pdl = bool(pdl_launch(x.device, rows).get("launch_pdl"))
    kernel = _kernel(x.device.index or 0, n, ref.dtype == torch.bfloat16, residual is not None, parts,
                     x.dtype == torch.float32, pdl, pin=PIN_LOADS)  # fmt: skip
    args = [nvrtc.ptr(x), nvrtc.ptr(ref), nvrtc.ptr(weight), nvrtc.ptr(out), nvrtc.ptr(res_out), ctypes.c_float(eps)]
    kernel((rows, 1, 1), threads_for(n), args, pdl=pdl)
    return out, res_out
