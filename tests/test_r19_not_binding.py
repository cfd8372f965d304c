"""R19 (not binding = stock) and the R14 redesign (turns decide grants, never `running`).

The rotation stall (issue 13): users V and W at 10^6 tok/s (far above need), token budget
16, block 16. V's R2 and W's X decode; V then sends R3 with a 100-token prompt. vLLM
spends the budget in `running` order. The old R14 rotated R3 into R2's place, at the
front of `running`, so R3's prefill took the whole budget and X got
[1, 0, 0, 0, 0, 0, 1, 1, 1, 1] tokens over the next 10 steps; stock vLLM gives X one token
every step, and so must a rate limit that does not bind (R19).
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
from test_scheduler_rules import make

from vllm_output_rate.adapter.conform import check_scheduler
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, Harness, StepTrace
from vllm_output_rate.adapter.not_binding import check_not_binding, never_binding, run_not_binding
from vllm_output_rate.adapter.scenarios import Hunt, RequestSpec, Scenario
from vllm_output_rate.proofs import modelcheck as mc
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Step
from vllm_output_rate.spec.state import EngineConfig, initial_state

FIXTURES = Path(__file__).parent / "fixtures"
MS = 1_000_000
RATE = 1_000_000  # tok/s: never binding


def steps(h: Harness, count: int, dt_ns: int) -> Iterator[StepTrace]:
    """``count`` steps of ``h``, its fake clock advanced ``dt_ns`` (ns) after each; yields
    each step's trace as it is taken (so a loop body sees ``h`` right after that step)."""
    for _ in range(count):
        trace = h.step()
        h.advance(dt_ns)
        yield trace


def stall_on(cls: str, async_scheduling: bool, feature_on: bool) -> list[dict[str, int]]:
    """The stall scenario of the module docstring; the batch of each of the 10 steps after
    R3 arrives (request id -> tokens, in SchedulerOutput order)."""
    h = Harness(
        cls,
        EngineShape(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            block_size=16,
            async_scheduling=async_scheduling,
            output_rate={"default_tokens_per_s": RATE} if feature_on else None,
        ),
    )
    h.add_request("R2", "V", prompt_len=4, max_tokens=60)
    h.add_request("X", "W", prompt_len=4, max_tokens=60)
    list(steps(h, 3, 10 * MS))  # both prefilled, both decoding
    h.add_request("R3", "V", prompt_len=100, max_tokens=5)
    batches = []
    for trace in steps(h, 10, 10 * MS):
        batches.append(dict(trace.scheduled))
        assert trace.white["throttled"] == [] and trace.white["refunded"] == []  # nothing binds
    return batches


@pytest.mark.rules("R19")
def test_r19_rotation_stall_other_user_gets_a_token_every_step(async_scheduling, reference_cls, stock_cls):
    got = stall_on(reference_cls, async_scheduling, True)
    assert [b.get("X", 0) for b in got] == [1] * 10  # the old R14: [1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert [b.get("R2", 0) for b in got] == [1] * 10
    # The whole schedule is stock vLLM's, batch order included (R19).
    h = Harness(
        stock_cls,
        EngineShape(max_num_seqs=4, max_num_batched_tokens=16, block_size=16, async_scheduling=async_scheduling),
    )
    h.add_request("R2", "V", prompt_len=4, max_tokens=60)
    h.add_request("X", "W", prompt_len=4, max_tokens=60)
    for _ in range(3):
        h.step()
    h.add_request("R3", "V", prompt_len=100, max_tokens=5)
    want = [dict(h.step().scheduled) for _ in range(10)]
    assert [list(b.items()) for b in got] == [list(b.items()) for b in want]


@pytest.mark.rules("R19")
def test_r19_spec_rotation_stall_is_the_base_step_for_step():
    # The same shape on the spec (I18 checked after every step): feature on at 10^6 tok/s,
    # and the base model from the same events give the same batches.
    on = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, default_rate_tokens_per_s=Fraction(RATE))
    events = [AddRequest("R2", "V", 0, 4, 60, None), AddRequest("X", "W", 0, 4, 60, None)]
    events += [Step(), AdvanceClock(10 * MS)] * 3 + [AddRequest("R3", "V", 0, 100, 5, None)]
    events += [Step(), AdvanceClock(10 * MS)] * 10
    batches = {}
    for config in (on, on.base_config()):
        state, history, seen = initial_state(config), invariants.DispatchHistory(), []
        for event in events:
            before = state
            state, obs = spec.step(state, event)
            history = invariants.advance_history(history, before, obs)
            assert invariants.check(before, event, state, obs, history if config.rate_limited else None) is None
            if isinstance(event, Step):
                assert not obs.limit_bound
                seen.append(obs.scheduled)
        batches[config.rate_limited] = seen
    assert batches[True] == batches[False]
    assert [dict(b).get("X", 0) for b in batches[True][3:]] == [1] * 10


@pytest.mark.rules("R19")
def test_r19_model_checker_scopes_hold_and_catch_the_articles_rotation():
    for name in ("sync-stall-not-binding", "async-stall-not-binding"):
        result = mc.explore(mc.scope_by_name(name))
        assert not result.violations, result.violations
        assert result.coverage["not_binding"] > 0  # I18 compared every such step with the base
    rotate = next(m for m in mc.MUTATIONS if m.name == "RotateRunning")
    scope = mc.scope_by_name("sync-stall-not-binding")
    with mc.applied(rotate, scope.config):
        result = mc.explore(scope, strict=False)
    assert "I18" in result.violations
    assert "a rate limit that does not bind must not change the schedule" in result.violations["I18"].message


@pytest.mark.rules("R19")
def test_r19_gate_passes_the_reference(async_scheduling, reference_cls):
    result = check_not_binding(reference_cls, async_scheduling, Hunt(12, max_steps=30))
    assert result.result == "pass", result.failure
    assert result.examples == 12 and result.steps > 0


@pytest.mark.rules("R19")
def test_r19_gate_rejects_the_articles_swap_rotation(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    result = check_not_binding("gate_candidates.SwapRotation", False, Hunt(30, max_steps=30, save_dir=tmp_path))
    assert result.result == "fail" and result.failed_level == "should"
    assert result.failure.startswith("[should] R19:")
    assert "a rate limit that does not bind must not change the schedule" in result.failure
    assert "the article's own rotation" in result.failure
    assert result.saved and Scenario.from_json(Path(result.saved).read_text()).default_rate_tokens_per_s == str(RATE)
    # The hand-written stall scenario itself is rejected with the stall shape.
    stall = Scenario(
        rates_tokens_per_s={},
        step_interval_ns=10 * MS,
        num_steps=14,
        max_num_batched_tokens=16,
        requests=(
            RequestSpec("R2", "V", 4, 30),
            RequestSpec("X", "W", 4, 30),
            RequestSpec("R3", "V", 100, 5, at_step=3),
        ),
    )
    assert run_not_binding(REFERENCE_SCHEDULER, stall).failure is None
    verdict = run_not_binding("gate_candidates.SwapRotation", stall)
    assert verdict.rule == "R19" and verdict.step == 4 and "[('R3', 16)]" in verdict.failure


@pytest.mark.rules("R19")
def test_r19_never_binding_scenarios_cannot_be_refused():
    scenario = Scenario(
        rates_tokens_per_s={"a": "2"}, requests=(RequestSpec("a0", "a", 3, 8),), step_interval_ns=1, num_steps=5
    )
    fast = never_binding(scenario)
    assert fast.default_rate_tokens_per_s == str(RATE) and fast.rates_tokens_per_s == {"a": str(RATE)}
    too_many = Scenario(
        rates_tokens_per_s={},
        step_interval_ns=1,
        num_steps=5,
        requests=tuple(RequestSpec(f"r{i}", "a", 1, 60_000) for i in range(2)),
    )
    with pytest.raises(AssertionError, match="may be refused"):
        never_binding(too_many)


@pytest.mark.rules("R19")
def test_r19_registered_at_level_should(registered_at_level):
    assert registered_at_level("not-binding", "should", below="must")[0] == "R19"


@pytest.mark.rules("R14")
def test_r14_bounded_bypass_still_holds_for_throttled_users(async_scheduling, reference_cls):
    # The rate-limit gate check at level should judges R14 as bounded bypass (sync: a
    # stream of a throttled user waits at most 2 x its user's streams grants).
    result = check_scheduler(reference_cls, async_scheduling, Hunt(20, seed=3, max_steps=30), level="should")
    assert result.result == "pass", result.failure


@pytest.mark.rules("R14")
def test_r14_throttled_user_takes_turns_while_another_users_long_prompt_prefills():
    # u at 10 tok/s (one grant per 100 ms step) with U1, U2, U3 decoding; v at 10^6 tok/s
    # with V1 decoding and a 100-token prompt V2 arriving; budget 16. u's grant goes round
    # robin over its streams (R14 turns), V1 decodes every step, and V2 prefills with the
    # rest of the budget, never ahead of the others (running order is the admission order).
    h = make(
        False,
        max_num_seqs=5,
        max_num_batched_tokens=16,
        block_size=16,
        output_rate={"default_tokens_per_s": RATE, "user_tokens_per_s": {"u": 10}},
    )
    for rid in ("U1", "U2", "U3"):
        h.add_request(rid, "u", prompt_len=2, max_tokens=30)
    h.add_request("V1", "v", prompt_len=2, max_tokens=30)
    list(steps(h, 2, 100 * MS))
    h.add_request("V2", "v", prompt_len=100, max_tokens=3)
    served = []
    for trace in steps(h, 9, 100 * MS):
        served.append([rid for rid in trace.sampled if rid.startswith("U")])
        assert "V1" in trace.sampled
        assert [r.request_id for r in h.scheduler.running] == ["U1", "U2", "U3", "V1", "V2"]
    assert all(len(s) == 1 for s in served)
    assert served[:6] in ([["U1"], ["U2"], ["U3"]] * 2, [["U2"], ["U3"], ["U1"]] * 2, [["U3"], ["U1"], ["U2"]] * 2)
