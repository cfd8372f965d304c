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
  out, or a value had to be made concrete). Not finding a counterexample is never reported
  as a proof.

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
prints one JSON record per property as it completes; ``run_all()`` runs that in child
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
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple

from vllm_output_rate.proofs.records import proof_record
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

TAU: int = spec.BURST_NS
NS_PER_S: int = spec.NS_PER_S

# Rates in tokens/s, picked per path by a symbolic index (see the module docstring).
RATES: tuple[Fraction, ...] = (Fraction(2), Fraction(3), Fraction(1, 2), Fraction(3, 2))
N_RATES: int = len(RATES)
# Rate of the second user "v" in the cleanup properties (a per-user override in the reference).
V_RATE: Fraction = Fraction(1, 2)
# The math.ceil models this module registered with CrossHair (so that a second install is a no-op).
_OUR_CEIL_MODELS: set[Callable[..., Any]] = set()

# CPU seconds per condition. The costliest correct property (the differential) needs about
# 14 s of CPU to exhaust its paths, the others 0.2-4 s (CPU time: a loaded machine makes
# them slower in wall time but does not change the verdicts).
DEFAULT_PER_CONDITION_TIMEOUT_S: float = 30.0
# Wall-clock cap on a whole run_all() (seconds): unfinished properties become "unknown".
DEFAULT_WALL_TIMEOUT_S: float = 75.0


def rate(k: int) -> Fraction:
    """``RATES[k]``, by explicit branching so that a symbolic ``k`` forks one path per rate."""
    for i, r in enumerate(RATES):
        if k == i:
            return r
    raise ValueError(f"rate index {k} not in 0..{N_RATES - 1}")


def interval(r: Fraction) -> Fraction:
    """R1: T = 1/rate seconds, in ns (written out here, not taken from the code under test)."""
    return Fraction(NS_PER_S) / r


# --------------------------------------------------------------------------------------
# Building states: spec state {user: S/p} and a reference limiter holding scaled TAT S.
# The wrappers below are the harness; the `*_holds` predicates state the rules directly
# (from docs/SPEC.md "The limiter (R1-R6)"), not by calling the code under test.
# --------------------------------------------------------------------------------------


def spec_state(tats: dict[str, Fraction]) -> spec.LimiterState:
    return spec.LimiterState(MappingProxyType(dict(tats)))


def ref_limiter(
    default: Fraction, overrides: dict[str, Fraction] | None = None, scaled_tats: dict[str, int] | None = None
) -> OutputRateLimiter:
    """An ``OutputRateLimiter`` whose scaled TATs are ``scaled_tats`` (white-box: ``_tat``
    is the limiter's one piece of per-user state, R1/R3)."""
    lim = OutputRateLimiter(default, overrides or {})
    for user, s in (scaled_tats or {}).items():
        lim._tat[user] = s
    return lim


# --------------------------------------------------------------------------------------
# R2: try_take
# --------------------------------------------------------------------------------------


class Take(NamedTuple):
    granted: bool
    before: Fraction | None  # input TAT in ns (None: user unknown)
    after: Fraction | None  # TAT in ns after the take, as the implementation holds it
    unchanged: bool  # the implementation's whole state is exactly as before


def r2_take_holds(k: int, known: bool, now: int, t: Take) -> bool:
    """R2: granted iff ``TAT - now <= tau`` (an unknown user always); after a grant
    ``TAT = max(TAT, now) + T``; a refusal changes nothing."""
    before = t.before if known else None
    if t.granted != (before is None or before - now <= TAU):
        return False
    if t.granted:
        return t.after == max(before if before is not None else Fraction(now), Fraction(now)) + interval(rate(k))
    return t.unchanged


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


class Undo(NamedTuple):
    granted: bool  # the take was granted (only a granted take is refunded, R9)
    before: Fraction | None  # input TAT in ns (None: user unknown)
    refunded: Fraction | None  # TAT after take + refund, as the implementation holds it


def r4_refund_holds(now: int, u: Undo) -> bool:
    """R4: a grant at ``now`` followed by its refund leaves ``TAT = max(TAT, now)`` (``now``
    for a user that was unknown): the TAT itself whenever it was not behind the clock.

    That is an undo: for every later time ``t >= now``, ``max(max(TAT, now), t) =
    max(TAT, t)`` and ``max(TAT, now) - t <= tau`` iff ``TAT - t <= tau`` (both hold when
    ``TAT < now``), so by R2 every later take decides and ends as if nothing had happened;
    a user left at ``TAT = now`` behaves as unknown (``ch_*_idle_equals_unknown``)."""
    if not u.granted:
        return True
    return u.refunded == (Fraction(now) if u.before is None else max(u.before, Fraction(now)))


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


class Ready(NamedTuple):
    ready: int
    allowed_at: bool  # allows(ready)
    allowed_before: bool  # allows(ready - 1)
    take_at: bool  # try_take at max(ready, 0) granted (the clock is never negative)
    take_before: bool  # try_take at ready - 1 granted (False when ready - 1 < 0)


def r5_ready_holds(r: Ready) -> bool:
    """R5: a take is allowed and granted at ``ready_at``, and refused one ns earlier; as
    ``TAT - now`` only falls when ``now`` grows, it is then refused at every earlier ns."""
    return r.allowed_at and r.take_at and not r.allowed_before and not r.take_before


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


class Cleaned(NamedTuple):
    kept: frozenset  # users left after cleanup
    tats_kept: bool  # kept users hold exactly their TATs from before
    deleted: int  # how many users the cleanup deleted (reference: its return value)


def r6_cleanup_holds(k: int, su: int, sv: int, now: int, c: Cleaned) -> bool:
    """R6: of the users "u" (TAT ``su/p`` at rate ``RATES[k] = p/q``) and "v" (TAT
    ``sv/p_v`` at ``V_RATE``), the cleanup keeps exactly those with TAT > now, with their
    TATs, and deletes the others. (``S/p > now`` iff ``S > now * p``, as ``p > 0``.)"""
    expected = frozenset(
        user for user, s, p in (("u", su, rate(k).numerator), ("v", sv, V_RATE.numerator)) if s > now * p
    )
    return c.kept == expected and c.tats_kept and c.deleted == 2 - len(expected)


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


class Twin(NamedTuple):
    idle: tuple  # (granted, TAT after) for the user holding TAT s/p <= t
    unknown: tuple  # (granted, TAT after) for the same user unknown to the limiter


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
# The catalogue and the runner
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossHairProperty:
    """A named property: the wrapper function whose PEP 316 condition states it.

    ``cost`` is the CPU seconds it took to confirm on an idle core (used only to share the
    properties out between child processes)."""

    name: str
    rules: tuple[str, ...]
    fn: Callable
    cost: float = 1.0


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


def install_ceil_model() -> bool:
    """Let CrossHair run ``math.ceil`` on a ``Fraction`` symbolically.

    CrossHair 0.0.113 models ``math.ceil`` by making its argument concrete, which forks one
    path per value and so can never exhaust ``spec.ready_at_ns`` (``math.ceil(TAT - tau)``).
    Python defines ``math.ceil(x)`` for a non-float ``x`` as ``x.__ceil__()``; for a
    ``Fraction`` that is the pure-Python ``-(-numerator // denominator)``, which CrossHair
    executes symbolically. This replaces CrossHair's patch for ``math.ceil`` by exactly
    that delegation for ``Fraction`` arguments (anything else goes to CrossHair's own
    patch). It edits a private CrossHair table; if that is missing nothing is changed, and
    the properties that use ``spec.ready_at_ns`` then come out "unknown", never "proved".

    Returns whether the model is installed.
    """
    import math

    try:
        importlib.import_module("crosshair.core_and_libs")  # makes CrossHair's own registrations
        from crosshair.core import _PATCH_REGISTRATIONS
    except ImportError:
        return False
    current = _PATCH_REGISTRATIONS.get(math.ceil)
    if current is None:
        return False
    if current in _OUR_CEIL_MODELS:
        return True

    def ceil_model(x, *rest):
        if type(x) is Fraction and not rest:
            return x.__ceil__()
        return current(x, *rest)

    _OUR_CEIL_MODELS.add(ceil_model)
    _PATCH_REGISTRATIONS[math.ceil] = ceil_model
    return True


if "crosshair.core" in sys.modules:  # imported by `crosshair check`: use the same model
    install_ceil_model()


def check_property(prop: CrossHairProperty, per_condition_timeout: float = DEFAULT_PER_CONDITION_TIMEOUT_S) -> dict:
    """Run CrossHair on one property *in this process*; return its record.

    ``{"name", "rules", "tool": "crosshair", "result", "seconds", "conditions"}``, where
    ``conditions`` lists ``{"line", "status": confirmed|refuted|unknown, "message"}``
    (``message`` holds CrossHair's counterexample for a refuted condition).
    """
    from crosshair.core_and_libs import AnalysisKind, MessageType, analyze_function
    from crosshair.options import AnalysisOptionSet

    install_ceil_model()
    options = AnalysisOptionSet(
        analysis_kind=[AnalysisKind.PEP316],
        per_condition_timeout=per_condition_timeout,
        enabled=True,  # overrides the `# crosshair: off` of the broken functions
    )
    start = time.perf_counter()
    conditions = []
    try:
        for checkable in analyze_function(prop.fn, options):
            for msg in checkable.analyze():
                if msg.state == MessageType.CONFIRMED:
                    status = "confirmed"
                elif msg.state in (MessageType.POST_FAIL, MessageType.EXEC_ERR, MessageType.POST_ERR):
                    status = "refuted"
                else:
                    # CANNOT_CONFIRM: budget or path timeout; PRE_UNSAT: no input meets the
                    # preconditions (vacuous); SYNTAX_ERR / IMPORT_ERR: nothing was checked.
                    status = "unknown"
                conditions.append({"line": msg.line, "status": status, "message": msg.message})
    except Exception as exc:  # a CrossHair crash is "unknown", never a proof
        conditions.append({"line": 0, "status": "unknown", "message": f"crosshair crashed: {exc!r}"})
    statuses = [c["status"] for c in conditions]
    if "refuted" in statuses:
        result = "refuted"
    elif statuses and all(s == "confirmed" for s in statuses):
        result = "proved"
    else:
        result = "unknown"
    return proof_record(
        prop.name, prop.rules, "crosshair", result, round(time.perf_counter() - start, 3), conditions=conditions
    )


def _share_out(props: list[CrossHairProperty], jobs: int) -> list[list[CrossHairProperty]]:
    """Longest first, each to the least loaded child."""
    shares: list[list[CrossHairProperty]] = [[] for _ in range(jobs)]
    loads = [0.0] * jobs
    for prop in sorted(props, key=lambda p: -p.cost):
        i = loads.index(min(loads))
        shares[i].append(prop)
        loads[i] += prop.cost
    return [s for s in shares if s]


def run_all(
    per_condition_timeout: float = DEFAULT_PER_CONDITION_TIMEOUT_S,
    names: list[str] | None = None,
    include_broken: bool = False,
    jobs: int = 2,
    wall_timeout: float | None = DEFAULT_WALL_TIMEOUT_S,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Check properties in ``jobs`` child processes; one record per property, in catalogue
    order (see ``check_property``).

    ``names`` selects properties (default: all of ``PROPERTIES``, plus ``BROKEN`` if
    ``include_broken``). ``wall_timeout`` (seconds, None for none) caps the whole run:
    children still running then are killed and their unfinished properties reported
    ``unknown``. ``on_record`` is called with each record as soon as it arrives.
    """
    if names is None:
        props = list(PROPERTIES) + (list(BROKEN) if include_broken else [])
    else:
        props = [BY_NAME[n] for n in names]
    lines: queue.Queue = queue.Queue()
    start = time.monotonic()
    children = [_start_child(share, per_condition_timeout, lines) for share in _share_out(props, max(1, jobs))]
    deadline = None if wall_timeout is None else start + wall_timeout
    records, timed_out = _collect_records(lines, len(children), deadline, on_record)
    errors: list[str] = []
    for child in children:
        if child.poll() is None:
            child.kill()  # only the children started above, through their own handles
        _, err = child.communicate()
        if child.returncode not in (0, -9) and err:
            errors.append(err.strip().splitlines()[-1])
    elapsed = time.monotonic() - start
    why = (
        f"not finished within the {wall_timeout:g} s wall-clock cap"
        if timed_out
        else "checker process failed: " + ("; ".join(errors) or "no record")
    )
    out = []
    for prop in props:
        record = records.get(prop.name)
        if record is None:
            record = proof_record(
                prop.name,
                prop.rules,
                "crosshair",
                "unknown",
                round(elapsed, 3),
                conditions=[{"line": 0, "status": "unknown", "message": why}],
            )
            if on_record is not None:
                on_record(record)
        out.append(record)
    return out


def _start_child(share: list, per_condition_timeout: float, lines: queue.Queue) -> subprocess.Popen:
    """One checker process for the properties ``share``; a thread pumps its stdout lines
    into ``lines`` (then None when the stream closes)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_output_rate.proofs.crosshair_limiter",
        "--per-condition-timeout",
        str(per_condition_timeout),
        "--only",
        *[p.name for p in share],
    ]
    child = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
    return child


def _collect_records(
    lines: queue.Queue, open_streams: int, deadline: float | None, on_record: Callable[[dict], None] | None
) -> tuple[dict[str, dict], bool]:
    """Read the JSON records of ``open_streams`` checker processes from ``lines`` until every
    stream closed or ``deadline`` (``time.monotonic()`` seconds; None: no limit) passed:
    ``(records by property name, True if the deadline cut it short)``."""
    records: dict[str, dict] = {}
    while open_streams:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            open_streams -= 1
            continue
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        records[record["name"]] = record
        if on_record is not None:
            on_record(record)
    return records, open_streams > 0


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put(None)


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
