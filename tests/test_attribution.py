"""Issue 18: a black-box kill names the rule the candidate broke (``adapter/attribution.py``),
prefix caching in the rate-limit scenarios, and the under-grant judged under pressure.

A failure of the dispatch replay (over-grant, window bound, under-grant) is named by the
one-rule change of the spec limiter that explains the candidate's whole recorded run and
its probes; the unchanged spec limiter never explains a failing history, and a history
the spec explains is not attributed at all.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from vllm_output_rate.adapter import attribution, boundaries
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER
from vllm_output_rate.adapter.rule_naming import named_verdict
from vllm_output_rate.adapter.scenario_run import build_harness, run_scenario
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario

MUTANTS = "vllm_output_rate.adapter.mutants"
MS = 1_000_000


def _ctx(rate: str = "10", burst_ns: int = 100 * MS) -> attribution.Context:
    return attribution.Context({"r0": "u", "r1": "u"}, {}, Fraction(rate), burst_ns)


def _dispatch(rid: str, first: bool = False) -> attribution.Dispatch:
    return attribution.Dispatch(rid, first_token=first, in_flight=False, admitted=first)


@pytest.mark.rules("R2")
def test_r2_a_history_the_spec_limiter_grants_is_not_attributed():
    # 10 tok/s, tau 100 ms: two grants at t = 0, then one per 100 ms: the spec's own pacing.
    history = [attribution.StepRecord(1, 0, [_dispatch("r0", True), _dispatch("r1", True)])]
    history += [attribution.StepRecord(k + 1, k * 100 * MS, [_dispatch("r0")]) for k in range(1, 5)]
    assert attribution.explains(attribution.SPEC, [(_ctx(), history)])
    assert attribution.attribute([(_ctx(), history)]) is None


@pytest.mark.rules("R1", "R2")
def test_r1_a_burst_of_one_second_is_named_r1_not_the_edge_slips():
    # Eleven grants in the first 11 ns (tau = 1 s at 10 tok/s), then a pause.
    history = [attribution.StepRecord(1, 0, [_dispatch("r0", True)])]
    history += [attribution.StepRecord(k + 1, k, [_dispatch("r0")]) for k in range(1, 11)]
    history += [attribution.StepRecord(12, 11, [], pauses=["r0"])]
    ctx = _ctx()
    hyp, others = attribution.attribute([(ctx, history)])
    assert hyp.rule == "R1" and "burst tolerance of 1 s" in hyp.slip
    assert not attribution.explains(attribution.SPEC, [(ctx, history)])
    assert all(h.rule != "R2" or "tau + 1 ns" not in h.slip for h in others)  # 1 ns cannot explain 0.9 s


@pytest.mark.rules("R6")
def test_r6_a_grant_right_after_a_cleanup_that_deleted_a_user_ahead_of_now_is_named_r6():
    # A user 50 ms ahead of the clock at the 256th schedule() (TAT 200 ms, now 150 ms) is
    # granted a fresh burst of two right after the cleanup; the spec keeps it and grants one.
    ctx = _ctx()
    history = [attribution.StepRecord(1, 0, [_dispatch("r0", True), _dispatch("r1", True)])]
    history += [attribution.StepRecord(k, 0, []) for k in range(2, 256)]
    history += [attribution.StepRecord(256, 150 * MS, [])]  # the cleanup
    history += [attribution.StepRecord(257, 150 * MS, [_dispatch("r0"), _dispatch("r1")])]
    assert not attribution.explains(attribution.SPEC, [(ctx, history)])
    hyp, _ = attribution.attribute([(ctx, history)])
    assert (hyp.rule, "ahead of now within tau" in hyp.slip) == ("R6", True)


def _boundary(name: str, rate: str) -> Scenario:
    scenario = boundaries._solved(name, rate, False, 0)
    assert scenario is not None, f"no model for {name} at {rate} tok/s"
    return scenario


@pytest.mark.rules("R6")
def test_r6_cleanup_slip_of_the_catalogue_is_named_r6_black_box():
    # Before: the kill named R2 (the over-grant property), not the rule broken.
    scenario = _boundary("cleanup-tat-now+1ns", "5")
    assert run_scenario(f"{MUTANTS}.CleanupActiveUsers", scenario, "should").rule == "R2"
    verdict = named_verdict(f"{MUTANTS}.CleanupActiveUsers", scenario, "should")
    assert verdict.rule == "R6" and verdict.failure.startswith("R6 broken: "), verdict
    assert "Seen first: " in verdict.failure and "over the user's rate" in verdict.failure
    assert named_verdict(REFERENCE_SCHEDULER, scenario, "should").failure is None


@pytest.mark.rules("R9")
def test_r9_double_refund_of_the_catalogue_is_named_r9_black_box():
    scenario = _boundary("charged-then-preempted", "1")
    assert run_scenario(f"{MUTANTS}.DoubleRefund", scenario, "should").rule == "R2"
    verdict = named_verdict(f"{MUTANTS}.DoubleRefund", scenario, "should")
    assert verdict.rule == "R9" and "refunds an undispatched charge twice" in verdict.failure, verdict


@pytest.mark.rules("R11", "R9")
def test_r11_under_grant_is_judged_under_pressure_where_the_article_fixes_the_outcome():
    # The boundary without its "ample from step" promise: KV pressure all along. A charge
    # kept after a preemption (no R9 refund) pauses B in a step that left budget, preempted
    # nothing and filled no active cap: the article serves B there, so it is an under-grant.
    scenario = replace(_boundary("charged-then-preempted", "5"), ample_from_step=None)
    assert not scenario.ample and not scenario.ample_at(10_000)
    verdict = run_scenario(f"{MUTANTS}.NoRefund", scenario, "must")
    assert (verdict.rule, verdict.level) == ("R11", "must") and "under pressure" in verdict.failure, verdict
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "should").failure is None


def _cached_prompts(prefix_caching: bool) -> Scenario:
    # Two requests with the same prompt: with prefix caching the second is admitted with its
    # prompt's full blocks already computed.
    requests = (RequestSpec("u0-r0", "u0", 40, 6), RequestSpec("u1-r0", "u1", 40, 6, at_step=3))
    return Scenario({"u0": "20"}, requests, 10 * MS, 12, prefix_caching=prefix_caching)


@pytest.mark.rules("R7", "R11")
def test_r7_prefix_caching_on_reaches_a_cached_prompt_and_the_reference_passes():
    scenario = _cached_prompts(True)
    assert "prefix_caching=True" in scenario.events()[0]
    harness = build_harness(REFERENCE_SCHEDULER, scenario)
    assert harness.scheduler.kv_cache_manager.enable_caching
    harness.add_request("u0-r0", "u0", 40, 6)
    while "u0-r0" not in harness.finished:
        harness.step()
        harness.advance(10 * MS)
    harness.add_request("u1-r0", "u1", 40, 6)
    trace = harness.step()
    assert trace.scheduled["u1-r0"] < 40  # the cached blocks were not recomputed
    for cls in (REFERENCE_SCHEDULER, "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"):
        assert run_scenario(cls, replace(scenario, async_scheduling="Async" in cls), "exact").failure is None


def test_prefix_caching_defaults_off_for_old_counterexamples_and_survives_json():
    import json

    scenario = _cached_prompts(True)
    assert Scenario.from_json(scenario.to_json()) == scenario
    data = json.loads(scenario.to_json())
    del data["prefix_caching"]  # saved before the field existed
    assert Scenario.from_json(json.dumps(data)).prefix_caching is False
    assert build_harness(REFERENCE_SCHEDULER, _cached_prompts(False)).scheduler.kv_cache_manager.enable_caching is False


def test_step_identity_checks_never_turn_prefix_caching_on():
    # The step spec models no prefix cache: base fidelity and white box build their engine
    # with it off whatever the scenario.
    from hypothesis import HealthCheck, given, settings

    from vllm_output_rate.adapter import fidelity, whitebox

    @settings(max_examples=10, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(scenario=whitebox.white_box_scenarios(False, 15))
    def shapes(scenario):
        assert fidelity.engine_shape(scenario.config).enable_prefix_caching is False

    shapes()


@pytest.mark.rules("R12")
@pytest.mark.parametrize("num_blocks", [None, 4096], ids=["ample", "pressured-check"])
def test_r12_a_pause_explained_only_by_throttled_requests_holding_active_seats_names_r12(article_flags, num_blocks):
    # Active cap 1: u0's request is throttled (1 tok/s, its second token refused), u1's is
    # granted (1000 tok/s) and was paused with nothing scheduled: only a cap that counts the
    # throttled u0-r0 is full. The article-style base serves u1-r0.
    from vllm_output_rate.adapter.configstyle import parse_config_style

    style = parse_config_style("engine-args")  # article_flags: the article's flags on EngineArgs
    scenario = Scenario(
        {"u0": "1", "u1": "1000"},
        (RequestSpec("u0-r0", "u0", 4, 4), RequestSpec("u1-r0", "u1", 4, 8, at_step=1)),
        10 * MS,
        20,
        max_num_active_seqs=1,
        num_blocks=num_blocks,
    )
    # num_blocks set: not ``ample``, so the under-grant is judged by the check under pressure.
    assert scenario.ample == (num_blocks is None)
    verdict = run_scenario("article_mutants.ArticleThrottledTakeActiveSeats", scenario, "should", style)
    assert (verdict.rule, verdict.level) == ("R12", "must"), verdict
    assert verdict.failure.startswith("R12 broken: ") and "['u0-r0']" in verdict.failure
    assert run_scenario("article_style.scheduler.ArticleScheduler", scenario, "should", style).failure is None
