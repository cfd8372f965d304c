"""Issue 26 item 2: every rule names its origin; a project rule's failure is a warning at
should and fatal at exact (``adapter/origins.py``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vllm_output_rate.adapter import gate_row, origins, registry
from vllm_output_rate.adapter.budgets import GATE_BUDGETS
from vllm_output_rate.adapter.gate_errors import exception_text
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.gate_row import GateOptions, PlannedRow
from vllm_output_rate.cli_conform_report import _verdict_line

FIXTURES = Path(__file__).parent / "fixtures"


def failed(name: str, failure: str, level: str) -> CheckResult:
    return CheckResult(name, [], result="fail", failure=failure, failed_level=level)


def test_every_row_names_its_origin():
    by_name = {spec.name: spec.origin_of() for spec in registry.registry()}
    for project in ("not-binding/sync", "fair-residency/async", "rate-change/sync", "shadow/async"):
        assert by_name[project] == origins.PROJECT_RULE, project
    assert by_name["white-box/sync"] == origins.PROJECT_DECISION
    assert by_name["lora-slots/sync"] == origins.PROJECT_RULE  # the bound: docs/SPEC.md Decision "LoRA slots"
    assert by_name["engine-wait/sync"] == origins.ARTICLE_RULE
    assert by_name["rate-limit/sync"] == f"{origins.PROMISE} + {origins.ARTICLE_RULE}"
    assert all(origin for origin in by_name.values())


@pytest.mark.parametrize(
    ("row", "failure", "level", "origin"),
    [
        (origins.PROJECT_RULE, "[should] R19: step 4: a limit that does not bind changed the batch", "should", "rule"),
        (origins.ARTICLE_RULE, "[should] R14: step 9: a stream bypassed 5 times", "should", "article"),
        (origins.PROMISE, "[must] crash: ArticleScheduler raised AssertionError", "must", "promise"),
        (origins.PROJECT_DECISION, "[exact] scheduled: X != spec Y", "exact", "decision"),
    ],
)
def test_failure_origin_follows_the_rule_then_the_level(row, failure, level, origin):
    assert origin in origins.failure_origin(row, failure, level)


def test_a_project_rule_is_a_warning_at_should_and_fatal_at_exact():
    for level, expected in (("should", origins.WARNING), ("exact", "fail")):
        result = failed("not-binding/sync", "[should] R19: step 4: the batch changed", "should")
        origins.judged(result, origins.PROJECT_RULE, level)
        assert (result.result, result.origin) == (expected, origins.PROJECT_RULE)
    article = failed("rate-limit/sync", "[should] R14: step 9: bypassed", "should")
    origins.judged(article, "article promise + article rule", "should")
    assert article.result == "fail" and article.origin == origins.ARTICLE_RULE
    declared = failed("rate-change/sync", "[must] R21: the new rate was not applied", "must")
    origins.judged(declared, origins.PROJECT_RULE, "should", declared=True)  # --rate-change: the candidate's claim
    assert declared.result == "fail"


def test_a_crash_in_a_project_rules_row_stays_fatal_at_should():
    crash = failed(
        "lora-slots/sync", "[must] crash: ArticleScheduler raised AssertionError at x.py:1: assert a", "must"
    )
    origins.judged(crash, origins.PROJECT_RULE, "should")
    assert (crash.result, crash.origin) == ("fail", origins.PROMISE)
    bound = failed("lora-slots/sync", "[should] R13: step 9: R13 (LoRA): f0 of user 'fast' has not sampled", "should")
    origins.judged(bound, origins.PROJECT_RULE, "should")
    assert (bound.result, bound.origin) == (origins.WARNING, origins.PROJECT_RULE)


def test_a_bare_assert_is_named_by_the_line_that_raised_it(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    from types import SimpleNamespace

    from mode_candidates import AssertsOnLora  # a bare assert outside pytest's assertion rewriting

    with pytest.raises(AssertionError) as error:
        AssertsOnLora(vllm_config=SimpleNamespace(lora_config=object()))
    text = exception_text(error.value)
    assert text.startswith("AssertionError at ") and "mode_candidates.py:" in text, text
    assert text.endswith(': assert kwargs["vllm_config"].lora_config is None'), text
    assert exception_text(ValueError("no LoRA")) == "ValueError: no LoRA"


@pytest.mark.slow
@pytest.mark.rules("R11")
def test_r11_the_article_fixture_is_rejected_for_vllms_max_loras_assertion_not_the_lora_bound(article_flags):
    # The article-style fixture both starves another user's adapter (the LoRA bound, this
    # project's decision: a warning at should) and, on vLLM 0.32, admits a second adapter
    # beside a throttled holder, which trips vLLM's own max_loras assertion: the hunt goes on
    # past the bound to find the crash, and names the assertion.
    from vllm_output_rate.adapter.configstyle import parse_config_style
    from vllm_output_rate.adapter.lora_slots import check_lora
    from vllm_output_rate.adapter.scenarios import Hunt
    from vllm_output_rate.adapter.versions import installed_profile

    if installed_profile().loras_counted_over_all_running:
        pytest.skip("this vLLM counts every running request's adapter itself: no max_loras crash to find")
    result = check_lora("article_style.scheduler.ArticleScheduler", False, Hunt(22), parse_config_style("engine-args"))
    assert result.result == "fail" and result.failure.startswith("[must] crash: ArticleScheduler raised AssertionError")
    assert "assert len(scheduled_loras) <= self.lora_config.max_loras" in result.failure


def test_the_verdict_line_names_the_warnings_and_the_exit_code_stays_0():
    warned = failed("not-binding/sync", "[should] R19: step 4: the batch changed", "should")
    origins.judged(warned, origins.PROJECT_RULE, "should")
    ok = CheckResult("rate-limit/sync", ["R2"])
    line = _verdict_line([ok, warned], "should", [], 3.0)
    assert line.endswith("-- ACCEPTED with 1 warning(s): not-binding/sync (R19)"), line
    assert "2/2 candidate checks passed" in line
    assert gate_row.exit_code([ok, warned]) == 0
    crash = failed("lora-slots/sync", "[must] crash: ArticleScheduler raised AssertionError", "must")
    line = _verdict_line([ok, warned, crash], "should", [], 3.0)
    assert line.endswith("-- REJECTED: lora-slots/sync failed; 1 warning(s): not-binding/sync (R19)"), line


@pytest.mark.slow
@pytest.mark.rules("R19")
def test_r19_the_articles_rotation_is_a_warning_at_should_through_the_gate_row(monkeypatch):
    # The article-style fixture fails R19 by construction (its swap rotation): at should the
    # gate's own row reports it as a warning with its counterexample, at exact as a failure.
    monkeypatch.syspath_prepend(str(FIXTURES))
    spec = next(s for s in registry.registry() if s.name == "not-binding/sync")
    small = GateOptions(scheduler_cls="gate_candidates.SwapRotation", profile="quick", spec_health=False)
    quick = replace(GATE_BUDGETS["quick"], rate_limit_sync=24)  # a quarter: 6 scenarios, the stall shape among them
    monkeypatch.setitem(GATE_BUDGETS, "quick", quick)
    result = gate_row.run_planned(PlannedRow(spec), small, lambda: None)
    assert result.result == origins.WARNING, result.failure
    assert result.failure.startswith("[should] R19:") and result.counterexample
    assert result.origin == origins.PROJECT_RULE
    assert gate_row.exit_code([result]) == 0
