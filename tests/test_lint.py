"""``make test`` runs ruff (the rule set of pyproject.toml) before pytest, and it passes.

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


def test_the_tree_passes_ruff() -> None:
    run = subprocess.run(RUFF + ["spec", "reference", "adapter", "proofs", "outrate", "tests", "gpu_tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]


def test_ruff_reports_an_unused_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    run = subprocess.run(RUFF + [str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "F401" in run.stdout


def test_make_test_runs_ruff_before_pytest() -> None:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = dry.splitlines()
    ruff = next(i for i, line in enumerate(lines) if "-m ruff check" in line)
    first_pytest = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert ruff < first_pytest
