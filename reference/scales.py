"""R3: a rate as exact integers: ``parse_rate`` and the integer scales of a rate table.

``parse_rate`` validates a rate in tokens/s and returns it as the exact reduced fraction
``p/q`` it is written as (``0.1`` -> 1/10, never the binary double nearest to it). For a
user at ``p/q`` tokens/s the reference limiter (``reference/limiter.py``) stores ``S =
TAT_ns * p``; ``_Scale`` holds that rate's integer constants (the emission interval
``10**9 * q`` and the burst tolerance ``tau * p`` in scaled units), ``UNLIMITED`` the scale
of an unlimited user (R28), and ``PreparedTable`` the scales of a whole ``RateTable``
(R21/R27; built off the step for a watched file by ``RateTable.prepare``).

Nothing here imports the rate table or the limiter: both build on it.

Source: docs/SPEC.md "The limiter (R1-R6)", Decision R3 (fractional rates) and R27-R29.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from itertools import islice
from numbers import Rational
from typing import Any

from vllm_output_rate.spec.limiter import NS_PER_S

MAX_RATE_TOKENS_PER_S: int = 10**9  # one token per ns; anything above is a typo
MAX_RATE_DENOMINATOR: int = 10**9  # rates are given to at most 9 decimal places
PREPARE_CHUNK: int = 500  # exact users' scales built between two pauses (PreparedTable)


def parse_rate(value: object, name: str = "rate") -> Fraction:
    """Validate a rate in tokens/s and return it as an exact reduced Fraction.

    Accepts int, float, ``fractions.Fraction`` and ``decimal.Decimal``.

    Raises:
        ValueError: naming ``name`` and the bad value, for bool, non-numbers (strings
            included), NaN, infinities, values <= 0, values above 10**9 tokens/s, and
            values with more than 9 decimal places.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, Rational, Decimal)):
        raise ValueError(
            f"{name} must be a number of tokens per second (int or float), got "
            f"{value!r} of type {type(value).__name__}; write it as a JSON number, e.g. 100 or 2.5, not a string"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of tokens per second, got {value!r}")
        rate = Fraction(repr(value))
    elif isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{name} must be a finite number of tokens per second, got {value!r}")
        rate = Fraction(value)
    else:
        rate = Fraction(value)
    if rate <= 0:
        raise ValueError(f"{name} must be > 0 tokens per second, got {value!r}")
    if rate > MAX_RATE_TOKENS_PER_S:
        raise ValueError(f"{name} must be <= {MAX_RATE_TOKENS_PER_S} tokens per second, got {value!r}")
    if rate.denominator > MAX_RATE_DENOMINATOR:
        raise ValueError(f"{name} may have at most 9 decimal places, got {value!r}")
    return rate


class _Scale:
    """R3: the integer constants of one rate ``p/q``: scale p, increment, scaled tau."""

    __slots__ = ("burst", "inc", "p", "rate")

    def __init__(self, rate: Fraction, burst_ns: int) -> None:
        self.rate = rate
        self.p = rate.numerator
        self.inc = NS_PER_S * rate.denominator  # T * p, exact
        self.burst = burst_ns * rate.numerator  # tau * p


class _Unlimited(_Scale):
    """R28: the scale of an unlimited user: every method checks for it first (no TAT)."""

    def __init__(self) -> None:
        self.rate, self.p, self.inc, self.burst = None, 1, 0, 0  # type: ignore[assignment]


UNLIMITED = _Unlimited()


class PreparedTable:
    """R21/R27: a ``RateTable`` with the scales of its exact users built for one limiter's
    burst and view (``prepare``; O(table), off the step for a watched file)."""

    __slots__ = ("default", "patterns", "scales", "shadow_view", "table")

    def __init__(
        self, table: Any, burst_ns: int, shadow_view: bool = False, pause: Callable[[], None] | None = None
    ) -> None:
        self.table, self.shadow_view = table, shadow_view
        by_rate: dict[Fraction | None, _Scale] = {None: UNLIMITED}

        def scale(entry: Any) -> _Scale:
            rate = entry.rate if shadow_view else entry.enforced_rate
            found = by_rate.get(rate)
            if found is None:
                found = by_rate[rate] = _Scale(rate, burst_ns)
            return found

        self.scales: dict[str, _Scale] = {}
        items = iter(table.exact.items())
        while chunk := list(islice(items, PREPARE_CHUNK)):  # pause: the watcher thread lets the step run
            self.scales.update((user, scale(entry)) for user, entry in chunk)
            if pause is not None:
                pause()
        self.default = scale(table.default_entry)
        self.patterns = bool(table.prefixes)
