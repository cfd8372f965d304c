"""The gate's one row type and how one planned row runs.

``GateOptions``: one gate run's settings. ``GateRow``: one row of the gate (its name, level,
rules, mode, budget, run and verdict), declared in ``adapter/registry.py`` (the adapter's
rows) and ``proofs/gate_checks.py`` (the proofs' spec-health rows). ``PlannedRow``: a row
of one run, with why it is not tested or not applicable. ``run_planned`` runs one: the
row's ``run`` records the observations (a ``CheckResult``), the row's ``verdict`` judges
them, and, for a candidate row, the coverage obligations its scenarios reached are recorded
for the run's ``coverage`` row (``adapter/coverage.py``) and the counterexample is saved
(``adapter/counterexample.py``). The run's mode matrix (``modes_result``) and exit code
(``exit_code``) are here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter import counterexample, coverage, modes, origins
from vllm_output_rate.adapter.budgets import GateBudget, gate_budget
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.levels import check_level
from vllm_output_rate.adapter.modes import check_mode_names

Tick = Callable[[], None]


@dataclass(frozen=True)
class GateOptions:
    """One gate run's settings.

    ``scheduler_cls`` / ``async_scheduler_cls``: dotted class paths (async None: the async
    checks are NOT TESTED unless ``sync_only``). ``style``: an ``adapter.configstyle``
    object (None: ``additional_config["output_rate"]``). ``integer_rates``: the candidate
    takes integer rates only (the article's flags). ``burst_configurable``: the candidate
    reads ``burst_ms`` (otherwise every scenario uses the article's fixed 100 ms).
    ``rate_change``: the candidate reads ``output_rate.rates_file`` (R21); its
    ``rate-change/*`` rows then judge at every level, not only at exact. ``profile``: the
    size of the run, a key of ``adapter/budgets.GATE_BUDGETS``.
    """

    scheduler_cls: str
    async_scheduler_cls: str | None = None
    level: str = "should"
    profile: str = "ci"
    seed: int = 0
    style: Any = None
    integer_rates: bool = False
    burst_configurable: bool = False
    rate_change: bool = False  # R21: the candidate declares the rates file (opt-in, like burst_configurable)
    require_modes: tuple[str, ...] = ()  # engine modes whose refusal is fatal (adapter/modes.py, --require-mode)
    sync_only: bool = False
    spec_health: bool = True
    save_dir: Path | None = None
    paths: tuple[str, ...] = ()  # --path directories of the candidate (saved in its counterexample files)

    def __post_init__(self) -> None:
        check_level(self.level)
        check_mode_names(self.require_modes)
        gate_budget(self.profile)


@dataclass(frozen=True)
class RowCall:
    """What a row's ``run`` gets: the run's ``options``, the profile's ``budget`` table, the
    row's ``examples`` in it (``GateRow.budget``), the progress ``tick`` and the row's
    ``level`` in this run (``GateRow.level_for``)."""

    options: GateOptions
    budget: GateBudget
    examples: int
    tick: Tick
    level: str


def judged_by_origin(row: GateRow, result: CheckResult, options: GateOptions) -> CheckResult:
    """A candidate row's verdict: a failure judged by its origin at the run's level
    (``adapter/origins.judged``: a project rule's failure is a warning at should, never a
    stop; fatal at every level for a row the candidate opted in to)."""
    opted_in = row.opt_in is not None and row.level_for(options) == "must"
    origins.judged(result, row.origin_of(), options.level, opted_in)
    return result


def judged_as_should(row: GateRow, result: CheckResult, options: GateOptions) -> CheckResult:
    """The verdict of a row of one seeded scenario whose failure is a should-level property
    (``engine-wait/*``, R16): not minimized, the failure labelled ``[should]``, then
    ``judged_by_origin``."""
    result.minimal = False  # one seeded scenario, not minimized
    if result.result == "fail":
        result.failed_level = "should"
        result.failure = f"[should] {result.failure}"
    return judged_by_origin(row, result, options)


def as_observed(row: GateRow, result: CheckResult, options: GateOptions) -> CheckResult:
    """A spec-health row's verdict: its observations as they are (never the candidate's)."""
    return result


@dataclass(frozen=True)
class GateRow:
    """One row of the gate.

    ``name``: ``family/mode`` or a bare name (``coverage``); ``level``: the lowest level at
    which it runs (``adapter/levels.py``); ``rules``: the rule ids it covers; ``mode``:
    "sync", "async" or None (mode-independent); ``budget(GateBudget) -> int``: its examples
    in a profile (``adapter/budgets.py``; the progress bar's length); ``run(RowCall) ->
    CheckResult``: the observations; ``verdict(row, result, options) -> CheckResult``: the
    observations judged (default for a candidate row ``judged_by_origin``, for spec health
    ``as_observed``). ``part``: "candidate" (it runs the class under test) or "spec health"
    (the spec against itself or stock vLLM, never the candidate's verdict); ``opt_in``: a
    ``GateOptions`` flag that makes the row judge at every level (R21: ``rate_change``);
    ``needs`` / ``draws``: the engine modes every scenario of the row needs / some draw
    (``adapter/modes.py``; ``registry.ROW_MODES``); ``origin``: where its rules come from
    (``adapter/origins.py``; None: from its rules and level).
    """

    name: str
    level: str
    rules: tuple[str, ...]
    mode: str | None
    budget: Callable[[GateBudget], int]
    run: Callable[[RowCall], Any]
    verdict: Callable[[GateRow, Any, GateOptions], Any] | None = None
    part: str = "candidate"
    opt_in: str | None = None
    needs: tuple[str, ...] = ()
    draws: tuple[str, ...] = ()
    origin: str | None = None

    def origin_of(self) -> str:
        """The row's origin (``adapter/origins.row_origin`` unless declared)."""
        return self.origin or origins.row_origin(self.rules, self.level)

    def level_for(self, options: GateOptions) -> str:
        """The row's level in this run: ``must`` if the candidate opted in (``opt_in``), else ``level``."""
        return "must" if self.opt_in is not None and getattr(options, self.opt_in) else self.level

    def examples(self, options: GateOptions) -> int:
        """The row's examples in the run ``options`` (its ``budget`` in the run's profile)."""
        return self.budget(gate_budget(options.profile))

    def observe(self, options: GateOptions, tick: Tick) -> Any:
        """Run the row on the run ``options`` (its ``run``, with its examples and level in that
        run): the observations, not judged yet (``judge``)."""
        budget = gate_budget(options.profile)
        return self.run(RowCall(options, budget, self.budget(budget), tick, self.level_for(options)))

    def judge(self, result: Any, options: GateOptions) -> Any:
        """``result`` judged by the row's ``verdict`` (or its part's default)."""
        verdict = self.verdict or (judged_by_origin if self.part == "candidate" else as_observed)
        return verdict(self, result, options)


@dataclass(frozen=True)
class PlannedRow:
    """A row of one run: ``skip`` is None when it runs, else why it is not tested;
    ``not_applicable``: why it does not apply (a mode the candidate refused at start-up)."""

    row: GateRow
    skip: str | None = None
    not_applicable: str | None = None


def run_planned(item: PlannedRow, options: GateOptions, tick: Tick) -> CheckResult:
    """Run one planned row (or build its NOT TESTED / not applicable row); returns a
    ``CheckResult`` with ``part`` and ``level`` set from the row."""
    row = item.row
    if item.skip is not None or item.not_applicable is not None:
        result, why = ("not tested", item.skip) if item.skip is not None else ("not applicable", item.not_applicable)
        return CheckResult(row.name, list(row.rules), result=result, failure=why, part=row.part, level=row.level)
    started = time.monotonic()
    if row.part == "candidate":  # issue 18: obligations reached, summed over the run
        with coverage.collecting() as reached:
            observed = row.observe(options, tick)
        result = row.judge(observed, options)
        coverage.record_check(options, row.name, result, reached)
    else:
        result = row.judge(row.observe(options, tick), options)
    result.seconds = time.monotonic() - started
    result.part, result.level = row.part, row.level_for(options)
    counterexample.record(result, options)  # issue 31: the file names the check that saved it
    return result


def modes_used(planned: Sequence[PlannedRow]) -> list[str]:
    """The engine modes the rows of ``planned`` that run need or draw (probed before they run)."""
    used: list[str] = []
    for item in planned:
        if item.skip is None and item.row.part == "candidate":
            used += [m for m in item.row.needs + item.row.draws if m not in used]
    return used


def apply_modes(planned: Sequence[PlannedRow], refused: dict[str, str]) -> list[PlannedRow]:
    """``planned`` with every row that needs a refused mode (``refused``: name -> message,
    ``adapter/modes.refused``) marked not applicable: "refused at start-up (message)"."""
    out = []
    for item in planned:
        hit = [m for m in item.row.needs if m in refused] if item.skip is None else []
        if hit:
            item = replace(item, not_applicable=f"mode {hit[0]} refused at start-up ({refused[hit[0]]})")
        out.append(item)
    return out


def modes_result(matrix: dict, options: GateOptions) -> CheckResult:
    """The ``modes`` row (level must, part candidate): the candidate's mode matrix
    (``adapter/modes.probe``) as its ``modes`` table and counterexample lines; it fails on a
    refusal with the feature off (R18), a crash (stock vLLM ran the same probe) or a
    required mode not supported (``--require-mode``)."""
    result = CheckResult("modes", ["R18"], examples=len(matrix), part="candidate", level="must")
    result.modes = [row.as_json() for row in matrix.values()]
    result.minimal = False
    lines = [f"{row.mode}: {row.status}" + (f" ({row.message})" if row.message else "") for row in matrix.values()]
    failed = modes.matrix_failure(matrix, options.scheduler_cls.rpartition(".")[2])
    if failed is not None:
        rule, text = failed
        result.result, result.failed_level, result.origin = "fail", "must", "article promise"
        result.failure, result.counterexample = f"[must] {rule}: {text}", lines
    return result


def exit_code(results: list) -> int:
    """0: every candidate check at or below the level passed and spec health is sound;
    1: a candidate check failed; 2: a check was NOT TESTED (nothing failed); 3: spec
    health failed (the gate's own model is out of step with the installed vLLM or itself:
    the verdict cannot be trusted)."""
    if any(r.result == "fail" and r.part == "candidate" for r in results):
        return 1
    if any(r.result == "fail" for r in results):
        return 3
    if any(r.result == "not tested" for r in results):
        return 2
    return 0
