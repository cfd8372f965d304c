"""Issue 26 item 3: the gate's black-box blind spots (adapter/step_checks.py and the judge).

Fast tests call the property functions on hand-made steps (a stand-in judge holding what the
scenario judge records: the step start, the spec limiter's replay, ``running`` after the
step); the slow ones run a boundary scenario on the article-style fixture (correct: pass)
and on its mutant of that blind spot (killed, at the property's level).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from vllm_output_rate.adapter import step_checks
from vllm_output_rate.adapter.harness import StepTrace
from vllm_output_rate.adapter.judge_record import StepStart
from vllm_output_rate.adapter.scenario_run import parallel_children
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario
from vllm_output_rate.spec import limiter as spec_limiter


def _judge(requests, running_after=(), start=None, **shape):
    scenario = Scenario(
        rates_tokens_per_s={"u": "1"},
        default_rate_tokens_per_s="1000",
        requests=tuple(requests),
        step_interval_ns=1_000_000,
        num_steps=4,
        **shape,
    )
    by_id = {r.request_id: r for r in requests}
    running = [SimpleNamespace(request_id=rid) for rid in running_after]
    judge = SimpleNamespace(
        scenario=scenario,
        by_id=by_id,
        name="Cand",
        start=start,
        harness=SimpleNamespace(scheduler=SimpleNamespace(running=running)),
    )
    judge.user_of = lambda rid: by_id[rid].user or "__anonymous__"
    return judge


def _trace(scheduled, sampled=(), admitted=(), preempted=(), now=0):
    return StepTrace(0, now, dict(scheduled), list(sampled), list(preempted), admitted=list(admitted))


def _refused(user: str = "u", now: int = 0):
    """A replay state in which ``user`` (1 token/s) is refused at ``now``."""
    state, _ = spec_limiter.try_take(spec_limiter.EMPTY, user, 1, now, spec_limiter.BURST_NS)
    assert not spec_limiter.allows(state, user, now, spec_limiter.BURST_NS)
    return state


# -- R12: a batch holds at most A non-throttled requests ------------------------------------------
@pytest.mark.rules("R12")
def test_r12_batch_over_the_active_cap_fails_at_should_naming_the_waiting_loop():
    reqs = [RequestSpec(f"v-r{k}", "v", 4, 3) for k in range(3)]
    judge = _judge(reqs, max_num_active_seqs=2)
    failure = step_checks.batch_over_cap(judge, _trace({"v-r0": 4, "v-r1": 4, "v-r2": 4}, admitted=["v-r1", "v-r2"]))
    assert failure is not None and failure[:2] == ("R12", "should")
    assert "3 requests in one step's batch" in failure[2] and "len(running) - throttled < A" in failure[2]
    assert step_checks.batch_over_cap(judge, _trace({"v-r0": 4, "v-r1": 4}, admitted=["v-r1"])) is None


# -- R10: no split prompt without chunked prefill; a running refused prefill advances ----------------
@pytest.mark.rules("R10")
def test_r10_a_chunk_that_does_not_sample_without_chunked_prefill_is_a_split_prompt():
    reqs = [RequestSpec("u-r0", "u", 4, 2), RequestSpec("v-r0", "v", 4, 2)]
    judge = _judge(reqs, chunked_prefill=False)
    failure = step_checks.split_prompt(judge, _trace({"u-r0": 3, "v-r0": 4}, sampled=["v-r0"]))
    assert failure is not None and failure[:2] == ("R10", "should") and "u-r0" in failure[2]
    assert "chunked prefill is off" in failure[2]
    assert step_checks.split_prompt(judge, _trace({"v-r0": 4}, sampled=["v-r0"])) is None
    chunked = _judge(reqs, chunked_prefill=True)
    assert step_checks.split_prompt(chunked, _trace({"u-r0": 3}, sampled=[])) is None


def _prefill_start(running, decoding=()):
    return StepStart(list(running), set(decoding), set(running))


@pytest.mark.rules("R10")
def test_r10_a_running_refused_prefill_left_at_0_tokens_with_budget_left_fails_at_should():
    reqs = [RequestSpec("u-r0", "u", 4, 3), RequestSpec("u-r1", "u", 40, 2)]
    start = _prefill_start(["u-r0", "u-r1"], decoding=["u-r0"])
    judge = _judge(reqs, ["u-r0", "u-r1"], start, max_num_batched_tokens=16)
    state = _refused()
    failure = step_checks.running_prefill_held(judge, _trace({}), state)
    assert failure is not None and failure[:2] == ("R10", "should") and "running u-r1" in failure[2]
    # Advanced (scheduled short of sampling): fine; the budget spent: not judged; granted: not this check's.
    assert step_checks.running_prefill_held(judge, _trace({"u-r1": 11}), state) is None
    assert step_checks.running_prefill_held(judge, _trace({"x": 16}), state) is None
    assert step_checks.running_prefill_held(judge, _trace({}), spec_limiter.EMPTY) is None


@pytest.mark.rules("R10")
def test_r10_can_advance_tells_the_limits_stop_from_vllms_own():
    reqs = [RequestSpec("u-r0", "u", 4, 2), RequestSpec("u-r1", "u", 1, 2)]
    start = StepStart([], {"u-r1"}, {"u-r0", "u-r1"})
    assert step_checks.can_advance(_judge(reqs, start=start), "u-r0")
    assert not step_checks.can_advance(_judge(reqs, start=start), "u-r1")  # only its sampling position
    assert not step_checks.can_advance(_judge(reqs, start=start, chunked_prefill=False), "u-r0")
    assert not step_checks.can_advance(_judge(reqs, start=start, prefix_caching=True), "u-r0")


# -- R13: throttled victims within the PRIORITY level ------------------------------------------------
@pytest.mark.rules("R13")
def test_r13_priority_victim_granted_while_a_throttled_request_of_its_level_kept_kv_fails():
    reqs = [RequestSpec("u-r0", "u", 4, 2), RequestSpec("v-r0", "v", 16, 3), RequestSpec("v-r1", "v", 4, 3)]
    start = StepStart(["u-r0", "v-r0", "v-r1"], {"u-r0", "v-r1"}, {"u-r0", "v-r0", "v-r1"})
    judge = _judge(reqs, ["u-r0", "v-r0"], start, policy="priority")
    judge._grants_at = lambda state, user, now, n: 0 if user == "u" else n
    trace = _trace({"v-r0": 1}, sampled=["v-r0"], preempted=["v-r1"])
    failure = step_checks.victim_within_level(judge, trace, None)
    assert failure is not None and failure[:2] == ("R13", "should")
    assert "preempted v-r1" in failure[2] and "u-r0" in failure[2]
    above = _judge([replace_priority(r, 1) if r.user == "v" else r for r in reqs], ["u-r0", "v-r0"], start)
    above.scenario = judge.scenario
    above._grants_at = judge._grants_at
    assert step_checks.victim_within_level(above, trace, None) is None  # u-r0 is above vLLM's victim level


def replace_priority(request: RequestSpec, priority: int) -> RequestSpec:
    from dataclasses import replace

    return replace(request, priority=priority)


# -- R14: other users' places in `running` -----------------------------------------------------------
@pytest.mark.rules("R14")
@pytest.mark.parametrize(
    ("after", "ok"),
    [
        (["u-r1", "v-r0", "u-r0"], True),  # the article's rotation: u's streams trade u's places
        (["u-r1", "v-r0"], True),  # and u-r0 finished: its place is freed, nothing moved
        (["u-r0", "v-r0", "u-r1"], True),
        (["u-r1", "u-r0", "v-r0"], False),  # u's next stream moved to the front, across v's
        (["v-r0", "u-r0", "u-r1"], False),
    ],
)
def test_r14_the_rotation_keeps_other_users_places(after, ok):
    reqs = [RequestSpec("u-r0", "u", 4, 6), RequestSpec("v-r0", "v", 4, 6), RequestSpec("u-r1", "u", 4, 6)]
    start = StepStart(["u-r0", "v-r0", "u-r1"], set(), set())
    failure = step_checks.others_reordered(_judge(reqs, after, start))
    assert (failure is None) == ok, failure
    if failure is not None:
        assert failure[:2] == ("R14", "should") and "other users' order" in failure[2]


# -- n > 1: children share one SamplingParams ---------------------------------------------------------
@pytest.mark.rules("R17")
def test_n_gt_1_children_share_one_sampling_params_as_vllms_front_end_builds_them():
    reqs = [RequestSpec(f"u-c{k}", "u", 4, 2, parent="u-n3") for k in range(3)] + [RequestSpec("v-r0", "v", 4, 2)]
    children = parallel_children(reqs)
    assert set(children) == {"u-c0", "u-c1", "u-c2"}
    params = {id(p) for p in children.values()}
    assert len(params) == 1  # one object: what one child's scheduler does to it, all see
    shared = children["u-c0"]
    assert shared.n == 1 and shared.max_tokens == 2 and shared.extra_args == {"output_rate_user": "u"}
    shared.extra_args.pop("output_rate_user")
    assert children["u-c2"].extra_args == {}


def test_a_scenario_with_children_round_trips_and_a_bad_parent_is_named():
    from vllm_output_rate.adapter.scenario_file import ScenarioFileError

    scenario = Scenario(
        rates_tokens_per_s={},
        requests=(RequestSpec("u-c0", "u", 4, 2, parent="u-n2"), RequestSpec("u-c1", "u", 4, 2, parent="u-n2")),
        step_interval_ns=1,
        num_steps=1,
    )
    assert Scenario.from_json(scenario.to_json()) == scenario
    assert any("child of 'u-n2'" in line for line in scenario.events())
    with pytest.raises(ScenarioFileError, match=r"requests\[0\]\.parent"):
        Scenario.from_json(scenario.to_json().replace('"u-n2"', "7", 1))


# -- boundary scenarios: the article-style fixture passes, its mutant of the blind spot is killed -----
KILLS = [
    ("refused-prefill-ahead", "1", "ArticleRefusedWaitingEndsLoop", ("R10", "should")),
    ("active-cap-throttled-places", "10", "ArticleAdmitsOnePastCap", ("R12", "should")),
    ("active-cap-throttled-places", "10", "ArticleFreesOnePlacePerUser", ("R12", "must")),
    ("refused-prompt-ahead", "1", "ArticleSplitsPromptWhenChunkedOff", ("R10", "should")),
    ("running-prefill-refused", "1", "ArticleRunningPrefillWaits", ("R10", "should")),
    ("fcfs-throttled-victim", "1", "ArticleVictimRemovedInPlace", ("R11", "must")),
    ("recompute-after-preemption", "16", "ArticleChargesRecompute", ("R11", "must")),
    ("priority-throttled-victim", "1", "ArticlePriorityVictimNotThrottled", ("R13", "should")),
    ("rotation-beside-others", "10", "ArticleRotationMovesToFront", ("R14", "should")),
    ("parallel-children", "1", "ArticleIdentityPoppedOnce", ("R2", "must")),
]


@pytest.mark.slow
@pytest.mark.parametrize(("boundary", "rate", "mutant", "named"), KILLS, ids=[k[2] for k in KILLS])
def test_blind_spot_boundary_passes_the_article_style_fixture_and_kills_its_mutant(
    boundary, rate, mutant, named, article_flags
):
    from vllm_output_rate.adapter import boundaries
    from vllm_output_rate.adapter.configstyle import parse_config_style
    from vllm_output_rate.adapter.scenario_run import run_scenario

    importlib.import_module("article_mutants")
    style = parse_config_style("engine-args")
    scenario = boundaries._solved(boundary, rate, False, 0)
    assert scenario is not None
    assert run_scenario("article_style.scheduler.ArticleScheduler", scenario, "should", style).failure is None
    verdict = run_scenario(f"article_mutants.{mutant}", scenario, "should", style)
    assert (verdict.rule, verdict.level) == named, verdict.failure
