"""One vLLM 0.32 V1 scheduling step, as an executable specification.

``step(state, event) -> (state, observation)`` is the whole model. It predicts, step for
step, what vLLM 0.32.0's ``Scheduler`` (sync) and ``AsyncScheduler`` (one step in flight)
do in the configuration class of ``spec/state.py`` (standard causal decoder, no prefix
caching, FCFS or PRIORITY, token budget, chunked prefill on or off, KV cache of N blocks,
``max_num_seqs``), and, with the feature on, what the rate-limited scheduler adds on top
(R7-R18, ``spec/rate.py``). This is our own model written from vLLM's observable
behaviour; it shares no code with vLLM.

Base behaviour of vLLM 0.32 (V-rules), the vocabulary of the whole spec:

| id | rule |
|---|---|
| V1 | Budget. One step's batch holds at most ``max_num_batched_tokens`` tokens. ``running`` is served first, then ``waiting``. |
| V2 | Running loop. ``running`` is visited in order until the budget is 0 or an allocation fails for good; a request given 0 tokens is skipped, later ones still served. |
| V3 | Async guard. A running request whose in-flight placeholders already carry it to ``max_tokens`` is skipped (no extra step past ``max_tokens``). |
| V4 | Chunk size. A running request gets ``num_tokens + placeholders - num_computed_tokens`` tokens, capped by the budget and by ``max_model_len - num_computed_tokens - 1``. |
| V5 | KV blocks. A request holds ``ceil(tokens / block_size)`` blocks for the tokens it has slots for; a chunk needs ``ceil(min(computed + n, max_model_len) / block_size) - held`` new blocks and fails if more than the free blocks. One block is vLLM's null block, never handed out. |
| V6 | Preemption. When a running request's allocation fails, a victim is preempted and the allocation retried: FCFS the last of ``running``, PRIORITY the max (priority, arrival). The victim frees all its blocks, restarts at 0 computed tokens, loses its placeholders, keeps its in-flight tokens as stale, and goes back to ``waiting`` (FCFS: at the front). A victim already scheduled in this step gives its tokens back to the budget. If the victim is the request itself, the running loop stops (0.32; 0.33 under PRIORITY: the loop continues with the next running request, ``priority_self_preemption_stops_running_loop``). |
| V7 | No admission in a step that preempted. |
| V8 | Waiting loop. ``waiting`` in queue order (FCFS: arrival, preempted in front; PRIORITY: (priority, arrival)). A request given 0 tokens at the last cap stops the loop (0.32) or is skipped (0.33, ``zero_token_waiting_stops_admission``). LoRA (``max_loras`` K): a request whose adapter is not among the counted adapters while K are counted is skipped; counted are the adapters of the running requests scheduled in this step (0.32) or of every running request (0.33, ``loras_counted_over_all_running``), plus those admitted in this step; after the running loop vLLM asserts that the scheduled running requests use at most K adapters. Stops when the budget is 0, when ``len(running)`` reaches the admission cap, when without chunked prefill the request's ``num_tokens`` exceed the budget left, or when the blocks of its whole sequence (``num_tokens``) are not free (vLLM's ``scheduler_reserve_full_isl``). Async: a request whose stale output is still in flight is skipped. An admitted request gets ``min(num_tokens, budget)`` tokens and blocks for that chunk. |
| V9 | After scheduling: ``num_computed_tokens`` += scheduled tokens; the chunk samples iff it reaches ``num_tokens + placeholders`` (a sampling dispatch); async: each sampling dispatch adds one placeholder. |
| V10 | Model output. Each sampling dispatch yields one token; on delivery it is appended (stale output too) and the request stops with ``stop`` at EOS, else ``length`` at ``max_tokens`` outputs or ``max_model_len`` tokens. A stopped request frees its blocks and leaves ``running``/``waiting``. Output for a request that already left is dropped. |
| V11 | Abort. A live request leaves at once (reason ``abort``), freeing its blocks. |
| V12 | Async pipeline. ``Step`` schedules step N+1 before delivering step N's output, so a request may be dispatched once more after its EOS. |

Where vLLM releases differ, the rule reads the release's value from ``state.base`` (a
``spec/versions.py`` profile, data passed in by the caller; default 0.32.0). Every decision
about a request is also recorded with its V-rule (``Cycle.decide``), so that a divergence
from vLLM can be named by rule.

Every function below cites the rules it implements. ``spec/rate.py`` holds R7-R16;
``spec/queues.py`` holds V6's preemption and ``waiting``'s order (V6, V8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from vllm_output_rate.spec import rate
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.queues import enqueue, preempt
from vllm_output_rate.spec.state import (
    ABORT,
    FCFS,
    LENGTH,
    PREEMPTED,
    RUNNING,
    STOP,
    WAITING,
    Cycle,
    Finished,
    Observation,
    OutputEntry,
    RequestState,
    SchedulerState,
    blocks_for,
    find,
    get,
    initial_state,
    put_request,
    with_blocks,
    with_request,
)


# -- the step ------------------------------------------------------------------------
def step(state: SchedulerState, event: Event) -> tuple[SchedulerState, Observation]:
    """Apply one event (``spec/events.py``) and say what it did."""
    if isinstance(event, AddRequest):
        return add_request(state, event), Observation(str(event), state.now_ns)
    if isinstance(event, Abort):
        return abort(state, event.request_id)
    if isinstance(event, AdvanceClock):
        # R16: time moves only by this event; the scheduler reads it once per cycle.
        return replace(state, now_ns=state.now_ns + event.delta_ns), Observation(str(event), state.now_ns)
    if isinstance(event, Step):
        return scheduling_step(state)
    if isinstance(event, ChangeRates):
        # R21: applied at the start of the next schedule(), at its clock reading (R16).
        assert state.config.rate_limited, "R21: rates can only change with the feature on (R18)"
        return replace(state, pending_rates=event.rates()), Observation(str(event), state.now_ns)
    assert isinstance(event, Drain), f"unknown event {event!r}"
    return drain(state)


def add_request(state: SchedulerState, event: AddRequest) -> SchedulerState:
    """V8: a new request joins ``waiting`` (FCFS: at the back; PRIORITY: by its key)."""
    assert find(state, event.request_id) is None, f"duplicate request id {event.request_id}"
    request = RequestState(
        request_id=event.request_id,
        user=event.user,
        priority=event.priority,
        arrival=state.num_arrivals,
        prompt_len=event.prompt_len,
        max_tokens=event.max_tokens,
        eos_index=event.eos_index,
        lora=event.lora,
    )
    assert event.lora == 0 or state.config.max_loras is not None, (
        f"V8: {event.request_id} names LoRA {event.lora} but LoRA is off (no max_loras)"
    )
    state = replace(state, requests=state.requests + (request,), num_arrivals=state.num_arrivals + 1)
    return replace(state, waiting=enqueue(state, request.request_id, front=False))


def abort(state: SchedulerState, request_id: str) -> tuple[SchedulerState, Observation]:
    """V11: a live request leaves with reason ``abort``; an unknown id changes nothing."""
    request = find(state, request_id)
    if request is None:
        return state, Observation(f"abort {request_id}", state.now_ns)
    state, finished = finish(state, request, ABORT)
    return state, Observation(f"abort {request_id}", state.now_ns, finished=(finished,))


def scheduling_step(state: SchedulerState) -> tuple[SchedulerState, Observation]:
    """V12: schedule, then deliver (sync: this step's output; async: the previous one)."""
    state, cycle, settled = schedule(state)
    state, output = commit(state, cycle)
    if state.config.async_scheduling:
        state, to_deliver = replace(state, in_flight=output), state.in_flight
    else:
        to_deliver = output
    state, finished = deliver(state, to_deliver or ())
    observation = Observation(
        event="step",
        now_ns=cycle.now_ns,
        scheduled=cycle.scheduled,
        sampled=tuple(e.request_id for e in output if e.sampled),
        preempted=cycle.preempted,
        admitted=cycle.admitted,
        finished=finished,
        delivered=to_deliver or (),
        scheduled_running=len(cycle.scheduled) - len(cycle.admitted),
        decided=cycle.decided,
        lora_victims=cycle.lora_victims,
        **settled,
    )
    return state, observation


def drain(state: SchedulerState) -> tuple[SchedulerState, Observation]:
    """V12: async only, deliver the output in flight and schedule nothing."""
    to_deliver = state.in_flight or ()
    state, finished = deliver(replace(state, in_flight=None), to_deliver)
    return state, Observation("drain", state.now_ns, finished=finished, delivered=to_deliver)


# -- schedule(): one cycle ----------------------------------------------------------
def schedule(state: SchedulerState) -> tuple[SchedulerState, Cycle, dict[str, Any]]:
    """V1-V8 (+ R6-R16 with the feature on): decide this step's batch.

    Returns the state after the loops (before V9), the cycle, and the rate-limit
    fields of the observation (empty with the feature off, R18).
    """
    if state.pending_rates is not None and state.config.rate_limited:
        state = rate.apply_rate_change(state)  # R21: at a step boundary, this cycle's clock
    cycle = Cycle(state=state, token_budget=state.config.max_num_batched_tokens, now_ns=state.now_ns)
    if state.config.rate_limited:
        cycle = rate.begin_cycle(cycle)  # R14, R13, R11
        cycle = rate.free_lora_slot(cycle)  # R13, LoRA
    cycle = running_loop(cycle)
    check_scheduled_loras(cycle)  # V8: vLLM's max_loras assertion
    cycle = waiting_loop(cycle)
    if not state.config.rate_limited:
        return cycle.state, cycle, {}
    new_state, settled = rate.end_cycle(cycle, dispatched=sampling_dispatches(cycle))  # R9, R15, R6, R16
    return new_state, replace(cycle, state=new_state), settled


def running_loop(cycle: Cycle) -> Cycle:
    """V2: visit ``running`` in order until the budget is spent or the loop halts.

    A request preempted by an earlier allocation of this loop is not visited. Requests the
    loop does not reach are recorded with the rule that ended it (V6 halt, V1 budget).
    """
    order = cycle.state.running
    for index, request_id in enumerate(order):
        if cycle.halted or cycle.token_budget == 0:
            rule = "V6" if cycle.halted else "V1"
            for rid in order[index:]:
                if rid in cycle.state.running:
                    cycle = cycle.decide(rid, rule)
            break
        if request_id in cycle.state.running:
            cycle = visit_running(cycle, request_id)
    return cycle


def visit_running(cycle: Cycle, request_id: str) -> Cycle:
    """V3, V4, V5, V6 (+ R7, R10-R12): give one running request its chunk, or skip it."""
    request = get(cycle.state, request_id)
    config = cycle.state.config
    if config.async_scheduling and max_tokens_in_flight(request):
        return cycle.decide(request_id, "V3")  # V3
    num_new_tokens = running_chunk_tokens(request, cycle)
    if config.rate_limited and num_new_tokens > 0:
        cycle, num_new_tokens = rate.decide_running(cycle, request, num_new_tokens)  # R7, R10-R12
    if num_new_tokens == 0:
        return cycle.decide(request_id, "V2")  # V2: skipped, later requests are still served
    cycle, allocated = allocate_running(cycle, request_id, num_new_tokens)
    if not allocated:
        # V6: it preempted itself. 0.32 (and FCFS, where it was the last of ``running``)
        # ends the loop; 0.33 under PRIORITY goes on with the next running request.
        if config.policy == FCFS or cycle.state.base.priority_self_preemption_stops_running_loop:
            return replace(cycle, halted=True)
        return cycle
    return add_scheduled(cycle, request_id, num_new_tokens).decide(request_id, "V4")


def max_tokens_in_flight(request: RequestState) -> bool:
    """V3: the in-flight placeholders already reach ``max_tokens`` (even if every
    placeholder were a real token, no further step is needed)."""
    return (
        request.num_output_placeholders > 0
        and request.num_computed_tokens + 2 - request.num_output_placeholders >= request.prompt_len + request.max_tokens
    )


def running_chunk_tokens(request: RequestState, cycle: Cycle) -> int:
    """V4: what a running request still needs, capped by the budget and ``max_model_len``."""
    wanted = request.sampling_position - request.num_computed_tokens
    room = cycle.state.config.max_model_len - request.num_computed_tokens - 1
    return max(min(wanted, cycle.token_budget, room), 0)


def allocate_running(cycle: Cycle, request_id: str, num_new_tokens: int) -> tuple[Cycle, bool]:
    """V5, V6: allocate the chunk's blocks, preempting victims until it fits.

    Returns (cycle, False) when the request itself was the victim. Bounded: every
    round removes one request from ``running``.
    """
    for _ in range(len(cycle.state.running) + 1):
        request = get(cycle.state, request_id)
        needed = max(
            blocks_for(request.num_computed_tokens + num_new_tokens, cycle.state.config) - request.num_blocks, 0
        )
        if needed <= cycle.state.num_free_blocks:
            state = with_blocks(cycle.state, request_id, request.num_blocks + needed)
            return replace(cycle, state=state), True
        victim = choose_victim(cycle, request_id)
        cycle = preempt(cycle, victim)
        if victim == request_id:
            return cycle, False
    raise AssertionError(f"V6: {request_id} still does not fit after preempting every running request")


def choose_victim(cycle: Cycle, request_id: str) -> str:
    """V6 (+ R13): the request to preempt when ``request_id``'s allocation fails."""
    if cycle.state.config.rate_limited:
        preferred = rate.preferred_victim(cycle, request_id)  # R13
        if preferred is not None:
            return preferred
    running = [get(cycle.state, rid) for rid in cycle.state.running]
    assert running, "V6: an allocation failed with nothing running"
    if cycle.state.config.policy == FCFS:
        return running[-1].request_id
    return max(running, key=lambda r: r.queue_key).request_id


def add_scheduled(cycle: Cycle, request_id: str, num_new_tokens: int) -> Cycle:
    """V1: the chunk joins the batch and spends its tokens."""
    assert 0 < num_new_tokens <= cycle.token_budget, f"V1: {num_new_tokens} tokens, budget {cycle.token_budget}"
    assert cycle.scheduled_tokens(request_id) == 0, f"V2: {request_id} scheduled twice in one step"
    return replace(
        cycle,
        token_budget=cycle.token_budget - num_new_tokens,
        scheduled=cycle.scheduled + ((request_id, num_new_tokens),),
    )


def lora_of(state: SchedulerState, request_id: str) -> int:
    """V8: the LoRA adapter id of a live request (0: the base model)."""
    return get(state, request_id).lora


def scheduled_running_loras(cycle: Cycle) -> frozenset[int]:
    """V8: the adapters (> 0) of the running requests scheduled so far in this cycle."""
    return frozenset(lora for rid, _ in cycle.scheduled if (lora := lora_of(cycle.state, rid)) > 0)


def check_scheduled_loras(cycle: Cycle) -> None:
    """V8: after the running loop vLLM asserts that its batch uses at most ``max_loras``
    adapters (vLLM 0.32 ``scheduler.py`` L897, 0.33 L1047: over every running request)."""
    limit = cycle.state.config.max_loras
    if limit is None:
        return
    used = counted_loras(cycle) if cycle.state.base.loras_counted_over_all_running else scheduled_running_loras(cycle)
    assert len(used) <= limit, f"V8: the running requests use adapters {sorted(used)} > max_loras={limit}"


def counted_loras(cycle: Cycle) -> frozenset[int]:
    """V8 (+ R11): the adapters the waiting loop's ``max_loras`` check counts now.

    Base: of the running requests scheduled in this cycle (0.32) or of every running
    request (0.33), plus the requests admitted so far in this cycle (both: they are
    scheduled and running). With the feature on, also the adapters of the requests
    throttled in this cycle (R11: a throttled request stays resident and keeps its
    adapter's slot; 0.32 alone would let another adapter in beside it, and the next step
    serving both would exceed ``max_loras``). With nothing throttled this is the base's
    count (R19).
    """
    state = cycle.state
    if state.base.loras_counted_over_all_running:
        ids: tuple[str, ...] = state.running
    else:
        ids = tuple(rid for rid, _ in cycle.scheduled)
    if state.config.rate_limited:
        ids += tuple(rid for rid in cycle.throttled if rid in state.running)
    return frozenset(lora for rid in ids if (lora := lora_of(state, rid)) > 0)


def lora_slot_free(cycle: Cycle, request: RequestState) -> bool:
    """V8: admitting ``request`` keeps the counted adapters within ``max_loras``."""
    limit = cycle.state.config.max_loras
    if limit is None or request.lora == 0:
        return True
    counted = counted_loras(cycle)
    return request.lora in counted or len(counted) < limit


def waiting_loop(cycle: Cycle) -> Cycle:
    """V7, V8: admit waiting requests in queue order until one stops the loop.

    V7 counts the running loop's preemptions only: R13's LoRA victims, preempted at the
    cycle start to free an adapter slot (``rate.free_lora_slot``), do not stop admission.
    """
    order = cycle.state.waiting
    if any(rid not in cycle.lora_victims for rid in cycle.preempted):
        # V7 (the requests this cycle preempted keep their V6)
        return replace(cycle, decided=cycle.decided + tuple((rid, "V7") for rid in order if rid not in cycle.preempted))
    for index, request_id in enumerate(order):
        cycle, go_on = visit_waiting(cycle, request_id)
        if not go_on:
            # The requests behind the one that stopped the loop are held back by the same rule.
            rule = cycle.decided[-1][1]
            return replace(cycle, decided=cycle.decided + tuple((rid, rule) for rid in order[index + 1 :]))
    return cycle


def admission_cap(cycle: Cycle) -> int:
    """V8 (+ R12): admit only while ``len(running)`` is below this."""
    if cycle.state.config.rate_limited:
        return rate.admission_cap(cycle)  # R12
    return cycle.state.config.upstream_admission_cap


def visit_waiting(cycle: Cycle, request_id: str) -> tuple[Cycle, bool]:
    """V8 (+ R7, R10, R13, R20): admit one waiting request, skip it, or stop the loop.

    Returns (cycle, go_on): go_on is False when the loop stops here. In order: the loop's
    limits (V1 budget, V8 admission cap), the feature's gates (``rate_gates``), the skips
    before a chunk is sized (``slot_skip``), then the first chunk (``admit_first_chunk``).
    """
    if cycle.token_budget == 0:
        return cycle.decide(request_id, "V1"), False
    if len(cycle.state.running) >= admission_cap(cycle):
        return cycle.decide(request_id, "V8"), False
    request = get(cycle.state, request_id)
    cycle, held = rate_gates(cycle, request)
    if held is not None:
        return cycle.decide(request_id, held), True
    skipped = slot_skip(cycle, request)
    if skipped is not None:
        return cycle.decide(request_id, skipped), True
    return admit_first_chunk(cycle, request)


def rate_gates(cycle: Cycle, request: RequestState) -> tuple[Cycle, str | None]:
    """R20, R10: with the feature on, the rule that skips a waiting request (a user at its
    residency cap, R20; a refused user, R10), or None to go on."""
    if not cycle.state.config.rate_limited:
        return cycle, None
    cycle, proceed = rate.residency_gate(cycle, request)  # R20: a user at its cap is skipped
    if not proceed:
        return cycle, "R20"
    cycle, proceed = rate.waiting_gate(cycle, request)  # R10: refused users skipped
    if not proceed:
        return cycle, "R10"
    return cycle, None


def slot_skip(cycle: Cycle, request: RequestState) -> str | None:
    """V8 (+ R13): the rule that skips a waiting request before its chunk is sized: its
    stale output still in flight (V8), no adapter slot (V8), or a new adapter slot for a
    refused user (R13); None to go on."""
    # V8: vLLM skips a waiting request whose stale output (V6) is still in flight. Only a
    # preemption makes output stale and the stale output is delivered right after that
    # cycle (V12); a cycle whose running loop preempts admits nothing (V7), so only R13's
    # LoRA victims (preempted at the cycle start, async) are ever skipped here.
    if request.num_stale_output_tokens > 0:
        assert request.request_id in cycle.lora_victims, f"V8: stale output in flight at admission: {request}"
        return "V8"
    assert request.num_computed_tokens == 0 and request.num_blocks == 0, f"V6/V8: {request}"
    if not lora_slot_free(cycle, request):
        return "V8"  # V8: max_loras adapters counted, skipped
    if cycle.state.config.rate_limited and not rate.lora_gate(cycle, request, counted_loras(cycle)):
        return "R13"  # R13: a refused user takes no new adapter slot
    return None


def admit_first_chunk(cycle: Cycle, request: RequestState) -> tuple[Cycle, bool]:
    """V8 (+ R7, R10): size a waiting request's first chunk and admit it, or stop the loop
    (a prompt longer than the budget without chunked prefill; its whole sequence's blocks
    not free, V5). Returns (cycle, go_on)."""
    config = cycle.state.config
    request_id = request.request_id
    if not config.chunked_prefill and request.num_tokens > cycle.token_budget:
        return cycle.decide(request_id, "V8"), False
    num_new_tokens = min(request.num_tokens, cycle.token_budget)
    if config.rate_limited:
        cycle, num_new_tokens = rate.decide_waiting(cycle, request, num_new_tokens)  # R7, R10
    if num_new_tokens == 0:
        # V8: 0 tokens at the last cap: 0.32 stops admission, 0.33 skips only this request.
        # Not reached in the modelled class (decide_waiting never gives 0); the reference
        # reaches vLLM's version of this point (reference/scheduler.py, R10).
        return cycle.decide(request_id, "V8"), not cycle.state.base.zero_token_waiting_stops_admission
    if blocks_for(request.num_tokens, config) > cycle.state.num_free_blocks:
        return cycle.decide(request_id, "V5"), False  # V8: the whole sequence must fit
    return admit(cycle, request_id, num_new_tokens).decide(request_id, "V8"), True


def admit(cycle: Cycle, request_id: str, num_new_tokens: int) -> Cycle:
    """V8: move a waiting request to the end of ``running`` with its first chunk."""
    needed = blocks_for(num_new_tokens, cycle.state.config)
    state = with_blocks(cycle.state, request_id, needed, status=RUNNING)
    state = replace(
        state,
        running=state.running + (request_id,),
        waiting=tuple(rid for rid in state.waiting if rid != request_id),
    )
    cycle = replace(cycle, state=state, admitted=cycle.admitted + (request_id,))
    return add_scheduled(cycle, request_id, num_new_tokens)


def sampling_dispatches(cycle: Cycle) -> frozenset[str]:
    """V9 / R7: scheduled requests whose chunk reaches the sampling position."""
    return frozenset(
        rid
        for rid, n in cycle.scheduled
        if get(cycle.state, rid).num_computed_tokens + n >= get(cycle.state, rid).sampling_position
    )


# -- after schedule(): V9 ------------------------------------------------------------
def commit(state: SchedulerState, cycle: Cycle) -> tuple[SchedulerState, tuple[OutputEntry, ...]]:
    """V9: advance ``num_computed_tokens`` and fabricate the model output of the batch.

    The fabricated model samples EOS at the request's ``eos_index``-th sampling dispatch.
    """
    output = []
    for request_id, num_tokens in cycle.scheduled:
        request = get(state, request_id)
        samples = request.num_computed_tokens + num_tokens >= request.sampling_position
        eos = samples and request.num_sampling_dispatches == request.eos_index
        placeholders = 1 if samples and state.config.async_scheduling else 0
        state = put_request(
            state,
            replace(
                request,
                num_computed_tokens=request.num_computed_tokens + num_tokens,
                num_in_flight_tokens=request.num_in_flight_tokens + num_tokens,
                num_output_placeholders=request.num_output_placeholders + placeholders,
                num_sampling_dispatches=request.num_sampling_dispatches + (1 if samples else 0),
            ),
        )
        output.append(OutputEntry(request_id, num_tokens, samples, eos))
    return state, tuple(output)


# -- update_from_output(): V10 ------------------------------------------------------
def deliver(state: SchedulerState, output: tuple[OutputEntry, ...]) -> tuple[SchedulerState, tuple[Finished, ...]]:
    """V10: apply one step's model output, in batch order; return who finished."""
    finished = []
    for entry in output:
        request = find(state, entry.request_id)
        if request is None:
            continue  # V10/V12: it left while its output was in flight
        state, done = deliver_one(state, request, entry)
        if done is not None:
            finished.append(done)
    return state, tuple(finished)


def deliver_one(
    state: SchedulerState, request: RequestState, entry: OutputEntry
) -> tuple[SchedulerState, Finished | None]:
    """V10: one request's part of the output: settle in-flight tokens, append, check stop."""
    stale = request.num_stale_output_tokens > 0
    assert request.num_in_flight_tokens >= entry.num_scheduled_tokens, f"V9: in-flight underflow {request}"
    assert not stale or request.num_stale_output_tokens >= entry.num_scheduled_tokens, f"V6: stale underflow {request}"
    request = replace(
        request,
        num_in_flight_tokens=request.num_in_flight_tokens - entry.num_scheduled_tokens,
        num_stale_output_tokens=request.num_stale_output_tokens - (entry.num_scheduled_tokens if stale else 0),
    )
    if entry.sampled:
        # V10: a stale token is appended too, but its placeholder was already dropped (V6).
        drop_placeholder = state.config.async_scheduling and not stale
        assert not drop_placeholder or request.num_output_placeholders > 0, f"V9: no placeholder for {request}"
        request = replace(
            request,
            num_output_tokens=request.num_output_tokens + 1,
            num_output_placeholders=request.num_output_placeholders - (1 if drop_placeholder else 0),
        )
    state = with_request(state, request.request_id, lambda _: request)
    reason = stop_reason(request, entry, state.config.max_model_len) if entry.sampled else None
    if reason is None:
        return state, None
    return finish(state, request, reason)


def stop_reason(request: RequestState, entry: OutputEntry, max_model_len: int) -> str | None:
    """V10: ``stop`` at EOS, else ``length`` at ``max_tokens`` outputs or ``max_model_len``."""
    if entry.eos:
        return STOP
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        return LENGTH
    return None


def finish(state: SchedulerState, request: RequestState, reason: str) -> tuple[SchedulerState, Finished]:
    """V10, V11: the request leaves: its blocks are freed, it leaves every queue."""
    rid = request.request_id
    assert request.status in (RUNNING, PREEMPTED, WAITING), request
    state = replace(
        state,
        requests=tuple(r for r in state.requests if r.request_id != rid),
        running=tuple(x for x in state.running if x != rid),
        waiting=tuple(x for x in state.waiting if x != rid),
        num_free_blocks=state.num_free_blocks + request.num_blocks,
    )
    return state, Finished(rid, reason, request.num_output_tokens)


def run(state: SchedulerState, events: Iterable[Event]) -> tuple[SchedulerState, list[Observation]]:
    """Apply ``events`` in order; return the final state and one observation per event."""
    observations = []
    for event in events:
        state, observation = step(state, event)
        observations.append(observation)
    return state, observations


__all__ = ["WAITING", "commit", "deliver", "initial_state", "run", "schedule", "step"]
