"""Z3 proofs of the GCRA limiter rules R1-R6 (spec and integer-scaled reference).

Each property below is proved for *unbounded* integers and reals by an inductive argument
(an inductive invariant, a simulation relation or a bisimulation, each checked one step at a
time), never by unrolling a bounded number of steps. A property is a list of proof
obligations ``hypotheses => conclusion``; it is *proved* when Z3 shows every obligation
valid (``Not(conclusion)`` unsatisfiable under the hypotheses). Each obligation is also
checked for *vacuity*: its hypotheses alone must be satisfiable, otherwise the "proof" would
hold of nothing.

What is modelled
----------------
One user's limiter state, because every operation of ``spec/limiter.py`` and
``reference/limiter.py`` reads and writes only the entry of the user it names (cleanup
decides per user too), so users are independent and a one-user proof is a proof for each
user of a map.

* Spec state (``spec/limiter.py``): ``known: Bool`` (user present in the map) and
  ``tat: Real`` (TAT in ns, exact rational). Emission interval ``T = 10**9 / rate`` ns.
* Reference state (``reference/limiter.py``): ``known: Bool`` and ``S: Int`` with
  ``S = TAT_ns * p`` for a rate ``p/q`` tokens/s; the increment is ``10**9 * q`` and the
  scaled burst ``tau * p`` (R3).
* The scheduler's use of the limiter (``reference/scheduler.py``): the clock is monotonic;
  one ``schedule()`` call reads it once (``now``) and then performs ``try_take``, ``refund``
  (only of a grant made earlier in the *same* call, R9) and ``cleanup_idle_users`` (R6) at
  that ``now``, in any interleaving. The proofs track the number ``pend`` of grants made in
  the current call and not yet refunded, and allow a refund only while ``pend > 0``.

Units: times ``now``, ``tat``, ``tau`` (burst), ``T`` and windows ``W`` are nanoseconds;
rates are tokens per second; scaled values ``S``, ``inc``, ``burst*p`` are ns x p.
Where a proof uses real-valued times it is *stronger* than needed: integer nanoseconds are a
special case, and no operation of the spec rounds (only ``ready_at`` rounds, and its proof
uses integers).

Refutations
-----------
``BROKEN_VARIANTS`` holds deliberately wrong limiters (``<`` instead of ``<=``, ready_at
rounded down, refund by 2T, cleanup of users with TAT > now, ...). ``run_property(name,
variant)`` runs a property against one. If an obligation fails, a counterexample to an
inductive step alone could be an unreachable state, so the result is ``refuted`` only when a
bounded search from the *empty* limiter (used for refutation only, never as a proof) finds a
concrete operation sequence that violates the property; the counterexample printed is that
sequence. Otherwise the result is ``unknown``.

Run ``python -m vllm_output_rate.proofs.z3_limiter`` for the results table, or with
``--variant NAME`` to run every property against a broken variant.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import z3

from vllm_output_rate.proofs.records import proof_record
from vllm_output_rate.spec import limiter as spec_limiter

NS_PER_S: int = spec_limiter.NS_PER_S
BURST_NS: int = spec_limiter.BURST_NS

# Operation alphabet of one scheduler step sequence (refutation search and trace printing).
ADV, TAKE, REFUND, CLEAN = 0, 1, 2, 3
_OP_NAMES = {ADV: "advance", TAKE: "try_take", REFUND: "refund", CLEAN: "cleanup"}

# Rates (p, q) = p/q tokens/s tried by the refutation search, with tau = BURST_NS.
# 10/s: T == tau exactly (boundary of <=); 3/s and 7/3: T not an integer number of ns;
# 1/2: T > tau; 20/s: several grants in the idle burst.
_SEARCH_RATES: tuple[tuple[int, int], ...] = ((10, 1), (3, 1), (20, 1), (1, 2), (7, 3))


def _zmax(a, b):
    return z3.If(a >= b, a, b)


# --------------------------------------------------------------------------------------
# The limiter as Z3 terms. One record of functions = one implementation; broken variants
# replace some of them. Spec functions act on (known, tat: Real); reference functions on
# (known, S: Int).
# --------------------------------------------------------------------------------------


def _spec_allows(known, tat, now, tau):
    """R2 (spec ``allows``): unknown user, or ``TAT - now <= tau``."""
    return z3.Or(z3.Not(known), tat - now <= tau)


def _spec_take(sem, known, tat, now, T, tau):
    """R2 (spec ``try_take``): if allowed, ``TAT := max(TAT or now, now) + T``."""
    granted = sem.spec_allows(known, tat, now, tau)
    base = sem.spec_take_base(known, tat, now)
    return granted, z3.Or(known, granted), z3.If(granted, base + T, tat)


def _spec_take_base(known, tat, now):
    """R2: ``tat_of``: ``max(TAT, now)``, ``now`` for an unknown user."""
    return z3.If(known, _zmax(tat, now), now)


def _spec_refund(known, tat, T):
    """R4 (spec ``refund``): ``TAT := TAT - T`` (precondition: user known)."""
    return known, tat - T


def _spec_cleanup(known, tat, now, tau):
    """R6 (spec ``cleanup_idle_users``): the user is kept iff ``TAT > now``."""
    return z3.And(known, tat > now)


def _spec_ready_at(tat, tau):
    """R5 (spec ``ready_at_ns``): ``math.ceil(TAT - tau)``; ``ceil(x) = -floor(-x)``."""
    return -z3.ToInt(-(tat - tau))


def _ref_scale(p, q, tau):
    """R3 (reference ``_Scale``): increment ``10**9 * q``, scaled burst ``tau * p``."""
    return NS_PER_S * q, tau * p


def _ref_take(known, S, now, p, inc, burst):
    """R2/R3 (reference ``try_take``), branch for branch."""
    nowp = now * p
    reset = z3.Or(z3.Not(known), nowp > S)  # `tat is None or tat < now`: tat = now
    refused = z3.And(z3.Not(reset), S - nowp > burst)  # `elif tat - now > s.burst`
    granted = z3.Not(refused)
    return granted, z3.Or(known, granted), z3.If(granted, z3.If(reset, nowp, S) + inc, S)


def _ref_allows(known, S, now, p, burst):
    """R2/R3 (reference ``allows``)."""
    return z3.Or(z3.Not(known), S - now * p <= burst)


def _ref_refund(known, S, inc):
    """R4 (reference ``refund``): ``S -= inc``."""
    return known, S - inc


def _ref_cleanup(known, S, now, p, burst):
    """R6 (reference ``cleanup_idle_users``): kept iff ``S > now * p``."""
    return z3.And(known, now * p < S)


def _ref_ready_at(S, p, burst):
    """R5 (reference ``ready_at_ns``): ``-((burst - S) // p)``.

    Z3 integer division is Euclidean; for ``p >= 1`` it equals Python's floor ``//``.
    """
    return -((burst - S) / p)


def _spec_rerate(known, tat, now, rate, rate2):
    """R21 (``limiter.rescaled_tat_ns``): the TAT after the rate changes ``rate`` -> ``rate2``
    (tokens/s) at ``now``. Returns ``(known', tat', side)``, ``side`` the constraints on the
    fresh rounding term: a lead ``x`` with ``x x rate2 >= lead x rate`` (the lead in tokens
    kept) and less than 1 ns above it (rounded up to a whole ns). An unchanged rate keeps
    the TAT; a TAT not ahead of the clock is forgotten (idle, R6)."""
    x = z3.FreshReal("lead_rounded")
    ahead = z3.And(known, tat > now)
    side = [z3.Implies(ahead, z3.And(x * rate2 >= (tat - now) * rate, (x - 1) * rate2 < (tat - now) * rate))]
    new_tat = z3.If(rate2 == rate, tat, now + x)
    return z3.If(rate2 == rate, known, ahead), z3.If(ahead, new_tat, tat), side


@dataclass(frozen=True)
class Semantics:
    """One limiter implementation as Z3 term builders (the correct one or a broken one)."""

    name: str
    description: str
    spec_allows: Callable = _spec_allows
    spec_take_base: Callable = _spec_take_base
    spec_refund: Callable = _spec_refund
    spec_cleanup: Callable = _spec_cleanup
    spec_ready_at: Callable = _spec_ready_at
    ref_scale: Callable = _ref_scale
    ref_take: Callable = _ref_take
    ref_allows: Callable = _ref_allows
    ref_refund: Callable = _ref_refund
    ref_cleanup: Callable = _ref_cleanup
    ref_ready_at: Callable = _ref_ready_at
    spec_rerate: Callable = _spec_rerate  # R21

    def spec_take(self, known, tat, now, T, tau):
        return _spec_take(self, known, tat, now, T, tau)


def _rerate_reset(known, tat, now, rate, rate2):
    return known, z3.If(known, now, tat), []  # BUG: TAT := now (a second burst)


def _rerate_keep(known, tat, now, rate, rate2):
    return known, tat, []  # BUG: TAT unchanged (debt forgiven when the rate falls)


CORRECT = Semantics("correct", "spec/limiter.py and reference/limiter.py as written", spec_rerate=_spec_rerate)


def _ref_take_strict(known, S, now, p, inc, burst):
    nowp = now * p
    reset = z3.Or(z3.Not(known), nowp > S)
    refused = z3.And(z3.Not(reset), S - nowp >= burst)  # BUG: allowed iff lead < burst
    granted = z3.Not(refused)
    return granted, z3.Or(known, granted), z3.If(granted, z3.If(reset, nowp, S) + inc, S)


def _ref_take_no_max(known, S, now, p, inc, burst):
    nowp = now * p
    refused = z3.And(known, S - nowp > burst)
    granted = z3.Not(refused)
    return granted, z3.Or(known, granted), z3.If(granted, z3.If(known, S, nowp) + inc, S)  # BUG


def _ref_take_now_unscaled(known, S, now, p, inc, burst):
    return _ref_take(known, S, now, 1, inc, burst)  # BUG: compares S with now, not now*p


BROKEN_VARIANTS: dict[str, Semantics] = {
    v.name: v
    for v in (
        Semantics(
            "allow_strict_lt",
            "allow test TAT - now < tau instead of <= (spec and reference)",
            spec_allows=lambda known, tat, now, tau: z3.Or(z3.Not(known), tat - now < tau),
            ref_take=_ref_take_strict,
            ref_allows=lambda known, S, now, p, burst: z3.Or(z3.Not(known), S - now * p < burst),
        ),
        Semantics(
            "ready_at_round_down",
            "ready_at = floor(TAT - tau) instead of ceil (spec and reference)",
            spec_ready_at=lambda tat, tau: z3.ToInt(tat - tau),
            ref_ready_at=lambda S, p, burst: (S - burst) / p,
        ),
        Semantics(
            "refund_2T",
            "refund subtracts 2T instead of T (spec and reference)",
            spec_refund=lambda known, tat, T: (known, tat - 2 * T),
            ref_refund=lambda known, S, inc: (known, S - 2 * inc),
        ),
        Semantics(
            "cleanup_tat_gt_now",
            "cleanup deletes every user that may take now (TAT - now <= tau), "
            "including users with TAT > now (spec and reference)",
            spec_cleanup=lambda known, tat, now, tau: z3.And(known, tat - now > tau),
            ref_cleanup=lambda known, S, now, p, burst: z3.And(known, S - now * p > burst),
        ),
        Semantics(
            "take_without_max",
            "grant sets TAT := TAT + T, forgetting max(TAT, now) (spec and reference)",
            spec_take_base=lambda known, tat, now: z3.If(known, tat, now),
            ref_take=_ref_take_no_max,
        ),
        Semantics(
            "ref_increment_uses_p",
            "reference increment 10**9 * p instead of 10**9 * q (reference only)",
            ref_scale=lambda p, q, tau: (NS_PER_S * p, tau * p),
        ),
        Semantics(
            "ref_now_unscaled",
            "reference compares S with now instead of now * p (reference only)",
            ref_take=_ref_take_now_unscaled,
        ),
        Semantics(
            "rerate_reset_to_now",
            "R21: a rate change resets the TAT to now (spec)",
            spec_rerate=_rerate_reset,
        ),
        Semantics(
            "rerate_keep_tat",
            "R21: a rate change keeps the TAT unchanged, the lead in ns instead of in tokens (spec)",
            spec_rerate=_rerate_keep,
        ),
        Semantics(
            "ref_ready_at_round_down",
            "reference ready_at = (S - burst) // p, rounded down (reference only)",
            ref_ready_at=lambda S, p, burst: (S - burst) / p,
        ),
    )
}

VARIANTS: dict[str, Semantics] = {CORRECT.name: CORRECT, **BROKEN_VARIANTS}


# --------------------------------------------------------------------------------------
# Obligations and their checking
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Obligation:
    """``And(hypotheses) => conclusion``, to be shown valid."""

    name: str
    hypotheses: tuple
    conclusion: object


def _fmt_value(value) -> str:
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
    items = sorted((d.name(), _fmt_value(model[d])) for d in model.decls() if d.arity() == 0)
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


@dataclass(frozen=True)
class Property:
    """A named property: its rules, its proof obligations and a refutation search.

    ``run(timeout_ms, variant)`` returns the result record (see ``run_all``).
    """

    name: str
    rules: list[str]
    doc: str
    obligations: Callable[[Semantics], list[Obligation]]
    search: Callable[[Semantics, int], str | None]

    def run(self, timeout_ms: int = 5000, variant: Semantics | str = CORRECT) -> dict:
        sem = VARIANTS[variant] if isinstance(variant, str) else variant

        def verdict(checked: Checked) -> tuple[str, str | None]:
            if checked.all_proved:
                return "proved", None
            # A failed inductive step may be unreachable: refute only with a concrete trace.
            counterexample = self.search(sem, timeout_ms)
            return ("refuted" if counterexample is not None else "unknown"), counterexample

        return z3_proof_record(self.name, self.rules, lambda: self.obligations(sem), timeout_ms, verdict)

    # `fn` is the spelling the project's manifest uses for "the function returning the result".
    @property
    def fn(self) -> Callable[..., dict]:
        return self.run


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


def _ops(prefix: str, n: int, constraints: list) -> list[tuple]:
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


def _spec_run(sem, ops, T, tau, constraints, start=None) -> tuple[list[_Step], tuple]:
    """Apply ``ops`` to the spec state (``_limiter_run``), from ``start`` or a fresh entry."""
    return _limiter_run(
        ops,
        constraints,
        start or (z3.BoolVal(False), z3.RealVal(0), z3.IntVal(0), z3.IntVal(0)),
        lambda known, tat, now: sem.spec_take(known, tat, now, T, tau),
        lambda known, tat: sem.spec_refund(known, tat, T),
        lambda known, tat, now: sem.spec_cleanup(known, tat, now, tau),
    )


def _ref_run(sem, ops, p, q, tau, constraints) -> list[_Step]:
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


def _render(model, steps: list[_Step], label: str, scaled_p: int | None = None) -> str:
    lines = []
    label = f"{label} " if label else ""
    for st in steps:
        op = model.eval(st.op, model_completion=True).as_long()
        now = _fmt_value(model.eval(st.now, model_completion=True))
        known = z3.is_true(model.eval(st.known, model_completion=True))
        tat = _fmt_value(model.eval(st.tat, model_completion=True)) if known else "absent"
        unit = f"S(ns*{scaled_p})" if scaled_p is not None else "TAT(ns)"
        if op == ADV:
            lines.append(f"{label}clock -> {now}")
            continue
        what = _OP_NAMES[op]
        if op == TAKE:
            ok = z3.is_true(model.eval(st.decision, model_completion=True))
            what += " granted" if ok else " refused"
        lines.append(f"{label}t={now} {what}, {unit}={tat}")
    return "; ".join(lines)


def _rate_text(p: int, q: int, tau: int) -> str:
    return f"rate={p}/{q} tok/s (T={Fraction(NS_PER_S * q, p)} ns), tau={tau} ns"


def _solve(constraints: list, timeout_ms: int) -> z3.ModelRef | None:
    solver = z3.Solver()
    solver.set(timeout=max(timeout_ms, 1000))
    solver.add(*constraints)
    return solver.model() if solver.check() == z3.sat else None


# --------------------------------------------------------------------------------------
# (a) R2 window bound
# --------------------------------------------------------------------------------------


def _window_inv(known, tat, c, s, k, pend, T, tau):
    """Inductive invariant of the window bound at clock ``c`` for a window starting at ``s``.

    ``k``: grants net of refunds made at times in ``[s, c]``; ``pend``: grants of the
    current scheduler step not yet refunded.
    """
    return z3.And(
        k >= 0,
        pend >= 0,
        z3.Implies(c < s, k == 0),
        z3.Implies(c >= s, pend <= k),  # a refund at c >= s undoes a counted grant
        z3.Implies(pend > 0, z3.And(known, tat >= c + pend * T)),
        z3.Implies(k > 0, z3.If(known, tat, c) >= s + k * T),
        z3.Implies(k > 0, (k - 1) * T <= c - s + tau),
    )


def _window_step_obligations(sem: Semantics, hyp: tuple, after, known, tat, c, s, k, pend, T, tau) -> list[Obligation]:
    """The limiter's own steps in a window-bound induction (R2, and R21 across rate changes):
    a try_take, a refund of a pending grant, a cleanup, each from a state satisfying ``hyp``.

    ``after(known, tat, k, pend, counted)`` is the invariant after a step, given the user's
    limiter entry, the net grants ``k`` in the window opened at ``s`` (ns) and the step's
    pending grants; ``counted`` is the Z3 condition that the step made a grant counted in
    the window (a take at ``c >= s``), or None for a step that grants nothing.
    """
    in_window = c >= s
    g, k_t, t_t = sem.spec_take(known, tat, c, T, tau)
    counted = z3.And(g, in_window)
    after_take = after(k_t, t_t, z3.If(counted, k + 1, k), z3.If(g, pend + 1, pend), counted)
    k_r, t_r = sem.spec_refund(known, tat, T)
    after_refund = after(k_r, t_r, z3.If(in_window, k - 1, k), pend - 1, None)
    after_clean = after(sem.spec_cleanup(known, tat, c, tau), tat, k, pend, None)
    return [
        Obligation("step_take", hyp, after_take),
        # R4/R9: a refund undoes a grant of the same step; the user must still be known.
        Obligation("step_refund", hyp + (pend > 0,), z3.And(known, after_refund)),
        Obligation("step_cleanup", hyp, after_clean),
    ]


def _window_obligations(sem: Semantics) -> list[Obligation]:
    """R2 window bound, all times in ns (reals), T = 10**9/rate ns > 0, tau >= 0 ns.

    Invariant ``_window_inv`` holds initially (k = pend = 0, any TAT) and is preserved by:
    a new scheduler step at a later clock (pend := 0), a try_take (counted iff c >= s), a
    refund of a pending grant, a cleanup. Closing: in every state with ``c <= s + W``,
    ``k <= (W + tau) * rate / 10**9 + 1``. Since operations happen in clock order, the net
    grants in the closed window [s, s + W] equal ``k`` in the last state with
    ``c <= s + W``, so the bound holds for every window.
    """
    known, _known2 = z3.Bools("known known2")
    tat, _tat2, c, c2, s, W, T, tau, rate = z3.Reals("tat tat2 c c2 s W T tau rate")
    k, pend = z3.Ints("k pend")
    params = [T > 0, tau >= 0]
    inv = _window_inv(known, tat, c, s, k, pend, T, tau)
    hyp = tuple(params + [inv])

    def after(known_, tat_, k_, pend_, counted):  # counted: already in k_ (R2 tracks no rate)
        return _window_inv(known_, tat_, c, s, k_, pend_, T, tau)

    return [
        Obligation("init", tuple(params), _window_inv(known, tat, c, s, 0, 0, T, tau)),
        Obligation("step_advance", hyp + (c2 >= c,), _window_inv(known, tat, c2, s, k, 0, T, tau)),
        *_window_step_obligations(sem, hyp, after, known, tat, c, s, k, pend, T, tau),
        Obligation(
            "close",
            hyp + (W >= 0, c <= s + W, rate > 0, T * rate == NS_PER_S),
            k <= (W + tau) * rate / NS_PER_S + 1,
        ),
    ]


def _window_search(sem: Semantics, timeout_ms: int, depth: int = 7) -> str | None:
    for p, q in _SEARCH_RATES:
        T, tau = z3.RealVal(Fraction(NS_PER_S * q, p)), BURST_NS
        cons: list = []
        ops = _ops("", depth, cons)
        steps, _ = _spec_run(sem, ops, T, tau, cons)
        s, W = z3.Ints("s W")
        cons += [s >= 0, W >= 0]
        count = 0
        for (op, _), st in zip(ops, steps):
            inside = z3.And(st.now >= s, st.now <= s + W)
            count = count + z3.If(z3.And(inside, st.granted), 1, 0) - z3.If(z3.And(inside, op == REFUND), 1, 0)
        cons.append((count - 1) * T > W + tau)
        model = _solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{_rate_text(p, q, tau)}, window [s={model[s]}, s+W={model.eval(s + W)}]: "
                f"{model.eval(count)} net grants > bound "
                f"{spec_limiter.window_bound_tokens(model[W].as_long(), Fraction(p, q), tau)}; "
                + _render(model, steps, "")
            )
    return None


# --------------------------------------------------------------------------------------
# (b) R2 idle burst
# --------------------------------------------------------------------------------------


def _burst_obligations(sem: Semantics) -> list[Obligation]:
    """R2 idle burst: from idle, takes at one instant ``t`` (ns) are granted exactly
    ``N = floor(tau * rate / 10**9) + 1`` times (tau in ns, rate in tokens/s).

    Induction on the number ``m`` of takes made at ``t``: with ``N`` the integer such that
    ``(N-1)*T <= tau < N*T``, after ``m >= 1`` takes the user is known with
    ``TAT = t + min(m, N) * T`` (base: idle, i.e. absent or TAT <= t, R6). Step: the
    (m+1)-th take is granted iff ``m * T <= tau``. So the k-th take succeeds iff
    ``(k-1) * T <= tau`` iff ``k <= N``. Closing: that ``N`` is ``floor(tau*rate/1e9) + 1``.
    """
    known = z3.Bool("known")
    tat, t, T, tau, rate = z3.Reals("tat t T tau rate")
    m, N = z3.Ints("m N")
    params = [T > 0, tau >= 0]
    n_def = [N >= 1, tau >= (N - 1) * T, tau < N * T]
    g0, k0, t0 = sem.spec_take(known, tat, t, T, tau)
    j = z3.If(m <= N, m, N)
    j1 = z3.If(m + 1 <= N, m + 1, N)
    g, k1, t1 = sem.spec_take(known, tat, t, T, tau)
    return [
        Obligation(
            "base_idle",
            tuple(params + [z3.Or(z3.Not(known), tat <= t)]),
            z3.And(g0, k0, t0 == t + T),
        ),
        Obligation(
            "step",
            tuple(params + n_def + [m >= 1, known, tat == t + j * T]),
            z3.And(g == (m * T <= tau), k1, t1 == t + j1 * T),
        ),
        Obligation(
            "close",
            tuple(params + [rate > 0, T * rate == NS_PER_S, z3.ToInt(tau * rate / NS_PER_S) + 1 == N]),
            z3.And(N >= 1, tau >= (N - 1) * T, tau < N * T),
        ),
        Obligation(
            "k_th_take_iff",
            tuple(params + n_def + [m >= 1]),
            (m <= N) == ((m - 1) * T <= tau),
        ),
    ]


def _burst_search(sem: Semantics, timeout_ms: int, depth: int = 3) -> str | None:
    """Any short prefix from the empty limiter that leaves the user idle at clock c0
    (absent, or TAT <= c0), then floor(tau*rate)+2 takes at c0."""
    for p, q in _SEARCH_RATES:
        rate, tau = Fraction(p, q), BURST_NS
        T = z3.RealVal(Fraction(NS_PER_S * q, p))
        expected = spec_limiter.idle_burst_grants(rate, tau)
        cons: list = []
        prefix = _ops("pre_", depth, cons)
        pre_steps, (k0, t0, c0, pend0) = _spec_run(sem, prefix, T, tau, cons)
        cons.append(z3.Or(z3.Not(k0), t0 <= c0))
        ops = [(z3.IntVal(TAKE), z3.IntVal(0))] * (expected + 1)
        steps, _ = _spec_run(sem, ops, T, tau, cons, start=(k0, t0, c0, pend0))
        grants = z3.Sum([z3.If(st.granted, 1, 0) for st in steps])
        cons.append(grants != expected)
        model = _solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{_rate_text(p, q, tau)}: {model.eval(grants)} grants at t={model.eval(c0)} from idle, "
                f"expected floor(tau*rate)+1 = {expected}; prefix: {_render(model, pre_steps, '')} | "
                f"burst: {_render(model, steps, '')}"
            )
    return None


# --------------------------------------------------------------------------------------
# (c) R3 integer scaling simulates the exact spec
# --------------------------------------------------------------------------------------


def _sim_rel(ks, tat, kr, S, p):
    """Simulation relation: same users known, and ``S == TAT * p`` (R3)."""
    return z3.And(ks == kr, z3.Implies(ks, z3.ToReal(S) == tat * z3.ToReal(p)))


def _sim_obligations(sem: Semantics) -> list[Obligation]:
    """R3: for every rate p/q tokens/s (integers p, q >= 1) and integer tau >= 0 ns, the
    reference (scaled ints, S = TAT_ns * p) and the exact spec (TAT rational ns,
    T = 10**9 q / p ns) related by ``_sim_rel`` make the same try_take decision and stay
    related after try_take, refund and cleanup at any integer ``now`` (ns); ``allows``
    agrees and ``tat_ns() = S/p`` equals the spec TAT. The empty limiters are related, so by
    induction every operation sequence gives the same decisions in both.
    """
    ks, kr = z3.Bools("spec_known ref_known")
    tat, T = z3.Reals("tat T")
    S, now, p, q, tau = z3.Ints("S now p q tau")
    inc, burst = sem.ref_scale(p, q, tau)
    hyp = (p >= 1, q >= 1, tau >= 0, T * p == NS_PER_S * q, _sim_rel(ks, tat, kr, S, p))

    gs, ks1, tat1 = sem.spec_take(ks, tat, now, T, tau)
    gr, kr1, S1 = sem.ref_take(kr, S, now, p, inc, burst)
    ks2, tat2 = sem.spec_refund(ks, tat, T)
    kr2, S2 = sem.ref_refund(kr, S, inc)
    ks3 = sem.spec_cleanup(ks, tat, now, tau)
    kr3 = sem.ref_cleanup(kr, S, now, p, burst)
    return [
        Obligation(
            "init_empty", (p >= 1,), _sim_rel(z3.BoolVal(False), z3.RealVal(0), z3.BoolVal(False), z3.IntVal(0), p)
        ),
        Obligation("try_take", hyp, z3.And(gs == gr, _sim_rel(ks1, tat1, kr1, S1, p))),
        Obligation("refund", hyp + (ks,), z3.And(kr, _sim_rel(ks2, tat2, kr2, S2, p))),
        Obligation("cleanup", hyp, _sim_rel(ks3, tat, kr3, S, p)),
        Obligation(
            "observers",
            hyp,
            z3.And(
                sem.spec_allows(ks, tat, now, tau) == sem.ref_allows(kr, S, now, p, burst),
                z3.Implies(ks, z3.ToReal(S) / z3.ToReal(p) == tat),
            ),
        ),
    ]


def _sim_search(sem: Semantics, timeout_ms: int, depth: int = 5) -> str | None:
    for p, q in _SEARCH_RATES:
        tau = BURST_NS
        cons: list = []
        ops = _ops("", depth, cons)
        spec_steps, _ = _spec_run(sem, ops, z3.RealVal(Fraction(NS_PER_S * q, p)), tau, cons)
        ref_steps = _ref_run(sem, ops, p, q, tau, cons)
        bad = []
        for (op, _), a, b in zip(ops, spec_steps, ref_steps):
            bad.append(z3.And(op == TAKE, a.decision != b.decision))
            bad.append(z3.Not(_sim_rel(a.known, a.tat, b.known, b.tat, z3.IntVal(p))))
        cons.append(z3.Or(bad))
        model = _solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{_rate_text(p, q, tau)}: spec and reference diverge; "
                + _render(model, spec_steps, "spec")
                + " | "
                + _render(model, ref_steps, "ref", scaled_p=p)
            )
    return None


# --------------------------------------------------------------------------------------
# (d) R5 ready_at is exact
# --------------------------------------------------------------------------------------


def _ready_obligations(sem: Semantics) -> list[Obligation]:
    """R5 (with R3): ready_at (integer ns) is the earliest integer ns at which try_take
    succeeds. For every known state: a take at ``ready_at`` is granted and a take at
    ``ready_at - 1`` is refused, and more generally a take at integer ``now`` is granted iff
    ``now >= ready_at``, for the spec (``ceil`` of a rational, encoded with Z3's
    floor ``ToInt``) and for the reference (``-((tau*p - S) // p)``, Z3 integer division,
    any p, q >= 1); the spec value is the unique integer r with ``r - 1 < TAT - tau <= r``;
    and on related states (S = TAT * p) the two values are equal. Per-state lemmas over
    all states (so over every reachable one); tau >= 0 ns integer. The lemmas are about the
    decision formula at any integer ``now``; a negative ready_at lies before the clock's
    start, and a user absent from the map has ``ready_at = None`` (may take at any time, R6).
    """
    tat, T = z3.Reals("tat T")
    S, p, q, tau = z3.Ints("S p q tau")
    yes = z3.BoolVal(True)
    inc, burst = sem.ref_scale(p, q, tau)
    r_spec = sem.spec_ready_at(tat, tau)
    r_ref = sem.ref_ready_at(S, p, burst)
    params = (p >= 1, q >= 1, tau >= 0, T * p == NS_PER_S * q)
    spec_at = lambda now: sem.spec_take(yes, tat, now, T, tau)[0]
    ref_at = lambda now: sem.ref_take(yes, S, now, p, inc, burst)[0]
    now = z3.Int("now")
    earliest = lambda ok, r: z3.And(z3.Implies(now >= r, ok(now)), z3.Implies(now < r, z3.Not(ok(now))))
    return [
        Obligation("spec_take_at_ready_at", params, z3.And(spec_at(r_spec), z3.Not(spec_at(r_spec - 1)))),
        Obligation("spec_ready_at_is_earliest", params, earliest(spec_at, r_spec)),
        Obligation("ref_ready_at_is_earliest", params, earliest(ref_at, r_ref)),
        Obligation("spec_ready_at_is_ceil", params, z3.And(r_spec - 1 < tat - tau, tat - tau <= r_spec)),
        Obligation("ref_take_at_ready_at", params, z3.And(ref_at(r_ref), z3.Not(ref_at(r_ref - 1)))),
        Obligation("ref_equals_spec", params + (z3.ToReal(S) == tat * z3.ToReal(p),), r_ref == r_spec),
    ]


def _ready_search(sem: Semantics, timeout_ms: int, depth: int = 5) -> str | None:
    yes = z3.BoolVal(True)
    for p, q in _SEARCH_RATES:
        tau = BURST_NS
        T = z3.RealVal(Fraction(NS_PER_S * q, p))
        cons: list = []
        ops = _ops("", depth, cons)
        spec_steps, (ks, tat, clock, _) = _spec_run(sem, ops, T, tau, cons)
        ref_steps = _ref_run(sem, ops, p, q, tau, cons)
        kr, S = ref_steps[-1].known, ref_steps[-1].tat
        inc, burst = sem.ref_scale(z3.IntVal(p), z3.IntVal(q), z3.IntVal(tau))
        r_spec, r_ref = sem.spec_ready_at(tat, tau), sem.ref_ready_at(S, z3.IntVal(p), burst)
        spec_ok = lambda now, tat=tat, T=T, tau=tau: sem.spec_take(yes, tat, now, T, tau)[0]
        ref_ok = lambda now, S=S, p=p, inc=inc, burst=burst: sem.ref_take(yes, S, now, p, inc, burst)[0]
        # Both ready_at and ready_at - 1 ns are times the clock can still show (>= clock).
        cons += [ks, kr, r_spec >= clock + 1, r_ref >= clock + 1]
        cons.append(
            z3.Or(
                z3.Not(spec_ok(r_spec)),
                spec_ok(r_spec - 1),
                z3.Not(ref_ok(r_ref)),
                ref_ok(r_ref - 1),
                r_spec != r_ref,
            )
        )
        model = _solve(cons, timeout_ms)
        if model is not None:
            rs, rr = model.eval(r_spec), model.eval(r_ref)
            return (
                f"{_rate_text(p, q, tau)}: spec ready_at={rs} (take there "
                f"{'granted' if z3.is_true(model.eval(spec_ok(rs))) else 'refused'}, at -1 ns "
                f"{'granted' if z3.is_true(model.eval(spec_ok(rs - 1))) else 'refused'}), "
                f"reference ready_at={rr} (take there "
                f"{'granted' if z3.is_true(model.eval(ref_ok(rr))) else 'refused'}, at -1 ns "
                f"{'granted' if z3.is_true(model.eval(ref_ok(rr - 1))) else 'refused'}); "
                + _render(model, spec_steps, "")
            )
    return None


# --------------------------------------------------------------------------------------
# (e), (f) R4 / R6: observational equivalence (a bisimulation)
# --------------------------------------------------------------------------------------


def _pending_ok(known, tat, c, pend, T):
    """Grants of the current step not yet refunded: each lies above the clock."""
    return z3.And(pend >= 0, z3.Implies(pend > 0, z3.And(known, tat >= c + pend * T)))


def _equiv(ka, ta, kb, tb, c, pend, T):
    """Bisimulation at clock ``c``: same effective TAT ``max(TAT, c)`` (absent = c)."""
    eff_a = z3.If(ka, _zmax(ta, c), c)
    eff_b = z3.If(kb, _zmax(tb, c), c)
    return z3.And(eff_a == eff_b, _pending_ok(ka, ta, c, pend, T), _pending_ok(kb, tb, c, pend, T))


def _bisim_obligations(sem: Semantics, variables) -> list[Obligation]:
    """``_equiv`` is a bisimulation of the scheduler's operations that preserves decisions.

    Related states (same clock, same pending grants) make the same try_take decision, the
    same ``allows`` answer and have the same earliest allowed time ``max(TAT - tau, c)``
    (absent = c); they stay related after a later scheduler step (pend := 0), a try_take,
    a refund of a pending grant (both users known) and a cleanup.
    """
    ka, kb = variables["ka"], variables["kb"]
    ta, tb, c, c2, T, tau = (variables[n] for n in ("ta", "tb", "c", "c2", "T", "tau"))
    pend = variables["pend"]
    params = (T > 0, tau >= 0)
    hyp = params + (_equiv(ka, ta, kb, tb, c, pend, T),)
    ga, ka1, ta1 = sem.spec_take(ka, ta, c, T, tau)
    gb, kb1, tb1 = sem.spec_take(kb, tb, c, T, tau)
    ka2, ta2 = sem.spec_refund(ka, ta, T)
    kb2, tb2 = sem.spec_refund(kb, tb, T)
    ka3, kb3 = sem.spec_cleanup(ka, ta, c, tau), sem.spec_cleanup(kb, tb, c, tau)
    earliest = lambda k, t: z3.If(k, _zmax(t - tau, c), c)
    return [
        Obligation("bisim_advance", hyp + (c2 >= c,), _equiv(ka, ta, kb, tb, c2, 0, T)),
        Obligation(
            "bisim_take",
            hyp,
            z3.And(ga == gb, _equiv(ka1, ta1, kb1, tb1, c, z3.If(ga, pend + 1, pend), T)),
        ),
        Obligation("bisim_refund", hyp + (pend > 0,), z3.And(ka, kb, _equiv(ka2, ta2, kb2, tb2, c, pend - 1, T))),
        Obligation("bisim_cleanup", hyp, _equiv(ka3, ta, kb3, tb, c, pend, T)),
        Obligation(
            "bisim_observers",
            hyp,
            z3.And(
                sem.spec_allows(ka, ta, c, tau) == sem.spec_allows(kb, tb, c, tau),
                earliest(ka, ta) == earliest(kb, tb),
            ),
        ),
    ]


def _bisim_vars():
    ka, kb = z3.Bools("known_a known_b")
    ta, tb, c, c2, T, tau = z3.Reals("tat_a tat_b c c2 T tau")
    return {"ka": ka, "kb": kb, "ta": ta, "tb": tb, "c": c, "c2": c2, "T": T, "tau": tau, "pend": z3.Int("pend")}


def _take_refund_obligations(sem: Semantics) -> list[Obligation]:
    """R4 (with R9): a try_take at clock ``c`` (ns) followed by a refund at ``c`` changes no
    future decision. Proof: from any state with its pending grants (``_pending_ok``), the
    state after take+refund is ``_equiv``-related to the state before (and the refund finds
    the user known); ``_equiv`` is a bisimulation preserving every decision
    (``_bisim_obligations``), so by induction on any later operation sequence both states
    give the same decisions. Times are reals (ns), T > 0, tau >= 0.
    """
    v = _bisim_vars()
    ka, ta, c, T, tau, pend = v["ka"], v["ta"], v["c"], v["T"], v["tau"], v["pend"]
    g, k1, t1 = sem.spec_take(ka, ta, c, T, tau)
    k2, t2 = sem.spec_refund(k1, t1, T)
    kb, tb = z3.If(g, k2, ka), z3.If(g, t2, ta)
    return [
        Obligation(
            "take_then_refund_related",
            (T > 0, tau >= 0, _pending_ok(ka, ta, c, pend, T)),
            z3.And(z3.Implies(g, k1), _equiv(kb, tb, ka, ta, c, pend, T)),
        )
    ] + _bisim_obligations(sem, v)


def _cleanup_obligations(sem: Semantics) -> list[Obligation]:
    """R6: deleting a user whose TAT <= now (what cleanup does) changes no future decision:
    a deleted user that returns behaves exactly as if kept. Proof: the state after cleanup
    at clock ``c`` (ns) is ``_equiv``-related to the state before, and ``_equiv`` is a
    bisimulation preserving every decision (``_bisim_obligations``). Reals, T > 0, tau >= 0.
    """
    v = _bisim_vars()
    ka, ta, c, T, tau, pend = v["ka"], v["ta"], v["c"], v["T"], v["tau"], v["pend"]
    kb = sem.spec_cleanup(ka, ta, c, tau)
    return [
        Obligation(
            "cleanup_related",
            (T > 0, tau >= 0, _pending_ok(ka, ta, c, pend, T)),
            _equiv(kb, ta, ka, ta, c, pend, T),
        )
    ] + _bisim_obligations(sem, v)


def _divergence_search(sem: Semantics, timeout_ms: int, insert: str, n1: int = 4, n2: int = 3) -> str | None:
    """Two runs share a prefix; run B then does take+refund (or cleanup) at the same
    instant; both then do the same suffix. Violation: a try_take decision differs."""
    for p, q in _SEARCH_RATES:
        T, tau = z3.RealVal(Fraction(NS_PER_S * q, p)), BURST_NS
        cons: list = []
        prefix = _ops("pre_", n1, cons)
        pre_steps, (k0, t0, c0, pend0) = _spec_run(sem, prefix, T, tau, cons)
        if insert == "take_refund":
            g, k1, t1 = sem.spec_take(k0, t0, c0, T, tau)
            k2, t2 = sem.spec_refund(k1, t1, T)
            kb, tb = z3.If(g, k2, k0), z3.If(g, t2, t0)
            note = "B: try_take " + "%s" + " then refund"
        else:
            kb, tb = sem.spec_cleanup(k0, t0, c0, tau), t0
            note = "B: cleanup"
        suffix = _ops("suf_", n2, cons)
        a_steps, _ = _spec_run(sem, suffix, T, tau, cons, start=(k0, t0, c0, pend0))
        b_steps, _ = _spec_run(sem, suffix, T, tau, [], start=(kb, tb, c0, pend0))
        cons.append(
            z3.Or([z3.And(op == TAKE, a.decision != b.decision) for (op, _), a, b in zip(suffix, a_steps, b_steps)])
        )
        model = _solve(cons, timeout_ms)
        if model is not None:
            if insert == "take_refund":
                note = note % ("granted" if z3.is_true(model.eval(g, model_completion=True)) else "refused")
            return (
                f"{_rate_text(p, q, tau)}: prefix: {_render(model, pre_steps, '')} | at "
                f"t={model.eval(c0)} {note} | A: {_render(model, a_steps, 'A')} | "
                f"B: {_render(model, b_steps, 'B')}"
            )
    return None


# --------------------------------------------------------------------------------------
# (g) R21: a rate change, window bound across it and no burst from it
# --------------------------------------------------------------------------------------


def _lead(known, tat, c):
    """The effective lead ``max(TAT, c) - c`` (0 for an unknown user), ns."""
    return z3.If(known, _zmax(tat, c), c) - c


def _rerate_inv(known, tat, c, s, k, pend, R, T, tau, A, M):
    """Inductive invariant of R21's window bound for a window starting at ``s``, clock ``c``.

    ``k``: net grants at times in ``[s, c]``; ``pend``: grants of the current step not yet
    refunded; ``R``: the rate in force (tokens/s, ``T x R = 10**9``); ``A``: the credit
    accrued in ``[s, c]``, the integral of the rate in force, x 10**9 (tokens x 10**9);
    ``M``: the largest rate at which a counted grant was made. In tokens: the grants so far
    are at most the credit plus the lead (``k <= A + lead x R``), and at most the credit
    plus one burst at ``M`` plus one (``k - 1 <= A + tau x M``).
    """
    return z3.And(
        k >= 0,
        pend >= 0,
        A >= 0,
        M >= 0,
        z3.Implies(c < s, z3.And(k == 0, A == 0)),
        z3.Implies(c >= s, pend <= k),
        z3.Implies(pend > 0, z3.And(known, tat >= c + pend * T)),
        z3.Implies(k > 0, k * NS_PER_S <= A + _lead(known, tat, c) * R),
        z3.Implies(k > 0, (k - 1) * NS_PER_S <= A + tau * M),
    )


def _rerate_window_obligations(sem: Semantics) -> list[Obligation]:
    """R21 window bound across rate changes, all times in ns (reals), rates in tokens/s.

    With the rate in force changing any number of times (each change at a step boundary,
    R21: ``spec_rerate``), the invariant ``_rerate_inv`` holds initially and is preserved
    by a new step at a later clock (the credit grows by the elapsed time in the window x
    the rate), a try_take, a refund of a pending grant, a cleanup and a rate change.
    Closing: net grants in a window ``[s, e]`` are at most ``(A + tau x M) / 10**9 + 1``
    where ``A / 10**9`` is the integral of the rate over the window and ``M`` the largest
    rate in force at a grant; with one change at ``c0`` from ``r_old`` to ``r_new``:
    ``(c0 - s) x r_old + (e - c0) x r_new + tau x max(r_old, r_new)``, each side's rate and
    one burst. A reset to now or an unchanged TAT breaks the change step.
    """
    known = z3.Bool("known")
    tat, c, c2, s, T, T2, R, R2, tau, A, M = z3.Reals("tat c c2 s T T2 R R2 tau A M")
    c0, r_old, r_new = z3.Reals("c0 r_old r_new")
    k, pend = z3.Ints("k pend")
    params = [R > 0, T * R == NS_PER_S, tau >= 0]
    inv = _rerate_inv(known, tat, c, s, k, pend, R, T, tau, A, M)
    hyp = tuple(params + [inv])

    def after(known_, tat_, k_, pend_, counted):
        # A counted grant is made at the rate in force: M := max(M, R).
        M_ = M if counted is None else z3.If(counted, _zmax(M, R), M)
        return _rerate_inv(known_, tat_, c, s, k_, pend_, R, T, tau, A, M_)

    accrued = A + (_zmax(c2, s) - _zmax(c, s)) * R
    after_advance = _rerate_inv(known, tat, c2, s, k, 0, R, T, tau, accrued, M)
    k_n, t_n, side = sem.spec_rerate(known, tat, c, R, R2)
    after_change = _rerate_inv(k_n, t_n, c, s, k, pend, R2, T2, tau, A, M)
    return [
        Obligation("init", tuple(params), _rerate_inv(known, tat, c, s, 0, 0, R, T, tau, 0, 0)),
        Obligation("step_advance", hyp + (c2 >= c,), after_advance),
        *_window_step_obligations(sem, hyp, after, known, tat, c, s, k, pend, T, tau),
        # R21: a change at a step boundary (no grant of the step pending), any new rate.
        Obligation("step_rate_change", hyp + (pend == 0, R2 > 0, T2 * R2 == NS_PER_S, *side), after_change),
        Obligation("close", hyp, k <= (A + tau * M) / NS_PER_S + 1),
        Obligation(
            "close_one_change",
            hyp
            + (
                s <= c0,
                c0 <= c,
                r_old > 0,
                r_new > 0,
                (c0 - s) * r_old + (c - c0) * r_new == A,
                _zmax(r_old, r_new) >= M,
            ),
            k <= ((c0 - s) * r_old + (c - c0) * r_new + tau * _zmax(r_old, r_new)) / NS_PER_S + 1,
        ),
    ]


def _greedy_at(sem: Semantics, known, tat, now, T, tau, takes: int):
    """``takes`` try_takes at ``now``; returns (known, tat, granted count term)."""
    count = 0
    for _ in range(takes):
        g, known, tat = sem.spec_take(known, tat, now, T, tau)
        count = count + z3.If(g, 1, 0)
    return known, tat, count


def _rerate_window_search(sem: Semantics, timeout_ms: int) -> str | None:
    """A user takes greedily at 0, the rate changes at 0, it takes greedily at ``d``: more
    grants in ``[0, d]`` than the piecewise bound (concrete, from the empty limiter)."""
    tau = BURST_NS
    for p_old, p_new in ((10, 10), (100, 1), (10, 2), (2, 10)):
        for d in (0, 10_000_000, 50_000_000):
            T_old, T_new = Fraction(NS_PER_S, p_old), Fraction(NS_PER_S, p_new)
            known, tat, n1 = _greedy_at(sem, z3.BoolVal(False), z3.RealVal(0), 0, z3.RealVal(T_old), tau, 25)
            known, tat, side = sem.spec_rerate(known, tat, z3.RealVal(0), z3.RealVal(p_old), z3.RealVal(p_new))
            known, tat, n2 = _greedy_at(sem, known, tat, d, z3.RealVal(T_new), tau, 25)
            bound = spec_limiter.piecewise_window_bound_tokens([(0, Fraction(p_old)), (d, Fraction(p_new))], tau)
            model = _solve(list(side) + [n1 + n2 > bound], timeout_ms)
            if model is not None:
                return (
                    f"rate={p_old}/s -> {p_new}/s at 0 ns: try_take x {model.eval(n1)} granted at 0 ns, change, "
                    f"try_take x {model.eval(n2)} granted at {d} ns: {model.eval(n1 + n2)} grants in [0, {d}] ns > "
                    f"piecewise bound {bound}"
                )
    return None


def _grants_count(g, lead, R, tau):
    """``g`` is the number of grants available at an instant with lead ``lead`` (R2):
    0 if ``lead > tau``, else ``(g - 1) T <= tau - lead < g T`` (times R: x 10**9)."""
    return z3.If(
        lead > tau, g == 0, z3.And(g >= 1, (g - 1) * NS_PER_S <= (tau - lead) * R, (tau - lead) * R < g * NS_PER_S)
    )


def _rerate_burst_obligations(sem: Semantics) -> list[Obligation]:
    """R21 no burst from the change: for a user with lead ``L >= 0`` at ``now``, the grants
    available at ``now`` after the change, ``g_new``, are at most those before, ``g_old``,
    when the rate falls or stays, and at most ``g_old + ceil(tau x (r_new - r_old))`` when it
    rises (the growth of the burst tolerance in tokens, which an idle user at ``r_new`` has
    too). A reset of the TAT to now breaks it."""
    L, now, R, R2, tau = z3.Reals("L now R R2 tau")
    g_old, g_new, d = z3.Ints("g_old g_new d")
    known_new, tat_new, side = sem.spec_rerate(z3.BoolVal(True), now + L, now, R, R2)
    lead_new = _lead(known_new, tat_new, now)
    hyp = (
        L >= 0,
        R > 0,
        R2 > 0,
        tau >= 0,
        *side,
        _grants_count(g_old, L, R, tau),
        _grants_count(g_new, lead_new, R2, tau),
    )
    return [
        Obligation("falls_or_stays", hyp + (R2 <= R,), g_new <= g_old),
        Obligation("rises", hyp + (d >= 0, d * NS_PER_S >= tau * (R2 - R)), g_new <= g_old + d),
    ]


def _rerate_burst_search(sem: Semantics, timeout_ms: int) -> str | None:
    """A user at 10/s takes its burst at 0 (2 grants), the rate is changed to 10/s again
    (unchanged) and it takes again at 0."""
    tau = BURST_NS
    T = z3.RealVal(Fraction(NS_PER_S, 10))
    known, tat, n1 = _greedy_at(sem, z3.BoolVal(False), z3.RealVal(0), 0, T, tau, 5)
    known, tat, side = sem.spec_rerate(known, tat, z3.RealVal(0), z3.RealVal(10), z3.RealVal(10))
    known, tat, n2 = _greedy_at(sem, known, tat, 0, T, tau, 5)
    model = _solve(list(side) + [n2 > 0], timeout_ms)
    if model is None:
        return None
    return (
        f"rate=10/s: try_take x {model.eval(n1)} granted at 0 ns (burst spent), rate change 10/s -> 10/s, "
        f"try_take x {model.eval(n2)} granted again at 0 ns (0 available before the change)"
    )


# --------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------

PROPERTIES: list[Property] = [
    Property(
        "r2_window_bound",
        ["R1", "R2", "R4", "R6", "R9"],
        _window_obligations.__doc__ or "",
        _window_obligations,
        _window_search,
    ),
    Property("r2_idle_burst", ["R1", "R2", "R6"], _burst_obligations.__doc__ or "", _burst_obligations, _burst_search),
    Property(
        "r3_integer_scaling_simulates_spec",
        ["R1", "R2", "R3", "R4", "R6"],
        _sim_obligations.__doc__ or "",
        _sim_obligations,
        _sim_search,
    ),
    Property("r5_ready_at_exact", ["R3", "R5"], _ready_obligations.__doc__ or "", _ready_obligations, _ready_search),
    Property(
        "r4_take_refund_noop",
        ["R2", "R4", "R9"],
        _take_refund_obligations.__doc__ or "",
        _take_refund_obligations,
        lambda sem, ms: _divergence_search(sem, ms, "take_refund"),
    ),
    Property(
        "r6_cleanup_noop",
        ["R2", "R6"],
        _cleanup_obligations.__doc__ or "",
        _cleanup_obligations,
        lambda sem, ms: _divergence_search(sem, ms, "cleanup"),
    ),
]

PROPERTIES += [
    Property(
        "r21_window_bound_across_change",
        ["R2", "R4", "R6", "R21"],
        _rerate_window_obligations.__doc__ or "",
        _rerate_window_obligations,
        _rerate_window_search,
    ),
    Property(
        "r21_no_burst_from_change",
        ["R2", "R21"],
        _rerate_burst_obligations.__doc__ or "",
        _rerate_burst_obligations,
        _rerate_burst_search,
    ),
]

PROPERTIES_BY_NAME: dict[str, Property] = {prop.name: prop for prop in PROPERTIES}

# Which property must refute which broken variant (each variant is caught by at least one).
EXPECTED_REFUTATIONS: dict[str, tuple[str, ...]] = {
    "allow_strict_lt": ("r2_idle_burst", "r5_ready_at_exact"),
    "ready_at_round_down": ("r5_ready_at_exact",),
    "refund_2T": ("r2_window_bound", "r4_take_refund_noop"),
    "cleanup_tat_gt_now": ("r2_window_bound", "r6_cleanup_noop"),
    "take_without_max": ("r2_window_bound",),
    "ref_increment_uses_p": ("r3_integer_scaling_simulates_spec",),
    "ref_now_unscaled": ("r3_integer_scaling_simulates_spec",),
    "ref_ready_at_round_down": ("r5_ready_at_exact",),
    "rerate_reset_to_now": ("r21_window_bound_across_change", "r21_no_burst_from_change"),
    "rerate_keep_tat": ("r21_window_bound_across_change",),
}


def run_property(name: str, variant: str | Semantics = CORRECT, timeout_ms: int = 5000) -> dict:
    """Run one property against ``variant`` (a name in ``VARIANTS`` or a ``Semantics``)."""
    return PROPERTIES_BY_NAME[name].run(timeout_ms=timeout_ms, variant=variant)


def run_all(timeout_ms: int = 5000, variant: str | Semantics = CORRECT) -> list[dict]:
    """Run every property; one record per property:
    ``{"name", "rules", "tool": "z3", "result": "proved"|"refuted"|"unknown", "seconds",
    "vacuity_ok", "counterexample"}``."""
    return [prop.run(timeout_ms=timeout_ms, variant=variant) for prop in PROPERTIES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default=CORRECT.name, choices=sorted(VARIANTS))
    parser.add_argument("--timeout-ms", type=int, default=5000)
    args = parser.parse_args(argv)
    results = run_all(args.timeout_ms, args.variant)
    print(f"variant: {args.variant}")
    print(f"{'property':38} {'result':8} {'seconds':>8} vacuity_ok  rules")
    for r in results:
        print(f"{r['name']:38} {r['result']:8} {r['seconds']:8.3f} {r['vacuity_ok']!s:10}  {','.join(r['rules'])}")
        if r["counterexample"]:
            print(f"    counterexample: {r['counterexample']}")
    expect = "proved" if args.variant == CORRECT.name else None
    return 0 if expect is None or all(r["result"] == expect for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
