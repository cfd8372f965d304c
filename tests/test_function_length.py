"""No function of the package is longer than 70 lines, outside a short documented allowlist.

A function's length is counted from its ``def`` line to its last line (decorators not
counted; nested functions count toward the function that holds them and on their own).
The allowlist names each exception and why it stays; an entry that no longer exists or
is no longer over the limit fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("spec", "reference", "adapter", "proofs", "outrate")
LIMIT = 70

# "folder/module.py::function" -> why it is longer (kept as short as possible).
ALLOWED: dict[str, str] = {}


def long_functions(root: Path = ROOT, folders: tuple[str, ...] = FOLDERS, limit: int = LIMIT) -> dict[str, int]:
    """``"folder/module.py::name" -> lines`` of every function longer than ``limit`` lines."""
    found: dict[str, int] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        found[f"{path.relative_to(root).as_posix()}::{node.name}"] = lines
    return found


def test_no_function_over_the_limit_outside_the_allowlist() -> None:
    over = {name: n for name, n in long_functions().items() if name not in ALLOWED}
    assert not over, f"functions over {LIMIT} lines (split them into named helpers): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(over.items(), key=lambda kv: -kv[1])
    )


def test_the_allowlist_holds_only_functions_still_over_the_limit() -> None:
    found = long_functions()
    stale = sorted(name for name in ALLOWED if name not in found)
    assert not stale, f"no longer over {LIMIT} lines (or gone): remove from ALLOWED: {stale}"


def test_the_count_sees_a_long_nested_function(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def outer():\n    def inner():\n{body}\n    return inner\n\ndef short():\n    return 1\n"
    )
    found = long_functions(tmp_path, ("pkg",))
    assert found == {"pkg/m.py::outer": LIMIT + 3, "pkg/m.py::inner": LIMIT + 1}
