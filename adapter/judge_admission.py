"""Admission in ample sync FCFS scenarios: the scenario judge's (``adapter/judge.py``)
checks of the first request left waiting, R12 at admission (``admission_cap_check``:
throttled requests give up their place in the active cap) and R10 (``prefill_advance_check``:
a refused prefill still advances short of sampling).

Each function takes the judge ``j`` (its scenario, ``start``, ``state``, ``by_id``,
``user_of``, ``name``, ``should``, ``named``). A failure is ``(rule, level, message)``.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.adapter import judge_grants, step_checks
from vllm_output_rate.spec import limiter as spec_limiter


def prefill_advance_check(j: Any, trace, unfinished: list[str], state_before) -> tuple[str, str, str] | None:
    """R10 (level should), ample sync scenarios with chunked prefill, without prefix
    caching (a cache hit may already reach n - 1) or an active cap (admission under it is
    the article's open choice): a waiting request with no token computed and a prompt of
    2 or more tokens, whose user the GCRA refuses at the step's start (so at its charge
    point too: within ``schedule()`` a TAT only rises), still advances its prefill short
    of sampling in that step ("开启 chunked prefill 时，prefill 可以先推进到倒数第二个位置"),
    unless a waiting request before it was not admitted either (vLLM 0.32 stops admitting
    behind a request given 0 tokens: the open choice ``judge_grants.under_grant_check`` excuses too)."""
    scenario, start = j.scenario, j.start
    if (
        start is None
        or not scenario.chunked_prefill
        or scenario.prefix_caching
        or scenario.max_num_active_seqs is not None
    ):
        return None
    now, burst = trace.now_ns, scenario.burst_ns
    rid = _first_left_waiting(j, trace, unfinished, set(start.running))
    if rid is not None:
        r = j.by_id[rid]
        if (
            rid not in start.untouched
            or r.prompt_len < 2
            or scenario.policy != "fcfs"
            or spec_limiter.allows(state_before, j.user_of(rid), now, burst)
        ):
            return None  # the first waiting request left out is not judged here: all behind it are excused
        return j.named(
            "R10",
            "should",
            (
                f"{j.name} left {rid} (user {j.user_of(rid)!r}, prompt {r.prompt_len} tokens) waiting at "
                f"t={now} ns with nothing computed: its user is refused, and with chunked prefill the article "
                f"still advances a refused prefill to n - 1 = {r.prompt_len - 1} (R10), seats and budget being "
                "ample"
            ),
        )
    return None


def _first_left_waiting(j: Any, trace, unfinished: list[str], resident: set[str]) -> str | None:
    """The first request, in arrival order (= vLLM's FCFS waiting order), that was not
    running at the step start and was not scheduled in it; None if there is none."""
    return next(
        (rid for rid in unfinished if rid in j.by_id and rid not in resident and rid not in trace.scheduled),
        None,
    )


def admission_cap_check(j: Any, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
    """R12 black-box at admission (level must), ample sync FCFS scenarios with an active
    cap A: the article's waiting loop admits while ``len(running) < M`` and ``len(running)
    - throttled < A`` ("先确认 running 总数没有达到 max_num_running_reqs，再把被跳过的请求从
    running 数里减掉，和 max_num_active_reqs 比较"). So when the running loop did not fill
    the cap (no running request was left out by it, so every running request left out at
    its sampling position is a throttled one: its user refused, ``judge_grants.throttled_seats``) and,
    after the step, ``len(running) - throttled < A``, the first waiting request left
    waiting must not be of a user the GCRA still grants; a waiting request behind one
    left out is excused (the head-of-line open choice of ``judge_grants.under_grant_check``)."""
    scenario, start = j.scenario, j.start
    cap = scenario.max_num_active_seqs
    if cap is None or start is None or scenario.policy != "fcfs":
        return None
    if sum(1 for r in trace.scheduled if r not in trace.admitted) >= cap:
        return None  # the running loop filled the cap: requests it left out count as running
    throttled = judge_grants.throttled_seats(j, trace, resident)
    counted = trace.num_running - len(throttled)  # len(running) when schedule() returned
    if counted >= cap:
        return None
    now, burst = trace.now_ns, scenario.burst_ns
    rid = _first_left_waiting(j, trace, unfinished, resident)
    if rid is not None:
        user = j.user_of(rid)
        if not spec_limiter.allows(j.state, user, now, burst):
            if j.should and step_checks.can_advance(j, rid):
                return (
                    "R10",
                    "should",
                    (
                        f"{j.name} left {rid} (user {user!r}) waiting at t={now} ns with its prefill not "
                        f"advanced although the active cap has room ({counted} < --max-num-active-seqs {cap} "
                        "after R12's count): its user is refused, and with chunked prefill the article still "
                        "admits it and advances its prefill to n - 1 (R10), so other users behind it proceed (P4)"
                    ),
                )
            return None  # the first left waiting is refused: it and those behind it are not judged
        return j.named(
            "R12",
            "must",
            (
                f"R12 broken: {j.name} left {rid} (user {user!r}) waiting at t={now} ns although the GCRA "
                f"grants that user a token and the active cap has room: {trace.num_running} running after "
                f"schedule(), {len(throttled)} of them throttled ({sorted(throttled)}, users the GCRA refuses), so "
                f"{counted} < --max-num-active-seqs {cap}; R12: the waiting loop admits while len(running) - "
                "throttled < A, throttled requests give up their place in the active cap"
            ),
        )
    return None
