"""The gate's budgets: how many scenarios each row of a gate run draws, one table per profile.

A *profile* (``outrate conform --profile quick|ci|release``, ``GateOptions.profile``) is
the size of a gate run; ``GATE_BUDGETS[profile]`` is its whole budget table, read by the
rows of ``adapter/registry.py`` (each row's ``budget``), by the coverage row (``coverage_k``)
and by the reports. Nothing else holds an example count of the gate. (Two other words stay
apart from it: a vLLM *version profile*, ``spec/versions.py``, is the base model of one
release; the *shared budget*, R23-R26, is one rate budget across engines.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GateBudget:
    """The examples of every gate row in one profile (counts of scenarios unless said).

    ``limiter``: random operation sequences of ``limiter-differential``; ``rate_limit_sync``
    / ``rate_limit_async``: ample scenarios of ``rate-limit/*`` (the stock-comparison rows
    ``feature-off``, ``not-binding``, ``shadow``, ``rate-tables`` draw a quarter, at least
    5); ``pressured``: scenarios of each ``invariants/*`` row; ``max_steps``: steps per
    scenario of those rows; ``base_sync`` / ``base_async`` / ``white_sync`` /
    ``white_async``: step scenarios of ``base-fidelity/*`` and ``white-box/*`` (up to
    ``STEP_SCENARIO_MAX_STEPS`` steps each); ``per_boundary``: scenarios per boundary and
    mode of ``boundaries/*``; ``lora_slots``, ``rate_change``, ``fair_residency``:
    scenarios of those rows; ``coverage_k``: scenario runs each coverage obligation needs.
    """

    limiter: int
    rate_limit_sync: int
    rate_limit_async: int
    pressured: int
    max_steps: int
    base_sync: int
    base_async: int
    white_sync: int
    white_async: int
    per_boundary: int
    lora_slots: int
    rate_change: int
    fair_residency: int
    coverage_k: int

    def as_json(self) -> dict[str, int]:
        """Every count by its field name (the reports print it)."""
        return asdict(self)


STEP_SCENARIO_MAX_STEPS = 40  # steps per scenario of base-fidelity/* and white-box/*

GATE_BUDGETS: dict[str, GateBudget] = {
    "quick": GateBudget(
        limiter=200,
        rate_limit_sync=25,
        rate_limit_async=15,
        pressured=20,
        max_steps=30,
        base_sync=30,
        base_async=20,
        white_sync=30,
        white_async=20,
        per_boundary=1,
        lora_slots=8,
        rate_change=8,
        fair_residency=10,
        coverage_k=1,
    ),
    "ci": GateBudget(
        limiter=1500,
        rate_limit_sync=120,
        rate_limit_async=60,
        pressured=120,
        max_steps=40,
        base_sync=300,
        base_async=200,
        white_sync=300,
        white_async=200,
        per_boundary=3,
        lora_slots=30,
        rate_change=30,
        fair_residency=40,
        coverage_k=3,
    ),
    "release": GateBudget(
        limiter=20000,
        rate_limit_sync=1500,
        rate_limit_async=800,
        pressured=1500,
        max_steps=80,
        base_sync=3000,
        base_async=2000,
        white_sync=3000,
        white_async=2000,
        per_boundary=10,
        lora_slots=200,
        rate_change=200,
        fair_residency=300,
        coverage_k=10,
    ),
}
PROFILES = tuple(GATE_BUDGETS)  # the profile names, smallest first


def gate_budget(profile: str) -> GateBudget:
    """The budget table of ``profile``.

    Raises:
        ValueError: ``profile`` is not one of ``PROFILES``, naming it and the valid ones.
    """
    if profile not in GATE_BUDGETS:
        raise ValueError(f"unknown gate profile {profile!r}: use one of {', '.join(PROFILES)}")
    return GATE_BUDGETS[profile]
