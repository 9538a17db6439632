"""The merge of a split decode's partials (flash-decoding's second kernel), shared by the Triton and the CUDA decode
attention kernels (``engine.kernels.triton_ops``, ``engine.kernels.fp8_decode``)."""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl_launch
from engine.kernels.pdl import enter


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_splits,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    # Every split wrote its partials; one that saw no key wrote m = -1e30, l = 0, which weigh nothing here.
    s = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, SPLITS)
    used = i < num_splits
    part = (s * H + h).to(tl.int64) * num_splits + i
    m = tl.load(part_ml_ptr + part * 2, mask=used, other=-1e30)
    l_ = tl.load(part_ml_ptr + part * 2 + 1, mask=used, other=0.0)
    top = tl.max(m, 0)
    w = tl.where(used, tl.exp2(m - top), 0.0)  # the partials' maxima are in log2 units
    d = tl.arange(0, D)
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_ * w, 0)
    tl.store(out_ptr + (s.to(tl.int64) * H + h) * D + d, out.to(out_ptr.dtype.element_ty))


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, splits: int) -> torch.Tensor:
    """``out [seqs, H, D]`` from a split decode's partials: ``part_acc [seqs, H, splits, D]`` (unnormalised sums)
    and ``part_ml [seqs, H, splits, 2]`` (each split's maximum, in log2 units, and sum of weights)."""
    seqs, heads, _, d = part_acc.shape
    _merge_splits_kernel[(seqs, heads)](
        part_acc, part_ml, out, splits,
        H=heads, D=d, SPLITS=triton.next_power_of_2(splits), **pdl_launch(out.device, out.shape[0]),
    )  # fmt: skip
    return out
