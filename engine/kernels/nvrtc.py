"""CUDA C++ kernels compiled at run time by NVRTC and launched through the driver API (ctypes), outside Triton.

NVRTC ships with PyTorch's CUDA wheels (``nvidia-cuda-nvrtc``), so no compiler or build step is needed: a kernel's
source is compiled once per process and architecture, to a cubin, on first use. Launches go on PyTorch's current
stream, so they are captured in CUDA graphs like any other kernel.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import torch


class NvrtcError(RuntimeError):
    pass


def _find_nvrtc() -> str:
    """The path of libnvrtc: the NVIDIA wheels PyTorch installs, else the system's."""
    names = []
    for base in sys.path:
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*", "torch/lib/libnvrtc*.so*"):
            names += [p for p in glob.glob(os.path.join(base, pattern)) if "builtins" not in p and ".alt." not in p]
    return sorted(names)[-1] if names else "libnvrtc.so"


@cache
def _nvrtc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL(_find_nvrtc())
    except OSError as e:
        raise NvrtcError(f"NVRTC, which compiles the engine's CUDA kernels, could not be loaded: {e}") from e


@cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check_driver(status: int, what: str) -> None:
    if status != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(status, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {status} ({(msg.value or b'?').decode()})")


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = (), fast_math: bool = True) -> bytes:
    """``source`` compiled by NVRTC for ``arch`` (``sm_90``), as a cubin; its ``#include "..."`` files are found
    beside this module."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if status != 0:
        raise NvrtcError(f"nvrtcCreateProgram failed ({status})")
    try:
        headers = f"--include-path={Path(__file__).parent}"  # the kernels' shared headers (*.cuh)
        math = ["--use_fast_math"] if fast_math else []
        opts = [f"--gpu-architecture={arch}", "-std=c++17", *math, headers, *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != 0:
            raise NvrtcError(f"{name} did not compile for {arch}:\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin) != 0:
            raise NvrtcError(f"{name}: NVRTC gave no cubin for {arch}")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Kernel:
    """One ``extern "C"`` kernel of a cubin, loaded into the current device's context."""

    def __init__(self, cubin: bytes, name: str) -> None:
        cu = _cuda()
        torch.cuda.init()  # type: ignore[no-untyped-call]
        ctx = ctypes.c_void_p()
        cu.cuCtxGetCurrent(ctypes.byref(ctx))
        if not ctx.value:  # a thread on which PyTorch has not yet touched the device: its primary context
            dev = ctypes.c_int()
            _check_driver(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
            _check_driver(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _check_driver(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._image = ctypes.create_string_buffer(cubin, len(cubin))
        self.module = ctypes.c_void_p()
        _check_driver(cu.cuModuleLoadData(ctypes.byref(self.module), self._image), f"loading {name}")
        self.func = ctypes.c_void_p()
        _check_driver(cu.cuModuleGetFunction(ctypes.byref(self.func), self.module, name.encode()), name)
        self.name = name

    def __call__(self, grid: tuple[int, int, int], block: int, args: Sequence[ctypes._CData],
                 pdl: bool = False) -> None:  # fmt: skip
        """Launch on PyTorch's current stream. ``pdl``: as a programmatic dependent launch (the kernel must wait
        with ``griddepcontrol.wait`` before reading what the kernel before it writes)."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        if not pdl:
            _check_driver(_cuda().cuLaunchKernel(
                self.func, grid[0], grid[1], grid[2], block, 1, 1, 0, stream, params, None,
            ), self.name)  # fmt: skip
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start)
        config = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, 0, stream, ctypes.pointer(attr), 1)
        _check_driver(_cuda().cuLaunchKernelEx(ctypes.byref(config), self.func, params, None), self.name)


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte union of values.
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig (CUDA 12+).
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]  # fmt: skip


def build(source: Path, kernel: str, device: int, defines: Mapping[str, object]) -> Kernel:
    """``kernel`` of the CUDA C++ file ``source``, compiled for ``device``'s architecture with ``-D`` ``defines``."""
    major, minor = torch.cuda.get_device_capability(device)
    cubin = compile_cubin(source.read_text(), source.name, f"sm_{major}{minor}",
                          [f"-D{k}={v}" for k, v in defines.items()])  # fmt: skip
    with torch.cuda.device(device):
        return Kernel(cubin, kernel)


@cache
def available() -> bool:
    """Whether NVRTC and the CUDA driver load (PyTorch's CUDA wheels bring NVRTC). If not, the CUDA C++ kernels'
    callers stay on Triton, with one warning. A kernel that then fails to compile is an error, not a fallback."""
    try:
        _nvrtc()
        _cuda()
    except (NvrtcError, OSError) as e:
        logging.getLogger(__name__).warning("the engine's CUDA C++ kernels are unavailable, Triton's run (%s)", e)
        return False
    return True


def use_cuda_kernel(variable: str, default: str = "cuda") -> bool:
    """A switch between a CUDA C++ kernel and the Triton one it replaces: ``cuda`` or ``triton`` (unset:
    ``default``)."""
    mode = os.environ.get(variable, default)
    if mode not in ("cuda", "triton"):
        raise ValueError(f"{variable} must be 'cuda' or 'triton', got {mode!r}")
    return mode == "cuda"


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
