"""The decode attention kernel (``triton_ops._paged_attention_kernel``) as Triton and ptxas compile it for Hopper,
without a GPU: its programs read nothing of global memory before the PDL wait, and let the next kernel in where the
launch's trigger says (docs/engine.md, twenty-first round). Compiled in a process of its own: this suite's kernel
tests run Triton's interpreter, which replaces the kernels at import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Found without importing Triton: an import here, at collection, would come before the modules that run Triton's
# kernels under its interpreter set TRITON_INTERPRET (test_kernels.py, collected after this module, then failed).
if importlib.util.find_spec("triton") is None:
    pytest.fail("triton is missing; `make install` puts it in", pytrace=False)

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]

# Compiles each variant for sm_90 (qwen3-8b's heads: 32 query heads over 8 KV heads of 128, blocks of 16; the bf16
# decode tile: 32 keys, one warp, 3 stages) and prints, per variant, the global memory accesses before ACQBULK (the
# wait; shared and local memory are the CTA's own), and where the next kernel is let in (PREEXIT,
# griddepcontrol.launch_dependents) against the wait and the loop's last tensor-core instruction.
PROGRAM = r"""
import json, re, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import triton_ops as T

cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
out = {}
for name, (split, rope, pdl) in json.loads(sys.argv[1]).items():
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i32", "qstart_ptr": "*i32",
           "ctx_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "tile_seq_ptr": "*i32",
           "tile_q_ptr": "*i32", "scale": "fp32", "v_offset": "i64", "table_stride": "i32", "num_splits": "i32",
           "window": "i32", "pos_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i32",
           "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32"}
    consts = dict(H=32, GROUP=4, D=128, BS=16, SB=8 * 16 * 128, SH=16 * 128, SS=128, BLOCK_M=16, BLOCK_N=32,
                  TILE_Q=1, SPLIT=split, TILED=False, PRECISION="tf32", INTERPRET=False, FP16_DOT=False,
                  V_REGS=False, UNMASKED=True, LAZY=True, PDL=pdl, ROPE=rope, QK_NORM=rope)
    names = list(sig) + list(consts)
    sig |= {k: "constexpr" for k in consts}
    aligned = [n for n, t in sig.items() if t.startswith("*")] + ["v_offset", "table_stride"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(T._paged_attention_kernel, sig, consts, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 3})
    cubin = Path(sys.argv[2]) / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    code = [line.split(";")[0].split("*/", 1)[1].strip() for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    ops = [c.split()[1] if c.startswith("@") else c.split()[0] for c in code]
    wait = ops.index("ACQBULK")
    out[name] = {"before": [o for o in ops[:wait] if o.startswith(("LDG", "LD.", "STG", "ST.", "ATOM", "RED"))],
                 "wait": wait, "let_in": ops.index("PREEXIT"),
                 "last_mma": max(i for i, o in enumerate(ops) if o.startswith("HMMA"))}
print(json.dumps(out))
"""

VARIANTS = {
    "split": (True, False, 2),
    "split, rope": (True, True, 2),
    "unsplit": (False, False, 2),
    "split, next kernel let in first thing": (True, False, 1),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(VARIANTS), str(tmp_path_factory.mktemp("sass"))],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nothing_is_read_before_the_wait(variant: str, compiled: dict[str, dict[str, object]]) -> None:
    # The kernel before may still be writing what the programs read: the query and the step's own keys.
    assert compiled[variant]["before"] == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_next_kernel_is_let_in_where_the_trigger_says(variant: str, compiled: dict[str, dict[str, int]]) -> None:
    # PDL 2 (PDL_LOOP): once the loop is done; PDL 1 (PDL_EARLY, triton_ops.ATTENTION_TRIGGER's other setting): first
    # thing (the merge's and the output projection's blocks are then placed while the attention runs).
    got = compiled[variant]
    if VARIANTS[variant][2] == 2:
        assert got["let_in"] > got["last_mma"]
    else:
        assert got["let_in"] < got["wait"]
