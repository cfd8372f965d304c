"""One row of the gate's table and of its JSON report: ``CheckResult``, with its JSON keys
in report order (``CHECK_RESULT_JSON_KEYS``, ``fields_as_json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """One row of the gate's table (and of the JSON report).

    ``result``: "pass", "fail", "warning" (a project rule failed at level should,
    ``adapter/origins.py``: printed, never fatal), "not applicable" (the row needs an engine
    mode the candidate refused at start-up, ``adapter/modes.py``), or "not tested" (the row
    could not run; ``failure`` says why). ``part``: "candidate" (runs the class under test) or "spec health" (the spec
    against itself or against stock vLLM; never the candidate's verdict). ``level``: the
    lowest conformance level at which the row runs; ``failed_level``: the level of the
    property that failed. ``scenarios``: the scenarios a row ran, by name (the boundaries
    row); ``coverage``: the coverage table (the coverage row); both go to the JSON report
    only when set.
    """

    name: str
    rules: list[str]
    examples: int = 0
    steps: int = 0
    result: str = "pass"
    seconds: float = 0.0
    counterexample: list[str] = field(default_factory=list)
    failure: str | None = None
    saved: str | None = None
    part: str = "candidate"
    level: str = "must"
    failed_level: str | None = None
    minimal: bool = True  # the counterexample is 1-minimal
    scenarios: list[str] = field(default_factory=list)
    coverage: dict[str, Any] | None = None
    origin: str | None = None  # of the failure (adapter/origins.py); a project rule is a warning at should
    modes: list[dict[str, Any]] | None = None  # the ``modes`` row: the candidate's mode matrix (adapter/modes.py)

    def as_json(self) -> dict:
        """The row as a JSON-ready dict, keys in ``CHECK_RESULT_JSON_KEYS`` order
        (``scenarios`` and ``coverage`` are added by the report when set)."""
        return fields_as_json(self, CHECK_RESULT_JSON_KEYS, rounded={"seconds": 3})


CHECK_RESULT_JSON_KEYS = (
    "name",
    "part",
    "level",
    "failed_level",
    "origin",
    "minimal",
    "rules",
    "examples",
    "steps",
    "result",
    "seconds",
    "failure",
    "counterexample",
    "saved",
)


def fields_as_json(record: Any, keys: tuple[str, ...], rounded: dict[str, int] | None = None) -> dict[str, Any]:
    """``{key: record.key}`` for ``keys``, in that order (a JSON report's key order); a
    key in ``rounded`` has its value rounded to that many decimal digits (seconds)."""
    rounded = rounded or {}
    return {key: round(getattr(record, key), rounded[key]) if key in rounded else getattr(record, key) for key in keys}
