"""The decoder's per-layer operations behind one seam: plain torch (the reference) or Triton kernels.

The model (``engine.models.decoder``) calls these and nothing else for its norms, activation, rotary
positions and attention, so one forward serves every device and step kind. ``TorchOps`` is the
exact reference and what the CPU runs; ``TritonOps`` fuses each into one kernel launch (CUDA, or
the CPU under ``TRITON_INTERPRET=1`` in tests) and never synchronises with the host, so a decode
step made of it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.models.moe import sum_parts
from engine.models.quant import Fp8Linear
from engine.sparse import MeanKeyIndexer, select_blocks_paged

_INDEXER = MeanKeyIndexer()  # stateless: the training-free indexer of dense checkpoints


@dataclass(frozen=True, slots=True)
class QKNorm:
    """Per-head RMSNorm of queries and keys before rotation (Qwen3): the two weights ``[head_dim]`` and eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


class ModelOps(Protocol):
    """What a decoder layer needs computed; each call is one step's whole batch."""

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-step rotary context shared by every layer (built once a step)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``. ``x`` may be ``[tokens, parts, hidden]``, a MoE layer's outputs
        per expert (``engine.models.moe.sum_parts``), summed in float32 and rounded once before the add."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` for a linear layer of the model (``nn.Linear``, ``Fp8Linear`` or a parallel one)."""
        ...

    def linear_parts(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``, or float32 parts of it ``[tokens, parts, out]`` along K, for a caller whose result goes
        only to the next ``add_rms_norm`` (which sums them): a narrow weight then fills the GPU without a launch
        more (``engine.kernels.gemv.parts_for``)."""
        ...

    def swiglu_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused gate/up projection ``layer``."""
        ...

    def attention(
        self, qkv: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: AttentionMetadata,
        indexer: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int, scale: float, window: int = 0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Normalise (``qk_norm``) and rotate Q/K of ``qkv``, store K/V, attend (to the last ``window``
        positions when > 0); returns ``[tokens, heads * head_dim]``."""
        ...


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last axis (the "NeoX" rotary layout Hugging Face uses)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm computed in float32, as the reference implementation does."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class TorchOps:
    """The reference: plain torch, exact against transformers on CPU."""

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        # [n, 1, head_dim]: broadcasts over heads.
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + sum_parts(x, residual.dtype)
        return torch_rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer(x)  # type: ignore[no-any-return]

    def linear_parts(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.linear(layer, x)

    def swiglu_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(layer(x))

    def attention(
        self, qkv: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: AttentionMetadata,
        indexer: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int, scale: float, window: int = 0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        n = qkv.shape[0]
        q, k, v = torch.split(qkv, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(n, heads, head_dim)
        k = k.view(n, kv_heads, head_dim)
        v = v.view(n, kv_heads, head_dim)
        if qk_norm is not None:
            q = torch_rms_norm(q, qk_norm.q_weight, qk_norm.eps)
            k = torch_rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return paged_attention(q, k, v, kv_cache, meta, scale, indexer, window)


def _weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A plain or FP8 linear layer's ``(weight, per-channel scale or None, bias or None)``."""
    scale = layer.weight_scale if isinstance(layer, Fp8Linear) else None
    return cast(torch.Tensor, layer.weight), scale, cast(torch.Tensor | None, layer.bias)


class TritonOps:
    """Fused Triton kernels: one launch per op, graph-capturable."""

    def __init__(self) -> None:
        from engine.kernels import gemv, triton_ops  # imported only where Triton is wanted

        self._k = triton_ops
        self._gemv = gemv
        self._skinny_types: tuple[type[nn.Module], ...] = (nn.Linear, Fp8Linear)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return cos, sin, positions  # the kernel reads the float32 tables at each token's position

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)

    def _skinny(self, layer: nn.Module, x: torch.Tensor) -> bool:
        # Plain and FP8 layers of a few tokens take the skinny kernel; parallel layers (subclasses with their own
        # collectives) and bigger batches their own forward (cuBLAS / _scaled_mm).
        return type(layer) in self._skinny_types and 0 < x.shape[0] <= self._gemv.MAX_TOKENS and x.dim() == 2

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._skinny(layer, x):
            return self._gemv.gemv(x, *_weights(layer))
        return layer(x)  # type: ignore[no-any-return]

    def linear_parts(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._skinny(layer, x):
            weight, scale, bias = _weights(layer)
            return self._gemv.gemv(x, weight, scale, bias, parts=self._gemv.parts_for(weight, x.shape[0]))
        return layer(x)  # type: ignore[no-any-return]

    def swiglu_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._skinny(layer, x) and layer.bias is None:
            weight, scale, _ = _weights(layer)
            return self._gemv.gemv(x, weight, scale, swiglu=True)
        return self._k.silu_and_mul(layer(x))

    def attention(
        self, qkv: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: AttentionMetadata,
        indexer: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int, scale: float, window: int = 0,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        cos, sin, positions = rope
        assert meta.query_start is not None, "Triton attention needs query_start in the metadata"
        if (
            self._k.ROPE_IN_ATTENTION and indexer is None and meta.max_query_len == 1
            and meta.num_decodes == qkv.shape[0] and kv_cache.dtype == qkv.dtype
        ):  # fmt: skip
            # A decode step over a 16-bit cache: the rotary positions and the K/V store in the attention's launch.
            fused = self._k.RopeInAttention(positions, cos, sin, meta.slot_mapping, heads, qk_norm)
            out = self._k.paged_attention(
                qkv, kv_cache, meta.block_tables, meta.query_start, meta.context_lens, scale, 1, meta.max_context,
                meta.num_splits, meta.tile_map, window, rope=fused,
            )  # fmt: skip
            return out.view(qkv.shape[0], -1)
        q = self._k.rope_and_store(
            qkv, positions, cos, sin, kv_cache, meta.slot_mapping, heads, kv_heads, head_dim, qk_norm
        )
        n = q.shape[0]
        nd = meta.num_decodes
        if indexer is not None:
            if nd == n:
                _INDEXER.update_decode(indexer, kv_cache, meta.slot_mapping)  # no data-dependent shapes
            else:
                _INDEXER.update(indexer, kv_cache, meta.slot_mapping)
        if indexer is None or not meta.sparse_topk or nd == 0:
            out = self._k.paged_attention(
                q, kv_cache, meta.block_tables, meta.query_start, meta.context_lens, scale,
                meta.max_query_len, meta.max_context, meta.num_splits, meta.tile_map, window,
            )  # fmt: skip
            return out.view(n, -1)
        # Sparse decode: the decode rows attend over their indexer-chosen blocks, read in place.
        block_size = kv_cache.shape[3]  # [2, blocks, kv_heads, block_size, head_dim]
        tables, lens = select_blocks_paged(
            q[:nd],
            indexer,
            meta.block_tables[:nd],
            meta.context_lens[:nd],
            block_size,
            meta.sparse_topk,
            meta.score_reduce,
        )
        width = tables.shape[1] * block_size
        decoded = self._k.paged_attention(
            q[:nd], kv_cache, tables, meta.query_start[: nd + 1], lens, scale, 1, min(width, meta.max_context),
            meta.num_splits,
        )  # fmt: skip
        if nd == n:
            return decoded.view(n, -1)
        out = torch.empty_like(q)
        out[:nd] = decoded
        out[nd:] = self._k.paged_attention(
            q, kv_cache, meta.block_tables, meta.query_start, meta.context_lens, scale,
            meta.max_query_len, meta.max_context,
        )[nd:]  # fmt: skip
        return out.view(n, -1)
