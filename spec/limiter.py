"""The GCRA output-rate limiter, rules R1-R6, in exact rational arithmetic.

This module is the oracle for the reference limiter (``reference/limiter.py``). It is
deliberately naive: one frozen mapping ``user -> TAT`` with TATs as ``fractions.Fraction``
nanoseconds, so that no rounding can ever hide a bug. Every function is pure: it takes a
state and returns a new one. No clock is read here; ``now_ns`` is always an argument.

Source: docs/SPEC.md "The limiter (R1-R6)" (GCRA with a 100 ms burst tolerance) and
"Constants".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType

# R1: burst tolerance tau. 100 ms: covers at least one engine step (a slow step must not
# let budget expire; docs/SPEC.md "Constants").
BURST_NS: int = 100_000_000
NS_PER_S: int = 1_000_000_000
# R6: idle users are deleted every CLEANUP_INTERVAL_STEPS scheduling steps.
CLEANUP_INTERVAL_STEPS: int = 256
# Bound on the number of users one limiter state may hold (TigerBeetle style: put a
# limit on every collection). A scenario never comes near it.
MAX_USERS: int = 1 << 20


def emission_interval_ns(rate_tokens_per_s: Fraction) -> Fraction:
    """R1: the emission interval T = 1/rate, in nanoseconds (exact).

    Args:
        rate_tokens_per_s: a positive rational rate.
    Returns:
        ``10**9 / rate`` as a Fraction.
    Raises:
        AssertionError: if the rate is not positive.
    """
    assert rate_tokens_per_s > 0, f"rate must be positive, got {rate_tokens_per_s!r}"
    return Fraction(NS_PER_S) / Fraction(rate_tokens_per_s)


@dataclass(frozen=True)
class LimiterState:
    """R1: one TAT (theoretical arrival time, ns, exact) per known user.

    ``tat_ns`` maps a user id to its TAT. A user absent from the map is idle: it behaves
    exactly as a user whose TAT is <= now (R6).
    """

    tat_ns: Mapping[str, Fraction] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        assert len(self.tat_ns) <= MAX_USERS, f"{len(self.tat_ns)} users > {MAX_USERS}"


EMPTY = LimiterState()


def _with_tat(state: LimiterState, user: str, tat_ns: Fraction) -> LimiterState:
    tats = dict(state.tat_ns)
    tats[user] = tat_ns
    return LimiterState(MappingProxyType(tats))


def tat_of(state: LimiterState, user: str, now_ns: int) -> Fraction:
    """R1/R6: the user's effective TAT at ``now_ns``: ``max(TAT, now)``, ``now`` if unknown."""
    return max(state.tat_ns.get(user, Fraction(now_ns)), Fraction(now_ns))


def allows(state: LimiterState, user: str, now_ns: int, burst_ns: int = BURST_NS) -> bool:
    """R2: a take at ``now_ns`` is allowed iff ``TAT - now <= tau``."""
    tat = state.tat_ns.get(user)
    return tat is None or tat - now_ns <= burst_ns


def try_take(
    state: LimiterState,
    user: str,
    rate_tokens_per_s: Fraction | None,
    now_ns: int,
    burst_ns: int = BURST_NS,
) -> tuple[LimiterState, bool]:
    """R2: try to take one token for ``user`` at ``now_ns``.

    Allowed iff ``TAT - now <= tau``; then ``TAT := max(TAT, now) + T``. A refusal leaves
    the state unchanged.

    R28: with the rate ``UNLIMITED`` (None) the take is granted and no TAT is kept.

    Returns:
        ``(new_state, granted)``.
    Raises:
        AssertionError: negative clock or non-positive rate.
    """
    assert now_ns >= 0, f"now_ns must be >= 0, got {now_ns}"
    if rate_tokens_per_s is None:  # R28: unlimited
        assert user not in state.tat_ns, f"R28: unlimited user {user!r} holds a TAT"
        return state, True
    if not allows(state, user, now_ns, burst_ns):
        return state, False
    new_tat = tat_of(state, user, now_ns) + emission_interval_ns(rate_tokens_per_s)
    # R2: after a grant the lead over now is at most tau + T.
    assert new_tat - now_ns <= burst_ns + emission_interval_ns(rate_tokens_per_s)
    return _with_tat(state, user, new_tat), True


def refund(state: LimiterState, user: str, rate_tokens_per_s: Fraction | None) -> LimiterState:
    """R4: undo one charge: ``TAT := TAT - T``.

    Only for a charge made earlier in the same ``schedule()`` whose request was not
    dispatched (R9), so the user is always known here. R28: an unlimited user (rate
    ``UNLIMITED``, None) was never charged: nothing to refund, the state is unchanged.

    Raises:
        AssertionError: if the user has no TAT (refund without a charge).
    """
    if rate_tokens_per_s is None:  # R28
        return state
    assert user in state.tat_ns, f"refund for user {user!r} that holds no charge"
    return _with_tat(state, user, state.tat_ns[user] - emission_interval_ns(rate_tokens_per_s))


def ready_at_ns(state: LimiterState, user: str, burst_ns: int = BURST_NS) -> int | None:
    """R5: earliest integer ns at which ``try_take`` succeeds: ``ceil(TAT - tau)``.

    Returns ``None`` for an unknown (idle) user, who may take at any time.
    """
    tat = state.tat_ns.get(user)
    if tat is None:
        return None
    return math.ceil(tat - burst_ns)


def cleanup_idle_users(state: LimiterState, now_ns: int) -> LimiterState:
    """R6: delete every user whose ``TAT <= now``.

    Such a user behaves exactly as an unknown one: ``max(TAT, now) == now`` for every
    later ``now``, and ``TAT - now <= 0 <= tau``.
    """
    kept = {u: t for u, t in state.tat_ns.items() if t > now_ns}
    return LimiterState(MappingProxyType(kept))


def idle_burst_grants(rate_tokens_per_s: Fraction, burst_ns: int = BURST_NS) -> int:
    """R2: grants at one instant from idle: ``floor(tau x rate) + 1``."""
    return math.floor(Fraction(burst_ns, NS_PER_S) * rate_tokens_per_s) + 1


def window_bound_tokens(window_ns: int, rate_tokens_per_s: Fraction, burst_ns: int = BURST_NS) -> int:
    """R2 bound: grants in any closed window of ``window_ns`` <= ``(W + tau) x rate + 1``.

    Returned as the integer floor of the bound (grants are integers).
    """
    assert window_ns >= 0, f"window_ns must be >= 0, got {window_ns}"
    return math.floor(Fraction(window_ns + burst_ns, NS_PER_S) * rate_tokens_per_s) + 1


# -- R21: a rate changed without a restart ---------------------------------------------
def rescaled_tat_ns(
    tat_ns: Fraction, old_rate_tokens_per_s: Fraction, new_rate_tokens_per_s: Fraction, now_ns: int
) -> Fraction | None:
    """R21: a user's TAT when its rate changes from ``old`` to ``new`` at ``now_ns``.

    The lead over the clock is kept *in tokens*: ``lead_tokens = (TAT - now) / T_old``
    and the new ``TAT = now + lead_tokens x T_new``, i.e. ``now + (TAT - now) x old / new``,
    rounded *up* to a whole nanosecond. So the change hands out no burst (the tokens
    already granted ahead of schedule stay ahead) and forgives no debt (nor does it add
    any: the rounding adds less than 1 ns of lead, and a later TAT never grants more).
    A user whose TAT is not ahead of the clock is idle (R6): ``None``, it is forgotten.
    An unchanged rate keeps the TAT exactly.

    Args:
        tat_ns: the user's TAT (ns, exact). Rates: positive, tokens/s. ``now_ns`` >= 0.
    Returns:
        The new TAT (ns, exact; an integer unless the rate is unchanged), or ``None``.
    Raises:
        AssertionError: a non-positive rate or a negative clock.
    """
    assert old_rate_tokens_per_s > 0 and new_rate_tokens_per_s > 0, (
        f"R21: rates must be positive, got {old_rate_tokens_per_s!r} -> {new_rate_tokens_per_s!r}"
    )
    assert now_ns >= 0, f"now_ns must be >= 0, got {now_ns}"
    lead = tat_ns - now_ns
    if lead <= 0:
        return None
    if old_rate_tokens_per_s == new_rate_tokens_per_s:
        return tat_ns
    return Fraction(now_ns + math.ceil(lead * Fraction(old_rate_tokens_per_s) / Fraction(new_rate_tokens_per_s)))


def change_rates(
    state: LimiterState,
    old_rate_of: Callable[[str], Fraction | None],
    new_rate_of: Callable[[str], Fraction | None],
    now_ns: int,
) -> LimiterState:
    """R21: every known user's TAT after the rate table changes at ``now_ns``.

    ``old_rate_of`` / ``new_rate_of``: ``user -> rate`` (tokens/s) before and after (the
    default changing, a user moving to or from the default and an override changing are
    all a change of ``rate_of(user)``). Users whose rate is unchanged keep their TAT;
    the others get ``rescaled_tat_ns`` (forgotten if idle). Unknown users stay unknown.
    R28: a user whose new rate is ``UNLIMITED`` (None) loses its TAT; one leaving
    unlimited holds none, so it starts idle (R6).
    """
    tats: dict[str, Fraction] = {}
    for user, tat in state.tat_ns.items():
        old, new = old_rate_of(user), new_rate_of(user)
        if old == new:
            tats[user] = tat
            continue
        if new is None:  # R28: unlimited from now on: no TAT (nothing to keep or refund)
            continue
        assert old is not None, f"R28: unlimited user {user!r} held a TAT"
        rescaled = rescaled_tat_ns(tat, old, new, now_ns)
        if rescaled is not None:
            tats[user] = rescaled
    return LimiterState(MappingProxyType(tats))


def grants_at(
    state: LimiterState, user: str, rate_tokens_per_s: Fraction, now_ns: int, burst_ns: int = BURST_NS
) -> int:
    """R2: how many ``try_take(user, ...)`` at ``now_ns`` in a row would succeed (R21's
    "no burst from the change" compares it before and after a change)."""
    lead = max(tat_of(state, user, now_ns) - now_ns, Fraction(0))
    if lead > burst_ns:
        return 0
    return math.floor((burst_ns - lead) / emission_interval_ns(rate_tokens_per_s)) + 1


def piecewise_window_bound_tokens(segments: list[tuple[int, Fraction]], burst_ns: int = BURST_NS) -> int:
    """R21 bound: grants in a closed window made of ``segments`` ``(duration_ns, rate)``
    (the rate in force over each part, in time order) are at most
    ``floor(sum(duration x rate) + tau x max(rate)) + 1``; with one segment this is R2's
    ``window_bound_tokens``."""
    assert segments and all(d >= 0 and r > 0 for d, r in segments), segments
    credit = sum((Fraction(d, NS_PER_S) * r for d, r in segments), Fraction(0))
    return math.floor(credit + Fraction(burst_ns, NS_PER_S) * max(r for _, r in segments)) + 1
