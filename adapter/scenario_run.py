"""Running a rate-limit ``Scenario`` (``adapter/scenarios.py``) on a scheduler class:
``run_scenario`` builds its ``Harness`` (``build_harness``), adds and aborts its requests
before their steps (n > 1 children as vLLM's front end builds them, ``parallel_children``),
steps it on the fake clock, has the scenario judge (``adapter/judge.py``) judge every step,
and drains it; ``minimize`` makes a failing scenario 1-minimal.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.judge import _Judge
from vllm_output_rate.adapter.levels import includes
from vllm_output_rate.adapter.scenarios import (
    DRAIN_IDLE_NS,
    DRAIN_STEP_LIMIT,
    RequestSpec,
    Scenario,
    Verdict,
    spec_limiter_user,
)
from vllm_output_rate.adapter.tinymodel import EOS_TOKEN_ID
from vllm_output_rate.spec import limiter as spec_limiter


def build_harness(scheduler_cls: str, scenario: Scenario, style=None, output_rate_extra=None):
    """A ``Harness`` for ``scenario`` with ample resources (only the limit can pause).

    ``style``: an ``adapter.configstyle.ConfigStyle`` (None: ``AdditionalConfigStyle``).
    ``output_rate_extra``: keys added to the scenario's ``output_rate`` section (the gate's
    ``shadow/*`` check adds ``{"shadow": True}``); feature on only.
    Raises ``ValueError`` when the style cannot express the scenario's rates.
    """
    shape = EngineShape(
        max_num_seqs=scenario.max_num_seqs or max(len(scenario.requests), 1),
        max_num_active_seqs=scenario.max_num_active_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens or 2048,
        chunked_prefill=scenario.chunked_prefill,
        block_size=scenario.block_size,
        num_blocks=scenario.num_blocks or 4096,
        policy=scenario.policy,
        async_scheduling=scenario.async_scheduling,
        output_rate=scenario.output_rate_config(),
        enable_prefix_caching=scenario.prefix_caching,
    )
    if output_rate_extra:
        if shape.output_rate is None:
            raise ValueError(f"output_rate_extra {output_rate_extra!r} needs a scenario with the feature on")
        shape = replace(shape, output_rate={**shape.output_rate, **output_rate_extra})
    return Harness(scheduler_cls, shape, style=style)


def run_scenario(
    scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None, attribute: bool = False
) -> Verdict:
    """Run ``scenario`` on ``scheduler_cls``; stop at the first failing property.

    ``attribute``: a failure of the dispatch replay (over-grant, window bound, under-grant)
    is named by the rule it breaks (``adapter/attribution.py``): the run goes on to its end
    recording what the candidate does (judging nothing more), and the one-rule change of
    the spec limiter that explains the whole history names the rule; without it (the
    cheap default, for hunting and shrinking) the property's own rule is named.

    ``level`` (``adapter/levels.py``) chooses which properties are judged, each tagged with
    its level in the verdict:

    - must: R2/R7 every sampling dispatch granted by the spec limiter at its instant;
      R2 window bound; R11/P3 every request ends with exactly its outputs; in ample sync
      scenarios P4 no under-grant (a request of a user the limiter still grants is not
      paused, unless the active cap is full).
    - should: R11 throttled requests stay resident (no preemption in ample scenarios);
      R12 scheduled running requests <= the active cap; R14 a user's streams take turns
      (bounded bypass, ``R14_BYPASS_FACTOR``).
    - exact: the white-box invariants on the scheduler's ``last_step_observation``.

    ``style``: how the candidate is configured (``adapter/configstyle.py``; None: through
    ``additional_config["output_rate"]``).
    """
    harness = (
        build_harness(scheduler_cls, scenario, style) if style is not None else build_harness(scheduler_cls, scenario)
    )
    judge = _Judge(scenario, harness, level)
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    aborts = scenario.abort_schedule()
    children = parallel_children(scenario.requests)
    rate_failure: tuple[tuple[str, str, str], int] | None = None  # kept while the rest is recorded
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        judge.aborted_in_flight = _arrivals_and_aborts(harness, pending, aborts, step, children)
        if step >= scenario.num_steps and not pending and not aborts and len(harness.finished) == len(judge.by_id):
            break
        unfinished = [rid for rid in harness.num_outputs if rid not in harness.finished]
        resident = {r.request_id for r in harness.scheduler.running}
        judge.before_step()
        if rate_failure is not None:  # naming the rule: record the rest of the run, judge nothing
            try:
                trace = harness.step()
            except Exception:  # a later crash of the candidate: name the rule from the record so far
                break
            judge.record_only(step, trace, unfinished, resident)
        else:
            held = judge.crash_triggers() if attribute else []
            try:
                trace = harness.step()
            except Exception as exc:
                crash = judge.crash_verdict(step, exc, held) if attribute else None
                if crash is None:
                    raise
                return crash
            judge.triggers_seen.update(held)
            failure = judge.after_step(step, trace, unfinished, resident)
            if failure:
                if not (attribute and judge.nameable):
                    return Verdict(judge.steps, failure[2], failure[0], step, level=failure[1])
                rate_failure = failure, step
        harness.advance(_next_advance_ns(scenario, step, trace, judge.state, judge.by_id, harness))
    return _final_verdict(judge, harness, level, attribute, rate_failure)


def parallel_children(requests: tuple[RequestSpec, ...] | list[RequestSpec]) -> dict[str, Any]:
    """n > 1 (R17): request id -> the ``SamplingParams`` of each child request, built as
    vLLM's front end builds them: one ``SamplingParams`` of the parent (its user in
    ``extra_args["output_rate_user"]``, ``n`` = its children) handed to vLLM's
    ``ParentRequest``, whose children share one copy of it (and so one ``extra_args`` dict).
    Children of one parent have the same user and ``max_tokens``. Requests without a
    ``parent`` are not in the map. Call once per harness: the copies are live objects."""
    from vllm import SamplingParams  # deferred: vLLM costs ~7 s to import
    from vllm.v1.engine import EngineCoreRequest  # deferred: vLLM costs ~7 s to import
    from vllm.v1.engine.parallel_sampling import ParentRequest  # deferred: vLLM costs ~7 s to import

    families: dict[str, list[RequestSpec]] = {}
    for r in requests:
        if r.parent is not None:
            families.setdefault(r.parent, []).append(r)
    out: dict[str, Any] = {}
    for parent_id, children in families.items():
        first = children[0]
        extra = None if first.user is None else {"output_rate_user": first.user}
        params = SamplingParams(n=len(children), max_tokens=first.max_tokens, extra_args=extra)
        params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
        parent = ParentRequest(
            EngineCoreRequest(
                request_id=parent_id,
                prompt_token_ids=None,
                mm_features=None,
                sampling_params=params,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
                external_req_id=parent_id,
            )
        )
        for index, child in enumerate(children):
            out[child.request_id] = parent.get_child_info(index)[1]
    return out


def add_spec(harness: Any, r: RequestSpec, children: dict[str, Any]) -> None:
    """Add request ``r`` to ``harness`` (an n > 1 child with its shared ``SamplingParams``
    from ``children``, ``parallel_children``)."""
    harness.add_request(
        r.request_id,
        r.user,
        r.prompt_len,
        r.max_tokens,
        r.eos_index,
        r.priority,
        sampling_params=children.get(r.request_id),
    )


def _arrivals_and_aborts(
    harness: Any,
    pending: list[RequestSpec],
    aborts: list[tuple[int, RequestSpec]],
    step: int,
    children: dict[str, Any] | None = None,
) -> list[str]:
    """Before ``step``: add the requests that arrive by then and abort the ones due (a
    request is never aborted in the step it arrives); both lists are consumed in order.
    ``children``: the n > 1 children's shared params (``parallel_children``).
    Returns the requests aborted with a step still in flight (vLLM's output placeholders)."""
    while pending and pending[0].at_step <= step:
        add_spec(harness, pending.pop(0), children or {})
    in_flight = []
    while aborts and aborts[0][0] <= step and aborts[0][1].at_step < step:
        rid = aborts.pop(0)[1].request_id
        request = harness.scheduler.requests.get(rid)
        if request is not None and getattr(request, "num_output_placeholders", 0) > 0:
            in_flight.append(rid)
        harness.abort(rid)
    return in_flight


def _final_verdict(
    judge: _Judge, harness: Any, level: str, attribute: bool, rate_failure: tuple[tuple[str, str, str], int] | None
) -> Verdict:
    """The verdict after the stepping loop: the rate failure kept for naming (with the
    run's history), else a request cut short after the drain, else a pass with each
    user's sampled tokens."""
    if rate_failure is not None:
        (rule, failed_level, text), step = rate_failure
        return Verdict(judge.steps, text, rule, step, level=failed_level, history=judge.naming_history())
    harness.drain()
    cut = _cut_request(judge, harness)
    if cut is not None:
        return cut
    assert includes(level, "must")
    return Verdict(
        judge.steps,
        None,
        sampled_per_user={u: len(t) for u, t in judge.history.items()},
        history=judge.naming_history() if attribute else None,
    )


def _cut_request(judge: _Judge, harness: Any) -> Verdict | None:
    """R11/P3 after the drain: the first request (not aborted) that did not end with exactly
    its outputs (``max_tokens``, or up to its EOS), as a failed verdict; None if all did."""
    for rid, r in judge.by_id.items():
        got = harness.finished.get(rid)
        if got is not None and got[0] == "abort":
            continue
        expected = r.max_tokens if r.eos_index is None or r.eos_index >= r.max_tokens else r.eos_index + 1
        if got is None or got[1] != expected:
            return Verdict(
                judge.steps,
                f"{judge.name}: {rid} ended with {got} but must end with {expected} "
                "outputs: the article pauses a request, it never cuts or fails it",
                "R11",
                None,
                level="must",
            )
    return None


def _next_advance_ns(scenario, step, trace, state, by_id, harness) -> int:
    """The scenario's clock step; after its last step, an idle step jumps to the next
    instant at which the spec limiter grants one of the waiting users (drain phase)."""
    interval = scenario.step_interval_ns
    if scenario.advances_ns is not None and step < len(scenario.advances_ns):
        return scenario.advances_ns[step]
    if step < scenario.num_steps or trace.sampled or trace.scheduled:
        return interval
    users = {spec_limiter_user(by_id[rid].user) for rid in harness.num_outputs if rid not in harness.finished}
    ready = [
        t
        for u in users
        if (t := spec_limiter.ready_at_ns(state, u, scenario.burst_ns)) is not None and t > trace.now_ns
    ]
    # A candidate may be more conservative than the spec replay (R8: async over-charges are
    # allowed): when the spec says "ready now" and nothing ran, move on by DRAIN_IDLE_NS.
    return max(interval, min(ready) - trace.now_ns) if ready else max(interval, DRAIN_IDLE_NS)


def minimize(scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None, run=None) -> Scenario:
    """Make a failing scenario 1-minimal: drop single requests, aborts and trailing steps
    while it still fails (after Hypothesis's own shrinking). ``run(scenario) -> Verdict``
    replaces ``run_scenario`` (the feature-off comparison uses its own)."""
    if run is None:

        def run(candidate: Scenario) -> Verdict:
            return run_scenario(scheduler_cls, candidate, level, style)

    def fails(candidate: Scenario) -> bool:
        return bool(candidate.requests) and run(candidate).failure is not None

    assert fails(scenario), "minimize() needs a failing scenario"
    progress = True
    while progress:
        progress = False
        for i, request in enumerate(scenario.requests):
            smaller = [
                replace(scenario, requests=scenario.requests[:i] + scenario.requests[i + 1 :]),
                replace(
                    scenario,
                    requests=scenario.requests[:i]
                    + (replace(request, abort_at_step=None),)
                    + scenario.requests[i + 1 :],
                )
                if request.abort_at_step is not None
                else None,
            ]
            for candidate in smaller:
                if candidate is not None and fails(candidate):
                    scenario, progress = candidate, True
                    break
            if progress:
                break
    step = run(scenario).step
    if step is not None and step + 1 < scenario.num_steps:
        candidate = replace(scenario, num_steps=step + 1)
        if fails(candidate):
            scenario = candidate
    return scenario
