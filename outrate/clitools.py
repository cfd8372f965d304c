"""What the ``outrate`` commands share: options (``--json PATH``, ``--counterexamples DIR``,
files written, on/off flags, values with a shown default) and the progress bar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def output_file_option(flag: str, param: str, help_text: str) -> Callable[[Any], Any]:
    """A ``FLAG PATH`` option naming a file the command writes (parameter ``param``: a
    ``Path``, or None when not given; a directory is refused)."""
    return click.option(flag, param, type=click.Path(dir_okay=False, path_type=Path), default=None, help=help_text)


def json_option(what: str = "the results") -> Callable[[Any], Any]:
    """The ``--json PATH`` option (parameter ``json_path``, a file path or None): "Write
    ``what`` as JSON here"."""
    return output_file_option("--json", "json_path", f"Write {what} as JSON here.")


def counterexamples_option(help_text: str) -> Callable[[Any], Any]:
    """The ``--counterexamples DIR`` option (parameter ``counterexamples``, a ``Path``,
    default ``reports``, shown in --help): where failing cases are saved for replay."""
    return click.option(
        "--counterexamples",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("reports"),
        show_default=True,
        help=help_text,
    )


def flag_option(flag: str, help_text: str) -> Callable[[Any], Any]:
    """An on/off option, off unless given (parameter: the flag's name, e.g. ``--sync-only``
    -> ``sync_only``, a bool)."""
    return click.option(flag, is_flag=True, help=help_text)


def shown_default_option(flag: str, kind: click.ParamType, default: Any, help_text: str) -> Callable[[Any], Any]:
    """An option of click type ``kind`` (a range such as ``click.IntRange(min=1)`` or a
    ``click.Choice``: click refuses any other value, naming it) whose ``default`` --help shows."""
    return click.option(flag, type=kind, default=default, show_default=True, help=help_text)


def bar_progress(console: Console, width: int) -> Progress:
    """A progress display on ``console`` that stays on screen: each task's description
    padded to ``width`` characters, its bar, done/total and the time elapsed."""
    return Progress(
        TextColumn(f"{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
