"""The rules R1-R6 as plain predicates, and the input domain, for the CrossHair contracts of
``crosshair_limiter.py``: the rates a symbolic index picks (``RATES``), the spec state and the
reference limiter built from a symbolic TAT, the records each wrapper returns (``Take``,
``Undo``, ``Ready``, ``Cleaned``, ``Twin``) and the ``*_holds`` predicates its ``post:``
condition calls, which write each rule out from docs/SPEC.md instead of calling the code
under test.
"""

from __future__ import annotations

from fractions import Fraction
from types import MappingProxyType
from typing import NamedTuple

from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

TAU: int = spec.BURST_NS
NS_PER_S: int = spec.NS_PER_S

# Rates in tokens/s, picked per path by a symbolic index (see the module docstring).
RATES: tuple[Fraction, ...] = (Fraction(2), Fraction(3), Fraction(1, 2), Fraction(3, 2))
N_RATES: int = len(RATES)
# Rate of the second user "v" in the cleanup properties (a per-user override in the reference).
V_RATE: Fraction = Fraction(1, 2)


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
# The wrappers of crosshair_limiter.py are the harness; the `*_holds` predicates state the rules directly
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


class Twin(NamedTuple):
    idle: tuple  # (granted, TAT after) for the user holding TAT s/p <= t
    unknown: tuple  # (granted, TAT after) for the same user unknown to the limiter
