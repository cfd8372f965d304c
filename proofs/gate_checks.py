"""The gate's spec-health rows that come from proofs/: ``proofs/z3``, ``model-check/quick``,
``proofs/shared-budget`` (R23-R26) and ``identity/bind`` (R30-R32, proofs/identity_check.py).

They live here, not in ``adapter/``, because the layers go one way (spec <- reference <-
adapter <- proofs <- outrate; ``tests/test_layers.py``): the proofs use the adapter's
``GateRow``/``CheckResult``, and the top layer (``vllm_output_rate.gate_plan``, used by
``outrate conform`` and by the pytest plugin) adds these rows to the adapter's plan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.gate_row import GateOptions, GateRow, PlannedRow, run_planned
from vllm_output_rate.adapter.z3guard import z3_alone
from vllm_output_rate.proofs import modelcheck_shared
from vllm_output_rate.proofs.identity_check import IDENTITY_RULES, check_identity, identity_cases
from vllm_output_rate.proofs.modelcheck import explore, profile_scopes

Z3_RULES = ("R1", "R2", "R3", "R4", "R5", "R6", "R21")
MODEL_RULES = ("I1-I18", "F1", "R6", "R19", "R28", "liveness")  # R28: scope sync-unlimited
SHARED_RULES = ("R23", "R24", "R25", "R26")


def check_proofs(tick: Callable[[], None]) -> CheckResult:
    """R1-R6 and R21 for all inputs: the Z3 proofs of ``proofs/z3_limiter.py`` (``outrate prove``
    adds the CrossHair contracts, which take about a minute)."""
    # deferred: z3_limiter imports z3 at its top; only the proof rows need it
    from vllm_output_rate.proofs.z3_limiter import run_all

    result = CheckResult("proofs/z3", list(Z3_RULES), part="spec health")
    with z3_alone():  # Z3 in one thread, its objects freed here (adapter/z3guard.py)
        records = list(run_all())
    for record in records:
        tick()
        result.examples += 1
        if record["result"] != "proved" or not record.get("vacuity_ok", True):
            result.result = "fail"
            result.failure = f"{record['name']}: {record['result']}"
            result.counterexample.append(str(record.get("counterexample")))
    return result


def check_model(tick: Callable[[], None]) -> CheckResult:
    """Every invariant in every state of the quick scopes of the model checker over the spec
    (``outrate check --profile ci|release`` explores the larger ones)."""
    result = CheckResult("model-check/quick", list(MODEL_RULES), part="spec health")
    for scope in profile_scopes("quick"):
        tick()
        outcome = explore(scope)
        result.examples += 1
        result.steps += outcome.states
        if outcome.violations:
            name, violation = next(iter(outcome.violations.items()))
            result.result = "fail"
            result.failure = f"scope {scope.name}: {name}: {violation}"
    return result


def check_shared_budget(tick: Callable[[], None]) -> CheckResult:
    """R23-R26: the Z3 proofs of ``proofs/z3_shared_budget.py``, every state of the model
    checker's 2-engine scope (``proofs/modelcheck_shared.py``), and each protocol mutant
    caught."""
    # deferred: z3_shared_budget imports z3 at its top; only the proof rows need it
    from vllm_output_rate.proofs import z3_shared_budget

    result = CheckResult("proofs/shared-budget", list(SHARED_RULES), part="spec health")
    with z3_alone():  # Z3 in one thread, its objects freed here (adapter/z3guard.py)
        records = list(z3_shared_budget.run_all())
    for record in records:
        tick()
        result.examples += 1
        if record["result"] != "proved" or not record["vacuity_ok"]:
            result.result = "fail"
            result.failure = f"{record['name']}: {record['result']}"
            result.counterexample.append(str(record["counterexample"]))
    for scope in modelcheck_shared.SCOPES:
        tick()
        outcome = modelcheck_shared.explore(scope)
        result.examples += 1
        result.steps += outcome.states
        if outcome.violation is not None or not outcome.complete:
            result.result = "fail"
            result.failure = f"scope {scope.name}: {outcome.violation}"
    for name, outcome in modelcheck_shared.run_mutants().items():
        tick()
        result.examples += 1
        if outcome.violation is None:
            result.result = "fail"
            result.failure = f"mutant {name} survived the scopes"
    return result


def _z3_proofs() -> int:
    """The ``proofs/z3`` row's examples (its progress bar): one tick per Z3 property."""
    # deferred: z3_limiter imports z3 at its top; only the proof rows need it
    from vllm_output_rate.proofs.z3_limiter import PROPERTIES

    return len(PROPERTIES)


def _shared_budget_items() -> int:
    """The ``proofs/shared-budget`` row's examples (its progress bar): its Z3 properties, scopes, mutants."""
    # deferred: z3_shared_budget imports z3 at its top; only the proof rows need it
    from vllm_output_rate.proofs import z3_shared_budget

    return len(z3_shared_budget.PROPERTIES) + len(modelcheck_shared.SCOPES) + len(modelcheck_shared.MUTANTS)


def _quick_scopes() -> int:
    return len(profile_scopes("quick"))


def spec_health_checks() -> list[GateRow]:
    """The spec-health rows of proofs/, in the gate's running order (last). Their budget is
    what they prove, whatever the profile: one progress tick per property, scope or mutant."""
    rows = [
        ("proofs/z3", Z3_RULES, lambda b: _z3_proofs(), lambda call: check_proofs(call.tick)),
        ("model-check/quick", MODEL_RULES, lambda b: _quick_scopes(), lambda call: check_model(call.tick)),
        (
            "proofs/shared-budget",
            SHARED_RULES,
            lambda b: _shared_budget_items(),
            lambda call: check_shared_budget(call.tick),
        ),
        ("identity/bind", IDENTITY_RULES, lambda b: identity_cases(), lambda call: check_identity(call.tick)),
    ]
    return [GateRow(name, "must", rules, None, budget, run, part="spec health") for name, rules, budget, run in rows]


def run_aside(name: str) -> CheckResult:
    """Run the spec-health row ``name`` (one of ``spec_health_checks``) on its own, with no
    progress ticks, through ``gate_row.run_planned`` (which sets ``seconds``, ``part`` and
    ``level``), and return its ``CheckResult``.

    For a worker process: these rows judge the spec and its proofs alone (pure Python and
    Z3, no vLLM import, no candidate, no option), so ``outrate conform`` runs them in a
    spawned process beside the candidate checks, on the second core. Their results are the
    same wherever they run.

    Raises:
        KeyError: ``name`` is not a row of ``spec_health_checks``.
    """
    specs = {spec.name: spec for spec in spec_health_checks()}
    if name not in specs:
        raise KeyError(f"not a proofs/ spec-health row: {name!r} (known: {sorted(specs)})")
    return run_planned(PlannedRow(specs[name]), GateOptions(scheduler_cls=""), lambda: None)  # rows read no option


def serve_aside(names: list[str], conn: Any) -> None:
    """Worker process entry: ``run_aside`` each of ``names`` in order and send
    ``(name, CheckResult)`` through ``conn`` (a ``multiprocessing`` connection) after each.
    An error ends the process; the gate then runs the rows not received itself."""
    for name in names:
        conn.send((name, run_aside(name)))
    conn.close()
