"""White box: the step spec predicts the reference rate-limited scheduler, every field.

Runs ``StepScenario``s with the feature on through ``adapter.fidelity.run_step_scenario``
on the class under test (default: the reference, sync and async). After every event it
compares everything base fidelity compares (batch, sampling dispatches, preemptions,
admissions, finishes, ``running``/``waiting`` order, KV blocks, per-request counters) and,
after every ``Step``, each field of the scheduler's ``last_step_observation``
(docs/OBSERVATION.md) with the spec's observation: ``now_ns`` (R16), ``charged`` in charge
order (R7), ``refunded`` in order (R9), ``throttled`` (R11), ``wait_hint_ns`` (R16) and
every user's exact TAT (R1-R6). A class without the observation interface is judged on
the base fields only (its rate-limit decisions still show in the batch).

The generated class puts the rate limit under resource pressure: few small KV blocks
(preemption of throttled and charged requests, R9, R13), small token budgets (chunked
prefill capped at n-1, R10), an active cap below ``max_num_seqs`` (R12), 1-3 users with
rates from 0.5 to 100 tok/s sharing up to 6 streams (R14, R15), FCFS and PRIORITY, clock
advances of 0-120 ms between steps, aborts and EOS, chunked prefill on and off, sometimes
a burst tolerance other than 100 ms and sometimes vLLM's own ``max_num_active_seqs``
(which the feature reinterprets, R12).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter.fidelity import (
    StepScenario,
    StepVerdict,
    base_scheduler_cls,
    build_events,
    describe_failure,
    drawn_engine_fields,
    request_plans,
    run_step_scenario,
)
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, Harness, StepTrace
from vllm_output_rate.spec.events import Event, Step
from vllm_output_rate.spec.state import EngineConfig, Observation, SchedulerState

RATES = ("0.5", "2", "3.5", "5", "10", "20", "50", "100")
STEP_INTERVALS_MS = (0, 1, 5, 10, 20, 33, 50, 120)


def compare_white(
    event: Event, trace: StepTrace | None, harness: Harness, obs: Observation, state: SchedulerState
) -> str | None:
    """R1-R16: the class under test's ``last_step_observation`` of a step equals the spec's;
    a difference names the class (``harness.cls_path``), never "reference" or "vLLM"."""
    if not isinstance(event, Step) or trace is None or trace.white is None:
        return None
    white: dict[str, Any] = trace.white
    fields = (
        ("now_ns (R16)", white["now_ns"], obs.now_ns),
        ("charged (R7)", list(white["charged"]), list(obs.charged)),
        ("refunded (R9)", list(white["refunded"]), list(obs.refunded)),
        ("throttled (R11)", sorted(white["throttled"]), list(obs.throttled)),
        ("wait_hint_ns (R16)", white["wait_hint_ns"], obs.wait_hint_ns),
        ("tat_ns (R1-R6)", {u: Fraction(t) for u, t in white["tat_ns"].items()}, dict(obs.tat_ns)),
    )
    for name, got, want in fields:
        if got != want:
            return f"{name}: {harness.cls_path.rpartition('.')[2]} {got!r} != spec {want!r}"  # the class by its name
    return None


@st.composite
def rate_configs(draw, async_scheduling: bool, contention: bool) -> EngineConfig:
    """Engine shapes with the feature on and resources under pressure.

    ``contention``: a slow user (0.5-5 tok/s, throttled most steps) and a fast one
    (50-100 tok/s) share a tight KV cache of 4-token blocks, so the fast user's growing
    streams run out of blocks while slow streams sit throttled: R13 victims, refunds of
    charged-then-preempted requests (R9).
    """
    max_num_seqs = draw(st.integers(2, 6))
    chunked = draw(st.booleans())
    # Small budgets split prompts into chunks whose last one may be refused (R10).
    budget = draw(st.one_of(st.integers(8, 24), st.integers(8, 128)))
    max_model_len = draw(st.sampled_from([2048, 80])) if chunked else budget
    if contention:
        overrides: tuple[tuple[str, Fraction], ...] = (
            ("u0", Fraction(draw(st.sampled_from(("0.5", "2", "5"))))),
            ("u1", Fraction(draw(st.sampled_from(("50", "100"))))),
        )
        block_size, num_blocks = 4, draw(st.integers(5, 12))
    else:
        num_users = draw(st.integers(1, 3))
        overrides = tuple(
            (f"u{i}", Fraction(draw(st.sampled_from(RATES)))) for i in range(num_users) if draw(st.booleans())
        )
        block_size = draw(st.sampled_from([4, 4, 8, 16]))
        num_blocks = draw(st.one_of(st.integers(4, 12), st.integers(4, 12), st.integers(4, 60)))
    return EngineConfig(
        **drawn_engine_fields(
            draw, max_num_seqs, budget, chunked, block_size, num_blocks, async_scheduling, max_model_len
        ),
        default_rate_tokens_per_s=Fraction(draw(st.sampled_from(RATES))),
        user_rates_tokens_per_s=overrides,
        output_rate_max_num_active_seqs=draw(st.one_of(st.none(), st.integers(1, max_num_seqs))),
        burst_ns=draw(st.sampled_from([100, 100, 100, 20, 250])) * 1_000_000,
    )


@st.composite
def white_box_scenarios(draw, async_scheduling: bool, max_steps: int = 40) -> StepScenario:
    """Hypothesis strategy: rate-limited scenarios under pressure (module docstring)."""
    contention = draw(st.booleans())
    config = draw(rate_configs(async_scheduling, contention))
    pressure = contention or draw(st.booleans())
    num_steps = draw(st.integers(min(15, max_steps), max_steps))
    users = ("u0", "u1") if contention else tuple(f"u{i}" for i in range(draw(st.integers(1, 3))))
    num_requests = draw(st.integers(3, 6) if contention else st.integers(2, 6))
    plans = [draw(request_plans(config, num_steps, users, i, pressure)) for i in range(num_requests)]
    intervals = st.sampled_from((5, 10, 20, 33)) if contention else st.sampled_from(STEP_INTERVALS_MS)
    clock_ms = draw(st.lists(intervals, min_size=num_steps, max_size=num_steps))
    drains = set(draw(st.lists(st.integers(0, num_steps - 1), max_size=2))) if async_scheduling else set()
    final_drain = async_scheduling and draw(st.booleans())
    events = build_events(plans, num_steps, drains, [ms * 1_000_000 for ms in clock_ms], final_drain)
    return StepScenario(config, events)


def reference_cls(async_scheduling: bool) -> str:
    """The reference class of the mode (P5)."""
    return REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER


def run_white_box(scenario: StepScenario, scheduler_cls: str | None = None, style: Any = None) -> StepVerdict:
    """White-box check of one scenario on ``scheduler_cls`` (default: the reference).

    ``style``: an ``adapter.configstyle.ConfigStyle`` (None: ``AdditionalConfigStyle``).
    """
    assert scenario.config.rate_limited, "the white-box check runs with the feature on"
    cls = scheduler_cls or reference_cls(scenario.config.async_scheduling)
    return run_step_scenario(cls, scenario, extra=compare_white, style=style)


def replay_file(path: str, scheduler_cls: str | None = None) -> StepVerdict:
    """Replay a saved step-scenario counterexample: base fidelity with the feature off,
    white box (default class: the reference) with it on. Prints the outcome."""
    with open(path) as handle:
        scenario = StepScenario.from_json(handle.read())
    if scenario.config.rate_limited:
        verdict = run_white_box(scenario, scheduler_cls)
    else:
        verdict = run_step_scenario(scheduler_cls or base_scheduler_cls(scenario.config.async_scheduling), scenario)
    print("\n".join(describe_failure(scenario, verdict)))
    print(
        f"FAIL at event {verdict.event_index}: {verdict.failure}"
        if verdict.failure
        else f"PASS: {verdict.events} events, {verdict.steps} steps agree"
    )
    return verdict


if __name__ == "__main__":  # python -m vllm_output_rate.adapter.whitebox FILE [SCHEDULER_CLS]
    import sys

    assert len(sys.argv) in (2, 3), "usage: python -m vllm_output_rate.adapter.whitebox FILE [SCHEDULER_CLS]"
    sys.exit(1 if replay_file(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None).failure else 0)
