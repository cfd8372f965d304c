"""``outrate check``: explicit-state model checking of the executable spec.

Runs the scopes of one profile of ``proofs/modelcheck_scopes.json`` through the model
checker (``proofs/modelcheck.py``): breadth-first search over every interleaving of the
scope's events, every invariant of ``spec/invariants.py`` on every transition, liveness
(every request that is not aborted can still finish; no state with work where nothing
can ever be scheduled) on the explored graph.

Prints a table (scope, states, transitions, states/s, invariants checked, violations,
result), optionally writes JSON::

    {"scopes": [{"name": str, "states": int, "transitions": int, "states_per_s": float,
                 "violations": int, ...}], "profile": str, "seconds": float, ...}

and exits 1 if any scope has a violation or exceeds its declared state bound. A state
or transition count that differs from the manifest's pinned one is reported (the spec's
state space changed; re-pin deliberately with ``python -m
vllm_output_rate.proofs.modelcheck --profile PROFILE --pin``) but is not a failure here;
``tests/test_modelcheck.py`` fails on it for the quick profile.

Each violation is saved as a replayable ``StepScenario`` under ``--counterexamples``;
``python -m vllm_output_rate.adapter.whitebox FILE`` replays it on real vLLM.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vllm_output_rate.clitools import counterexamples_option, json_option, shown_default_option

SCOPE_KEYS = ("name", "states", "transitions", "states_per_s", "violations")


@click.command()
@shown_default_option(
    "--profile",
    click.Choice(["quick", "ci", "release"]),
    "ci",
    "Which scopes to explore (quick: seconds; ci: >= 10^5 states, minutes; release: >= 10^6 states).",
)
@json_option()
@shown_default_option("--jobs", click.IntRange(min=1), 2, "Worker processes (one scope per process at a time).")
@counterexamples_option("Directory where violating event sequences are saved for replay.")
def check(profile, json_path, jobs, counterexamples) -> None:
    """Model-check the spec over the profile's scopes; exit 1 on any violation."""
    # deferred: proofs.modelcheck and the model checker it loads cost ~0.15 s, kept off `outrate --help`
    from vllm_output_rate.proofs import modelcheck

    console = Console(width=None if sys.stdout.isatty() else 130)
    scopes = modelcheck.profile_scopes(profile)
    started = time.monotonic()
    progress = Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        TextColumn("{task.completed:>9,.0f} states"),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks = {}
    with progress:
        for scope in scopes:
            # Pinned scopes show a real bar; others count up to their declared bound.
            total = scope.pinned[0] if scope.pinned else scope.max_states
            tasks[scope.name] = progress.add_task(scope.name, total=total, note="waiting")

        def on_progress(name: str, states: int, transitions: int) -> None:
            progress.update(tasks[name], completed=states, note=f"{transitions:,} transitions")

        def on_done(result: dict) -> None:
            task = tasks[result["name"]]
            if "error" in result:
                progress.update(task, note="[bold red]bound exceeded[/]")
                return
            note = "[green]ok[/]" if result["violations"] == 0 else f"[bold red]{result['violations']} violations[/]"
            progress.update(task, completed=result["states"], total=result["states"], note=note)

        results = modelcheck.run_profile(
            profile, jobs=jobs, save_dir=str(counterexamples), on_progress=on_progress, on_done=on_done
        )
    elapsed = time.monotonic() - started
    table, failed, changed = _results_table(
        f"outrate check --profile {profile} ({len(scopes)} scopes, {jobs} processes)", results, elapsed
    )
    console.print(table)
    _print_details(console, results, changed, profile)
    ok = [r for r in results if "error" not in r]
    total_states = sum(r["states"] for r in ok)
    total_transitions = sum(r["transitions"] for r in ok)
    console.print(
        f"{total_states:,} distinct states, {total_transitions:,} transitions in {elapsed:.1f} s "
        f"({jobs} processes); {failed} scope(s) failed"
    )
    if json_path is not None:
        _write_json(json_path, results, profile, jobs, elapsed, total_states, total_transitions)
    sys.exit(1 if failed else 0)


def _results_table(title: str, results: list[dict[str, Any]], elapsed: float) -> tuple[Table, int, list[Any]]:
    """The table of scopes and its total row; the number of failed scopes; the scopes whose
    state or transition count moved from the pinned one, as (name, pin, result)."""
    table = Table(title=title)
    for col in ("scope", "states", "transitions", "states/s", "invariants checked", "violations", "result"):
        table.add_column(col, justify="left" if col in ("scope", "result") else "right")
    failed = 0
    changed = []
    for r in results:
        if "error" in r:
            failed += 1
            table.add_row(r["name"], "-", "-", "-", "-", "-", "[bold red]bound exceeded[/]")
            continue
        pin = r["pinned"]
        moved = pin is not None and (pin["states"], pin["transitions"]) != (r["states"], r["transitions"])
        if moved:
            changed.append((r["name"], pin, r))
        if r["violations"]:
            failed += 1
            result = "[bold red]FAIL[/]"
        else:
            result = "[yellow]pass, count changed[/]" if moved else "[green]pass[/]"
        table.add_row(
            r["name"],
            f"{r['states']:,}",
            f"{r['transitions']:,}",
            f"{r['states_per_s']:,.0f}",
            f"{r['invariant_checks']:,}",
            str(r["violations"]),
            result,
        )
    ok = [r for r in results if "error" not in r]
    total_states = sum(r["states"] for r in ok)
    total_transitions = sum(r["transitions"] for r in ok)
    table.add_row(
        "[bold]total[/]",
        f"{total_states:,}",
        f"{total_transitions:,}",
        f"{total_states / elapsed:,.0f}" if elapsed > 0 else "-",
        f"{sum(r['invariant_checks'] for r in ok):,}",
        str(sum(r["violations"] for r in ok)),
        "[bold red]FAIL[/]" if failed else "[green]pass[/]",
    )
    return table, failed, changed


def _print_details(console: Console, results: list[dict[str, Any]], changed: list[Any], profile: str) -> None:
    """Each scope error and violation (events, replay command), then each moved count."""
    for r in results:
        if "error" in r:
            console.print(f"[bold red]{r['name']}[/]: {r['error']}")
        for v in r.get("details", []):
            console.print(f"[bold red]{r['name']} {v['check']}[/] ({v['length']} events): {v['message']}")
            for line in v["events"]:
                console.print(f"    {line}")
            if v["official"]:
                console.print(f"    spec invariants on replay: {v['official']}")
            if v["scenario"]:
                console.print(
                    f"    saved: {v['scenario']}  (replay on vLLM: python -m "
                    f"vllm_output_rate.adapter.fidelity {v['scenario']})"
                )
    for name, pin, r in changed:
        console.print(
            f"[yellow]{name}[/]: {r['states']} states / {r['transitions']} transitions, pinned "
            f"{pin['states']} / {pin['transitions']}: the spec's state space changed; if intended, re-pin "
            f"with python -m vllm_output_rate.proofs.modelcheck --profile {profile} --pin"
        )


def _write_json(
    json_path: Path,
    results: list[dict[str, Any]],
    profile: str,
    jobs: int,
    elapsed: float,
    total_states: int,
    total_transitions: int,
) -> None:
    """The JSON report (module docstring)."""
    doc = {
        "scopes": [
            {
                **{k: r[k] for k in SCOPE_KEYS},
                "invariant_checks": r["invariant_checks"],
                "max_depth": r["max_depth"],
                "seconds": r["seconds"],
                "pinned": r["pinned"],
                "coverage": r["coverage"],
                "counterexamples": r["details"],
            }
            if "error" not in r
            else {
                "name": r["name"],
                "states": 0,
                "transitions": 0,
                "states_per_s": 0.0,
                "violations": 0,
                "error": r["error"],
            }
            for r in results
        ],
        "profile": profile,
        "jobs": jobs,
        "seconds": round(elapsed, 2),
        "total_states": total_states,
        "total_transitions": total_transitions,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
