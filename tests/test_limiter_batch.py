"""R2 in closed form: ``grants_at`` / ``take_many`` of the reference limiter against ``try_take``.

The reference scheduler asks the limiter once per user per step (``grants_at``) and writes
the step's charges back in one ``take_many``; these must equal one ``try_take`` per charge
at the same clock reading, for every rate (integral and fractional), TAT lead and count.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.reference.limiter import OutputRateLimiter

pytestmark = pytest.mark.check

RATES = st.sampled_from(
    [
        Fraction(1, 1000),
        Fraction(1, 3),
        Fraction(1, 2),
        Fraction(7),
        Fraction(10),
        Fraction(20),
        Fraction(100),
        Fraction(333333, 1000),
        Fraction(10**6),
    ]
)
BURSTS = st.sampled_from([1, 1_000_000, 100_000_000, 250_000_000])
HISTORY = st.lists(st.tuples(st.integers(0, 400_000_000), st.booleans()), max_size=12)


def _replay(rate: Fraction, burst_ns: int, history: list[tuple[int, bool]]) -> tuple[OutputRateLimiter, int]:
    """A limiter after ``history`` (clock steps, take or refund-after-take); returns it and now."""
    lim = OutputRateLimiter(rate, burst_ns=burst_ns)
    now = 10**12
    for gap, refund in history:
        now += gap
        if lim.try_take("u", now) and refund:
            lim.refund("u")
    return lim, now


def _count_takes(lim: OutputRateLimiter, now: int, cap: int) -> int:
    taken = 0
    while taken < cap and lim.try_take("u", now):
        taken += 1
    return taken


@pytest.mark.rules("R2")
@settings(max_examples=300, derandomize=True, deadline=None)
@given(RATES, BURSTS, HISTORY, st.integers(0, 300_000_000))
def test_r2_grants_at_counts_consecutive_try_takes(rate, burst_ns, history, later) -> None:
    lim, now = _replay(rate, burst_ns, history)
    now += later
    expected_cap = 250_001  # 10**6 tok/s x 250 ms + 1: the most any of these allows at one instant
    predicted = lim.grants_at("u", now)
    assert predicted <= expected_cap
    assert _count_takes(lim, now, expected_cap + 1) == predicted


@pytest.mark.rules("R2")
@settings(max_examples=300, derandomize=True, deadline=None)
@given(RATES, BURSTS, HISTORY, st.integers(0, 300_000_000), st.integers(1, 50))
def test_r2_take_many_equals_try_take_loop(rate, burst_ns, history, later, count) -> None:
    one, now = _replay(rate, burst_ns, history)
    many, _ = _replay(rate, burst_ns, history)
    now += later
    count = min(count, one.grants_at("u", now))
    if count == 0:
        assert many.grants_at("u", now) == 0
        return
    for _ in range(count):
        assert one.try_take("u", now)
    many.take_many("u", now, count)
    assert many.tat_ns("u") == one.tat_ns("u")
    assert many.grants_at("u", now) == one.grants_at("u", now)


@pytest.mark.rules("R2")
def test_r2_grants_at_idle_user_is_the_burst() -> None:
    # Idle at 10 tok/s, tau 100 ms: floor(0.1 x 10) + 1 = 2 grants (R2 idle burst).
    lim = OutputRateLimiter(10)
    assert lim.grants_at("u", 5_000_000_000) == 2
    assert lim.grants_at("u", 5_000_000_000) == 2  # asking changes nothing
    assert len(lim) == 0


@pytest.mark.rules("R2")
@pytest.mark.parametrize("count", [0, -1])
def test_r2_take_many_rejects_count_below_one(count: int) -> None:
    lim = OutputRateLimiter(10)
    with pytest.raises(ValueError, match=f"count >= 1, got {count}"):
        lim.take_many("u", 0, count)


@pytest.mark.rules("R2")
@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 3), max_size=4), HISTORY)
def test_r2_take_counts_equals_take_many_per_user(counts, history) -> None:
    # Users a-c have their own rates (b fractional); d takes the default rate.
    def limiter() -> OutputRateLimiter:
        lim = OutputRateLimiter(100, {"a": 10, "b": Fraction(1, 3), "c": 1000})
        now = 10**12
        for gap, refund in history:
            now += gap
            for user in "abcd":
                if lim.try_take(user, now) and refund:
                    lim.refund(user)
        return lim

    one, many = limiter(), limiter()
    now = 10**12 + sum(gap for gap, _ in history)
    for user, n in counts.items():
        one.take_many(user, now, n)
    many.take_counts(counts, now)
    assert {u: many.tat_ns(u) for u in "abcd"} == {u: one.tat_ns(u) for u in "abcd"}


@pytest.mark.rules("R2")
def test_r2_take_counts_rejects_a_count_below_one_naming_the_user_and_takes_nothing() -> None:
    lim = OutputRateLimiter(10)
    with pytest.raises(ValueError, match="got 0 for user 'bob'"):
        lim.take_counts({"alice": 1, "bob": 0}, 0)
    assert len(lim) == 0  # nothing taken: the whole batch is checked first


USERS = ("a", "b", "c", "d")


@pytest.mark.rules("R2")
@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.dictionaries(st.sampled_from(USERS), RATES, max_size=3),
    RATES,
    st.dictionaries(st.sampled_from(USERS), st.integers(1, 5), min_size=1),
    st.lists(st.tuples(st.integers(0, 200_000_000), st.booleans()), min_size=1, max_size=10),
    st.lists(st.sampled_from(USERS), max_size=2),
)
def test_r2_take_steady_equals_take_counts_step_by_step(overrides, default, counts, gaps, warm) -> None:
    # take_steady keeps steps of the same counts per (scale, increment) group and writes
    # them when a TAT is read; after each step every TAT equals the eager take_counts'
    # (users with and without a TAT before the run, shared and distinct rates). A step
    # whose flag is set reads the TATs in between (a flush in the middle of a run).
    eager = OutputRateLimiter(default, overrides)
    lazy = OutputRateLimiter(default, overrides)
    now = 10**12
    for user in warm:  # some users hold a TAT before the run
        for lim in (eager, lazy):
            lim.try_take(user, now)
    for gap, read in gaps:
        now += gap
        eager.take_counts(counts, now)
        lazy.take_steady(counts, now)
        if read:
            assert lazy._tat == eager._tat
    assert lazy._tat == eager._tat
    assert {u: lazy.grants_at(u, now) for u in USERS} == {u: eager.grants_at(u, now) for u in USERS}


def test_take_steady_comparison_sees_a_wrong_unrolling() -> None:
    # The comparison above can fail: writing only the last step (S := now x p + a, the
    # unrolling without the S0 + k a term) differs from take_counts for a user that
    # started ahead of the clock.
    from vllm_output_rate.reference import limiter as limiter_module

    class LastStepOnly(limiter_module._Deferred):
        def write(self, tats):
            for _p, a, top, members in self.groups:
                for user, _before in members:
                    tats[user] = top + (self.k + 1) * a

    eager, lazy = OutputRateLimiter(10), OutputRateLimiter(10)
    counts = {"u": 3}
    for lim in (eager, lazy):
        for _ in range(2):
            lim.try_take("u", 10**12)  # TAT 200 ms ahead
    real = limiter_module._Deferred
    limiter_module._Deferred = LastStepOnly
    try:
        for now in (10**12, 10**12 + 1):
            eager.take_counts(counts, now)
            lazy.take_steady(counts, now)
    finally:
        limiter_module._Deferred = real
    assert lazy._tat != eager._tat
