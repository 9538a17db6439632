"""C sources atomesh compiles on first use (the OTLP encoder, the stream relay, the trace recorder) and keeps built.

A library is named by its source and flags (and whatever else the caller says it depends on, such as the
interpreter), not by the compiler: a build made beforehand (an image's build stage) serves a machine
without one. It is kept under `$XDG_CACHE_HOME/atomesh` (else `~/.cache/atomesh`); the compiler is `$CC`,
else `cc`. Engines build their own kernels the same way (`engine/cpu_packed.py`); the two programs share
no code.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any


def cache_folder(cache_dir: Path | None = None) -> Path:
    return cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atomesh"


def build_library(source: Path, flags: tuple[str, ...], *, suffix: str = ".so", key: str = "",
                  include: tuple[str, ...] = (), cache_dir: Path | None = None,
                  what: str = "library") -> tuple[Path | None, str]:  # fmt: skip
    """`source` compiled with `flags` (once; later calls find it built), or None and why not. `key`: what else
    the build depends on (in its name); `include`: where the compiler looks for headers (not in its name)."""
    try:
        text = source.read_bytes()
    except OSError as e:
        return None, f"cannot read {source}: {e}"
    digest = hashlib.sha256(text + " ".join((*flags, key)).encode()).hexdigest()[:16]
    folder = cache_folder(cache_dir)
    library = folder / f"{source.stem}-{digest}{suffix}"
    if library.exists():
        return library, ""
    compiler = os.environ.get("CC") or shutil.which("cc")
    if not compiler:
        return None, "no C compiler (set CC or install cc)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=folder)
    except OSError as e:
        return None, f"cannot write the {what} under {folder}: {e}"
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *flags, *include, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=120, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{compiler} did not run: {e}"
        if done.returncode != 0:
            return None, f"{compiler} failed: {done.stderr.strip()[-500:]}"
        os.replace(tmp, library)  # atomic: processes starting together share one build
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library, ""


def build_extension(source: Path, name: str, flags: tuple[str, ...], *, what: str,
                    cache_dir: Path | None = None) -> tuple[Any, str]:  # fmt: skip
    """`source`, a CPython extension module called `name`, compiled with `flags` (once per source, flags and
    interpreter, by `build_library`) and imported; or None and why not. Needs Linux and, to build it, a C
    compiler and the interpreter's headers."""
    if not sys.platform.startswith("linux"):
        return None, f"the {what} is built for Linux only (this is {sys.platform})"
    include = sysconfig.get_paths().get("include", "")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # Named by source, flags and interpreter, not compiler: a build made beforehand (an image's build
    # stage) serves a machine without one.
    library, why_not = build_library(source, flags, suffix=suffix, key=sys.version, cache_dir=cache_dir,
                                     include=(f"-I{include}",) if include else (), what=what)  # fmt: skip
    if library is None:
        if not include or not Path(include, "Python.h").exists():
            why_not = f"no Python.h under {include!r} (install the interpreter's headers); {why_not}"
        return None, why_not
    spec = importlib.util.spec_from_file_location(
        name, library, loader=importlib.machinery.ExtensionFileLoader(name, str(library))
    )
    if spec is None or spec.loader is None:
        return None, f"cannot load {library}"
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        return None, f"cannot load {library}: {e}"
    return module, ""
