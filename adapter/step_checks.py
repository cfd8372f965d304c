"""Black-box per-step properties of the scenario judge that close the gate's blind spots
(issue 26 item 3): each judges only what vLLM exposes (``SchedulerOutput`` through the
harness's ``StepTrace``, the ``Request`` fields the judge records before a step, the order
of ``Scheduler.running``) against the spec limiter's replay, and states its failure in the
article's terms.

Called by ``adapter/judge._Judge.after_step`` (each function takes the judge ``j``: its
scenario, ``start`` (``judge_record.StepStart``), ``state`` (the replay after the step's dispatches),
``by_id``, ``user_of``, ``name``). A failure is ``(rule, level, message)``: an article rule
at ``should``, an article promise at ``must`` (docs/SPEC.md, conformance levels).

- ``batch_over_cap`` (R12, should): a step's batch holds at most A non-throttled requests;
- ``split_prompt`` (R10, should): without chunked prefill every scheduled chunk samples;
- ``running_prefill_held`` (R10, should): a running request's refused prefill advances to
  n - 1 when the step left token budget;
- ``victim_within_level`` (R13, should): under PRIORITY, a throttled request is preferred
  within vLLM's victim level;
- ``others_reordered`` (R14, should): the rotation moves only a user's own streams within
  their own slots of ``running``.

Head-of-line blocking caused by the limit (R10/P4) and under-grants in a step that preempted
(P4) are judged in ``judge_grants.under_grant_check`` / ``pressured_under_grant_check`` with
``can_advance`` and ``fcfs_preempting_step_judged`` from here.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter

Failure = tuple[str, str, str]


def can_advance(j: Any, rid: str) -> bool:
    """R10: whether the article lets a refused waiting request ``rid`` advance its prefill
    short of sampling in this step: chunked prefill on, at least 2 tokens left to compute at
    the step start (not ``decoding``), and no prefix caching (a cache hit, capped by vLLM at
    ``num_tokens - 1``, may leave only the sampling position). A refused request that cannot
    advance gets 0 tokens, and vLLM 0.32's own loop then stops admission (its
    ``num_new_tokens == 0`` stop, the article's charge point placement): that blocking is
    vLLM's, an open choice; blocking behind one that could advance is the limit's."""
    scenario, start = j.scenario, j.start
    return (
        scenario.chunked_prefill
        and not scenario.prefix_caching
        and start is not None
        and rid not in start.decoding
        and rid in j.by_id
    )


def batch_over_cap(j: Any, trace: Any) -> Failure | None:
    """R12 (should): the waiting loop admits only while ``len(running) - throttled < A`` and
    the running loop schedules at most A running requests, so a step's batch (running and
    admitted requests together, all of them non-throttled) holds at most A requests."""
    cap = j.scenario.max_num_active_seqs
    if cap is None or len(trace.scheduled) <= cap:
        return None
    admitted = [r for r in trace.scheduled if r in trace.admitted]
    return (
        "R12",
        "should",
        (
            f"R12 broken: {j.name} put {len(trace.scheduled)} requests in one step's batch "
            f"({len(trace.scheduled) - len(admitted)} running, {len(admitted)} admitted: {sorted(admitted)}), more "
            f"than --max-num-active-seqs {cap}: the article's waiting loop admits only while len(running) - "
            "throttled < A, so a batch never holds more than A non-throttled requests"
        ),
    )


def split_prompt(j: Any, trace: Any) -> Failure | None:
    """R10 (should): without chunked prefill a prompt is never split (vLLM admits a prompt
    whole or not at all, and the article: "整个 prefill 只能等"), so every request scheduled
    in a step samples in it; a chunk that stops short of sampling is a split prompt (a
    refused prefill advanced to n - 1 although chunked prefill is off)."""
    if j.scenario.chunked_prefill:
        return None
    sampled = set(trace.sampled)
    split = [rid for rid in trace.scheduled if rid in j.by_id and rid not in sampled]
    if not split:
        return None
    rid = split[0]
    return (
        "R10",
        "should",
        (
            f"{j.name} scheduled {trace.scheduled[rid]} tokens of {rid} (user {j.user_of(rid)!r}) at "
            f"t={trace.now_ns} ns in a chunk that does not sample although chunked prefill is off: the article "
            "never splits a prompt without chunked prefill, a refused prefill waits whole (R10)"
        ),
    )


def left_room(j: Any, trace: Any) -> bool:
    """The step left token budget (``max_num_batched_tokens``) and did not fill the active
    cap with running requests: vLLM's running loop then reached every running request."""
    scenario = j.scenario
    if sum(trace.scheduled.values()) >= (scenario.max_num_batched_tokens or 2048):
        return False
    cap = scenario.max_num_active_seqs
    return cap is None or sum(1 for r in trace.scheduled if r not in trace.admitted) < cap


def running_prefill_held(j: Any, trace: Any, state_before: Any) -> Failure | None:
    """R10 (should), chunked prefill: a request running at the step start with a prefill in
    progress (2 or more tokens left to compute), whose user the GCRA refuses at the step's
    start (so at its charge point too: within ``schedule()`` a TAT only rises), still
    advances toward n - 1 in a step that left token budget, preempted nothing and did not
    fill the active cap with running requests ("开启 chunked prefill 时，prefill 可以先推进到
    倒数第二个位置"). vLLM's running loop reaches every running request in such a step."""
    scenario, start = j.scenario, j.start
    if start is None or not scenario.chunked_prefill or trace.preempted:
        return None
    if not left_room(j, trace):
        return None
    budget = scenario.max_num_batched_tokens or 2048
    running_after = {r.request_id for r in j.harness.scheduler.running}
    now, burst = trace.now_ns, scenario.burst_ns
    for rid in start.running:
        if (
            rid not in j.by_id
            or rid in trace.scheduled
            or rid not in running_after
            or rid in start.decoding
            or rid not in start.demand
            or spec_limiter.allows(state_before, j.user_of(rid), now, burst)
        ):
            continue
        return (
            "R10",
            "should",
            (
                f"{j.name} gave running {rid} (user {j.user_of(rid)!r}) no tokens at t={now} ns while its prefill "
                f"was in progress: its user is refused, and with chunked prefill the article still advances a "
                f"refused prefill to n - 1 (R10); the step left token budget ({sum(trace.scheduled.values())} of "
                f"{budget} scheduled), preempted nothing and did not fill the active cap"
            ),
        )
    return None


def victim_within_level(j: Any, trace: Any, state_before: Any) -> Failure | None:
    """R13 under PRIORITY (should), both timings of "throttled" accepted: let P be a
    preempted request whose user the GCRA grants at the step start at least once per
    request it has running (throttled at no timing), and Q a request of the same priority
    as P, running at the step start and after it, not scheduled, with only its sampling
    position left and a token to dispatch, of a user refused at the step start, whose
    (user, priority) group stands in ``running`` before every group with a request
    scheduled or preempted in the step (so vLLM's loop passed Q, refused it and recorded it
    as throttled before any allocation failed). vLLM's victim level is P's priority (the
    largest value), and the article prefers throttled victims within it: Q before P."""
    start, scenario = j.start, j.scenario
    if start is None or scenario.policy != "priority" or not trace.preempted:
        return None
    throttled, grants, counts = passed_throttled(j, trace, state_before, set(trace.preempted))
    for rid in trace.preempted:
        if rid not in j.by_id or rid not in start.running:
            continue
        user, level = j.user_of(rid), j.by_id[rid].priority
        same = [q for q in throttled if j.by_id[q].priority == level]
        if same and grants.get(user, 0) >= counts.get(user, 0) > 0:
            q = same[-1]
            return (
                "R13",
                "should",
                (
                    f"{j.name} preempted {rid} (user {user!r}, priority {level}, granted at t={trace.now_ns} ns for "
                    f"each of its running requests) while {q} (user {j.user_of(q)!r}, the same priority, refused and "
                    "passed by the running loop before any KV allocation failed) kept its KV: under PRIORITY the "
                    "article preempts throttled requests first within vLLM's victim level"
                ),
            )
    return None


def passed_throttled(j: Any, trace: Any, state_before: Any, also_sized: set[str]):
    """(the running requests the loop passed and refused before any allocation failed, in
    ``running`` order; each running user's grants at the step start, up to its running
    requests; those counts). ``also_sized``: requests sized in the step besides the
    scheduled ones (the preempted, which may have preempted themselves)."""
    start = j.start
    running_after = {r.request_id for r in j.harness.scheduler.running}
    known = [rid for rid in start.running if rid in j.by_id]

    def group(rid: str) -> tuple[str, int]:
        return j.user_of(rid), j.by_id[rid].priority

    positions: dict[tuple[str, int], list[int]] = {}
    for i, rid in enumerate(known):
        positions.setdefault(group(rid), []).append(i)
    sized = {group(rid) for rid in known if rid in trace.scheduled or rid in also_sized}
    first = min((min(positions[g]) for g in sized), default=len(known))
    counts: dict[str, int] = {}
    for rid in known:
        counts[j.user_of(rid)] = counts.get(j.user_of(rid), 0) + 1
    grants = {u: j._grants_at(state_before, u, trace.now_ns, n) for u, n in counts.items()}
    throttled = [
        rid
        for rid in known
        if rid in running_after
        and rid not in trace.scheduled
        and rid in start.decoding
        and rid in start.demand
        and grants[j.user_of(rid)] == 0
        and max(positions[group(rid)]) < first
    ]
    return throttled, grants, counts


def others_reordered(j: Any) -> Failure | None:
    """R14 (should): the article's rotation swaps a user's streams only among the places
    that user's streams (same priority) hold in ``running``; every other relative order is
    kept, and the requests that leave (finished, preempted) only free their places. So each
    request in ``running`` both before a ``schedule()`` and after the step sits, after it, in
    a place its (user, priority) group held before it, in ``running`` order: greedily, each
    such request in the order after the step takes the first place of its group past the
    place the one before it took; a request with no such place left was moved across
    another user's streams."""
    start = j.start
    if start is None:
        return None
    before = start.running
    after = [r.request_id for r in j.harness.scheduler.running if r.request_id in j.by_id]
    kept = set(after) & set(before)
    after = [rid for rid in after if rid in kept]

    def label(rid: str) -> tuple[str, int]:
        return j.user_of(rid), j.by_id[rid].priority

    places: dict[tuple[str, int], list[int]] = {}
    for i, rid in enumerate(before):
        if rid in j.by_id:
            places.setdefault(label(rid), []).append(i)
    taken = -1
    for rid in after:
        free = [i for i in places[label(rid)] if i > taken]
        if not free:
            return (
                "R14",
                "should",
                (
                    f"{j.name} changed other users' order in `running`: {before} became {after} (kept requests; "
                    f"{rid} of user {label(rid)[0]!r} moved past another user's streams); the article's rotation "
                    "moves a user's streams only within the places its own streams hold, all other relative orders "
                    "stay"
                ),
            )
        taken = free[0]
    return None


def fcfs_preempting_step_judged(j: Any, trace: Any) -> bool:
    """P4 under pressure in a step that preempted (``judge_grants.pressured_under_grant_check``):
    judged under FCFS only. vLLM's FCFS victim is the last of ``running`` (the article's
    preferred victims: throttled requests the loop already passed), so its running loop
    stops early only on a request that preempted itself, after every later request was
    preempted; a request still running and not preempted was reached. Its token budget is
    never given back (so a budget left at the end was left at every visit), no charge is
    held by a request visited before it and preempted later, and nothing is admitted after
    a preemption (V7). Under PRIORITY the victim may be a request already served and 0.32
    ends the loop at a self-preemption: not judged."""
    return j.scenario.policy == "fcfs"
