"""Modules of the product: no import cycle, function-level imports only to defer heavy ones, sizes.

tests/test_layers.py checks that folders (layers) import one way; this checks modules. An
import inside a function counts as much as one at the top: hiding a cycle in a function is
still a cycle. A function-level import stays only where it defers a heavy import (vLLM,
torch, z3, ...), and says so in a ``deferred:`` comment on its line or the line above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_layers import LAYERS, PACKAGE, ROOT, imported_modules

pytestmark = pytest.mark.check


# A module of the product may be at most this long (lines); tests/ and gpu_tests/ are not counted.
MODULE_LIMIT = 600
# The comment a function-level import carries, on its line or the line above, saying what
# heavy import it defers (vLLM, torch, z3, ...). Anything else belongs at the top of the module.
DEFERRED = "deferred:"


def module_name(path: Path, layer: str, root: Path = ROOT) -> str:
    """The absolute module name of ``path``, a file of ``layer``'s folder under ``root``."""
    parts = list(path.relative_to(root / layer).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    base = [PACKAGE] if layer == "outrate" else [PACKAGE, layer]
    return ".".join(base + parts)


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> the project modules it imports`` at any depth of its AST.

    An import of a name from a package (``from vllm_output_rate.adapter import scenarios``)
    counts as an import of the longest module name it starts with.
    """
    files = {module_name(p, layer, root): (p, layer) for layer in LAYERS for p in sorted((root / layer).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, (path, layer) in files.items():
        for target in _import_targets(path, layer, root):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _import_targets(path: Path, layer: str, root: Path) -> list[str]:
    """Every name ``path`` imports, as ``module`` and, for ``from module import name``, also
    ``module.name`` (which is a module when ``name`` is a submodule)."""
    targets = []
    by_line: dict[int, str] = dict(imported_modules(path, layer, root))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = by_line[node.lineno] if node.level else (node.module or "")
            targets += [module] + [f"{module}.{a.name}" for a in node.names]
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def undeferred_imports(root: Path = ROOT) -> list[str]:
    """``file:line`` of every import inside a function without a ``deferred:`` comment."""
    bad = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            lines = path.read_text().splitlines()
            seen: set[int] = set()
            for node in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import | ast.ImportFrom) and sub.lineno not in seen:
                        seen.add(sub.lineno)
                        near = lines[sub.lineno - 1] + (lines[sub.lineno - 2] if sub.lineno > 1 else "")
                        if DEFERRED not in near:
                            bad.append(f"{path.relative_to(root)}:{sub.lineno}")
    return bad


def long_modules(root: Path = ROOT, limit: int = MODULE_LIMIT) -> dict[str, int]:
    """``file -> lines`` of every product module longer than ``limit`` lines."""
    found = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            count = len(path.read_text().splitlines())
            if count > limit:
                found[str(path.relative_to(root))] = count
    return found


def test_no_module_cycle() -> None:
    assert cycles(module_graph()) == []


def test_cycle_detector_sees_a_planted_cycle(tmp_path: Path) -> None:
    """Positive control: a three-module cycle through a function-level import is reported."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "adapter" / "a.py").write_text("from vllm_output_rate.adapter import b\n")
    (tmp_path / "adapter" / "b.py").write_text("from . import c\n")
    (tmp_path / "adapter" / "c.py").write_text("def f():\n    from vllm_output_rate.adapter.a import x\n")
    (tmp_path / "adapter" / "d.py").write_text("from vllm_output_rate.adapter import a\n")  # into it, not in it
    (tmp_path / "spec" / "e.py").write_text("from vllm_output_rate.spec import f\n")
    (tmp_path / "spec" / "f.py").write_text("import vllm_output_rate.spec.e\n")
    assert cycles(module_graph(tmp_path)) == [
        ["vllm_output_rate.adapter.a", "vllm_output_rate.adapter.b", "vllm_output_rate.adapter.c"],
        ["vllm_output_rate.spec.e", "vllm_output_rate.spec.f"],
    ]


def test_function_level_imports_only_defer_heavy_ones() -> None:
    assert undeferred_imports() == []


def test_undeferred_import_detector(tmp_path: Path) -> None:
    """Positive control: a function-level import without the comment is reported, one with it is not."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "adapter" / "m.py").write_text(
        "import json\n"
        "def f():\n    import os\n"
        "    # deferred: vLLM costs seconds to import\n    import vllm\n"
        "    import torch  # deferred: torch\n"
    )
    assert undeferred_imports(tmp_path) == ["adapter/m.py:3"]


def test_no_module_over_the_limit() -> None:
    assert long_modules() == {}
