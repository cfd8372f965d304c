"""Z3 proofs relating implementations and operations (``z3_limiter.py``): (c) R3, the
integer-scaled reference simulates the exact spec; (d) R5, ``ready_at`` is exact; (e), (f)
R4 / R6, a same-step take+refund and a cleanup are unobservable (a bisimulation). Each with
its refutation search.
"""

from __future__ import annotations

from fractions import Fraction

import z3

from vllm_output_rate.proofs.z3_obligations import Obligation
from vllm_output_rate.proofs.z3_semantics import BURST_NS, NS_PER_S, SEARCH_RATES, TAKE, Semantics, zmax
from vllm_output_rate.proofs.z3_traces import rate_text, ref_run, render_trace, solve, spec_run, symbolic_ops

# --------------------------------------------------------------------------------------
# (c) R3 integer scaling simulates the exact spec
# --------------------------------------------------------------------------------------


def _sim_rel(ks, tat, kr, S, p):
    """Simulation relation: same users known, and ``S == TAT * p`` (R3)."""
    return z3.And(ks == kr, z3.Implies(ks, z3.ToReal(S) == tat * z3.ToReal(p)))


def sim_obligations(sem: Semantics) -> list[Obligation]:
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


def sim_search(sem: Semantics, timeout_ms: int, depth: int = 5) -> str | None:
    """R3 refutation: a concrete sequence from the empty limiter after which the reference's
    grant differs from the spec's, as text; None if none is found within ``depth`` steps."""
    for p, q in SEARCH_RATES:
        tau = BURST_NS
        cons: list = []
        ops = symbolic_ops("", depth, cons)
        spec_steps, _ = spec_run(sem, ops, z3.RealVal(Fraction(NS_PER_S * q, p)), tau, cons)
        ref_steps = ref_run(sem, ops, p, q, tau, cons)
        bad = []
        for (op, _), a, b in zip(ops, spec_steps, ref_steps):
            bad.append(z3.And(op == TAKE, a.decision != b.decision))
            bad.append(z3.Not(_sim_rel(a.known, a.tat, b.known, b.tat, z3.IntVal(p))))
        cons.append(z3.Or(bad))
        model = solve(cons, timeout_ms)
        if model is not None:
            return (
                f"{rate_text(p, q, tau)}: spec and reference diverge; "
                + render_trace(model, spec_steps, "spec")
                + " | "
                + render_trace(model, ref_steps, "ref", scaled_p=p)
            )
    return None


# --------------------------------------------------------------------------------------
# (d) R5 ready_at is exact
# --------------------------------------------------------------------------------------


def ready_obligations(sem: Semantics) -> list[Obligation]:
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


def ready_search(sem: Semantics, timeout_ms: int, depth: int = 5) -> str | None:
    """R5 refutation: a concrete sequence from the empty limiter after which the spec's or
    the reference's ``ready_at`` is not the first ns a take is granted, or the two differ, as
    text; None if none is found within ``depth`` steps."""
    yes = z3.BoolVal(True)
    for p, q in SEARCH_RATES:
        tau = BURST_NS
        T = z3.RealVal(Fraction(NS_PER_S * q, p))
        cons: list = []
        ops = symbolic_ops("", depth, cons)
        spec_steps, (ks, tat, clock, _) = spec_run(sem, ops, T, tau, cons)
        ref_steps = ref_run(sem, ops, p, q, tau, cons)
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
        model = solve(cons, timeout_ms)
        if model is not None:
            rs, rr = model.eval(r_spec), model.eval(r_ref)
            return (
                f"{rate_text(p, q, tau)}: spec ready_at={rs} (take there "
                f"{'granted' if z3.is_true(model.eval(spec_ok(rs))) else 'refused'}, at -1 ns "
                f"{'granted' if z3.is_true(model.eval(spec_ok(rs - 1))) else 'refused'}), "
                f"reference ready_at={rr} (take there "
                f"{'granted' if z3.is_true(model.eval(ref_ok(rr))) else 'refused'}, at -1 ns "
                f"{'granted' if z3.is_true(model.eval(ref_ok(rr - 1))) else 'refused'}); "
                + render_trace(model, spec_steps, "")
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
    eff_a = z3.If(ka, zmax(ta, c), c)
    eff_b = z3.If(kb, zmax(tb, c), c)
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
    earliest = lambda k, t: z3.If(k, zmax(t - tau, c), c)
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


def take_refund_obligations(sem: Semantics) -> list[Obligation]:
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


def cleanup_obligations(sem: Semantics) -> list[Obligation]:
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


def divergence_search(sem: Semantics, timeout_ms: int, insert: str, n1: int = 4, n2: int = 3) -> str | None:
    """Two runs share a prefix; run B then does take+refund (or cleanup) at the same
    instant; both then do the same suffix. Violation: a try_take decision differs."""
    for p, q in SEARCH_RATES:
        T, tau = z3.RealVal(Fraction(NS_PER_S * q, p)), BURST_NS
        cons: list = []
        prefix = symbolic_ops("pre_", n1, cons)
        pre_steps, (k0, t0, c0, pend0) = spec_run(sem, prefix, T, tau, cons)
        if insert == "take_refund":
            g, k1, t1 = sem.spec_take(k0, t0, c0, T, tau)
            k2, t2 = sem.spec_refund(k1, t1, T)
            kb, tb = z3.If(g, k2, k0), z3.If(g, t2, t0)
            note = "B: try_take " + "%s" + " then refund"
        else:
            kb, tb = sem.spec_cleanup(k0, t0, c0, tau), t0
            note = "B: cleanup"
        suffix = symbolic_ops("suf_", n2, cons)
        a_steps, _ = spec_run(sem, suffix, T, tau, cons, start=(k0, t0, c0, pend0))
        b_steps, _ = spec_run(sem, suffix, T, tau, [], start=(kb, tb, c0, pend0))
        cons.append(
            z3.Or([z3.And(op == TAKE, a.decision != b.decision) for (op, _), a, b in zip(suffix, a_steps, b_steps)])
        )
        model = solve(cons, timeout_ms)
        if model is not None:
            if insert == "take_refund":
                note = note % ("granted" if z3.is_true(model.eval(g, model_completion=True)) else "refused")
            return (
                f"{rate_text(p, q, tau)}: prefix: {render_trace(model, pre_steps, '')} | at "
                f"t={model.eval(c0)} {note} | A: {render_trace(model, a_steps, 'A')} | "
                f"B: {render_trace(model, b_steps, 'B')}"
            )
    return None
