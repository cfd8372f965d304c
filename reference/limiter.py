"""``OutputRateLimiter``: per-user GCRA on integer-scaled TATs (rules R1-R6).

The reference limiter used by ``RateLimitedScheduler``. It makes exactly the decisions of
the exact-rational spec (``vllm_output_rate.spec.limiter``) with plain Python ints:

R3: for a user whose rate is ``p/q`` tokens/s (a reduced fraction), the limiter stores
``S = TAT_ns * p``. The emission interval ``T = 10**9 * q / p`` ns then becomes the
integer ``10**9 * q`` in scaled units, the burst tolerance ``tau`` becomes ``tau * p``,
and ``now`` becomes ``now_ns * p``. Every comparison and addition is exact; nothing is
ever rounded except ``ready_at_ns``, which rounds *up* (R5).

Fractional rates are exact: a rate is taken as the decimal number it is written as
(``0.5`` -> 1/2, ``2.5`` -> 5/2, ``Fraction(1, 3)`` stays 1/3). Floats are read through
their shortest ``repr`` so ``0.1`` means 1/10, not the binary double nearest to it
(``parse_rate``; it and the integer scales, ``_Scale`` and ``PreparedTable``, are in
reference/scales.py).

R27-R29 (reference/ratetable.py): the rates come from a ``RateTable``: exact users'
scales are built with the table (off the step for a watched file, ``prepare``), users
matched by a prefix pattern are resolved on first sight and cached, and an unlimited user
(R28; a shadow plan's user, R29, in the enforcing limiter) has the ``UNLIMITED`` scale: it
is always granted, holds no TAT and has nothing to refund.

Source: docs/SPEC.md "The limiter (R1-R6)", Decision R3 (fractional rates) and R27-R29.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

# The rule constants are the spec's (R1: tau = 100 ms); the arithmetic below is this
# limiter's own (integer-scaled), checked against the spec's rationals by the gate.
from vllm_output_rate.reference.ratetable import RateTable
from vllm_output_rate.reference.scales import UNLIMITED, PreparedTable, _Scale, parse_rate
from vllm_output_rate.spec.limiter import BURST_NS

# R28: grants_at of an unlimited user: more than any step can charge (one per request, R7).
UNLIMITED_GRANTS: int = 1 << 62
MAX_RESOLVED_USERS: int = 1 << 20  # pattern-matched users cached; the cache restarts above it


class OutputRateLimiter:
    """Per-user GCRA limiter with integer-scaled TATs (R1-R6).

    Args:
        default_rate_tokens_per_s: rate of every user not in ``user_rates_tokens_per_s``.
        user_rates_tokens_per_s: per-user overrides, ``{user_id: rate}``.
        burst_ns: burst tolerance tau in ns (R1; default 100 ms). Must be > 0.
    Raises:
        ValueError: a bad rate (see ``parse_rate``), a non-string user id, or a bad burst.
    """

    def __init__(
        self,
        default_rate_tokens_per_s: object,
        user_rates_tokens_per_s: Mapping[str, object] | None = None,
        burst_ns: int = BURST_NS,
        table: Any = None,
        shadow_view: bool = False,
        prepared: PreparedTable | None = None,
    ) -> None:
        if isinstance(burst_ns, bool) or not isinstance(burst_ns, int) or burst_ns <= 0:
            raise ValueError(f"burst_ns must be a positive int of nanoseconds, got {burst_ns!r}")
        self.burst_ns = burst_ns
        self.shadow_view = shadow_view  # R29: a shadow plan's users at their rate (else unlimited)
        if prepared is None and table is None:
            table = flat_table(default_rate_tokens_per_s, user_rates_tokens_per_s)
        # R1: scaled TAT per known user. Absent = idle (R6); an unlimited user never has one (R28).
        self._tats: dict[str, int] = {}
        # take_steady's steps not yet written to ``_tats`` (``_tat`` writes them first).
        self._deferred: _Deferred | None = None
        self.replaced: tuple[Any, ...] = ()  # what the last install replaced (for the watcher to retire)
        self._use(prepared if prepared is not None else PreparedTable(table, burst_ns, shadow_view))

    def _use(self, prepared: PreparedTable) -> None:
        """Install ``prepared``'s scales (O(1)): exact users' eagerly, pattern users lazily."""
        table = prepared.table
        self.table = table
        self.default_rate = table.default_rate if self.shadow_view else table.default_entry.enforced_rate
        self.user_rates: Mapping[str, Fraction] = table.user_rates
        self._default = prepared.default
        self._scales = prepared.scales
        self._patterns = prepared.patterns
        self._resolved: dict[str, _Scale] = {}  # pattern-matched users (R27), resolved once

    @property
    def _tat(self) -> dict[str, int]:
        """R1: user -> scaled TAT, every deferred step written (``take_steady``)."""
        return self._tats if self._deferred is None else self._flushed()

    def _flushed(self) -> dict[str, int]:
        """Write the deferred steps of ``take_steady`` to the TATs; returns them."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.write(self._tats)
        return self._tats

    def prepare(self, table: Any) -> PreparedTable:
        """R21/R27: ``table``'s scales for this limiter (O(table); thread-safe: reads only
        the burst and the view), for ``install``."""
        return PreparedTable(table, self.burst_ns, self.shadow_view)

    def _resolve(self, user: str) -> _Scale:
        """The scale of a user that is not an exact entry: a pattern's or the default's."""
        if not self._patterns:
            return self._default
        s = self._resolved.get(user)
        if s is None:
            entry = self.table.lookup(user)
            rate = entry.rate if self.shadow_view else entry.enforced_rate
            if rate is None:
                s = UNLIMITED
            elif rate == self._default.rate:
                s = self._default
            else:
                s = _Scale(rate, self.burst_ns)
            if len(self._resolved) >= MAX_RESOLVED_USERS:
                self._resolved.clear()
            self._resolved[user] = s
        return s

    def _scale(self, user: str) -> _Scale:
        """R1/R27: the user's scale (``UNLIMITED`` for R28)."""
        return self._scales.get(user) or self._resolve(user)

    def rate_of(self, user: str) -> Fraction | None:
        """The user's rate in tokens/s (exact); None: unlimited (R28)."""
        return self._scale(user).rate

    def is_unlimited(self, user: str) -> bool:
        """R28: the user is never throttled and never charged by this limiter."""
        return self._scale(user) is UNLIMITED

    def try_take(self, user: str, now_ns: int) -> bool:
        """R2: grant one output token to ``user`` at ``now_ns`` if ``TAT - now <= tau``.

        On a grant, ``TAT := max(TAT, now) + T``. A refusal changes nothing. O(1).
        R28: an unlimited user is always granted and keeps no TAT.
        """
        s = self._scales.get(user) or self._resolve(user)
        if s is UNLIMITED:
            return True
        now = now_ns * s.p
        tat = self._tat.get(user)
        if tat is None or tat < now:
            tat = now
        elif tat - now > s.burst:
            return False
        self._tat[user] = tat + s.inc
        return True

    def grants_at(self, user: str, now_ns: int) -> int:
        """R2 in closed form: how many ``try_take(user, now_ns)`` in a row would succeed.

        With ``d = max(TAT, now) - now`` (scaled), a run of takes at one ``now`` is granted
        while ``d + (j - 1) T <= tau``, so the count is ``floor((tau - d) / T) + 1`` when
        ``d <= tau`` and 0 otherwise. Changes nothing. O(1). The scheduler asks once per
        user per step and charges against the count (``take_counts``), which is the same as
        calling ``try_take`` once per charge. R28: ``UNLIMITED_GRANTS`` for an unlimited user.
        """
        s = self._scales.get(user) or self._resolve(user)
        if s is UNLIMITED:
            return UNLIMITED_GRANTS
        now = now_ns * s.p
        tat = self._tat.get(user)
        lead = 0 if tat is None or tat < now else tat - now
        if lead > s.burst:
            return 0
        return (s.burst - lead) // s.inc + 1

    def take_many(self, user: str, now_ns: int, count: int) -> None:
        """R2: ``count`` grants at ``now_ns`` at once: ``TAT := max(TAT, now) + count x T``.

        The same state as ``count`` successful ``try_take(user, now_ns)`` calls; the caller
        keeps ``count <= grants_at(user, now_ns)`` (not checked again here).

        Raises:
            ValueError: ``count`` < 1.
        """
        if count < 1:
            raise ValueError(f"take_many needs count >= 1, got {count!r}")
        self.take_counts({user: count}, now_ns)

    def take_counts(self, counts: Mapping[str, int], now_ns: int) -> None:
        """R2: ``take_many(user, now_ns, n)`` for every ``user -> n`` of ``counts`` (n >= 1).

        One call for a whole scheduler step; the caller keeps every ``n`` within
        ``grants_at(user, now_ns)``.

        Raises:
            ValueError: a count < 1, naming the user.
        """
        if counts and min(counts.values()) < 1:  # checked before any TAT changes
            user, count = next((u, n) for u, n in counts.items() if n < 1)
            raise ValueError(f"take_counts needs counts >= 1, got {count!r} for user {user!r}")
        tat_of, scales, resolve = self._tat, self._scales, self._resolve
        default = None if self._patterns else self._default  # what _resolve returns without patterns
        last: _Scale | None = None  # the last scale seen, its scaled clock reading and increment
        now = inc = 0
        for user, count in counts.items():
            s = scales.get(user) or default or resolve(user)
            if s is not last:
                if s is UNLIMITED:
                    continue  # R28: never charged
                last, now, inc = s, now_ns * s.p, s.inc
            tat = tat_of.get(user)
            if tat is None or tat < now:
                tat = now
            tat_of[user] = tat + count * inc

    def take_steady(self, counts: Mapping[str, int], now_ns: int) -> None:
        """R2: ``take_counts(counts, now_ns)`` for a step that repeats the last one's
        ``counts`` (the same mapping object, unchanged): O(groups) instead of O(users).

        Steps in a row with the same ``counts`` are kept as, per group of users with the
        same scale and count (increment ``a = count x T``, scaled), the maximum ``M`` of
        ``now_j x p - j x a`` over the steps ``j = 1..k``; a user's TAT after them is
        ``max(S0 + k a, M + (k + 1) a)`` (``S0``: its TAT before them; idle: the second
        term only), which unrolls ``S := max(S, now x p) + a`` k times. Any read or write of
        a TAT (``_tat``) first writes them. A subclass that replaces ``take_counts`` gets
        ``take_counts`` itself. The caller keeps every count within ``grants_at``.
        """
        if type(self).take_counts is not OutputRateLimiter.take_counts:
            self.take_counts(counts, now_ns)
            return
        deferred = self._deferred
        if deferred is None or deferred.counts is not counts:
            tats = self._tat  # writes an earlier run's steps first
            deferred = self._deferred = _Deferred(counts, tats, self._scale)
        deferred.step(now_ns)

    def allows(self, user: str, now_ns: int) -> bool:
        """R2: would ``try_take(user, now_ns)`` succeed? Changes nothing."""
        tat = self._tat.get(user)
        if tat is None:
            return True
        s = self._scales.get(user) or self._resolve(user)
        return tat - now_ns * s.p <= s.burst

    def refund(self, user: str) -> None:
        """R4: undo one grant: ``TAT := TAT - T``.

        R28: nothing to refund for an unlimited user (it was never charged).

        Raises:
            KeyError: if the user holds no TAT (a refund without a charge is a bug, R9).
        """
        s = self._scales.get(user) or self._resolve(user)
        if s is UNLIMITED:
            return
        self._tat[user] -= s.inc

    def ready_at_ns(self, user: str) -> int | None:
        """R5: earliest ns at which ``try_take(user, .)`` succeeds, ``ceil(TAT - tau)``.

        ``None`` for an idle (unknown) user, who may take at any time.
        """
        tat = self._tat.get(user)
        if tat is None:
            return None
        s = self._scales.get(user) or self._resolve(user)
        return -((s.burst - tat) // s.p)  # ceil((tat - burst) / p)

    def tat_ns(self, user: str) -> Fraction | None:
        """R1: the user's TAT in ns, exact (``None`` if idle). For the gate's white-box view."""
        tat = self._tat.get(user)
        if tat is None:
            return None
        s = self._scales.get(user) or self._resolve(user)
        return Fraction(tat, s.p)

    def cleanup_idle_users(self, now_ns: int) -> int:
        """R6: delete every user with ``TAT <= now``; return how many were deleted."""
        idle = [u for u, tat in self._tat.items() if tat <= now_ns * self._scale(u).p]
        for user in idle:
            del self._tat[user]
        return len(idle)

    def change_rates(
        self, default_rate_tokens_per_s: object, user_rates_tokens_per_s: Mapping[str, object] | None, now_ns: int
    ) -> int:
        """R21: replace the rate table at ``now_ns``, keeping every user's lead in tokens.

        For a user holding a TAT whose rate changes ``p/q -> p'/q'`` (override or default),
        with scaled lead ``L = S - now x p`` (``L / p`` ns): if ``L <= 0`` the user is idle
        and forgotten (R6); otherwise its new lead is ``ceil(L x q' / (q x p'))`` ns (the
        lead in tokens kept, rounded up to a whole ns: never a token handed out) and
        ``S' = (now + lead) x p'``. Integer arithmetic only, the same TAT as the spec's
        ``limiter.rescaled_tat_ns``. Users whose rate is unchanged keep ``S``. The burst
        tolerance is not part of the change. Call between steps only (the scheduler calls
        it at the start of ``schedule()``).

        Returns:
            How many users' TATs were rescaled or forgotten.
        Raises:
            ValueError: a bad rate or user id (``parse_rate``); nothing is changed then.
        """
        fresh = self.prepare(flat_table(default_rate_tokens_per_s, user_rates_tokens_per_s))  # validates
        return self.install(fresh, now_ns)

    def install(self, prepared: PreparedTable, now_ns: int) -> int:
        """R21/R27: put a prepared table (``prepare``) in force at ``now_ns``, as
        ``change_rates`` does: O(users holding a TAT), whatever the table's size.

        R28: a user becoming unlimited drops its TAT (nothing to keep); one leaving
        unlimited has none, so it starts idle (R6).

        Returns:
            How many users' TATs were rescaled or forgotten.
        """
        changed = 0
        new_scales, new_default = prepared.scales, prepared.default
        for user, scaled in list(self._tat.items()):
            old = self._scale(user)
            new = new_scales.get(user)
            if new is None:
                new = new_default if not prepared.patterns else self._pattern_scale(prepared, user)
            old_rate, new_rate = old.rate, new.rate
            if old_rate == new_rate:
                continue
            changed += 1
            lead = scaled - now_ns * old.p
            if lead <= 0 or new_rate is None:
                del self._tat[user]  # R6 idle, or R28 unlimited from now on
                continue
            num, den = lead * new_rate.denominator, old_rate.denominator * new_rate.numerator
            lead_ns = -((-num) // den)  # R21: rounded up
            self._tat[user] = (now_ns + lead_ns) * new_rate.numerator
        self.replaced = (self.table, self._scales, self._resolved)
        self._use(prepared)
        return changed

    def _pattern_scale(self, prepared: PreparedTable, user: str) -> _Scale:
        """The scale ``user`` gets from ``prepared`` when no exact entry names it."""
        entry = prepared.table.lookup(user)
        rate = entry.rate if self.shadow_view else entry.enforced_rate
        return UNLIMITED if rate is None else _Scale(rate, self.burst_ns)

    def users(self) -> Iterable[str]:
        """Users that currently hold a TAT (for observation and memory checks)."""
        return self._tat.keys()

    def __len__(self) -> int:
        return len(self._tat)


class _Deferred:
    """``take_steady``'s steps in a row with the same ``counts``: the groups of users with
    the same scale ``p`` and increment ``a``, each with ``[p, a, M, members]`` (``M``: the
    maximum of ``now_j x p - j x a`` so far; ``members``: (user, TAT before the run or None))."""

    __slots__ = ("counts", "groups", "k")

    def __init__(self, counts: Mapping[str, int], tats: dict[str, int], scale_of: Any) -> None:
        self.counts, self.k = counts, 0
        groups: dict[tuple[int, int], list[Any]] = {}
        for user, count in counts.items():
            s = scale_of(user)
            if s is UNLIMITED:
                continue  # R28: never charged
            a = count * s.inc
            group = groups.get((s.p, a))
            if group is None:
                group = groups[(s.p, a)] = [s.p, a, None, []]
            group[3].append((user, tats.get(user)))
        self.groups = list(groups.values())

    def step(self, now_ns: int) -> None:
        """One more step at ``now_ns``: O(groups)."""
        k = self.k = self.k + 1
        for group in self.groups:
            v = now_ns * group[0] - k * group[1]
            if group[2] is None or v > group[2]:
                group[2] = v

    def write(self, tats: dict[str, int]) -> None:
        """Every member's TAT after the ``k`` steps: ``max(S0 + k a, M + (k + 1) a)``."""
        k = self.k  # >= 1: take_steady makes a run and steps it in one call
        for _p, a, top, members in self.groups:
            base = top + (k + 1) * a
            for user, before in members:
                tats[user] = base if before is None or before + k * a < base else before + k * a


def flat_table(default_rate_tokens_per_s: object, user_rates_tokens_per_s: Mapping[str, object] | None) -> Any:
    """Today's table (a default and per-user rates) as a ``ratetable.RateTable``.

    Raises:
        ValueError: a bad rate (``parse_rate``) or a user id that is not a non-empty string.
    """
    default = parse_rate(default_rate_tokens_per_s, "default rate")
    users: dict[str, Fraction] = {}
    for user, rate in (user_rates_tokens_per_s or {}).items():
        if not isinstance(user, str) or not user:
            raise ValueError(f"user ids in the rate overrides must be non-empty strings, got {user!r}")
        users[user] = parse_rate(rate, f"rate of user {user!r}")
    return RateTable.flat(default, users)
