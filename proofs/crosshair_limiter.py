"""CrossHair contracts on the GCRA limiter rules R1-R6 (spec and integer-scaled reference).

Each *property* below is a small pure wrapper function over ``spec/limiter.py`` (exact
rational TATs) or ``reference/limiter.py`` (``OutputRateLimiter``, scaled integer TATs)
with a PEP 316 contract in its docstring: ``pre:`` lines restrict the inputs and one
``post:`` line states the property through a ``*_holds`` predicate, which writes the rule
out from docs/SPEC.md (R1-R6) instead of calling the code under test. CrossHair runs the wrapper
on symbolic integers and explores its execution paths with Z3. A condition is

* ``confirmed`` when CrossHair exhausted *every* path with definite solver answers
  (its "Confirmed over all paths.", what ``crosshair check --report_all`` prints): a proof
  for every input meeting the preconditions, unbounded integers included;
* ``refuted`` when CrossHair found a concrete input that breaks it (or makes the wrapper or
  the condition raise);
* otherwise ``unknown`` (CrossHair's "Not confirmed.": the CPU budget ran out, a path timed
  out, or a value had to be made concrete; or "Unable to meet precondition.": the budget ran
  out before one input met the preconditions). Not finding a counterexample is never
  reported as a proof.

A property is ``proved`` when its conditions are all confirmed, ``refuted`` when one is
refuted, otherwise ``unknown``.

Properties (one condition each)
-------------------------------
=============================  ==========================================================
ch_{spec,ref}_try_take          R2: granted iff TAT - now <= tau (unknown user: always);
                                after a grant TAT = max(TAT, now) + T; a refusal leaves the
                                whole state unchanged.
ch_{spec,ref}_refund_undoes_take  R4: a grant then its refund at the same now leaves
                                TAT = max(TAT, now): the TAT itself unless it was behind
                                the clock, which is an undo for every later take.
ch_{spec,ref}_ready_at_least    R5: a take is allowed and granted at ready_at, allowed at
                                no integer ns before it.
ch_{spec,ref}_cleanup_exact     R6: cleanup keeps exactly the users with TAT > now (two
                                users, two rates), with their TATs; deletes the rest.
ch_{spec,ref}_idle_equals_unknown  R6: a user with TAT <= t is treated at t exactly as an
                                unknown user, so a deleted user behaves as if kept.
ch_spec_vs_reference_step       R3, diffbehavior style: each operation (take, refund,
                                cleanup, ready_at, allows) on corresponding states of the
                                spec and the reference gives the same answer and the same
                                TAT afterwards.
=============================  ==========================================================

The differential is one step from *every* pair of corresponding states (spec TAT ``S/p``,
reference scaled TAT ``S``, or the user unknown to both), so by induction on the number of
operations the two implementations agree on every sequence of operations.

Input domain
------------
Rates are concrete on each path: a symbolic index ``k`` picks one of ``RATES``: integer
rates 2/s and 3/s (T not a whole number of ns), fractional rates 1/2 (numerator 1) and 3/2
(numerator and denominator > 1, T not whole). Those cover each shape of the scaling
``p/q`` (R3); where T lies relative to tau does not matter here, since every property
starts from an arbitrary symbolic TAT. (A rate with a composite numerator such as 10 is
sound too but costs twice the CPU: ``Fraction`` normalisation branches on ``S mod p``.)
With a rate ``p/q``
every TAT reachable from the empty limiter is a multiple of ``1/p`` ns (R3: the reference
stores ``S = TAT * p``), so a user's TAT is written ``S/p`` with ``S`` an *unbounded
symbolic integer*; clocks are unbounded symbolic integers >= 0. Symbolic rates are left to
the Z3 proofs (``z3_limiter.py``): ``Fraction`` normalises with a gcd loop, which on two
symbolic integers has unboundedly many paths, so CrossHair could never exhaust it. One
user suffices for the per-user rules (each operation reads and writes only the entry of
the user it names); the cleanup properties use two.

Modelling step: ``install_ceil_model()`` lets CrossHair evaluate ``math.ceil`` of a
``Fraction`` (used by ``spec.ready_at_ns``) as ``Fraction.__ceil__``, which is how Python
defines it; CrossHair's own model makes the argument concrete and could never confirm.

Refutations
-----------
``BROKEN`` holds deliberately wrong limiters under the same contracts (refuse at a lead of
exactly tau; ``ready_at`` rounded down). They carry ``# crosshair: off``, so a plain
``crosshair check`` of this module checks only the correct properties; the runner
re-enables them when asked (``--broken``) and ``tests/test_prove.py`` checks that CrossHair
refutes them.

Running
-------
``python -m vllm_output_rate.proofs.crosshair_limiter [--per-condition-timeout S]``
prints one JSON record per property as it completes; ``crosshair_runner.run_all()`` runs that in child
processes (CrossHair's tracer stays out of the caller's process) under a wall-clock cap.
A condition may use ``per_condition_timeout`` seconds of *CPU* time (CrossHair's
``--per_condition_timeout``; the per-path timeout is CrossHair's default, its square
root). The same check from the shell (this module installs the ceil model when it is
imported by CrossHair)::

    crosshair check --report_all --analysis_kind=PEP316 --per_condition_timeout=30 \
        vllm_output_rate.proofs.crosshair_limiter
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from fractions import Fraction

from vllm_output_rate.proofs.crosshair_check import (
    DEFAULT_PER_CONDITION_TIMEOUT_S,
    CrossHairProperty,
    check_property,
    install_ceil_model,
)
from vllm_output_rate.proofs.crosshair_rules import (  # the noqa ones: read by the pre:/post: conditions
    N_RATES,  # noqa: F401
    TAU,
    V_RATE,
    Cleaned,
    Ready,
    Take,
    Twin,
    Undo,
    interval,
    r2_take_holds,  # noqa: F401
    r4_refund_holds,  # noqa: F401
    r5_ready_holds,  # noqa: F401
    r6_cleanup_holds,  # noqa: F401
    rate,
    ref_limiter,
    spec_state,
)
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

# --------------------------------------------------------------------------------------
# R2: try_take
# --------------------------------------------------------------------------------------


def spec_try_take(k: int, known: bool, s: int, now: int) -> Take:
    """R1/R2 on the spec ``try_take``: TAT ``s/p`` ns (or unknown user), clock ``now``.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r2_take_holds(k, known, now, _)
    """
    r = rate(k)
    tat = Fraction(s, r.numerator) if known else None
    state = spec_state({"u": tat} if tat is not None else {})
    new, granted = spec.try_take(state, "u", r, now)
    return Take(granted, tat, new.tat_ns.get("u"), new is state or dict(new.tat_ns) == dict(state.tat_ns))


def ref_try_take(k: int, known: bool, s: int, now: int) -> Take:
    """R1/R2/R3 on the reference ``OutputRateLimiter.try_take``: scaled TAT ``s`` (TAT
    ``s/p`` ns) or unknown user, default rate; the TAT is read back with ``tat_ns``.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r2_take_holds(k, known, now, _)
    """
    r = rate(k)
    scaled = {"u": s} if known else {}
    lim = ref_limiter(r, scaled_tats=scaled)
    granted = lim.try_take("u", now)
    return Take(granted, Fraction(s, r.numerator) if known else None, lim.tat_ns("u"), dict(lim._tat) == scaled)


# --------------------------------------------------------------------------------------
# R4: refund undoes a grant made at the same instant
# --------------------------------------------------------------------------------------


def spec_refund_undoes_take(k: int, known: bool, s: int, now: int) -> Undo:
    """R2/R4 on the spec: ``try_take`` then ``refund`` at the same ``now``.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r4_refund_holds(now, _)
    """
    r = rate(k)
    tat = Fraction(s, r.numerator) if known else None
    taken, granted = spec.try_take(spec_state({"u": tat} if tat is not None else {}), "u", r, now)
    if not granted:
        return Undo(False, tat, None)
    return Undo(True, tat, spec.refund(taken, "u", r).tat_ns["u"])


def ref_refund_undoes_take(k: int, known: bool, s: int, now: int) -> Undo:
    """R2/R3/R4 on the reference: ``try_take`` then ``refund`` at the same ``now``.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r4_refund_holds(now, _)
    """
    r = rate(k)
    lim = ref_limiter(r, scaled_tats={"u": s} if known else {})
    tat = Fraction(s, r.numerator) if known else None
    if not lim.try_take("u", now):
        return Undo(False, tat, None)
    lim.refund("u")
    return Undo(True, tat, lim.tat_ns("u"))


# --------------------------------------------------------------------------------------
# R5: ready_at is the least integer instant at which a take succeeds
# --------------------------------------------------------------------------------------


def spec_ready_at_least(k: int, s: int) -> Ready:
    """R5 on the spec ``ready_at_ns`` (``ceil(TAT - tau)``), TAT ``s/p`` >= 0 ns.

    pre: 0 <= k < N_RATES
    pre: s >= 0
    post: r5_ready_holds(_)
    """
    r = rate(k)
    state = spec_state({"u": Fraction(s, r.numerator)})
    ready = spec.ready_at_ns(state, "u")
    assert ready is not None  # the user has a TAT
    return Ready(
        ready,
        spec.allows(state, "u", ready),
        spec.allows(state, "u", ready - 1),
        spec.try_take(state, "u", r, max(ready, 0))[1],
        ready - 1 >= 0 and spec.try_take(state, "u", r, ready - 1)[1],
    )


def _ref_ready(k: int, s: int, ready_of: Callable[[OutputRateLimiter], int | None]) -> Ready:
    r = rate(k)
    lim = ref_limiter(r, scaled_tats={"u": s})
    ready = ready_of(lim)
    assert ready is not None
    return Ready(
        ready,
        lim.allows("u", ready),
        lim.allows("u", ready - 1),
        ref_limiter(r, scaled_tats={"u": s}).try_take("u", max(ready, 0)),
        ready - 1 >= 0 and ref_limiter(r, scaled_tats={"u": s}).try_take("u", ready - 1),
    )


def ref_ready_at_least(k: int, s: int) -> Ready:
    """R3/R5 on the reference ``ready_at_ns`` (``-((burst - S) // p)``), scaled TAT ``s``.

    pre: 0 <= k < N_RATES
    pre: s >= 0
    post: r5_ready_holds(_)
    """
    return _ref_ready(k, s, lambda lim: lim.ready_at_ns("u"))


# --------------------------------------------------------------------------------------
# R6: cleanup keeps exactly the users with TAT > now, and a deleted user behaves as kept
# --------------------------------------------------------------------------------------


def spec_cleanup_exact(k: int, su: int, sv: int, now: int) -> Cleaned:
    """R6 on the spec ``cleanup_idle_users``; two users at different rates. (An unknown
    user is not in the map, so it can be neither kept nor deleted.)

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r6_cleanup_holds(k, su, sv, now, _)
    """
    tats = {"u": Fraction(su, rate(k).numerator), "v": Fraction(sv, V_RATE.numerator)}
    clean = spec.cleanup_idle_users(spec_state(tats), now)
    return Cleaned(
        frozenset(clean.tat_ns), all(clean.tat_ns[u] == tats[u] for u in clean.tat_ns), len(tats) - len(clean.tat_ns)
    )


def ref_cleanup_exact(k: int, su: int, sv: int, now: int) -> Cleaned:
    """R3/R6 on the reference ``cleanup_idle_users``: "u" at the default rate, "v" at a
    per-user override rate.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r6_cleanup_holds(k, su, sv, now, _)
    """
    scaled = {"u": su, "v": sv}
    lim = ref_limiter(rate(k), {"v": V_RATE}, scaled)
    deleted = lim.cleanup_idle_users(now)
    kept = frozenset(lim.users())
    return Cleaned(kept, all(lim._tat[u] == scaled[u] for u in kept), deleted)


def spec_idle_equals_unknown(k: int, s: int, t: int) -> Twin:
    """R2/R6 on the spec: a user whose TAT is <= t is treated at time t exactly as an
    unknown user, so deleting it (cleanup at any now with TAT <= now <= t) changes nothing.

    pre: 0 <= k < N_RATES
    pre: 0 <= t
    pre: s <= t * rate(k).numerator
    post: _.idle == _.unknown
    """
    r = rate(k)
    idle, g_idle = spec.try_take(spec_state({"u": Fraction(s, r.numerator)}), "u", r, t)
    unknown, g_unknown = spec.try_take(spec.EMPTY, "u", r, t)
    return Twin((g_idle, idle.tat_ns["u"]), (g_unknown, unknown.tat_ns["u"]))


def ref_idle_equals_unknown(k: int, s: int, t: int) -> Twin:
    """R3/R6 on the reference: a user holding scaled TAT ``s <= t * p`` is treated at time
    t exactly as an unknown one.

    pre: 0 <= k < N_RATES
    pre: 0 <= t
    pre: s <= t * rate(k).numerator
    post: _.idle == _.unknown
    """
    r = rate(k)
    idle, unknown = ref_limiter(r, scaled_tats={"u": s}), ref_limiter(r)
    g_idle, g_unknown = idle.try_take("u", t), unknown.try_take("u", t)
    return Twin((g_idle, idle._tat["u"]), (g_unknown, unknown._tat["u"]))


# --------------------------------------------------------------------------------------
# R3: differential, spec versus reference, one operation from corresponding states
# --------------------------------------------------------------------------------------

OP_TAKE, OP_REFUND, OP_CLEANUP, OP_READY, OP_ALLOWS = range(5)
N_OPS = 5


def spec_vs_reference_step(k: int, known: bool, s: int, op: int, now: int) -> tuple:
    """R3 (diffbehavior style): one operation on corresponding states of the spec (TAT
    ``s/p`` ns) and the reference (scaled TAT ``s``; the rate is a per-user override) gives
    the same answer and the same TAT afterwards. Refund only of a known user (R9: a refund
    follows a grant).

    pre: 0 <= k < N_RATES
    pre: 0 <= op < N_OPS
    pre: now >= 0
    pre: known or op != OP_REFUND
    post: _[0] == _[1]
    """
    r = rate(k)
    state = spec_state({"u": Fraction(s, r.numerator)} if known else {})
    lim = ref_limiter(Fraction(1), {"u": r}, {"u": s} if known else {})
    spec_out: object
    ref_out: object
    if op == OP_TAKE:
        state, spec_out = spec.try_take(state, "u", r, now)
        ref_out = lim.try_take("u", now)
    elif op == OP_REFUND:
        state, spec_out = spec.refund(state, "u", r), None
        lim.refund("u")
        ref_out = None
    elif op == OP_CLEANUP:
        before = len(state.tat_ns)
        state = spec.cleanup_idle_users(state, now)
        spec_out = before - len(state.tat_ns)
        ref_out = lim.cleanup_idle_users(now)
    elif op == OP_READY:
        spec_out, ref_out = spec.ready_at_ns(state, "u"), lim.ready_at_ns("u")
    else:
        spec_out, ref_out = spec.allows(state, "u", now), lim.allows("u", now)
    return (spec_out, state.tat_ns.get("u")), (ref_out, lim.tat_ns("u"))


# --------------------------------------------------------------------------------------
# Deliberately broken limiters (must be refuted; not part of the normal run)
# --------------------------------------------------------------------------------------


def broken_try_take_strict(k: int, known: bool, s: int, now: int) -> Take:
    """Broken on purpose: the R2 contract on a take that refuses at a lead of exactly tau
    (``>=`` where R2 says ``>``). CrossHair must find ``s/p - now == tau``.

    pre: 0 <= k < N_RATES
    pre: now >= 0
    post: r2_take_holds(k, known, now, _)
    """
    # crosshair: off
    r = rate(k)
    tat = Fraction(s, r.numerator) if known else None
    if tat is not None and tat - now >= TAU:  # BUG: R2 refuses only when TAT - now > tau
        return Take(False, tat, tat, True)
    return Take(True, tat, max(tat if tat is not None else Fraction(now), Fraction(now)) + interval(r), False)


def broken_ready_at_floor(k: int, s: int) -> Ready:
    """Broken on purpose: the R5 contract on a reference ``ready_at`` rounded *down*
    (``(S - burst) // p``). CrossHair must find an ``s`` that is not a multiple of ``p``.

    pre: 0 <= k < N_RATES
    pre: s >= 0
    post: r5_ready_holds(_)
    """
    # crosshair: off
    return _ref_ready(k, s, lambda lim: (lim._tat["u"] - lim.burst_ns * rate(k).numerator) // rate(k).numerator)


# --------------------------------------------------------------------------------------
# The catalogue (checked by crosshair_check.py, run by crosshair_runner.py)
# --------------------------------------------------------------------------------------


PROPERTIES: tuple[CrossHairProperty, ...] = (
    CrossHairProperty("ch_spec_try_take", ("R1", "R2"), spec_try_take, 3.7),
    CrossHairProperty("ch_ref_try_take", ("R1", "R2", "R3"), ref_try_take, 2.3),
    CrossHairProperty("ch_spec_refund_undoes_take", ("R2", "R4"), spec_refund_undoes_take, 3.4),
    CrossHairProperty("ch_ref_refund_undoes_take", ("R2", "R3", "R4"), ref_refund_undoes_take, 1.3),
    CrossHairProperty("ch_spec_ready_at_least", ("R2", "R5"), spec_ready_at_least, 2.9),
    CrossHairProperty("ch_ref_ready_at_least", ("R2", "R3", "R5"), ref_ready_at_least, 0.5),
    CrossHairProperty("ch_spec_cleanup_exact", ("R6",), spec_cleanup_exact, 2.9),
    CrossHairProperty("ch_ref_cleanup_exact", ("R3", "R6"), ref_cleanup_exact, 0.6),
    CrossHairProperty("ch_spec_idle_equals_unknown", ("R2", "R6"), spec_idle_equals_unknown, 1.9),
    CrossHairProperty("ch_ref_idle_equals_unknown", ("R2", "R3", "R6"), ref_idle_equals_unknown, 0.2),
    CrossHairProperty("ch_spec_vs_reference_step", ("R1", "R2", "R3", "R4", "R5", "R6"), spec_vs_reference_step, 14.0),
)

BROKEN: tuple[CrossHairProperty, ...] = (
    CrossHairProperty("ch_broken_try_take_strict", ("R2",), broken_try_take_strict, 0.7),
    CrossHairProperty("ch_broken_ready_at_floor", ("R5",), broken_ready_at_floor, 0.1),
)

BY_NAME: dict[str, CrossHairProperty] = {p.name: p for p in PROPERTIES + BROKEN}


if "crosshair.core" in sys.modules:  # imported by `crosshair check`: use the same model
    install_ceil_model()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--per-condition-timeout",
        type=float,
        default=DEFAULT_PER_CONDITION_TIMEOUT_S,
        help="CPU seconds per condition (CrossHair's --per_condition_timeout)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=sorted(BY_NAME), default=None, help="check these properties (broken ones included)"
    )
    parser.add_argument("--broken", action="store_true", help="also check the deliberately broken limiters")
    args = parser.parse_args(argv)
    props = [BY_NAME[n] for n in args.only] if args.only else list(PROPERTIES) + (list(BROKEN) if args.broken else [])
    for prop in props:
        print(json.dumps(check_property(prop, args.per_condition_timeout)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
