"""The package's layers go one way: spec <- reference <- adapter <- proofs <- outrate (CLI).

A module may import its own layer and the layers below it, never one above. The check
reads every module's AST, so an import inside a function (the usual way to hide a cycle
from an import-time test) counts as much as one at the top of the file; relative imports
are resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parents[1]
# Bottom first. The folder holding the modules of a layer, and its import prefix.
LAYERS = ("spec", "reference", "adapter", "proofs", "outrate")
PACKAGE = "vllm_output_rate"


def layer_of_module(module: str) -> str | None:
    """The layer of an absolute module name of this project (None: not this project)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) > 1 and parts[1] in LAYERS[:-1]:
        return parts[1]
    return "outrate"  # vllm_output_rate itself and its top-level modules (cli, gate_plan, ...)


def imported_modules(path: Path, layer: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any depth of the AST."""
    package = PACKAGE if layer == "outrate" else f"{PACKAGE}.{layer}"
    if path.name != "__init__.py" and path.parent.name not in LAYERS:
        package += "." + ".".join(path.parent.relative_to(root / layer).parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == PACKAGE:  # from vllm_output_rate import gate_plan / spec / ...
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


def violations(root: Path = ROOT) -> list[str]:
    """Every import against the layers' direction, as ``file:line: layer -> layer (module)``."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            for line, module in imported_modules(path, layer, root):
                target = layer_of_module(module)
                if target is not None and rank[target] > rank[layer]:
                    bad.append(f"{path.relative_to(root)}:{line}: {layer} -> {target} ({module})")
    return bad


def test_no_import_against_the_layers() -> None:
    assert violations() == []


def test_detector_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """Positive control on a tree made for it: each kind of upward import is reported."""
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "adapter" / "up.py").write_text(
        "from vllm_output_rate.spec import rate\n"  # downward: fine
        "def f():\n    from vllm_output_rate.proofs import modelcheck\n"  # hidden in a function
        "    import vllm_output_rate.cli\n"
    )  # the top layer
    (tmp_path / "spec" / "rel.py").write_text("from ..reference import limiter\n")  # relative
    (tmp_path / "reference" / "root.py").write_text("from vllm_output_rate import tinymodel\n")
    assert violations(tmp_path) == [
        "spec/rel.py:1: spec -> reference (vllm_output_rate.reference)",
        "reference/root.py:1: reference -> outrate (vllm_output_rate.tinymodel)",
        "adapter/up.py:3: adapter -> proofs (vllm_output_rate.proofs)",
        "adapter/up.py:4: adapter -> outrate (vllm_output_rate.cli)",
    ]


def test_layer_of_module() -> None:
    assert layer_of_module("vllm_output_rate.spec.rate") == "spec"
    assert layer_of_module("vllm_output_rate.gate_plan") == "outrate"
    assert layer_of_module("vllm_output_rate") == "outrate"
    assert layer_of_module("vllm.v1") is None and layer_of_module("vllm_output_rate_x") is None
