"""The rate-limit layer of one scheduling cycle: rules R6-R16 and R19 on top of V1-V12.

``spec/scheduler.py`` calls these functions only with the feature on (R18: with it off,
the cycle is vLLM's own). Each one decides one thing at one point of the cycle:

| point of the cycle (V-rule) | function | rules |
|---|---|---|
| start of ``schedule()`` | ``begin_cycle`` | R16 (one clock reading), R14 turn order, R13/R11 throttled at start |
| running loop, last cap on a chunk (V4) | ``decide_running`` | R12 active cap, R7 charge, R10 cap at n-1, R11 skip |
| waiting loop, before a request is sized (V8) | ``waiting_gate`` | R10: refused users' requests skipped, never blocking others |
| waiting loop, last cap on a chunk (V8) | ``decide_waiting`` | R7 charge, R10 cap at n-1 |
| waiting loop, admission cap (V8) | ``admission_cap`` | R12 |
| waiting loop, before a request is sized (V8) | ``residency_gate`` | R20: a user at its residency cap is skipped |
| preemption (V6) | ``preferred_victim`` | R13 |
| end of ``schedule()`` | ``end_cycle`` | R9 single refund point, R15 last served, R6 cleanup, R16 wait hint, R19 |
| before the cycle, a rate change pending | ``apply_rate_change`` | R21 |

R19: no function here reorders ``running`` or changes a chunk unless a limit binds
(``limit_binds``); then the cycle is the base scheduler's (V1-V12) from the same state.

The limiter is ``spec.limiter`` (R1-R5, exact rationals). A user refused once in a cycle
is not asked again in that cycle: grants only push TAT up, so a refusal holds for the
whole cycle (R2).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.queues import preempt  # the V6 preemption, shared with spec/scheduler.py
from vllm_output_rate.spec.state import (
    CLEANUP_INTERVAL_STEPS,
    FCFS,
    Cycle,
    RequestState,
    SchedulerState,
    get,
)


# -- R21: a rate change, at the start of a cycle -----------------------------------------
def apply_rate_change(state: SchedulerState) -> SchedulerState:
    """R21: install ``state.pending_rates`` at the cycle's clock reading, before R14/R2.

    Every user with a TAT whose rate changes keeps its lead in tokens
    (``limiter.change_rates``); the configuration gets the new table. Applied only here,
    at the start of ``schedule()``, so no decision of a cycle ever sees two rates.
    """
    assert state.pending_rates is not None, "R21: called with a rate change pending"
    default, overrides = state.pending_rates
    old = state.config
    new = old.with_rates(default, overrides)
    limiter = spec_limiter.change_rates(state.limiter, old.rate_of, new.rate_of, state.now_ns)
    return replace(state, config=new, limiter=limiter, pending_rates=None)


# -- start of the cycle ----------------------------------------------------------------
def begin_cycle(cycle: Cycle) -> Cycle:
    """R14, R13, R11: the turn order, then the requests throttled at the start.

    ``running`` is not reordered (R14, R19): the turn order only decides which of a
    user's decoding streams receive that user's grants when they do not cover them all.
    """
    order = turn_order(cycle.state)
    state = replace(cycle.state, turns=order)  # R14: the rotated order persists
    at_start, refused, held = start_turns(state, order)
    return replace(
        cycle,
        state=state,
        turn_order=order,
        throttled_at_start=at_start,
        throttled=frozenset(at_start),  # R11/R12: resident, skipped, not active
        refused_users=refused,  # R2: refused for the whole cycle; R16
        held_users=held,  # R14: granted, but not for every stream; R16
    )


def turn_order(state: SchedulerState) -> tuple[str, ...]:
    """R14: the running requests in the order in which they take turns.

    The order the last cycle left (``state.turns``, without requests no longer running),
    then the running requests new to it in ``running`` order; within it, each (user,
    priority) group's streams are rotated within the group's own places so that the
    stream after the group's last-served one comes first. This is the order the article
    gives ``running`` itself; here it is only a preference, and ``running`` keeps vLLM's
    order (R19). Decision: if the last-served stream is no longer running (or is already
    last), the group keeps its order.
    """
    running = set(state.running)
    kept = [rid for rid in state.turns if rid in running]
    known = set(kept)
    base = kept + [rid for rid in state.running if rid not in known]
    slots_by_group: dict[tuple[str, int], list[int]] = {}
    for index, rid in enumerate(base):
        request = get(state, rid)
        slots_by_group.setdefault((request.user, request.priority), []).append(index)
    order = list(base)
    for (user, priority), slots in slots_by_group.items():
        members = [base[i] for i in slots]
        last = last_served(state, user, priority)
        if last not in members or members.index(last) == len(members) - 1:
            continue
        cut = members.index(last) + 1
        for slot, rid in zip(slots, members[cut:] + members[:cut]):
            order[slot] = rid
    assert sorted(order) == sorted(state.running), "R14: the turn order must only permute"
    return tuple(order)


def decoding(request: RequestState) -> bool:
    """R11/R14: a running request that can only sample next (R10: nothing left to
    prefill) and is not already carried to ``max_tokens`` by its placeholders (V3)."""
    only_sampling_left = request.num_computed_tokens >= request.sampling_position - 1
    below_max = request.num_output_tokens + request.num_output_placeholders < request.max_tokens
    return only_sampling_left and below_max


def start_turns(
    state: SchedulerState, order: tuple[str, ...] | None = None
) -> tuple[tuple[str, ...], frozenset[str], frozenset[str]]:
    """R11, R13, R14: ``(throttled_at_start, refused_users, held_users)`` at ``state.now_ns``.

    A user granted ``g`` tokens now (``grants_now``) with ``n > g`` decoding streams gives
    them to the first ``g`` in its turn order (``order``, default ``turn_order(state)``);
    the other ``n - g`` are throttled at the start (in ``running`` order). ``g = 0``: the
    user is refused; ``0 < g < n``: held.
    """
    order = turn_order(state) if order is None else order
    streams: dict[str, list[str]] = {}
    for rid in order:
        request = get(state, rid)
        if decoding(request):
            streams.setdefault(request.user, []).append(rid)
    passed: set[str] = set()
    refused: set[str] = set()
    held: set[str] = set()
    for user, rids in streams.items():
        grants = grants_now(state, user, len(rids))
        if grants < len(rids):
            passed.update(rids[grants:])
            (held if grants else refused).add(user)
    at_start = tuple(rid for rid in state.running if rid in passed)
    return at_start, frozenset(refused), frozenset(held)


def grants_now(state: SchedulerState, user: str, at_most: int) -> int:
    """R2: how many successive takes for ``user`` would succeed at ``state.now_ns`` (at
    most ``at_most``; the state is not changed)."""
    config, limiter = state.config, state.limiter
    for granted in range(at_most):
        limiter, ok = spec_limiter.try_take(limiter, user, config.rate_of(user), state.now_ns, config.burst_ns)
        if not ok:
            return granted
    return at_most


def last_served(state: SchedulerState, user: str, priority: int) -> str | None:
    """R15: the group's last dispatched stream, if any."""
    for u, p, rid in state.last_served:
        if (u, p) == (user, priority):
            return rid
    return None


def allows(cycle: Cycle, user: str) -> bool:
    """R2: would a take for ``user`` succeed now (no state change)?"""
    return spec_limiter.allows(cycle.state.limiter, user, cycle.now_ns, cycle.state.config.burst_ns)


# -- the loops -------------------------------------------------------------------------
def samples(request: RequestState, num_new_tokens: int) -> bool:
    """R7: the chunk reaches the sampling position (prompt + outputs + placeholders)."""
    return request.num_computed_tokens + num_new_tokens >= request.sampling_position


def try_charge(cycle: Cycle, request: RequestState) -> tuple[Cycle, bool]:
    """R7, R2: charge one token to the request's user, unless refused in this cycle."""
    user = request.user
    if user in cycle.refused_users:
        return cycle, False
    config = cycle.state.config
    limiter, granted = spec_limiter.try_take(
        cycle.state.limiter, user, config.rate_of(user), cycle.now_ns, config.burst_ns
    )
    if not granted:
        return replace(cycle, refused_users=cycle.refused_users | {user}), False
    state = replace(cycle.state, limiter=limiter)
    return replace(cycle, state=state, charged=cycle.charged + (request.request_id,)), True


def charge_if_sampling(cycle: Cycle, request: RequestState, num_new_tokens: int) -> tuple[Cycle, bool]:
    """R7: a chunk of ``num_new_tokens`` that samples is charged now; one that does not
    sample passes uncharged. ``(cycle, True)``: the chunk may go at its size; ``(cycle,
    False)``: it samples and its user is refused (the caller applies R10 or R11)."""
    if not samples(request, num_new_tokens):
        return cycle, True
    return try_charge(cycle, request)


def prefill_room(request: RequestState) -> int:
    """R10: tokens a refused request may still compute without sampling (up to n-1)."""
    return request.sampling_position - 1 - request.num_computed_tokens


def decide_running(cycle: Cycle, request: RequestState, num_new_tokens: int) -> tuple[Cycle, int]:
    """R12, R7, R10, R11: the final size of a running request's chunk (0: skip it).

    R12: once A running requests are in the batch, the rest get 0 (not throttled).
    R11/R14: a request throttled at the start gets 0 (its user is refused, or its
    grants go to the user's streams whose turn it is).
    R7: a chunk that samples is charged; R10: if refused, with chunked prefill it still
    advances to n-1; R11: otherwise it is throttled: skipped, resident, not active.
    """
    assert num_new_tokens > 0, "V4: only non-empty chunks reach the last cap"
    if len(cycle.scheduled) >= cycle.state.config.active_cap:
        return replace(cycle, active_cap_reached=True), 0  # R12: every scheduled entry so far is running
    if request.request_id in cycle.throttled_at_start:
        return cycle, 0  # R11, R14: refused, or not its turn among its user's streams
    cycle, granted = charge_if_sampling(cycle, request, num_new_tokens)
    if granted:
        return cycle, num_new_tokens
    room = prefill_room(request)
    if not cycle.state.config.chunked_prefill or room <= 0:
        return replace(cycle, throttled=cycle.throttled | {request.request_id}), 0  # R11
    return cycle, min(num_new_tokens, room)  # R10


def waiting_gate(cycle: Cycle, request: RequestState) -> tuple[Cycle, bool]:
    """R10: may a waiting request be sized at all?

    Yes if its user is granted now. Otherwise its user is refused for the cycle, and it
    proceeds only if, with chunked prefill, it can prefill something short of sampling;
    else it is skipped, and later waiting requests are still considered (the decision
    of docs/SPEC.md "Decisions", R10: vLLM 0.32 would stop admission here).
    """
    if request.user not in cycle.refused_users and allows(cycle, request.user):
        return cycle, True
    cycle = replace(cycle, refused_users=cycle.refused_users | {request.user})
    if not cycle.state.config.chunked_prefill:
        return cycle, False
    return cycle, request.num_computed_tokens < request.num_tokens - 1


def resident_count(state: SchedulerState, user: str) -> int:
    """R20: running (resident) requests of ``user``, those admitted in this cycle included."""
    return sum(1 for rid in state.running if get(state, rid).user == user)


def residency_gate(cycle: Cycle, request: RequestState) -> tuple[Cycle, bool]:
    """R20: may a waiting request be considered for admission at all?

    With ``max_num_seqs_per_user`` C configured, a waiting request whose user already
    holds C running requests (counting those admitted earlier in this cycle) is skipped,
    and later waiting requests, of other users, are still considered (like R10's skip):
    one user's flood never holds every resident slot while another user waits. Without
    C (the default) every request proceeds.
    """
    cap = cycle.state.config.max_num_seqs_per_user
    if cap is None or resident_count(cycle.state, request.user) < cap:
        return cycle, True
    return replace(cycle, residency_skipped=cycle.residency_skipped + (request.request_id,)), False


def decide_waiting(cycle: Cycle, request: RequestState, num_new_tokens: int) -> tuple[Cycle, int]:
    """R7, R10: the final size of a waiting request's first chunk (never 0).

    ``waiting_gate`` let the request through, so either its user is granted now (the
    charge succeeds: same instant, same TAT), or, with chunked prefill, it can stop short
    of sampling. A refused request therefore never stops admission (R10 decision).
    """
    cycle, granted = charge_if_sampling(cycle, request, num_new_tokens)
    if granted:
        return cycle, num_new_tokens
    room = prefill_room(request)
    # R10: the gate passes a refused request only with chunked prefill and room to prefill.
    assert cycle.state.config.chunked_prefill and room > 0, f"R10: refused {request} passed the gate"
    return cycle, min(num_new_tokens, room)


def admission_cap(cycle: Cycle) -> int:
    """R12: admit while ``len(running) < M`` and ``len(running) - throttled < A``."""
    config = cycle.state.config
    return min(config.max_num_seqs, config.active_cap + len(cycle.throttled))


def preferred_victim(cycle: Cycle, request_id: str) -> str | None:
    """R13: a request throttled at the start of this cycle is preempted before others.

    FCFS: the last of them in ``running`` order. PRIORITY: only among those at vLLM's
    victim level (the highest priority value in ``running``), the latest arrival.
    None: no such request, vLLM's own choice applies (V6).
    """
    state = cycle.state
    candidates = [get(state, rid) for rid in cycle.throttled_at_start if rid in state.running and rid != request_id]
    if not candidates:
        return None
    if state.config.policy == FCFS:
        return candidates[-1].request_id
    level = max(get(state, rid).priority for rid in state.running)
    at_level = [r for r in candidates if r.priority == level]
    if not at_level:
        return None
    return max(at_level, key=lambda r: r.arrival).request_id


def free_lora_slot(cycle: Cycle) -> Cycle:
    """R13 (LoRA): preempt the throttled holders of an adapter slot another user needs.

    With ``max_loras`` K and K adapters in use by ``running``, take the first waiting
    request W (queue order) on an adapter not in use whose user is granted now. An adapter
    is a candidate if every running request on it was throttled at the start of this cycle
    and its user is refused (not merely held, R14: a held user could take the slot back in
    this very cycle) and is not W's user. The candidate of the last such request in
    ``running`` order (FCFS's victim end) loses all its holders, last first, each preempted
    as by V6 (blocks freed, back to ``waiting``); the running loop then runs on the rest
    and the waiting loop admits as usual (no V7 for these). ``lora_gate`` keeps the
    victims from taking the slot back while their user is refused, so W's delay is
    bounded by this cycle (plus V8's own stops: budget, admission cap, blocks).
    None of this happens without LoRA, with fewer than K adapters in use, or with no
    throttled holder: the decision of docs/SPEC.md "LoRA slots".
    """
    state = cycle.state
    limit = state.config.max_loras
    if limit is None or not cycle.throttled_at_start:
        return cycle
    in_use: dict[int, list[str]] = {}
    for rid in state.running:
        lora = get(state, rid).lora
        if lora > 0:
            in_use.setdefault(lora, []).append(rid)
    if len(in_use) < limit:
        return cycle
    needing = next(
        (
            get(state, rid)
            for rid in state.waiting
            if (w := get(state, rid)).lora > 0
            and w.lora not in in_use
            and w.user not in cycle.refused_users
            and allows(cycle, w.user)
        ),
        None,
    )
    if needing is None:
        return cycle
    at_start = set(cycle.throttled_at_start)

    def freeable(rids: list[str]) -> bool:
        return all(
            rid in at_start and get(state, rid).user in cycle.refused_users and get(state, rid).user != needing.user
            for rid in rids
        )

    holders = [
        rid for rid in state.running if freeable(in_use.get(get(state, rid).lora, [])) and get(state, rid).lora > 0
    ]
    if not holders:
        return cycle
    victim_lora = get(state, holders[-1]).lora
    for rid in reversed(in_use[victim_lora]):
        cycle = preempt(cycle, rid)
        cycle = replace(cycle, lora_victims=cycle.lora_victims + (rid,))
    return cycle


def lora_gate(cycle: Cycle, request: RequestState, counted: frozenset[int]) -> bool:
    """R13 (LoRA): may a waiting request take an adapter slot? A request of a user refused
    in this cycle whose adapter is not among the ``counted`` ones (``scheduler.counted_loras``)
    is skipped: a refused user could only prefill (R10), and would hold a slot another
    user's request may need (``free_lora_slot`` would take it back next cycle)."""
    if request.lora == 0 or request.lora in counted:
        return True
    return request.user not in cycle.refused_users


# -- end of the cycle ------------------------------------------------------------------
def end_cycle(cycle: Cycle, dispatched: frozenset[str]) -> tuple[SchedulerState, dict[str, Any]]:
    """R9, R15, R6, R16: settle the cycle's charges and report the rate-limit fields.

    R9: every charge whose request is not dispatched to sample is refunded, once, here
    and nowhere else. R15: of each group's dispatched charges, the one last in the
    group's turn order becomes its last served (``next_last_served``).
    R6: every ``CLEANUP_INTERVAL_STEPS`` cycles, idle users are forgotten (and last-served
    entries of requests that left). R16: the wait hint is the earliest ready time among
    the users refused or held (R14) in this cycle. R19: ``limit_bound`` says whether a
    limit bound (``limit_binds``).
    """
    state = cycle.state
    limiter = state.limiter
    served = {(u, p): rid for u, p, rid in state.last_served}
    refunded = []
    for rid in cycle.charged:
        request = get(state, rid)
        if rid not in dispatched:
            limiter = spec_limiter.refund(limiter, request.user, state.config.rate_of(request.user))  # R4, R9
            refunded.append(rid)
    served = next_last_served(cycle, served, [rid for rid in cycle.charged if rid in dispatched])  # R15
    num_schedules = state.num_schedules + 1
    if num_schedules % CLEANUP_INTERVAL_STEPS == 0:
        limiter = spec_limiter.cleanup_idle_users(limiter, cycle.now_ns)  # R6
        live = {r.request_id for r in state.requests}
        served = {key: rid for key, rid in served.items() if rid in live}
    state = replace(
        state,
        limiter=limiter,
        num_schedules=num_schedules,
        last_served=tuple((u, p, rid) for (u, p), rid in served.items()),
    )
    waiting_users = cycle.refused_users | cycle.held_users
    ready = [t for u in waiting_users if (t := spec_limiter.ready_at_ns(limiter, u, state.config.burst_ns)) is not None]
    settled: dict[str, Any] = {
        "charged": cycle.charged,
        "refunded": tuple(refunded),
        "throttled": tuple(sorted(cycle.throttled)),
        "wait_hint_ns": min(ready) if ready else None,
        "tat_ns": tuple(sorted(limiter.tat_ns.items())),
        "rate_limited": True,
        "limit_bound": limit_binds(cycle),
    }
    return state, settled


def next_last_served(
    cycle: Cycle, served: dict[tuple[str, int], str], dispatched: list[str]
) -> dict[tuple[str, int], str]:
    """R15: each group's last-served stream after a cycle that dispatched ``dispatched``
    (charged and not refunded): the group's dispatched stream that comes last in the
    cycle's turn order (R14), followed by the requests admitted in the cycle in admission
    order. So the next turn order starts with a stream that was passed over.
    """
    order = cycle.turn_order + cycle.admitted
    position = {rid: i for i, rid in enumerate(order)}
    served = dict(served)
    for rid in sorted(dispatched, key=position.__getitem__):
        request = get(cycle.state, rid)
        served[(request.user, request.priority)] = rid
    return served


def limit_binds(cycle: Cycle) -> bool:
    """R19: did a limit of the feature bind in this cycle? A user was refused (R2), a
    stream was held for another's turn (R14), a request was throttled (R11) or the active
    cap gave a running request 0 tokens (R12), or a waiting request was skipped at its
    user's residency cap (R20). When none did, the cycle is the base
    scheduler's from the same state (R19)."""
    return bool(
        cycle.refused_users
        or cycle.held_users
        or cycle.throttled
        or cycle.active_cap_reached
        or cycle.residency_skipped
    )  # R20: a waiting request skipped at its user's cap
