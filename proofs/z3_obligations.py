"""Proof obligations (``hypotheses => conclusion``) and their checking by Z3: each is
*proved* when ``Not(conclusion)`` is unsatisfiable under the hypotheses, and checked for
vacuity (its hypotheses alone satisfiable). ``z3_proof_record`` turns a property's checked
obligations into its manifest record; ``z3_limiter.py`` and ``z3_shared_budget.py`` use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import z3

from vllm_output_rate.proofs.records import proof_record

# --------------------------------------------------------------------------------------
# Obligations and their checking
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Obligation:
    """``And(hypotheses) => conclusion``, to be shown valid."""

    name: str
    hypotheses: tuple
    conclusion: object


def fmt_value(value) -> str:
    """A Z3 model value as text: True/False, an integer, a fraction ``n/d`` or a decimal."""
    if z3.is_true(value):
        return "True"
    if z3.is_false(value):
        return "False"
    if z3.is_int_value(value):
        return str(value.as_long())
    if z3.is_rational_value(value):
        frac = value.as_fraction()
        return str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    if z3.is_algebraic_value(value):
        return value.as_decimal(12)
    return str(value)


def _fmt_model(model: z3.ModelRef) -> str:
    items = sorted((d.name(), fmt_value(model[d])) for d in model.decls() if d.arity() == 0)
    return ", ".join(f"{k}={v}" for k, v in items)


def _check(ob: Obligation, timeout_ms: int) -> tuple[str, bool, str | None]:
    """Return (status in proved/refuted/unknown, vacuity_ok, model text if refuted)."""
    solver = z3.Solver()
    solver.set(timeout=timeout_ms)
    solver.add(*ob.hypotheses)
    vacuity_ok = solver.check() == z3.sat
    solver.add(z3.Not(ob.conclusion))
    answer = solver.check()
    if answer == z3.unsat:
        return "proved", vacuity_ok, None
    if answer == z3.sat:
        return "refuted", vacuity_ok, f"{ob.name}: {_fmt_model(solver.model())}"
    return "unknown", vacuity_ok, f"{ob.name}: {solver.reason_unknown()}"


@dataclass(frozen=True)
class Checked:
    """A property's obligations, each checked by Z3 (``check_obligations``).

    ``statuses``: per obligation, in order, ``"proved"``, ``"refuted"`` or ``"unknown"``;
    ``vacuity_ok``: every obligation's hypotheses alone are satisfiable; ``failures``: per
    obligation not proved, its name with Z3's model (refuted) or reason (unknown).
    """

    statuses: tuple[str, ...]
    vacuity_ok: bool
    failures: tuple[str, ...]

    @property
    def all_proved(self) -> bool:
        """Every obligation proved (an empty list of obligations counts as proved)."""
        return all(s == "proved" for s in self.statuses)


def check_obligations(obligations: Iterable[Obligation], timeout_ms: int) -> Checked:
    """Check each of ``obligations`` with a Z3 timeout of ``timeout_ms`` ms per check."""
    results = [_check(ob, timeout_ms) for ob in obligations]
    return Checked(
        statuses=tuple(status for status, _, _ in results),
        vacuity_ok=all(vac for _, vac, _ in results),
        failures=tuple(detail for _, _, detail in results if detail is not None),
    )


def z3_proof_record(
    name: str,
    rules: Sequence[str],
    obligations: Callable[[], Iterable[Obligation]],
    timeout_ms: int,
    verdict: Callable[[Checked], tuple[str, str | None]],
) -> dict:
    """Build ``obligations()``, check them (``check_obligations``, ``timeout_ms`` ms per
    check) and return the property's manifest record (``proof_record``, tool ``"z3"``):
    ``verdict(checked)`` gives the result (``"proved"``, ``"refuted"`` or ``"unknown"``) and
    the counterexample text or None; ``seconds`` covers all three."""
    start = time.perf_counter()
    checked = check_obligations(obligations(), timeout_ms)
    result, counterexample = verdict(checked)
    return proof_record(
        name,
        rules,
        "z3",
        result,
        round(time.perf_counter() - start, 4),
        vacuity_ok=checked.vacuity_ok,
        counterexample=counterexample,
    )
