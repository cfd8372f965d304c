"""Differential test (R1-R6): the reference limiter makes exactly the spec's decisions.

Random operation sequences (``adapter/limiter_diff.operations``) run on the exact-rational
spec limiter and on ``OutputRateLimiter``; after every op the grant decision, ``allows``,
``ready_at_ns``, ``tat_ns`` of every user and the set of users held must agree. The
mutant tests check that the comparison catches a wrong implementation and names the rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import KeysView
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import Phase, find, given, settings

from vllm_output_rate.adapter.limiter_diff import Op, OpSequence, operations, run_differential
from vllm_output_rate.reference.limiter import OutputRateLimiter

pytestmark = pytest.mark.check

DIFF_SETTINGS = settings(derandomize=True, max_examples=300, deadline=None, database=None)


@DIFF_SETTINGS
@given(operations(80))
def test_reference_matches_spec(seq: OpSequence) -> None:
    diff = run_differential(seq)
    assert diff is None, f"{diff}\n  in: {seq}"


def test_generated_sequences_reach_every_rule() -> None:
    """The generator is not vacuous: grants, refusals, refunds, deletions, R5 edges, jumps."""
    seen: Counter[str] = Counter()

    @settings(derandomize=True, max_examples=100, deadline=None, database=None)
    @given(operations(80))
    def run(seq: OpSequence) -> None:
        assert run_differential(seq, stats=seen) is None

    run()
    for key in ("granted", "refused", "refund", "cleanup_deleted", "granted_at_ready", "refused_before_ready", "jump"):
        assert seen[key] > 0, f"no {key!r} in 100 generated sequences: {dict(seen)}"


# ---------------------------------------------------------------------------------------
# Mutants: each is wrong in one rule, and run_differential must say which


class _StrictLess(OutputRateLimiter):
    """R2 mutant: allows only when TAT - now < tau (strict)."""

    def try_take(self, user: str, now_ns: int) -> bool:
        tat = self.tat_ns(user)
        if tat is not None and tat - now_ns >= self.burst_ns:
            return False
        return super().try_take(user, now_ns)


class _NoRefund(OutputRateLimiter):
    """R4 mutant: refund does nothing."""

    def refund(self, user: str) -> None:
        return None


class _FloorReady(OutputRateLimiter):
    """R5 mutant: ready_at rounds down."""

    def ready_at_ns(self, user: str) -> int | None:
        tat = self.tat_ns(user)
        return None if tat is None else (tat - self.burst_ns).__floor__()


class _CleanupStrict(OutputRateLimiter):
    """R6 mutant: deletes only users with TAT < now (keeps TAT == now)."""

    def cleanup_idle_users(self, now_ns: int) -> int:
        return super().cleanup_idle_users(now_ns - 1)


class _FloatInterval(OutputRateLimiter):
    """R3 mutant: TAT in float ns, T = 1e9 / rate rounded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ftat: dict[str, float] = {}

    def try_take(self, user: str, now_ns: int) -> bool:
        tat = max(self._ftat.get(user, float(now_ns)), float(now_ns))
        if tat - now_ns > self.burst_ns:
            return False
        self._ftat[user] = tat + 1e9 / float(self.rate_of(user))
        return True

    def tat_ns(self, user: str) -> Fraction | None:
        t = self._ftat.get(user)
        return None if t is None else Fraction(t)

    def ready_at_ns(self, user: str) -> int | None:
        t = self._ftat.get(user)
        return None if t is None else -int(-(t - self.burst_ns) // 1)

    def allows(self, user: str, now_ns: int) -> bool:
        t = self._ftat.get(user)
        return t is None or t - now_ns <= self.burst_ns

    def users(self) -> KeysView[str]:
        return self._ftat.keys()


def _seq(rate: Fraction, *ops: Op) -> OpSequence:
    return OpSequence(rate, (), ("u0",), ops)


TAKE = Op("take", "u0")


def test_reference_agrees_on_hand_sequences() -> None:
    # rate 10: burst of 2 at 0, third refused, at 100 ms one more (lead == tau)
    assert run_differential(_seq(Fraction(10), TAKE, TAKE, TAKE, Op("advance", arg=10**8), TAKE)) is None


@pytest.mark.rules("R2")
def test_mutant_r2_strict_comparison_caught() -> None:
    # rate 10 at t=0: the 2nd take has lead 10**8 == tau: spec grants, mutant refuses
    diff = run_differential(_seq(Fraction(10), TAKE, TAKE), make_impl=_StrictLess)
    assert diff is not None and diff.startswith("R2: grant differs at op 1 (take(u0))"), diff


@pytest.mark.rules("R4")
def test_mutant_r4_refund_caught() -> None:
    diff = run_differential(_seq(Fraction(10), Op("advance", arg=0), TAKE, Op("refund")), make_impl=_NoRefund)
    # after the refund the spec's TAT is 0, the mutant's still 10**8
    assert diff is not None and diff.startswith("R4: tat_ns(u0) differs at op 2"), diff


@pytest.mark.rules("R5")
def test_mutant_r5_rounding_caught() -> None:
    # rate 3: TAT 10**9/3, ready_at = ceil(233_333_333 1/3) = 233_333_334, mutant 233_333_333
    diff = run_differential(_seq(Fraction(3), TAKE), make_impl=_FloorReady)
    assert diff is not None and diff.startswith("R5: ready_at_ns(u0) differs at op 0"), diff
    assert "spec 233333334, impl 233333333" in diff


@pytest.mark.rules("R6")
def test_mutant_r6_cleanup_caught() -> None:
    # rate 10: TAT 10**8 after one take at 0; cleanup at exactly 10**8 must delete u0
    seq = _seq(Fraction(10), TAKE, Op("advance", arg=10**8), Op("cleanup"))
    diff = run_differential(seq, make_impl=_CleanupStrict)
    assert diff is not None and diff.startswith("R6:"), diff


@pytest.mark.rules("R3")
def test_mutant_r3_float_caught() -> None:
    # rate 3: T = 10**9/3 is not a float; the very first TAT differs
    diff = run_differential(_seq(Fraction(3), TAKE), make_impl=_FloatInterval)
    assert diff is not None and diff.startswith("R3: tat_ns(u0) differs at op 0"), diff


def test_mutants_caught_by_generated_sequences() -> None:
    """Hypothesis finds each mutant from generated sequences too (not only by hand)."""
    search = settings(derandomize=True, max_examples=300, deadline=None, database=None, phases=[Phase.generate])
    for mutant, rule in ((_StrictLess, "R2"), (_NoRefund, "R4"), (_FloorReady, "R5"), (_CleanupStrict, "R6")):
        seq = find(
            operations(80), lambda s, mutant=mutant: run_differential(s, make_impl=mutant) is not None, settings=search
        )
        diff = run_differential(seq, make_impl=mutant)
        assert diff is not None and diff.startswith(rule + ":"), (mutant.__name__, diff)


def test_implementation_crash_reported_not_raised() -> None:
    class _Crash(OutputRateLimiter):
        def try_take(self, user: str, now_ns: int) -> bool:
            raise RuntimeError("boom")

    diff = run_differential(_seq(Fraction(10), TAKE), make_impl=_Crash)
    assert diff is not None and diff.startswith("R2: implementation raised RuntimeError: boom"), diff
