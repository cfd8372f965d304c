"""The spec-health rows of proofs/ (``proofs/gate_checks.py``) as the gate runs them."""

from __future__ import annotations

import pytest

from vllm_output_rate.adapter.gate_row import GateOptions
from vllm_output_rate.proofs import gate_checks


@pytest.mark.rules("R2", "R23")
@pytest.mark.parametrize("name", ["proofs/z3", "proofs/shared-budget"])
def test_spec_health_row_progress_budget_is_the_ticks_it_takes(name):
    """The progress bar of ``outrate conform`` counts a row's planned budget; the row ticks
    once per property, scope or mutant it runs, so the two agree (a stale budget showed
    ``proofs/z3 6/6`` beside 8 proofs in the table)."""
    row = next(s for s in gate_checks.spec_health_checks() if s.name == name)
    ticks = []
    options = GateOptions(scheduler_cls="")
    result = row.observe(options, lambda: ticks.append(1))
    assert result.result == "pass", result.failure
    assert row.examples(options) == len(ticks) == result.examples
