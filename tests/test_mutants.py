"""The gate rejects every mutant of the catalogue, naming a rule, with a short counterexample."""

from __future__ import annotations

import pytest

from vllm_output_rate.adapter.conform import PROFILES
from vllm_output_rate.adapter.mutants import MUTANTS
from vllm_output_rate.adapter.mutation import _first_failure, kill
from vllm_output_rate.adapter.scenarios import Scenario, run_scenario, scenarios

CI = PROFILES["ci"]
QUICK = PROFILES["quick"]


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_mutant_is_killed_in_profile_ci(mutant):
    result = kill(mutant, CI["mutant"], CI["max_steps"], seed=0)
    assert result.killed, f"{mutant.name} ({mutant.rule}) survived"
    assert result.killed_by and result.killed_by.startswith("R")
    assert result.counterexample_events <= 6, result.counterexample
    # The 1-minimal counterexample still fails on the mutant and passes on the reference.
    assert result.failure


@pytest.mark.parametrize("name", ["RefundDispatched", "BudgetPerRequest"])
def test_r9_r2_discovery_at_least_95_of_100_seeds_in_profile_quick(name):
    # In the style of Hypothesis's own discovery tests: the bug must be found in >= 95 of
    # 100 independent seeds with the quick profile's budget for the ample sync check.
    mutant = next(m for m in MUTANTS if m.name == name)
    strategy = scenarios(async_scheduling=False, max_steps=QUICK["max_steps"])
    found = sum(_first_failure(mutant.cls, strategy, QUICK["sync"], seed) is not None for seed in range(100))
    assert found >= 95, f"{name} found in only {found}/100 seeds"


def test_r9_counterexample_of_a_mutant_replays_from_json():
    mutant = next(m for m in MUTANTS if m.name == "RefundDispatched")
    scenario = _first_failure(mutant.cls, scenarios(async_scheduling=False, max_steps=10), 50, 3)
    assert scenario is not None
    again = Scenario.from_json(scenario.to_json())
    assert again == scenario
    assert run_scenario(mutant.cls, again).rule == "R9"
