"""Triton kernel of FP8 activation quantization per token: one read of the activations, one write of FP8 bytes.

The torch code it replaces (``engine.models.quant.quantize_per_token``) makes six passes over the activations
(float copy, abs, amax, divide, clamp, cast); at prefill sizes those cost as much as the FP8 matmul saves. This
kernel gives the same bytes: the amax is exact, the scale and the quotient are IEEE float32 divisions (``div_rn``,
not Triton's approximate ``/``), and the cast rounds to nearest even as torch's does. No host sync, no
data-dependent shape: usable inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One program holds a whole row in registers; wider rows than this fall back to torch (no supported model has one).
MAX_COLS = 32768


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    scale = tl.math.div_rn(amax, FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant(
    x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, min_amax: float
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
        FP8_MAX=fp8_max, MIN_AMAX=min_amax, BLOCK=block, num_warps=min(16, max(4, block // 1024)),
    )  # fmt: skip
    return q, scale
