"""Name the V-rule of a base-fidelity divergence (spec vs real vLLM after one event).

``run_step_scenario`` (``adapter/fidelity.py``) stops at the first event where vLLM and the
spec differ and says which field differed. This module turns that into a V-rule id:

- a difference in the step's batch (``scheduled``, ``sampled``, ``preempted``,
  ``admitted``) names the rule of the spec's own decision about the first request on which
  the two sides differ (``Observation.decided``: why the spec scheduled, skipped,
  preempted, admitted or did not reach it); e.g. vLLM schedules ``r2`` while the spec's
  running loop had stopped at a self-preemption before it: V6. When the spec served a
  request that vLLM did not serve at all, vLLM stopped earlier: the rule is the spec's
  nearest earlier decision that was not a plain serve (the same V6 seen from 0.32);
- deliveries and finishes name V10 (sync), V12 (async), V11 (abort);
- state differences name the rule that owns the field: KV blocks V5, computed tokens and
  placeholders V9, outputs V10, ``running``/``waiting`` the spec's decision about the first
  request out of place (else V8);
- a spec invariant names its own id.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.adapter.vllm_compat import admitted_ids
from vllm_output_rate.spec.events import Abort, Drain, Event, Step
from vllm_output_rate.spec.state import Observation, SchedulerState

# The rule a batch field names when the spec recorded no decision for the request.
_FIELD_RULE = {"scheduled": "V2", "sampled": "V9", "preempted": "V6", "admitted": "V8"}


def _decision(obs: Observation, request_id: str) -> str | None:
    rule = None
    for rid, r in obs.decided:
        if rid == request_id:
            rule = r  # the last decision wins (scheduled, then preempted: V6)
    return rule if rule is None or rule.startswith("V") else None


def _first_out_of_place(got: list, want: list) -> list[str]:
    """Ids at the first position where two ordered lists differ (either side), then the rest
    of the symmetric difference."""
    ids: list[str] = []
    for a, b in zip(got, want):
        if a != b:
            ids += [x[0] if isinstance(x, tuple) else x for x in (a, b)]
            break
    else:
        longer = got[len(want) :] or want[len(got) :]
        ids += [x[0] if isinstance(x, tuple) else x for x in longer[:1]]
    norm = lambda xs: {x[0] if isinstance(x, tuple) else x for x in xs}
    ids += sorted(norm(got) ^ norm(want))
    return ids


def _by_decision(obs: Observation, ids: list[str], default: str, vllm_ids: set[str] | None = None) -> str:
    """The rule of the spec's decision about the first of ``ids`` it decided on.

    If the spec served that request (V4 scheduled, V8 admitted) and vLLM did not serve it at
    all (``vllm_ids``), vLLM stopped before it: the cause is the spec's nearest earlier
    decision that was not a plain serve (e.g. the V6 self-preemption 0.32 stops at).
    """
    for rid in ids:
        rule = _decision(obs, rid)
        if rule is None:
            continue
        if rule in ("V4", "V8") and vllm_ids is not None and rid not in vllm_ids:
            trail = list(obs.decided)
            last = max(i for i, (r, _) in enumerate(trail) if r == rid)
            for _, earlier in reversed(trail[:last]):
                if earlier.startswith("V") and earlier not in ("V4", "V8"):
                    return earlier
        return rule
    return default


def batch_lists(trace: Any, scheduler_output: Any, obs: Observation) -> dict[str, tuple[list, list]]:
    """(vLLM, spec) per batch field, in the form ``compare_step`` compares them."""
    admitted = sorted(admitted_ids(scheduler_output))
    return {
        "scheduled": (list(trace.scheduled.items()), list(obs.scheduled)),
        "sampled": (list(trace.sampled), list(obs.sampled)),
        "preempted": (list(trace.preempted), sorted(obs.preempted)),
        "admitted": (admitted, sorted(obs.admitted)),
    }


def rule_of(
    failure: str,
    event: Event,
    trace: Any,
    harness: Any,
    obs: Observation,
    state: SchedulerState,
    async_scheduling: bool,
) -> str:
    """The V-rule (or invariant id) a divergence found by ``run_step_scenario`` belongs to.

    ``failure``: its message (``"<field>: vLLM ... != spec ..."`` or ``"spec invariant ..."``).
    """
    if failure.startswith("spec invariant "):
        return failure.split()[2]
    field = failure.split(":", 1)[0]
    if field in _FIELD_RULE and isinstance(event, Step):
        got, want = batch_lists(trace, harness.last_scheduler_output, obs)[field]
        vllm_ids = {x[0] if isinstance(x, tuple) else x for x in got}
        return _by_decision(obs, _first_out_of_place(got, want), _FIELD_RULE[field], vllm_ids)
    if field == "finished":
        if isinstance(event, Abort):
            return "V11"
        if isinstance(event, Drain) or async_scheduling:
            return "V12"
        return "V10"
    if field in ("running", "waiting"):
        sched = harness.scheduler
        got = [r.request_id for r in (sched.running if field == "running" else sched.waiting)]
        want = list(state.running if field == "running" else state.waiting)
        return _by_decision(obs, _first_out_of_place(got, want), "V8")
    if field == "free KV blocks":
        return "V5"
    if field.startswith("requests"):
        return _request_field_rule(harness, state)
    return "V?"


def _request_field_rule(harness: Any, state: SchedulerState) -> str:
    """V9 (computed, placeholders), V10 (outputs), V5 (blocks) by the first differing counter."""
    sched = harness.scheduler
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    spec_requests = {r.request_id: r for r in state.requests}
    for rid, r in sched.requests.items():
        want = spec_requests.get(rid)
        if want is None:
            return "V10"  # vLLM keeps a request the spec finished
        got = (
            r.num_computed_tokens,
            r.num_output_tokens,
            r.num_output_placeholders,
            len(manager.req_to_blocks.get(rid, ())),
        )
        spec = (want.num_computed_tokens, want.num_output_tokens, want.num_output_placeholders, want.num_blocks)
        for rule, a, b in zip(("V9", "V10", "V9", "V5"), got, spec):
            if a != b:
                return rule
    return "V10"  # the spec keeps a request vLLM finished
