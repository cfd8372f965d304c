"""Coverage obligations (issue 18 item 2): a rule or boundary a run never reached was not checked.

The scenario judge (``adapter/judge._Judge.after_step``) calls
``adapter/coverage_observe.observe`` once per step, before it replays the step's sampling dispatches on the spec limiter. ``observe``
decides, black-box, from the spec-limiter replay state and what vLLM exposes
(``StepTrace``: scheduled tokens, sampling dispatches, preemptions, admissions, finishes),
which obligations the step reached: every branch of the spec's rate layer (R6-R18) and
every boundary of ``adapter/boundaries.py``. Each obligation counts at most once per
scenario run.

Counts go to every active collector (``collecting()``). A gate run
(``adapter/gate_row.run_planned``) collects over all of its candidate checks
(``run_counts(options)``); its final ``coverage`` row fails with
``not reached: <name>, ...`` when an obligation that applies to the run was reached fewer
than ``coverage_k`` times (``adapter/budgets.py``, per profile), and carries the table (``table``). A failure has no
counterexample (it names obligations, not a scenario). When another candidate check of the
run failed, coverage is not judged (result ``not judged``: "run stopped by <check>"): a
failing check stops at its counterexample, so its scenarios reach fewer obligations.

The obligations are proxies built from the outside: e.g. "charged then preempted" is a
preemption of a decoding request whose user the spec still granted, while every other
resident request was scheduled in that step (so vLLM's loop reached it, charged it, then
preempted it). They never read the candidate's own observation.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

from vllm_output_rate.adapter.boundary_catalog import BOUNDARIES, BOUNDARY_NAMES
from vllm_output_rate.adapter.budgets import gate_budget
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.modes import obligation_refused

MAX_RUNS_KEPT = 16  # gate runs whose counts are kept (``run_counts``)
NOT_JUDGED = "not judged"  # the coverage row's result when another candidate check failed

# (name, rule(s), applies to: "any" | "async")
RULE_OBLIGATIONS: tuple[tuple[str, str, str], ...] = (
    ("R6 cleanup deletes an idle user", "R6", "any"),
    ("R7 decode dispatch charged", "R7", "any"),
    ("R7 final prefill chunk charged", "R7", "any"),
    ("R7 prompt chunk not charged", "R7", "any"),
    ("R8 dispatched after its final token (async)", "R8", "async"),
    ("R9 charge refunded at the end of the step", "R9", "any"),
    ("R10 refused prefill advanced to n-1", "R10", "any"),
    ("R10 refused waiting request ahead of another waiting request", "R10", "any"),
    ("R10 no chunked prefill: a refused prompt waits whole", "R10", "any"),
    ("R11 throttled request kept resident", "R11", "any"),
    ("R12 active cap binds", "R12", "any"),
    ("R13 throttled request preempted", "R13", "any"),
    ("R14 a user's streams take turns", "R14 R15", "any"),
    ("R16 every user refused while requests wait", "R16", "any"),
    ("R17 anonymous bucket", "R17", "any"),
    ("R17 odd ids kept exactly", "R17", "any"),
    ("R18 feature off", "R18", "any"),
    # Issue 26: the gate's black-box blind spots.
    ("R18 feature off: two streams of one user, a long prompt, a binding token budget", "R18", "any"),
    ("P4 other users served in an FCFS step that preempted", "R11 R13", "any"),
    ("R17 n > 1 children share one SamplingParams", "R17", "any"),
)
FEATURE_OFF_ORDER = RULE_OBLIGATIONS[-3][0]
ODD_ID = re.compile(r"^[a-z0-9-]{1,64}$")


def boundary_names() -> tuple[str, ...]:
    return BOUNDARY_NAMES


def obligations() -> list[tuple[str, str, str]]:
    """Every obligation: the rule branches, then the boundaries (``boundary: <name>``)."""
    return list(RULE_OBLIGATIONS) + [(f"boundary: {b.name}", " ".join(b.rules), "any") for b in BOUNDARIES]


# -- collectors -------------------------------------------------------------------------------
_ACTIVE: list[Counter] = []
_RUNS: dict[int, tuple[Any, Counter, list[str]]] = {}  # id(options) -> (options, counts, failed checks)


@contextlib.contextmanager
def collecting() -> Iterator[Counter]:
    """Count the obligations reached by every scenario run inside the block."""
    counts: Counter = Counter()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:  # by identity: two collectors with equal counts are still two
        del _ACTIVE[next(i for i, c in enumerate(_ACTIVE) if c is counts)]


def collecting_now() -> bool:
    """True while a collector is active (``collecting``): otherwise nothing need be observed."""
    return bool(_ACTIVE)


def _run(options) -> tuple[Any, Counter, list[str]]:
    entry = _RUNS.get(id(options))
    if entry is None or entry[0] is not options:
        while len(_RUNS) >= MAX_RUNS_KEPT:  # one process may run many gates (tests)
            del _RUNS[next(iter(_RUNS))]
        entry = _RUNS[id(options)] = (options, Counter(), [])
    return entry


def run_counts(options) -> Counter:
    """The counts of one gate run (keyed by its ``GateOptions`` object)."""
    return _run(options)[1]


def stopped_by(options) -> list[str]:
    """The candidate checks of one gate run that failed so far, in running order."""
    return _run(options)[2]


def record_check(options, check: str, result, reached: Counter) -> None:
    """Add one candidate check's counts to its gate run (and its name to the run's failed
    checks if it failed); a feature-off row's scenarios (``adapter/feature_off.py``, no
    judge) count for R18."""
    _, counts, failed = _run(options)
    counts.update(reached)
    if result.result == "fail":
        failed.append(check)
    if check.startswith("feature-off/"):
        counts["R18 feature off"] += result.examples


def order_sensitive(scenario) -> bool:
    """R18's shapes where order matters (``adapter/feature_off.py``): chunked prefill with a
    token budget that a prompt exceeds (a binding budget, a long prompt) and two or more
    streams of one user."""
    budget = scenario.max_num_batched_tokens
    users = [r.user for r in scenario.requests]
    return (
        scenario.chunked_prefill
        and budget is not None
        and any(r.prompt_len > budget for r in scenario.requests)
        and any(users.count(u) >= 2 for u in users)
    )


def note_feature_off(scenario) -> None:
    """A feature-off comparison ran ``scenario`` (no judge): its order-sensitive shape, if it
    is one, counts once (``order_sensitive``)."""
    if order_sensitive(scenario):
        for counts in _ACTIVE:
            counts[FEATURE_OFF_ORDER] += 1


def note(judge, name: str) -> None:
    """Obligation ``name`` was reached by ``judge``'s scenario (once per scenario)."""
    seen = judge.__dict__.setdefault("_coverage_seen", set())
    if name in seen:
        return
    seen.add(name)
    for counts in _ACTIVE:
        counts[name] += 1


# -- the gate's coverage row ---------------------------------------------------------------------
def table(counts: Counter, k: int, async_tested: bool) -> list[dict]:
    """One row per obligation: name, rules, count, k, status (``ok``, ``NOT REACHED``, or
    ``not applicable`` for an async obligation of a run without an async class, or one
    that needs an engine mode the candidate refused (``adapter/modes.OBLIGATION_MODES``);
    ``check_coverage`` turns ``NOT REACHED`` into ``not judged`` in a run another check
    stopped)."""
    rows = []
    for name, rules, applies in obligations():
        count = counts.get(name, 0)
        status = "not applicable" if applies == "async" and not async_tested else "ok" if count >= k else "NOT REACHED"
        if status == "NOT REACHED" and obligation_refused(name):  # a mode refused at start-up (adapter/modes.py)
            status = "not applicable"
        rows.append({"obligation": name, "rules": rules, "count": count, "k": k, "status": status})
    return rows


def check_coverage(options, counts: Counter | None = None):
    """The ``coverage`` row of a gate run: pass iff every applicable obligation was reached
    at least ``gate_budget(options.profile).coverage_k`` times by the run's candidate checks; not
    judged (``NOT_JUDGED``, "run stopped by <check>") when one of them failed. A failure
    carries no counterexample: the unreached obligations are in ``coverage["not_reached"]``."""
    counts = run_counts(options) if counts is None else counts
    k = gate_budget(options.profile).coverage_k
    rows = table(counts, k, options.async_scheduler_cls is not None)
    result = CheckResult(
        "coverage", sorted({r for _, rules, _ in obligations() for r in rules.split()}), examples=len(rows)
    )
    result.coverage = {"k": k, "profile": options.profile, "rows": rows}
    missing = [r for r in rows if r["status"] == "NOT REACHED"]
    result.coverage["not_reached"] = [f"{r['obligation']} ({r['count']}/{k})" for r in missing]
    stopped = stopped_by(options)
    if stopped:
        result.result = NOT_JUDGED
        for row in missing:
            row["status"] = NOT_JUDGED
        result.failure = (
            f"not judged: run stopped by {', '.join(stopped)} (a failing check stops at its "
            "counterexample, so its scenarios reach fewer obligations: fix it first)"
        )
    elif missing:
        result.result = "fail"
        result.failed_level = "must"
        result.failure = (
            f"[must] coverage: not reached: {', '.join(r['obligation'] for r in missing)} (each needs "
            f">= {k} scenario runs in profile {options.profile}; a rule or boundary never reached was "
            "not checked)"
        )
    return result
