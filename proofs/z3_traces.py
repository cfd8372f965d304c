"""Symbolic operation sequences from the empty limiter, for the refutation searches of
``z3_limiter.py`` only (never a proof): ``n`` symbolic (op, dt ns) steps applied to the
spec's or the reference's state, a solver over their constraints, and the printing of a
concrete counterexample trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import z3

from vllm_output_rate.proofs.z3_obligations import fmt_value
from vllm_output_rate.proofs.z3_semantics import ADV, CLEAN, NS_PER_S, OP_NAMES, REFUND, TAKE

# --------------------------------------------------------------------------------------
# Symbolic operation sequences from the empty limiter (refutation search only)
# --------------------------------------------------------------------------------------


@dataclass
class _Step:
    op: object
    now: object  # clock at which the operation acts (after the advance, for an advance)
    decision: object  # try_take's answer (meaningful when op == TAKE)
    granted: object
    known: object
    tat: object  # spec TAT (Real) or reference S (Int), after the step


def symbolic_ops(prefix: str, n: int, constraints: list) -> list[tuple]:
    """``n`` symbolic ``(op, dt ns)`` pairs named ``prefix``..., their domain added to ``constraints``."""
    ops = []
    for i in range(n):
        op, dt = z3.Int(f"{prefix}op{i}"), z3.Int(f"{prefix}dt{i}")
        constraints += [op >= ADV, op <= CLEAN, dt >= 0, z3.Implies(op != ADV, dt == 0)]
        ops.append((op, dt))
    return ops


def _limiter_run(ops, constraints, start, take, refund, cleanup) -> tuple[list[_Step], tuple]:
    """Apply ``ops`` (symbolic (op, dt ns) pairs) to one user's limiter entry, from
    ``start = (known, x, now, pend)``: ``x`` is the spec's TAT (Real ns) or the reference's
    scaled state S (Int); ``pend``: grants of the current step. A refund is allowed only
    while a same-step grant is pending (added to ``constraints``).

    ``take(known, x, now) -> (decision, known, x)``, ``refund(known, x) -> (known, x)`` and
    ``cleanup(known, x, now) -> known`` are the limiter's operations (R1, R4/R9, R6).
    Returns the steps and the entry after the last one.
    """
    known, x, now, pend = start
    steps = []
    for op, dt in ops:
        constraints.append(z3.Implies(op == REFUND, pend > 0))
        g, k_t, x_t = take(known, x, now)
        k_r, x_r = refund(known, x)
        k_c = cleanup(known, x, now)
        granted = z3.And(op == TAKE, g)
        known = z3.If(op == TAKE, k_t, z3.If(op == REFUND, k_r, z3.If(op == CLEAN, k_c, known)))
        x = z3.If(op == TAKE, x_t, z3.If(op == REFUND, x_r, x))
        pend = z3.If(op == ADV, 0, z3.If(granted, pend + 1, z3.If(op == REFUND, pend - 1, pend)))
        now = now + dt
        steps.append(_Step(op, now, g, granted, known, x))
    return steps, (known, x, now, pend)


def spec_run(sem, ops, T, tau, constraints, start=None) -> tuple[list[_Step], tuple]:
    """Apply ``ops`` to the spec state (``_limiter_run``), from ``start`` or a fresh entry."""
    return _limiter_run(
        ops,
        constraints,
        start or (z3.BoolVal(False), z3.RealVal(0), z3.IntVal(0), z3.IntVal(0)),
        lambda known, tat, now: sem.spec_take(known, tat, now, T, tau),
        lambda known, tat: sem.spec_refund(known, tat, T),
        lambda known, tat, now: sem.spec_cleanup(known, tat, now, tau),
    )


def ref_run(sem, ops, p, q, tau, constraints) -> list[_Step]:
    """Apply ``ops`` to the reference limiter's scaled state (``_limiter_run``), from a fresh entry."""
    inc, burst = sem.ref_scale(p, q, tau)
    steps, _ = _limiter_run(
        ops,
        constraints,
        (z3.BoolVal(False), z3.IntVal(0), z3.IntVal(0), z3.IntVal(0)),
        lambda known, S, now: sem.ref_take(known, S, now, p, inc, burst),
        lambda known, S: sem.ref_refund(known, S, inc),
        lambda known, S, now: sem.ref_cleanup(known, S, now, p, burst),
    )
    return steps


def render_trace(model, steps: list[_Step], label: str, scaled_p: int | None = None) -> str:
    """The concrete trace of ``steps`` in ``model`` as text, each step led by ``label``; the
    reference's scaled state when ``scaled_p`` is given, the spec's TAT otherwise."""
    lines = []
    label = f"{label} " if label else ""
    for st in steps:
        op = model.eval(st.op, model_completion=True).as_long()
        now = fmt_value(model.eval(st.now, model_completion=True))
        known = z3.is_true(model.eval(st.known, model_completion=True))
        tat = fmt_value(model.eval(st.tat, model_completion=True)) if known else "absent"
        unit = f"S(ns*{scaled_p})" if scaled_p is not None else "TAT(ns)"
        if op == ADV:
            lines.append(f"{label}clock -> {now}")
            continue
        what = OP_NAMES[op]
        if op == TAKE:
            ok = z3.is_true(model.eval(st.decision, model_completion=True))
            what += " granted" if ok else " refused"
        lines.append(f"{label}t={now} {what}, {unit}={tat}")
    return "; ".join(lines)


def rate_text(p: int, q: int, tau: int) -> str:
    """A rate ``p/q`` tokens/s with its emission interval and burst ``tau`` ns, as text."""
    return f"rate={p}/{q} tok/s (T={Fraction(NS_PER_S * q, p)} ns), tau={tau} ns"


def solve(constraints: list, timeout_ms: int) -> z3.ModelRef | None:
    """A model of ``constraints`` (timeout at least 1 s), or None if unsatisfiable or unknown."""
    solver = z3.Solver()
    solver.set(timeout=max(timeout_ms, 1000))
    solver.add(*constraints)
    return solver.model() if solver.check() == z3.sat else None
