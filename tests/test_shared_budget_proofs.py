"""R23-R26: the Z3 proofs (proofs/z3_shared_budget.py) and the model checker's 2-engine
scope with its protocol mutants (proofs/modelcheck_shared.py)."""

from __future__ import annotations

import pytest
import z3

from vllm_output_rate.proofs import modelcheck_shared, z3_shared_budget
from vllm_output_rate.proofs.z3_obligations import Obligation, _check


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    return {r["name"]: r for r in z3_shared_budget.run_all()}


@pytest.mark.rules("R23", "R24")
def test_r24_shared_window_bound_and_work_conservation_are_proved(records) -> None:
    for name in ("r24_shared_window_bound", "r24_work_conservation"):
        assert records[name]["result"] == "proved" and records[name]["vacuity_ok"], records[name]


@pytest.mark.rules("R25")
def test_r25_fail_closed_is_proved(records) -> None:
    assert records["r25_fail_closed"]["result"] == "proved" and records["r25_fail_closed"]["vacuity_ok"]


@pytest.mark.rules("R26")
def test_r26_no_double_spend_is_proved(records) -> None:
    assert records["r26_no_double_spend"]["result"] == "proved" and records["r26_no_double_spend"]["vacuity_ok"]


@pytest.mark.rules("R24")
def test_r24_a_bound_one_token_tighter_is_refuted() -> None:
    close = z3_shared_budget._bound_obligations()[-1]
    W, T, tau = z3.Reals("W T tau")
    D, cap = z3.Ints("D cap")
    tighter = Obligation("close_tighter", close.hypotheses, (W + tau) / T + cap >= D)
    assert _check(tighter, 5000)[0] == "refuted"


@pytest.mark.rules("R23", "R24", "R25", "R26")
def test_r24_model_checker_scope_explores_every_state_without_violation() -> None:
    for scope in modelcheck_shared.SCOPES:
        result = modelcheck_shared.explore(scope)
        assert result.violation is None and result.complete, result.violation
        assert result.states > 10_000  # the scope is not trivially small


@pytest.mark.rules("R23", "R24", "R26")
@pytest.mark.parametrize("mutant", [m.name for m in modelcheck_shared.MUTANTS])
def test_r26_each_protocol_mutant_is_caught(mutant: str) -> None:
    expected = {"double_spend": "cap", "lease_leak": "cap", "lost_return": "conservation", "clock_skew": "conservation"}
    result = modelcheck_shared.explore(modelcheck_shared.SCOPES[0], mutant)
    assert result.violation is not None, f"mutant {mutant} survived"
    check, _, events = result.violation
    assert check == expected[mutant] and len(events) <= 6, result.violation
