"""``outrate conform --mutants``: the mutant hunt of the gate run (``adapter/mutation.py``:
the reference's mutants and those of each ``--mutants-from`` module), its kill table and
summary.
"""

from __future__ import annotations

import statistics

import click
from rich.table import Table

from vllm_output_rate.cli_common import console, escape_markup
from vllm_output_rate.clitools import bar_progress


def check_mutant_modules(modules: tuple[str, ...]) -> None:
    """Load the ``--mutants-from`` catalogue modules before any check runs: a module that
    does not load is a usage error naming it (``adapter/mutation.load_mutants``)."""
    from vllm_output_rate.adapter.mutation import catalogue  # deferred: adapter.mutation imports vLLM at its top (~7 s)

    try:
        catalogue(modules)
    except (ImportError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--mutants-from") from None


def run_mutants(profile: str, seed: int, level: str, white_box: bool, modules: tuple[str, ...]) -> list[dict]:
    """Hunt every mutant of the catalogue (``adapter/mutation.catalogue``: the reference's and
    those of the catalogue ``modules``, ``--mutants-from``) with the gate's candidate checks
    at ``level`` (without the exact-level white-box checks unless ``white_box``); print the
    kill table and the median and maximum seconds to kill."""
    # deferred: adapter.mutation imports vLLM at its top (~7 s)
    from vllm_output_rate.adapter.mutation import catalogue, kill

    mutants = catalogue(modules)  # loaded once already (check_mutant_modules)
    rows = []
    with bar_progress(console, 44) as progress:
        task = progress.add_task("mutants", total=len(mutants))
        for mutant in mutants:
            progress.update(task, description=f"mutant {mutant.name}")
            rows.append(kill(mutant, level, profile, seed, white_box).as_json())
            progress.advance(task)
    _print_mutant_table(rows, profile, level, white_box)
    _print_mutant_summary(rows, level)
    return rows


def _print_mutant_table(rows: list[dict], profile: str, level: str, white_box: bool) -> None:
    """The kill table of ``run_mutants``: one row per mutant (``Mutant.as_json`` rows)."""
    table = Table(title=f"mutants (level {level}, profile {profile}, white box {'on' if white_box else 'off'})")
    for col in (
        "mutant",
        "base",
        "rule",
        "killed",
        "killed by rule",
        "check",
        "level",
        "black-box",
        "seconds",
        "events",
    ):
        table.add_column(col)
    for m in rows:
        table.add_row(
            m["mutant"],
            "article" if m["based_on"] == "article_style" else "reference",
            m["rule"],
            "[green]yes[/]"
            if m["killed"]
            else (f"[yellow]{m['not_judged']}[/]" if m.get("not_judged") else "[bold red]NO[/]"),
            m["killed_by"] or "-",
            m["check"] or "-",
            m["level"] or "-",
            "-" if m["black_box"] is None else ("yes" if m["black_box"] else "no"),
            f"{m['seconds']:.1f}",
            str(m["counterexample_events"]),
        )
    console.print(table)


def _print_mutant_summary(rows: list[dict], level: str) -> None:
    """Under the kill table: how many were killed (by a black-box check, by their own rule),
    the median and maximum seconds to kill, the mutants not hunted at ``level``, the
    spurious kills and every survivor."""
    # deferred: adapter.mutation imports vLLM at its top (~7 s)
    from vllm_output_rate.adapter.mutation import names_rule

    killed = [m for m in rows if m["killed"]]
    judged = [m for m in rows if not m.get("not_judged")]
    if killed:
        secs = [m["seconds"] for m in killed]
        same = sum(names_rule(m["killed_by"], m["rule"]) for m in killed)
        console.print(
            f"{len(killed)}/{len(judged)} mutants killed, {sum(bool(m['black_box']) for m in killed)} by a "
            f"black-box check, {same} by a failure naming the mutant's own rule; seconds to kill: median "
            f"{statistics.median(secs):.1f}, max {max(secs):.1f}"
            + (
                f"; not hunted at level {level}: "
                + ", ".join(f"{m['mutant']} ({m['not_judged']})" for m in rows if m.get("not_judged"))
                if len(judged) < len(rows)
                else ""
            ),
            soft_wrap=True,
        )
    for m in rows:
        for line in m.get("spurious") or []:
            console.print(
                f"[yellow]mutant {m['mutant']}: not counted, the unmutated base fails it too:[/] {escape_markup(line)}",
                soft_wrap=True,
            )
        if not m["killed"] and not m.get("not_judged"):
            short = m.get("coverage_shortfall")  # a coverage shortfall is no kill (adapter/mutation.py)
            console.print(
                f"[bold red]mutant {m['mutant']} ({m['rule']}) SURVIVED[/]"
                + (f" (its checks passed; coverage: {escape_markup(short)})" if short else ""),
                soft_wrap=True,
            )
