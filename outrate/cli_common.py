"""What the gate's commands (``outrate conform``, ``replay``, ``drift``) share: the console,
the ``--level`` choice and the ``--path`` option, the ``--config-style`` value, the import
path, vLLM's logging, JSON files, rich markup, and the exit without teardown.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

console = Console(width=None if sys.stdout.isatty() else 130)
LEVELS = click.Choice(["must", "should", "exact"])  # the gate's conformance levels (--level)


def path_option(help_text: str) -> Any:
    """The repeatable ``--path DIR`` option (parameter ``paths``, a tuple of existing
    directories, empty when not given): put first on the import path (a package's own
    directory stands for the one above it, ``gate_plan.import_dirs``)."""
    return click.option("--path", "paths", multiple=True, type=click.Path(exists=True, file_okay=False), help=help_text)


def exit_now(code: int) -> None:
    """Exit without interpreter teardown: Z3's context destructors (boundary scenarios) were
    seen to hang at exit on a loaded machine after the verdict was printed and saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quiet_vllm_logging() -> None:
    """Raise the ``vllm`` logger to ERROR (a higher level already set stays): outside a
    server vLLM configures no logging, so its per-engine-config INFO and WARNING records
    (block size, SSM cache type, Triton) would go to stderr between outrate's own lines."""
    logging.getLogger("vllm").setLevel(max(logging.getLogger("vllm").level, logging.ERROR))


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2))


def put_on_path(paths: tuple[str, ...]) -> None:
    """Put ``paths`` first on the import path and on the children's ``PYTHONPATH``, in order."""
    for directory in reversed(paths):
        sys.path.insert(0, str(Path(directory).resolve()))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(directory).resolve()), os.environ.get("PYTHONPATH")])
        )


def escape_markup(text: str | None) -> str:
    """``text`` with rich markup escaped (counterexamples hold brackets)."""
    return escape(text or "")


def style_from_option(text: str):
    """The ``--config-style`` object, or a click error naming the bad value."""
    if text == "additional-config":
        return None
    try:
        # deferred: adapter.configstyle loads unittest.mock and the config parsers (~0.2 s), kept off `outrate --help`
        from vllm_output_rate.adapter.configstyle import parse_config_style

        return parse_config_style(text)
    except (ValueError, ImportError) as exc:
        raise click.BadParameter(str(exc), param_hint="--config-style") from None
