"""The ``outrate`` command line (click + rich): the ``main`` group, ``check-trace`` and
``tiny-model``. Each other command lives in its own module: ``cli_conform.py`` (with
``cli_conform_report.py`` and ``cli_mutants.py``), ``cli_replay.py``, ``cli_drift.py``,
``bench/``, ``serve.py``, ``loadtest.py`` (``measure``), ``prove.py``, ``check.py``, ``soak.py``
and ``keys.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from vllm_output_rate import __version__, manifest
from vllm_output_rate.bench import bench
from vllm_output_rate.check import check
from vllm_output_rate.cli_common import console
from vllm_output_rate.cli_conform import conform
from vllm_output_rate.cli_drift import drift
from vllm_output_rate.cli_replay import replay
from vllm_output_rate.clitools import flag_option
from vllm_output_rate.keys import keys
from vllm_output_rate.loadtest import measure
from vllm_output_rate.prove import prove
from vllm_output_rate.serve import serve
from vllm_output_rate.soak import soak


def _offline_env() -> None:
    """Nothing is ever fetched from a model hub (the project writes its own tiny model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@click.group()
@click.version_option(__version__, prog_name="outrate")
@click.pass_context
def main(ctx: click.Context) -> None:
    """vllm-output-rate: per-user output-token rate limiting in the vLLM V1 scheduler."""
    _offline_env()
    if ctx.invoked_subcommand == "conform":  # the candidate manifest: options given override it
        _read_manifest(ctx)


def _read_manifest(ctx: click.Context) -> None:
    """Make ``[tool.outrate]`` of ``outrate.toml`` / ``pyproject.toml`` in the working directory
    (``outrate/manifest.py``) ``outrate conform``'s defaults; a usage error naming the file,
    key and value if it cannot be read."""
    try:
        found = manifest.find(Path("."))
        if found is None:
            return
        ctx.default_map = {"conform": manifest.conform_defaults(*found)}
    except manifest.ManifestError as exc:
        raise click.UsageError(f"{exc}\nFix the candidate manifest (or run outrate conform elsewhere).") from None
    ctx.obj = {"manifest": f"{found[0].name} [tool.outrate]"}


@main.command("check-trace", context_settings={"ignore_unknown_options": True})
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@flag_option("--partial", "The engine still writes FILE: skip an unterminated last line.")
def check_trace_cmd(file, partial) -> None:
    """Check an engine-side event trace (outrate serve --trace-path FILE): per run and per user the
    rates over busy periods, every violation; exit 1 on a violation (or no run), 2 if unreadable."""
    # deferred: adapter.trace_check and its checker cost ~50 ms, kept off `outrate --help`
    from vllm_output_rate.adapter.trace_check import main as trace_main

    sys.exit(trace_main([str(file)] + (["--partial"] if partial else [])))


@main.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def tiny_model(directory) -> None:
    """Write the tiny Llama-style model config (dummy weights) into DIRECTORY.

    DIRECTORY is created if missing; one that cannot be created or written is a usage
    error (exit 2) naming it.
    """
    # deferred: adapter.tinymodel loads tokenizers (~50 ms), kept off `outrate --help`
    from vllm_output_rate.adapter.tinymodel import write_config

    try:
        write_config(directory)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot write the tiny model into {directory}: {exc.strerror or exc} "
            f"({exc.filename or directory}); choose a directory that can be created and written",
            param_hint="DIRECTORY",
        ) from None
    console.print(f"wrote {directory}/config.json")


for _command in (conform, replay, drift, bench, serve, measure, prove, check, soak, keys):
    main.add_command(_command)


if __name__ == "__main__":
    main()
