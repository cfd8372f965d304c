"""Where each rule of the gate comes from, and what a level does with its failure
(docs/SPEC.md, "Conformance levels", the origin column).

| origin | examples | must | should | exact |
|---|---|---|---|---|
| ``PROMISE``: an article promise | P1-P5, the window bound, identity (R17), feature off = base (R18) | fatal | fatal | fatal |
| ``ARTICLE_RULE``: an article rule | R10-R16 as the article states them | - | fatal | fatal |
| ``PROJECT_RULE``: this project's rule | R19, R20, R21, shadow | - | warning | fatal |
| ``PROJECT_DECISION``: this project's decision on a choice the article leaves open | step identity with the spec (white box) | - | accepted | fatal |

A failure at level ``must`` (a crash, a cut request, an over-grant) breaks an article
promise in any row. Otherwise its origin is the project's if its rule is one of
``PROJECT_RULES`` or its row judges a project rule (``not-binding/*``,
``fair-residency/*``, ``rate-change/*``, ``shadow/*``, and ``lora-slots/*``'s bound, docs/SPEC.md
Decision "LoRA slots"); otherwise it follows the level of the property that failed:
``should`` an article rule, ``exact`` a project decision.
"""

from __future__ import annotations

import re

PROMISE = "article promise"
ARTICLE_RULE = "article rule"
PROJECT_RULE = "project rule"
PROJECT_DECISION = "project decision"
ORIGINS = (PROMISE, ARTICLE_RULE, PROJECT_RULE, PROJECT_DECISION)
PROJECT_RULES = ("R19", "R20", "R21", "R27", "R28", "R29", "shadow")
BY_LEVEL = {"must": PROMISE, "should": ARTICLE_RULE, "exact": PROJECT_DECISION}
WARNING = "warning"  # a CheckResult.result: a project rule failed at level should
_TAGGED = re.compile(r"^\[(must|should|exact)\] ([^:\s]+)")  # "[should] R19: ..." (conform._record_failure)


def row_origin(rules: tuple[str, ...], level: str) -> str:
    """The origin of a row's properties from its ``rules`` and the lowest ``level`` it runs
    at: ``PROJECT_RULE`` if every rule is one of ``PROJECT_RULES`` (or the first is), else
    the level's (``BY_LEVEL``), with ``+ article rule`` for a must row (at should it judges
    the article's rules too)."""
    if rules and rules[0] in PROJECT_RULES:
        return PROJECT_RULE
    origin = BY_LEVEL[level]
    return f"{PROMISE} + {ARTICLE_RULE}" if level == "must" else origin


def failure_origin(row: str, failure: str | None, failed_level: str | None) -> str:
    """The origin of one failure: ``PROMISE`` if it failed at level must (``failed_level``,
    else the one in the text ``[level] RULE: ...``, else must: a crash); else
    ``PROJECT_RULE`` if the row's origin (``row_origin`` or declared) is, or the failure
    names a project rule; else the origin of the level that failed."""
    match = _TAGGED.match(failure or "")
    level = failed_level or (match.group(1) if match else "must")
    if level == "must":  # a crash, a cut request, an over-grant: a promise in any row
        return PROMISE
    if row == PROJECT_RULE or failed_rule(failure) in PROJECT_RULES:
        return PROJECT_RULE
    return BY_LEVEL.get(level, PROMISE)


def failed_rule(failure: str | None) -> str | None:
    """The rule a failure names (``[level] RULE: ...``), or None."""
    match = _TAGGED.match(failure or "")
    return match.group(2) if match else None


def judged(result, row: str, level: str, declared: bool = False) -> None:
    """Set ``result.origin`` (a ``gate_result.CheckResult`` of a row of origin ``row``) from its
    failure, and turn a failed project rule into a ``WARNING`` at ``level`` should (at exact
    it stays fatal). ``declared``: the candidate opted in to the rule (``--rate-change``):
    it stays fatal at every level."""
    if result.result != "fail":
        return
    result.origin = failure_origin(row, result.failure, result.failed_level)
    if result.origin == PROJECT_RULE and level != "exact" and not declared:
        result.result = WARNING
