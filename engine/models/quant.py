"""FP8 linear layers and the checkpoint side of FP8: which quantization a model asks for, its KV cache scales.

The scheme is ATOM's "online PTPC-FP8": weights in float8_e4m3fn with one float32 scale per output channel,
activations quantized per token at run time (dynamic, no calibration). A bf16 checkpoint is quantized at load
(``--quantization fp8``); FP8 checkpoints (``quant_method`` "fp8", or "compressed-tensors" with FP8 weights)
are loaded as they are, their per-tensor or per-channel scales expanded per row; block-wise ones are
requantized per channel (see ``Fp8Linear.load_rows``).

On CUDA the matmul is ``torch._scaled_mm`` (cuBLASLt FP8) beside two Triton kernels (engine.kernels.fp8); elsewhere
``fp8_linear_reference`` computes the same quantities in float32 torch, so CPU tests check the GPU's numerics.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import triton_importable

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# scale = amax * (1/448), a multiplication by this float32 constant everywhere: torch's CUDA division by a scalar
# multiplies by the reciprocal anyway, and CPU, GPU and the Triton kernel then give the same scales to the bit.
INV_FP8_MAX = 1.0 / FP8_MAX
# Floor of a row's amax: an all-zero row gets a finite, nonzero scale (and quantizes to zeros).
MIN_AMAX = 1e-12
# cuBLASLt's FP8 matmul wants the reduction (in) and output (out) dims multiples of 16; any token count works.
_SCALED_MM_ALIGN = 16
# At most this many tokens, the CUDA path runs a tensor-wise matmul and a scaling epilogue (see Fp8Linear._scaled_mm).
SMALL_BATCH_TOKENS = 64
# The widest rows the fused Triton quantization takes (engine.kernels.fp8.MAX_COLS, not imported here
# so that the CPU never imports triton).
FUSED_QUANT_MAX_COLS = 32768


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` to FP8 with its own scale ``amax(|row|) / 448``: ``(fp8 [rows, cols], float32 [rows, 1])``.

    No host sync and no data-dependent shape, so it can run inside a captured CUDA graph.
    """
    # abs and max are exact in any dtype; the quotient is a float32 division (a bf16 x promotes).
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX) * INV_FP8_MAX
    # Clamped: x / scale may round past 448, and CUDA casts out-of-range values to NaN (e4m3fn has no inf).
    return torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[out, in]`` to FP8 per output channel: ``(fp8 [out, in], float32 scale [out])``."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_channel wants a 2-D weight [out, in], got shape {tuple(w.shape)}")
    q, scale = _quantize_rows(w)
    return q, scale.view(-1)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[tokens, in]`` to FP8 per token: ``(fp8 [tokens, in], float32 scale [tokens, 1])``."""
    return _quantize_rows(x)


@functools.cache
def _triton_per_token_quant() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The fused Triton quantization of activations on CUDA, or None without triton (then torch's passes run)."""
    if not triton_importable():
        return None
    from engine.kernels.fp8 import per_token_quant

    return per_token_quant


@functools.cache
def _triton_scale_epilogue() -> Callable[..., torch.Tensor] | None:
    if not triton_importable():
        return None
    from engine.kernels.fp8 import scale_epilogue

    return scale_epilogue


def _scale_epilogue_cuda(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``(acc * x_scale * w_scale + bias).to(dtype)``, in one Triton kernel where it can (the reference's order)."""
    fused = _triton_scale_epilogue()
    if fused is not None:
        return fused(acc, x_scale, w_scale, bias, dtype)
    y = acc * x_scale * w_scale.view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _quantize_tokens_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token`` on a GPU: the same bytes, in one Triton kernel where it can."""
    fused = _triton_per_token_quant()
    if fused is None or x.shape[1] > FUSED_QUANT_MAX_COLS:
        return quantize_per_token(x)
    return fused(x, FP8_DTYPE, FP8_MAX, INV_FP8_MAX, MIN_AMAX)


def dequantize(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of an FP8 ``[rows, cols]`` tensor under a per-tensor (one element) or per-row scale."""
    return w_fp8.float() * _row_scales(scale, w_fp8.shape[0]).view(-1, 1)


def dequantize_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Float32 values of a block-wise FP8 weight: one scale per ``block_size`` tile (the last tiles may be partial).

    ``scale_inv`` is what DeepSeek and Qwen3-*-FP8 ship as ``weight_scale_inv``: despite the name it multiplies.
    """
    rows, cols = w_fp8.shape
    bn, bk = block_size
    grid = (math.ceil(rows / bn), math.ceil(cols / bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"block scales of a [{rows}, {cols}] weight in {bn}x{bk} blocks must be {list(grid)}, "
            f"got {list(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:rows, :cols]
    return w_fp8.float() * scales


def _row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint scale as float32 ``[rows]``: one element (per tensor) expanded, ``[rows]`` / ``[rows, 1]`` kept."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows)
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return scale.float().reshape(rows)
    raise ValueError(
        f"an FP8 scale must be per tensor (one element) or per channel ([{rows}] or [{rows}, 1]), "
        f"got shape {list(scale.shape)} (block-wise scales need block_size)"
    )


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The FP8 linear in float32 torch, on any device: what ``torch._scaled_mm`` computes.

    Activations ``[tokens, in]`` are quantized per token; the product of the FP8 values is accumulated in float32
    (each product of two e4m3 values is exact in float32), then scaled by token and by channel, the bias added, and
    the result cast to ``x.dtype``. Equal to (dequantized activations) @ (dequantized weight).T up to float32
    rounding.
    """
    xq, x_scale = quantize_per_token(x)
    y = (xq.float() @ weight.float().t()) * x_scale * weight_scale.view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8Linear(nn.Module):
    """A linear layer with FP8 weights (one float32 scale per output channel) and per-token FP8 activations.

    Built on the meta device and materialised with ``to_empty`` like the rest of the model, then filled with
    ``load_rows``. ``module.to(dtype)`` converts the bias only: the FP8 weight and its float32 scales keep their
    dtypes (they would otherwise be cast like any floating-point parameter).
    """

    _unit_scale: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # The tensor-wise scale of small-batch matmuls (see _scaled_mm); not a weight, so not in the state dict.
        self.register_buffer("_unit_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        kept = (self.weight, self.weight_scale, self._unit_scale)

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if any(t is k for k in kept) and out.dtype != t.dtype:
                # A dtype cast (model.to(bfloat16)) would ruin the scales: move the original instead.
                return t.to(device=out.device)
            return out

        applied: Self = super()._apply(keep_dtype, recurse)  # type: ignore[no-untyped-call]
        if not self._unit_scale.is_meta:
            with torch.no_grad():
                self._unit_scale.fill_(1.0)  # to_empty left it uninitialised
        return applied

    def load_rows(
        self,
        start: int,
        tensor: torch.Tensor,
        scale: torch.Tensor | None = None,
        block_size: tuple[int, int] | None = None,
    ) -> int:
        """Write one checkpoint tensor ``[rows, in]`` into output rows ``start:start + rows``; returns ``rows``.

        Fused layers (q/k/v, gate/up) load each Hub tensor into its own row range this way.

        - A high-precision tensor (bf16, fp16, fp32) is quantized per output channel.
        - An FP8 (e4m3fn) tensor with its checkpoint ``scale`` is stored as it is, the scale expanded per row:
          one element (per tensor) or ``[rows]`` / ``[rows, 1]`` (per channel). Exact, so a fused layer holds
          q, k and v under their own per-tensor scales without requantizing.
        - An FP8 tensor with ``block_size`` (``weight_block_size`` of the config) and its block scales
          ``[ceil(rows / bn), ceil(in / bk)]`` (``weight_scale_inv``) is dequantized and requantized per
          channel: the forward has one scale per output channel. The rounding this adds is that of one more
          per-channel quantization (at most 2^-4 of each value, relative).
        """
        if tensor.dim() != 2 or tensor.shape[1] != self.in_features:
            raise ValueError(f"load_rows wants a [rows, {self.in_features}] tensor, got shape {list(tensor.shape)}")
        rows = tensor.shape[0]
        if start < 0 or start + rows > self.out_features:
            raise ValueError(f"rows {start}:{start + rows} fall outside this layer's {self.out_features} outputs")
        device = self.weight.device
        tensor = tensor.to(device)
        if tensor.dtype == FP8_DTYPE:
            if scale is None:
                raise ValueError("an FP8 tensor needs its checkpoint scale (weight_scale or weight_scale_inv)")
            scale = scale.to(device)
            if block_size is not None:
                q, s = quantize_per_channel(dequantize_blocks(tensor, scale, block_size))
            else:
                q, s = tensor, _row_scales(scale, rows)
        elif tensor.dtype in (torch.bfloat16, torch.float16, torch.float32):
            if scale is not None or block_size is not None:
                raise ValueError(f"a scale goes with an FP8 tensor, not with a {tensor.dtype} one")
            q, s = quantize_per_channel(tensor)
        else:
            raise ValueError(f"cannot load a {tensor.dtype} tensor into an FP8 layer (float8_e4m3fn or bf16/fp16/fp32)")
        with torch.no_grad():
            self.weight[start : start + rows].copy_(q)
            self.weight_scale[start : start + rows].copy_(s)
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda:
            y = self._scaled_mm(x2)
        else:
            y = fp8_linear_reference(x2, self.weight, self.weight_scale, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """``torch._scaled_mm`` with per-token scales for ``x`` and per-channel scales for the weight.

        Up to ``SMALL_BATCH_TOKENS`` tokens (decode steps) the matmul runs with unit tensor-wise scales into float32
        and one epilogue kernel applies both scales and the bias: cuBLASLt splits the reduction over the GPU there,
        while the row-wise kernel leaves most of it idle (measured on an H200, Llama-3.1-8B shapes, 1 to 64
        tokens: row-wise 14-46 us against bf16's 16-62 us; tensor-wise + epilogue well below both). Above it,
        row-wise scales in the matmul itself (no float32 round trip).
        """
        weight: torch.Tensor = self.weight
        w_scale: torch.Tensor = self.weight_scale
        n = self.out_features
        pad_k = -self.in_features % _SCALED_MM_ALIGN
        pad_n = -n % _SCALED_MM_ALIGN
        if pad_k or pad_n:
            # Not a shape of any supported model (their widths are multiples of 16), so the padded copy of the
            # weight made here on every call is acceptable; zero columns add nothing, extra rows are cut off.
            x = F.pad(x, (0, pad_k))
            padded = torch.zeros(n + pad_n, self.in_features + pad_k, dtype=FP8_DTYPE, device=weight.device)
            padded[:n, : self.in_features] = weight
            weight = padded
            w_scale = F.pad(w_scale, (0, pad_n), value=1.0)
        xq, x_scale = _quantize_tokens_cuda(x)
        bias = self.bias
        # cuBLASLt wants the weight column-major [in, out]: the transpose of the row-major [out, in] is.
        if x.shape[0] <= SMALL_BATCH_TOKENS:
            unit = self._unit_scale
            acc = torch._scaled_mm(xq, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
            return _scale_epilogue_cuda(acc[:, :n], x_scale, self.weight_scale, bias, x.dtype)
        # cuBLASLt adds the bias in its epilogue, except for float32 output where _scaled_mm refuses a bias.
        fused_bias = None
        if bias is not None and x.dtype != torch.float32:
            fused_bias = F.pad(bias.to(x.dtype), (0, pad_n)) if pad_n else bias.to(x.dtype)
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), bias=fused_bias, out_dtype=x.dtype
        )
        if pad_n:
            y = y[:, :n].contiguous()
        if bias is not None and fused_bias is None:
            y = y + bias
        return y


class WeightScheme(enum.Enum):
    """How a model's linear weights arrive: quantized at load (ONLINE), or FP8 with these checkpoint scales."""

    ONLINE = "online"  # a bf16/fp16 checkpoint, --quantization fp8
    TENSOR = "tensor"  # one scale per tensor
    CHANNEL = "channel"  # one scale per output channel
    BLOCK = "block"  # one scale per block_size tile; requantized per channel at load


# Never quantized, whatever the config says: embeddings, the head, norms and MoE routers (a Qwen/Mixtral
# router is ``...mlp.gate`` / ``...block_sparse_moe.gate``, unlike ``mlp.gate_proj``).
_ALWAYS_HIGH_PRECISION = re.compile(r"(^|\.)(embed_tokens|lm_head|[a-z_]*norm|gate|router|shared_expert_gate)(\.|$)")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """What ``--quantization`` and the checkpoint's ``quantization_config`` ask of the linear layers.

    Activations are always quantized per token at run time (dynamic).
    """

    scheme: WeightScheme
    # The checkpoint's name for a weight's scale, beside ``<module>.weight``; None when quantized online.
    scale_name: str | None = None
    block_size: tuple[int, int] | None = None
    # ``ignore`` / ``modules_to_not_convert`` / ``ignored_layers``: names, dotted prefixes, or "re:" regexes.
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the module of this checkpoint name (``model.layers.0.mlp.up_proj``) gets an ``Fp8Linear``."""
        if _ALWAYS_HIGH_PRECISION.search(module):
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):  # anchored at the start only, as compressed-tensors matches
                    return False
            elif f".{entry}." in f".{module}.":
                return False
        return True

    def quantizes_fused(self, modules: Sequence[str]) -> bool:
        """Whether a fused layer (its parts' checkpoint names: q/k/v_proj) is quantized; its parts must agree."""
        answers = {self.quantizes(m) for m in modules}
        if len(answers) != 1:
            raise ValueError(f"the parts of one fused layer must be all quantized or none: {list(modules)}")
        return answers.pop()

    def load(self, layer: Fp8Linear, start: int, module: str, take: Callable[[str], torch.Tensor]) -> int:
        """Load checkpoint module ``module``'s weight (and scale) into ``layer``'s rows from ``start``; returns rows.

        ``take(name)`` hands over one checkpoint tensor (and removes it, as the model loaders do).
        """
        weight = take(f"{module}.weight")
        if self.scale_name is None:
            return layer.load_rows(start, weight)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{module}.weight is {weight.dtype} in an FP8 checkpoint (expected float8_e4m3fn)")
        return layer.load_rows(start, weight, take(f"{module}.{self.scale_name}"), self.block_size)


def parse_quantization(config_json: Mapping[str, Any], flag: str | None) -> QuantSpec | None:
    """The quantization of a model from its ``config.json`` and the ``--quantization`` flag; None: none.

    ``flag`` "fp8" quantizes a bf16/fp16 checkpoint at load; on an FP8 checkpoint it changes nothing. What this
    engine does not run (other methods, integer or FP4 weights, static activation scales) is a ValueError naming
    the field and its value.
    """
    if flag is not None and flag != "fp8":
        raise ValueError(f"--quantization {flag!r} is not supported (only 'fp8')")
    qc = config_json.get("quantization_config")
    if qc is None:
        return QuantSpec(WeightScheme.ONLINE) if flag == "fp8" else None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported (only 'fp8' and FP8 'compressed-tensors')"
    )


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field} {value!r} is not supported ({why})")


def _parse_fp8(qc: Mapping[str, Any]) -> QuantSpec:
    """``quant_method`` "fp8" (vLLM / Hugging Face ``FineGrainedFP8``): per-tensor or block-wise weight scales."""
    activation = qc.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise _refuse("activation_scheme", activation, "only 'dynamic': static input scales are not implemented")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "only 'e4m3'")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantSpec(WeightScheme.TENSOR, scale_name="weight_scale", ignore=ignore)
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "expected two positive integers [rows, cols]")
    return QuantSpec(WeightScheme.BLOCK, scale_name="weight_scale_inv", block_size=(block[0], block[1]), ignore=ignore)


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> QuantSpec:
    """``quant_method`` "compressed-tensors" (llm-compressor): FP8 weights, dynamic FP8 activations."""
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "expected at least one scheme")
    schemes = {_parse_group(f"config_groups.{name}", group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise _refuse("config_groups", sorted(groups), "its groups must share one weight scheme")
    scheme, block = schemes.pop()
    return QuantSpec(scheme, scale_name="weight_scale", block_size=block, ignore=tuple(qc.get("ignore") or ()))


def _parse_group(field: str, group: Any) -> tuple[WeightScheme, tuple[int, int] | None]:
    if not isinstance(group, Mapping):
        raise _refuse(field, group, "expected an object")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{field}.targets", targets, "only ['Linear']")
    if group.get("output_activations") is not None:
        raise _refuse(f"{field}.output_activations", group["output_activations"], "only null")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise _refuse(f"{field}.weights", weights, "expected an object")
    _check_fp8_args(f"{field}.weights", weights)
    if weights.get("dynamic", False) is not False:
        raise _refuse(f"{field}.weights.dynamic", weights.get("dynamic"), "weights carry their scales")
    acts = group.get("input_activations")
    if not isinstance(acts, Mapping):
        raise _refuse(f"{field}.input_activations", acts, "only dynamic FP8 activations: weight-only FP8 is not run")
    _check_fp8_args(f"{field}.input_activations", acts)
    if acts.get("dynamic") is not True:
        raise _refuse(
            f"{field}.input_activations.dynamic",
            acts.get("dynamic"),
            "only true: static input scales are not implemented",
        )
    # Per-token activations serve a "tensor" dynamic scheme too, with finer scales.
    if acts.get("strategy", "token") not in ("token", "tensor"):
        raise _refuse(f"{field}.input_activations.strategy", acts.get("strategy"), "only 'token' or 'tensor'")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return WeightScheme.CHANNEL, None
    if strategy == "tensor":
        return WeightScheme.TENSOR, None
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise _refuse(f"{field}.weights.block_structure", block, "expected two positive integers")
        return WeightScheme.BLOCK, (block[0], block[1])
    raise _refuse(f"{field}.weights.strategy", strategy, "only 'channel', 'tensor' or 'block'")


def _check_fp8_args(field: str, args: Mapping[str, Any]) -> None:
    """8-bit symmetric float, as llm-compressor writes FP8 (int8, FP4 and asymmetric schemes are refused)."""
    if args.get("type") != "float":
        raise _refuse(f"{field}.type", args.get("type"), "only 'float' (FP8)")
    if args.get("num_bits") != 8:
        raise _refuse(f"{field}.num_bits", args.get("num_bits"), "only 8 (FP8)")
    if args.get("symmetric", True) is not True:
        raise _refuse(f"{field}.symmetric", args.get("symmetric"), "only symmetric")


class HasNumLayers(Protocol):
    """A model config, as far as kv_scales needs it (LlamaConfig and its successors)."""

    @property
    def num_hidden_layers(self) -> int: ...


# Checkpoint names of a layer's KV cache scales, after ``model.layers.N.``, as vLLM reads them.
_KV_SCALE_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.attn.k_scale", "self_attn.k_proj.output_scale", "self_attn.kv_scale"),
    "v": ("self_attn.v_scale", "self_attn.attn.v_scale", "self_attn.v_proj.output_scale", "self_attn.kv_scale"),
}
_KV_SCALE_NAME = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.(?:attn\.)?[kv]_scale|self_attn\.[kv]_proj\.output_scale|self_attn\.kv_scale)"
)


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (``kv_scales`` reads it; model loaders skip it)."""
    return _KV_SCALE_NAME.fullmatch(name) is not None


def kv_scales(config: HasNumLayers, checkpoint: Mapping[str, torch.Tensor]) -> list[tuple[float, float]]:
    """Per layer ``(k_scale, v_scale)`` for an FP8 KV cache: the checkpoint's, or 1.0 where it has none.

    Read from ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (also ``self_attn.attn.k_scale``,
    ``self_attn.k_proj.output_scale``, and the older shared ``self_attn.kv_scale``). Each must be one positive,
    finite number; per-head scales are refused.
    """
    layers = config.num_hidden_layers
    for name in checkpoint:
        match = _KV_SCALE_NAME.fullmatch(name)
        if match and int(match.group(1)) >= layers:
            raise ValueError(f"checkpoint has KV scale {name!r} but the model has {layers} layers")
    scales: list[tuple[float, float]] = []
    for i in range(layers):
        k, v = (_kv_scale(checkpoint, f"model.layers.{i}.", _KV_SCALE_NAMES[kind]) for kind in ("k", "v"))
        scales.append((k, v))
    return scales


def _kv_scale(checkpoint: Mapping[str, torch.Tensor], prefix: str, names: tuple[str, ...]) -> float:
    found = {prefix + n: checkpoint[prefix + n] for n in names if prefix + n in checkpoint}
    values: set[float] = set()
    for name, tensor in found.items():
        if tensor.numel() != 1:
            raise ValueError(f"KV scale {name!r} has shape {list(tensor.shape)}: only one scale per layer is supported")
        value = float(tensor.float().item())  # at load time: one host sync per layer is fine
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV scale {name!r} is {value}: it must be positive and finite")
        values.add(value)
    if len(values) > 1:
        raise ValueError(f"checkpoint gives layer {prefix!r} different KV scales: {sorted(found)}")
    return values.pop() if values else 1.0
