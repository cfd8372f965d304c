"""R2's rate bounds as Z3 proofs (``z3_limiter.py``): (a) the window bound, grants in any
window of ``W`` ns at most ``W/T + tau/T + 1``, by an inductive invariant; (b) the idle
burst, exactly ``floor(tau/T) + 1`` grants from an idle user. Each with its refutation
search from the empty limiter.
"""

from __future__ import annotations

from fractions import Fraction

import z3

from vllm_output_rate.proofs.z3_obligations import Obligation
from vllm_output_rate.proofs.z3_semantics import BURST_NS, NS_PER_S, REFUND, SEARCH_RATES, TAKE, Semantics
from vllm_output_rate.proofs.z3_traces import rate_text, render_trace, solve, spec_run, symbolic_ops
from vllm_output_rate.spec import limiter as spec_limiter

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


def window_step_obligations(sem: Semantics, hyp: tuple, after, known, tat, c, s, k, pend, T, tau) -> list[Obligation]:
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


def window_obligations(sem: Semantics) -> list[Obligation]:
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
        *window_step_obligations(sem, hyp, after, known, tat, c, s, k, pend, T, tau),
        Obligation(
            "close",
            hyp + (W >= 0, c <= s + W, rate > 0, T * rate == NS_PER_S),
            k <= (W + tau) * rate / NS_PER_S + 1,
        ),
    ]


def window_search(sem: Semantics, timeout_ms: int, depth: int = 7) -> str | None:
    """R2 window refutation: a concrete sequence from the empty limiter that grants more in a
    window than the bound allows, as text; None if none is found within ``depth`` steps."""
    for p, q in SEARCH_RATES:
        T, tau = z3.RealVal(Fraction(NS_PER_S * q, p)), BURST_NS
        cons: list = []
        ops = symbolic_ops("", depth, cons)
        steps, _ = spec_run(sem, ops, T, tau, cons)
        s, W = z3.Ints("s W")
        cons += [s >= 0, W >= 0]
        count = 0
        for (op, _), st in zip(ops, steps):
            inside = z3.And(st.now >= s, st.now <= s + W)
            count = count + z3.If(z3.And(inside, st.granted), 1, 0) - z3.If(z3.And(inside, op == REFUND), 1, 0)
        cons.append((count - 1) * T > W + tau)
        model = solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{rate_text(p, q, tau)}, window [s={model[s]}, s+W={model.eval(s + W)}]: "
                f"{model.eval(count)} net grants > bound "
                f"{spec_limiter.window_bound_tokens(model[W].as_long(), Fraction(p, q), tau)}; "
                + render_trace(model, steps, "")
            )
    return None


# --------------------------------------------------------------------------------------
# (b) R2 idle burst
# --------------------------------------------------------------------------------------


def burst_obligations(sem: Semantics) -> list[Obligation]:
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


def burst_search(sem: Semantics, timeout_ms: int, depth: int = 3) -> str | None:
    """Any short prefix from the empty limiter that leaves the user idle at clock c0
    (absent, or TAT <= c0), then floor(tau*rate)+2 takes at c0."""
    for p, q in SEARCH_RATES:
        rate, tau = Fraction(p, q), BURST_NS
        T = z3.RealVal(Fraction(NS_PER_S * q, p))
        expected = spec_limiter.idle_burst_grants(rate, tau)
        cons: list = []
        prefix = symbolic_ops("pre_", depth, cons)
        pre_steps, (k0, t0, c0, pend0) = spec_run(sem, prefix, T, tau, cons)
        cons.append(z3.Or(z3.Not(k0), t0 <= c0))
        ops = [(z3.IntVal(TAKE), z3.IntVal(0))] * (expected + 1)
        steps, _ = spec_run(sem, ops, T, tau, cons, start=(k0, t0, c0, pend0))
        grants = z3.Sum([z3.If(st.granted, 1, 0) for st in steps])
        cons.append(grants != expected)
        model = solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{rate_text(p, q, tau)}: {model.eval(grants)} grants at t={model.eval(c0)} from idle, "
                f"expected floor(tau*rate)+1 = {expected}; prefix: {render_trace(model, pre_steps, '')} | "
                f"burst: {render_trace(model, steps, '')}"
            )
    return None
