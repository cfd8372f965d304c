"""What the ``outrate`` commands share: the ``--json PATH`` option and the progress bar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def json_option(what: str = "the results") -> Callable[[Any], Any]:
    """The ``--json PATH`` option (parameter ``json_path``, a file path or None): "Write
    ``what`` as JSON here"."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=f"Write {what} as JSON here.",
    )


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
