"""Coverage obligations reached, step by step (``adapter/coverage.py`` holds the obligations,
the collectors and the gate's coverage row).

The scenario judge (``adapter/judge._Judge.after_step``) calls ``observe`` once per step,
before it replays the step's sampling dispatches on the spec limiter. ``observe`` decides,
black-box, from the spec-limiter replay state and what vLLM exposes (``StepTrace``:
scheduled tokens, sampling dispatches, preemptions, admissions, finishes), which
obligations the step reached, one observer per concern, and notes each with
``coverage.note`` (at most once per scenario run). The obligations are proxies built from
the outside; they never read the candidate's own observation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm_output_rate.adapter import step_checks
from vllm_output_rate.adapter.coverage import ODD_ID, collecting_now, note
from vllm_output_rate.spec import limiter as spec_limiter


@dataclass
class _Aux:
    """Per-scenario memory of the observer (black-box)."""

    computed: dict  # request id -> tokens scheduled since its (re)admission
    chunks: dict  # request id -> chunks scheduled since its (re)admission
    n_minus_1: set  # request ids whose last chunk ended at n - 1 without sampling
    turns: dict  # user -> stream ids served, one grant per step (R14)
    refused_prefill: dict  # request id -> its user, refused when its chunk ended at n - 1 (R10)


def _lead_ns(state, user: str, now: int) -> Fraction | None:
    tat = state.tat_ns.get(user)
    return None if tat is None else tat - now


def _grants_at(state, user: str, now: int, rate: Fraction, burst: int) -> int:
    lead = _lead_ns(state, user, now)
    lead = Fraction(0) if lead is None or lead < 0 else lead
    if lead > burst:
        return 0
    return math.floor((burst - lead) / spec_limiter.emission_interval_ns(rate)) + 1


@dataclass
class _Step:
    """One step as the observer sees it (black-box): the judge, its memory, the step's
    trace, and what follows from the spec state before the step.

    ``now``/``burst`` in ns; ``by_user``: user -> request ids dispatched for sampling this
    step (in dispatch order); ``waiting_users``: the users of the unfinished requests;
    ``refused``: those of them the spec limiter refuses at ``now`` (R2)."""

    judge: Any
    aux: _Aux
    trace: Any
    unfinished: list[str]
    resident: set[str]
    now: int
    burst: int
    by_user: dict[str, list[str]]
    waiting_users: set[str]
    refused: set[str]


def observe(judge, step: int, trace, unfinished: list[str], resident: set[str]) -> None:
    """Record the obligations step ``step`` reached (see module docstring). Called by the
    judge before it replays the step; ``judge.state`` is the spec state before the step."""
    if not collecting_now():
        return
    scenario = judge.scenario
    if not scenario.feature_on:
        note(judge, "R18 feature off")
        return
    aux = judge.__dict__.get("_coverage_aux")
    if aux is None:
        aux = judge._coverage_aux = _Aux({}, {}, set(), {}, {})
    state, now, burst = judge.state, trace.now_ns, scenario.burst_ns
    by_user: dict[str, list[str]] = {}
    for rid in trace.sampled:
        by_user.setdefault(judge.user_of(rid), []).append(rid)
    waiting_users = {judge.user_of(rid) for rid in unfinished}
    refused = {u for u in waiting_users if not spec_limiter.allows(state, u, now, burst)}
    view = _Step(judge, aux, trace, unfinished, resident, now, burst, by_user, waiting_users, refused)
    _observe_cleanup(view, _observe_takes(view))
    _observe_chunks(view)
    # R8 (async): dispatched again in the step whose delivered output finished it.
    if scenario.async_scheduling and any(rid in trace.finished for rid in trace.sampled):
        note(judge, "R8 dispatched after its final token (async)")
    _observe_not_sampled(view)
    _observe_preempted(view)
    _observe_alloc_failure(view)
    _observe_turns(view)
    _observe_user_ids(view)
    _observe_blind_spots(view)


def _observe_takes(view: _Step) -> spec_limiter.LimiterState:
    """R2/R5/R3 boundaries (burst edge, ready-at, fractional interval): replay this step's
    takes one by one on the spec limiter; returns the spec state after them."""
    judge, now, burst = view.judge, view.now, view.burst
    scenario, state = judge.scenario, judge.state
    local = state
    for user, rids in view.by_user.items():
        rate = scenario.rate_of(user)
        for _ in rids:
            lead = _lead_ns(local, user, now)
            if lead is not None:
                if lead == burst:
                    note(judge, "boundary: burst-edge")
                x = lead + now - burst  # TAT - tau
                if x.denominator != 1 and now == math.ceil(x):
                    note(judge, "boundary: ready-at")
            local, _ = spec_limiter.try_take(local, user, rate, now, burst)
    for user in view.waiting_users - set(view.by_user):
        lead = _lead_ns(state, user, now)
        if lead is None or lead <= burst:
            continue
        over = lead - burst
        if over == 1:
            note(judge, "boundary: burst-edge+1ns")
        x = lead + now - burst
        if x.denominator != 1 and now == math.ceil(x) - 1:
            note(judge, "boundary: ready-at-1ns")
        if spec_limiter.emission_interval_ns(scenario.rate_of(user)).denominator != 1 and 2 * over < 1:
            note(judge, "boundary: fractional-interval")
    return local


def _observe_cleanup(view: _Step, local: spec_limiter.LimiterState) -> None:
    """R6: the judge cleans up after this step's takes (spec state ``local``) at the same
    cadence; an idle user deleted, and the cleanup boundaries TAT = now and now + 1 ns."""
    judge, now = view.judge, view.now
    if judge.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
        for tat in local.tat_ns.values():
            if tat <= now:
                note(judge, "R6 cleanup deletes an idle user")
            if tat == now:
                note(judge, "boundary: cleanup-tat-now")
            elif tat == now + 1:
                note(judge, "boundary: cleanup-tat-now+1ns")


def _observe_chunks(view: _Step) -> None:
    """R7 / R10: chunks, from the scheduled token counts (charged decode and final prefill
    chunks, uncharged prompt chunks, prefills ending at n - 1 or reaching n); updates the
    per-request memory, which a preemption resets."""
    judge, aux, trace = view.judge, view.aux, view.trace
    sampled_set = set(trace.sampled)
    for rid, tokens in trace.scheduled.items():
        spec = judge.by_id.get(rid)
        if spec is None:
            continue
        first_sample = rid not in judge.last_sample_step
        if rid in sampled_set:
            if not first_sample:
                note(judge, "R7 decode dispatch charged")
            else:
                note(judge, "R7 final prefill chunk charged")
                done = aux.computed.get(rid, 0) + tokens
                if aux.chunks.get(rid, 0) >= 1 and done == spec.prompt_len:
                    note(judge, "boundary: prefill-reaches-n")
            if rid in aux.n_minus_1 and tokens == 1:
                note(judge, "boundary: prefill-ends-n-1")
                if rid in aux.refused_prefill:
                    note(judge, "R10 refused prefill advanced to n-1")
            aux.n_minus_1.discard(rid)
            aux.computed[rid] = aux.computed.get(rid, 0) + tokens
        else:
            note(judge, "R7 prompt chunk not charged")
            aux.computed[rid] = aux.computed.get(rid, 0) + tokens
            aux.chunks[rid] = aux.chunks.get(rid, 0) + 1
            if first_sample and aux.computed[rid] == spec.prompt_len - 1:
                aux.n_minus_1.add(rid)
                user = judge.user_of(rid)
                if not spec_limiter.allows(judge.state, user, view.now, view.burst):
                    aux.refused_prefill[rid] = user
    for rid in trace.preempted:
        aux.computed.pop(rid, None)
        aux.chunks.pop(rid, None)
        aux.n_minus_1.discard(rid)


def _observe_not_sampled(view: _Step) -> None:
    """R10, R11, R12, R16 from the requests that did not sample: throttled and kept
    resident, a refused waiting request ahead of another, a refused prompt waiting whole,
    the active cap binding, every user refused."""
    _observe_waiting(view)
    if view.judge.scenario.max_num_active_seqs is not None:
        _observe_active_cap(view)
    trace, refused = view.trace, view.refused
    if not trace.sampled and len(view.waiting_users) >= 2 and view.waiting_users <= refused:
        note(view.judge, "R16 every user refused while requests wait")
        note(view.judge, "boundary: all-refused")


def _observe_waiting(view: _Step) -> None:
    """R11 and R10 over the unfinished requests in order: a throttled request kept
    resident, a refused waiting request ahead of another, a refused prompt waiting whole."""
    judge, trace, refused, scheduled = view.judge, view.trace, view.refused, view.trace.scheduled
    scenario = judge.scenario
    blocked_first = False
    for rid in view.unfinished:
        user = judge.user_of(rid)
        if rid in view.resident:
            if rid not in scheduled and user in refused and rid not in trace.preempted:
                note(judge, "R11 throttled request kept resident")
            continue
        if blocked_first and user not in refused:
            # The situation R10 is about, whatever the outcome: the spec admits the later
            # request; the article's charge-point placement may hold it for this step (an open
            # choice, docs/SPEC.md "What the article leaves open").
            note(judge, "R10 refused waiting request ahead of another waiting request")
            if not scenario.chunked_prefill:  # the refused prompt ahead waited whole
                note(judge, "boundary: refused-prompt-ahead")
        if rid in scheduled:
            continue
        if user in refused:
            blocked_first = True
            if not scenario.chunked_prefill:
                note(judge, "R10 no chunked prefill: a refused prompt waits whole")


def _observe_active_cap(view: _Step) -> None:
    """R12 in a scenario with an active cap: the cap binds, and admissions past throttled
    requests fill it."""
    judge, trace, refused, scheduled = view.judge, view.trace, view.refused, view.trace.scheduled
    cap = judge.scenario.max_num_active_seqs
    admitted = set(trace.admitted)
    running_scheduled = [rid for rid in scheduled if rid not in admitted]
    if len(running_scheduled) >= cap and any(
        rid in view.resident and rid not in scheduled and judge.user_of(rid) not in refused for rid in view.unfinished
    ):
        note(judge, "R12 active cap binds")
    throttled = [rid for rid in view.resident if rid not in scheduled and judge.user_of(rid) in refused]
    if admitted and len(throttled) + len(running_scheduled) >= cap:
        note(judge, "boundary: active-cap-binds")  # admitted past throttled requests


def _observe_preempted(view: _Step) -> None:
    """R13 and R9 from the preemptions: a throttled victim (FCFS or PRIORITY), a throttled
    request above vLLM's victim level, and a request charged then preempted (proxies, see
    module docstring)."""
    judge, trace, refused, resident = view.judge, view.trace, view.refused, view.resident
    scheduled, policy = trace.scheduled, judge.scenario.policy
    for rid in trace.preempted:
        user = judge.user_of(rid)
        if user in refused:
            note(judge, "R13 throttled request preempted")
            if policy == "priority":
                note(judge, "boundary: priority-throttled-victim")
            else:
                note(judge, "boundary: fcfs-throttled-victim")
        elif (
            policy == "priority"
            and judge.by_id.get(rid) is not None
            and any(
                other in resident
                and other not in scheduled
                and other not in trace.preempted
                and judge.user_of(other) in refused
                and judge.by_id[other].priority < judge.by_id[rid].priority
                for other in view.unfinished
            )
        ):
            # A throttled request above vLLM's victim level kept its KV.
            note(judge, "boundary: priority-throttled-victim-above")
        elif (
            rid in resident
            and rid in judge.last_sample_step
            and all(other in scheduled for other in resident if other != rid and other in view.unfinished)
        ):
            note(judge, "boundary: charged-then-preempted")
            note(judge, "R9 charge refunded at the end of the step")


def _observe_alloc_failure(view: _Step) -> None:
    """R9: charged, then not allocated (proxy, see module docstring): in an FCFS step with
    few KV blocks, no preemption and a free seat, the first waiting request the spec would
    grant and the token budget would fit, never scheduled, was charged and refunded."""
    judge, trace = view.judge, view.trace
    scenario, scheduled = judge.scenario, trace.scheduled
    seats = scenario.max_num_seqs or len(judge.by_id)
    if (
        scenario.num_blocks is not None
        and scenario.policy == "fcfs"
        and not trace.preempted
        and (scenario.max_num_active_seqs is None or scenario.max_num_active_seqs >= seats)
        and trace.num_running < seats
    ):
        budget = scenario.max_num_batched_tokens or 2048
        used = sum(scheduled.values())
        for rid in view.unfinished:
            if rid in view.resident or rid in scheduled:
                continue
            spec, user = judge.by_id[rid], judge.user_of(rid)
            grants = _grants_at(judge.state, user, view.now, scenario.rate_of(user), view.burst)
            if (
                grants > len(view.by_user.get(user, ()))
                and used + spec.prompt_len <= budget
                and rid not in view.aux.computed
                and rid not in judge.last_sample_step
            ):
                note(judge, "boundary: charged-then-alloc-failure")
                note(judge, "R9 charge refunded at the end of the step")
            break  # FCFS: the waiting loop stops at the first request it cannot allocate


def _observe_turns(view: _Step) -> None:
    """R14/R15: one grant per step among >= 2 resident streams of a user; the turn wraps
    (the user's grants over the last m + 1 such steps named all m streams, then the first
    again)."""
    judge, aux = view.judge, view.aux
    for user in view.waiting_users:
        streams = [
            rid
            for rid in view.unfinished
            if judge.user_of(rid) == user and rid in view.resident and rid in judge.last_sample_step
        ]
        got = view.by_user.get(user, [])
        turns = aux.turns.setdefault(user, [])
        if len(streams) < 2 or len(got) != 1 or got[0] not in streams:
            turns.clear()
            continue
        turns.append(got[0])
        m = len(streams)
        if len(turns) > m and len(set(turns[-m - 1 : -1])) == m and turns[-1] == turns[-m - 1]:
            note(judge, "R14 a user's streams take turns")
            note(judge, "boundary: rotation-wrap")


def _observe_user_ids(view: _Step) -> None:
    """R17 from the dispatched requests' users: the anonymous bucket, odd ids kept exactly."""
    judge = view.judge
    for rid in view.trace.sampled:
        user = judge.by_id[rid].user
        if user is None:
            note(judge, "R17 anonymous bucket")
        elif not ODD_ID.match(user):
            note(judge, "R17 odd ids kept exactly")


def _observe_blind_spots(view: _Step) -> None:
    """Issue 26's situations (``adapter/step_checks.py``): a refused waiting prompt that can
    advance, ahead of another user's request (R10/P4); two or more throttled streams whose
    places others take (R12); a running request's refused prefill advanced (R10); a user's
    streams taking turns beside another user's stream (R14); other users served in an FCFS
    step that preempted (P4); n > 1 children sampling (R17)."""
    judge, trace, refused = view.judge, view.trace, view.refused
    _observe_refused_ahead(view)
    throttled = [r for r in view.resident if r not in trace.scheduled and judge.user_of(r) in refused]
    if len(throttled) >= 2 and len(set(trace.admitted)) >= 2:
        note(judge, "boundary: active-cap-throttled-places")
    if judge.start is not None:
        _observe_running_chunks(view)
        _observe_turns_beside(view)
    if trace.preempted and judge.scenario.policy == "fcfs":
        victims = {judge.user_of(r) for r in trace.preempted if r in judge.by_id}
        if any(judge.user_of(r) not in victims for r in trace.scheduled if r in view.resident):
            note(judge, "P4 other users served in an FCFS step that preempted")
    _observe_parallel_children(view)


def _observe_refused_ahead(view: _Step) -> None:
    """R10/P4: a refused waiting prompt that can advance, ahead of another user's request."""
    judge = view.judge
    ahead = False
    for rid in view.unfinished:
        if rid in view.resident:
            continue
        if judge.user_of(rid) in view.refused:
            ahead = ahead or step_checks.can_advance(judge, rid)
        elif ahead:
            note(judge, "boundary: refused-prefill-ahead")


def _observe_running_chunks(view: _Step) -> None:
    """R10 on running requests that were scheduled a prefill chunk (not decoding at the
    step's start): a refused one advanced, and a recompute of one that sampled before."""
    judge, start, sampled = view.judge, view.judge.start, set(view.trace.sampled)
    for rid in view.trace.scheduled:
        if (
            rid in view.resident
            and rid not in sampled
            and rid not in start.decoding
            and judge.user_of(rid) in view.refused
        ):
            note(judge, "boundary: running-prefill-refused")
        if rid in judge.last_sample_step and rid not in sampled and rid not in start.decoding:
            note(judge, "boundary: recompute-after-preemption")  # a chunk of one that sampled before


def _observe_parallel_children(view: _Step) -> None:
    """R17: a child of an n > 1 request sampled while a sibling is unfinished."""
    judge = view.judge
    for rid in view.trace.sampled:
        parent = judge.by_id[rid].parent if rid in judge.by_id else None
        if parent is not None and any(
            o != rid and judge.by_id[o].parent == parent for o in view.unfinished if o in judge.by_id
        ):
            note(judge, "R17 n > 1 children share one SamplingParams")
            note(judge, "boundary: parallel-children")


def _observe_turns_beside(view: _Step) -> None:
    """R14 beside another user: a (user, priority) group holding places of ``running`` on
    both sides of another group's request got exactly one grant among its streams."""
    judge, start = view.judge, view.judge.start
    known = [rid for rid in start.running if rid in judge.by_id]
    places: dict[tuple[str, int], list[int]] = {}
    for i, rid in enumerate(known):
        places.setdefault((judge.user_of(rid), judge.by_id[rid].priority), []).append(i)
    for mine in places.values():
        if len(mine) < 2 or all(p in mine for p in range(mine[0], mine[-1] + 1)):
            continue
        served = [known[p] for p in mine if known[p] in view.trace.sampled]
        if len(served) == 1:
            note(judge, "boundary: rotation-beside-others")
            return
