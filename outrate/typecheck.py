"""Run mypy over the package with the settings of pyproject.toml (``make test``, before pytest).

mypy finds modules by their place on disk, and the package ``vllm_output_rate`` is
assembled from five top-level folders (pyproject.toml, ``[tool.setuptools] package-dir``:
``outrate/`` is ``vllm_output_rate``, ``spec/`` is ``vllm_output_rate.spec``, ...), which the
editable install maps by an import hook that mypy does not run. So this module lays the
package out as one tree of symbolic links (``.mypy_cache/tree/vllm_output_rate``, a fixed
place so that mypy's incremental cache stays valid), runs ``python -m mypy`` on it, and
prints mypy's report with every path turned back into the repository's own
(``spec/limiter.py:12: error: ...``).

``python -m vllm_output_rate.typecheck [paths...]``: exit status is mypy's (0: no error,
1: errors found, 2: mypy could not run). With no path the whole package is checked; a path
names one file or folder of the repository (``spec``, ``reference/limiter.py``).

Raises ``SystemExit`` with a message naming the folder when the repository layout differs
from the mapping below (a folder renamed or moved).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_output_rate"
# Repository folder -> its place in the package (mirrors pyproject.toml's package-dir).
FOLDERS = {"outrate": "", "spec": "spec", "reference": "reference", "adapter": "adapter", "proofs": "proofs"}
TREE = ROOT / ".mypy_cache" / "tree"


def _link(target: Path, link: Path) -> None:
    """Make ``link`` a symbolic link to ``target``, replacing a stale one."""
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def build_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Lay the package out under ``tree`` as links into ``root``; return the package folder.

    ``outrate/``'s own files and subfolders are linked one by one into the package folder
    (it is the package itself); ``spec/`` and the other layers are linked as whole folders.
    Entries of earlier runs that no longer exist in the repository are removed.
    """
    package = tree / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, Path] = {}
    for folder, place in FOLDERS.items():
        source = root / folder
        if not (source / "__init__.py").is_file():
            raise SystemExit(f"typecheck: {source} is not a package folder; update FOLDERS in {__file__}")
        if place:
            wanted[place] = source
    for entry in sorted((root / "outrate").iterdir()):
        if entry.name == "__pycache__" or entry.name in wanted:
            continue
        if entry.suffix == ".py" or (entry.is_dir() and (entry / "__init__.py").is_file()):
            wanted[entry.name] = entry
    for stale in package.iterdir():
        if stale.name not in wanted and (stale.is_symlink() or stale.is_file()):
            stale.unlink()
    for name, target in wanted.items():
        _link(target, package / name)
    return package


def to_tree(path: str, root: Path = ROOT, tree: Path = TREE) -> str:
    """A repository path (``spec/limiter.py``, ``outrate``) as its path in the link tree."""
    parts = Path(path).resolve().relative_to(root).parts
    if not parts or parts[0] not in FOLDERS:
        raise SystemExit(f"typecheck: {path} is not inside one of the package folders {sorted(FOLDERS)}")
    place = FOLDERS[parts[0]]
    return str(tree / PACKAGE / place / Path(*parts[1:])) if len(parts) > 1 or place else str(tree / PACKAGE)


def to_repository(line: str, root: Path = ROOT, tree: Path = TREE) -> str:
    """One line of mypy's report with a link-tree path turned back into the repository's."""
    prefix = str(tree / PACKAGE) + os.sep
    for candidate in (prefix, os.path.relpath(tree / PACKAGE, root) + os.sep):
        if line.startswith(candidate):
            rest = line[len(candidate) :]
            first = rest.split(os.sep, 1)[0]
            folder = next((f for f, place in FOLDERS.items() if place and place == first), None)
            return rest if folder else "outrate" + os.sep + rest
    return line


def main(argv: list[str] | None = None) -> int:
    """Check ``argv`` (repository paths; default: the whole package) and print mypy's report."""
    paths = sys.argv[1:] if argv is None else argv
    build_tree()
    targets = [to_tree(p) for p in paths] if paths else [str(TREE / PACKAGE)]
    # A path inside another one given (``outrate`` is the whole package) is checked with it.
    targets = [t for t in targets if not any(t != o and t.startswith(o + os.sep) for o in targets)]
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in (run.stdout + run.stderr).splitlines():
        print(to_repository(line))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
