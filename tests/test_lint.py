"""``make test`` and ``make check`` run ruff (lint and format check) and mypy (the settings of
pyproject.toml) once, before pytest; any finding stops them. The tree-wide runs live in the
Makefile only (they are not repeated from pytest); the tests here check that the Makefile
runs them first, and that each tool does report a planted finding.

The checks that stop ``make test`` on a drifted design are pytest tests of their own:
``tests/test_layers.py`` (imports against the layers), ``tests/test_traceability.py``
(a hand-edited traceability row), ``tests/test_dependencies.py`` (an undeclared import).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml")]
RUFF_FORMAT = [
    sys.executable,
    "-m",
    "ruff",
    "format",
    "--check",
    "--no-cache",
    "--config",
    str(ROOT / "pyproject.toml"),
]
MYPY = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental"]
LAYERS = ("outrate", "spec", "reference", "adapter", "proofs")


@pytest.mark.parametrize(
    ("source", "code"),
    [("import os\n", "F401"), ("def f(items=[]):\n    return items\n", "B006")],
    ids=["unused-import", "bugbear-mutable-default"],
)
def test_ruff_reports_a_finding(tmp_path: Path, source: str, code: str) -> None:
    """An unused import (F401) fails the check, and so does a finding of the stricter
    families: a mutable default argument (B006)."""
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    run = subprocess.run(RUFF + [str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and code in run.stdout


def test_make_test_runs_ruff_before_pytest() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = dry.splitlines()
    ruff = next(i for i, line in enumerate(lines) if "-m ruff check" in line)
    first_pytest = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert ruff < first_pytest


def _make_dry_run(*args: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(
        ["make", "-n", "test", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout.splitlines()


@pytest.mark.parametrize("vllm", ["0.32.0", "0.33.0", "0.34.0"])
def test_make_test_runs_ruff_the_format_check_and_mypy_before_pytest(vllm: str) -> None:
    lines = _make_dry_run(f"VLLM={vllm}")
    order = [
        next(i for i, line in enumerate(lines) if command in line)
        for command in ("-m ruff check", "-m ruff format --check", "-m vllm_output_rate.typecheck", "-m pytest")
    ]
    assert order == sorted(order), lines
    # mypy and ruff once per lane: pytest does not run them again (the tree-wide runs left tests/)
    assert sum("-m vllm_output_rate.typecheck" in line for line in lines) == 1, lines
    pytest_line = next(line for line in lines if "-m pytest" in line)
    if vllm == "0.32.0":
        assert '-m "not soak"' in pytest_line and "OUTRATE_PER_RELEASE_CHECK=1" in pytest_line, pytest_line
    else:
        assert '-m "per_release and not slow and not live and not soak"' in pytest_line, pytest_line


def test_make_check_is_static_then_the_check_lane_then_the_quick_gate() -> None:
    """``make check``: ruff, the format check and mypy once, then ``pytest -m check``, then the
    gate's quick profile on the reference scheduler."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    lines = subprocess.run(["make", "-n", "check"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = lines.splitlines()
    order = [
        next(i for i, line in enumerate(lines) if command in line)
        for command in (
            "-m ruff check",
            "-m ruff format --check",
            "-m vllm_output_rate.typecheck",
            "-m pytest -q -m check",
        )
    ]
    assert order == sorted(order), lines
    gate = next(i for i, line in enumerate(lines) if "outrate conform" in line)
    assert gate > order[-1] and "--profile quick" in lines[gate], lines


def _fake_repository(root: Path, files: dict[str, str]) -> None:
    """The five package folders under ``root`` (empty ``__init__.py``), plus ``files``."""
    for folder in LAYERS:
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)


UNTYPED = "def double(x):\n    return 2 * x\n"


def test_mypy_is_strict_on_spec_and_normal_elsewhere(tmp_path: Path) -> None:
    """The same unannotated function fails in spec/ (strict) and passes in adapter/ (normal);
    a wrong type fails anywhere. The error lines name the repository's paths."""
    from vllm_output_rate import typecheck

    _fake_repository(
        tmp_path,
        {"spec/untyped.py": UNTYPED, "adapter/untyped.py": UNTYPED, "proofs/wrong.py": "count: int = 'three'\n"},
    )
    tree = typecheck.build_tree(tmp_path, tmp_path / ".mypy_cache" / "tree")
    run = subprocess.run(MYPY + [str(tree)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = [
        typecheck.to_repository(line, tmp_path, tmp_path / ".mypy_cache" / "tree") for line in run.stdout.splitlines()
    ]
    assert run.returncode == 1, run.stdout
    errors = [line for line in lines if ": error:" in line]
    assert any(line.startswith("spec/untyped.py:1:") and "[no-untyped-def]" in line for line in errors), lines
    assert any(line.startswith("proofs/wrong.py:1:") and "[assignment]" in line for line in errors), lines
    assert not any(line.startswith("adapter/") for line in errors), lines


def test_typecheck_maps_paths_both_ways(tmp_path: Path) -> None:
    from vllm_output_rate import typecheck

    tree = tmp_path / "t"
    assert typecheck.to_tree(str(ROOT / "spec" / "limiter.py"), ROOT, tree) == str(
        tree / "vllm_output_rate" / "spec" / "limiter.py"
    )
    assert typecheck.to_tree(str(ROOT / "outrate" / "cli.py"), ROOT, tree) == str(tree / "vllm_output_rate" / "cli.py")
    assert (
        typecheck.to_repository(f"{tree}/vllm_output_rate/cli.py:3: error: x", ROOT, tree)
        == "outrate/cli.py:3: error: x"
    )
    assert (
        typecheck.to_repository(f"{tree}/vllm_output_rate/spec/a.py:1: note: y", ROOT, tree) == "spec/a.py:1: note: y"
    )
    with pytest.raises(SystemExit, match="docs"):
        typecheck.to_tree(str(ROOT / "docs"), ROOT, tree)


def test_the_format_check_fails_on_an_unformatted_file(tmp_path: Path) -> None:
    """Single quotes and a cramped dict: the check names the file and fails; formatted, it passes."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = {  'a':1 }\n")
    run = subprocess.run(RUFF_FORMAT + [str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "bad.py" in run.stdout + run.stderr, run.stdout + run.stderr
    bad.write_text('x = {"a": 1}\n')
    assert subprocess.run(RUFF_FORMAT + [str(bad)], capture_output=True, text=True, timeout=60).returncode == 0


def test_the_format_check_leaves_the_article_style_fixture_alone() -> None:
    """tests/fixtures/article_style/ is an independent implementation: never reformatted."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--diff", "--no-cache", "tests/fixtures"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "article_style" not in run.stdout + run.stderr, run.stdout[-2000:]


def split_into_characters(text: str, run: int = 20) -> list[int]:
    """1-based first lines of every run of ``run`` or more lines holding at most one
    character each: a text written one character per line (a string joined as if it were
    a list of lines) instead of as itself."""
    found, count = [], 0
    for number, line in enumerate(text.split("\n"), start=1):
        count = count + 1 if len(line.strip()) <= 1 else 0
        if count == run:
            found.append(number - run + 1)
    return found


@pytest.mark.check
def test_docs_are_not_written_one_character_per_line():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert {str(p.relative_to(ROOT)): lines for p in pages if (lines := split_into_characters(p.read_text()))} == {}


@pytest.mark.check
def test_one_character_per_line_detector():
    table = "| a | 1 |\n| b | 2 |\n"
    assert split_into_characters("intro\n" + table + "\nend\n") == []
    assert split_into_characters("intro\n" + "\n".join(table) + "\nend\n") == [2]
