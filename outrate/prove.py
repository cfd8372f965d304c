"""``outrate prove``: the limiter's machine-checked properties (R1-R6, R21), Z3 and CrossHair.

* Z3 (``proofs/z3_limiter.py``): inductive proofs over unbounded integers and reals,
  symbolic rates; each obligation gets ``--timeout-ms``.
* CrossHair (``proofs/crosshair_limiter.py``): PEP 316 contracts on wrappers around the
  spec and the reference limiter, checked in child processes (``proofs/crosshair_runner.py``); each condition gets
  ``--crosshair-timeout`` CPU seconds, the whole CrossHair run ``--wall-timeout`` seconds.
  "proved" only when CrossHair confirmed the condition over all paths.

Prints a table (property, rules, tool, result, seconds), optionally writes JSON::

    {"properties": [{"name": str, "rules": [str], "tool": "z3"|"crosshair",
                     "result": "proved"|"refuted"|"unknown", "seconds": float}, ...],
     "notes": {name: counterexample or reason for "unknown"}, "settings": {...}, "seconds": float}

and exits 1 if any property is refuted (0 otherwise, "unknown" included).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from vllm_output_rate.clitools import bar_progress, flag_option, shown_default_option
from vllm_output_rate.proofs import crosshair_check, crosshair_limiter, crosshair_runner
from vllm_output_rate.proofs.records import RECORD_KEYS

RESULT_STYLE = {"proved": "green", "unknown": "yellow", "refuted": "bold red"}


def _note(record: dict) -> str | None:
    """Why a record is not simply "proved" (counterexample or reason), if it is not."""
    if record["tool"] == "z3":
        if record["result"] != "proved":
            return record.get("counterexample") or "no counterexample found"
        if record.get("vacuity_ok") is False:
            return "vacuity check failed: some obligation's hypotheses are unsatisfiable"
        return None
    if record["result"] == "proved":
        return None
    return (
        "; ".join(
            f"line {c['line']}: {c['message']}" for c in record.get("conditions", []) if c["status"] != "confirmed"
        )
        or None
    )


def _run_proofs(
    console: Console, timeout_ms: int, crosshair_timeout: float, wall_timeout: float | None, jobs: int, broken: bool
) -> list[dict]:
    """The Z3 proofs, then the CrossHair properties (with the known-broken ones if
    ``broken``) in ``jobs`` processes, under one progress bar: their records, in order."""
    from vllm_output_rate.proofs import z3_limiter  # deferred: imports z3 (slow), needed only to prove

    crosshair_props = list(crosshair_limiter.PROPERTIES) + (list(crosshair_limiter.BROKEN) if broken else [])
    records: list[dict] = []
    progress = bar_progress(console, 44)
    with progress:
        task = progress.add_task("z3: inductive proofs", total=len(z3_limiter.PROPERTIES) + len(crosshair_props))
        records += z3_limiter.run_all(timeout_ms=timeout_ms)
        progress.update(
            task,
            advance=len(z3_limiter.PROPERTIES),
            description=f"crosshair: {len(crosshair_props)} properties, {jobs} processes",
        )

        def tick(record: dict) -> None:
            progress.update(task, advance=1, description=f"crosshair: {record['name']} {record['result']}")

        records += crosshair_runner.run_all(
            per_condition_timeout=crosshair_timeout,
            names=[p.name for p in crosshair_props],
            jobs=jobs,
            wall_timeout=wall_timeout,
            on_record=tick,
        )
        progress.update(task, description="done")
    return records


def _write_document(text: str, json_path: str) -> None:
    """Write ``text`` to ``json_path`` (making its folder), or to stdout for ``-``."""
    if json_path == "-":
        click.echo(text)
    else:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


@click.command()
@click.option(
    "--json",
    "json_path",
    default=None,
    is_flag=False,
    flag_value="-",
    metavar="PATH",
    help="Write the results as JSON to PATH ('-' or no value: stdout, the table then goes to stderr).",
)
@shown_default_option("--timeout-ms", click.IntRange(min=1), 5000, "Z3 timeout per proof obligation, in milliseconds.")
@shown_default_option(
    "--crosshair-timeout",
    click.FloatRange(min=0.1),
    crosshair_check.DEFAULT_PER_CONDITION_TIMEOUT_S,
    "CrossHair CPU seconds per condition (its --per_condition_timeout).",
)
@shown_default_option(
    "--wall-timeout",
    click.FloatRange(min=1),
    crosshair_runner.DEFAULT_WALL_TIMEOUT_S,
    "Wall-clock cap in seconds on the CrossHair run; unfinished checks are reported unknown.",
)
@shown_default_option("--jobs", click.IntRange(min=1), 2, "CrossHair child processes.")
@flag_option(
    "--broken",
    "Also check the deliberately broken limiters of the CrossHair module (they must come out "
    "refuted, so the exit status is then 1).",
)
def prove(json_path, timeout_ms, crosshair_timeout, wall_timeout, jobs, broken) -> None:
    """Prove the limiter rules R1-R6 and R21 with Z3 and CrossHair; exit 1 if any property is refuted."""
    console = Console(stderr=json_path == "-", width=None if sys.stdout.isatty() else 130)
    started = time.monotonic()
    records = _run_proofs(console, timeout_ms, crosshair_timeout, wall_timeout, jobs, broken)
    elapsed = time.monotonic() - started

    table = Table(
        title=f"outrate prove -- Z3 {timeout_ms} ms/obligation, CrossHair {crosshair_timeout:g} CPU s/condition"
    )
    for col in ("property", "rules", "tool", "result", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for r in records:
        style = RESULT_STYLE[r["result"]]
        table.add_row(r["name"], " ".join(r["rules"]), r["tool"], f"[{style}]{r['result']}[/]", f"{r['seconds']:.2f}")
    console.print(table)
    notes = {r["name"]: note for r in records if (note := _note(r)) is not None}
    for name, note in notes.items():
        console.print(f"[bold]{name}[/]: {note}")
    counts = {k: sum(r["result"] == k for r in records) for k in ("proved", "unknown", "refuted")}
    console.print(
        f"{counts['proved']} proved, {counts['unknown']} unknown, {counts['refuted']} refuted in {elapsed:.1f} s"
    )

    if json_path is not None:
        doc = {
            "properties": [{k: r[k] for k in RECORD_KEYS} for r in records],
            "notes": notes,
            "settings": {
                "z3_timeout_ms": timeout_ms,
                "crosshair_per_condition_timeout_s": crosshair_timeout,
                "crosshair_wall_timeout_s": wall_timeout,
                "crosshair_jobs": jobs,
                "broken": broken,
            },
            "seconds": round(elapsed, 2),
        }
        _write_document(json.dumps(doc, indent=2), json_path)
    sys.exit(1 if counts["refuted"] else 0)
