"""The article's design rules the scenario judge (``adapter/judge.py``) checks at level
should, after the dispatch replay and the under-grant checks: R12 scheduled running
requests within the active cap (``active_cap_check``), R13 preferred victims
(``_priority_victim_check``, ``_fcfs_victim_check``), the blind spots of
``adapter/step_checks.py``, and R14/R15 a user's streams taking turns (``bypass_check``,
ample sync scenarios).

Each function takes the judge ``j`` (its scenario, ``start``, ``state``, ``by_id``,
``user_of``, ``name``, ``harness``, ``last_sample_step``, ``bypassed``, ``bypass_bound``,
``named``). A failure is ``(rule, level, message)``.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.adapter import step_checks

R14_BYPASS_FACTOR = 2  # R14: a ready stream waits at most this x (the user's streams) grants


def should_checks(j: Any, trace, resident: set[str], state_before) -> tuple[str, str, str] | None:
    """The should-level checks of one step, in order (``state_before``: the replay at the
    step's start): the active cap (R12), under PRIORITY the victim level (R13), the blind
    spots of ``adapter/step_checks.py``, under FCFS the preferred victims (R13). The first
    failure, or None."""
    scenario = j.scenario
    priority_victims = scenario.policy == "priority" and trace.preempted
    fcfs_victims = scenario.policy == "fcfs" and trace.preempted and j.start is not None
    return (
        active_cap_check(j, trace)
        or (_priority_victim_check(j, trace, resident) if priority_victims else None)
        or _blind_spot_checks(j, trace, state_before)
        or (_fcfs_victim_check(j, trace, state_before, trace.now_ns) if fcfs_victims else None)
    )


def active_cap_check(j: Any, trace) -> tuple[str, str, str] | None:
    """R12 (level should): the step's scheduled running requests (scheduled and not admitted
    in it) number at most --max-num-active-seqs."""
    scenario = j.scenario
    if scenario.max_num_active_seqs is None:
        return None
    scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
    if len(scheduled_running) > scenario.max_num_active_seqs:
        return j.named(
            "R12",
            "should",
            (
                f"{j.name} scheduled {len(scheduled_running)} running requests in one step, more than "
                f"--max-num-active-seqs {scenario.max_num_active_seqs}"
            ),
        )
    return None


def _blind_spot_checks(j: Any, trace, state_before) -> tuple[str, str, str] | None:
    """The should-level properties of ``adapter/step_checks.py`` (issue 26): R12 batch
    within the active cap, R10 no split prompt without chunked prefill and a running
    refused prefill advanced to n - 1, R13 throttled victims within the PRIORITY level,
    R14 other users' order in ``running`` kept by the rotation."""
    return (
        step_checks.batch_over_cap(j, trace)
        or step_checks.split_prompt(j, trace)
        or step_checks.running_prefill_held(j, trace, state_before)
        or step_checks.victim_within_level(j, trace, state_before)
        or step_checks.others_reordered(j)
    )


def _fcfs_victim_check(j: Any, trace, state_before, now: int) -> tuple[str, str, str] | None:
    """R13 under FCFS (level should), black-box, accepting both timings of "throttled"
    (the article: recorded so far in this step's loop; this spec: at the step start).

    Let Q be a request running at the step start, of a user the GCRA refuses at the
    step's instant (replay), with only its sampling position left and a token still to
    dispatch, that is neither scheduled nor preempted in the step, and whose (user,
    priority) group stands, in ``running`` at the step start, before every group with a
    request scheduled in the step (so vLLM's loop, which preempts only while sizing a
    request it then schedules, passed Q, refused it and recorded it as throttled
    before any allocation failed, whatever the rotation within groups). Then a
    preempted request P whose user the GCRA grants at the step start at least once per
    request it has running (so P is throttled at no timing) is a victim chosen over a
    throttled request: a violation."""
    throttled, grants, counts = _fcfs_passed_throttled(j, trace, state_before, now)
    if not throttled:
        return None
    start = j.start
    assert start is not None, "checked only with the step start recorded"
    for rid in trace.preempted:
        if rid not in j.by_id or rid not in start.running:
            continue
        user = j.user_of(rid)
        if grants.get(user, 0) >= counts.get(user, 0) > 0:
            q = throttled[-1]
            return (
                "R13",
                "should",
                (
                    f"{j.name} preempted {rid} (user {user!r}, granted at t={now} ns for each of its running "
                    f"requests) while {q} (user {j.user_of(q)!r}, refused at t={now} ns, throttled and passed "
                    "by the running loop before any KV allocation failed) kept its KV: the article preempts "
                    "throttled requests first"
                ),
            )
    return None


def _fcfs_passed_throttled(j: Any, trace, state_before, now: int):
    """For ``_fcfs_victim_check``: (the requests Q, in ``running`` order; each running
    user's grants at the step start, up to its running requests; those counts)."""
    assert j.start is not None, "checked only with the step start recorded"
    if not any(rid in j.by_id for rid in j.start.running):
        return [], {}, {}
    return step_checks.passed_throttled(j, trace, state_before, set())


def _priority_victim_check(j: Any, trace, resident: set[str]) -> tuple[str, str, str] | None:
    """R13 under PRIORITY (level should): vLLM preempts at its victim level, the highest
    priority value in ``running``, and the article's preferred throttled victims are
    taken only within that level; so no request preempted in a step may have a lower
    priority value than a request that was running at the step start and still is."""
    running = {r.request_id for r in j.harness.scheduler.running}
    survivors = [rid for rid in resident if rid in running and rid in j.by_id]
    for rid in trace.preempted:
        if rid not in j.by_id:
            continue
        level = j.by_id[rid].priority
        above = sorted(s for s in survivors if j.by_id[s].priority > level)
        if above:
            return j.named(
                "R13",
                "should",
                (
                    f"{j.name} preempted {rid} (priority {level}) while {above[0]} (priority "
                    f"{j.by_id[above[0]].priority}, a lower priority) kept its KV: under PRIORITY the victim is "
                    "taken at the lowest priority level, and the article's throttled victims only within it"
                ),
            )
    return None


def bypass_check(j: Any, step: int, trace, unfinished: list[str]) -> tuple[str, str, str] | None:
    """R14 as bounded bypass: while stream ``s`` of a user is decoding and unfinished,
    at most ``R14_BYPASS_FACTOR x n`` of that user's grants go to its other streams
    before ``s`` samples again (n: the user's unfinished streams)."""
    sampled = set(trace.sampled)
    by_user: dict[str, list[str]] = {}
    for rid in unfinished:
        by_user.setdefault(j.user_of(rid), []).append(rid)
    for user, streams in by_user.items():
        grants = [rid for rid in trace.sampled if j.user_of(rid) == user]
        bound = R14_BYPASS_FACTOR * len(streams)
        for rid in streams:
            if rid in sampled:
                j.bypassed[rid] = 0
                j.bypass_bound.pop(rid, None)
            elif rid in j.last_sample_step:
                j.bypassed[rid] = j.bypassed.get(rid, 0) + len(grants)
                # The bound of the longest turn cycle since rid last sampled: streams that
                # finish meanwhile (n > 1 children end together) do not shrink it.
                held = j.bypass_bound[rid] = max(bound, j.bypass_bound.get(rid, 0))
                if j.bypassed[rid] > held:
                    # Turns (R14) start after the last-served stream (R15): a slip of either
                    # shows as the same bypass, so both are named.
                    return j.named(
                        "R14/R15",
                        "should",
                        (
                            f"{j.name}: {rid} of user {user!r} waited while {j.bypassed[rid]} of that "
                            f"user's tokens went to its other streams (bound {held}): the article's streams "
                            "of one user take turns (R14), each turn starting after the stream served last (R15)"
                        ),
                    )
    return None
