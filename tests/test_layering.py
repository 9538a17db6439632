"""The import rule of docs/design.md, enforced: no import cycle among the modules of `atomesh` or `engine`;
`atomesh`'s modules import only from their own layer or the layers below (`LAYERS`, the picture in
docs/design.md); `engine` and `atomesh` never import each other; nothing imports `atomesh.app` but
`atomesh.cli`; the benchmarks (`bench`) import the runtime packages, which neither hold nor import a benchmark.

The graph is read from the source with `ast`, so it sees every import statement wherever it is, inside
functions too: an import deferred into a function body is still a dependency (it merely runs later),
and deferring one is how a cycle hides. Imports under `if TYPE_CHECKING:` are left out: they never
run, and they are how a module names a type of a module above it without depending on it.
An import of a package's own `__init__` from one of its submodules is not an edge (the package is
being imported already); a package `__init__` that imports its submodules is.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("atomesh", "engine")
BENCHMARKS = "bench"

# The gateway's layers, bottom first (docs/design.md draws them). A module belongs to the layer of the
# longest name below that is the module itself or a package holding it; the root package, "atomesh",
# names only its own `__init__` (it is no catch-all: a module no name below covers has no layer, and
# test_every_gateway_module_has_a_layer fails).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocabulary", ("atomesh", "atomesh.errors", "atomesh.native", "atomesh.request", "atomesh.tasks")),
    ("settings", ("atomesh.config", "atomesh.compat", "atomesh.cors", "atomesh.tenancy")),
    (
        "observability",
        (
            "atomesh.logs",
            "atomesh.metrics",
            "atomesh.tracing",
            "atomesh.otlp",
            "atomesh.otlp_native",
            "atomesh.otlp_sender",
        ),
    ),
    ("transport", ("atomesh.flow", "atomesh.httpclient", "atomesh.splice", "atomesh.transport")),
    ("workers", ("atomesh.workers",)),
    ("kv", ("atomesh.kv",)),
    ("placement", ("atomesh.policies", "atomesh.placement")),
    ("routing", ("atomesh.backends", "atomesh.router", "atomesh.migration")),
    ("request checks", ("atomesh.validation", "atomesh.auth", "atomesh.admission")),
    ("composition", ("atomesh.gateway",)),
    ("http", ("atomesh.api", "atomesh.frontdoor", "atomesh.service")),
    ("processes", ("atomesh.cluster",)),
    ("entry points", ("atomesh.app", "atomesh.cli", "atomesh.__main__", "atomesh.up")),
    ("test doubles", ("atomesh.testing",)),
)
ROOT_PACKAGES = frozenset(PACKAGES)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks (their `else` branches do run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (at run time, anywhere in its file)."""
    files = {module_name(f, root): f for pkg in packages for f in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    up = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import name` imports pkg, and pkg.name when that is a module.
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


@functools.cache
def repo_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """`import_graph` of this checkout's `packages`, parsed once for all the tests here (its source does not change
    while they run; the tests that write modules of their own call `import_graph`)."""
    return import_graph(packages)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    found = cycles(repo_graph((*PACKAGES, BENCHMARKS)))
    assert not found, "import cycles (straighten the layering, see docs/design.md):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_cycles_count_deferred_imports_but_not_type_checking_ones(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p import b\n")
    (pkg / "b.py").write_text("def f():\n    from p.c import x\n")  # deferred: still an edge
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import p.a\n")  # depends on the cycle, is not part of it
    assert cycles(import_graph(("p",), tmp_path)) == [["p.a", "p.b", "p.c"]]
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert cycles(import_graph(("p",), tmp_path)) == []


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s layer; -1 when it has none."""
    best, level = "", -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            holds = name not in ROOT_PACKAGES and module.startswith(name + ".")
            if (module == name or holds) and len(name) > len(best):
                best, level = name, i
    return level


def test_a_module_outside_every_layer_has_none() -> None:
    """The check below can fail: the root package covers only itself."""
    assert layer_of("atomesh.somewhere_new") == -1 and layer_of("atomesh.kv.anything") >= 0
    assert layer_of("atomesh") == 0


def test_every_gateway_module_has_a_layer() -> None:
    unplaced = sorted(m for m in repo_graph(("atomesh",)) if layer_of(m) < 0)
    assert not unplaced, f"add these modules to LAYERS (and the picture in docs/design.md): {unplaced}"


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in repo_graph(("atomesh",)).items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )
    assert not upward, "imports from a higher layer (see docs/design.md):\n" + "\n".join(upward)


def test_engine_and_gateway_never_import_each_other() -> None:
    graph = repo_graph()
    crossing = sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if m.split(".")[0] != t.split(".")[0]
    )
    assert not crossing, crossing


def test_only_the_cli_imports_the_app() -> None:
    graph = repo_graph()
    importers = sorted(m for m, targets in graph.items() if "atomesh.app" in targets)
    assert importers == ["atomesh.cli"]


def test_nothing_outside_the_policies_asks_which_policy_it_holds() -> None:
    """A policy declares what it needs (`Policy.needs`, `attach`, `replicas`, `export`, `elsewhere`); the
    gateway, the cluster and everything else wire it through those, never by testing its class."""
    folder = ROOT / "atomesh" / "policies"
    classes = {
        node.name
        for f in folder.glob("*.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    found = []
    for path in sorted((ROOT / "atomesh").rglob("*.py")):
        if folder in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | {
                    n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)
                }
                if names & classes:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert classes and not found, "\n".join(found)


def benchmark_code_in_runtime(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """What of the runtime `packages` is benchmark code or reaches for it: a module named bench* (the
    benchmarks live in the top-level `bench` package), an import of `bench`, or a `bench` module loaded by
    name (`importlib.import_module("bench....")`, `__import__`)."""
    found = []
    graph = repo_graph((*packages, BENCHMARKS)) if root == ROOT else import_graph((*packages, BENCHMARKS), root)
    for mod, targets in sorted(graph.items()):
        if mod.split(".")[0] not in packages:
            continue
        found += [f"{mod} is a benchmark" for part in mod.split(".")[1:] if part.startswith("bench")]
        found += [f"{mod} imports {t}" for t in sorted(targets) if t.split(".")[0] == BENCHMARKS]
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                    continue
                name, arg = ast.unparse(node.func), node.args[0].value
                if name.endswith(("import_module", "__import__")) and isinstance(arg, str):
                    if arg == BENCHMARKS or arg.startswith(BENCHMARKS + "."):
                        found.append(f"{module_name(path, root)} loads {arg}")
    return found


def test_the_runtime_packages_hold_and_import_no_benchmark() -> None:
    found = benchmark_code_in_runtime()
    assert not found, "benchmarks go under bench/ and import the runtime, never the other way:\n" + "\n".join(found)


def test_benchmark_code_in_a_runtime_package_is_found(tmp_path: Path) -> None:
    """The check above can fail: each way a runtime package can hold or reach a benchmark is caught."""
    for folder in ("rt", "bench", "bench/gateway"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "bench" / "gateway" / "serving.py").write_text("import rt.core\n")
    (tmp_path / "rt" / "core.py").write_text("")
    assert benchmark_code_in_runtime(tmp_path, ("rt",)) == []
    (tmp_path / "rt" / "bench_speed.py").write_text("")
    (tmp_path / "rt" / "cli.py").write_text("def f():\n    from bench.gateway import serving\n")
    (tmp_path / "rt" / "up.py").write_text("import importlib\nimportlib.import_module('bench.gateway.serving')\n")
    assert benchmark_code_in_runtime(tmp_path, ("rt",)) == [
        "rt.bench_speed is a benchmark",
        "rt.cli imports bench.gateway",
        "rt.cli imports bench.gateway.serving",
        "rt.up loads bench.gateway.serving",
    ]
