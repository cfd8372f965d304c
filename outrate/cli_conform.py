"""``outrate conform``: the conformance gate on a scheduler class at a level. Its options, the
candidate classes and configuration style checked before any row, stock vLLM's preflight,
the engine-mode probe, and the planned rows run under progress bars (the proofs/
spec-health rows in a worker beside them); ``cli_conform_report.py`` prints the outcome.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from pathlib import Path
from typing import Any

import click

from vllm_output_rate import gate_environment, gate_modes
from vllm_output_rate.adapter import environment
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.cli_common import (
    LEVELS,
    console,
    escape_markup,
    exit_now,
    path_option,
    put_on_path,
    quiet_vllm_logging,
    style_from_option,
)
from vllm_output_rate.cli_conform_report import conform_settings, report_conform
from vllm_output_rate.cli_mutants import check_mutant_modules
from vllm_output_rate.clitools import (
    bar_progress,
    counterexamples_option,
    flag_option,
    json_option,
    output_file_option,
    shown_default_option,
)


@click.command()
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
@path_option("Directory to put on the import path first (the candidate's source tree); repeatable.")
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
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    sync_cls, async_scheduler_cls = _candidate_classes(scheduler_cls, async_scheduler_cls, sync_only, paths)
    started = time.monotonic()
    style, vllm_version = _import_gate(sync_cls, async_scheduler_cls, config_style, paths)
    if mutants:
        check_mutant_modules(tuple(mutants_from))
    options = _gate_options(
        (sync_cls, async_scheduler_cls),
        style,
        paths,
        counterexamples,
        level=level,
        profile=profile,
        seed=seed,
        integer_rates=integer_rates,
        burst_configurable=burst_configurable,
        sync_only=sync_only,
        spec_health=not no_spec_health,
        rate_change=rate_change,
        require_modes=tuple(require_modes),
    )
    release_clause = _environment_first(options, vllm_version, config_style, json_path)
    _refuse_fractional_rates(options)
    results = _run_or_stop(
        gate_plan.plan(options), options, conform_settings(options, vllm_version, config_style), json_path
    )
    code = report_conform(
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
    exit_now(code)


def _gate_options(
    classes: tuple[str, str | None], style: Any, paths: tuple[str, ...], counterexamples: Path, **settings: Any
) -> Any:
    """The gate run's ``gate_row.GateOptions``: the sync and async ``classes`` under test, the
    ``--config-style`` object, the ``--path`` directories (with the classes' own,
    ``gate_plan.import_dirs``), where counterexamples are saved, and the run's other
    ``settings`` (level, profile, seed, ...) as ``outrate conform`` was given them."""
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    # deferred: gate_row imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import gate_row

    sync_cls, async_scheduler_cls = classes
    return gate_row.GateOptions(
        scheduler_cls=sync_cls,
        async_scheduler_cls=async_scheduler_cls,
        style=style,
        save_dir=counterexamples,
        paths=gate_plan.import_dirs(paths, classes),
        **settings,
    )


def _refuse_fractional_rates(options: Any) -> None:
    """Probe the candidate's configuration once (``gate_plan.fractional_rates_problem``): a
    usage error naming ``--integer-rates`` if the candidate takes no fractional rate."""
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    with console.status("probing the candidate's configuration"):
        problem = gate_plan.fractional_rates_problem(options)
    if problem is not None:  # every fractional-rate scenario would read as a crash
        raise click.BadParameter(problem, param_hint="--integer-rates")


def _run_or_stop(plan: list[Any], options: Any, settings: dict[str, Any], json_path: Path | None) -> list[Any]:
    """``_run_with_modes``; if stock vLLM raised where the candidate did
    (``environment.EnvironmentFailure``), print the no-verdict paragraph and exit 3."""
    try:
        return _run_with_modes(plan, options)
    except environment.EnvironmentFailure as failure:
        paragraph = environment.environment_paragraph(failure.what)
        exit_now(gate_environment.stop_without_verdict(console, paragraph, json_path, settings))
        raise  # not reached: exit_now ends the process


def _environment_first(options: Any, vllm_version: str, config_style: str, json_path: Path | None) -> str | None:
    """Before any candidate row (``outrate/gate_environment.py``): the unsupported-release
    warning, printed once; stock vLLM's preflight in the harness; on an unsupported release
    the drift hunt. A failure prints one paragraph and exits 3 (no verdict, no
    counterexample). Returns the verdict-line clause of an unsupported release, or None."""
    notice = gate_environment.version_notice(vllm_version)
    if notice is not None:
        console.print(escape_markup(notice), soft_wrap=True)
    settings = conform_settings(options, vllm_version, config_style)
    paragraph = gate_environment.preflight(console)
    clause = None
    if paragraph is None:
        paragraph, clause = gate_environment.unsupported_release_drift(console, vllm_version)
    if paragraph is not None:
        exit_now(gate_environment.stop_without_verdict(console, paragraph, json_path, settings))
    return clause


def _run_with_modes(plan: list[Any], options: Any) -> list[Any]:
    """Probe the candidate's engine modes (``outrate/gate_modes.py``), then run ``plan`` with
    the rows of refused modes not applicable and their scenarios left out; the ``modes`` row
    first. Says which manifest the settings came from, if any."""
    # deferred: adapter.modes imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import modes

    manifest = (click.get_current_context().find_root().obj or {}).get("manifest")
    if manifest:
        console.print(f"settings from the candidate manifest {escape_markup(manifest)} (options given override it)")
    with console.status("building the candidate once per engine mode its rows use"):
        plan, modes_row, refused = gate_modes.probe(options, plan)
    with modes.refusing(refused):
        return [modes_row, *_run_plan(plan, options)]


def _import_gate(
    sync_cls: str, async_scheduler_cls: str | None, config_style: str, paths: tuple[str, ...] = ()
) -> tuple[Any, str]:
    """Import vLLM and the classes under test (under a status line; ``paths``: the
    ``--path`` directories, for the hint when a class does not import), and resolve and
    check ``config_style``: ``(style, vLLM's version)``. A usage error (exit 2) stops the run."""
    with console.status("importing vLLM and the scheduler under test"):
        _import_candidates(sync_cls, async_scheduler_cls, paths)
        style = style_from_option(config_style)
        _preflight_style(style)
        import vllm  # deferred: vLLM costs ~7 s to import; only a gate run needs it

        quiet_vllm_logging()  # the gate builds hundreds of schedulers
    return style, vllm.__version__


def _candidate_classes(
    scheduler_cls: str | None, async_scheduler_cls: str | None, sync_only: bool, paths: tuple[str, ...]
) -> tuple[str, str | None]:
    """Put ``paths`` first on the import path (and the children's ``PYTHONPATH``); the sync
    class (default: the reference) and the async one (default: the reference's with the
    reference, none with ``--sync-only``)."""
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    put_on_path(gate_plan.import_dirs(paths, (scheduler_cls, async_scheduler_cls)))
    sync_cls = scheduler_cls or REFERENCE_SCHEDULER
    if async_scheduler_cls is None and sync_cls == REFERENCE_SCHEDULER and not sync_only:
        async_scheduler_cls = REFERENCE_ASYNC_SCHEDULER
    if sync_only:
        async_scheduler_cls = None
    return sync_cls, async_scheduler_cls


def _import_candidates(sync_cls: str, async_scheduler_cls: str | None, paths: tuple[str, ...] = ()) -> None:
    """Import the classes under test; a click error naming the option if one cannot be
    judged (``gate_plan.candidate_class_problem``, shared with the pytest plugin), with the
    ``--path`` that would work when its package is not found (``gate_plan.package_hint``),
    or if it is in the wrong slot (``gate_plan.slot_problem``: an AsyncScheduler subclass
    goes to ``--async-scheduler-cls``, any other scheduler to ``--scheduler-cls``)."""
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    slots = ((sync_cls, "--scheduler-cls", False), (async_scheduler_cls, "--async-scheduler-cls", True))
    for path, hint, async_slot in slots:
        if path is None:
            continue
        problem = gate_plan.candidate_class_problem(path, gate_plan.package_hint(path, paths))
        if problem is not None:
            raise click.BadParameter(problem, param_hint=hint)
        problem = gate_plan.slot_problem(path, f"{hint} {path}", async_slot, "--async-scheduler-cls")
        if problem is not None:
            raise click.UsageError(problem)


def _preflight_style(style: Any) -> None:
    """Configure a probe engine the way ``--config-style`` does, once, before any check: a gate
    set up wrong (e.g. engine-args with a candidate that adds no rate flags) is a usage error
    (exit 2), not a rejected candidate."""
    if style is None:
        return

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
        # deferred: proofs.gate_checks imports the gate's rows (Hypothesis) at its top
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
    # deferred: gate_row imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import gate_row

    # deferred: proofs.gate_checks imports the gate's rows (Hypothesis) at its top
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
