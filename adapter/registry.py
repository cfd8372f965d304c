"""The one registry of gate rows, used by ``outrate conform`` and by the pytest plugin
(both through ``vllm_output_rate.gate_plan``, which adds the spec-health rows of proofs/).

Every row is a ``GateRow`` (``adapter/gate_row.py``): its name, level, rules, mode, budget,
run and verdict. ``registry()`` declares them, in running order; ``plan(options)`` lists
the rows of a run with, for each, either nothing (it runs) or the reason it is not tested;
the CLI and the plugin both run exactly that list (``gate_row.run_planned``), so they give
the same verdict at the same level, profile and seed. The examples of every row come from
the profile's budget table (``adapter/budgets.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from vllm_output_rate.adapter import conform, coverage, engine_wait
from vllm_output_rate.adapter.boundary_catalog import BOUNDARIES
from vllm_output_rate.adapter.budgets import GateBudget
from vllm_output_rate.adapter.feature_off import check_feature_off, check_shadow
from vllm_output_rate.adapter.gate_row import GateOptions, GateRow, PlannedRow, RowCall, judged_as_should
from vllm_output_rate.adapter.levels import includes
from vllm_output_rate.adapter.lora_slots import check_lora
from vllm_output_rate.adapter.not_binding import check_not_binding
from vllm_output_rate.adapter.rate_change import check_rate_change
from vllm_output_rate.adapter.rate_tables import check_rate_tables
from vllm_output_rate.adapter.residency import check_residency
from vllm_output_rate.adapter.scenarios import Hunt

MODES = ("sync", "async")

# The rules each row covers, by the row's name before "/".
RATE_LIMIT_RULES = ("R2", "R7", "R11", "R12", "R14", "R17")
INVARIANTS_RULES = ("R1", "R2", "R6", "R7", "R9", "R11", "R12", "R17")
WHITE_BOX_RULES = ("R1", "R2", "R4", "R6", "R7", "R9", "R10", "R11", "R12", "R13", "R14", "R15", "R16")
BOUNDARY_RULES = tuple(sorted({r for b in BOUNDARIES for r in b.rules}))
COVERAGE_RULES = tuple(f"R{i}" for i in range(6, 19))


def _cls(call: RowCall, mode: str) -> str:
    """The class an async or sync row runs (an async row is planned only with an async class)."""
    options = call.options
    cls = options.async_scheduler_cls if mode == "async" else options.scheduler_cls
    assert cls is not None, "an async check without --async-scheduler-cls is planned as not tested"
    return cls


def _hunt(call: RowCall, max_steps: int = 40) -> Hunt:
    """The ``adapter/scenarios.Hunt`` of one row in this gate run: its examples, of at most
    ``max_steps`` steps, the run's seed, progress tick and save directory."""
    return Hunt(call.examples, call.options.seed, max_steps, call.tick, call.options.save_dir)


def _configured_as(options: GateOptions) -> dict[str, Any]:
    """How the candidate is configured, as the keyword arguments of the scenario checks
    (``check_scheduler``, ``check_white_box``, ``check_boundaries``): its configuration
    ``style`` and whether it takes ``integer_rates`` only."""
    return {"style": options.style, "integer_rates": options.integer_rates}


def _ample(mode: str) -> Callable[[GateBudget], int]:
    """The budget of ``rate-limit/<mode>``: its ample scenarios."""
    return (lambda b: b.rate_limit_async) if mode == "async" else (lambda b: b.rate_limit_sync)


def _quarter(mode: str) -> Callable[[GateBudget], int]:
    """The budget of a stock-comparison row: a quarter of the mode's ample scenarios, at least 5."""
    ample = _ample(mode)
    return lambda b: max(ample(b) // 4, 5)


def _scheduler_row(mode: str, pressured: bool) -> GateRow:
    """``rate-limit/<mode>`` (ample resources) or ``invariants/<mode>`` (resource pressure)."""

    def run(call: RowCall) -> Any:
        return conform.check_scheduler(
            _cls(call, mode),
            mode == "async",
            _hunt(call, call.budget.max_steps),
            pressured=pressured,
            level=call.options.level,
            burst_configurable=call.options.burst_configurable,
            **_configured_as(call.options),
        )

    name, rules = ("invariants", INVARIANTS_RULES) if pressured else ("rate-limit", RATE_LIMIT_RULES)
    budget = (lambda b: b.pressured) if pressured else _ample(mode)
    return GateRow(f"{name}/{mode}", "must", rules, mode, budget, run)


def _stock_comparison_row(name: str, level: str, rules: tuple[str, ...], mode: str, check: Callable) -> GateRow:
    """A row that runs the candidate beside stock vLLM on a quarter of the mode's scenario
    budget (at least 5 scenarios): ``check(class, async_mode, hunt, style)``."""

    def run(call: RowCall) -> Any:
        return check(_cls(call, mode), mode == "async", _hunt(call, call.budget.max_steps), call.options.style)

    return GateRow(f"{name}/{mode}", level, rules, mode, _quarter(mode), run)


def _hunted_row(
    name: str, level: str, rules: tuple[str, ...], mode: str, budget: Callable[[GateBudget], int], check: Callable
) -> GateRow:
    """A row with its own count of scenarios per profile: ``check(class, async_mode, hunt, style)``."""

    def run(call: RowCall) -> Any:
        return check(_cls(call, mode), mode == "async", _hunt(call), call.options.style)

    return GateRow(f"{name}/{mode}", level, rules, mode, budget, run)


def _rate_change_row(mode: str) -> GateRow:
    """R21: rates changed without a restart through the candidate's rates file
    (``adapter/rate_change.py``). Level exact, as the article has no live rate change; a
    candidate that declares it (``--rate-change``) is judged at every level."""

    def run(call: RowCall) -> Any:
        return check_rate_change(_cls(call, mode), mode == "async", _hunt(call), call.options.style, level=call.level)

    return GateRow(f"rate-change/{mode}", "exact", ("R21",), mode, lambda b: b.rate_change, run, opt_in="rate_change")


def _white_box_row(mode: str) -> GateRow:
    """``white-box/<mode>``: the step spec predicts the class under test, every field of its
    observation included (level exact)."""

    def run(call: RowCall) -> Any:
        return conform.check_white_box(
            _cls(call, mode),
            mode == "async",
            _hunt(call),
            burst_configurable=call.options.burst_configurable,
            **_configured_as(call.options),
        )

    budget = (lambda b: b.white_async) if mode == "async" else (lambda b: b.white_sync)
    return GateRow(f"white-box/{mode}", "exact", WHITE_BOX_RULES, mode, budget, run)


def _engine_wait_row(mode: str) -> GateRow:
    """``engine-wait/<mode>`` (R16): one seeded scenario in vLLM's own engine-core loop."""

    def run(call: RowCall) -> Any:
        return engine_wait.check_engine_wait(_cls(call, mode), call.options.seed, call.tick, style=call.options.style)

    return GateRow(f"engine-wait/{mode}", "should", ("R16",), mode, lambda b: 1, run, verdict=judged_as_should)


def _boundaries_row(mode: str) -> GateRow:
    """Issue 18 item 1: the Z3-directed boundary scenarios (``adapter/boundaries.py``), on
    the candidate at every level, with its config style and integer rates."""

    def run(call: RowCall) -> Any:
        from vllm_output_rate.adapter.boundaries import check_boundaries  # deferred: it imports z3

        return check_boundaries(
            _cls(call, mode),
            mode == "async",
            call.options.seed,
            call.tick,
            call.options.save_dir,
            level=call.options.level,
            per_boundary=call.budget.per_boundary,
            **_configured_as(call.options),
        )

    return GateRow(f"boundaries/{mode}", "must", BOUNDARY_RULES, mode, lambda b: len(BOUNDARIES) * b.per_boundary, run)


def _coverage_row() -> GateRow:
    """Issue 18 item 2: every obligation of ``adapter/coverage.py`` reached >= k times by
    this run's candidate checks (k per profile); runs last among the candidate checks. It
    runs no scenario: it reads what the run's other candidate rows recorded."""

    def run(call: RowCall) -> Any:
        call.tick()
        return coverage.check_coverage(call.options)

    return GateRow("coverage", "must", COVERAGE_RULES, None, lambda b: 1, run)


def _spec_health_rows() -> list[GateRow]:
    """The adapter's spec-health rows: the limiter differential and base fidelity."""

    def fidelity(mode: str) -> GateRow:
        rules = tuple(f"V{i}" for i in range(1, 12)) + (("V12",) if mode == "async" else ())
        budget = (lambda b: b.base_async) if mode == "async" else (lambda b: b.base_sync)

        def run(call: RowCall) -> Any:
            options = call.options
            return conform.check_base_fidelity(
                mode == "async", call.examples, options.seed, call.tick, options.save_dir
            )

        return GateRow(f"base-fidelity/{mode}", "must", rules, None, budget, run, part="spec health")

    def limiter(call: RowCall) -> Any:
        return conform.check_limiter_differential(call.examples, call.options.seed, call.tick)

    limiter_rules = ("R1", "R2", "R3", "R4", "R5", "R6")
    differential = GateRow(
        "limiter-differential", "must", limiter_rules, None, lambda b: b.limiter, limiter, part="spec health"
    )
    return [differential, fidelity("sync"), fidelity("async")]


# The engine modes of each row (adapter/modes.py), by the row's name before "/": (modes every
# scenario needs, modes some scenarios draw). An async row needs "async" as well.
_SCHEDULER_DRAWS = ("priority", "prefix-caching", "no-chunked-prefill")  # scenarios.pressured_scenarios
ROW_MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rate-limit": ((), ("prefix-caching", "no-chunked-prefill")),
    "invariants": ((), _SCHEDULER_DRAWS),
    "feature-off": ((), _SCHEDULER_DRAWS),
    "not-binding": ((), _SCHEDULER_DRAWS),
    "shadow": ((), _SCHEDULER_DRAWS),
    "rate-tables": ((), _SCHEDULER_DRAWS),
    "boundaries": ((), ("priority", "no-chunked-prefill")),
    "fair-residency": ((), ("no-chunked-prefill",)),
    "rate-change": ((), ("no-chunked-prefill",)),
    "lora-slots": (("lora",), ("no-chunked-prefill",)),
    "white-box": ((), ("lora", "priority", "no-chunked-prefill")),
}


# Rows whose origin is not the one of their rules and level (adapter/origins.py): the LoRA
# bound is this project's decision (docs/SPEC.md, Decision "LoRA slots"); a crash stays fatal.
ROW_ORIGINS = {"lora-slots": "project rule"}


def _declared(row: GateRow) -> GateRow:
    """``row`` with its engine modes (``ROW_MODES``, plus ``async`` for an async row) and
    its origin where declared (``ROW_ORIGINS``)."""
    family = row.name.partition("/")[0]
    needs, draws = ROW_MODES.get(family, ((), ()))
    needs = needs + (("async",) if row.mode == "async" else ())
    return replace(row, needs=needs, draws=draws, origin=row.origin or ROW_ORIGINS.get(family))


def _candidate_rows(mode: str) -> list[GateRow]:
    """The scenario rows of one mode that run at every level, in running order."""
    return [
        _scheduler_row(mode, False),
        _scheduler_row(mode, True),
        _stock_comparison_row("feature-off", "must", ("R18",), mode, check_feature_off),
        _stock_comparison_row("not-binding", "should", ("R19", "R14"), mode, check_not_binding),
        _boundaries_row(mode),
    ]


def registry(extra: Sequence[GateRow] = ()) -> list[GateRow]:
    """Every row of the adapter, candidate rows first, in running order, then ``extra``.

    ``extra``: rows of a higher layer (``proofs/gate_checks.py``'s spec-health rows, added
    by ``vllm_output_rate.gate_plan``: the adapter does not import proofs/)."""
    rows = _candidate_rows("sync") + _candidate_rows("async")
    rows += [_engine_wait_row(m) for m in MODES]
    # R20 fair residency (level exact: this project's extension, off by default; the article
    # has no per-user resident cap, so it never decides an article-style candidate's must/should)
    rows += [
        _hunted_row("fair-residency", "exact", ("R20",), m, lambda b: b.fair_residency, check_residency) for m in MODES
    ]
    rows += [_rate_change_row(m) for m in MODES]  # R21
    # R11, R13: LoRA slots: no crash (must), the other user's adapter served within a bound
    # (should, R13 Decision "LoRA slots")
    rows += [_hunted_row("lora-slots", "should", ("R11", "R13"), m, lambda b: b.lora_slots, check_lora) for m in MODES]
    rows += [_white_box_row(m) for m in MODES]
    # Shadow mode (docs/SPEC.md, Decision "Shadow mode"; level exact, our decision): with
    # output_rate.shadow: true and binding rates the candidate is stock step for step.
    rows += [_stock_comparison_row("shadow", "exact", ("shadow",), m, check_shadow) for m in MODES]
    # R27-R29 (level exact: the article has no rate table): a plan table whose most specific
    # entries free every user is stock step for step (adapter/rate_tables.py).
    rows += [_stock_comparison_row("rate-tables", "exact", ("R27", "R28", "R29"), m, check_rate_tables) for m in MODES]
    rows.append(_coverage_row())
    return [_declared(row) for row in rows] + _spec_health_rows() + list(extra)


def plan(options: GateOptions, extra: Sequence[GateRow] = ()) -> list[PlannedRow]:
    """The rows of one run (``registry(extra)``): those at or below ``options.level``; an
    async row without an async class is planned as NOT TESTED (or left out with
    ``sync_only``); spec health is left out with ``spec_health=False``."""
    planned = []
    for row in registry(extra):
        if row.part == "spec health" and not options.spec_health:
            continue
        if not includes(options.level, row.level_for(options)):  # R21: an opt-in row judges at every level
            continue
        if row.mode == "async" and options.async_scheduler_cls is None:
            if options.sync_only:
                continue
            planned.append(PlannedRow(row, "no --async-scheduler-cls given (use --sync-only to judge sync alone)"))
            continue
        planned.append(PlannedRow(row))
    return planned
