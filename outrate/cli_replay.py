"""``outrate replay``: re-run the check that saved a counterexample of ``outrate conform``
(``adapter/counterexample.py``), or judge a bare rate-limit or step scenario by its keys.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape

from vllm_output_rate.adapter.scenario_file import ScenarioFileError
from vllm_output_rate.adapter.scenarios import Scenario
from vllm_output_rate.adapter.versions import profile_named
from vllm_output_rate.cli_common import (
    LEVELS,
    console,
    escape_markup,
    path_option,
    put_on_path,
    quiet_vllm_logging,
    style_from_option,
)

if TYPE_CHECKING:
    from vllm_output_rate.adapter.fidelity import StepScenario


@click.command()
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
@path_option("Directory to put on the import path first; repeatable; default: the file's.")
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
    # deferred: adapter.counterexample imports the gate's rows (Hypothesis) at its top
    from vllm_output_rate.adapter import counterexample

    quiet_vllm_logging()  # between the scenario and the verdict
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
    put_on_path(_checked_class(cls, paths))
    style = style_from_option(config_style or loaded.gate.get("config_style", "additional-config"))
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
    error naming the --path that would work if its module is not found, or naming the module
    and the exception if the module raises while it is imported. Returns the directories used."""
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; kept off `outrate --help`
    from vllm_output_rate import gate_plan

    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import load_class

    dirs = gate_plan.import_dirs(paths, (cls,))
    for directory in reversed(dirs):
        sys.path.insert(0, str(Path(directory).resolve()))
    try:
        load_class(cls)
    except (ValueError, ImportError) as exc:  # a raising module: candidate_import.CandidateImportError
        hint = gate_plan.package_hint(cls, paths) if isinstance(exc, ModuleNotFoundError) else ""
        raise click.BadParameter(f"{exc}{hint}", param_hint="--scheduler-cls") from None
    return dirs


def _base_model(base_version: str | None) -> Any:
    """The ``VllmVersionProfile`` named by ``--base-model`` (None if not given); a usage error if unknown."""
    if base_version is None:
        return None

    try:
        return profile_named(base_version)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-model") from None


def _replay_header(scenario_file: Path, loaded: Any, cls: str, judged: str) -> None:
    """What ``outrate replay`` re-runs: the check, its level, what it compares with, the class,
    the run that saved it (a note if the installed vLLM differs) and the scenario."""
    import vllm  # deferred: vLLM costs ~7 s to import; only a replay needs it

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
    # deferred: adapter.fidelity imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import fidelity

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
        put_on_path(paths)
    style = style_from_option(config_style or "additional-config")
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
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    # deferred: adapter.rule_naming imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.rule_naming import named_verdict

    cls = scheduler_cls or (REFERENCE_ASYNC_SCHEDULER if scenario.async_scheduling else REFERENCE_SCHEDULER)
    console.print(f"rate-limit scenario on {cls}")
    for line in scenario.events():
        console.print(f"  {escape(line)}")
    if not scenario.feature_on:
        # deferred: adapter.feature_off imports Hypothesis at its top
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
    # deferred: adapter.fidelity imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter import fidelity

    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    # deferred: adapter.whitebox imports Hypothesis at its top; kept off `outrate --help`
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
