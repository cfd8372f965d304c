"""The ``outrate`` command line (click + rich)."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vllm_output_rate import __version__
from vllm_output_rate.bench import bench
from vllm_output_rate.check import check
from vllm_output_rate.clitools import (
    bar_progress,
    counterexamples_option,
    flag_option,
    json_option,
    output_file_option,
    shown_default_option,
)
from vllm_output_rate.keys import keys
from vllm_output_rate.loadtest import measure
from vllm_output_rate.prove import prove
from vllm_output_rate.serve import serve
from vllm_output_rate.soak import soak

if TYPE_CHECKING:
    from vllm_output_rate.adapter.fidelity import StepScenario
    from vllm_output_rate.adapter.scenarios import Scenario

console = Console(width=None if sys.stdout.isatty() else 130)
LEVELS = click.Choice(["must", "should", "exact"])  # the gate's conformance levels (--level)


def _offline_env() -> None:
    """Nothing is ever fetched from a model hub (the project writes its own tiny model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _path_option(help_text: str) -> Any:
    """The repeatable ``--path DIR`` option (parameter ``paths``, a tuple of existing
    directories, empty when not given): put first on the import path (a package's own
    directory stands for the one above it, ``gate_plan.import_dirs``)."""
    return click.option("--path", "paths", multiple=True, type=click.Path(exists=True, file_okay=False), help=help_text)


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
    from vllm_output_rate import manifest

    try:
        found = manifest.find(Path("."))
        if found is None:
            return
        ctx.default_map = {"conform": manifest.conform_defaults(*found)}
    except manifest.ManifestError as exc:
        raise click.UsageError(f"{exc}\nFix the candidate manifest (or run outrate conform elsewhere).") from None
    ctx.obj = {"manifest": f"{found[0].name} [tool.outrate]"}


@main.command()
@click.option(
    "--scheduler-cls",
    default=None,
    metavar="DOTTED.PATH",
    help="Scheduler class under test (sync); default: the reference RateLimitedScheduler.",
)
@click.option(
    "--async-scheduler-cls",
    default=None,
    metavar="DOTTED.PATH",
    help="Async scheduler class under test; default: the reference's async class when "
    "--scheduler-cls is the reference. Without it the async checks are NOT TESTED (exit 2) "
    "unless --sync-only is given.",
)
@shown_default_option(
    "--level",
    LEVELS,
    "should",
    "must: the article's promises and the bound; should: also its design rules, every open "
    "choice accepted; exact: step identity with this project's spec (white-box).",
)
@flag_option("--sync-only", "Judge the sync class alone (the async checks are left out).")
@click.option(
    "--config-style",
    "config_style",
    default="additional-config",
    show_default=True,
    metavar="additional-config|engine-args|hook:pkg.module.function",
    help="How the candidate is configured: additional_config['output_rate'], the article's engine "
    "flags through vLLM's own EngineArgs parser, or a function (vllm_config, rates) -> None.",
)
@flag_option(
    "--burst-configurable",
    "The candidate reads burst_ms; otherwise every scenario uses the article's fixed 100 ms.",
)
@flag_option(
    "--integer-rates",
    "The candidate takes integer rates only (the article's flags); scenarios draw integers.",
)
@flag_option(
    "--rate-change",
    "R21: the candidate reloads output_rate.rates_file without a restart; its rate-change rows "
    "then judge at every level (otherwise at exact only).",
)
@_path_option("Directory to put on the import path first (the candidate's source tree); repeatable.")
@flag_option("--no-spec-health", "Skip the spec-health checks (they never judge the candidate).")
@click.option(
    "--require-mode",
    "require_modes",
    multiple=True,
    type=click.Choice(["async", "lora", "priority", "prefix-caching", "no-chunked-prefill", "n>1"]),
    help="An engine mode the candidate must support: its refusal at start-up fails the run (otherwise a "
    "refused mode is reported in the mode matrix and its rows are not applicable); repeatable.",
)
@click.option("--profile", type=click.Choice(["quick", "ci", "release"]), default="ci", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed: the same seed replays the same run.")
@flag_option(
    "--mutants",
    "Also run the mutant catalogue (the reference's mutants, adapter/mutants.py, and those of "
    "each --mutants-from module) at --level; every mutant must be killed.",
)
@click.option(
    "--mutants-from",
    "mutants_from",
    multiple=True,
    metavar="MODULE",
    help="A mutant catalogue module on the import path (see --path) whose MUTANTS tuple of "
    "adapter.mutants.Mutant joins the hunt of --mutants; repeatable, e.g. "
    "--mutants --path tests/fixtures --mutants-from article_mutants.",
)
@flag_option(
    "--no-white-box",
    "With --mutants: hunt without the white-box (exact-level) checks, from what vLLM exposes only.",
)
@json_option()
@output_file_option("--junit", "junit_path", "Write a JUnit XML report here (one testcase per check and per mutant).")
@output_file_option("--markdown", "markdown_path", "Write the gate manifest as Markdown here.")
@counterexamples_option("Directory where failing scenarios are saved for replay.")
def conform(
    scheduler_cls,
    async_scheduler_cls,
    level,
    sync_only,
    config_style,
    burst_configurable,
    integer_rates,
    paths,
    no_spec_health,
    profile,
    seed,
    mutants,
    json_path,
    junit_path,
    markdown_path,
    counterexamples,
    no_white_box=False,
    rate_change=False,
    require_modes=(),
    mutants_from=(),
) -> None:
    """Run the conformance gate on a scheduler class at a level.

    Exit 0: every candidate check passed; 1: a candidate check failed (or a mutant
    survived); 2: some check was NOT TESTED; 3: spec health failed (the verdict cannot be
    trusted on this vLLM).
    """
    from vllm_output_rate import gate_plan
    from vllm_output_rate.adapter import gate_row

    sync_cls, async_scheduler_cls = _candidate_classes(scheduler_cls, async_scheduler_cls, sync_only, paths)
    started = time.monotonic()
    style, vllm_version = _import_gate(sync_cls, async_scheduler_cls, config_style, paths)
    if mutants:
        _check_mutant_modules(tuple(mutants_from))
    options = gate_row.GateOptions(
        scheduler_cls=sync_cls,
        async_scheduler_cls=async_scheduler_cls,
        level=level,
        profile=profile,
        seed=seed,
        style=style,
        integer_rates=integer_rates,
        burst_configurable=burst_configurable,
        sync_only=sync_only,
        spec_health=not no_spec_health,
        save_dir=counterexamples,
        rate_change=rate_change,
        paths=gate_plan.import_dirs(paths, (sync_cls, async_scheduler_cls)),
        require_modes=tuple(require_modes),
    )
    release_clause = _environment_first(options, vllm_version, config_style, json_path)
    with console.status("probing the candidate's configuration"):
        problem = gate_plan.fractional_rates_problem(options)
    if problem is not None:  # every fractional-rate scenario would read as a crash
        raise click.BadParameter(problem, param_hint="--integer-rates")
    results = _run_or_stop(
        gate_plan.plan(options), options, _conform_settings(options, vllm_version, config_style), json_path
    )
    code = _report_conform(
        results,
        options,
        vllm_version,
        config_style,
        paths,
        not no_white_box,
        tuple(mutants_from) if mutants else None,
        (json_path, junit_path, markdown_path),
        started,
        release_clause=release_clause,
    )
    _exit_now(code)


def _run_or_stop(plan: list[Any], options: Any, settings: dict[str, Any], json_path: Path | None) -> list[Any]:
    """``_run_with_modes``; if stock vLLM raised where the candidate did
    (``environment.EnvironmentFailure``), print the no-verdict paragraph and exit 3."""
    from vllm_output_rate import gate_environment
    from vllm_output_rate.adapter import environment

    try:
        return _run_with_modes(plan, options)
    except environment.EnvironmentFailure as failure:
        paragraph = environment.environment_paragraph(failure.what)
        _exit_now(gate_environment.stop_without_verdict(console, paragraph, json_path, settings))
        raise  # not reached: _exit_now ends the process


def _exit_now(code: int) -> None:
    """Exit without interpreter teardown: Z3's context destructors (boundary scenarios) were
    seen to hang at exit on a loaded machine after the verdict was printed and saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _environment_first(options: Any, vllm_version: str, config_style: str, json_path: Path | None) -> str | None:
    """Before any candidate row (``outrate/gate_environment.py``): the unsupported-release
    warning, printed once; stock vLLM's preflight in the harness; on an unsupported release
    the drift hunt. A failure prints one paragraph and exits 3 (no verdict, no
    counterexample). Returns the verdict-line clause of an unsupported release, or None."""
    from vllm_output_rate import gate_environment

    notice = gate_environment.version_notice(vllm_version)
    if notice is not None:
        console.print(escape_markup(notice), soft_wrap=True)
    settings = _conform_settings(options, vllm_version, config_style)
    paragraph = gate_environment.preflight(console)
    clause = None
    if paragraph is None:
        paragraph, clause = gate_environment.unsupported_release_drift(console, vllm_version)
    if paragraph is not None:
        _exit_now(gate_environment.stop_without_verdict(console, paragraph, json_path, settings))
    return clause


def _run_with_modes(plan: list[Any], options: Any) -> list[Any]:
    """Probe the candidate's engine modes (``outrate/gate_modes.py``), then run ``plan`` with
    the rows of refused modes not applicable and their scenarios left out; the ``modes`` row
    first. Says which manifest the settings came from, if any."""
    from vllm_output_rate import gate_modes
    from vllm_output_rate.adapter import modes

    manifest = (click.get_current_context().find_root().obj or {}).get("manifest")
    if manifest:
        console.print(f"settings from the candidate manifest {escape_markup(manifest)} (options given override it)")
    with console.status("building the candidate once per engine mode its rows use"):
        plan, modes_row, refused = gate_modes.probe(options, plan)
    with modes.refusing(refused):
        return [modes_row, *_run_plan(plan, options)]


def _report_conform(
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
    from vllm_output_rate.adapter import gate_row

    json_path, junit_path, markdown_path = report_paths
    level, profile = options.level, options.profile
    header = _conform_header(options, vllm_version, config_style)
    _print_results(results, header)
    _print_failures(results, _gate_command(options, config_style))

    mutant_rows = _run_mutants(profile, options.seed, level, white_box, mutants) if mutants is not None else []
    survivors = [m for m in mutant_rows if not m["killed"] and not m.get("not_judged")]
    checks_json = _checks_json(results)
    code = gate_row.exit_code(results)
    if survivors and code == 0:
        code = 1
    if json_path is not None:
        _write_json(
            json_path,
            {
                **_conform_settings(options, vllm_version, config_style),
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


def _conform_settings(options: Any, vllm_version: str, config_style: str) -> dict[str, Any]:
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


def _import_gate(
    sync_cls: str, async_scheduler_cls: str | None, config_style: str, paths: tuple[str, ...] = ()
) -> tuple[Any, str]:
    """Import vLLM and the classes under test (under a status line; ``paths``: the
    ``--path`` directories, for the hint when a class does not import), and resolve and
    check ``config_style``: ``(style, vLLM's version)``. A usage error (exit 2) stops the run."""
    with console.status("importing vLLM and the scheduler under test"):
        _import_candidates(sync_cls, async_scheduler_cls, paths)
        style = _config_style(config_style)
        _preflight_style(style)
        import vllm

        _quiet_vllm_logging()  # the gate builds hundreds of schedulers
    return style, vllm.__version__


def _quiet_vllm_logging() -> None:
    """Raise the ``vllm`` logger to ERROR (a higher level already set stays): outside a
    server vLLM configures no logging, so its per-engine-config INFO and WARNING records
    (block size, SSM cache type, Triton) would go to stderr between outrate's own lines."""
    logging.getLogger("vllm").setLevel(max(logging.getLogger("vllm").level, logging.ERROR))


def _write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2))


def _candidate_classes(
    scheduler_cls: str | None, async_scheduler_cls: str | None, sync_only: bool, paths: tuple[str, ...]
) -> tuple[str, str | None]:
    """Put ``paths`` first on the import path (and the children's ``PYTHONPATH``); the sync
    class (default: the reference) and the async one (default: the reference's with the
    reference, none with ``--sync-only``)."""
    from vllm_output_rate import gate_plan
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    _put_on_path(gate_plan.import_dirs(paths, (scheduler_cls, async_scheduler_cls)))
    sync_cls = scheduler_cls or REFERENCE_SCHEDULER
    if async_scheduler_cls is None and sync_cls == REFERENCE_SCHEDULER and not sync_only:
        async_scheduler_cls = REFERENCE_ASYNC_SCHEDULER
    if sync_only:
        async_scheduler_cls = None
    return sync_cls, async_scheduler_cls


def _put_on_path(paths: tuple[str, ...]) -> None:
    """Put ``paths`` first on the import path and on the children's ``PYTHONPATH``, in order."""
    for directory in reversed(paths):
        sys.path.insert(0, str(Path(directory).resolve()))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(directory).resolve()), os.environ.get("PYTHONPATH")])
        )


def _version_warning() -> str:
    """A header clause for an installed vLLM that is not a supported release ("" if it is);
    the warning itself is printed once, first (``_environment_first``)."""
    from vllm_output_rate.adapter.versions import installed_warning

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
    from vllm_output_rate.adapter import reports

    if junit_path is not None:
        reports.junit(junit_path, header, checks_json, mutant_rows)
    if markdown_path is not None:
        reports.markdown(markdown_path, header, checks_json, mutant_rows, _budget(profile))


def _import_candidates(sync_cls: str, async_scheduler_cls: str | None, paths: tuple[str, ...] = ()) -> None:
    """Import the classes under test; a click error naming the option if one cannot be
    judged (``gate_plan.candidate_class_problem``, shared with the pytest plugin), with the
    ``--path`` that would work when its package is not found (``gate_plan.package_hint``)."""
    from vllm_output_rate import gate_plan

    for path, hint in ((sync_cls, "--scheduler-cls"), (async_scheduler_cls, "--async-scheduler-cls")):
        problem = None if path is None else gate_plan.candidate_class_problem(path, gate_plan.package_hint(path, paths))
        if problem is not None:
            raise click.BadParameter(problem, param_hint=hint)


def _preflight_style(style: Any) -> None:
    """Configure a probe engine the way ``--config-style`` does, once, before any check: a gate
    set up wrong (e.g. engine-args with a candidate that adds no rate flags) is a usage error
    (exit 2), not a rejected candidate."""
    if style is None:
        return
    from vllm_output_rate.adapter.engine_shape import EngineShape

    probe = EngineShape(output_rate={"default_tokens_per_s": 10, "user_tokens_per_s": {"u0": 5}})
    try:
        style.build_vllm_config(probe)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--config-style") from None


class _Aside:
    """The proofs/ spec-health rows (``proofs.gate_checks``: the model checker's quick
    scopes and the Z3 proofs, which need neither vLLM nor the candidate), run in one spawned
    worker process from the start of a gate run (``gate_checks.serve_aside``), on the
    second core, beside the candidate checks."""

    def __init__(self, names: list[str]) -> None:
        import multiprocessing

        from vllm_output_rate.proofs import gate_checks

        context = multiprocessing.get_context("spawn")  # a clean process: no vLLM, no candidate
        self.conn, worker_end = context.Pipe(duplex=False)
        self.proc = context.Process(target=gate_checks.serve_aside, args=(names, worker_end), daemon=True)
        self.proc.start()
        worker_end.close()
        self.names: set[str] = set(names)
        self.received: dict[str, Any] = {}

    def result(self, name: str) -> Any:
        """The worker's ``CheckResult`` of row ``name``, or None if ``name`` is not run here
        or the worker ended before sending it (it died: the caller runs the row itself)."""
        while name in self.names and name not in self.received:
            try:
                got, result = self.conn.recv()
            except (EOFError, OSError):
                self.names.clear()
                return None
            self.received[got] = result
        return self.received.pop(name, None)

    def close(self) -> None:
        """Stop the worker if it still runs (the gate run ended early) and wait for it."""
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join()
        self.conn.close()


def _run_plan(plan: list[Any], options: Any) -> list[Any]:
    """Run the planned checks in order with one progress bar each; their ``CheckResult``s.

    The proofs/ spec-health rows run from the start in a worker (``_Aside``) and are
    reported in their place in the plan, as if run there; a row the worker did not deliver
    is run here."""
    from vllm_output_rate.adapter import gate_row
    from vllm_output_rate.proofs import gate_checks

    rows = {spec.name for spec in gate_checks.spec_health_checks()}
    names = [item.row.name for item in plan if item.skip is None and item.row.name in rows]
    aside = _Aside(names) if names else None
    results = []
    progress = bar_progress(console, 28)
    try:
        with progress:
            for item in plan:
                total = item.row.examples(options) if item.skip is None else 1
                task = progress.add_task(item.row.name, total=total)
                result = aside.result(item.row.name) if aside is not None else None
                if result is None:
                    result = gate_row.run_planned(item, options, functools.partial(progress.advance, task))
                progress.update(task, completed=total)
                results.append(result)
    finally:
        if aside is not None:
            aside.close()
    return results


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
        from vllm_output_rate.gate_modes import mode_table

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
    from vllm_output_rate.adapter.budgets import gate_budget

    return gate_budget(profile).as_json()


def escape_markup(text: str | None) -> str:
    """``text`` with rich markup escaped (counterexamples hold brackets)."""
    from rich.markup import escape

    return escape(text or "")


def _config_style(text: str):
    """The ``--config-style`` object, or a click error naming the bad value."""
    if text == "additional-config":
        return None
    try:
        from vllm_output_rate.adapter.configstyle import parse_config_style

        return parse_config_style(text)
    except (ValueError, ImportError) as exc:
        raise click.BadParameter(str(exc), param_hint="--config-style") from None


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
    from vllm_output_rate.gate_modes import not_applicable_clause, warning_clause

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


def _check_mutant_modules(modules: tuple[str, ...]) -> None:
    """Load the ``--mutants-from`` catalogue modules before any check runs: a module that
    does not load is a usage error naming it (``adapter/mutation.load_mutants``)."""
    from vllm_output_rate.adapter.mutation import catalogue

    try:
        catalogue(modules)
    except (ImportError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--mutants-from") from None


def _run_mutants(profile: str, seed: int, level: str, white_box: bool, modules: tuple[str, ...]) -> list[dict]:
    """Hunt every mutant of the catalogue (``adapter/mutation.catalogue``: the reference's and
    those of the catalogue ``modules``, ``--mutants-from``) with the gate's candidate checks
    at ``level`` (without the exact-level white-box checks unless ``white_box``); print the
    kill table and the median and maximum seconds to kill."""
    from vllm_output_rate.adapter.mutation import catalogue, kill

    mutants = catalogue(modules)  # loaded once already (_check_mutant_modules)
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
    """The kill table of ``_run_mutants``: one row per mutant (``Mutant.as_json`` rows)."""
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
    import statistics

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


@main.command()
@click.argument("scenario_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--scheduler-cls",
    default=None,
    metavar="DOTTED.PATH",
    help="Class to run the check on; default: the class the file names (the class the gate judged; stock "
    "vLLM for a base-fidelity scenario). Give the fixed class here to see the check pass.",
)
@click.option(
    "--level",
    type=LEVELS,
    default=None,
    help="Level the check judges at; default: the file's (the gate's --level for the scenario checks); "
    "exact for a file that names no check.",
)
@click.option(
    "--config-style",
    "config_style",
    default=None,
    help="How the class is configured (as for outrate conform); default: the file's, else additional-config.",
)
@_path_option("Directory to put on the import path first; repeatable; default: the file's.")
@click.option(
    "--base-model",
    "base_version",
    default=None,
    metavar="VERSION",
    help="Step scenarios: judge against the base-model rows of this vLLM release (spec/versions.py), "
    "as `outrate drift --base-model` did; default: the installed vLLM's own rows.",
)
def replay(scenario_file, scheduler_cls, level, config_style, paths, base_version) -> None:
    """Re-run the check that saved a counterexample of `outrate conform`; exit 1 if it fails.

    A file of `outrate conform --counterexamples` names the check that saved it, its level
    and rule, the class, --path, configuration style, profile, seed and vLLM release
    (adapter/counterexample.py); with no option, replay re-runs exactly that check on that
    scenario and ends `FAIL [level] rule: ...` as the gate's row did, or `PASS` saying the
    class now keeps that rule. An option given here overrides the file's value.

    A file without a check (a bare scenario, as outrate 0.1.0 saved them, or `outrate
    drift`'s) is judged by its keys: ``rates_tokens_per_s`` + ``requests``: a rate-limit
    scenario against the spec limiter; ``config`` + ``events``: a step scenario against the
    step spec (white box with the feature on, base fidelity with it off).

    Exit 0: it passes; 1: it fails; 2: a usage error, e.g. a file edited to a value no
    saved scenario holds (the message names the field and the value; nothing runs).
    """
    from vllm_output_rate.adapter import counterexample
    from vllm_output_rate.adapter.scenario_file import ScenarioFileError

    _quiet_vllm_logging()  # between the scenario and the verdict
    data = _read_json_file(scenario_file)
    if not counterexample.is_counterexample(data):
        _replay_bare(scenario_file, data, scheduler_cls, level or "exact", config_style, paths, base_version)
        return
    try:
        loaded = counterexample.load(data, scenario_file.name)
    except (counterexample.CounterexampleError, ScenarioFileError) as exc:
        raise click.BadParameter(f"{scenario_file}: {exc}", param_hint="SCENARIO_FILE") from None
    if base_version is not None and loaded.kind.row != "base-fidelity":
        raise click.BadParameter(
            "only a step scenario (base fidelity, white box) follows a base model", param_hint="--base-model"
        )
    paths = paths or _file_paths(scenario_file, loaded.candidate.get("paths", []))
    cls = scheduler_cls or counterexample.default_class(loaded)
    _put_on_path(_checked_class(cls, paths))
    style = _config_style(config_style or loaded.gate.get("config_style", "additional-config"))
    judged = level or loaded.check["judged_at"]
    _replay_header(scenario_file, loaded, cls, judged)
    failure = counterexample.replay(loaded, cls, judged, style, _base_model(base_version))
    if failure is not None:
        console.print(f"[bold red]FAIL[/] {escape_markup(failure)}", soft_wrap=True)
        sys.exit(1)
    rule, failed_level = loaded.check.get("rule"), loaded.check.get("failed_level")
    keeps = f"now keeps {rule} on this scenario" if rule else "now passes this check on this scenario"
    if rule == "crash":  # the gate's crash row: the candidate raised
        keeps = "runs this scenario without crashing"
    said = f" (the gate's row failed: [{failed_level}] {rule})" if rule and failed_level else ""
    console.print(f"[green]PASS[/] {loaded.check['name']}: {cls.rpartition('.')[2]} {keeps}{escape_markup(said)}")


def _read_json_file(scenario_file: Path) -> Any:
    """The parsed JSON of ``scenario_file``; a usage error naming it if it is not JSON."""
    try:
        return json.loads(scenario_file.read_text())
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{scenario_file} is not JSON: {exc}", param_hint="SCENARIO_FILE") from None


def _file_paths(scenario_file: Path, saved: list[str]) -> tuple[str, ...]:
    """The ``--path`` directories a counterexample file names (relative to the working
    directory as saved); a usage error naming one that does not exist here."""
    for directory in saved:
        if not Path(directory).is_dir():
            raise click.BadParameter(
                f"{scenario_file} was saved with --path {directory}, which is not a directory here: run replay from "
                "the directory the gate ran in, or give --path DIR (the directory that holds the candidate's package)",
                param_hint="--path",
            )
    return tuple(saved)


def _checked_class(cls: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Put ``paths`` on the import path (``gate_plan.import_dirs``) and import ``cls``; a usage
    error naming the --path that would work if it cannot be. Returns the directories used."""
    from vllm_output_rate import gate_plan
    from vllm_output_rate.adapter.harness import load_class

    dirs = gate_plan.import_dirs(paths, (cls,))
    for directory in reversed(dirs):
        sys.path.insert(0, str(Path(directory).resolve()))
    try:
        load_class(cls)
    except (ValueError, ImportError) as exc:
        hint = gate_plan.package_hint(cls, paths) if "No module named" in str(exc) else ""
        raise click.BadParameter(f"{exc}{hint}", param_hint="--scheduler-cls") from None
    return dirs


def _base_model(base_version: str | None) -> Any:
    """The ``VllmVersionProfile`` named by ``--base-model`` (None if not given); a usage error if unknown."""
    if base_version is None:
        return None
    from vllm_output_rate.adapter.versions import profile_named

    try:
        return profile_named(base_version)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-model") from None


def _replay_header(scenario_file: Path, loaded: Any, cls: str, judged: str) -> None:
    """What ``outrate replay`` re-runs: the check, its level, what it compares with, the class,
    the run that saved it (a note if the installed vLLM differs) and the scenario."""
    import vllm

    check, gate = loaded.check, loaded.gate
    console.print(
        f"replaying {check['name']} (level {judged}; compares with {check['compares_with']}) on "
        f"{cls.rpartition('.')[2]} ({cls})",
        soft_wrap=True,
    )
    console.print(
        f"saved by outrate {gate.get('outrate')} with vLLM {gate.get('vllm')}: profile {gate.get('profile')}, seed "
        f"{gate.get('seed')}, config {gate.get('config_style')}, burst {gate.get('burst')}"
        f"{', integer rates' if gate.get('integer_rates') else ''}; the gate's row: "
        f"{escape_markup(check.get('failure') or '')}",
        soft_wrap=True,
    )
    if gate.get("vllm") != vllm.__version__:
        console.print(
            f"[yellow]note: {scenario_file.name} was saved with vLLM {gate.get('vllm')}; this is vLLM "
            f"{vllm.__version__}: the verdict may differ[/]"
        )
    for line in loaded.lines:
        console.print(f"  {escape_markup(line)}")


def _replay_bare(scenario_file, data, scheduler_cls, level, config_style, paths, base_version) -> None:
    """``outrate replay`` of a file that names no check (a bare scenario): judged by its keys."""
    from vllm_output_rate.adapter import fidelity
    from vllm_output_rate.adapter.scenario_file import ScenarioFileError
    from vllm_output_rate.adapter.scenarios import Scenario

    keys = set(data) if isinstance(data, dict) else set()
    if not ({"config", "events"} <= keys or {"rates_tokens_per_s", "requests"} <= keys):
        found = sorted(keys) if isinstance(data, dict) else type(data).__name__
        raise click.BadParameter(
            f"{scenario_file} is neither a counterexample file of outrate conform (key format), a rate-limit "
            f"scenario (keys rates_tokens_per_s, requests) nor a step scenario (keys config, events); found {found}",
            param_hint="SCENARIO_FILE",
        )
    kind = "step" if {"config", "events"} <= keys else "rate-limit"
    text = json.dumps(data)
    try:
        scenario = fidelity.StepScenario.from_json(text) if kind == "step" else Scenario.from_json(text)
    except ScenarioFileError as exc:  # names the field and the bad value
        raise click.BadParameter(
            f"{scenario_file}: not a valid {kind} scenario: {exc}", param_hint="SCENARIO_FILE"
        ) from None
    except (TypeError, KeyError, ValueError, AssertionError) as exc:
        raise click.BadParameter(
            f"{scenario_file}: not a valid {kind} scenario: {exc!r}", param_hint="SCENARIO_FILE"
        ) from None
    if scheduler_cls is not None:
        _checked_class(scheduler_cls, paths)
    else:
        _put_on_path(paths)
    style = _config_style(config_style or "additional-config")
    base = _base_model(base_version)
    if scenario_file.name.startswith("counterexample-"):  # outrate conform's name: saved before files named a check
        console.print(
            f"[yellow]note: {scenario_file.name} names no check (saved by outrate 0.1.0 or earlier): it is judged "
            f"as a {kind} scenario at level {level}, which may not be the check that saved it; run outrate conform "
            "again with this release to save a file that replays its check[/]",
            soft_wrap=True,
        )
    if isinstance(scenario, Scenario):
        if base is not None:
            raise click.BadParameter(
                "only a step scenario (base fidelity, white box) follows a base model", param_hint="--base-model"
            )
        _replay_rate_limit(scenario, scheduler_cls, level, style)
    else:
        _replay_step(scenario, scheduler_cls, style, base)


def _replay_rate_limit(scenario: Scenario, scheduler_cls: str | None, level: str, style: Any) -> None:
    """``outrate replay`` of a rate-limit scenario (adapter/scenarios.py); exit 1 if it fails."""
    from rich.markup import escape

    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
    from vllm_output_rate.adapter.rule_naming import named_verdict

    cls = scheduler_cls or (REFERENCE_ASYNC_SCHEDULER if scenario.async_scheduling else REFERENCE_SCHEDULER)
    console.print(f"rate-limit scenario on {cls}")
    for line in scenario.events():
        console.print(f"  {escape(line)}")
    if not scenario.feature_on:
        from vllm_output_rate.adapter.feature_off import run_feature_off

        verdict = run_feature_off(cls, scenario, style)
    else:
        verdict = named_verdict(cls, scenario, level, style)  # named by the rule it breaks
    if verdict.failure:
        console.print(
            f"[bold red]FAIL[/] {escape(f'[{verdict.level}]')} {verdict.rule}: step {verdict.step}: "
            f"{escape(verdict.failure)}"
        )
        sys.exit(1)
    console.print(
        f"[green]PASS[/] {verdict.steps} steps on {cls}; sampling dispatches per user: {verdict.sampled_per_user}"
    )


def _replay_step(scenario: StepScenario, scheduler_cls: str | None, style: Any, base: Any = None) -> None:
    """``outrate replay`` of a step scenario (adapter/fidelity.py): white box with the feature
    on, base fidelity with it off (V-rules of release ``base``, a ``VllmVersionProfile``;
    None: the installed vLLM's); exit 1 if it fails."""
    from rich.markup import escape

    from vllm_output_rate.adapter import fidelity
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
    from vllm_output_rate.adapter.whitebox import run_white_box

    async_mode = scenario.config.async_scheduling
    if scenario.config.rate_limited:
        check = "white box"
        cls = scheduler_cls or (REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER)
        verdict = run_white_box(scenario, cls, style=style)
    else:
        check = "base fidelity"
        cls = scheduler_cls or fidelity.base_scheduler_cls(async_mode)
        verdict = fidelity.run_step_scenario(cls, scenario, base=base)
    console.print(f"step scenario ({check}: spec vs {cls})")
    for line in fidelity.describe_failure(scenario, verdict):
        console.print(f"  {escape(line)}")
    if verdict.failure:
        rule = getattr(verdict, "rule", None) if check == "base fidelity" else None  # a V-rule
        subject = "stock vLLM" if cls == fidelity.base_scheduler_cls(async_mode) else cls.rpartition(".")[2]
        failure = verdict.failure.replace(": vLLM ", f": {subject} ")  # the class by its name (issue 31)
        console.print(
            f"[bold red]FAIL[/] event {verdict.event_index}: {escape(failure)}" + (f" ({rule})" if rule else "")
        )
        sys.exit(1)
    console.print(f"[green]PASS[/] {verdict.events} events, {verdict.steps} steps: {cls} agrees with the spec")


@main.command()
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
    from rich.markup import escape

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
        _write_json(
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
    from vllm_output_rate.adapter.versions import installed_version, installed_warning, profile_named

    with console.status("importing vLLM"):
        for module in ("vllm.v1.core.sched.async_scheduler", "vllm.v1.core.sched.scheduler"):
            importlib.import_module(module)

        _quiet_vllm_logging()
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
    from rich.markup import escape

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
    from rich.markup import escape

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


@main.command("check-trace", context_settings={"ignore_unknown_options": True})
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@flag_option("--partial", "The engine still writes FILE: skip an unterminated last line.")
def check_trace_cmd(file, partial) -> None:
    """Check an engine-side event trace (outrate serve --trace-path FILE): per run and per user the
    rates over busy periods, every violation; exit 1 on a violation (or no run), 2 if unreadable."""
    from vllm_output_rate.adapter.trace_check import main as trace_main

    sys.exit(trace_main([str(file)] + (["--partial"] if partial else [])))


@main.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def tiny_model(directory) -> None:
    """Write the tiny Llama-style model config (dummy weights) into DIRECTORY.

    DIRECTORY is created if missing; one that cannot be created or written is a usage
    error (exit 2) naming it.
    """
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


for _command in (bench, serve, measure, prove, check, soak, keys):
    main.add_command(_command)


if __name__ == "__main__":
    main()
