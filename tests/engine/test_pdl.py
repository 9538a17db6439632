"""Programmatic dependent launch (``engine.kernels.pdl``): which launches take part, and what the kernels compile to.

The GPU figures are in docs/engine.md (tenth round); on CPU the kernels are compiled for Hopper (sm_90) with
Triton's own ptxas, without running them, to check where the two grid-dependency instructions land: the wait before
anything is read, the next kernel let in first thing or after the main loop, and nothing at all with PDL off.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Neither Triton nor the engine's kernels are imported at collection: that would come before the modules that run
# Triton's kernels under its interpreter set TRITON_INTERPRET (test_kernels.py, collected after this one, then failed).
if importlib.util.find_spec("triton") is None:
    pytest.fail("triton is missing; `make install` puts it in", pytrace=False)

pytestmark = pytest.mark.timeout(300)


# Compiled in a child process: Triton's interpreter, which other test modules turn on for the whole process,
# replaces every kernel by an interpreted one that cannot be compiled.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine import kernels
from engine.kernels import fused_moe, gemv, triton_ops


def ptx(fn, names, types, cx):
    sig = dict(zip(names, types)) | dict.fromkeys(cx, "constexpr")
    # 16-byte aligned pointers and strides, as a launch of the engine's tensors specializes them: the loads then go
    # to shared memory asynchronously (cp.async), as on the GPU.
    aligned = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(zip(names, types))
               if t.startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=aligned)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    return out.asm["ptx"]


gemv_names = ["x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "M", "N", "stride_x", "stride_w", "stride_out"]
gemv_types = ["*bf16"] * 2 + ["*fp32", "*bf16", "*bf16"] + ["i32"] * 5
gemv_cx = {"K": 1024, "HAS_SCALE": False, "HAS_BIAS": False, "SWIGLU": False, "FP16_DOT": False,
           "PRECISION": "tf32", "K_SPLIT": 1024, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256}
out = {f"gemv{p}": ptx(gemv._gemv_kernel, gemv_names, gemv_types, gemv_cx | {"PDL": p})
       for p in (kernels.PDL_OFF, kernels.PDL_EARLY, kernels.PDL_LOOP)}
for name, parts in (("norm", 1), ("norm_parts", 8)):  # 8: summing a MoE layer's experts
    out[name] = ptx(triton_ops._rms_norm_kernel,
                    ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "n_cols", "eps"],
                    ["*bf16"] * 5 + ["i32", "fp32"],
                    {"HAS_RES": True, "PARTS": parts, "BLOCK": 1024, "PDL": kernels.PDL_EARLY})
out["route_align"] = ptx(
    fused_moe._route_and_align_kernel,
    ["logits_ptr", "weights_ptr", "ids_ptr", "sorted_ptr", "expert_ids_ptr", "used_ptr", "offset_ptr", "tokens",
     "num_experts", "capacity", "num_blocks"],
    ["*bf16", "*bf16", "*i64"] + ["*i32"] * 4 + ["i32"] * 4,
    {"E": 128, "TOP_K": 8, "TOP_KP": 8, "RENORMALIZE": True, "BLOCK_T": 2, "BLOCK_E": 128, "BLOCK_M": 16, "EP": 256,
     "B": 16, "BB": 64, "PDL": kernels.PDL_EARLY, "PARTS": 4, "LOGITS_DT": triton.language.bfloat16})
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


LOADS = r"ld\.global|cp\.async"  # a global load to registers, or one straight to shared memory


def _lines(ptx: str, pattern: str) -> list[int]:
    return [i for i, line in enumerate(ptx.splitlines()) if re.search(pattern, line)]


def test_a_loop_kernel_waits_first_and_lets_the_next_one_in_where_it_was_told(ptx: dict[str, str]) -> None:
    from engine import kernels

    off, early, loop = (ptx[f"gemv{p}"] for p in (kernels.PDL_OFF, kernels.PDL_EARLY, kernels.PDL_LOOP))
    assert "griddepcontrol" not in off
    for code in (early, loop):
        (wait,) = _lines(code, r"griddepcontrol\.wait")
        (let_in,) = _lines(code, r"griddepcontrol\.launch_dependents")
        loads, mmas = _lines(code, LOADS), _lines(code, r"\bmma\.")
        assert loads and mmas and wait < min(loads), "the wait must come before the first load"
        assert "cp.async" in code  # compiled as a launch compiles it: the weight goes to shared memory asynchronously
        if code is early:
            assert let_in < min(loads)
        else:
            assert let_in > max(mmas), "PDL_LOOP lets the next kernel in after the main loop"


@pytest.mark.parametrize("kernel", ["gemv1", "gemv2", "norm", "norm_parts", "route_align"])
def test_no_load_takes_the_read_only_path(ptx: dict[str, str], kernel: str) -> None:
    # ptxas may move a read-only load (ld.global.nc) above griddepcontrol.wait, and under PDL what the kernel before
    # writes is not read-only while this one runs (docs/engine.md, nineteenth round). Triton emits none in these.
    assert not _lines(ptx[kernel], r"ld\.global\S*\.nc\b")


@pytest.mark.parametrize("kernel", ["norm", "norm_parts", "route_align"])
def test_a_small_kernel_waits_before_it_reads(ptx: dict[str, str], kernel: str) -> None:
    code = ptx[kernel]
    (wait,) = _lines(code, r"griddepcontrol\.wait")
    assert wait < min(_lines(code, LOADS))
    assert _lines(code, r"griddepcontrol\.launch_dependents")


def test_which_launches_take_part() -> None:
    from engine import kernels
    from engine.kernels import gemv

    # Off the GPU, and in steps larger than the skinny matmul's, a launch is a plain one.
    assert kernels.pdl_launch(torch.device("cpu"), 1) == {"PDL": kernels.PDL_OFF}
    assert kernels.pdl_launch(torch.device("cuda"), kernels.PDL_MAX_TOKENS + 1) == {"PDL": kernels.PDL_OFF}
    assert kernels.pdl_launch(torch.device("cuda"), 1, kernels.PDL_OFF) == {"PDL": kernels.PDL_OFF}
    assert kernels.PDL_MAX_TOKENS == gemv.MAX_TOKENS  # PDL covers exactly the steps whose matmuls are ours
    assert kernels.pdl_enabled(0, "0") is False
    with pytest.raises(ValueError, match="ENGINE_PDL must be 0 or 1, got 'yes'"):
        kernels.pdl_enabled(0, "yes")


def test_rocm_gpus_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import kernels

    # ROCm builds of torch call their GPUs "cuda" and report capabilities such as 9.4 (MI300): no PDL there.
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels.pdl_enabled.cache_clear()
    try:
        assert kernels.pdl_enabled(0, "") is False
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            kernels.pdl_enabled(0, "1")
    finally:
        kernels.pdl_enabled.cache_clear()
