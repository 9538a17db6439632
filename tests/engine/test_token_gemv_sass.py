"""One token's CUDA matmul (``engine/kernels/token_gemv.cu``) as ptxas compiles it for Hopper, without a GPU.

Under programmatic dependent launch the kernel may run while the kernel before it still writes its input. The source
asks for its first weight chunks before ``griddepcontrol.wait`` and reads that input after it, but the order in the
compiled code is ptxas's: it schedules a bare wait above the weight loads, and it may move loads through the
read-only path above the wait (docs/engine.md, nineteenth round; an MoE model read stale expert ids that way and
faulted). Every variant the engine launches is compiled here with NVRTC for sm_90 and disassembled with Triton's
cuobjdump: only weight chunks are loaded before the wait, the first ones are (``PIN_LOADS``), and the next kernel is
let in where ``EARLY`` says.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gwtest import require

require("nvidia.cuda_nvrtc", "make install puts NVRTC in (nvidia-cuda-nvrtc-cu12), which compiles the kernel")

from engine.kernels import nvrtc, token_gemv, token_norm  # noqa: E402
from engine.kernels.token_gemv import TokenTile  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# Triton's own cuobjdump, found without importing Triton: an import here, at collection, would come before the
# modules that run Triton's kernels under its interpreter set TRITON_INTERPRET.
_TRITON = importlib.util.find_spec("triton")
CUOBJDUMP = Path(_TRITON.origin or "").parent / "backends" / "nvidia" / "bin" / "cuobjdump" if _TRITON else None
if CUOBJDUMP is None or not CUOBJDUMP.exists():
    pytest.fail(f"Triton's cuobjdump is missing ({CUOBJDUMP}); `make install` puts Triton in", pytrace=False)
WEIGHT_CHUNK = "LDG.E.NA.128.CONSTANT"  # ld_stream: a weight's 16-byte chunk, read once, not kept in L1

# name: (K, weight bytes, tile, SwiGLU, scale, bias, routed, router) as the engine launches them for Qwen3 shapes
# (token_gemv.tile_for, its measured tiles among them).
VARIANTS: dict[str, tuple[Any, ...]] = {
    "bf16": (4096, 2, TokenTile(4, 1, 8), False, False, False, 0, None),
    "bf16 bias": (2048, 2, TokenTile(4, 1, 8), False, False, True, 0, None),
    "bf16 swiglu": (4096, 2, TokenTile(4, 1, 8), True, False, False, 0, None),
    "e4m3": (4096, 1, TokenTile(8, 1, 4), False, True, False, 0, None),
    "e4m3 swiglu": (4096, 1, TokenTile(4, 2, 4), True, True, False, 0, None),
    "bf16 down": (12288, 2, TokenTile(8, 1, 8), False, False, False, 0, None),
    "e4m3 down": (12288, 1, TokenTile(8, 1, 4), False, True, False, 0, None),
    "router": (2048, 2, TokenTile(4, 1, 8), False, False, False, 0, (8, 128, True, False)),
    "experts gate/up": (2048, 2, TokenTile(4, 1, 8), True, False, False, 1, None),
    "experts down, float32 weights": (768, 2, TokenTile(4, 1, 3), False, False, False, 2, None),
    "experts down, 16-bit weights": (768, 2, TokenTile(4, 1, 3), False, False, False, 3, None),
}


def _usage(tmp_path: Path) -> str:
    """The registers and memory of the kernel ``sass`` compiled last (cuobjdump's resource usage)."""
    out = subprocess.run([str(CUOBJDUMP), "-res-usage", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return out.stdout


def sass(constants: dict[str, int], tmp_path: Path, source: Path = token_gemv._SOURCE) -> list[str]:
    cubin = tmp_path / "k.cubin"
    defines = [f"-D{k}={v}" for k, v in constants.items()]
    cubin.write_bytes(nvrtc.compile_cubin(source.read_text(), source.name, "sm_90", defines))
    out = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True, timeout=60, check=True)
    return [line.split(";")[0].split("*/", 1)[1].strip() for line in out.stdout.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]  # fmt: skip


# (variant, pin, early): every variant at three settings of the pin and EARLY.
SETTINGS = [(v, pin, early) for v in VARIANTS for pin, early in ((1, 1), (0, 0), (1, 3))]


@pytest.mark.parametrize(("variant", "pin", "early"), SETTINGS)
def test_only_weights_are_read_before_the_wait(variant: str, pin: int, early: int, tmp_path: Path) -> None:
    k, wbytes, tile, swiglu, scale, bias, routed, router = VARIANTS[variant]
    constants = token_gemv.defines(k, wbytes, True, tile, swiglu, scale, bias, True, routed, router, pin=pin,
                                   early=early)  # fmt: skip
    code = sass(constants, tmp_path)
    (wait,) = [i for i, ins in enumerate(code) if ins.startswith("ACQBULK")]
    (let_in,) = [i for i, ins in enumerate(code) if ins.startswith("PREEXIT")]
    chunks = [i for i, ins in enumerate(code) if ins.startswith(WEIGHT_CHUNK)]
    before = [ins for ins in code[:wait] if ins.startswith(("LDG", "LD.", "LDS", "ATOM", "RED"))]
    assert all(ins.startswith(WEIGHT_CHUNK) for ins in before), f"read before the wait: {before}"
    rows = tile.rows_per_warp * (2 if swiglu else 1)
    if routed:  # the experts' weights are only known after the wait
        assert not before
    elif pin:
        assert len(before) == rows * tile.unroll, "the first chunks of every row are asked for before the wait"
    else:
        assert not before  # ptxas's own order: the wait first
    lets_in_first = {0: False, 1: wbytes == 1, 3: True}[early]  # EARLY: 1 e4m3 weights, 3 every launch
    assert constants["EARLY"] == lets_in_first
    if lets_in_first:
        assert let_in < wait
    else:
        assert let_in > max(chunks), "the next kernel is let in once the block has left its loop"


def test_without_pdl_there_is_no_grid_dependency(tmp_path: Path) -> None:
    constants = token_gemv.defines(4096, 2, True, TokenTile(4, 1, 8), False, False, False, False, pin=1, early=3)
    code = sass(constants, tmp_path)
    assert not [ins for ins in code if ins.startswith(("ACQBULK", "PREEXIT"))]


# The decode step's CUDA norm (token_norm.cu), as the engine launches it: (N, residual, parts, float32 parts).
NORMS: dict[str, tuple[int, bool, int, bool]] = {
    "norm": (4096, False, 1, False),
    "add and norm": (4096, True, 1, False),
    "add a MoE layer's 8 experts and norm": (2048, True, 8, False),
    "add float32 parts and norm": (4096, True, 2, True),
    "two chunks a thread": (8192, True, 1, False),
}


@pytest.mark.parametrize("pin", [1, 0])
@pytest.mark.parametrize("variant", list(NORMS))
def test_the_norm_reads_only_its_weight_before_the_wait(variant: str, pin: int, tmp_path: Path) -> None:
    n, has_res, parts, x_f32 = NORMS[variant]
    constants = token_norm.defines(n, True, has_res, parts, x_f32, True, pin=pin)
    code = sass(constants, tmp_path, token_norm._SOURCE)
    (wait,) = [i for i, ins in enumerate(code) if ins.startswith("ACQBULK")]
    (let_in,) = [i for i, ins in enumerate(code) if ins.startswith("PREEXIT")]
    loads = [ins for ins in code if ins.startswith(("LDG", "LD."))]
    before = [ins for ins in code[:wait] if ins.startswith(("LDG", "LD."))]
    weight = [ins for ins in loads if ins.startswith("LDG.E.128.CONSTANT")]
    assert len(weight) == constants["VEC"], "the weight through the read-only path, 16 bytes a load"
    assert before == (weight if pin else []), "only the weight is asked for before the wait, all of it with the pin"
    after = [ins for ins in code[wait:] if ins.startswith(("LDG", "LD.")) and ins not in weight]
    assert all(ins.startswith("LDG.E.128 ") for ins in after), f"x and the residual by plain loads: {after}"
    assert len(after) == constants["VEC"] * (parts * (2 if x_f32 else 1) + has_res)
    assert let_in < wait, "the next kernel is let in first thing"


# A MoE router with the residual add and RMS norm before it in the same launch (token_gemv.cu's NORM), as the engine
# launches it for Qwen3-30B-A3B's shape: (K, tile, x's parts, float32 parts). x is the attention's output, whole or in
# float32 parts of its o projection.
NORMED: dict[str, tuple[int, TokenTile, int, bool]] = {
    "add and norm": (2048, TokenTile(4, 1, 8), 1, False),
    "float32 parts, added": (2048, TokenTile(4, 1, 8), 2, True),
}


@pytest.mark.parametrize("variant", list(NORMED))
def test_the_router_with_its_norm_reads_only_weights_before_the_wait(variant: str, tmp_path: Path) -> None:
    """The first chunks of every row and the norm's weight before the wait (plain loads there, which the fence holds:
    ptxas sank read-only ones below it), x and the residual by plain loads after it, block 0's stores of the residual
    stream and the norm after it too."""
    k, tile, parts, x_f32 = NORMED[variant]
    constants = token_gemv.defines(k, 2, True, tile, False, False, False, True, 0, (8, 128, True, False), pin=1,
                                   early=1, norm=(parts, x_f32))  # fmt: skip
    assert constants["NORM"] == 1
    code = sass(constants, tmp_path)
    (wait,) = [i for i, ins in enumerate(code) if ins.startswith("ACQBULK")]
    before = [ins.split()[0] for ins in code[:wait] if ins.startswith(("LDG", "LD.", "LDS", "ATOM", "RED", "ST"))]
    norm_chunks = k // 8 // (32 * tile.warps)
    assert before == ["LDG.E.NA.128"] * (tile.rows_per_warp * tile.unroll + norm_chunks), f"before the wait: {before}"
    assert code[wait - 1] == "MEMBAR.SC.CTA", "the fence holds the wait behind them"
    after = [ins for ins in code[wait:] if ins.startswith("LDG.E.128 ")]
    assert len(after) == norm_chunks * (parts * (2 if x_f32 else 1) + 1), "x and the residual, plain loads"
    assert not [ins for ins in code[wait:] if ins.startswith("LDG.E.128.CONSTANT")], "nothing it waits for, read-only"
    stores = [ins for ins in code[wait:] if ins.split()[ins.startswith("@")] == "STG.E.128"]  # (predicated: block 0)
    assert len(stores) == 2 * norm_chunks, "block 0 stores the residual stream and the norm, which the experts read"


# Linear layers with runs staged in shared memory before the wait (token_gemv.cu's STAGE, token_gemv.STAGE_RUNS), as
# stage_for gives them: (K, weight bytes, tile, SwiGLU, scale, runs staged, blocks an SM must hold).
# Qwen3-8B's shapes, then wider rows (Llama's down projections) and tiles with more runs or rows.
STAGED: dict[str, tuple[Any, ...]] = {
    "bf16 o projection": (4096, 2, TokenTile(4, 1, 8), False, False, 1, 8),
    "bf16 LM head's tile": (4096, 2, TokenTile(8, 1, 8), False, False, 1, 4),
    "bf16 swiglu": (4096, 2, TokenTile(4, 1, 8), True, False, 0, 0),  # (none with SwiGLU)
    "e4m3 o projection": (4096, 1, TokenTile(8, 1, 4), False, True, 0, 0),  # e4m3 rows: none (measured slower)
    "e4m3 swiglu": (4096, 1, TokenTile(4, 2, 4), True, True, 0, 0),
    "bf16 down projection": (12288, 2, TokenTile(8, 1, 8), False, False, 0, 0),  # no room beside its token
    "e4m3 down projection": (12288, 1, TokenTile(8, 1, 4), False, True, 0, 0),
    "bf16, 8,192 columns": (8192, 2, TokenTile(4, 1, 8), False, False, 1, 0),
    "bf16, 7,168 columns": (7168, 2, TokenTile(4, 1, 7), False, False, 2, 0),  # rows over 10 KB: no bound
    "bf16, 5,120 columns: three runs": (5120, 2, TokenTile(4, 1, 5), False, False, 3, 5),
    "bf16, two rows a warp": (4096, 2, TokenTile(4, 2, 4), False, False, 2, 0),
    "e4m3, two rows a warp": (4096, 1, TokenTile(4, 2, 4), False, True, 0, 0),
}


@pytest.mark.parametrize("variant", list(STAGED))
def test_staged_runs_are_asked_for_before_the_wait_and_read_from_shared_memory(variant: str, tmp_path: Path) -> None:
    """Every row's first run to registers and the next ``stage`` runs to shared memory (cp.async: LDGSTS) before the
    fence and the wait, no other read; after it, the loop streams only the runs after those; without spilling, in
    the registers that let the blocks ``stage_bounds`` asks for share an SM."""
    k, wbytes, tile, swiglu, scale, stage, bound = STAGED[variant]
    assert token_gemv.stage_for(k, wbytes, tile, swiglu, 8) == stage
    if not stage:
        return
    assert token_gemv.stage_for(k, wbytes, tile, swiglu, 0) == 0
    constants = token_gemv.defines(k, wbytes, True, tile, swiglu, scale, False, True, pin=1, early=1, stage=stage)
    code = sass(constants, tmp_path)
    ops = [ins.split()[1] if ins.startswith("@") else ins.split()[0] for ins in code]
    (wait,) = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    rows = tile.rows_per_warp * (2 if swiglu else 1)
    first = "LDG.E.NA.128"  # plain loads, as with the norm (see above): ptxas sank read-only ones below the wait
    before = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "ATOM", "RED", "ST"))]
    assert sorted(before) == sorted([first] * (rows * tile.unroll) + ["LDGDEPBAR"]
                                    + ["LDGSTS.E.BYPASS.128"] * (stage * rows * tile.unroll)), before  # fmt: skip
    assert "MEMBAR.SC.CTA" in ops[wait - 2 : wait], "the fence holds the wait behind them"
    runs = k * wbytes // (32 * 16) // tile.unroll
    streamed = [op for op in ops[wait:] if op == WEIGHT_CHUNK]
    assert len(streamed) == rows * tile.unroll * (runs - 1 - stage), "the loop streams only the runs after them"
    assert "DEPBAR.LE" in ops[wait:], "and waits for its copies before it reads them"
    usage = _usage(tmp_path)
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
    regs, blocks = int(re.search(r"REG:(\d+)", usage).group(1)), constants["MIN_BLOCKS"]
    assert blocks == bound and regs * 32 * tile.warps * max(blocks, 1) <= 65536, (usage, blocks)


# e4m3 launches with the token staged as float32 (token_gemv.cu's XF32, token_gemv.X_F32): (K, tile, SwiGLU, X_F32,
# the blocks an SM must hold). Qwen3-8B's QKV/o and gate/up rows, unbounded and bounded.
XF32: dict[str, tuple[Any, ...]] = {
    "e4m3 o projection": (4096, TokenTile(8, 1, 4), False, 1, 0),
    "e4m3 o projection, bounded": (4096, TokenTile(8, 1, 4), False, 2, 5),
    "e4m3 swiglu": (4096, TokenTile(4, 2, 4), True, 1, 0),
    "e4m3, 8,192 columns, bounded": (8192, TokenTile(8, 1, 4), False, 2, 5),
}


@pytest.mark.parametrize("variant", list(XF32))
def test_float32_x_keeps_the_order_around_the_wait(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first weight chunks before the wait, the token's 16-bit values read after it with plain loads, and
    each chunk's x read from shared memory as four float4s (LDS.128), once for all of a warp's rows; no local memory,
    in the registers the bound asks for (a bounded SwiGLU tile spills 8 bytes, so it is not among these)."""
    k, tile, swiglu, mode, bound = XF32[variant]
    monkeypatch.setattr(token_gemv, "X_F32", mode)
    assert token_gemv.x_f32_for(k, 1, 0) == mode and token_gemv.x_f32_for(k, 2, 0) == 0
    constants = token_gemv.defines(k, 1, True, tile, swiglu, True, False, True, pin=1, early=1, xf32=mode)
    assert constants["XF32"] == 1 and constants["MIN_BLOCKS"] == bound
    code = sass(constants, tmp_path)
    (wait,) = [i for i, ins in enumerate(code) if ins.startswith("ACQBULK")]
    before = [ins for ins in code[:wait] if ins.startswith(("LDG", "LD.", "LDS", "ATOM", "RED"))]
    rows = tile.rows_per_warp * (2 if swiglu else 1)
    assert before == [ins for ins in before if ins.startswith(WEIGHT_CHUNK)] and len(before) == rows * tile.unroll
    chunks = k // (32 * 16)
    assert len([ins for ins in code[wait:] if ins.startswith("LDS.128")]) == 4 * chunks, "once for all the rows"
    assert not [ins for ins in code[wait:] if ins.startswith("LDG.E.128.CONSTANT")], "x by plain loads after the wait"
    usage = _usage(tmp_path)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    assert "LOCAL:0 " in usage and regs * 32 * tile.warps * max(bound, 1) <= 65536, usage
