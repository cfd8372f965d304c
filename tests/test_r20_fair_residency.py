"""R20, fair residency (issue 13 item 3): one user's flood cannot hold every resident slot.

With ``output_rate.max_num_seqs_per_user`` C, a waiting request whose user already holds
C running requests is skipped at admission and later waiting requests of other users are
still admitted (docs/SPEC.md R20). Shown here on the spec, on the reference against the
spec step for step (white box), by the model checker's flood scopes (I19, F2: the
admission-delay bound) and by the gate's ``fair-residency/*`` rows, which reject the
reference with the cap ignored (the article's behaviour). Configuration: the key, the
``outrate serve`` flag, and the refusals naming the flag. The live flood is
``gpu_tests/test_live_flood.py``.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
from test_scheduler_rules import make

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.fidelity import StepScenario
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.residency import check_residency
from vllm_output_rate.adapter.scenarios import Hunt
from vllm_output_rate.adapter.whitebox import run_white_box
from vllm_output_rate.proofs import modelcheck as mc
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.engine_checks import check_engine_supported
from vllm_output_rate.reference.section import OutputRateConfigError
from vllm_output_rate.spec import rate as spec_rate
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Step
from vllm_output_rate.spec.state import EngineConfig, initial_state

REFERENCE = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
REFERENCE_ASYNC = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
MS = 1_000_000
FLOOD_SCOPES = ("sync-flood-cap", "async-flood-cap")


def flood_events(streams: int = 6) -> tuple:
    """User f (2 tok/s) sends ``streams`` streams; 2 steps later user o sends one."""
    events = [AddRequest(f"f{i}", "f", 0, 3, 20, None) for i in range(streams)]
    events += [Step(), AdvanceClock(20 * MS), Step(), AdvanceClock(20 * MS), AddRequest("o0", "o", 0, 3, 3, None)]
    events += [Step(), AdvanceClock(20 * MS)] * 6
    return tuple(events)


def flood_config(cap: int | None, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        default_rate_tokens_per_s=Fraction(1000),
        user_rates_tokens_per_s=(("f", Fraction(2)),),
        max_num_seqs_per_user=cap,
    )


def admitted_at(config: EngineConfig) -> tuple[int | None, tuple[str, ...]]:
    """(index of the Step that admitted o0 or None, running after the last step) on the spec."""
    state = initial_state(config)
    steps = 0
    when = None
    for event in flood_events():
        state, obs = spec.step(state, event)
        if isinstance(event, Step):
            if "o0" in obs.admitted:
                when = steps
            steps += 1
    return when, state.running


@pytest.mark.rules("R20")
def test_r20_spec_other_user_admitted_at_once_while_the_flood_waits_at_its_cap():
    when, running = admitted_at(flood_config(cap=2))
    assert when == 2  # the first step after o0 arrived
    assert sum(rid.startswith("f") for rid in running) == 2


@pytest.mark.rules("R20")
def test_r20_spec_without_cap_the_flood_holds_every_slot_and_the_other_user_waits():
    # The article's behaviour (the default): f's throttled streams hold all 4 slots.
    when, running = admitted_at(flood_config(cap=None))
    assert when is None and len(running) == 4 and all(rid.startswith("f") for rid in running)


@pytest.mark.rules("R20")
def test_r20_spec_skip_is_a_limit_that_binds():
    # R19: a step in which R20 skipped a waiting request is not compared with the base.
    state = initial_state(flood_config(cap=1))
    for event in (AddRequest("f0", "f", 0, 3, 20, None), AddRequest("f1", "f", 0, 3, 20, None)):
        state, _ = spec.step(state, event)
    state, obs = spec.step(state, Step())
    assert obs.admitted == ("f0",) and obs.limit_bound
    assert ("f1", "R20") in obs.decided


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.rules("R20")
def test_r20_reference_matches_the_spec_step_for_step(async_scheduling):
    for cap in (1, 2, 4, None):
        scenario = StepScenario(flood_config(cap, async_scheduling), flood_events())
        verdict = run_white_box(scenario)
        assert verdict.failure is None, (cap, verdict.failure)


@pytest.mark.rules("R20")
def test_r20_reference_never_exceeds_the_cap_and_admits_other_users():
    h = make(
        False,
        max_num_seqs=4,
        output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"f": 2}, "max_num_seqs_per_user": 2},
    )
    for i in range(6):
        h.add_request(f"f{i}", "f", prompt_len=3, max_tokens=20)
    h.step()
    h.add_request("o0", "o", prompt_len=3, max_tokens=3)
    trace = h.step()
    assert trace.admitted == ["o0"]
    users = [h.users[r.request_id] for r in h.scheduler.running]
    assert users.count("f") == 2 and users.count("o") == 1


@pytest.mark.rules("R20")
def test_r20_model_checker_flood_scopes_hold_with_pinned_counts():
    for name in FLOOD_SCOPES:
        scope = mc.scope_by_name(name)
        assert scope.fair_admission and scope.config.max_num_seqs_per_user == 1
        result = mc.explore(scope)
        assert result.ok, (name, {c: v.message for c, v in result.violations.items()})
        assert (result.states, result.transitions) == scope.pinned, (name, result.states, result.transitions)
        assert result.coverage["throttled"] and result.coverage["admitted"]
    quick = {s.name for s in mc.profile_scopes("quick")}
    assert set(FLOOD_SCOPES) <= quick


@pytest.mark.rules("R20")
def test_r20_model_checker_catches_an_ignored_cap_with_i19_and_the_f2_bound():
    ignored = mc.Mutation(
        "NoResidencyCap",
        "R20",
        "the cap is ignored (the article's behaviour)",
        lambda config: [(spec_rate, "residency_gate", lambda cycle, request: (cycle, True))],
    )
    for name in FLOOD_SCOPES:
        scope = mc.scope_by_name(name)
        with mc.applied(ignored, scope.config):
            result = mc.explore(scope, raise_on_bound=False, strict=False)
        assert {"I19", "F2"} <= set(result.violations), (name, list(result.violations))
        assert result.violations["F2"].concrete and result.violations["F2"].length <= 6


@pytest.mark.rules("R20")
def test_r20_model_checker_explored_paths_replay_on_the_reference():
    for name, _count, _events, failure in mc.replay_sample_on_vllm(list(FLOOD_SCOPES), 4):
        assert failure is None, (name, failure)


@pytest.mark.rules("R20")
def test_r20_gate_passes_the_reference_and_rejects_the_ignored_cap(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    for cls, async_mode in ((REFERENCE, False), (REFERENCE_ASYNC, True)):
        result = check_residency(cls, async_mode, Hunt(6))
        assert result.result == "pass", result.failure
    for cls, async_mode in (("r20_candidates.NoResidencyCap", False), ("r20_candidates.NoResidencyCapAsync", True)):
        result = check_residency(cls, async_mode, Hunt(20))
        assert result.result == "fail" and result.failure.startswith("[exact] R20"), result.failure


@pytest.mark.rules("R20")
def test_r20_gate_not_tested_for_a_style_without_the_cap():
    from vllm_output_rate.adapter.configstyle import parse_config_style

    result = check_residency(REFERENCE, False, Hunt(1), style=parse_config_style("engine-args"))
    assert result.result == "not tested" and "max_num_seqs_per_user" in result.failure


@pytest.mark.rules("R20")
def test_r20_registered_at_level_exact(registered_at_level):
    """R20 is this project's extension (the article has no per-user cap): it never decides an
    article-style candidate's must/should verdict."""
    assert registered_at_level("fair-residency", "exact", below="should") == ("R20",)


# -- configuration -----------------------------------------------------------------------
@pytest.mark.rules("R20")
def test_r20_config_key_parsed_default_none():
    assert parse_output_rate({"default_tokens_per_s": 5}).max_num_seqs_per_user is None
    assert parse_output_rate({"default_tokens_per_s": 5, "max_num_seqs_per_user": 3}).max_num_seqs_per_user == 3


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "4"])
@pytest.mark.rules("R20")
def test_r20_bad_cap_refused_naming_the_key_and_flag(value):
    with pytest.raises(OutputRateConfigError, match=r"max_num_seqs_per_user \(--max-num-seqs-per-user\)"):
        parse_output_rate({"default_tokens_per_s": 5, "max_num_seqs_per_user": value})


@pytest.mark.rules("R20")
def test_r20_cap_above_max_num_seqs_refused_at_start_up():
    from vllm.config import ModelConfig, VllmConfig

    from vllm_output_rate.adapter.tinymodel import default_model_dir

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(default_model_dir()), skip_tokenizer_init=True, dtype="float32", max_model_len=256
        )
    )
    config.scheduler_config.max_num_seqs = 8
    config.additional_config = {"output_rate": {"default_tokens_per_s": 100, "max_num_seqs_per_user": 9}}
    with pytest.raises(OutputRateConfigError, match=r"\(9\) must be <= --max-num-seqs \(8\).*--max-num-seqs-per-user"):
        check_engine_supported(config)
    shape = EngineShape(max_num_seqs=8, output_rate={"default_tokens_per_s": 100, "max_num_seqs_per_user": 9})
    with pytest.raises(OutputRateConfigError, match="max_num_seqs_per_user"):
        Harness(REFERENCE, shape)  # the scheduler's constructor refuses it too
    ok = copy.deepcopy(shape.output_rate)
    ok["max_num_seqs_per_user"] = 8
    Harness(REFERENCE, EngineShape(max_num_seqs=8, output_rate=ok))


@pytest.mark.rules("R20")
def test_r20_outrate_serve_flag():
    import click

    from vllm_output_rate.serve_section import build_output_rate_section

    section = build_output_rate_section("10", None, 16, None, max_num_seqs_per_user=4)
    assert section == {"default_tokens_per_s": 10, "max_num_seqs_per_user": 4}
    with pytest.raises(click.UsageError, match=r"--max-num-seqs-per-user \(17\) must be <= --max-num-seqs \(16\)"):
        build_output_rate_section("10", None, 16, None, max_num_seqs_per_user=17)
    with pytest.raises(click.UsageError, match="--max-num-seqs-per-user needs --default-user-output-tokens"):
        build_output_rate_section(None, None, 16, None, max_num_seqs_per_user=4)
