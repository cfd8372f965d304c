"""P4, no under-grant: the scenario judge's (``adapter/judge.py``) checks that a request of
a user the spec GCRA still grants is not paused, where nothing but the limit (and the
active cap, R12) can be short: ``under_grant_check`` (ample scenarios, or past the
pressure) and ``pressured_under_grant_check`` (under pressure, where the article fixes the
outcome). A pause that only throttled running requests counted in the active cap explain
is R12's (``throttled_seats``).

Each function takes the judge ``j`` (its scenario, ``start``, ``state``, ``by_id``,
``user_of``, ``name``, ``records``, ``named``). A failure is ``(rule, level, message)``.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.adapter import step_checks
from vllm_output_rate.adapter.judge_record import StepStart
from vllm_output_rate.spec import limiter as spec_limiter


def under_grant_check(j: Any, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
    """P4 (level must): a request of a user the GCRA still grants after this step's
    dispatches is scheduled to sample, unless the active cap is full; a waiting request
    behind a refused user's waiting request is excused (the article's open choice).
    Judged only where nothing but the limit can be short (``Scenario.ample_at``)."""
    now, sampled, cap = trace.now_ns, set(trace.sampled), j.scenario.max_num_active_seqs
    cap_full = cap is not None and len(trace.scheduled) >= cap
    burst = j.scenario.burst_ns
    blocked_behind = False  # an earlier waiting request of a refused user was not admitted
    limit_blocked: str | None = None  # ... one the article would have advanced to n - 1 (R10)
    for rid in unfinished:  # in arrival order (= vLLM's FCFS waiting order)
        user = j.user_of(rid)
        if rid not in resident and rid not in trace.scheduled and not spec_limiter.allows(j.state, user, now, burst):
            # Open choice (docs/SPEC.md "What the article leaves open"): checking the user at
            # the charge point, after vLLM's own checks, gives that request 0 tokens, and vLLM
            # 0.32 then stops admitting the waiting requests behind it in this step. That stop
            # is vLLM's only where the refused request cannot advance short of sampling.
            if step_checks.can_advance(j, rid) and not blocked_behind:
                limit_blocked = limit_blocked or rid
            else:
                blocked_behind = True
            continue
        if cap is not None and rid not in resident:
            continue  # admission under an active cap is the article's open choice
        if rid not in resident and blocked_behind:
            continue
        if rid not in resident and limit_blocked is not None and rid not in trace.scheduled:
            if j.should and spec_limiter.allows(j.state, user, now, burst):
                return _head_of_line(j, rid, limit_blocked, now)
            continue
        if rid in sampled or cap_full:
            continue
        if j.records:
            j.records[-1].pauses.append(rid)  # the judge holds this pause to be the limiter's
        if spec_limiter.allows(j.state, user, now, burst):
            seated = throttled_seats(j, trace, resident) if cap is not None else []
            if cap is not None and len(trace.scheduled) + len(seated) >= cap:
                # R12: the cap is full only if throttled running requests hold seats in it.
                return (
                    "R12",
                    "must",
                    (
                        f"R12 broken: {j.name} paused {rid} (user {user!r}) at t={now} ns although the GCRA "
                        f"still grants that user a token: {len(trace.scheduled)} requests scheduled, below "
                        f"--max-num-active-seqs {cap}, which the throttled running requests {sorted(seated)} (users "
                        f"the GCRA refuses) fill only if they are counted; R12: throttled requests give up their "
                        f"place in the active cap. Seen: under-grant"
                    ),
                )
            return j.named(
                "R11",
                "must",
                (
                    f"{j.name} paused {rid} (user {user!r}) at t={now} ns although the GCRA still grants "
                    f"that user a token and nothing else (seats, budget, KV, active cap) was short: under-grant"
                ),
            )
    return None


def _head_of_line(j: Any, rid: str, blocker: str, now: int) -> tuple[str, str, str]:
    """R10/P4 (should): ``rid`` left waiting behind ``blocker``, a refused waiting request
    whose prefill could have advanced short of sampling (``step_checks.can_advance``)."""
    return (
        "R10",
        "should",
        (
            f"R10 broken (P4): {j.name} left {rid} (user {j.user_of(rid)!r}) waiting at t={now} ns although "
            f"the GCRA grants that user and nothing else was short, behind {blocker} (user "
            f"{j.user_of(blocker)!r}, refused) whose prefill could still advance to n - 1: a refused waiting "
            "request ended admission, so other users' requests behind it wait (promise 4: 一个用户被限速时，其他用户"
            "照常推进). vLLM's own stops (a prompt that does not fit, a request left with only its sampling "
            "position) are stock; a stop caused by the refusal is not"
        ),
    )


def throttled_seats(j: Any, trace, resident: set[str]) -> list[str]:
    """Running requests at the step start, not scheduled, with only their sampling
    position left and a token to dispatch, whose user the GCRA refuses (after the
    step's dispatches): the throttled requests R12 excludes from the active cap."""
    start, now, burst = j.start, trace.now_ns, j.scenario.burst_ns
    if start is None:
        return []
    return [
        rid
        for rid in start.running
        if rid in resident
        and rid in j.by_id
        and rid not in trace.scheduled
        and rid in start.decoding
        and rid in start.demand
        and not spec_limiter.allows(j.state, j.user_of(rid), now, burst)
    ]


def pressured_under_grant_check(j: Any, trace, unfinished: list[str]) -> tuple[str, str, str] | None:
    """P4 under pressure (level must, sync and async), where the article fixes the
    outcome: a step that left token budget, preempted nothing (so every KV allocation of
    vLLM's running loop succeeded and the loop reached every running request) and did
    not fill the active cap must serve every request that was running at its start with
    only its sampling position left and a token to dispatch, whose user the GCRA still
    grants after the step's dispatches (within ``schedule()`` a TAT only rises, so the
    user was granted at that request's charge point too). Under FCFS a step that
    preempted is judged too (``step_checks.fcfs_preempting_step_judged``: the loop still
    reached every request left running). Waiting requests are not
    judged here (admission under pressure is vLLM's and the article's open choice).

    Async (one step in flight): the same outcome is fixed. The charge condition counts
    the in-flight placeholders (R7; the article: "判断条件不变"), so a request with a
    step in flight is decoding (``judge_record.StepStart.decoding``); one whose placeholders already
    carry it to ``max_tokens`` has no token to dispatch (V3, R11: not ``demand``); the
    step after an unseen EOS is dispatched and charged like any other (R8), and nothing
    waits for model output (R8), so a granted request is not held for its in-flight
    output. A request the delivered output finished (its final token was in flight) is
    not judged: dispatching it again would give its user nothing. Refunds (R9) happen
    only at the end of ``schedule()``, after the running loop, and this check judges no
    step that preempted."""
    start, scenario = j.start, j.scenario
    if start is None or (trace.preempted and not step_checks.fcfs_preempting_step_judged(j, trace)):
        return None
    if not step_checks.left_room(j, trace):
        return None
    scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
    running_after = {r.request_id for r in j.harness.scheduler.running}
    now, burst = trace.now_ns, scenario.burst_ns
    for rid in start.running:
        if (
            rid not in j.by_id
            or rid not in unfinished
            or rid in trace.scheduled
            or rid not in running_after
            or rid not in start.decoding
            or rid not in start.demand
        ):
            continue
        user = j.user_of(rid)
        if j.records:
            j.records[-1].pauses.append(rid)  # the judge holds this pause to be the limiter's
        if spec_limiter.allows(j.state, user, now, burst):
            return _paused_while_granted(j, trace, start, rid, user, scheduled_running)
    return None


def _paused_while_granted(
    j: Any, trace, start: StepStart, rid: str, user: str, scheduled_running: list[str]
) -> tuple[str, str, str]:
    """The failure of ``pressured_under_grant_check`` for running ``rid`` paused although
    the GCRA still grants ``user`` (``scheduled_running``: the step's scheduled requests
    that were not admitted in it): R12 (must) when those fill --max-num-active-seqs only
    if the throttled running requests (``throttled_seats``) are counted, else R11
    (must, named from the dispatch replay: P4 under-grant under pressure)."""
    scenario, now = j.scenario, trace.now_ns
    budget, cap = scenario.max_num_batched_tokens or 2048, scenario.max_num_active_seqs
    seated = throttled_seats(j, trace, set(start.running)) if cap is not None else []
    if cap is not None and len(scheduled_running) + len(seated) >= cap:
        return (
            "R12",
            "must",
            (
                f"R12 broken: {j.name} paused running {rid} (user {user!r}) at t={now} ns although the "
                f"GCRA still grants that user a token and the step left budget and preempted nothing: "
                f"{len(scheduled_running)} running requests scheduled, below --max-num-active-seqs {cap}, "
                f"which the throttled running requests {sorted(seated)} (users the GCRA refuses) fill only "
                f"if they are counted; R12: throttled requests give up their place. Seen: under-grant"
            ),
        )
    return j.named(
        "R11",
        "must",
        (
            f"{j.name} paused running {rid} (user {user!r}) at t={now} ns although the GCRA still grants "
            f"that user a token, the step left token budget ({sum(trace.scheduled.values())} of {budget} "
            "scheduled) and did not fill the active cap, "
            + (
                f"and under FCFS vLLM's loop reached it after preempting {trace.preempted} from the end "
                "of `running` (a preemption must not skip the next request)"
                if trace.preempted
                else "and preempted nothing"
            )
            + ": under-grant under pressure, other users must proceed (P4)"
        ),
    )
