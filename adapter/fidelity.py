"""Base fidelity: the step spec predicts stock vLLM (each supported release), step for step.

A ``StepScenario`` is an ``EngineConfig`` plus a sequence of events from the shared
alphabet (``spec/events.py``). ``run_step_scenario`` applies each event to the spec
(``spec.scheduler.step``) and to a real scheduler driven by ``Harness``, and compares
after every event (stops at the first difference):

- ``scheduled``: request ids and token counts, in ``SchedulerOutput`` order (V1-V8);
- ``sampled``: the sampling dispatches (V9);
- ``preempted`` (V6) and ``admitted`` (V8, new or resumed requests:
  ``vllm_compat.admitted_ids``);
- ``finished``: request id -> (finish reason, number of outputs) (V10, V11);
- the scheduler state vLLM holds after the event: ``running`` in order, ``waiting`` in
  pop order, free KV blocks, and each live request's ``num_computed_tokens``,
  ``num_output_tokens``, ``num_output_placeholders`` and KV blocks (V5, V9).

The spec's invariants (``spec/invariants.py``) are checked after every spec step too.

The generated class (``base_scenarios``) stays inside what the spec models; each
exclusion is listed in ``EXCLUSIONS`` with its reason (narrow the class, never loosen
the comparison).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any, cast

from hypothesis import strategies as st

from vllm_output_rate.adapter import divergence
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER, Harness, StepTrace
from vllm_output_rate.adapter.scenario_file import ScenarioFileError, checked_object
from vllm_output_rate.adapter.step_file import config_from_json, event_from_json, frac_out
from vllm_output_rate.adapter.versions import installed_profile
from vllm_output_rate.adapter.vllm_compat import admitted_ids
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.state import EngineConfig, Observation, SchedulerState, initial_state
from vllm_output_rate.spec.versions import VllmVersionProfile

MAX_SCENARIO_EVENTS = 10_000  # bound on one scenario (TigerBeetle style)

# What the generated class leaves out, and why (docs: README of the gate, report).
EXCLUSIONS = (
    "prefix caching: off in the gate (every admission starts at 0 computed tokens); the spec does not model "
    "block hashing or cache hits",
    "prompt_len >= max_model_len: vLLM's front end rejects such prompts before the scheduler sees them",
    "speculative decoding, KV connectors, LoRA, multimodal, structured output, pooling, pipeline parallel, "
    "streaming input, reset_prefix_cache, pause states: rejected by the feature's config validation or not "
    "part of a standard causal decoder",
    "long_prefill_token_threshold, watermark, max_num_scheduled_tokens: left at vLLM's defaults (0, 0.0, "
    "max_num_batched_tokens)",
    "without chunked prefill max_model_len = max_num_batched_tokens (vLLM requires max_num_batched_tokens >= "
    "max_model_len); with chunked prefill max_model_len is 2048 or as small as 66 so that the V4 cap can bind",
)


@dataclass(frozen=True)
class StepScenario:
    """A replayable scenario: an engine configuration and an event sequence."""

    config: EngineConfig
    events: tuple[Event, ...]

    def __post_init__(self) -> None:
        assert len(self.events) <= MAX_SCENARIO_EVENTS, f"{len(self.events)} events > {MAX_SCENARIO_EVENTS}"

    def lines(self) -> list[str]:
        """The scenario as short printable lines: ``config_line()`` first, then the events,
        numbered from 0."""
        return [self.config_line()] + [f"{i:3d} {e}" for i, e in enumerate(self.events)]

    def config_line(self) -> str:
        """The engine configuration on one line (a scenario family with a fixed shape
        overrides it to name what that shape varies)."""
        c = self.config
        head = (
            f"config: seqs={c.max_num_seqs} active={c.max_num_active_seqs} budget={c.max_num_batched_tokens} "
            f"chunked={c.chunked_prefill} num_blocks={c.num_blocks} block_size={c.block_size} policy={c.policy} "
            f"async={c.async_scheduling} max_model_len={c.max_model_len}"
        )
        if c.rate_limited:
            rates = ", ".join(f"{u}={r}" for u, r in c.user_rates_tokens_per_s)
            head += (
                f" default_rate={c.default_rate_tokens_per_s} rates=[{rates}] "
                f"rate_active={c.output_rate_max_num_active_seqs} burst_ms={c.burst_ns / 1_000_000:g}"
            )
            if c.max_num_seqs_per_user is not None:
                head += f" seqs_per_user={c.max_num_seqs_per_user}"
        if c.max_loras is not None:
            head += f" max_loras={c.max_loras}"
        return head

    def to_json(self) -> str:
        config = asdict(self.config)
        config["default_rate_tokens_per_s"] = frac_out(config["default_rate_tokens_per_s"])
        config["user_rates_tokens_per_s"] = [[u, frac_out(r)] for u, r in self.config.user_rates_tokens_per_s]
        events = [{"type": type(e).__name__, **asdict(e)} for e in self.events]
        return json.dumps({"config": config, "events": events}, indent=1)

    @staticmethod
    def from_json(text: str) -> StepScenario:
        """The scenario of a file ``to_json`` wrote (``outrate conform`` and ``outrate
        drift`` save them), every field validated before anything runs; a config key left
        out takes ``EngineConfig``'s default.

        Raises:
            ScenarioFileError (adapter/scenario_file.py): not JSON, an unknown or missing key, an
                unknown event type, a value of the wrong type or out of range, a user id
                that is not a non-empty string of at most 256 characters (R17), a rate that
                is not a positive finite number of tokens/s; the message names the field
                (e.g. ``events[3].user``) and the value.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ScenarioFileError(f"not JSON: {exc}") from None
        data = checked_object(data, "the scenario", ("config", "events"), required=("config", "events"))
        config = config_from_json(data["config"])
        if not isinstance(data["events"], list):
            raise ScenarioFileError(f"events: must be a list of event objects, got {type(data['events']).__name__}")
        events = tuple(event_from_json(e, f"events[{i}]") for i, e in enumerate(data["events"]))
        try:
            return StepScenario(config, events)
        except AssertionError as exc:
            raise ScenarioFileError(f"events: {exc}") from None


def engine_shape(config: EngineConfig, rates_file: str | None = None) -> EngineShape:
    """The harness shape (vLLM configuration) of a spec configuration; ``rates_file``: R21's
    ``output_rate.rates_file`` (only with the feature on)."""
    output_rate: dict[str, Any] | None = None  # R21: rates_file is a str value
    if config.default_rate_tokens_per_s is not None:  # R18: rate_limited
        output_rate = {
            "default_tokens_per_s": _as_number(config.default_rate_tokens_per_s),
            "user_tokens_per_s": {u: _as_number(cast(Fraction, r)) for u, r in config.user_rates_tokens_per_s},
        }
        if config.burst_ns != 100_000_000:  # only candidates that read burst_ms get another tau
            output_rate["burst_ms"] = config.burst_ns // 1_000_000
        if config.output_rate_max_num_active_seqs is not None:
            output_rate["max_num_active_seqs"] = config.output_rate_max_num_active_seqs
        if config.max_num_seqs_per_user is not None:  # R20
            output_rate["max_num_seqs_per_user"] = config.max_num_seqs_per_user
        if rates_file is not None:  # R21
            output_rate["rates_file"] = rates_file
    return EngineShape(
        **{name: getattr(config, name) for name in _SHARED_FIELDS}, output_rate=output_rate, enable_prefix_caching=False
    )  # the step spec models no prefix cache: step identity needs it off


# The engine fields a spec configuration and a harness shape share (same names, same
# meaning): copied as they are by engine_shape.
_SHARED_FIELDS = tuple(f.name for f in fields(EngineShape) if f.name in {g.name for g in fields(EngineConfig)})


def _as_number(rate: Fraction) -> int | float:
    """A rate as the JSON number the reference parses back to exactly ``rate``."""
    if rate.denominator == 1:
        return int(rate)
    value = float(rate)
    assert Fraction(repr(value)) == rate, f"rate {rate} has no exact short decimal form"
    return value


class ObservedHarness(Harness):
    """A ``Harness`` that also keeps the last ``SchedulerOutput`` (for ``admitted``)."""

    last_scheduler_output: Any = None

    def _schedule(self):
        self.last_scheduler_output = super()._schedule()
        return self.last_scheduler_output


@dataclass
class StepVerdict:
    """Outcome of one step scenario: ``failure`` None when the step spec and vLLM agreed
    throughout (``adapter.scenarios.Verdict`` is the candidate judge's verdict instead)."""

    steps: int = 0
    events: int = 0
    failure: str | None = None
    event_index: int | None = None
    rule: str | None = None  # the V-rule of the divergence (adapter/divergence.py)


def apply_event(harness: Harness, event: Event) -> StepTrace | None:
    """Apply one alphabet event to the real scheduler (Harness calls, see spec/events.py)."""
    if isinstance(event, AddRequest):
        user = None if event.user == "__anonymous__" else event.user
        harness.add_request(
            event.request_id,
            user,
            event.prompt_len,
            event.max_tokens,
            event.eos_index,
            priority=event.priority,
            lora=event.lora,
        )
        return None
    if isinstance(event, Abort):
        harness.abort(event.request_id)
        return None
    if isinstance(event, AdvanceClock):
        harness.advance(event.delta_ns)
        return None
    if isinstance(event, Step):
        return harness.step()
    if isinstance(event, ChangeRates):  # R21: through the candidate's rates file
        harness.change_rates(*event.rates())
        return None
    assert isinstance(event, Drain), f"unknown event {event!r}"
    return harness.drain()


def _diff(name: str, got: Any, want: Any) -> str | None:
    return None if got == want else f"{name}: vLLM {got!r} != spec {want!r}"


def compare_step(trace: StepTrace, harness: ObservedHarness, obs: Observation) -> str | None:
    """V1-V10: the step's batch and deliveries, as vLLM exposes them, against the spec."""
    so = harness.last_scheduler_output
    admitted = sorted(admitted_ids(so))
    finished = {f.request_id: (f.reason, f.num_output_tokens) for f in obs.finished}
    return (
        _diff("scheduled", list(trace.scheduled.items()), list(obs.scheduled))
        or _diff("sampled", trace.sampled, list(obs.sampled))
        or _diff("preempted", trace.preempted, sorted(obs.preempted))
        or _diff("admitted", admitted, sorted(obs.admitted))
        or _diff("finished", trace.finished, finished)
    )


def compare_state(harness: Harness, state: SchedulerState) -> str | None:
    """V5, V6, V8, V9: what vLLM holds after the event equals the spec state."""
    sched = harness.scheduler
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert len(sched.kv_holding_waiting) == 0, "no request in the modelled class keeps KV while waiting"
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    got = {
        r.request_id: (
            r.num_computed_tokens,
            r.num_output_tokens,
            r.num_output_placeholders,
            len(manager.req_to_blocks.get(r.request_id, ())),
        )
        for r in sched.requests.values()
    }
    want = {
        r.request_id: (r.num_computed_tokens, r.num_output_tokens, r.num_output_placeholders, r.num_blocks)
        for r in state.requests
    }
    return (
        _diff("running", running, list(state.running))
        or _diff("waiting", waiting, list(state.waiting))
        or _diff("free KV blocks", free, state.num_free_blocks)
        or _diff("requests (computed, outputs, placeholders, blocks)", got, want)
    )


def compare_event(
    event: Event, trace: StepTrace | None, harness: ObservedHarness, obs: Observation, finished_before: dict
) -> str | None:
    """Compare one event's effect (batch, deliveries, aborts) on vLLM and on the spec."""
    if isinstance(event, Step):
        assert trace is not None, "a Step event has the step's trace"
        return compare_step(trace, harness, obs)
    finished = {f.request_id: (f.reason, f.num_output_tokens) for f in obs.finished}
    got = {k: v for k, v in harness.finished.items() if k not in finished_before}
    return _diff("finished", got, finished)


ExtraCheck = Callable[[Event, StepTrace | None, Harness, Observation, SchedulerState], str | None]


def run_step_scenario(
    scheduler_cls: str,
    scenario: StepScenario,
    extra: ExtraCheck | None = None,
    style: Any = None,
    base: VllmVersionProfile | None = None,
) -> StepVerdict:
    """Run ``scenario`` on the spec and on ``scheduler_cls``; stop at the first difference.

    ``extra`` adds comparisons (the white-box check passes the rate-limit fields).
    ``style``: an ``adapter.configstyle.ConfigStyle`` (None: ``AdditionalConfigStyle``).
    ``base``: the vLLM release the spec's V-rules follow (``spec/versions.py``; None: the
    installed vLLM's, ``adapter/versions.py``). A failure's ``rule`` names its V-rule.
    R21: a scenario with ``ChangeRates`` events configures ``output_rate.rates_file`` (a
    temporary file) and ``Harness.change_rates`` rewrites it before the next step.
    """
    if not any(isinstance(event, ChangeRates) for event in scenario.events):
        return _run_step_scenario(scheduler_cls, scenario, engine_shape(scenario.config), extra, style, base)
    with tempfile.TemporaryDirectory(prefix="outrate-rates-") as directory:
        shape = engine_shape(scenario.config, rates_file=os.path.join(directory, "rates.json"))
        return _run_step_scenario(scheduler_cls, scenario, shape, extra, style, base)


def _run_step_scenario(
    scheduler_cls: str,
    scenario: StepScenario,
    shape: EngineShape,
    extra: ExtraCheck | None,
    style: Any,
    base: VllmVersionProfile | None,
) -> StepVerdict:
    harness = ObservedHarness(scheduler_cls, shape, style=style)
    state = initial_state(scenario.config, base if base is not None else installed_profile())
    history = invariants.DispatchHistory() if scenario.config.rate_limited else None
    verdict = StepVerdict()
    for index, event in enumerate(scenario.events):
        before = state
        state, obs = spec.step(state, event)
        verdict.events += 1
        if history is not None:
            history = invariants.advance_history(history, before, obs)
        violated = invariants.check(before, event, state, obs, history)
        if violated:
            verdict.failure, verdict.event_index = f"spec invariant {violated}", index
            verdict.rule = violated.split()[0]
            return verdict
        finished_before = dict(harness.finished)
        trace = apply_event(harness, event)
        verdict.steps += isinstance(event, Step)
        failure = (
            compare_event(event, trace, harness, obs, finished_before)
            or compare_state(harness, state)
            or (extra(event, trace, harness, obs, state) if extra is not None else None)
        )
        if failure:
            verdict.failure, verdict.event_index = failure, index
            verdict.rule = divergence.rule_of(
                failure, event, trace, harness, obs, state, scenario.config.async_scheduling
            )
            return verdict
    return verdict


def describe_failure(scenario: StepScenario, verdict: StepVerdict) -> list[str]:
    """The scenario lines up to (and marking) the first differing event."""
    lines = scenario.lines()
    if verdict.event_index is None:
        return lines
    head, events = lines[:1], lines[1:]
    shown = events[: verdict.event_index + 1]
    shown[-1] += "   <-- first difference"
    return head + shown


# -- the generated class -----------------------------------------------------------------
@dataclass(frozen=True)
class _Req:
    add: AddRequest
    at_step: int
    abort_at: int | None


@st.composite
def base_configs(draw, async_scheduling: bool, pressure: bool) -> EngineConfig:
    """Engine shapes. ``pressure``: few small KV blocks and several seats, so that
    running requests grow into a KV shortage and preempt each other (V6)."""
    max_num_seqs = draw(st.integers(2, 6) if pressure else st.integers(1, 6))
    chunked = draw(st.booleans())
    budget = draw(st.integers(8, 256))
    # vLLM: max_num_batched_tokens >= max_model_len without chunking.
    max_model_len = draw(st.sampled_from([2048, 2048, 66, 80, 128])) if chunked else budget
    if pressure:
        block_size, num_blocks = draw(st.sampled_from([4, 4, 8])), draw(st.integers(4, 14))
    else:
        block_size, num_blocks = draw(st.sampled_from([4, 8, 16])), draw(st.integers(4, 40))
    return EngineConfig(
        **drawn_engine_fields(
            draw, max_num_seqs, budget, chunked, block_size, num_blocks, async_scheduling, max_model_len
        )
    )


def drawn_engine_fields(
    draw,
    max_num_seqs: int,
    budget: int,
    chunked: bool,
    block_size: int,
    num_blocks: int,
    async_scheduling: bool,
    max_model_len: int,
) -> dict[str, Any]:
    """The engine part of a drawn ``EngineConfig`` (keyword arguments) from the drawn sizes;
    draws the active cap (None two times in three) and the policy (FCFS or PRIORITY), in
    that order. ``draw``: a Hypothesis ``draw`` (``st.composite``)."""
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_active_seqs": draw(st.one_of(st.none(), st.none(), st.integers(1, max_num_seqs))),
        "max_num_batched_tokens": budget,
        "chunked_prefill": chunked,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "async_scheduling": async_scheduling,
        "max_model_len": max_model_len,
    }


@st.composite
def request_plans(
    draw, config: EngineConfig, num_steps: int, users: tuple[str, ...], index: int, pressure: bool
) -> _Req:
    """One request: arrival step, sizes, EOS index, priority, maybe an abort.

    ``pressure``: early arrivals, short prompts, long outputs, few EOS and aborts, so that
    admitted requests (V8 needs only their current sequence to fit) outgrow the KV cache.
    """
    prompt_cap = min(64, config.max_model_len - 1)
    last_step = max(0, num_steps - 1)
    if pressure:
        at_step = draw(st.integers(0, min(6, last_step)))
        prompt_len = draw(st.integers(1, min(12, prompt_cap)))
        max_tokens = draw(st.integers(8, 20))
        eos_index = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 20)))
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(at_step, max(at_step, num_steps))))
    else:
        at_step = draw(st.integers(0, last_step))
        prompt_len = draw(st.integers(1, prompt_cap))
        max_tokens = draw(st.integers(1, 20))
        eos_index = draw(st.one_of(st.none(), st.integers(0, 20)))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(at_step, max(at_step, num_steps))))
    add = AddRequest(
        request_id=f"r{index}",
        user=draw(st.sampled_from(users)),
        # Under pressure, later arrivals often outrank earlier ones: PRIORITY then preempts
        # requests already served in the step (V6 budget give-back).
        priority=draw(st.one_of(st.just(max(0, 2 - index)), st.integers(0, 2)) if pressure else st.integers(0, 2)),
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        eos_index=eos_index,
    )
    return _Req(add, at_step, abort_at)


def build_events(
    plans: list[_Req], num_steps: int, drains: set[int], clock_ns: list[int] | None, final_drain: bool
) -> tuple[Event, ...]:
    """Lay the plans out on the step axis: before step s, arrivals then aborts of s."""
    events: list[Event] = []
    for s in range(num_steps):
        events.extend(p.add for p in plans if p.at_step == s)
        events.extend(Abort(p.add.request_id) for p in plans if p.abort_at == s)
        if s in drains:
            events.append(Drain())
        events.append(Step())
        if clock_ns is not None and clock_ns[s]:
            events.append(AdvanceClock(clock_ns[s]))
    events.extend(Abort(p.add.request_id) for p in plans if p.abort_at is not None and p.abort_at >= num_steps)
    if final_drain:
        events.append(Drain())
    return tuple(events)


@st.composite
def base_scenarios(draw, async_scheduling: bool, max_steps: int = 40) -> StepScenario:
    """Hypothesis strategy: the base-fidelity class (see module docstring, EXCLUSIONS).

    Half of the scenarios run under KV pressure (``base_configs``, ``request_plans``).
    """
    pressure = draw(st.booleans())
    config = draw(base_configs(async_scheduling, pressure))
    num_steps = draw(st.integers(min(20, max_steps) if pressure else 1, max_steps))
    num_requests = draw(st.integers(3, 6) if pressure else st.integers(1, 6))
    plans = [draw(request_plans(config, num_steps, ("u0", "u1"), i, pressure)) for i in range(num_requests)]
    drains = set(draw(st.lists(st.integers(0, num_steps - 1), max_size=2))) if async_scheduling else set()
    final_drain = async_scheduling and draw(st.booleans())
    return StepScenario(config, build_events(plans, num_steps, drains, None, final_drain))


@st.composite
def with_loras(draw, scenarios: st.SearchStrategy[StepScenario]) -> StepScenario:
    """V8 LoRA slots: a scenario of ``scenarios`` with ``max_loras`` 1 or 2 and each request
    on the base model or on one of ``max_loras + 1`` adapters (more adapters than slots,
    so admission skips for ``max_loras``). The draws come after the scenario's own, so
    ``base_scenarios`` and ``white_box_scenarios`` keep their examples."""
    scenario = draw(scenarios)
    max_loras = draw(st.integers(1, 2))
    events = tuple(
        replace(e, lora=draw(st.integers(0, max_loras + 1))) if isinstance(e, AddRequest) else e
        for e in scenario.events
    )
    return StepScenario(replace(scenario.config, max_loras=max_loras), events)


def base_scheduler_cls(async_scheduling: bool) -> str:
    """Stock vLLM: the class base fidelity judges the spec against."""
    return STOCK_ASYNC_SCHEDULER if async_scheduling else STOCK_SCHEDULER


def run_base(scenario: StepScenario, base: VllmVersionProfile | None = None) -> StepVerdict:
    """Base fidelity of one scenario on stock vLLM (feature off).

    ``base``: the release whose V-rules the spec follows (None: the installed vLLM's). A
    failure names its V-rule first (``V6: scheduled: vLLM ... != spec ...``).
    """
    assert not scenario.config.rate_limited, "base fidelity runs with the feature off"
    verdict = run_step_scenario(base_scheduler_cls(scenario.config.async_scheduling), scenario, base=base)
    if verdict.failure is not None and verdict.rule is not None:
        verdict.failure = f"{verdict.rule}: {verdict.failure}"
    return verdict
