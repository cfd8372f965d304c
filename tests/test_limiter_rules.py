"""Rules R1-R6 of the GCRA limiter, checked on the spec and on the reference limiter.

Every expected value is worked out by hand in a comment next to it (T = 10**9 / rate ns,
tau = 10**8 ns). The spec limiter is driven through ``SpecLimiter`` (a thin wrapper that
calls the pure spec functions on a held ``LimiterState``), the reference through
``OutputRateLimiter``; the ``make`` fixture gives one or the other.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from vllm_output_rate.adapter.limiter_diff import SpecLimiter
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

pytestmark = pytest.mark.check

MS = 1_000_000  # ns
TAU = 100 * MS  # R1: burst tolerance, 10**8 ns

Limiter = SpecLimiter | OutputRateLimiter
MakeLimiter = Callable[..., Limiter]


@pytest.fixture(params=["spec", "reference"])
def make(request: pytest.FixtureRequest) -> MakeLimiter:
    """Build a limiter of one kind: ``make(default_rate, {user: rate})`` (tokens/s)."""
    if request.param == "spec":
        return SpecLimiter
    return OutputRateLimiter


def take_until_refused(lim: Limiter, user: str, now_ns: int, limit: int = 10**6) -> int:
    """R2: greedy takes at one instant ``now_ns`` (ns); return how many were granted (<= ``limit``)."""
    n = 0
    while lim.try_take(user, now_ns):
        n += 1
        assert n < limit, "limiter never refused"
    return n


# ---------------------------------------------------------------------------------------
# R1: one TAT per user, integer ns of a monotonic clock


@pytest.mark.rules("R1")
def test_r1_one_tat_per_user_in_ns(make: MakeLimiter) -> None:
    lim = make(10)  # T = 10**9 / 10 = 10**8 ns
    assert lim.tat_ns("a") is None and lim.tat_ns("b") is None
    assert set(lim.users()) == set()
    assert lim.try_take("a", 0)
    # a: TAT = max(unknown -> 0, 0) + 10**8 = 100_000_000; b untouched
    assert lim.tat_ns("a") == 100_000_000
    assert lim.tat_ns("b") is None
    assert set(lim.users()) == {"a"}
    assert lim.try_take("b", 50 * MS)
    # b: TAT = 50_000_000 + 100_000_000 = 150_000_000; a unchanged
    assert lim.tat_ns("b") == 150_000_000
    assert lim.tat_ns("a") == 100_000_000
    assert set(lim.users()) == {"a", "b"}


@pytest.mark.rules("R1")
def test_r1_per_user_override_rates(make: MakeLimiter) -> None:
    lim = make(10, {"fast": 100, "slow": Fraction(1, 2)})
    assert lim.rate_of("fast") == 100
    assert lim.rate_of("slow") == Fraction(1, 2)
    assert lim.rate_of("other") == 10
    # fast: T = 10**7; the k-th take at t=0 sees lead (k-1)*10**7 <= 10**8 iff k <= 11
    assert take_until_refused(lim, "fast", 0) == 11
    assert lim.tat_ns("fast") == 110_000_000  # 11 * 10**7
    # slow: T = 2*10**9; after one grant the lead 2*10**9 > tau
    assert take_until_refused(lim, "slow", 0) == 1
    assert lim.tat_ns("slow") == 2_000_000_000
    # other (default 10/s): T = 10**8; grants at leads 0 and 10**8 -> 2; the throttled
    # "fast" and "slow" users do not reduce it (P4)
    assert take_until_refused(lim, "other", 0) == 2
    assert lim.tat_ns("other") == 200_000_000


@pytest.mark.rules("R1")
def test_r1_users_are_independent(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "a", 0) == 2  # a is throttled now (TAT 2*10**8)
    assert not lim.allows("a", 0)
    # b has its own TAT: its whole idle burst (2 grants) is still available at t=0
    assert lim.allows("b", 0)
    assert take_until_refused(lim, "b", 0) == 2
    assert lim.tat_ns("a") == lim.tat_ns("b") == 200_000_000


# ---------------------------------------------------------------------------------------
# R2: allowed iff TAT - now <= tau; then TAT := max(TAT, now) + T


@pytest.mark.rules("R2")
def test_r2_idle_burst_rate_10(make: MakeLimiter) -> None:
    lim = make(10)  # T = 10**8 ns, tau = 10**8 ns
    # 1st take: idle, TAT := 0 + 10**8
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == 100_000_000
    # 2nd take: lead 10**8 - 0 = tau, allowed (<=); TAT := 10**8 + 10**8
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == 200_000_000
    # 3rd take: lead 2*10**8 > tau, refused; a refusal changes nothing
    assert not lim.allows("u", 0)
    assert not lim.try_take("u", 0)
    assert lim.tat_ns("u") == 200_000_000


@pytest.mark.rules("R2")
def test_r2_steady_pacing_rate_10(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "u", 0) == 2  # TAT = 2*10**8
    granted_total = 2
    for k in range(1, 21):
        # before step k the TAT is (k+1)*10**8.
        # at k*10**8 - 1: lead = (k+1)*10**8 - k*10**8 + 1 = tau + 1 > tau -> refused
        assert not lim.try_take("u", k * 100 * MS - 1)
        assert lim.tat_ns("u") == (k + 1) * 100 * MS
        # at k*10**8: lead = tau -> granted, TAT := (k+1)*10**8 + 10**8 = (k+2)*10**8
        assert lim.try_take("u", k * 100 * MS)
        assert lim.tat_ns("u") == (k + 2) * 100 * MS
        # a second take at the same instant: lead tau + T > tau -> refused
        assert not lim.try_take("u", k * 100 * MS)
        granted_total += 1
    # 2 at t=0 plus one per 100 ms up to 2 s: 22 grants in the closed window [0, 2 s]
    assert granted_total == 22


@pytest.mark.rules("R2")
def test_r2_long_idle_gap_restores_burst_only(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "u", 0) == 2  # TAT = 2*10**8
    # 10 s later: TAT 2*10**8 < now, so TAT := max(TAT, now) + T = 10**10 + 10**8; the
    # idle time is not banked: again exactly 2 grants (TAT 10.1 s, 10.2 s)
    now = 10 * 10**9
    assert lim.try_take("u", now)
    assert lim.tat_ns("u") == 10_100_000_000
    assert lim.try_take("u", now)
    assert lim.tat_ns("u") == 10_200_000_000
    assert not lim.try_take("u", now)


@pytest.mark.rules("R2")
def test_r2_allows_predicts_try_take_and_changes_nothing(make: MakeLimiter) -> None:
    lim = make(3)  # T = 10**9/3
    assert lim.allows("u", 0)  # idle
    assert lim.tat_ns("u") is None  # allows() created no state
    assert lim.try_take("u", 0)  # TAT = 10**9/3
    # lead at 233_333_333 = 100_000_000 1/3 > tau; at 233_333_334 it is 99_999_999 1/3
    assert not lim.allows("u", 233_333_333)
    assert lim.allows("u", 233_333_334)
    assert lim.tat_ns("u") == Fraction(10**9, 3)


@pytest.mark.rules("R2")
def test_r2_spec_functions_are_pure() -> None:
    rate = Fraction(10)
    s0 = spec.EMPTY
    s1, g1 = spec.try_take(s0, "u", rate, 0)
    s2, g2 = spec.try_take(s1, "u", rate, 0)
    s3, g3 = spec.try_take(s2, "u", rate, 0)
    assert (g1, g2, g3) == (True, True, False)
    # the inputs are never modified: 0, 10**8, 2*10**8 as after each step
    assert dict(s0.tat_ns) == {}
    assert dict(s1.tat_ns) == {"u": 100_000_000}
    assert dict(s2.tat_ns) == {"u": 200_000_000}
    assert s3 is s2  # a refusal returns the state unchanged
    with pytest.raises(TypeError):
        tat_ns: Any = s1.tat_ns  # read-only by design: the assignment below must fail
        tat_ns["u"] = Fraction(0)


@pytest.mark.rules("R2")
@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        (10, 2),  # floor(0.1 * 10) + 1 = 1 + 1
        (3, 1),  # floor(0.3) + 1
        (25, 3),  # floor(2.5) + 1
        (1000, 101),  # floor(100) + 1
        (Fraction(1, 2), 1),  # floor(0.05) + 1
        (Fraction(10**6, 7), 14_286),  # floor(10**5 / 7 = 14285.71..) + 1
    ],
)
def test_r2_idle_burst_grants_helper_and_limiters(make: MakeLimiter, rate: int | Fraction, expected: int) -> None:
    assert spec.idle_burst_grants(Fraction(rate)) == expected
    assert take_until_refused(make(rate), "u", 0) == expected


@pytest.mark.rules("R2")
def test_r2_idle_burst_grants_other_burst() -> None:
    # tau = 1 ns: floor(10**-9 * 10) + 1 = 1; tau = 1 s: floor(1 * 10) + 1 = 11
    assert spec.idle_burst_grants(Fraction(10), burst_ns=1) == 1
    assert spec.idle_burst_grants(Fraction(10), burst_ns=10**9) == 11
    ref = OutputRateLimiter(10, burst_ns=10**9)
    assert take_until_refused(ref, "u", 0) == 11
    ref1 = OutputRateLimiter(10, burst_ns=1)
    assert take_until_refused(ref1, "u", 0) == 1


@pytest.mark.rules("R2")
@pytest.mark.parametrize(
    ("window_ns", "rate", "expected"),
    [
        (0, Fraction(10), 2),  # floor(0.1 * 10) + 1
        (10**9, Fraction(10), 12),  # floor(1.1 * 10) + 1
        (2 * 10**9, Fraction(10), 22),  # floor(2.1 * 10) + 1
        (10**9, Fraction(3), 4),  # floor(1.1 * 3 = 3.3) + 1
        (10**9, Fraction(1, 2), 1),  # floor(1.1 * 0.5 = 0.55) + 1
        (5 * 10**8, Fraction(25), 16),  # floor(0.6 * 25 = 15) + 1
        (9 * 10**8, Fraction(1, 3), 1),  # floor(1.0 / 3) + 1
        (29 * 10**8, Fraction(1, 3), 2),  # floor(3.0 / 3 = 1) + 1
    ],
)
def test_r2_window_bound_tokens_helper(window_ns: int, rate: Fraction, expected: int) -> None:
    assert spec.window_bound_tokens(window_ns, rate) == expected


@pytest.mark.rules("R2")
def test_r2_window_bound_tokens_rejects_negative_window() -> None:
    with pytest.raises(AssertionError):
        spec.window_bound_tokens(-1, Fraction(10))


def _max_grants_in_window(grant_times: list[int], window_ns: int) -> int:
    """Most grants in any closed window [s, s + window_ns]; s ranges over grant times."""
    return max(
        bisect.bisect_right(grant_times, s + window_ns) - bisect.bisect_left(grant_times, s) for s in grant_times
    )


@pytest.mark.rules("R2")
def test_r2_window_bound_attained_by_greedy_taker(make: MakeLimiter) -> None:
    lim = make(10)
    times: list[int] = []
    for t in range(0, 3000 * MS + 1, MS):  # take greedily every 1 ms for 3 s
        while lim.try_take("u", t):
            times.append(t)
    # grants: 2 at t=0, then one every 100 ms: 2 + 30 = 32 by t=3 s
    assert len(times) == 32
    # closed 1 s window [0, 1 s]: 2 + 10 = 12 = floor((1 + 0.1) * 10) + 1; never more
    assert _max_grants_in_window(times, 10**9) == 12
    # closed 250 ms window: [0, 250 ms] holds 0, 0, 100, 200 ms = 4 = floor(0.35*10) + 1
    assert _max_grants_in_window(times, 250 * MS) == 4


# ---------------------------------------------------------------------------------------
# R3: exact arithmetic, fractional rates exact


@pytest.mark.rules("R3")
@pytest.mark.parametrize(
    ("rate", "t_ns"),
    [
        (Fraction(1, 2), 2_000_000_000),  # 10**9 / (1/2)
        (0.5, 2_000_000_000),  # the float 0.5 read as the decimal 1/2
        (Fraction(1, 3), 3_000_000_000),  # 10**9 / (1/3)
        (Fraction(1, 7), 7_000_000_000),  # 10**9 / (1/7)
        (2.5, 400_000_000),  # 10**9 / (5/2)
        (Decimal("2.5"), 400_000_000),
        (0.1, 10_000_000_000),  # the decimal 1/10, not the binary double 0.1000000000000000055..
    ],
)
def test_r3_fractional_rates_exact(make: MakeLimiter, rate: object, t_ns: int) -> None:
    lim = make(rate)
    # T > tau for every rate here, so a take at ready_at = TAT - tau < TAT gives
    # TAT := max(TAT, now) + T = TAT + T. After n grants paced at ready_at: TAT = n*T.
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == t_ns
    assert not lim.try_take("u", 0)  # lead T > tau
    for n in range(2, 1002):
        ready = lim.ready_at_ns("u")
        assert ready == (n - 1) * t_ns - TAU
        assert not lim.try_take("u", ready - 1)
        assert lim.try_take("u", ready)
        assert lim.tat_ns("u") == n * t_ns
    # 1001 grants: TAT exactly 1001 * T, no drift
    assert lim.tat_ns("u") == 1001 * t_ns


@pytest.mark.rules("R3")
def test_r3_rate_3_accumulates_without_drift(make: MakeLimiter) -> None:
    lim = make(3)  # T = 10**9/3 = 333_333_333 1/3 ns, never rounded
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == Fraction(10**9, 3)
    now = 0
    for _ in range(2999):  # 2999 more grants, each at the earliest instant
        now = lim.ready_at_ns("u")
        assert lim.try_take("u", now)
    # 3000 grants from 0: TAT = 3000 * 10**9/3 = 10**12 exactly; the last grant was at
    # ready_at of TAT 2999 * 10**9/3 = 999_666_666_666 2/3, i.e. ceil(999_566_666_666 2/3)
    assert lim.tat_ns("u") == 10**12
    assert now == 999_566_666_667
    assert lim.ready_at_ns("u") == 10**12 - TAU


@pytest.mark.rules("R3")
def test_r3_large_rate_integer_interval(make: MakeLimiter) -> None:
    lim = make(Fraction(10**6, 7))  # T = 7 * 10**9 / 10**6 = 7000 ns
    # the k-th take at t=0 sees lead (k-1)*7000 <= 10**8 iff k <= 14286
    assert take_until_refused(lim, "u", 0) == 14_286
    assert lim.tat_ns("u") == 14_286 * 7000  # 100_002_000
    assert lim.ready_at_ns("u") == 2000  # 100_002_000 - 10**8


# ---------------------------------------------------------------------------------------
# R4: refund(user): TAT := TAT - T


@pytest.mark.rules("R4")
def test_r4_refund_moves_tat_back_by_t(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "u", 0) == 2  # TAT = 2*10**8
    lim.refund("u")
    assert lim.tat_ns("u") == 100_000_000  # 2*10**8 - 10**8
    assert lim.ready_at_ns("u") == 0  # 10**8 - tau
    # the refunded token can be taken again at the same instant, then no more
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == 200_000_000
    assert not lim.try_take("u", 0)


@pytest.mark.rules("R4")
def test_r4_refund_fractional_rate(make: MakeLimiter) -> None:
    lim = make(3)
    assert lim.try_take("u", 0)  # TAT = 10**9/3
    lim.refund("u")
    # TAT = 10**9/3 - 10**9/3 = 0 exactly; the user is still held
    assert lim.tat_ns("u") == 0
    assert set(lim.users()) == {"u"}
    assert lim.ready_at_ns("u") == -TAU  # ceil(0 - 10**8)


@pytest.mark.rules("R4")
def test_r4_refund_without_charge_is_an_error(make: MakeLimiter) -> None:
    lim = make(10)
    with pytest.raises((KeyError, AssertionError)):
        lim.refund("never-charged")


def _history_idle(lim: Limiter) -> int:
    return 5 * 10**9  # nothing taken; the instant of the take+refund


def _history_lead_at_tau(lim: Limiter) -> int:
    # rate 10: burst at 0 (TAT 2*10**8); at 10**8 the lead is exactly tau (still allowed)
    assert take_until_refused(lim, "u", 0) == 2
    return 100 * MS


def _history_lead_below_tau(lim: Limiter) -> int:
    # one grant at 0 (TAT 10**8); at 50 ms the lead is 5*10**7 < tau
    assert lim.try_take("u", 0)
    return 50 * MS


def _history_past(lim: Limiter) -> int:
    # one grant at 0 (TAT 10**8); at 1 s the TAT is in the past
    assert lim.try_take("u", 0)
    return 10**9


@pytest.mark.rules("R4")
@pytest.mark.parametrize("history", [_history_idle, _history_lead_at_tau, _history_lead_below_tau, _history_past])
def test_r4_take_then_refund_changes_no_later_decision(make: MakeLimiter, history: Callable[[Limiter], int]) -> None:
    a, b = make(10), make(10)
    t0 = history(a)
    assert history(b) == t0
    tat_before = a.tat_ns("u")
    # a: one take at t0 that is granted and refunded in the same step (R9); b: nothing
    assert a.try_take("u", t0)
    a.refund("u")
    if tat_before is not None and tat_before >= t0:
        # TAT - T + T: exactly the old TAT when it was not behind the clock
        assert a.tat_ns("u") == tat_before
    else:
        # the take moved TAT to max(TAT, t0) = t0 first; t0 behaves as any TAT <= now
        assert a.tat_ns("u") == t0
    # every later decision is the same, on a dense grid around the 100 ms boundaries
    times = sorted({t0 + d for k in range(12) for d in (k * 50 * MS - 1, k * 50 * MS, k * 50 * MS + 1) if d >= 0})
    decisions_a, decisions_b = [], []
    for t in times:
        for _ in range(3):
            decisions_a.append(a.try_take("u", t))
            decisions_b.append(b.try_take("u", t))
        assert a.ready_at_ns("u") == b.ready_at_ns("u")
        assert a.tat_ns("u") == b.tat_ns("u")
    assert decisions_a == decisions_b
    assert True in decisions_a and False in decisions_a  # the sequence exercises both


# ---------------------------------------------------------------------------------------
# R5: ready_at_ns = ceil(TAT - tau), the earliest instant a take succeeds


@pytest.mark.rules("R5")
@pytest.mark.parametrize(
    ("rate", "expected"),
    [
        # rate 3, T = 333_333_333 1/3:
        #  take at 0: TAT = 333_333_333 1/3, ready = ceil(233_333_333 1/3) = 233_333_334
        #  take there: TAT = 666_666_666 2/3, ready = ceil(566_666_666 2/3) = 566_666_667
        #  take there: TAT = 10**9, ready = 900_000_000 (integral, not rounded further)
        (3, [(Fraction(10**9, 3), 233_333_334), (Fraction(2 * 10**9, 3), 566_666_667), (Fraction(10**9), 900_000_000)]),
        # rate 7, T = 142_857_142 6/7:
        #  TAT 142_857_142 6/7 -> ready ceil(42_857_142 6/7) = 42_857_143
        #  TAT 285_714_285 5/7 -> ready ceil(185_714_285 5/7) = 185_714_286
        #  TAT 428_571_428 4/7 -> ready ceil(328_571_428 4/7) = 328_571_429
        (
            7,
            [
                (Fraction(10**9, 7), 42_857_143),
                (Fraction(2 * 10**9, 7), 185_714_286),
                (Fraction(3 * 10**9, 7), 328_571_429),
            ],
        ),
    ],
)
def test_r5_ready_at_rounds_up(make: MakeLimiter, rate: int, expected: list[tuple[Fraction, int]]) -> None:
    lim = make(rate)
    now = 0
    for tat, ready in expected:
        assert lim.try_take("u", now)
        assert lim.tat_ns("u") == tat
        assert lim.ready_at_ns("u") == ready
        # one ns before ready_at: lead = TAT - (ready - 1) > tau -> refused, TAT unchanged
        assert not lim.try_take("u", ready - 1)
        assert lim.tat_ns("u") == tat
        assert lim.ready_at_ns("u") == ready
        now = ready  # at ready_at: lead <= tau -> the next take succeeds


@pytest.mark.rules("R5")
def test_r5_ready_at_integral_not_rounded(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "u", 0) == 2  # TAT 2*10**8
    assert lim.ready_at_ns("u") == 100_000_000  # 2*10**8 - 10**8, already an integer
    assert not lim.try_take("u", 99_999_999)
    assert lim.try_take("u", 100_000_000)


@pytest.mark.rules("R5")
def test_r5_ready_at_none_for_idle_user(make: MakeLimiter) -> None:
    lim = make(10)
    assert lim.ready_at_ns("nobody") is None
    # while the burst is not spent, ready_at is in the past: a take succeeds at once
    assert lim.try_take("u", 10**9)  # TAT 1.1 s
    assert lim.ready_at_ns("u") == 10**9  # 1.1 s - 0.1 s = now
    assert lim.try_take("u", 10**9)


@pytest.mark.rules("R5")
def test_r5_spec_ready_at_function() -> None:
    state = spec.LimiterState({"u": Fraction(10**9, 3), "v": Fraction(5)})
    assert spec.ready_at_ns(state, "u") == 233_333_334  # ceil(333_333_333 1/3 - 10**8)
    assert spec.ready_at_ns(state, "v") == 5 - TAU  # ceil(5 - 10**8), negative
    assert spec.ready_at_ns(state, "u", burst_ns=0) == 333_333_334  # ceil(TAT)
    assert spec.ready_at_ns(state, "w") is None


# ---------------------------------------------------------------------------------------
# R6: users with TAT <= now are deleted; a deleted user behaves as if kept


@pytest.mark.rules("R6")
def test_r6_cleanup_deletes_only_tat_le_now(make: MakeLimiter) -> None:
    lim = make(10)
    assert lim.try_take("a", 0)  # TAT(a) = 10**8
    assert lim.try_take("b", 50 * MS)  # TAT(b) = 5*10**7 + 10**8 = 1.5*10**8
    assert lim.cleanup_idle_users(100 * MS - 1) == 0  # both TATs > now
    assert set(lim.users()) == {"a", "b"}
    assert lim.cleanup_idle_users(100 * MS) == 1  # TAT(a) == now: deleted
    assert set(lim.users()) == {"b"}
    assert lim.tat_ns("a") is None and lim.ready_at_ns("a") is None
    assert lim.tat_ns("b") == 150_000_000
    assert lim.cleanup_idle_users(150 * MS) == 1
    assert len(lim) == 0


@pytest.mark.rules("R6")
def test_r6_spec_cleanup_is_pure() -> None:
    state = spec.LimiterState({"a": Fraction(10), "b": Fraction(11)})
    after = spec.cleanup_idle_users(state, 10)  # a: 10 <= 10 deleted; b: 11 > 10 kept
    assert dict(after.tat_ns) == {"b": 11}
    assert dict(state.tat_ns) == {"a": 10, "b": 11}


@pytest.mark.rules("R6")
@pytest.mark.parametrize("rate", [10, 3, Fraction(1, 7), 2.5])
@pytest.mark.parametrize("idle_for_ns", [0, 1, 7 * 10**9, 10**15])
def test_r6_deleted_user_behaves_exactly_as_kept(make: MakeLimiter, rate: object, idle_for_ns: int) -> None:
    kept, deleted = make(rate), make(rate)
    for lim in (kept, deleted):
        take_until_refused(lim, "u", 0)
    tat = kept.tat_ns("u")
    assert tat is not None
    t_clean = int(tat) + (tat.denominator != 1) + idle_for_ns  # ceil(TAT) + idle: TAT <= t_clean
    assert deleted.cleanup_idle_users(t_clean) == 1
    assert deleted.tat_ns("u") is None and kept.tat_ns("u") == tat
    # same takes on both: bursts, paced takes at ready_at, at ready_at - 1, and gaps
    now = t_clean
    for step in range(40):
        if step % 7 == 3:
            now += 10**9 + step  # a gap
        elif step % 2:
            ready = kept.ready_at_ns("u")
            assert ready == deleted.ready_at_ns("u")
            if ready is not None and ready - (step % 4 == 1) > now:
                now = ready - (step % 4 == 1)  # exactly ready_at, or one ns before
        for _ in range(3):
            assert kept.try_take("u", now) == deleted.try_take("u", now)
        assert kept.tat_ns("u") == deleted.tat_ns("u")
        assert kept.ready_at_ns("u") == deleted.ready_at_ns("u")


@pytest.mark.rules("R6")
def test_r6_returning_user_hand_values(make: MakeLimiter) -> None:
    lim = make(10)
    assert take_until_refused(lim, "u", 0) == 2  # TAT 2*10**8
    assert lim.cleanup_idle_users(200 * MS) == 1  # TAT == now: deleted
    # back at 200 ms from idle: TAT := 2*10**8 + 10**8, then 4*10**8, then refused; the
    # same as kept (max(2*10**8, 2*10**8) + T)
    assert lim.try_take("u", 200 * MS)
    assert lim.tat_ns("u") == 300_000_000
    assert lim.try_take("u", 200 * MS)
    assert lim.tat_ns("u") == 400_000_000
    assert not lim.try_take("u", 200 * MS)
