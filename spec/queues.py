"""V6, V8: a request moved back into ``waiting``, and ``waiting``'s order.

``preempt`` (V6) takes a running request out of ``running``, frees its KV blocks, resets
it and puts it back in ``waiting``; ``enqueue`` (V6, V8) places a request in ``waiting``
(FCFS: at the front or the back; PRIORITY: by (priority, arrival)). The scheduling step
(``spec/scheduler.py``) preempts when an allocation fails and enqueues new requests; the
rate-limited step (``spec/rate.py``, R13) preempts to free a LoRA adapter's slot. Both
build on this module, which imports nothing of spec/ but ``state``.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_output_rate.spec.state import FCFS, PREEMPTED, RUNNING, Cycle, SchedulerState, get, with_blocks


def preempt(cycle: Cycle, victim_id: str) -> Cycle:
    """V6: preempt ``victim_id``: free its blocks, reset it, put it back in ``waiting``.

    Tokens it was scheduled in this cycle return to the budget (PRIORITY only: an FCFS
    victim is never one already served).
    """
    victim = get(cycle.state, victim_id)
    assert victim.status == RUNNING, f"V6: only running requests are preempted, {victim_id} is {victim.status}"
    state = replace(cycle.state, running=tuple(rid for rid in cycle.state.running if rid != victim_id))
    state = with_blocks(
        state,
        victim_id,
        0,
        status=PREEMPTED,
        num_computed_tokens=0,
        num_output_placeholders=0,
        num_stale_output_tokens=victim.num_in_flight_tokens,
        num_preemptions=victim.num_preemptions + 1,
    )
    state = replace(state, waiting=enqueue(state, victim_id, front=True))
    returned = cycle.scheduled_tokens(victim_id)
    return replace(
        cycle,
        state=state,
        token_budget=cycle.token_budget + returned,
        scheduled=tuple((rid, n) for rid, n in cycle.scheduled if rid != victim_id),
        preempted=cycle.preempted + (victim_id,),
        throttled=cycle.throttled - {victim_id},  # R11/R12: no longer resident
        decided=cycle.decided + ((victim_id, "V6"),),
    )


def enqueue(state: SchedulerState, request_id: str, front: bool) -> tuple[str, ...]:
    """V6, V8: ``waiting`` with ``request_id`` added (FCFS: front or back; PRIORITY: by key)."""
    assert request_id not in state.waiting, f"{request_id} queued twice"
    if state.config.policy == FCFS:
        return (request_id,) + state.waiting if front else state.waiting + (request_id,)
    ids = state.waiting + (request_id,)
    return tuple(sorted(ids, key=lambda rid: get(state, rid).queue_key))
