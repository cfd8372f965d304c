"""spec/properties.py: the R2 window bound, the R7/R9 accounting and R11/P3, implemented once.

The streaming ``R2Window`` is checked against the definition (every pair of grants, by
``spec.limiter.window_bound_tokens``); ``accounting_error`` and ``first_cut`` against
hand-made cases.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.spec.limiter import BURST_NS, window_bound_tokens
from vllm_output_rate.spec.properties import R2Window, accounting_error, first_cut, net_charges, window_excess

pytestmark = pytest.mark.check

MS = 1_000_000


def _brute_force_ok(times: list[int], rate: Fraction, burst_ns: int) -> bool:
    return all(
        j - i + 1 <= window_bound_tokens(times[j] - times[i], rate, burst_ns)
        for i in range(len(times))
        for j in range(i, len(times))
    )


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.sampled_from([0, 0, 1, 10, 33, 50, 100, 400]), min_size=1, max_size=40),
    rate=st.sampled_from([Fraction(1, 3), Fraction(1), Fraction(7, 2), Fraction(10), Fraction(20)]),
    burst_ms=st.sampled_from([20, 100, 250]),
)
def test_streaming_window_matches_every_pair(gaps: list[int], rate: Fraction, burst_ms: int) -> None:
    times, t = [], 0
    for gap in gaps:
        t += gap * MS
        times.append(t)
    window = R2Window(rate, burst_ms * MS)
    first_excess = next((e for e in map(window.add, times) if e is not None), None)
    assert (first_excess is None) == _brute_force_ok(times, rate, burst_ms * MS)
    if first_excess is not None:  # the reported window really breaks the bound
        assert first_excess.count > first_excess.bound
        assert first_excess.bound == window_bound_tokens(
            first_excess.end_ns - first_excess.start_ns, rate, burst_ms * MS
        )


def test_window_excess_reports_the_window_ending_at_the_newest_grant() -> None:
    rate = Fraction(10)  # burst: floor(0.1 x 10) + 1 = 2 grants at one instant
    assert window_excess([0, 0], rate) is None
    excess = window_excess([0, 0, 0], rate, BURST_NS)
    assert excess is not None and (excess.count, excess.start_ns, excess.end_ns, excess.bound) == (3, 0, 0, 2)
    assert window_excess([0, 0, 200 * MS], rate) is None


def test_accounting_error_names_the_first_broken_part() -> None:
    assert accounting_error(["a", "b"], ["b"], ["a"]) is None
    assert accounting_error(["a", "a"], [], ["a"])[0] == "R7"
    assert accounting_error(["a"], ["a", "a"], [])[0] == "R9"
    assert "without a charge" in accounting_error(["a"], ["b"], ["a"])[1]
    assert "although dispatched" in accounting_error(["a"], ["a"], ["a"])[1]
    assert "!= sampling dispatches" in accounting_error(["a"], [], [])[1]
    assert "!= sampling dispatches" in accounting_error([], [], ["a"])[1]
    assert net_charges(["a", "b"], ["b"]) == {"a": 1}


@pytest.mark.rules("R11")
def test_r11_first_cut_names_the_first_request_not_ending_with_its_tokens() -> None:
    expected = {"a": 3, "b": 2, "c": 4}
    assert first_cut({"a": ("length", 3), "b": ("length", 2), "c": ("length", 4)}, expected) is None
    assert first_cut({"a": ("length", 3), "b": ("stop", 1), "c": ("length", 4)}, expected) == ("b", ("stop", 1))
    assert first_cut({"a": ("length", 3), "b": ("length", 2)}, expected) == ("c", None)  # never finished
    assert (
        first_cut({"a": ("length", 3), "b": ("length", 2), "c": ("length", 4), "d": ("length", 0)}, expected) is None
    )  # only the expected requests are judged
