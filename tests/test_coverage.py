"""Issue 18 item 2: coverage obligations (``adapter/coverage.py``).

A gate run sums, over its candidate checks, how many scenario runs reached each rule
branch (R6-R18) and each boundary of ``adapter/boundaries.py``; the ``coverage`` row fails
with ``not reached: <name>`` when one applicable obligation was reached fewer than k times
(k per profile). The reference reaches every obligation at the quick budget; a boundary
budget too small to reach the boundaries fails the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from vllm_output_rate.adapter import boundaries, boundary_catalog, coverage, gate_row, registry
from vllm_output_rate.adapter.budgets import GATE_BUDGETS, PROFILES, gate_budget
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.adapter.scenario_run import run_scenario


def _noop() -> None:
    pass


def _run_gate(options, names=None):
    """The planned candidate checks of ``options`` (only ``names`` if given), run in order
    as ``outrate conform`` runs them; returns the results."""
    results = []
    for item in registry.plan(options):
        if item.row.part != "candidate" or (names is not None and item.row.name not in names):
            continue
        results.append(gate_row.run_planned(item, options, _noop))
    return results


@pytest.mark.rules("R6", "R18")
def test_obligations_cover_every_rule_r6_to_r18_and_every_boundary():
    rules = {r for _, rules, _ in coverage.obligations() for r in rules.split()}
    assert {f"R{i}" for i in range(6, 19)} <= rules
    names = [name for name, _, _ in coverage.obligations()]
    assert [n for n in names if n.startswith("boundary: ")] == [
        f"boundary: {b}" for b in boundary_catalog.BOUNDARY_NAMES
    ]
    assert {p: gate_budget(p).coverage_k for p in PROFILES} == {"quick": 1, "ci": 3, "release": 10}


def test_obligation_counts_once_per_scenario_and_only_inside_a_collector():
    scenario = boundaries._solved("all-refused", "2", False, 0)
    run_scenario(REFERENCE_SCHEDULER, scenario, "must")  # no collector: nothing is kept
    with coverage.collecting() as outer:
        with coverage.collecting() as inner:
            run_scenario(REFERENCE_SCHEDULER, scenario, "must")
        run_scenario(REFERENCE_SCHEDULER, scenario, "must")
    assert inner["boundary: all-refused"] == 1  # several refused steps, one scenario
    assert outer["boundary: all-refused"] == 2
    assert inner["R17 anonymous bucket"] == 1 and inner["R17 odd ids kept exactly"] == 1


def test_async_obligations_not_applicable_without_an_async_class():
    rows = {r["obligation"]: r for r in coverage.table(Counter(), 1, async_tested=False)}
    assert rows["R8 dispatched after its final token (async)"]["status"] == "not applicable"
    assert rows["boundary: burst-edge"]["status"] == "NOT REACHED"


def test_reference_reaches_every_obligation_at_the_quick_budget():
    options = gate_row.GateOptions(
        REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, level="must", profile="quick", spec_health=False
    )
    results = _run_gate(options)
    assert [r.result for r in results] == ["pass"] * len(results), [(r.name, r.failure) for r in results]
    row = results[-1]
    assert row.name == "coverage" and row.coverage["k"] == 1
    assert all(r["status"] == "ok" for r in row.coverage["rows"]), [
        r for r in row.coverage["rows"] if r["status"] != "ok"
    ]


ARTICLE = "article_style.scheduler.Article"  # the independent implementation (issue 13)


@pytest.mark.rules("R10", "R12")
@pytest.mark.parametrize(
    ("prefix", "style", "integer_rates", "seed"),
    [
        ("vllm_output_rate.reference.scheduler.RateLimited", None, False, 0),
        (ARTICLE, "engine-args", True, 0),
        (ARTICLE, "engine-args", True, 1),
    ],
    ids=["reference", "article-style-seed-0", "article-style-seed-1"],
)
def test_boundary_scenarios_alone_reach_every_obligation(prefix, style, integer_rates, seed, article_flags):
    """Coverage must not hang on what the random scenarios happen to draw: a correct
    candidate at the quick budget (k 1) would otherwise fail ``coverage`` on some seeds. The
    boundary scenarios alone, at one per boundary and mode, reach every obligation but R18's
    two (reached by the feature-off rows)."""
    from vllm_output_rate.adapter.configstyle import parse_config_style

    config_style = None if style is None else parse_config_style(style)
    with coverage.collecting() as reached:
        for async_mode in (False, True):
            cls = prefix + ("AsyncScheduler" if async_mode else "Scheduler")
            for name, scenario in boundaries.boundary_scenarios(async_mode, integer_rates, seed):
                verdict = run_scenario(cls, scenario, "must", config_style)
                assert verdict.failure is None, (name, verdict.failure)
    names = [name for name, _, _ in coverage.obligations() if not name.startswith("R18 feature off")]
    assert [name for name in names if reached[name] == 0] == []


def test_boundary_budget_too_small_fails_the_run_with_not_reached(monkeypatch):
    # No boundary scenario at all (budget 0 per boundary): the random scenarios of the
    # other checks never put a TAT at now + 1 ns on the 256th schedule() nor a refund after
    # a self-preemption, so the run must say those were not checked, and fail.
    monkeypatch.setitem(GATE_BUDGETS, "quick", replace(GATE_BUDGETS["quick"], per_boundary=0))
    options = gate_row.GateOptions(
        REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, level="must", profile="quick", spec_health=False
    )
    results = _run_gate(options, names={"rate-limit/sync", "boundaries/sync", "boundaries/async", "coverage"})
    row = results[-1]
    assert row.name == "coverage" and row.result == "fail" and row.part == "candidate"
    assert row.failure.startswith("[must] coverage: not reached: ")
    for name in ("boundary: cleanup-tat-now+1ns", "boundary: charged-then-preempted", "boundary: rotation-wrap"):
        assert name in row.failure
    assert "boundary: cleanup-tat-now+1ns (0/1)" in row.coverage["not_reached"]
    assert row.counterexample == []  # obligations, not a scenario: no counterexample
    assert gate_row.exit_code(results) == 1


def test_k_per_profile_applies(monkeypatch):
    # The same single boundary run counts 1: enough for quick (k 1), not for ci (k 3).
    counts = Counter({name: 1 for name, _, _ in coverage.obligations()})
    quick = coverage.check_coverage(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y", profile="quick"), counts)
    ci = coverage.check_coverage(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y", profile="ci"), counts)
    assert quick.result == "pass" and ci.result == "fail" and "(each needs >= 3" in ci.failure


@pytest.mark.slow
def test_cli_conform_lists_boundary_scenarios_and_prints_the_coverage_table(tmp_path):
    report = tmp_path / "conform.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_output_rate.cli",
            "conform",
            "--level",
            "must",
            "--profile",
            "quick",
            "--no-spec-health",
            "--json",
            str(report),
            "--counterexamples",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, COLUMNS="200"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "boundaries/sync scenarios: burst-edge@" in run.stdout
    assert "coverage obligations (k = 1 per run, profile quick)" in run.stdout
    data = json.loads(report.read_text())
    rows = {c["name"]: c for c in data["checks"]}
    assert [s.split("@")[0] for s in rows["boundaries/async"]["scenarios"]] == list(boundary_catalog.BOUNDARY_NAMES)
    assert rows["coverage"]["coverage"]["k"] == 1
    assert {r["status"] for r in rows["coverage"]["coverage"]["rows"]} == {"ok"}


def test_coverage_is_not_judged_after_another_check_failed_and_never_prints_a_counterexample():
    # A failing check stops at its counterexample, so the run reaches fewer obligations:
    # coverage is then "not judged: run stopped by <check>", not a second failure. Judged,
    # its failure lists the unreached obligations, never a counterexample.
    from vllm_output_rate.adapter.gate_result import CheckResult

    options = gate_row.GateOptions(REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, profile="quick")
    coverage.record_check(
        options,
        "rate-limit/sync",
        CheckResult("rate-limit/sync", ["R2"], result="fail", failure="[must] R2: over", counterexample=["e"]),
        Counter(),
    )
    row = coverage.check_coverage(options)
    assert row.result == "not judged" and row.failure.startswith("not judged: run stopped by rate-limit/sync")
    assert {r["status"] for r in row.coverage["rows"]} == {"not judged"}  # nothing reached, nothing judged
    assert gate_row.exit_code([row]) == 0 and row.counterexample == []
    judged = coverage.check_coverage(
        gate_row.GateOptions(REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, profile="quick")
    )
    assert judged.result == "fail" and judged.counterexample == []
    failed = CheckResult(
        "rate-limit/sync", ["R2"], result="fail", failure="[must] R2: over", counterexample=["0 add r0"]
    )
    after_failure, alone = _printed([failed, row]), _printed([judged])
    assert after_failure.count("counterexample (") == 1  # the rate-limit row's only
    assert "coverage NOT JUDGED (candidate): not judged: run stopped by rate-limit/sync" in " ".join(
        after_failure.split()
    )
    assert "counterexample" not in alone and "not reached: boundary: burst-edge (0/1)" in alone


def _printed(results) -> str:
    from vllm_output_rate import cli_common, cli_conform_report

    with cli_common.console.capture() as captured:
        cli_conform_report._print_failures(results)
    return captured.get()
