"""The ``outrate bench`` command: runs the parts asked for, prints the tables, writes JSON and the plot."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import logging
import os
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from vllm_output_rate.bench.common import (
    CLOCKS,
    FULL,
    QUICK,
    Plan,
    console,
)
from vllm_output_rate.bench.gate import measure_gate
from vllm_output_rate.bench.limiter import measure_limiter
from vllm_output_rate.bench.live import live_steps, measure_live
from vllm_output_rate.bench.profiling import profile_schedule
from vllm_output_rate.bench.render import (
    _gate_table,
    _idle_table,
    _limiter_table,
    _live_table,
    _scheduler_table,
    _shared_table,
    machine,
    profile_tables,
    write_plot,
)
from vllm_output_rate.bench.scheduler import SchedulerKinds, SchedulerRow, measure_scheduler, set_try_take_floor
from vllm_output_rate.bench.shared import measure_all_shared, shared_configs
from vllm_output_rate.bench.tables import measure_tables, tables_steps, tables_table
from vllm_output_rate.clitools import bar_progress, flag_option, json_option, output_file_option


def _parse_sizes(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of integers, got {value!r}") from None
    if any(s < 1 for s in sizes):
        raise click.BadParameter(f"sizes must be >= 1, got {value!r}")
    return sizes


@click.command()
@json_option()
@output_file_option("--plot", "plot_path", "Write a PNG plot of per-step cost against running requests here.")
@flag_option("--quick", "Tiny sizes and few repetitions (for tests); numbers are rough.")
@click.option("--sizes", default=None, metavar="N,N,...", help="Numbers of running requests to time.")
@click.option(
    "--rounds",
    type=click.IntRange(1, 200),
    default=None,
    help="Interleaved rounds per configuration (default 41; --quick 3).",
)
@click.option(
    "--instances",
    type=click.IntRange(1, 16),
    default=None,
    help="Scheduler part: schedulers of each kind per configuration, timed in the same rounds (default 3; --quick 1).",
)
@click.option(
    "--clock",
    type=click.Choice(sorted(CLOCKS)),
    default="cpu",
    show_default=True,
    help="Step clock: this thread's CPU time (robust on a shared machine) or wall time.",
)
@click.option(
    "--only",
    type=click.Choice(["scheduler", "shared", "limiter", "gate", "tables", "live"]),
    multiple=True,
    help="Run only these parts (repeatable); default: all.",
)
@click.option(
    "--live/--no-live",
    default=None,
    help="Also start a real vLLM engine (tiny model) for the live section; default: on, off with --quick.",
)
@click.option(
    "--profile",
    "profile_n",
    type=click.IntRange(1),
    default=None,
    metavar="N",
    help="Instead of the benchmark: cProfile the reference's schedule() at N running requests.",
)
@click.option(
    "--profile-throttled",
    "profile_fraction",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    default=0.0,
    show_default=True,
    metavar="F",
    help="With --profile: throttle this fraction of the requests, and profile the article-style peer beside the "
    "reference (schedule() and update_from_output(), the calls the bench times).",
)
def bench(
    json_path, plot_path, quick, sizes, rounds, instances, clock, only, live, profile_n, profile_fraction
) -> None:
    """Measure the rate limit's cost: scheduler steps vs stock vLLM, limiter ops/s, gate rates."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    plan = _plan(quick, sizes, rounds, instances)
    parts = set(only) or {"scheduler", "shared", "limiter", "gate", "tables"}
    if live or (live is None and not only and not quick):
        parts.add("live")
    elif live is False:
        parts.discard("live")
    if profile_fraction and profile_n is None:
        raise click.UsageError(f"--profile-throttled {profile_fraction} needs --profile N (the running requests)")
    command = _command_line(
        json_path, plot_path, quick, sizes, rounds, clock, only, profile_n, live, profile_fraction, instances
    )
    started = time.monotonic()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with console.status("importing vLLM"):
        import vllm  # deferred: vLLM costs ~7 s to import; only a bench run needs it

        importlib.import_module("vllm_output_rate.reference.scheduler")  # the class under test, imported once
    # vLLM's config warnings (e.g. about the gate's small engine shapes) are not results.
    logging.getLogger("vllm").setLevel(logging.ERROR)

    if profile_n is not None:
        _profile(profile_n, 20 if quick else 100, json_path, command, profile_fraction)
        return
    scheduler_rows, shared, limiter, gate, live_result = _measure(parts, plan, clock)
    if scheduler_rows:  # the try_take floor: the limiter part's, else a short try_take run
        set_try_take_floor(scheduler_rows, limiter)
    tables = _measure_tables(quick) if "tables" in parts else None

    env = machine()
    env["load_average_at_start"] = load_at_start
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    console.print(
        f"{when}; {env['cores']} cores, {env['cpu']}; vLLM {vllm.__version__}; Python {env['python']}; "
        f"load average at the end {env['load_average']}; command: {command}"
    )
    _print_tables(scheduler_rows, shared, limiter, gate, live_result, clock)
    if tables is not None:
        console.print(tables_table(tables))
    if plot_path is not None and scheduler_rows:
        write_plot(
            scheduler_rows,
            plot_path,
            f"outrate bench, vLLM {vllm.__version__}, {env['cores']} cores {env['cpu']}, {when}",
        )
        console.print(f"wrote {plot_path}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "date": when,
            "command": command,
            "vllm_version": vllm.__version__,
            "machine": env,
            "quick": quick,
            "clock": clock,
            "plan": asdict(plan),
            "seconds": round(time.monotonic() - started, 1),
            "scheduler": [asdict(r) for r in scheduler_rows],
            "shared": shared,
            "limiter": limiter,
            "gate": gate,
            "live": live_result,
            "tables": tables,
        }
        json_path.write_text(json.dumps(report, indent=2, default=_json_default))
        console.print(f"wrote {json_path}")


def _measure_tables(quick: bool) -> dict[str, Any]:
    """Rate tables of real size (``bench/tables.py``), with its progress bar."""
    progress = bar_progress(console, 34)
    with progress:
        task = progress.add_task("rate tables (1k, 10k, 100k users)", total=tables_steps(quick))
        return measure_tables(quick, functools.partial(progress.advance, task))


def _plan(quick: bool, sizes: str | None, rounds: int | None, instances: int | None = None) -> Plan:
    """``QUICK`` or ``FULL``, with ``--sizes``, ``--rounds`` and ``--instances`` applied."""
    plan = QUICK if quick else FULL
    overrides: dict[str, Any] = {}
    if (parsed := _parse_sizes(sizes)) is not None:
        overrides["sizes"] = parsed
    if rounds is not None:
        overrides["rounds"] = rounds
    if instances is not None:
        overrides["instances"] = instances
    return Plan(**{**asdict(plan), **overrides}) if overrides else plan


def _profile(profile_n: int, steps: int, json_path: Path | None, command: str, fraction: float = 0.0) -> None:
    """``--profile N``: the cProfile tables of the reference's ``schedule()`` (and the JSON);
    with ``--profile-throttled F`` > 0, the reference's and the article-style peer's steps
    at that fraction throttled, and the ratio of their totals under the profiler."""
    with console.status(f"profiling the reference's schedule() at {profile_n} running requests"):
        prof = profile_schedule(profile_n, steps, top=25, fraction=fraction)
    for table in profile_tables(prof, profile_n, steps):
        console.print(table)
    result: dict[str, Any] = {"profile": prof, "running": profile_n, "steps": steps, "command": command}
    if fraction > 0:
        with console.status(f"profiling the article-style peer at {profile_n} running requests"):
            peer = profile_schedule(profile_n, steps, top=25, fraction=fraction, peer=True)
        for table in profile_tables(peer, profile_n, steps):
            console.print(table)
        result["peer_profile"] = peer
        result["reference_peer_ratio"] = prof["total_us_per_step"] / peer["total_us_per_step"]
        console.print(
            f"under the profiler, {fraction:.0%} throttled: reference {prof['total_us_per_step']:,.0f} µs/step, "
            f"article-style {peer['total_us_per_step']:,.0f} µs/step, ratio {result['reference_peer_ratio']:.3f}"
        )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))


def _nothing() -> None:
    """A progress tick that counts nothing (the discarded warm-up cell)."""


def _measure(
    parts: set[str], plan: Plan, clock: str
) -> tuple[
    list[SchedulerRow], dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None
]:
    """Run the parts asked for, each with its progress bar: scheduler rows, shared budget,
    limiter, gate, live."""
    configs = [(n, f, m) for n in plan.sizes for m in plan.modes for f in plan.fractions]
    scheduler_rows: list[SchedulerRow] = []
    shared: dict[str, Any] | None = None
    limiter: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    live_result: dict[str, Any] | None = None
    progress = bar_progress(console, 34)
    with contextlib.ExitStack() as stack:
        # The schedulers' processes (bench/processes.py), started before the progress display.
        kinds = stack.enter_context(SchedulerKinds(plan.instances)) if "scheduler" in parts else None
        stack.enter_context(progress)
        if kinds is not None:
            task = progress.add_task("scheduler", total=len(configs) * plan.rounds)
            if plan.warmup_rounds:  # discarded: see Plan.warmup_rounds
                progress.update(task, description="scheduler warm-up (discarded)")
                warmup = dataclasses.replace(plan, rounds=plan.warmup_rounds)
                measure_scheduler(*configs[0], warmup, _nothing, clock, kinds)
            for n, fraction, mode in configs:
                progress.update(task, description=f"scheduler {mode} N={n} throttled {fraction:.0%}")
                advance = functools.partial(progress.advance, task)
                scheduler_rows.append(measure_scheduler(n, fraction, mode, plan, advance, clock, kinds))
            progress.update(task, description="scheduler")
            kinds.close()
        if "shared" in parts:
            task = progress.add_task("shared budget (Redis)", total=len(shared_configs(plan)) * plan.rounds)
            shared = measure_all_shared(plan, functools.partial(progress.advance, task), clock)
        if "limiter" in parts:
            task = progress.add_task("limiter", total=plan.limiter_batches)
            limiter = measure_limiter(plan, functools.partial(progress.advance, task))
        if "gate" in parts:
            task = progress.add_task("gate (differential)", total=2 * plan.gate_scenarios)
            gate = measure_gate(plan, functools.partial(progress.advance, task))
        if "live" in parts:
            task = progress.add_task("live engine (tiny model)", total=live_steps(plan))
            live_result = measure_live(plan, functools.partial(progress.advance, task))
    return scheduler_rows, shared, limiter, gate, live_result


def _print_tables(
    scheduler_rows: list[SchedulerRow],
    shared: dict[str, Any] | None,
    limiter: dict[str, Any] | None,
    gate: dict[str, Any] | None,
    live_result: dict[str, Any] | None,
    clock: str,
) -> None:
    """The table of each part that ran (shared budget and gate: why a part or row was skipped)."""
    if scheduler_rows:
        console.print(_scheduler_table(scheduler_rows, clock))
    if shared is not None:
        if shared["skipped"]:
            console.print(f"shared budget: skipped: {shared['skipped']}")
        else:
            console.print(_shared_table(shared, clock))
    if limiter is not None:
        console.print(_limiter_table(limiter))
    if gate is not None:
        console.print(_gate_table(gate))
        for name, why in gate["skipped"].items():
            console.print(f"{name}: {why}")
    if live_result is not None:
        console.print(_live_table(live_result))
        console.print(_idle_table(live_result))


def _json_default(value: Any) -> Any:
    return str(value)


def _command_line(
    json_path, plot_path, quick, sizes, rounds, clock, only, profile_n, live=None, fraction=0.0, instances=None
) -> str:
    """The command that reproduces this run (for the report)."""
    words = ["outrate", "bench"]
    words += ["--quick"] if quick else []
    words += ["--sizes", sizes] if sizes else []
    words += ["--rounds", str(rounds)] if rounds is not None else []
    words += ["--instances", str(instances)] if instances is not None else []
    words += ["--clock", clock] if clock != "cpu" else []
    for part in only:
        words += ["--only", part]
    words += [] if live is None else ["--live" if live else "--no-live"]
    words += ["--profile", str(profile_n)] if profile_n is not None else []
    words += ["--profile-throttled", str(fraction)] if fraction else []
    words += ["--json", str(json_path)] if json_path is not None else []
    words += ["--plot", str(plot_path)] if plot_path is not None else []
    return " ".join(words)
