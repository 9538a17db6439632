"""Triton's interpreter (``TRITON_INTERPRET=1``, the kernels on CPU in these tests) without two of its redundant costs.

Before a kernel's programs run, the interpreter patches ``triton.language`` (every builtin, the tensor class, the
math module) with interpreted versions, and restores it after the grid. It patches again at every call of a
``@triton.jit`` helper inside a program (``enter``, ``_rope``, ``tl.zeros``...): once per helper, per program, per
launch. With the modules already patched that second pass changes nothing (a patched builtin is no longer a builtin,
so it is skipped, and the rest is set to equivalent values), but it walks the modules' members each time. Here a
helper's patch, while its launch's patch is in place, is skipped when every ``triton.language`` module the helper
sees is patched already; a launch's own patch, and a module not patched yet, are done as before. And the numpy dtype
of each op's operands and result, looked up in a table the interpreter builds anew at every call, is remembered per
scalar type. The kernels run exactly as they did: test_kernels, test_async_scheduling and test_spec_decode_kernels
took 204 s instead of 304 s on the 2-core development machine (2026-12-03).

Only under ``TRITON_INTERPRET=1`` (set before Triton is imported: its own ``@triton.jit`` helpers are interpreted
only then), and only for the Triton these tests pin (``triton==3.6.0`` in pyproject.toml); with another, the
interpreter is left as it is."""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any


def speed_up() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    if not triton.__version__.startswith("3.6.") or getattr(interpreter, "_atomesh_skips_repatching", False):
        return
    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    langs_of: dict[Any, list[Any]] = {}
    grid = threading.local()  # this thread's launch: running (its patch in place), or its own patch still to come

    class Unchanged:
        def restore(self) -> None:
            pass

    def langs(fn: Any) -> list[Any]:
        if fn not in langs_of:
            langs_of[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        return langs_of[fn]

    def patched(lang: Any) -> bool:
        # The interpreter replaces each builtin (tl.load among them) by a wrapper that is no builtin.
        return not tl.core.is_builtin(lang.load)

    def patch_once(fn: Any) -> Any:
        if getattr(grid, "patch_to_come", False):  # the launch's own patch (restored after its grid): as before
            grid.patch_to_come = False
            return patch_lang(fn)
        if getattr(grid, "running", False) and langs(fn) and all(patched(lang) for lang in langs(fn)):
            return Unchanged()  # a helper called by a program, every module it sees patched
        return patch_lang(fn)

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(grid, "running", False)
        grid.running, grid.patch_to_come = True, True
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            grid.running, grid.patch_to_come = outer, False

    # A value's numpy dtype, looked up for every op's operands and result in a table the interpreter builds anew at
    # each call: that of its scalar type (a block's is its element's), remembered per scalar type instead. Pointers,
    # and blocks of them, are looked up as before.
    np_dtype, np_dtypes = interpreter._get_np_dtype, {}

    def np_dtype_once(tt_dtype: Any) -> Any:
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if type(scalar) is not tl.dtype:
            return np_dtype(tt_dtype)
        if scalar not in np_dtypes:
            np_dtypes[scalar] = np_dtype(scalar)
        return np_dtypes[scalar]

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    interpreter._get_np_dtype = np_dtype_once
    interpreter._atomesh_skips_repatching = True
