"""Docstrings and comments cite what the repository holds.

* No module of the package, the tests or the live tests cites ``semantics.md`` or "the
  seed article": neither is in the repository; docs/SPEC.md is the reference.
* ``spec/__init__.py``'s module table names the invariants ``spec/invariants.py`` defines
  (``I1-In``, n the highest ``iN_*`` function).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("spec", "reference", "adapter", "proofs", "outrate", "tests", "gpu_tests")
# An independent implementation, never edited to suit this project.
EXCLUDED = ROOT / "tests" / "fixtures" / "article_style"
NOT_IN_THE_REPOSITORY = re.compile(r"semantics\.md|seed article", re.IGNORECASE)


def _sources() -> list[Path]:
    return [
        p
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*.py"))
        if EXCLUDED not in p.parents and p != Path(__file__).resolve()
    ]


def test_no_citation_of_documents_outside_the_repository() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in _sources()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if NOT_IN_THE_REPOSITORY.search(line)
    ]
    assert not found, "cite docs/SPEC.md instead:\n" + "\n".join(found)


def test_the_citation_check_sees_a_stale_source_line() -> None:
    assert NOT_IN_THE_REPOSITORY.search('Source: semantics.md "Configuration"; seed article, start-up flags.')
    assert not NOT_IN_THE_REPOSITORY.search('Source: docs/SPEC.md "Configuration".')


def test_spec_package_names_the_current_invariant_range() -> None:
    tree = ast.parse((ROOT / "spec" / "invariants.py").read_text())
    numbers = [
        int(m.group(1))
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        if (m := re.fullmatch(r"i(\d+)_\w+", node.name))
    ]
    assert numbers, "no iN_* function in spec/invariants.py"
    highest = max(numbers)
    assert sorted(set(numbers)) == list(range(1, highest + 1)), sorted(set(numbers))
    docstring = ast.get_docstring(ast.parse((ROOT / "spec" / "__init__.py").read_text())) or ""
    assert f"I1-I{highest}," in docstring, f"spec/__init__.py should say I1-I{highest}"
