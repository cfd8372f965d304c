"""(g) R21 as Z3 proofs (``z3_limiter.py``): across a rate change the window bound holds
with the old rate before and the new one after, and the change itself grants no burst.
Each with its refutation search.
"""

from __future__ import annotations

from fractions import Fraction

import z3

from vllm_output_rate.proofs.z3_obligations import Obligation
from vllm_output_rate.proofs.z3_semantics import BURST_NS, NS_PER_S, Semantics, zmax
from vllm_output_rate.proofs.z3_traces import solve
from vllm_output_rate.proofs.z3_window import window_step_obligations
from vllm_output_rate.spec import limiter as spec_limiter

# --------------------------------------------------------------------------------------
# (g) R21: a rate change, window bound across it and no burst from it
# --------------------------------------------------------------------------------------


def _lead(known, tat, c):
    """The effective lead ``max(TAT, c) - c`` (0 for an unknown user), ns."""
    return z3.If(known, zmax(tat, c), c) - c


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


def rerate_window_obligations(sem: Semantics) -> list[Obligation]:
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
        M_ = M if counted is None else z3.If(counted, zmax(M, R), M)
        return _rerate_inv(known_, tat_, c, s, k_, pend_, R, T, tau, A, M_)

    accrued = A + (zmax(c2, s) - zmax(c, s)) * R
    after_advance = _rerate_inv(known, tat, c2, s, k, 0, R, T, tau, accrued, M)
    k_n, t_n, side = sem.spec_rerate(known, tat, c, R, R2)
    after_change = _rerate_inv(k_n, t_n, c, s, k, pend, R2, T2, tau, A, M)
    return [
        Obligation("init", tuple(params), _rerate_inv(known, tat, c, s, 0, 0, R, T, tau, 0, 0)),
        Obligation("step_advance", hyp + (c2 >= c,), after_advance),
        *window_step_obligations(sem, hyp, after, known, tat, c, s, k, pend, T, tau),
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
                zmax(r_old, r_new) >= M,
            ),
            k <= ((c0 - s) * r_old + (c - c0) * r_new + tau * zmax(r_old, r_new)) / NS_PER_S + 1,
        ),
    ]


def _greedy_at(sem: Semantics, known, tat, now, T, tau, takes: int):
    """``takes`` try_takes at ``now``; returns (known, tat, granted count term)."""
    count = 0
    for _ in range(takes):
        g, known, tat = sem.spec_take(known, tat, now, T, tau)
        count = count + z3.If(g, 1, 0)
    return known, tat, count


def rerate_window_search(sem: Semantics, timeout_ms: int) -> str | None:
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
            model = solve(list(side) + [n1 + n2 > bound], timeout_ms)
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


def rerate_burst_obligations(sem: Semantics) -> list[Obligation]:
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


def rerate_burst_search(sem: Semantics, timeout_ms: int) -> str | None:
    """A user at 10/s takes its burst at 0 (2 grants), the rate is changed to 10/s again
    (unchanged) and it takes again at 0."""
    tau = BURST_NS
    T = z3.RealVal(Fraction(NS_PER_S, 10))
    known, tat, n1 = _greedy_at(sem, z3.BoolVal(False), z3.RealVal(0), 0, T, tau, 5)
    known, tat, side = sem.spec_rerate(known, tat, z3.RealVal(0), z3.RealVal(10), z3.RealVal(10))
    known, tat, n2 = _greedy_at(sem, known, tat, 0, T, tau, 5)
    model = solve(list(side) + [n2 > 0], timeout_ms)
    if model is None:
        return None
    return (
        f"rate=10/s: try_take x {model.eval(n1)} granted at 0 ns (burst spent), rate change 10/s -> 10/s, "
        f"try_take x {model.eval(n2)} granted again at 0 ns (0 available before the change)"
    )
