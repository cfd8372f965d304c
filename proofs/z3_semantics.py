"""The GCRA limiter as Z3 terms (``z3_limiter.py``'s model): the spec's operations on
(known, TAT: Real ns) and the integer-scaled reference's on (known, S: Int = TAT x p), R1-R6
and R21, as one ``Semantics`` record; ``CORRECT`` is the code as written, ``BROKEN_VARIANTS``
the deliberately wrong limiters each proof must refute. Also the operation alphabet and the
rates tried by the refutation searches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import z3

from vllm_output_rate.spec import limiter as spec_limiter

NS_PER_S: int = spec_limiter.NS_PER_S
BURST_NS: int = spec_limiter.BURST_NS

# Operation alphabet of one scheduler step sequence (refutation search and trace printing).
ADV, TAKE, REFUND, CLEAN = 0, 1, 2, 3
OP_NAMES = {ADV: "advance", TAKE: "try_take", REFUND: "refund", CLEAN: "cleanup"}

# Rates (p, q) = p/q tokens/s tried by the refutation search, with tau = BURST_NS.
# 10/s: T == tau exactly (boundary of <=); 3/s and 7/3: T not an integer number of ns;
# 1/2: T > tau; 20/s: several grants in the idle burst.
SEARCH_RATES: tuple[tuple[int, int], ...] = ((10, 1), (3, 1), (20, 1), (1, 2), (7, 3))


def zmax(a, b):
    """``max(a, b)`` as a Z3 term."""
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
    return z3.If(known, zmax(tat, now), now)


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
