"""The candidate manifest: ``outrate conform``'s settings kept with the patch.

A ``[tool.outrate]`` table in the patch's ``pyproject.toml`` (or an ``outrate.toml``,
whose keys may stand at the top level or in ``[tool.outrate]``; it wins over
``pyproject.toml``) in the current directory::

    [tool.outrate]
    scheduler-cls = "my_fork.sched.MyScheduler"
    async-scheduler-cls = "my_fork.sched.MyAsyncScheduler"
    config-style = "engine-args"
    integer-rates = true
    burst-configurable = false
    rate-change = false
    path = ["src"]
    require-modes = ["lora"]
    mutants-from = ["my_fork_mutants"]  # outrate conform --mutants: its MUTANTS join the hunt
    level = "should"
    profile = "ci"

``outrate conform`` with no options reads it; an option given on the command line
overrides the manifest's value (click's ``default_map``). Keys are the long options'
names (``-`` or ``_``); ``path``, ``require-modes`` and ``mutants-from`` take a string or a
list of strings.
A relative ``path`` is relative to the manifest's directory.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, cast

# manifest key -> (conform's parameter, expected Python type(s))
KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "scheduler-cls": ("scheduler_cls", (str,)),
    "async-scheduler-cls": ("async_scheduler_cls", (str,)),
    "config-style": ("config_style", (str,)),
    "integer-rates": ("integer_rates", (bool,)),
    "burst-configurable": ("burst_configurable", (bool,)),
    "rate-change": ("rate_change", (bool,)),
    "sync-only": ("sync_only", (bool,)),
    "path": ("paths", (str, list)),
    "require-modes": ("require_modes", (str, list)),
    "mutants-from": ("mutants_from", (str, list)),
    "level": ("level", (str,)),
    "profile": ("profile", (str,)),
    "seed": ("seed", (int,)),
}
LISTS = ("path", "require-modes", "mutants-from")
FILES = ("outrate.toml", "pyproject.toml")


class ManifestError(ValueError):
    """A manifest that cannot be read: the message names the file, the key and the value."""


def find(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The manifest in ``directory``: ``(file, its [tool.outrate] table)``, or None when
    neither ``FILES`` holds one.

    Raises:
        ManifestError: a file that is not TOML, or an ``outrate`` table that is no table.
    """
    for name in FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{name} is not valid TOML: {exc}") from None
        table = data.get("tool", {}).get("outrate") if isinstance(data.get("tool"), dict) else None
        if table is None and name == "outrate.toml":
            table = {k: v for k, v in data.items() if k != "tool"}
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ManifestError(f"{name}: [tool.outrate] must be a table, got {table!r}")
        return path, table
    return None


def conform_defaults(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` as ``outrate conform``'s ``default_map``: parameter name -> value (lists as
    tuples, ``path`` entries relative to ``path``'s directory).

    Raises:
        ManifestError: an unknown key (naming the known ones) or a value of the wrong type,
            naming the file, the key and the value.
    """
    defaults: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        if key not in KEYS:
            raise ManifestError(
                f"{path.name}: unknown key {raw_key!r} in [tool.outrate]; known keys: {', '.join(KEYS)}"
            )
        param, types = KEYS[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join("a list of strings" if t is list else t.__name__ for t in types)
            raise ManifestError(f"{path.name}: [tool.outrate] {raw_key} = {value!r}: must be {want}")
        if key in LISTS:
            items: list[Any] = [value] if isinstance(value, str) else list(cast(list[Any], value))
            if not all(isinstance(item, str) for item in items):
                raise ManifestError(f"{path.name}: [tool.outrate] {raw_key} = {value!r}: must be a list of strings")
            if key == "path":
                items = [str(path.parent / item) if not Path(item).is_absolute() else item for item in items]
            value = tuple(items)
        defaults[param] = value
    return defaults
