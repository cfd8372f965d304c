"""Conformance levels: which properties a gate run judges (docs/SPEC.md, "Conformance levels").

- ``must``: the article's promises and the bound, judged from what vLLM exposes: every
  sampling dispatch granted by the GCRA at its instant (R2, R7, R8), the window bound,
  every request completes exactly (R11/P3), no under-grant where the article leaves no
  choice (P4), the feature off is the base scheduler step for step (R18).
- ``should``: the article's design rules, black-box, every open choice accepted (R10-R14,
  R16).
- ``exact``: step identity with this project's spec, white-box (our decisions included).

Each level includes the ones before it.
"""

from __future__ import annotations

LEVELS = ("must", "should", "exact")


def check_level(level: str) -> str:
    """``level`` unchanged if it is one of ``LEVELS``.

    Raises:
        ValueError: naming the bad value and the valid ones.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown conformance level {level!r}: use one of {', '.join(LEVELS)}")
    return level


def includes(chosen: str, level: str) -> bool:
    """True if a run at level ``chosen`` judges properties of level ``level``."""
    return LEVELS.index(check_level(level)) <= LEVELS.index(check_level(chosen))
