"""What ``outrate conform`` prints and writes after its checks ran: the results, coverage and
mode tables, each failure with the command that re-runs it, the JSON, JUnit and Markdown
reports, and the verdict line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.table import Table

from vllm_output_rate.adapter.budgets import gate_budget
from vllm_output_rate.adapter.versions import installed_warning
from vllm_output_rate.cli_common import console, escape_markup, write_json
from vllm_output_rate.cli_mutants import run_mutants
from vllm_output_rate.gate_modes import mode_table, not_applicable_clause, warning_clause


def report_conform(
    results: list,
    options: Any,
    vllm_version: str,
    config_style: str,
    paths: tuple[str, ...],
    white_box: bool,
    mutants: tuple[str, ...] | None,
    report_paths: tuple[Path | None, Path | None, Path | None],
    started: float,
    release_clause: str | None = None,
) -> int:
    """Everything ``outrate conform`` prints and writes after its checks ran: the tables,
    the failures with their replay commands, the mutant hunt (``mutants``: the catalogue
    modules joining the reference's mutants, None: no hunt; with the white-box checks if
    ``white_box``), the JSON, JUnit and Markdown reports
    (``report_paths``, None: not written) and the verdict line (led by ``release_clause`` on
    an unsupported vLLM release). Returns the exit code."""
    # deferred: gate_row imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import gate_row

    json_path, junit_path, markdown_path = report_paths
    level, profile = options.level, options.profile
    header = _conform_header(options, vllm_version, config_style)
    _print_results(results, header)
    _print_failures(results, _gate_command(options, config_style))

    mutant_rows = run_mutants(profile, options.seed, level, white_box, mutants) if mutants is not None else []
    survivors = [m for m in mutant_rows if not m["killed"] and not m.get("not_judged")]
    checks_json = _checks_json(results)
    code = gate_row.exit_code(results)
    if survivors and code == 0:
        code = 1
    if json_path is not None:
        write_json(
            json_path,
            {
                **conform_settings(options, vllm_version, config_style),
                "seconds": round(time.monotonic() - started, 2),
                "exit_code": code,
                "checks": checks_json,
                "mutants": mutant_rows,
            },
        )
    _write_reports(junit_path, markdown_path, header, checks_json, mutant_rows, profile)
    line = _verdict_line(results, level, mutant_rows, time.monotonic() - started)
    console.print(f"{release_clause}: {line}" if release_clause else line, soft_wrap=True)
    return code


def _conform_header(options: Any, vllm_version: str, config_style: str) -> str:
    """The first line of ``outrate conform``'s tables: vLLM's version, the classes and the
    run's settings (``options``: ``gate_row.GateOptions``), then any version warning."""
    o = options
    return (
        f"outrate conform -- vLLM {vllm_version} -- {o.scheduler_cls} / {o.async_scheduler_cls or '-'}"
        f" -- level {o.level}, profile {o.profile}, seed {o.seed}, config {config_style}, "
        f"burst {'configurable' if o.burst_configurable else 'fixed 100 ms'}"
        f"{', integer rates' if o.integer_rates else ''}"
    ) + _version_warning()


def conform_settings(options: Any, vllm_version: str, config_style: str) -> dict[str, Any]:
    """The settings part of ``outrate conform --json`` (``options``: ``gate_row.GateOptions``)."""
    o = options
    return {
        "vllm_version": vllm_version,
        "scheduler": o.scheduler_cls,
        "async_scheduler": o.async_scheduler_cls,
        "level": o.level,
        "config_style": config_style,
        "burst_configurable": o.burst_configurable,
        "rate_change": o.rate_change,
        "require_modes": list(o.require_modes),
        "integer_rates": o.integer_rates,
        "profile": o.profile,
        "seed": o.seed,
    }


def _version_warning() -> str:
    """A header clause for an installed vLLM that is not a supported release ("" if it is);
    the warning itself is printed once, first (``_environment_first``)."""
    return " -- not a supported vLLM release" if installed_warning() else ""


def _checks_json(results: list[Any]) -> list[dict[str, Any]]:
    """The JSON rows of the checks, with the scenarios run and the coverage table where set."""
    checks_json = [r.as_json() for r in results]
    for r, row in zip(results, checks_json):
        if r.scenarios:
            row["scenarios"] = r.scenarios
        if r.coverage:
            row["coverage"] = r.coverage
        if r.modes:
            row["modes"] = r.modes
    return checks_json


def _write_reports(
    junit_path: Path | None,
    markdown_path: Path | None,
    header: str,
    checks_json: list[Any],
    mutant_rows: list[Any],
    profile: str,
) -> None:
    """The JUnit XML and Markdown reports, where asked for (adapter/reports.py)."""
    # deferred: adapter.reports loads tabulate and junit_xml (~80 ms), kept off `outrate --help`
    from vllm_output_rate.adapter import reports

    if junit_path is not None:
        reports.junit(junit_path, header, checks_json, mutant_rows)
    if markdown_path is not None:
        reports.markdown(markdown_path, header, checks_json, mutant_rows, _budget(profile))


def _print_results(results: list[Any], header: str) -> None:
    """The candidate and spec-health tables, the boundary scenarios run and the coverage table."""
    for part, title in (
        ("candidate", f"{header}\ncandidate checks (the verdict)"),
        ("spec health", "spec health (never the candidate's verdict)"),
    ):
        rows = [r for r in results if r.part == part]
        if rows:
            console.print(_results_table(title, rows))
    modes_row = next((r for r in results if r.modes), None)
    if modes_row is not None:  # issue 26: the candidate's mode matrix
        console.print(mode_table(modes_row.modes))
    for r in results:  # issue 18: the boundary scenarios run, by name, and the coverage table
        if r.scenarios:
            console.print(f"{r.name} scenarios: {escape_markup(', '.join(r.scenarios))}", soft_wrap=True)
    coverage_row = next((r for r in results if r.coverage), None)
    if coverage_row is not None:
        console.print(_coverage_table(coverage_row.coverage))


def _gate_command(options: Any, config_style: str) -> list[str]:
    """The ``outrate conform`` command (argv) of this run (``options``: ``gate_row.GateOptions``),
    paths relative to the working directory: what reproduces a row that saves no scenario."""
    # deferred: adapter.counterexample imports the gate's rows (Hypothesis) at its top
    from vllm_output_rate.adapter.counterexample import shown_path

    o = options
    argv = ["outrate", "conform", "--scheduler-cls", o.scheduler_cls]
    argv += ["--async-scheduler-cls", o.async_scheduler_cls] if o.async_scheduler_cls else ["--sync-only"]
    for directory in o.paths:
        argv += ["--path", shown_path(directory)]
    if config_style != "additional-config":
        argv += ["--config-style", config_style]
    argv += [flag for flag, on in (("--integer-rates", o.integer_rates), ("--burst-configurable",
             o.burst_configurable), ("--rate-change", o.rate_change)) if on]  # fmt: skip
    return argv + ["--level", o.level, "--profile", o.profile, "--seed", str(o.seed)]


def _print_failures(results: list[Any], gate_command: list[str] | None = None) -> None:
    """Each failed check: its failure, counterexample and the shell-quoted ``outrate replay``
    line that re-runs it (``adapter/counterexample.py``); a row that saves no scenario (the
    coverage row's obligations: it has no counterexample) says so and gives ``gate_command``
    (this run's ``outrate conform``, which reproduces it); a coverage row not judged
    (another check failed) says which check stopped the run."""
    # deferred: adapter.counterexample imports the gate's rows (Hypothesis) at its top
    from vllm_output_rate.adapter import counterexample

    again = f"re-run: {counterexample.shell_line(gate_command)}" if gate_command else ""
    for r in results:
        if r.result in ("not judged", "not applicable"):
            console.print(f"[yellow]{r.name} {r.result.upper()}[/] ({r.part}): {escape_markup(r.failure)}")
            continue
        if r.result not in ("fail", "warning"):
            continue
        if r.result == "warning":  # adapter/origins.py: a project rule, at should
            console.print(
                f"[bold yellow]{r.name} WARNING[/] ({r.part}, {r.origin}: this project's rule, not the article's; "
                f"fatal at --level exact): {escape_markup(r.failure)}",
                soft_wrap=True,
            )
        else:
            origin = f", {r.origin}" if r.origin else ""
            console.print(f"[bold red]{r.name} FAILED[/] ({r.part}{origin}): {escape_markup(r.failure)}")
        if r.coverage:  # obligations, not a scenario: the coverage table above has the counts
            for line in r.coverage.get("not_reached", []):
                console.print(f"    not reached: {escape_markup(line)}")
            why = "no scenario to save: coverage counts the obligations the whole run's checks reached"
            console.print(f"  {why}; {escape_markup(again)}" if again else f"  {why}", soft_wrap=True)
            continue
        console.print(
            "  counterexample ("
            + ("shrunk, 1-minimal" if r.minimal else "shrunk by Hypothesis, not proven 1-minimal")
            + "):"
        )
        for line in r.counterexample:
            console.print(f"    {escape_markup(line)}")
        if r.saved and counterexample.kind_of(r.name) is not None:
            line = counterexample.shell_line(counterexample.rerun_command(r.saved))
            console.print(f"  saved: {escape_markup(counterexample.shown_path(r.saved))}", soft_wrap=True)
            console.print(f"  re-run: {escape_markup(line)}", soft_wrap=True)
        elif r.saved:
            console.print(f"  saved: {escape_markup(r.saved)}  (re-run: outrate replay {r.saved})", soft_wrap=True)
        elif again:
            console.print(f"  no counterexample file saved (give --counterexamples DIR); {escape_markup(again)}")


def _budget(profile: str) -> dict:
    """The budget table of ``profile`` (``adapter/budgets.py``), for the gate manifest."""
    return gate_budget(profile).as_json()


def _coverage_table(coverage: dict) -> Table:
    """The coverage obligations of a run (``adapter/coverage.py``): count against k."""
    table = Table(title=f"coverage obligations (k = {coverage['k']} per run, profile {coverage['profile']})")
    for col in ("obligation", "rules", "reached", "status"):
        table.add_column(col, justify="right" if col == "reached" else "left")
    styles = {"ok": "green", "NOT REACHED": "bold red", "not applicable": "yellow", "not judged": "yellow"}
    for row in coverage["rows"]:
        table.add_row(
            row["obligation"], row["rules"], str(row["count"]), f"[{styles[row['status']]}]{row['status']}[/]"
        )
    return table


def _results_table(title: str, rows: list) -> Table:
    """One rich table of check results."""
    table = Table(title=title)
    for col in ("check", "level", "rules", "examples", "steps", "steps/s", "result", "seconds"):
        table.add_column(col, justify="right" if col in ("examples", "steps", "steps/s", "seconds") else "left")
    styles = {"pass": "green", "fail": "bold red", "not tested": "bold yellow", "not judged": "yellow"}
    styles |= {"warning": "yellow", "not applicable": "cyan"}
    for r in rows:
        table.add_row(
            r.name,
            r.level,
            " ".join(r.rules),
            str(r.examples),
            str(r.steps),
            f"{r.steps / r.seconds:.0f}" if r.seconds else "-",
            f"[{styles[r.result]}]{r.result.upper()}[/]",
            f"{r.seconds:.1f}",
        )
    return table


def _verdict_line(results: list, level: str, mutant_rows: list, seconds: float) -> str:
    """The last line of a gate run: the verdict at the level, what was not tested."""
    candidate = [r for r in results if r.part == "candidate" and r.result != "not applicable"]
    passed = sum(r.result in ("pass", "warning") for r in candidate)
    failed = [r.name for r in candidate if r.result == "fail"]
    untested = [r.name for r in results if r.result == "not tested"]
    health_failed = [r.name for r in results if r.part == "spec health" and r.result == "fail"]
    parts = [f"level {level}: {passed}/{len(candidate)} candidate checks passed"]
    if mutant_rows:
        judged = [m for m in mutant_rows if not m.get("not_judged")]
        parts.append(
            f"{sum(m['killed'] for m in judged)}/{len(judged)} mutants killed"
            + (
                f" ({len(mutant_rows) - len(judged)} not a defect at this level)"
                if len(judged) < len(mutant_rows)
                else ""
            )
        )
    parts += [clause for clause in (not_applicable_clause(results),) if clause]
    line = ", ".join(parts) + f" in {seconds:.0f} s"
    warnings = warning_clause(results)
    survived = [m["mutant"] for m in mutant_rows if not m["killed"] and not m.get("not_judged")]
    if failed:
        line += f" -- REJECTED: {', '.join(failed)} failed" + (f"; {warnings}" if warnings else "")
    elif health_failed:
        line += f" -- SPEC HEALTH FAILED ({', '.join(health_failed)}): no verdict on this vLLM"
    elif survived:  # the candidate passed, but the gate missed a slip it must catch
        line += f" -- GATE TOO WEAK: {len(survived)} mutant(s) survived: {', '.join(survived)}"
    elif untested:
        line += f" -- NOT TESTED: {', '.join(untested)} (give --async-scheduler-cls, or --sync-only)"
    else:
        line += f" -- ACCEPTED with {warnings}" if warnings else " -- ACCEPTED"
    return line
