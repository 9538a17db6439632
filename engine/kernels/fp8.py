"""Triton kernels around the FP8 matmul of ``engine.models.quant.Fp8Linear``: activation quantization and
the scaling epilogue of small batches. None syncs with the host or sizes anything from device data, so both run
inside captured CUDA graphs.

``per_token_quant`` replaces the torch code of ``engine.models.quant.quantize_per_token``, five passes over the
activations (abs, amax, divide, clamp, cast) that at prefill sizes cost as much as the FP8 matmul saves, by one
read and one write. It gives the same bytes: the amax is exact, the scale the same float32 product, the quotient
an IEEE float32 division (``div_rn``, not Triton's approximate ``/``), and the cast rounds to nearest even as
torch's does.
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One program holds a whole row in registers; wider rows than this fall back to torch (no supported model has one).
MAX_COLS = 32768
EPILOGUE_BLOCK = 1024


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    scale = amax * INV_FP8_MAX
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant(
    x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, inv_fp8_max: float, min_amax: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [tokens, cols]`` to ``(fp8 [tokens, cols], float32 scale [tokens, 1])``, as ``quantize_per_token``."""
    tokens, cols = x.shape
    if cols > MAX_COLS:
        raise ValueError(f"per_token_quant handles rows of at most {MAX_COLS} values, got {cols}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(tokens, cols, dtype=fp8_dtype, device=x.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return q, scale
    block = triton.next_power_of_2(cols)
    _per_token_quant_kernel[(tokens,)](
        x, q, scale, cols, x.stride(0), q.stride(0),
        FP8_MAX=fp8_max, INV_FP8_MAX=inv_fp8_max, MIN_AMAX=min_amax,
        BLOCK=block, num_warps=min(16, max(4, block // 1024)),
    )  # fmt: skip
    return q, scale


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, cols, stride_acc, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    acc = tl.load(acc_ptr + row * stride_acc + offs, mask=mask, other=0.0)
    y = acc * tl.load(x_scale_ptr + row) * tl.load(w_scale_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``(acc * x_scale * w_scale + bias).to(dtype)`` in one kernel: float32 ``acc [tokens, out]`` (rows may be
    strided), ``x_scale [tokens, 1]``, ``w_scale [out]``, ``bias [out]`` or None."""
    tokens, cols = acc.shape
    out = torch.empty(tokens, cols, dtype=dtype, device=acc.device)
    if tokens == 0:
        return out
    _scale_epilogue_kernel[(tokens, triton.cdiv(cols, EPILOGUE_BLOCK))](
        acc, x_scale, w_scale, acc if bias is None else bias, out, cols, acc.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=EPILOGUE_BLOCK,
    )  # fmt: skip
    return out
