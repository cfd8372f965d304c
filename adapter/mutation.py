"""Mutation testing of the gate: every mutant of ``adapter/mutants.py`` must be rejected.

For each mutant the gate's scenario checks run in order of cost (ample sync scenarios,
then scenarios under resource pressure with white-box invariants; async mutants on the
async checks) until one fails. The kill is recorded with the seconds it took, the rule the
failing check names, and the length of the 1-minimal counterexample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

from vllm_output_rate.adapter.mutants import MUTANTS, Mutant
from vllm_output_rate.adapter.scenarios import (
    Scenario,
    event_count,
    minimize,
    pressured_scenarios,
    run_scenario,
    scenarios,
)


@dataclass
class MutantResult:
    """One row of the kill table (and of the JSON ``"mutants"`` list)."""

    mutant: str
    rule: str
    killed: bool
    seconds: float
    counterexample_events: int = 0
    killed_by: str | None = None  # the rule id the failing check names
    check: str | None = None
    failure: str | None = None
    counterexample: list[str] | None = None

    def as_json(self) -> dict:
        return {
            "mutant": self.mutant,
            "rule": self.rule,
            "killed": self.killed,
            "seconds": round(self.seconds, 3),
            "counterexample_events": self.counterexample_events,
            "killed_by": self.killed_by,
            "check": self.check,
            "failure": self.failure,
            "counterexample": self.counterexample,
        }


def _first_failure(cls: str, strategy, examples: int, seed: int) -> Scenario | None:
    found: dict[str, Scenario] = {}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink], print_blob=False, report_multiple_bugs=False)
    @hseed(seed)
    @given(scenario=strategy)
    def prop(scenario):
        verdict = run_scenario(cls, scenario)
        if verdict.failure is not None:
            found["scenario"] = scenario
        assert verdict.failure is None

    try:
        prop()
    except AssertionError:
        return found.get("scenario")
    return None


def kill(mutant: Mutant, examples: int, max_steps: int, seed: int) -> MutantResult:
    """Run the gate's scenario checks on one mutant until one rejects it."""
    started = time.monotonic()
    modes = [True] if mutant.async_only else [False, True]
    plan = []
    for async_mode in modes:
        tag = "async" if async_mode else "sync"
        plan.append((f"rate-limit/{tag}", scenarios(async_scheduling=async_mode, max_steps=max_steps)))
        plan.append((f"invariants/{tag}", pressured_scenarios(async_scheduling=async_mode, max_steps=max_steps)))
    for check, strategy in plan:
        scenario = _first_failure(mutant.cls, strategy, examples, seed)
        if scenario is None:
            continue
        scenario = minimize(mutant.cls, scenario)
        verdict = run_scenario(mutant.cls, scenario)
        return MutantResult(mutant.name, mutant.rule, True, time.monotonic() - started, event_count(scenario),
                            verdict.rule, check, verdict.failure, scenario.events())
    return MutantResult(mutant.name, mutant.rule, False, time.monotonic() - started)


def kill_all(examples: int, max_steps: int, seed: int, tick: Callable[[str], None] = lambda name: None,
             mutants: tuple[Mutant, ...] = MUTANTS) -> list[MutantResult]:
    """``kill`` every mutant of the catalogue; ``tick`` is called before each."""
    results = []
    for mutant in mutants:
        tick(mutant.name)
        results.append(kill(mutant, examples, max_steps, seed))
    return results
