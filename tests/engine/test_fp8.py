"""FP8 linear layers (engine/models/quant.py): quantization error bounds, FP8 checkpoints written with safetensors
and loaded as such, the configs refused, KV cache scales; with ``ENGINE_TEST_DEVICE=cuda`` the ``_scaled_mm`` path
against the torch reference on the same GPU, eagerly and inside a captured CUDA graph."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.loader import tiny_config
from engine.models.quant import (
    FP8_DTYPE,
    FP8_MAX,
    INV_FP8_MAX,
    MIN_AMAX,
    SMALL_BATCH_TOKENS,
    Fp8Linear,
    QuantSpec,
    WeightScheme,
    dequantize,
    dequantize_blocks,
    fp8_linear_reference,
    is_kv_scale_name,
    kv_scales,
    parse_quantization,
    quantize_per_channel,
    quantize_per_token,
)

pytestmark = pytest.mark.timeout(60)
# As in conftest.py, read here so that this file runs where the gateway's packages are not installed (a GPU box).
DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cpu")

# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of a value, relative, for normal values;
# below 2^-6 (of the scaled value) the spacing is 2^-9, so at most 2^-10 * scale absolute.
FP8_REL = 2.0**-4
FP8_SUBNORMAL_ABS = 2.0**-10


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def _layer(in_features: int, out_features: int, bias: bool = False, device: str = "cpu") -> Fp8Linear:
    """An Fp8Linear as the model runner makes its layers: on the meta device, then materialised empty."""
    with torch.device("meta"):
        layer = Fp8Linear(in_features, out_features, bias=bias)
    return layer.to_empty(device=device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 bytes as integers: torch.equal on float8 tensors is not implemented everywhere."""
    return t.view(torch.uint8)


# --- quantization helpers ---------------------------------------------------------------------------------------


def test_per_channel_round_trip_is_within_fp8_rounding() -> None:
    # Rows of very different magnitudes, a zero row and a denormal-sized one: each row gets its own scale.
    w = torch.randn(64, 96, generator=_g(0)) * torch.logspace(-6, 3, 64)[:, None]
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (64,)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    torch.testing.assert_close(scale[torch.arange(64) != 5], w.abs().amax(1)[torch.arange(64) != 5] / FP8_MAX)
    # Every row's largest value lands on 448 exactly (the scale uses the whole range).
    assert (q.float().abs().amax(1)[torch.arange(64) != 5] == FP8_MAX).all()
    back = dequantize(q, scale)
    assert (back[5] == 0).all()
    bound = FP8_REL * w.abs() + FP8_SUBNORMAL_ABS * scale[:, None]
    assert ((back - w).abs() <= bound).all()
    # Gaussian rows: about 2.6% relative error in norm (the figure quoted in docs/engine.md).
    g = torch.randn(256, 512, generator=_g(1))
    assert _rel_err(dequantize(*quantize_per_channel(g)), g) < 0.03


def test_per_token_quantization_scales_each_row() -> None:
    x = torch.randn(7, 48, generator=_g(2)) * torch.tensor([1e-3, 1, 10, 100, 0.5, 3, 1e4])[:, None]
    q, scale = quantize_per_token(x)
    assert scale.shape == (7, 1)
    assert ((q.float() * scale - x).abs() <= FP8_REL * x.abs() + FP8_SUBNORMAL_ABS * scale).all()


def test_dequantize_takes_per_tensor_and_per_channel_scales() -> None:
    q, _ = quantize_per_channel(torch.randn(6, 16, generator=_g(3)))
    s = torch.arange(1, 7, dtype=torch.float32)
    assert torch.equal(dequantize(q, torch.tensor(2.0)), q.float() * 2.0)
    assert torch.equal(dequantize(q, s), q.float() * s[:, None])
    assert torch.equal(dequantize(q, s.view(6, 1)), dequantize(q, s))
    with pytest.raises(ValueError, match=r"got shape \[2, 3\]"):
        dequantize(q, torch.ones(2, 3))


# --- Fp8Linear on the CPU ---------------------------------------------------------------------------------------


def test_fp8_linear_matches_a_float32_linear_within_4_5_percent() -> None:
    lin = nn.Linear(512, 256, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 512, generator=_g(4)) / 512**0.5)
        lin.bias.copy_(torch.randn(256, generator=_g(5)) * 0.1)
    layer = _layer(512, 256, bias=True)
    assert layer._unit_scale.item() == 1.0  # set again after to_empty, which leaves buffers uninitialised
    layer.load_rows(0, lin.weight.detach())
    with torch.no_grad():
        assert layer.bias is not None
        layer.bias.copy_(lin.bias)
    x = torch.randn(3, 11, 512, generator=_g(6))  # any leading dims
    with torch.no_grad():
        y, ref = layer(x), lin(x)
    assert y.shape == (3, 11, 256) and y.dtype == torch.float32
    # Weights and activations each lose ~2.6% (per channel, per token); together 3.67-3.78% over 20 Gaussian draws.
    assert _rel_err(y, ref) < 0.045
    # The CPU path is the reference computation, and that equals dequantize-then-matmul up to float32 rounding.
    x2 = x.reshape(-1, 512)
    deq = dequantize(*quantize_per_token(x2)) @ dequantize(layer.weight, layer.weight_scale).t() + lin.bias
    torch.testing.assert_close(y.reshape(-1, 256), deq.detach(), rtol=1e-5, atol=1e-5)


def test_to_dtype_casts_the_bias_but_keeps_fp8_weights_and_float32_scales() -> None:
    dense, fp8 = nn.Linear(32, 32), Fp8Linear(32, 48, bias=True)
    fp8.load_rows(0, torch.randn(48, 32, generator=_g(7)))
    assert fp8.bias is not None
    with torch.no_grad():  # the layer's bias is torch.empty until a checkpoint fills it (left empty, it failed once)
        fp8.bias.copy_(torch.randn(48, generator=_g(9)))
    weight, scale = _bits(fp8.weight).clone(), fp8.weight_scale.clone()
    model = nn.Sequential(dense, fp8).to(torch.bfloat16)
    assert dense.weight.dtype == torch.bfloat16
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.dtype == torch.float32
    assert fp8.bias is not None and fp8.bias.dtype == torch.bfloat16
    assert torch.equal(_bits(fp8.weight), weight) and torch.equal(fp8.weight_scale, scale)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.weight_scale", "1.bias"}
    assert fp8._unit_scale.dtype == torch.float32 and fp8._unit_scale.item() == 1.0
    y = model(torch.randn(4, 32, generator=_g(8)).bfloat16())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_rows_of_three_per_tensor_scaled_tensors_equal_three_separate_layers() -> None:
    # A fused qkv layer: each Hub tensor keeps its own per-tensor scale, stored exactly.
    parts = [(64, 0.01), (32, 0.2), (32, 3.0)]  # (rows, per-tensor scale)
    tensors = [
        (torch.randn(rows, 64, generator=_g(10 + i)) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        for i, (rows, _) in enumerate(parts)
    ]
    fused = _layer(64, 128)
    start = 0
    for t, (_, s) in zip(tensors, parts, strict=True):
        start += fused.load_rows(start, t, torch.tensor(s))
    assert start == 128
    singles = []
    for t, (rows, s) in zip(tensors, parts, strict=True):
        single = _layer(64, rows)
        single.load_rows(0, t, torch.tensor([s]))
        singles.append(single)
    assert torch.equal(_bits(fused.weight), torch.cat([_bits(t) for t in tensors]))
    assert torch.equal(fused.weight_scale, torch.cat([s.weight_scale for s in singles]))
    assert torch.equal(fused.weight_scale, torch.cat([torch.full((r,), s) for r, s in parts]))
    x = torch.randn(9, 64, generator=_g(13))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), torch.cat([s(x) for s in singles], dim=1), rtol=1e-6, atol=1e-6)
    # High-precision rows are quantized row by row: loading in pieces equals quantizing the whole.
    hp = torch.randn(128, 64, generator=_g(14)).bfloat16()
    pieces = _layer(64, 128)
    pieces.load_rows(0, hp[:64])
    pieces.load_rows(64, hp[64:])
    whole_q, whole_s = quantize_per_channel(hp)
    assert torch.equal(_bits(pieces.weight), _bits(whole_q)) and torch.equal(pieces.weight_scale, whole_s)


def test_load_rows_refuses_what_it_cannot_store() -> None:
    layer = _layer(32, 48)
    fp8 = torch.zeros(16, 32).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="needs its checkpoint scale"):
        layer.load_rows(0, fp8)
    with pytest.raises(ValueError, match=r"rows 40:56 fall outside this layer's 48 outputs"):
        layer.load_rows(40, fp8, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"wants a \[rows, 32\] tensor, got shape \[16, 31\]"):
        layer.load_rows(0, torch.zeros(16, 31))
    with pytest.raises(ValueError, match="a scale goes with an FP8 tensor"):
        layer.load_rows(0, torch.zeros(16, 32), torch.tensor(1.0))
    with pytest.raises(ValueError, match="float8_e5m2"):
        layer.load_rows(0, torch.zeros(16, 32).to(torch.float8_e5m2), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"per channel \(\[16\] or \[16, 1\]\), got shape \[8\]"):
        layer.load_rows(0, fp8, torch.ones(8))


# --- FP8 checkpoints on disk ------------------------------------------------------------------------------------

CT_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
            },
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip
FP8_TENSOR = {"quant_method": "fp8", "activation_scheme": "dynamic"}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _write_checkpoint(folder: Path, quantization_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": quantization_config}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def _read_checkpoint(folder: Path, flag: str | None = None) -> tuple[QuantSpec, dict[str, torch.Tensor]]:
    spec = parse_quantization(json.loads((folder / "config.json").read_text()), flag)
    assert spec is not None
    return spec, load_file(str(folder / "model.safetensors"))


QKV = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
HIDDEN = 96


def _load_qkv(spec: QuantSpec, weights: dict[str, torch.Tensor]) -> Fp8Linear:
    """The lead's loading loop in small: q, k and v of layer 0 into one fused layer, taking each tensor once."""
    prefix = "model.layers.0.self_attn."
    assert spec.quantizes_fused([prefix + name for name in QKV])
    layer = _layer(HIDDEN, sum(QKV.values()))
    start = 0
    for name in QKV:
        start += spec.load(layer, start, prefix + name, weights.pop)
    return layer


def _check_forward(layer: Fp8Linear, dense: torch.Tensor) -> None:
    """Against a float32 linear holding the checkpoint's dequantized weight: only the activations' rounding."""
    x = torch.randn(10, HIDDEN, generator=_g(20))
    with torch.no_grad():
        assert _rel_err(layer(x), x @ dense.t()) < 0.035


def test_compressed_tensors_per_channel_checkpoint_loads_as_such(tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, rows) in enumerate(QKV.items()):
        q, scale = quantize_per_channel(torch.randn(rows, HIDDEN, generator=_g(30 + i)) * (i + 1))
        tensors[f"model.layers.0.self_attn.{name}.weight"] = q
        tensors[f"model.layers.0.self_attn.{name}.weight_scale"] = scale.view(rows, 1)  # as llm-compressor writes
    _write_checkpoint(tmp_path / "ct", CT_CHANNEL, tensors)
    spec, weights = _read_checkpoint(tmp_path / "ct")
    assert spec == QuantSpec(WeightScheme.CHANNEL, scale_name="weight_scale", ignore=("lm_head",))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    layer = _load_qkv(spec, weights)
    assert not weights  # every weight and scale taken
    names = [f"model.layers.0.self_attn.{n}" for n in QKV]
    assert torch.equal(_bits(layer.weight), torch.cat([_bits(tensors[n + ".weight"]) for n in names]))
    assert torch.equal(layer.weight_scale, torch.cat([tensors[n + ".weight_scale"].view(-1) for n in names]))
    _check_forward(layer, torch.cat([dequantize(tensors[n + ".weight"], tensors[n + ".weight_scale"]) for n in names]))


def test_fp8_per_tensor_checkpoint_loads_as_such(tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    dense = []
    for i, (name, rows) in enumerate(QKV.items()):
        w = torch.randn(rows, HIDDEN, generator=_g(40 + i)) * 10 ** (i - 1)
        scale = w.abs().amax() / FP8_MAX
        tensors[f"model.layers.0.self_attn.{name}.weight"] = (w / scale).to(FP8_DTYPE)
        tensors[f"model.layers.0.self_attn.{name}.weight_scale"] = scale.reshape(())  # a scalar, as vLLM writes
        dense.append(dequantize(tensors[f"model.layers.0.self_attn.{name}.weight"], scale))
    _write_checkpoint(tmp_path / "fp8", FP8_TENSOR, tensors)
    spec, weights = _read_checkpoint(tmp_path / "fp8", flag="fp8")  # the flag on an FP8 checkpoint changes nothing
    assert spec == QuantSpec(WeightScheme.TENSOR, scale_name="weight_scale")
    layer = _load_qkv(spec, weights)
    assert not weights
    torch.testing.assert_close(dequantize(layer.weight, layer.weight_scale), torch.cat(dense), rtol=0, atol=0)
    _check_forward(layer, torch.cat(dense))


def _block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one scale per block x block tile, as DeepSeek's and Qwen3's FP8 checkpoints are made."""
    rows, cols = w.shape
    grid = torch.zeros(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().amax() / FP8_MAX
    scales = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), grid


def test_block_wise_checkpoint_is_requantized_per_channel(tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    originals, blocks = [], []
    hidden = 300  # partial blocks in both directions (128-wide tiles)
    rows_of = {"q_proj": 200, "k_proj": 72, "v_proj": 72}
    for i, (name, rows) in enumerate(rows_of.items()):
        # Columns of very different sizes, so that the block scales differ within a row.
        w = torch.randn(rows, hidden, generator=_g(50 + i)) * torch.logspace(-2, 1, hidden)[None, :]
        q, grid = _block_quantize(w, 128)
        tensors[f"model.layers.0.self_attn.{name}.weight"] = q
        tensors[f"model.layers.0.self_attn.{name}.weight_scale_inv"] = grid
        originals.append(w)
        blocks.append(dequantize_blocks(q, grid, (128, 128)))
    _write_checkpoint(tmp_path / "block", FP8_BLOCK, tensors)
    spec, weights = _read_checkpoint(tmp_path / "block")
    assert spec == QuantSpec(WeightScheme.BLOCK, scale_name="weight_scale_inv", block_size=(128, 128))
    layer = _layer(hidden, 344)
    start = 0
    for name in rows_of:
        start += spec.load(layer, start, f"model.layers.0.self_attn.{name}", weights.pop)
    assert start == 344 and not weights
    block_values = torch.cat(blocks)
    back = dequantize(layer.weight, layer.weight_scale)
    # One more per-channel rounding of the checkpoint's values, within FP8's bound...
    bound = FP8_REL * block_values.abs() + FP8_SUBNORMAL_ABS * layer.weight_scale[:, None]
    assert ((back - block_values).abs() <= bound).all()
    # ...so against the original weights two roundings add up: ~2.6% (blocks) becomes ~3.6% in norm.
    assert _rel_err(block_values, torch.cat(originals)) < 0.03
    assert _rel_err(back, torch.cat(originals)) < 0.045
    with pytest.raises(ValueError, match=r"must be \[2, 3\], got \[2, 2\]"):
        dequantize_blocks(tensors["model.layers.0.self_attn.q_proj.weight"], torch.ones(2, 2), (128, 128))


# --- configs ----------------------------------------------------------------------------------------------------


def test_configs_and_flag_give_the_spec() -> None:
    assert parse_quantization({}, None) is None
    assert parse_quantization({"torch_dtype": "bfloat16"}, "fp8") == QuantSpec(WeightScheme.ONLINE)
    spec = parse_quantization({"quantization_config": FP8_BLOCK | {"modules_to_not_convert": ["model.layers.0"]}}, None)
    assert spec is not None and spec.ignore == ("model.layers.0",)
    ct_tensor = json.loads(json.dumps(CT_CHANNEL))
    ct_tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    ct_tensor["ignore"] = ["re:.*lm_head", "re:.*mlp.down_proj$"]
    spec = parse_quantization({"quantization_config": ct_tensor}, None)
    assert spec is not None and spec.scheme is WeightScheme.TENSOR and spec.scale_name == "weight_scale"
    assert spec.quantizes("model.layers.3.mlp.gate_proj")
    assert spec.quantizes("model.layers.3.mlp.experts.7.up_proj")
    assert not spec.quantizes("model.layers.3.mlp.down_proj")  # by the regex
    for name in (
        "model.embed_tokens", "lm_head", "model.norm", "model.layers.0.input_layernorm",
        "model.layers.0.self_attn.q_norm", "model.layers.2.mlp.gate",  # a Qwen MoE router
        "model.layers.2.block_sparse_moe.gate", "model.layers.2.mlp.shared_expert_gate",
    ):  # fmt: skip
        assert not spec.quantizes(name), name
    prefix = QuantSpec(WeightScheme.ONLINE, ignore=("model.layers.1",))
    assert not prefix.quantizes("model.layers.1.self_attn.o_proj")
    assert prefix.quantizes("model.layers.10.self_attn.o_proj")
    mixed = QuantSpec(WeightScheme.ONLINE, ignore=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match="all quantized or none"):
        mixed.quantizes_fused([f"model.layers.0.self_attn.{n}" for n in QKV])


def _ct(weights: dict[str, Any] | None = None, acts: dict[str, Any] | None = None, **group: Any) -> dict[str, Any]:
    qc: dict[str, Any] = json.loads(json.dumps(CT_CHANNEL))
    g = qc["config_groups"]["group_0"]
    g["weights"] |= weights or {}
    g["input_activations"] = None if acts == {} else g["input_activations"] | (acts or {})
    g |= group
    return qc


@pytest.mark.parametrize(
    ("qc", "flag", "message"),
    [
        (None, "int8", "--quantization 'int8' is not supported"),
        (None, "awq", "--quantization 'awq' is not supported"),
        ({"quant_method": "awq", "bits": 4}, None, "quant_method 'awq' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "fp8", "quant_method 'gptq' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, None, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "mxfp4"}, None, "quant_method 'mxfp4' is not supported"),
        ({"activation_scheme": "dynamic"}, None, "quant_method None is not supported"),
        (FP8_TENSOR | {"activation_scheme": "static"}, None, "activation_scheme 'static' is not supported"),
        (FP8_TENSOR | {"fmt": "e5m2"}, None, "fmt 'e5m2' is not supported"),
        (FP8_TENSOR | {"weight_block_size": [128]}, None, r"weight_block_size \[128\] is not supported"),
        (_ct({"type": "int"}), None, "config_groups.group_0.weights.type 'int' is not supported"),
        (_ct({"num_bits": 4}, {"num_bits": 4}), None, "config_groups.group_0.weights.num_bits 4 is not supported"),
        (_ct({"strategy": "group", "group_size": 128}), None, "weights.strategy 'group' is not supported"),
        (_ct({"symmetric": False}), None, "weights.symmetric False is not supported"),
        (_ct(acts={"dynamic": False}), None, "input_activations.dynamic False is not supported"),
        (_ct(acts={}), None, "config_groups.group_0.input_activations None is not supported"),
        (_ct(targets=["Attention"]), None, r"targets \['Attention'\] is not supported"),
    ],
)
def test_unsupported_quantization_is_refused_naming_field_and_value(
    qc: dict[str, Any] | None, flag: str | None, message: str
) -> None:
    config = {} if qc is None else {"quantization_config": qc}
    with pytest.raises(ValueError, match=message):
        parse_quantization(config, flag)


# --- KV cache scales --------------------------------------------------------------------------------------------


def test_kv_scales_per_layer_from_the_checkpoint_else_one() -> None:
    config = replace(tiny_config(), num_hidden_layers=4)
    checkpoint = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0, dtype=torch.bfloat16),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0),
        "model.layers.2.self_attn.kv_scale": torch.tensor(0.125),  # the older shared name
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
    }
    assert kv_scales(config, checkpoint) == [(0.5, 0.25), (2.0, 4.0), (0.125, 0.125), (1.0, 1.0)]
    assert [n for n in checkpoint if is_kv_scale_name(n)] == list(checkpoint)[:5]
    assert is_kv_scale_name("model.layers.7.self_attn.attn.v_scale")
    assert not is_kv_scale_name("model.layers.0.self_attn.k_proj.weight_scale")


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"model.layers.9.self_attn.k_scale": torch.tensor(1.0)}, "model has 4 layers"),
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, r"has shape \[2\]: only one scale per layer"),
        ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "must be positive and finite"),
        (
            {
                "model.layers.0.self_attn.k_scale": torch.tensor(1.0),
                "model.layers.0.self_attn.kv_scale": torch.tensor(2.0),
            },
            "different KV scales",
        ),
    ],
)
def test_kv_scales_refuse_what_they_cannot_use(checkpoint: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_scales(replace(tiny_config(), num_hidden_layers=4), checkpoint)


# --- CUDA: torch._scaled_mm --------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(
    DEVICE != "cuda" or not torch.cuda.is_available(), reason="FP8 _scaled_mm needs a GPU (ENGINE_TEST_DEVICE=cuda)"
)


def _cuda_layer(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Fp8Linear:
    layer = _layer(in_features, out_features, bias=bias, device="cuda")
    layer.load_rows(0, torch.randn(out_features, in_features, generator=_g(60)) / in_features**0.5)
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out_features, generator=_g(61)))
    return layer.to(dtype)


# Relative error in norm. Hopper's FP8 tensor cores keep fewer bits than float32 while they accumulate (about 14,
# DeepSeek-V3's report measured), so even float32 output differs from a float32 sum: 2e-5 to 9e-5 seen on an
# H200. Half-precision output rounds once more (2^-11 / 2^-9 relative), in cuBLASLt's epilogue.
_TOLERANCE = {torch.float32: 5e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(256, 384), (40, 24)])  # the latter padded to 16s
def test_scaled_mm_matches_the_reference_on_the_gpu(
    dtype: torch.dtype, bias: bool, in_features: int, out_features: int
) -> None:
    layer = _cuda_layer(in_features, out_features, bias, dtype)
    # Up to SMALL_BATCH_TOKENS: tensor-wise matmul + epilogue kernel; above: row-wise scales. Any count works.
    for tokens in (1, 7, SMALL_BATCH_TOKENS, SMALL_BATCH_TOKENS + 1, 300):
        x = torch.randn(tokens, in_features, generator=_g(62)).to("cuda", dtype)
        with torch.no_grad():
            y = layer(x)
            ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias)
        assert y.dtype == dtype and y.shape == (tokens, out_features)
        assert _rel_err(y, ref) < _TOLERANCE[dtype], (tokens, _rel_err(y, ref))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [16, 128])  # both kernel paths
def test_scaled_mm_replays_in_a_captured_cuda_graph(dtype: torch.dtype, tokens: int) -> None:
    layer = _cuda_layer(256, 384, True, dtype)
    static_x = torch.zeros(tokens, 256, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        layer(static_x)  # warm-up outside the capture: cuBLASLt's workspace and heuristics
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    for seed in (70, 71):
        x = torch.randn(tokens, 256, generator=_g(seed)).to("cuda", dtype) * (seed - 69)
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            eager = layer(x)
            ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias)
        torch.testing.assert_close(static_y, eager, rtol=0, atol=0)
        assert _rel_err(static_y, ref) < _TOLERANCE[dtype]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_activation_quantization_gives_torchs_bytes(dtype: torch.dtype) -> None:
    # (Not under TRITON_INTERPRET: Triton 3.6's interpreter rounds 125.2 to 64 in e4m3, dropping the carry.)
    from engine.kernels.fp8 import per_token_quant

    for tokens, cols in ((1, 4096), (37, 300), (5, 14336)):
        x = torch.randn(tokens, cols, generator=_g(80)) * torch.logspace(-4, 4, tokens)[:, None]
        x[0, : cols // 2] = 0.0
        x = x.to("cuda", dtype)
        if tokens > 1:
            x[1] = 0.0  # an all-zero token
        q, scale = per_token_quant(x, FP8_DTYPE, FP8_MAX, INV_FP8_MAX, MIN_AMAX)
        ref_q, ref_scale = quantize_per_token(x)
        assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(scale, ref_scale)
