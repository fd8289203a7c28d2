"""The layering rules of the kernel path, read from the sources (every import, also those inside functions):
kernels/ imports nothing of core/; the engine, the models and the attention backends reach the kernels only
through core/ops; and core/ops, core/quant and kernels/ import one another without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"deepinfer.core": "core", "deepinfer.kernels": "kernels"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [part for part in path.relative_to(REPO / folder).with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every deepinfer module or name `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepinfer"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("deepinfer"))
    return found


def test_kernels_import_nothing_of_core():
    for module, path in _modules().items():
        if module.startswith("deepinfer.kernels"):
            assert not [name for name in _imports(path) if name.startswith("deepinfer.core")], module


def test_engine_models_and_backends_reach_kernels_only_through_core_ops():
    for module, path in _modules().items():
        if module.startswith(("deepinfer.core.engine", "deepinfer.core.models", "deepinfer.core.attention")):
            assert not [name for name in _imports(path) if name.startswith("deepinfer.kernels")], module
            assert "_logged" not in path.read_text(), f"{module} reads dispatch's private state"


def test_ops_quant_and_kernels_import_without_a_cycle():
    modules = _modules()
    scope = {m: p for m, p in modules.items() if m.startswith(("deepinfer.core.ops", "deepinfer.core.quant",
                                                                "deepinfer.kernels"))}
    graph = {m: {name for name in _imports(path) if name in scope and name != m} for m, path in scope.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            assert state.get(target) != 1, "import cycle: " + " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
