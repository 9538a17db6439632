"""Linear layers over a few rows on the CPU, with their weights packed once by oneDNN.

For 4 rows or more torch's CPU ``linear`` calls MKL's GEMM, which repacks the whole weight on every call: a
step whose weights do not fit in the cache then reads them about twice. That is what made a speculative verify
row (the last token and its k drafts, ``1 + k`` rows) cost up to twice a one-row decode step on the CPU, where
one row takes the GEMV path and reads each weight once. Packed once at start into oneDNN's blocked layout
(the same size as the weight), a linear over 4 .. a few hundred rows reads the weight once: on SmolLM2's LM
head (576 x 49,152, float32, one thread) 4 rows take 10.4 ms instead of 18.4 and 8 rows 12.2 instead of 29.2,
against 9.3 for one row (measured 2026-12-02). Fewer rows keep the GEMV path, which is faster than a packed
weight there.

The packed copy doubles the memory of the linear weights, so only engines that speculate use it
(``ModelRunner.pack_linears``). Results equal torch's ``linear`` up to float rounding (another summation
order, as between the GEMV and GEMM paths themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.ops import TorchOps

# From this many rows on, a packed weight is faster than torch's linear (GEMM with repacking); below, GEMV wins.
MIN_PACKED_ROWS = 4


def can_pack(module: nn.Linear) -> bool:
    """Whether oneDNN can pack ``module``: a plain float32 ``nn.Linear`` on the CPU, with oneDNN in this torch."""
    return (
        type(module) is nn.Linear  # not a subclass (FP8, tensor-parallel) with its own forward
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    )


class PackedCpuOps(TorchOps):
    """The torch reference ops, but linears over ``MIN_PACKED_ROWS`` rows or more use oneDNN-packed weights."""

    def __init__(self, model: nn.Module) -> None:
        self._packed: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and can_pack(module) and id(module) not in self._packed:
                    # The row-count hint picks the layout; one packed for 4 rows serves every count measured.
                    weight = module.weight.detach()
                    self._packed[id(module)] = torch.ops.mkldnn._reorder_linear_weight(weight, MIN_PACKED_ROWS)

    @property
    def num_packed(self) -> int:
        """How many linear layers have a packed weight."""
        return len(self._packed)

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(id(layer))
        if packed is None or x.dim() != 2 or x.shape[0] < MIN_PACKED_ROWS or x.dtype != torch.float32:
            return layer(x)  # type: ignore[no-any-return]
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")  # type: ignore[no-any-return]

    def swiglu_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(self.linear(layer, x))
