"""R13 (LoRA): a throttled resident holding the adapter slot another user's request needs
is the preferred victim (docs/SPEC.md, Decision "LoRA slots"); V8's max_loras count per
vLLM release, checked against real vLLM (base fidelity, stock) and against the reference
(white box). In-process, sync and async, on the installed vLLM (0.32.0 or 0.33.0).

The issue-13 shape: ``max_loras`` 1; A (user u, 10 tok/s, adapter 1) decodes and is
throttled; B (user v, 1000 tok/s, adapter 2) arrives. Without the decision B waits until A
has finished (0.33; 0.32 without the reference's own count would even crash); with it A is
preempted in the next step, B is admitted in that same step and finishes, and A resumes
and finishes with all its tokens.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from vllm_output_rate.adapter.fidelity import StepScenario, run_step_scenario
from vllm_output_rate.adapter.harness import STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER
from vllm_output_rate.adapter.whitebox import run_white_box
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Drain, Step
from vllm_output_rate.spec.state import EngineConfig, initial_state

MS = 1_000_000


def _shape(async_scheduling: bool, a_tokens: int = 6, b_tokens: int = 2, steps: int = 12) -> StepScenario:
    config = EngineConfig(
        max_loras=1,
        async_scheduling=async_scheduling,
        default_rate_tokens_per_s=Fraction(10),
        user_rates_tokens_per_s=(("v", Fraction(1000)),),
    )
    events = [
        AddRequest("A", "u", prompt_len=4, max_tokens=a_tokens, lora=1),
        Step(),
        AdvanceClock(50 * MS),
        Step(),
        AdvanceClock(50 * MS),
        AddRequest("B", "v", prompt_len=4, max_tokens=b_tokens, lora=2),
    ]
    events += [Step(), AdvanceClock(50 * MS)] * steps
    if async_scheduling:
        events.append(Drain())
    return StepScenario(config, tuple(events))


def _spec_steps(scenario: StepScenario):
    state, observations = spec.run(initial_state(scenario.config), scenario.events)
    return state, [o for o in observations if o.event == "step"]


@pytest.mark.rules("R13")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_r13_lora_throttled_holder_is_preempted_and_the_other_adapter_admitted_the_same_step(async_scheduling):
    scenario = _shape(async_scheduling)
    state, steps = _spec_steps(scenario)
    freed = next(i for i, o in enumerate(steps) if o.lora_victims)
    assert steps[freed].lora_victims == ("A",) and steps[freed].preempted == ("A",)
    assert steps[freed].admitted == ("B",), steps[freed]  # no V7 for a LoRA victim
    # B arrived before step 2, in which A was still granted (and so running on the slot by
    # right); A is refused from step 3, the step that frees the slot and admits B.
    assert freed == 3 and ("A", 1) in steps[2].scheduled
    finished = {f.request_id: (f.reason, f.num_output_tokens) for o in steps for f in o.finished}
    assert finished == {"A": ("length", 6), "B": ("length", 2)} and not state.requests
    # A preempted once only: refused, it does not take the slot back while B runs (lora_gate).
    assert sum(o.preempted.count("A") for o in steps) == 1


@pytest.mark.rules("R13")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_r13_lora_reference_matches_the_spec_step_for_step(async_scheduling):
    # White box: batches, preemptions, admissions, running/waiting order, KV and every
    # rate-limit field of the reference equal the spec's (which the test above pins down).
    verdict = run_white_box(_shape(async_scheduling))
    assert verdict.failure is None, verdict
    assert verdict.steps >= 12


@pytest.mark.rules("R13")
def test_r13_lora_holder_of_a_held_user_is_not_a_victim():
    # u has 2 streams on adapter 1 and grants for one of them (held, R14, not refused): its
    # other stream could take the slot back at once, so nothing is preempted and B waits.
    config = EngineConfig(
        max_loras=1, default_rate_tokens_per_s=Fraction(20), user_rates_tokens_per_s=(("v", Fraction(1000)),)
    )
    events = [
        AddRequest("A1", "u", prompt_len=4, max_tokens=8, lora=1),
        AddRequest("A2", "u", prompt_len=4, max_tokens=8, lora=1),
        Step(),
        AdvanceClock(50 * MS),
        AddRequest("B", "v", prompt_len=4, max_tokens=2, lora=2),
    ]
    events += [Step(), AdvanceClock(50 * MS)] * 3
    _, steps = _spec_steps(StepScenario(config, tuple(events)))
    assert any(o.throttled for o in steps)
    assert not any(o.lora_victims for o in steps) and not any("B" in o.admitted for o in steps)
    assert run_white_box(StepScenario(config, tuple(events))).failure is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v8_lora_base_fidelity_stock_counts_adapters_per_release(async_scheduling):
    # Stock vLLM, feature off: B (adapter 2) is skipped while A (adapter 1) runs, C (adapter
    # 1) is admitted beside A, B once A and C have finished: the spec's V8 count agrees
    # with the installed release step for step.
    config = EngineConfig(max_loras=1, async_scheduling=async_scheduling)
    events = (
        AddRequest("A", "u", prompt_len=4, max_tokens=6, lora=1),
        Step(),
        AddRequest("B", "v", prompt_len=4, max_tokens=2, lora=2),
        AddRequest("C", "v", prompt_len=4, max_tokens=2, lora=1),
    ) + (Step(),) * 12
    scenario = StepScenario(config, events)
    verdict = run_step_scenario(STOCK_ASYNC_SCHEDULER if async_scheduling else STOCK_SCHEDULER, scenario)
    assert verdict.failure is None, verdict
    _, steps = _spec_steps(scenario)
    admitted = [rid for o in steps for rid in o.admitted]
    assert admitted == ["A", "C", "B"], admitted


# -- generated LoRA scenarios: spec against stock vLLM (base) and the reference (white box)
def _hunt(strategy, run, examples: int) -> None:
    from hypothesis import HealthCheck, given, seed, settings

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=False, suppress_health_check=list(HealthCheck)
    )
    @seed(13)
    @given(scenario=strategy)
    def prop(scenario):
        verdict = run(scenario)
        assert verdict.failure is None, (verdict.failure, scenario.lines())

    prop()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v8_lora_base_fidelity_generated_scenarios(async_scheduling):
    from vllm_output_rate.adapter.fidelity import base_scenarios, run_base, with_loras

    _hunt(with_loras(base_scenarios(async_scheduling)), run_base, 60)


@pytest.mark.rules("R11", "R13")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_r13_lora_white_box_generated_scenarios(async_scheduling):
    from vllm_output_rate.adapter.fidelity import with_loras
    from vllm_output_rate.adapter.whitebox import white_box_scenarios

    _hunt(with_loras(white_box_scenarios(async_scheduling)), run_white_box, 60)


@pytest.mark.rules("R11")
def test_r11_lora_a_request_done_at_max_model_len_does_not_hold_its_slot_async():
    # Found by the gate (white-box/async with LoRA): max_model_len 8, async. r3 (adapter 1)
    # has its last token in flight and no room below max_model_len: vLLM's running loop
    # gives it 0 tokens (V4), so it is neither scheduled nor throttled and vLLM 0.32 does
    # not count its adapter; r4 (adapter 2) is admitted beside it, as by stock vLLM. The
    # reference once counted r3 (every running request but V3's) and kept r4 waiting.
    config = EngineConfig(
        max_num_seqs=2,
        max_num_batched_tokens=8,
        chunked_prefill=False,
        block_size=4,
        num_blocks=5,
        async_scheduling=True,
        max_model_len=8,
        max_loras=1,
        default_rate_tokens_per_s=Fraction(1, 2),
        user_rates_tokens_per_s=(("u0", Fraction(1, 2)), ("u1", Fraction(50))),
    )
    events = [
        AddRequest("r0", "u0", 2, 1, 8, lora=1),
        AddRequest("r1", "u0", 1, 1, 8),
        AddRequest("r2", "u0", 0, 1, 8),
        Step(),
        AdvanceClock(5 * MS),
        Step(),
        AdvanceClock(5 * MS),
        AddRequest("r3", "u1", 0, 2, 8, lora=1),
        AddRequest("r4", "u1", 0, 1, 8, lora=2),
    ]
    events += [Step(), AdvanceClock(5 * MS)] * 8
    scenario = StepScenario(config, tuple(events))
    _, steps = _spec_steps(scenario)
    assert any(o.admitted == ("r4",) and ("r3", "V2") in o.decided for o in steps)
    verdict = run_white_box(scenario)
    assert verdict.failure is None, verdict
