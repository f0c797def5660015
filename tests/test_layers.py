"""The layers stack (docs/architecture.md, "Layers"): each package imports only the layers below it,
and no module imports, even lazily or for type checking only, a module that imports it back.

Imports are read from the source (every `import` and `from ... import` anywhere in a module,
under `TYPE_CHECKING` and inside functions too), so the test needs neither torch nor grpc.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each package may import from the project, lowest layer first. `wire.v1` is generated.
ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "planners": {"wire"},
    "executor": {"wire", "planners"},
    "agent": {"wire", "planners"},
    "core_service": {"wire", "planners", "executor", "agent"},
    "elaswave": {"wire", "planners", "executor", "agent", "core_service"},
    "simulator": {"wire", "planners"},
    "harness": {"wire", "planners", "executor", "agent", "core_service", "elaswave"},
    "bench": {"wire", "planners", "executor", "agent", "core_service", "elaswave", "harness", "examples"},
    "examples": {"elaswave"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" not in path.relative_to(ROOT / package).parts[:1]:
                found[_module_name(path)] = path
    return found


def _imported_names(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # `from pkg import submodule` depends on the submodule, not on the package's __init__
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
        return subs if len(subs) == len(node.names) else [node.module, *subs]
    return []


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for imported in _imported_names(node, modules):
                while imported and imported not in modules:  # a name inside a module: the module
                    imported = imported.rpartition(".")[0]
                # importing one's own package's __init__ is implicit in being its submodule
                if imported and imported != name and not name.startswith(imported + "."):
                    edges[name].add(imported)
        edges.setdefault(name, set())
    return edges


GRAPH = _graph()


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package: str) -> None:
    wrong = sorted(
        f"{module} imports {imported}"
        for module, targets in GRAPH.items()
        if module.split(".")[0] == package
        for imported in targets
        if imported.split(".")[0] not in ALLOWED[package] | {package}
    )
    assert not wrong, f"{package} reaches outside its layers {sorted(ALLOWED[package])}: {wrong}"


def test_module_import_graph_is_acyclic() -> None:
    try:
        tuple(TopologicalSorter(GRAPH).static_order())
    except CycleError as err:
        cycle = err.args[1]
        pytest.fail(f"import cycle: {' -> '.join(cycle)}")


def test_the_graph_is_read() -> None:
    # Guard against a parser that silently finds nothing: known edges must be there.
    assert "wire.worker_env" in GRAPH["wire.local_protocol"]
    assert any(t.startswith("planners.") for t in GRAPH["executor.trainer"])
