"""The ``outrate`` command line (click + rich)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vllm_output_rate import __version__

console = Console(width=None if sys.stdout.isatty() else 130)


def _offline_env() -> None:
    """Nothing is ever fetched from a model hub (the project writes its own tiny model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@click.group()
@click.version_option(__version__, prog_name="outrate")
def main() -> None:
    """vllm-output-rate: per-user output-token rate limiting in the vLLM V1 scheduler."""
    _offline_env()


@main.command()
@click.option("--scheduler-cls", default=None, metavar="DOTTED.PATH",
              help="Scheduler class under test (sync); default: the reference RateLimitedScheduler.")
@click.option("--async-scheduler-cls", default=None, metavar="DOTTED.PATH",
              help="Async scheduler class under test; default: the reference's async class when "
                   "--scheduler-cls is the reference; otherwise the async checks run only if this is given.")
@click.option("--profile", type=click.Choice(["quick", "ci", "release"]), default="ci", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed: the same seed replays the same run.")
@click.option("--mutants", is_flag=True, help="Also run the mutant catalogue; every mutant must be killed.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the results as JSON here.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here (one testcase per check and per mutant).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the gate manifest as Markdown here.")
@click.option("--counterexamples", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="Directory where failing scenarios are saved for replay.")
def conform(scheduler_cls, async_scheduler_cls, profile, seed, mutants, json_path, junit_path, markdown_path,
            counterexamples) -> None:
    """Run the conformance gate on a scheduler class; exit 1 if any check fails or a mutant survives."""
    from vllm_output_rate.adapter import conform as gate
    from vllm_output_rate.adapter import reports
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, load_class

    sync_cls = scheduler_cls or REFERENCE_SCHEDULER
    if async_scheduler_cls is None and sync_cls == REFERENCE_SCHEDULER:
        async_scheduler_cls = REFERENCE_ASYNC_SCHEDULER
    budget = gate.PROFILES[profile]
    started = time.monotonic()
    with console.status("importing vLLM and the scheduler under test"):
        for path in {sync_cls, async_scheduler_cls} - {None}:
            try:
                load_class(path)
            except (ValueError, ImportError) as exc:
                raise click.BadParameter(str(exc), param_hint="--scheduler-cls") from None
        import vllm

        # The gate builds hundreds of schedulers; vLLM's per-construction warnings are noise here.
        logging.getLogger("vllm").setLevel(max(logging.getLogger("vllm").level, logging.ERROR))

    def scheduler_check(cls, async_mode, pressured):
        examples = budget["pressured"] if pressured else budget["async" if async_mode else "sync"]
        return examples, lambda tick: gate.check_scheduler(cls, async_mode, examples, budget["max_steps"], seed,
                                                           tick, counterexamples, pressured=pressured)

    plan = [("limiter-differential", budget["limiter"],
             lambda tick: gate.check_limiter_differential(budget["limiter"], seed, tick))]
    modes = [(sync_cls, False)] + ([(async_scheduler_cls, True)] if async_scheduler_cls else [])
    for cls, async_mode in modes:
        tag = "async" if async_mode else "sync"
        for pressured, prefix in ((False, "rate-limit"), (True, "invariants")):
            plan.append((f"{prefix}/{tag}", *scheduler_check(cls, async_mode, pressured)))
    if async_scheduler_cls is None:
        console.print("async checks not run: give --async-scheduler-cls to judge an async class")
    step_budget = gate.STEP_SPEC_PROFILES[profile]
    plan += [
        ("base-fidelity/sync", step_budget["base_sync"],
         lambda tick: gate.check_base_fidelity(False, step_budget["base_sync"], seed, tick, counterexamples)),
        ("base-fidelity/async", step_budget["base_async"],
         lambda tick: gate.check_base_fidelity(True, step_budget["base_async"], seed, tick, counterexamples)),
        ("white-box/sync", step_budget["white_sync"],
         lambda tick: gate.check_white_box(sync_cls, False, step_budget["white_sync"], seed, tick, counterexamples)),
    ]
    if async_scheduler_cls is not None:
        plan.append(("white-box/async", step_budget["white_async"],
                     lambda tick: gate.check_white_box(async_scheduler_cls, True, step_budget["white_async"], seed,
                                                       tick, counterexamples)))

    from vllm_output_rate.proofs.modelcheck import profile_scopes

    plan += [("proofs/z3", 6, gate.check_proofs),
             ("model-check/quick", len(profile_scopes("quick")), gate.check_model)]

    results = []
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    with progress:
        for name, total, run in plan:
            task = progress.add_task(name, total=total)
            t0 = time.monotonic()
            result = run(lambda: progress.advance(task))
            result.seconds = time.monotonic() - t0
            progress.update(task, completed=total)
            results.append(result)

    header = (f"outrate conform -- vLLM {vllm.__version__} -- {sync_cls} / {async_scheduler_cls}"
              f" -- profile {profile}, seed {seed}")
    table = Table(title=header)
    for col in ("check", "rules", "examples", "steps", "examples/s", "steps/s", "result", "seconds"):
        table.add_column(col, justify="right" if col not in ("check", "rules", "result") else "left")
    for r in results:
        style = "green" if r.result == "pass" else "bold red"
        table.add_row(r.name, " ".join(r.rules), str(r.examples), str(r.steps),
                      f"{r.examples / r.seconds:.0f}" if r.seconds else "-",
                      f"{r.steps / r.seconds:.0f}" if r.seconds else "-",
                      f"[{style}]{r.result.upper()}[/]", f"{r.seconds:.1f}")
    console.print(table)
    failed = [r for r in results if r.result != "pass"]
    for r in failed:
        console.print(f"[bold red]{r.name} FAILED[/]: {r.failure}")
        console.print("  counterexample (shrunk, 1-minimal):")
        for line in r.counterexample:
            console.print(f"    {line}")
        if r.saved:
            console.print(f"  saved: {r.saved}  (re-run: outrate replay {r.saved} --scheduler-cls ...)")

    mutant_rows = _run_mutants(budget, seed) if mutants else []
    survivors = [m for m in mutant_rows if not m["killed"]]

    checks_json = [r.as_json() for r in results]
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({
            "vllm_version": vllm.__version__,
            "scheduler": sync_cls,
            "async_scheduler": async_scheduler_cls,
            "profile": profile,
            "seed": seed,
            "seconds": round(time.monotonic() - started, 2),
            "checks": checks_json,
            "mutants": mutant_rows,
        }, indent=2))
    if junit_path is not None:
        reports.junit(junit_path, header, checks_json, mutant_rows)
    if markdown_path is not None:
        reports.markdown(markdown_path, header, checks_json, mutant_rows, budget)
    console.print(f"{len(results) - len(failed)}/{len(results)} checks passed"
                  + (f", {len(mutant_rows) - len(survivors)}/{len(mutant_rows)} mutants killed" if mutants else "")
                  + f" in {time.monotonic() - started:.0f} s")
    sys.exit(1 if failed or survivors else 0)


def _run_mutants(budget: dict, seed: int) -> list[dict]:
    """Hunt every mutant of the catalogue with the gate's checks; print the kill table."""
    import statistics

    from vllm_output_rate.adapter.mutants import MUTANTS
    from vllm_output_rate.adapter.mutation import kill

    rows = []
    with Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("mutants", total=len(MUTANTS))
        for mutant in MUTANTS:
            progress.update(task, description=f"mutant {mutant.name}")
            rows.append(kill(mutant, budget["mutant"], budget["max_steps"], seed).as_json())
            progress.advance(task)
    table = Table(title="mutants")
    for col in ("mutant", "rule", "killed", "counterexample names", "check", "seconds", "events"):
        table.add_column(col)
    for m in rows:
        table.add_row(m["mutant"], m["rule"], "[green]yes[/]" if m["killed"] else "[bold red]NO[/]",
                      m["killed_by"] or "-", m["check"] or "-", f"{m['seconds']:.1f}",
                      str(m["counterexample_events"]))
    console.print(table)
    killed = [m for m in rows if m["killed"]]
    if killed:
        secs = [m["seconds"] for m in killed]
        events = [m["counterexample_events"] for m in killed]
        console.print(f"seconds to kill: median {statistics.median(secs):.1f}, max {max(secs):.1f}; "
                      f"counterexample events: median {statistics.median(events):g}, max {max(events)}")
    for m in rows:
        if not m["killed"]:
            console.print(f"[bold red]mutant {m['mutant']} ({m['rule']}) SURVIVED[/]")
    return rows


@main.command()
@click.argument("scenario_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--scheduler-cls", default=None, metavar="DOTTED.PATH",
              help="Class to run the scenario on; default: the class the saving check judged (the reference, sync "
                   "or async as the scenario says; stock vLLM for a base-fidelity scenario).")
def replay(scenario_file, scheduler_cls) -> None:
    """Re-run a saved counterexample of `outrate conform`; exit 1 if it fails.

    The format is read from the file's keys. ``rates_tokens_per_s`` + ``requests``: a
    rate-limit scenario (checks rate-limit/*, invariants/*; adapter/scenarios.py), judged
    against the spec limiter. ``config`` + ``events``: a step scenario (checks
    base-fidelity/*, white-box/*; adapter/fidelity.py), judged against the step spec after
    every event: with the feature off as base fidelity (default class: stock vLLM), with it
    on as white box (default class: the reference).
    """
    from rich.markup import escape

    from vllm_output_rate.adapter import fidelity
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, load_class
    from vllm_output_rate.adapter.scenarios import Scenario, run_scenario
    from vllm_output_rate.adapter.whitebox import run_white_box

    text = scenario_file.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{scenario_file} is not JSON: {exc}", param_hint="SCENARIO_FILE") from None
    keys = set(data) if isinstance(data, dict) else set()
    if {"config", "events"} <= keys:
        kind, parse = "step", fidelity.StepScenario.from_json
    elif {"rates_tokens_per_s", "requests"} <= keys:
        kind, parse = "rate-limit", Scenario.from_json
    else:
        found = sorted(keys) if isinstance(data, dict) else type(data).__name__
        raise click.BadParameter(
            f"{scenario_file} is neither a rate-limit scenario (keys rates_tokens_per_s, requests) nor a step "
            f"scenario (keys config, events); found {found}", param_hint="SCENARIO_FILE")
    try:
        scenario = parse(text)
    except (TypeError, KeyError, ValueError, AssertionError) as exc:
        raise click.BadParameter(f"{scenario_file}: not a valid {kind} scenario: {exc!r}",
                                 param_hint="SCENARIO_FILE") from None
    if scheduler_cls is not None:
        try:
            load_class(scheduler_cls)
        except (ValueError, ImportError) as exc:
            raise click.BadParameter(str(exc), param_hint="--scheduler-cls") from None

    if kind == "rate-limit":
        cls = scheduler_cls or (REFERENCE_ASYNC_SCHEDULER if scenario.async_scheduling else REFERENCE_SCHEDULER)
        console.print(f"rate-limit scenario on {cls}")
        for line in scenario.events():
            console.print(f"  {escape(line)}")
        verdict = run_scenario(cls, scenario)
        if verdict.failure:
            console.print(f"[bold red]FAIL[/] {verdict.rule}: step {verdict.step}: {escape(verdict.failure)}")
            sys.exit(1)
        console.print(f"[green]PASS[/] {verdict.steps} steps on {cls}; sampling dispatches per user: "
                      f"{verdict.sampled_per_user}")
        return

    async_mode = scenario.config.async_scheduling
    if scenario.config.rate_limited:
        check = "white box"
        cls = scheduler_cls or (REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER)
        verdict = run_white_box(scenario, cls)
    else:
        check = "base fidelity"
        cls = scheduler_cls or fidelity.base_scheduler_cls(async_mode)
        verdict = fidelity.run_step_scenario(cls, scenario)
    console.print(f"step scenario ({check}: spec vs {cls})")
    for line in fidelity.describe_failure(scenario, verdict):
        console.print(f"  {escape(line)}")
    if verdict.failure:
        console.print(f"[bold red]FAIL[/] event {verdict.event_index}: {escape(verdict.failure)}")
        sys.exit(1)
    console.print(f"[green]PASS[/] {verdict.events} events, {verdict.steps} steps: {cls} agrees with the spec")


@main.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def tiny_model(directory) -> None:
    """Write the tiny Llama-style model config (dummy weights) into DIRECTORY."""
    from vllm_output_rate.tinymodel import write_config

    write_config(directory)
    console.print(f"wrote {directory}/config.json")


from vllm_output_rate.bench import bench  # noqa: E402
main.add_command(bench)


from vllm_output_rate.serve import serve  # noqa: E402
main.add_command(serve)
from vllm_output_rate.loadtest import measure  # noqa: E402
main.add_command(measure)
from vllm_output_rate.prove import prove; main.add_command(prove)  # noqa: E402,E702
from vllm_output_rate.check import check; main.add_command(check)  # noqa: E402,E702
from vllm_output_rate.soak import soak; main.add_command(soak)  # noqa: E402,E702


if __name__ == "__main__":
    main()
