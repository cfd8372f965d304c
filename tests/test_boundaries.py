"""Issue 18 item 1: the Z3-directed boundary scenarios of ``adapter/boundaries.py``.

Each boundary has a model (Z3 finds clock advances for it) for every rate of its pool,
reaches its boundary on the reference in sync and async (as ``adapter/coverage.py``
observes it, black-box, from the spec-limiter replay), and kills the test-only slip it
targets (``tests/fixtures/gate_candidates.py``). The "1 ns" twins are checked by hand
against the spec limiter: the edge step is granted with TAT - now = tau exactly, its twin
refused at tau + 1 ns, and ready_at is granted while ready_at - 1 ns is refused.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest

from vllm_output_rate.adapter import boundaries, boundary_catalog, coverage
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.spec import limiter as spec_limiter

FIXTURES = Path(__file__).parent / "fixtures"
TAU = spec_limiter.BURST_NS


def _noop() -> None:
    pass


def _scenario(name: str, rate: str, async_mode: bool = False):
    scenario = boundaries._solved(name, rate, async_mode, 0)
    assert scenario is not None, f"no model for {name} at {rate} tok/s"
    return scenario


def _one_stream_target(scenario) -> tuple[Fraction, int]:
    """(TAT before the target step, its clock) for a one-user, one-stream boundary: the
    solved prefix is granted step by step (spec limiter), the target is its last step."""
    user, state, now = "u", spec_limiter.EMPTY, 0
    rate = scenario.rate_of(user)
    for advance in scenario.advances_ns:
        state, granted = spec_limiter.try_take(state, user, rate, now)
        assert granted, "the solved prefix is granted at every step"
        now += advance
    return state.tat_ns[user], now


@pytest.mark.parametrize("integer_rates", [False, True])
def test_every_boundary_has_a_model_for_every_rate_of_its_pool(integer_rates):
    for boundary in boundary_catalog.BOUNDARIES:
        for rate in boundary.rates(integer_rates):
            assert boundaries._solved(boundary.name, rate, False, 0) is not None, (boundary.name, rate)
            if integer_rates:
                assert Fraction(rate).denominator == 1, (boundary.name, rate)


def test_boundary_scenarios_per_run_cover_every_boundary_with_seeded_rates():
    named = boundaries.boundary_scenarios(False, integer_rates=True, seed=0, per_boundary=3)
    assert [n.split("@")[0] for n, _ in named] == [b.name for b in boundary_catalog.BOUNDARIES for _ in range(3)]
    assert all(
        Fraction(r).denominator == 1
        for _, s in named
        for r in [s.default_rate_tokens_per_s, *s.rates_tokens_per_s.values()]
    )
    other = boundaries.boundary_scenarios(False, integer_rates=True, seed=1, per_boundary=3)
    assert [n for n, _ in named] != [n for n, _ in other], "the seed chooses the rates"
    fractional_t = {n for n, s in named if n.startswith(("ready-at", "fractional-interval"))}
    for name in fractional_t:  # 10**9 / rate not a whole number of ns, integer rates too
        rate = Fraction(name.split("@")[1])
        assert spec_limiter.emission_interval_ns(rate).denominator != 1


@pytest.mark.rules("R2")
@pytest.mark.parametrize("rate", ["2", "3", "10", "20", "2.5"])
def test_r2_burst_edge_grant_at_tau_and_twin_refused_at_tau_plus_1ns(rate):
    tat, now = _one_stream_target(_scenario("burst-edge", rate))
    assert tat - now == TAU
    assert spec_limiter.allows(spec_limiter.LimiterState({"u": tat}), "u", now)
    tat, now = _one_stream_target(_scenario("burst-edge+1ns", rate))
    assert tat - now == TAU + 1
    assert not spec_limiter.allows(spec_limiter.LimiterState({"u": tat}), "u", now)


@pytest.mark.rules("R5")
@pytest.mark.parametrize("rate", ["3", "7", "9", "3.5"])
def test_r5_take_at_ready_at_granted_and_1ns_before_refused(rate):
    tat, now = _one_stream_target(_scenario("ready-at", rate))
    state = spec_limiter.LimiterState({"u": tat})
    assert (tat - TAU).denominator != 1 and now == spec_limiter.ready_at_ns(state, "u")
    assert math.ceil(tat - TAU) - (tat - TAU) == Fraction(1, Fraction(rate).numerator)  # smallest margin
    assert spec_limiter.allows(state, "u", now)
    tat, now = _one_stream_target(_scenario("ready-at-1ns", rate))
    state = spec_limiter.LimiterState({"u": tat})
    assert now == spec_limiter.ready_at_ns(state, "u") - 1 and not spec_limiter.allows(state, "u", now)


@pytest.mark.parametrize("name", boundary_catalog.BOUNDARY_NAMES)
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_boundary_reached_on_the_reference(name, async_mode):
    boundary = next(b for b in boundary_catalog.BOUNDARIES if b.name == name)
    for rate in boundary.rates(False)[:2]:
        scenario = _scenario(name, rate, async_mode)
        cls = REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER
        with coverage.collecting() as reached:
            verdict = run_scenario(cls, scenario, "exact")
        assert verdict.failure is None, verdict.failure
        assert reached[f"boundary: {name}"] == 1, (rate, dict(reached))


# boundary -> (test-only slip of tests/fixtures/gate_candidates.py, modes it is killed in,
# level, rule named). Under-grant slips are judged only in ample sync (P4).
KILLS = [
    ("burst-edge", "BurstEdgeStrict", ("sync",), "must", "R11"),
    ("burst-edge+1ns", "BurstEdgeWide", ("sync", "async"), "must", "R2"),
    ("ready-at", "IntervalRoundedUp", ("sync",), "must", "R11"),
    ("ready-at-1ns", "ReadyAtFloorGrants", ("sync", "async"), "must", "R2"),
    ("fractional-interval", "IntervalTruncated", ("sync", "async"), "must", "R2"),
    ("cleanup-tat-now+1ns", "CleanupNowPlusOne", ("sync", "async"), "must", "R2"),
    ("prefill-reaches-n", "FirstTokenFree", ("sync", "async"), "must", "R2"),
    ("prefill-ends-n-1", "PrefillAdvanceToN", ("sync", "async"), "must", "R2"),
    ("charged-then-preempted", "DoubleRefundBoth", ("sync", "async"), "must", "R2"),
    ("charged-then-alloc-failure", "DoubleRefundBoth", ("sync", "async"), "must", "R2"),
    ("all-refused", "GrantWhenAllRefused", ("sync", "async"), "must", "R2"),
    ("refused-prompt-ahead", "WholePromptWhenRefused", ("sync", "async"), "must", "R2"),
]


@pytest.mark.parametrize("name, slip, modes, level, rule", KILLS, ids=[k[0] for k in KILLS])
def test_boundary_scenario_kills_the_slip_it_targets(name, slip, modes, level, rule, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    boundary = next(b for b in boundary_catalog.BOUNDARIES if b.name == name)
    for mode in modes:
        async_mode = mode == "async"
        cls = f"gate_candidates.{slip}" + ("Async" if async_mode else "")
        for rate in boundary.rates(True)[:2]:
            verdict = run_scenario(cls, _scenario(name, rate, async_mode), level)
            assert verdict.failure is not None and verdict.rule == rule, (mode, rate, verdict)


@pytest.mark.rules("R14")
def test_r14_rotation_wrap_kills_no_rotation_at_should_in_sync():
    scenario = _scenario("rotation-wrap", "20")
    verdict = run_scenario("vllm_output_rate.adapter.mutants.NoRotation", scenario, "should")
    assert verdict.rule == "R14/R15" and verdict.level == "should"
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "should").failure is None


@pytest.mark.rules("R12")
@pytest.mark.parametrize("rate", ["1", "5", "2.5"])
def test_r12_active_cap_binds_kills_throttled_requests_counted_toward_the_cap(rate):
    # Cap 1: U is admitted, throttled at step 1 (1 ns past u's burst edge), and gives V its
    # place; a patch counting throttled requests toward the cap leaves V waiting.
    scenario = _scenario("active-cap-binds", rate)
    assert scenario.max_num_active_seqs == 1 and scenario.ample
    verdict = run_scenario("vllm_output_rate.adapter.mutants.ThrottledCountTowardCap", scenario, "must")
    assert (verdict.rule, verdict.level) == ("R12", "must"), verdict
    assert "left v-r0 (user 'v') waiting" in verdict.failure and "['u-r0']" in verdict.failure
    with coverage.collecting() as reached:
        assert run_scenario(REFERENCE_SCHEDULER, scenario, "should").failure is None
    assert reached["R12 active cap binds"] == 1 and reached["boundary: active-cap-binds"] == 1


@pytest.mark.rules("R6")
def test_r6_cleanup_at_tat_equal_now_is_not_distinguishable(monkeypatch):
    # R6 deletes a user with TAT == now; deleting it or not is the same for every later
    # take (Z3 r6_cleanup_noop), so the slip at TAT = now + 1 ns passes this twin.
    monkeypatch.syspath_prepend(str(FIXTURES))
    for rate in ("2", "10"):
        assert (
            run_scenario("gate_candidates.CleanupNowPlusOne", _scenario("cleanup-tat-now", rate), "must").failure
            is None
        )


def test_check_boundaries_row_lists_scenarios_and_names_the_failing_boundary(monkeypatch, tmp_path):
    ok = boundaries.check_boundaries(REFERENCE_SCHEDULER, False, 0, _noop, level="should")
    assert ok.result == "pass" and ok.name == "boundaries/sync"
    assert [n.split("@")[0] for n in ok.scenarios] == list(boundary_catalog.BOUNDARY_NAMES)
    monkeypatch.syspath_prepend(str(FIXTURES))
    bad = boundaries.check_boundaries("gate_candidates.CleanupNowPlusOne", False, 0, _noop, tmp_path, level="must")
    assert bad.result == "fail" and bad.failed_level == "must"
    # The over-grant after the cleanup is named by the rule broken (adapter/attribution.py): R6.
    assert "[must] R6:" in bad.failure and "R6 broken: " in bad.failure and "over the user's rate" in bad.failure
    assert "(boundary scenario cleanup-tat-now+1ns@" in bad.failure
    assert bad.saved is not None and Path(bad.saved).exists()


@pytest.mark.rules("R13")
@pytest.mark.parametrize("rate", ["1", "5"])
def test_r13_fcfs_throttled_victim_kills_vllms_own_victim_choice(rate):
    # FCFS: U1 (refused) stands before V1 and V2 in `running`; V1's decode needs a block.
    # vLLM alone preempts V2 (the last of `running`) while the throttled U1 keeps its KV.
    scenario = _scenario("fcfs-throttled-victim", rate)
    assert scenario.policy == "fcfs"
    verdict = run_scenario("vllm_output_rate.adapter.mutants.ThrottledNotPreferredVictims", scenario, "should")
    assert (verdict.rule, verdict.level) == ("R13", "should"), verdict
    assert "preempted v-r1" in verdict.failure and "u-r0" in verdict.failure
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "should").failure is None
    # Below should the victim is not judged.
    assert (
        run_scenario("vllm_output_rate.adapter.mutants.ThrottledNotPreferredVictims", scenario, "must").failure is None
    )


@pytest.mark.rules("R13")
def test_r13_priority_variant_puts_the_throttled_request_above_the_victim_level():
    scenario = _scenario("priority-throttled-victim-above", "5")
    priority = {r.request_id: r.priority for r in scenario.requests}
    assert scenario.policy == "priority" and priority == {"u-r0": 0, "v-r0": 1, "v-r1": 1}
    for async_mode, cls in ((False, REFERENCE_SCHEDULER), (True, REFERENCE_ASYNC_SCHEDULER)):
        assert (
            run_scenario(cls, _scenario("priority-throttled-victim-above", "5", async_mode), "should").failure is None
        )


@pytest.mark.rules("R9")
@pytest.mark.parametrize("name", ["charged-then-preempted", "charged-then-alloc-failure"])
def test_r9_kept_charge_is_an_under_grant_once_the_pressure_is_gone(name):
    # The scenario is not ample (3-4 KV blocks), but from ``ample_from_step`` on only B is
    # left: a charge kept although its request was not dispatched (no R9 refund) then
    # refuses B where the GCRA grants it.
    boundary = next(b for b in boundary_catalog.BOUNDARIES if b.name == name)
    for rate in boundary.rates(True)[:2]:
        scenario = _scenario(name, rate)
        assert not scenario.ample and scenario.ample_from_step is not None
        verdict = run_scenario("vllm_output_rate.adapter.mutants.NoRefund", scenario, "must")
        assert (verdict.rule, verdict.level) == ("R11", "must"), verdict
        assert "under-grant" in verdict.failure and verdict.step >= scenario.ample_from_step
        assert run_scenario(REFERENCE_SCHEDULER, scenario, "should").failure is None


def test_ample_from_step_survives_json_and_old_files_default_to_none():
    from vllm_output_rate.adapter.scenarios import Scenario

    scenario = _scenario("charged-then-preempted", "5")
    assert Scenario.from_json(scenario.to_json()) == scenario
    import json

    data = json.loads(scenario.to_json())
    del data["ample_from_step"]  # a counterexample saved before the field existed
    assert Scenario.from_json(json.dumps(data)).ample_from_step is None
    assert scenario.ample_at(scenario.ample_from_step) and not scenario.ample_at(scenario.ample_from_step - 1)
