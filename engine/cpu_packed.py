"""Linear layers over a few rows on the CPU, with their weights packed once.

A speculative verify row (the last token and its k drafts) is ``1 + k`` rows through every linear layer. One
row takes torch's GEMV path, which streams each weight once at about the core's memory bandwidth (float32
SmolLM2-135M: 0.5 GB, about 14 GB/s on one core of the Xeon this was measured on). More rows go to GEMM:

- torch's ``linear`` from 4 rows on calls MKL's GEMM, which repacks the whole weight on every call: a step
  whose weights do not fit in the cache reads them about twice (4 rows cost 2.2x one row, 9 rows 2.7x);
- a weight packed once by oneDNN reads it once, but its small-row kernels stream it at 60-70% of the GEMV's
  rate;
- ``engine/cpu_gemm.c`` (this module builds it with the C compiler on first use, AVX-512 or AVX2, one thread) keeps
  every row's accumulators in registers while the weight streams past once: 4 to 9 rows cost 1.1-1.2x one
  row, oneDNN's 1.6-1.7x (SmolLM2's linears, one thread, 2026-12-02; ``python -m bench.engine.cpu_linears``).

``PackedCpuOps`` packs every float32 ``nn.Linear`` once at start: for that kernel when the engine runs torch on one
thread and the CPU has AVX-512 or AVX2 and a C compiler builds it (rows 2 .. ``MAX_NATIVE_ROWS``; more rows, a prefill
chunk, go to torch's GEMM, whose repacking is small beside so many rows), else for oneDNN (rows from
``MIN_PACKED_ROWS``; oneDNN uses the threads torch has). One row keeps torch's GEMV either way, so a
speculating engine's plain steps compute what a plain engine's do. The packed copy doubles the memory of the
linear weights (about 0.5 GB for SmolLM2 in float32), which is why plain engines do not make it. Results equal
torch's ``linear`` up to float rounding (another summation order, as between its GEMV and GEMM paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.kernels.ops import TorchOps

log = logging.getLogger(__name__)

# oneDNN: from this many rows on, a packed weight is faster than torch's linear (GEMM with repacking).
MIN_PACKED_ROWS = 4
# The native kernel: rows 2 .. this; beyond, a prefill chunk's worth of rows, torch's GEMM.
MAX_NATIVE_ROWS = 32
_SOURCE = Path(__file__).with_name("cpu_gemm.c")
_FLAGS = ("-O3", "-shared", "-fPIC")
# The vector instructions the kernel is built for, as torch sees the CPU (its best: AVX-512 where both are there).
_ISA_FLAGS = {"AVX512": ("-mavx512f", "-mfma"), "AVX2": ("-mavx2", "-mfma")}


def can_pack(module: nn.Module) -> bool:
    """Whether ``module`` can be packed: a plain float32 ``nn.Linear`` on the CPU (not a subclass, FP8 or
    tensor-parallel, with its own forward)."""
    return type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32


class CpuGemm:
    """``engine/cpu_gemm.c`` built and loaded: packs a weight into its panels and multiplies rows by it."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))  # ctypes releases the GIL for the call
        ptr, n = ctypes.c_void_p, ctypes.c_long
        lib.atomesh_pack.argtypes = [ptr, ptr, n, n]
        lib.atomesh_pack.restype = None
        lib.atomesh_gemm.argtypes = [ptr, ptr, ptr, ptr, n, n, n]
        lib.atomesh_gemm.restype = None
        lib.atomesh_panel_width.restype = n
        self._lib = lib
        self.panel = int(lib.atomesh_panel_width())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` (float32) in the kernel's panels: ``ceil(N / panel) * K * panel`` floats."""
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // self.panel) * k * self.panel, dtype=torch.float32)
        self._lib.atomesh_pack(w.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def linear(self, packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """``x [M, K] @ weight.T (+ bias)`` from the packed weight (``n``: the weight's rows)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        b = None if bias is None else bias.detach().contiguous()  # held: the kernel reads it
        self._lib.atomesh_gemm(packed.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
                               x.shape[0], n, x.shape[1])  # fmt: skip
        return out


@dataclass(frozen=True, slots=True)
class GemmBuild:
    """The native kernel, or why this process cannot have it."""

    gemm: CpuGemm | None
    why_not: str = ""


def build_cpu_gemm(cache_dir: Path | None = None) -> GemmBuild:
    """Compile ``engine/cpu_gemm.c`` (once per source and compiler; kept under ``cache_dir``, by default
    ``$XDG_CACHE_HOME/atomesh`` or ``~/.cache/atomesh``) and load it. Needs AVX-512 or AVX2 with FMA (as torch
    sees the CPU) and a C compiler (``$CC``, else ``cc``)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _ISA_FLAGS:
        return GemmBuild(None, f"the CPU's vector capability is {capability}, the kernel needs AVX512 or AVX2")
    flags = (*_FLAGS, *_ISA_FLAGS[capability])
    compiler = os.environ.get("CC") or shutil.which("cc")
    if not compiler:
        return GemmBuild(None, "no C compiler (set CC or install cc)")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    folder = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atomesh"
    library = folder / f"cpu_gemm-{digest}.so"
    if not library.exists():
        try:
            library.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        except OSError as e:
            return GemmBuild(None, f"cannot write the kernel's library under {library.parent}: {e}")
        os.close(fd)
        try:
            try:
                done = subprocess.run([compiler, *flags, "-o", tmp, str(_SOURCE)], capture_output=True, text=True,
                                      timeout=120, check=False)  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as e:
                return GemmBuild(None, f"{compiler} did not run: {e}")
            if done.returncode != 0:
                return GemmBuild(None, f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, library)  # atomic: engines starting together share one build
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return GemmBuild(CpuGemm(library))


class PackedCpuOps(TorchOps):
    """The torch reference ops, but linears over several rows use weights packed once: for ``engine/cpu_gemm.c``
    when ``gemm`` is given (rows 2 .. ``MAX_NATIVE_ROWS``), else for oneDNN (from ``MIN_PACKED_ROWS`` rows)."""

    def __init__(self, model: nn.Module, gemm: CpuGemm | None = None) -> None:
        self.gemm = gemm
        self._packed: dict[int, torch.Tensor] = {}
        if gemm is None and not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return  # a torch without oneDNN: every linear stays torch's
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, nn.Linear) or not can_pack(module) or id(module) in self._packed:
                    continue
                weight = module.weight.detach()
                if gemm is not None:
                    self._packed[id(module)] = gemm.pack(weight)
                else:  # the row-count hint picks the layout; one packed for 4 rows serves every count measured
                    self._packed[id(module)] = torch.ops.mkldnn._reorder_linear_weight(weight, MIN_PACKED_ROWS)

    @property
    def num_packed(self) -> int:
        """How many linear layers have a packed weight."""
        return len(self._packed)

    @property
    def kind(self) -> str:
        """Which packing: ``native`` (engine/cpu_gemm.c) or ``onednn``."""
        return "native" if self.gemm is not None else "onednn"

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(id(layer))
        if (packed is None or not isinstance(layer, nn.Linear) or x.dim() != 2 or x.dtype != torch.float32
                or x.shape[1] != layer.in_features):  # fmt: skip
            return layer(x)  # type: ignore[no-any-return]  # (and torch's error for a wrong width)
        rows = x.shape[0]
        if self.gemm is not None and 2 <= rows <= MAX_NATIVE_ROWS:
            return self.gemm.linear(packed, x, layer.bias, layer.out_features)
        if self.gemm is None and rows >= MIN_PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")  # type: ignore[no-any-return]
        return layer(x)  # type: ignore[no-any-return]

    def swiglu_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(self.linear(layer, x))
