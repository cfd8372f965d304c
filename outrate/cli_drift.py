"""``outrate drift``: spec health, the first divergence of the installed vLLM from the base
model per V-rule (``adapter/drift.py``), each saved for ``outrate replay``.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vllm_output_rate.adapter.versions import installed_version, installed_warning, profile_named
from vllm_output_rate.cli_common import console, quiet_vllm_logging, write_json
from vllm_output_rate.clitools import counterexamples_option, json_option


@click.command()
@click.option(
    "--base-model",
    "base_version",
    default=None,
    metavar="VERSION",
    help="Judge the installed vLLM against the base-model rows of this release (spec/versions.py); "
    "default: the installed vLLM's own rows.",
)
@click.option("--examples", type=int, default=300, show_default=True, help="Scenarios per hunt.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mode", type=click.Choice(["sync", "async", "both"]), default="both", show_default=True)
@click.option(
    "--time-budget",
    "time_budget_s",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Start no new hunt after this many seconds.",
)
@json_option("the findings")
@counterexamples_option("Directory where each rule's counterexample is saved for `outrate replay`.")
def drift(base_version, examples, seed, mode, time_budget_s, json_path, counterexamples) -> None:
    """Spec health: per V-rule, the first divergence of the installed vLLM from the base model.

    Runs base fidelity (stock vLLM, feature off) and prints, for each V-rule that diverges,
    its 1-minimal counterexample and the time it took. Exit 1 if any rule diverges.
    """
    # deferred: adapter.drift imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import drift as drift_mod

    started = time.monotonic()
    version, warning, base = _import_for_drift(base_version)
    console.print(
        f"outrate drift -- vLLM {version} -- base model: vLLM {base.version} rows -- "
        f"{examples} examples per hunt, seed {seed}"
    )
    if warning:
        console.print(f"[bold yellow]{escape(warning)}[/]")
    modes = {"sync": (False,), "async": (True,), "both": (False, True)}[mode]
    again = "" if base_version is None else f" --base-model {base.version}"
    progress = Progress(
        TextColumn("{task.description:<20}"),
        TextColumn("{task.completed} runs"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("hunting", total=None)
        report = drift_mod.drift(
            base,
            version,
            warning,
            examples=examples,
            seed=seed,
            modes=modes,
            time_budget_s=time_budget_s,
            tick=lambda: progress.advance(task),
            on_found=functools.partial(_show_divergence, counterexamples, again),
        )
    _print_drift_report(report, version, base.version)
    console.print(f"{len(report.found)} V-rule(s) diverge; {time.monotonic() - started:.1f} s in all")
    if json_path is not None:
        write_json(
            json_path,
            {
                "vllm_version": version,
                "base_version": base.version,
                "warning": warning,
                "examples": report.examples,
                "complete": report.complete,
                "seconds": round(report.seconds, 2),
                "found": [e.as_json() for e in report.found],
            },
        )
    sys.exit(1 if report.found else 0)


def _import_for_drift(base_version: str | None) -> tuple[str, str | None, Any]:
    """Import vLLM's schedulers (under a status line): ``(installed version, its warning or
    None, the base-model profile named by --base-model)``; an unknown release is a
    ``click.BadParameter`` naming it."""
    with console.status("importing vLLM"):
        for module in ("vllm.v1.core.sched.async_scheduler", "vllm.v1.core.sched.scheduler"):
            importlib.import_module(module)

        quiet_vllm_logging()
        version, warning = installed_version(), installed_warning()
        try:
            base = profile_named(base_version)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--base-model") from None
    return version, warning, base


def _show_divergence(counterexamples: Path, again_options: str, entry: Any) -> None:
    """Print one divergence the drift hunt found (rule, failure, 1-minimal counterexample)
    and save its scenario under ``counterexamples`` for ``outrate replay`` (with
    ``again_options`` in the printed command)."""
    console.print(f"[bold red]{entry.rule}[/] ({entry.mode}) diverges: {escape(entry.failure)}")
    console.print(
        f"  found in {entry.seconds_to_find:.1f} s ({entry.examples} scenarios), 1-minimal in "
        f"{entry.seconds_to_minimize:.1f} s, {entry.events} events:"
    )
    for line in entry.counterexample:
        console.print(f"    {escape(line)}")
    counterexamples.mkdir(parents=True, exist_ok=True)
    path = counterexamples / f"drift-{entry.rule.replace('/', '-')}-{entry.mode}.json"
    path.write_text(entry.scenario.to_json())
    console.print(f"  saved: {path}  (outrate replay {path}{again_options})")


def _print_drift_report(report: Any, version: str, base_version: str) -> None:
    """The drift table (one row per diverging V-rule, if any) and the scenarios run per mode."""
    table = Table(title=f"drift: vLLM {version} vs base model {base_version}")
    for col in ("V-rule", "mode", "first divergence", "events", "seconds to find", "seconds to 1-minimal"):
        table.add_column(col)
    for e in report.found:
        table.add_row(
            e.rule,
            e.mode,
            escape(e.failure[:90]),
            str(e.events),
            f"{e.seconds_to_find:.1f}",
            f"{e.seconds_to_minimize:.1f}",
        )
    if report.found:
        console.print(table)
    for m, n in report.examples.items():
        state = "clean last round" if report.complete.get(m) else "time budget reached"
        console.print(f"{m}: {n} scenarios ({state})")
