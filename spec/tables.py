"""R27-R29: what a rate table means, per user (pure; the reference is reference/ratetable.py).

A table maps users to entries: exact user ids, prefix patterns (a prefix of the id) and a
default. Each entry is a ``TableEntry``: a rate in tokens/s or ``UNLIMITED`` (R28), and
whether its plan is in shadow (R29). Plans are a naming convenience of the file: an entry
on a plan carries the plan's rate and shadow flag unless it gives its own rate.

- R27 ``resolve``: the most specific entry wins: the exact id, else the longest prefix of
  the id among the patterns, else the default. (Two entries for the same key cannot exist:
  the loader refuses such a tie.)
- R28 ``UNLIMITED``: the limiter keeps no TAT for such a user, every take is granted and
  there is nothing to refund (``spec/limiter.py``: ``try_take``, ``refund``,
  ``change_rates`` with the rate ``UNLIMITED``). Its dispatches are still counted.
- R29 ``enforced_rate``: a shadow entry is enforced as ``UNLIMITED``; ``shadow_rate`` is
  the rate its would-be throttles are counted at (by a second limiter, which decides
  nothing). So the schedule with a shadow plan is the schedule with that plan unlimited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

UNLIMITED = None  # R28: the rate of an unlimited user (no TAT, never refused, nothing to refund)


@dataclass(frozen=True)
class TableEntry:
    """One entry: ``rate`` tokens/s (``UNLIMITED``: None) and ``shadow`` (R29)."""

    rate: Fraction | None
    shadow: bool = False

    def __post_init__(self) -> None:
        assert self.rate is None or self.rate > 0, f"a rate is > 0 tokens/s, got {self.rate!r}"
        assert not (self.shadow and self.rate is None), "an unlimited entry has nothing to shadow"


def resolve(
    exact: Mapping[str, TableEntry], prefixes: Mapping[str, TableEntry], default: TableEntry, user: str
) -> TableEntry:
    """R27: the entry of ``user``: ``exact[user]``, else ``prefixes[p]`` for the longest
    prefix ``p`` of ``user`` among the patterns, else ``default``."""
    if user in exact:
        return exact[user]
    matches = [p for p in prefixes if user.startswith(p)]
    return prefixes[max(matches, key=len)] if matches else default


def enforced_rate(entry: TableEntry) -> Fraction | None:
    """R28/R29: the rate the enforcing limiter applies: ``UNLIMITED`` for a shadow entry."""
    return UNLIMITED if entry.shadow else entry.rate


def shadow_rate(entry: TableEntry) -> Fraction | None:
    """R29: the rate a shadow entry's would-be throttles are counted at (None: not shadow)."""
    return entry.rate if entry.shadow else None
