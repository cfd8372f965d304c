"""Observable properties checked in more than one place, implemented once.

The spec's invariants (``spec/invariants.py``), the gate's scenario judge
(``adapter/judge.py``) and the trace checker (``adapter/trace_check.py``) all judge
the same two properties of what a scheduler did; each calls these functions and words
its own message.

* R2 window bound: in every closed window of ``W`` ns a user is granted at most
  ``floor((W + tau) x rate) + 1`` tokens (``spec.limiter.window_bound_tokens``).
  ``R2Window`` checks it in O(1) memory per user, whatever the number of dispatches.
* R7/R9 accounting: each request is charged at most once a step, a refund undoes one of
  the same step's charges once, never of a request that then sampled, and charges minus
  refunds are exactly the step's sampling dispatches (``accounting_error``).
* R11/P3 paused, never cut: every request ends with exactly the output tokens it asked
  for (``first_cut``; the gate's rate-change, residency and LoRA checks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from vllm_output_rate.spec.limiter import BURST_NS, NS_PER_S, window_bound_tokens


@dataclass(frozen=True)
class WindowExcess:
    """A window breaking R2: ``count`` grants in ``[start_ns, end_ns]`` > ``bound``."""

    count: int
    start_ns: int
    end_ns: int
    bound: int


class R2Window:
    """Streaming R2 check of one user's grant times (non-decreasing), O(1) memory.

    With rate ``p/q`` tok/s and ``A_k = k * q * 10**9 - p * t_k`` for the k-th grant (from
    0), the window from grant ``j`` to grant ``k`` holds ``k - j + 1`` grants, and
    ``k - j + 1 > floor((t_k - t_j + tau) x p/q / 10**9) + 1`` exactly when
    ``A_k - A_j > tau * p``. So keeping the running minimum of ``A`` decides, at each
    grant, whether *some* window ending there breaks the bound; the window reported is
    the one with the most excess (the earliest such start on ties).
    """

    __slots__ = ("_limit", "_min_a", "_min_index", "_min_ns", "_unit", "burst_ns", "count", "rate")

    def __init__(self, rate: Fraction, burst_ns: int = BURST_NS) -> None:
        assert rate > 0, f"rate must be positive, got {rate}"
        self.rate, self.burst_ns = Fraction(rate), burst_ns
        self._unit = self.rate.denominator * NS_PER_S
        self._limit = burst_ns * self.rate.numerator
        self.count = 0
        self._min_a: int | None = None
        self._min_index = self._min_ns = 0

    def add(self, now_ns: int) -> WindowExcess | None:
        """Record the next grant at ``now_ns``; the worst window ending there, if it breaks R2."""
        k = self.count
        self.count += 1
        a = k * self._unit - self.rate.numerator * now_ns
        if self._min_a is None or a < self._min_a:
            self._min_a, self._min_index, self._min_ns = a, k, now_ns
        if a - self._min_a <= self._limit:
            return None
        return WindowExcess(
            k - self._min_index + 1,
            self._min_ns,
            now_ns,
            window_bound_tokens(now_ns - self._min_ns, self.rate, self.burst_ns),
        )


def window_excess(times_ns: Sequence[int], rate: Fraction, burst_ns: int = BURST_NS) -> WindowExcess | None:
    """R2 on the windows that end at the newest of ``times_ns`` (None: all within the bound)."""
    window, excess = R2Window(rate, burst_ns), None
    for t in times_ns:
        excess = window.add(t)
    return excess


def accounting_error(charged: Sequence[str], refunded: Sequence[str], sampled: Iterable[str]) -> tuple[str, str] | None:
    """R7/R9 on one step: ``(rule, what is wrong)`` for the first broken part, or None.

    ``charged`` / ``refunded``: request ids in call order (a repeat is itself an error);
    ``sampled``: the ids dispatched to sample a token in the step. The parts, in order:
    ``charge_refund_error``, then charges minus refunds == sampling dispatches.
    """
    sampled = set(sampled)
    error = charge_refund_error(charged, refunded, sampled)
    if error is not None:
        return error
    net = sorted(net_charges(charged, refunded))
    if net != sorted(sampled):
        return (
            "R9",
            f"charges {list(charged)} minus refunds {list(refunded)} = {net} != sampling dispatches {sorted(sampled)}",
        )
    return None


def charge_refund_error(
    charged: Sequence[str], refunded: Sequence[str], sampled: Iterable[str]
) -> tuple[str, str] | None:
    """R7/R9, the parts before the balance: charged at most once; each refund once, of a
    charge of this step, of a request that did not sample. ``(rule, message)`` or None."""
    sampled = set(sampled)
    twice = sorted(rid for rid, n in Counter(charged).items() if n > 1)
    if twice:
        return "R7", f"charged more than once in one step: {twice}"
    refunded_twice = sorted(rid for rid, n in Counter(refunded).items() if n > 1)
    if refunded_twice:
        return "R9", f"refunded more than once: {refunded_twice}"
    stray = sorted(set(refunded) - set(charged))
    if stray:
        return "R9", f"refund without a charge in this step: {stray}"
    refunded_dispatched = sorted(set(refunded) & sampled)
    if refunded_dispatched:
        return "R9", f"refunded although dispatched to sample: {refunded_dispatched}"
    return None


def net_charges(charged: Sequence[str], refunded: Sequence[str]) -> Counter[str]:
    """Charges minus refunds, as a multiset of request ids (R7, R9)."""
    return Counter(charged) - Counter(refunded)


def first_cut(
    finished: Mapping[str, tuple[str, int]], expected: Mapping[str, int]
) -> tuple[str, tuple[str, int] | None] | None:
    """R11/P3: the first request of ``expected`` (request id -> the output tokens it must
    end with) that did not end with exactly that many, as ``(id, (finish status, output
    tokens) or None if it never finished)``; None when every one did. ``finished``: id ->
    (finish status, output tokens)."""
    for rid, want in expected.items():
        got = finished.get(rid)
        if got is None or got[1] != want:
            return rid, got
    return None
