"""R16's judgement (``judge``): pure, from the child's observation of vLLM's engine-core loop.

The sampling dispatches are replayed through the spec limiter (``spec/limiter.py``, R1-R5)
to know each user's ready time; then (1) no spin, (2a) no oversleep, (2b) the longest wait
(reported), (2c) no early wake (R5 when the wake is at ``ready_at`` rounded down), and
(3) a new request and an abort wake the engine. The first failure, in the article's terms,
is ``_first_failure``'s. Times ns.
"""

from __future__ import annotations

import bisect
import itertools
import math
from fractions import Fraction
from typing import Any

from vllm_output_rate.adapter.engine_wait_scenario import (
    A_RATE_TOKENS_PER_S,
    ARTICLE_RECHECK_NS,
    FLOAT_TIMEOUT_SLACK_NS,
    LATENESS_TOLERANCE_NS,
    MS,
    SPIN_SLACK_WAKEUPS,
    STOCK_IDLE_SLEEP_NS,
    USER_A,
    USER_B,
    WAKE_TOLERANCE_NS,
    EngineWaitScenario,
    EngineWaitVerdict,
)
from vllm_output_rate.spec import limiter


# =======================================================================================
# Judgement: pure, from the observation.
# =======================================================================================
def judge(obs: dict, scenario: EngineWaitScenario, verdict: EngineWaitVerdict) -> EngineWaitVerdict:
    """Fill ``verdict`` from the child's observation ``obs`` of ``scenario`` (rule R16).

    ``obs``: ``wakeups`` (fake instants of loop iterations, each with whether it ran the
    model), ``steps`` (each ``schedule()``: instant, scheduled and sampling request ids),
    ``waits`` (fake blocking waits: start, end, requests pending), ``aborts`` (instants of
    ``finish_requests`` calls and their ids), ``end_ns``, ``stopped_by``, ``error``.
    """
    if obs.get("error") and "end_ns" not in obs:
        verdict.failure = f"the engine could not be built around the candidate: {obs['error'].strip().splitlines()[-1]}"
        verdict.error = obs["error"]
        return verdict
    end_ns = obs["end_ns"]
    verdict.fake_ns = end_ns
    verdict.stopped_by = obs.get("stopped_by", "")
    verdict.engine_step = obs.get("step_fn", "")
    steps = obs["steps"]
    wakeups = obs["wakeups"] or [[s["t"], s["tokens"] > 0] for s in steps]
    verdict.wakeups = len(wakeups)
    productive = [s for s in steps if s["tokens"] > 0]
    verdict.productive_steps = len(productive)
    run = _Replay(scenario, end_ns, wakeups, obs.get("arrivals", {}))
    run.replay(productive, verdict)
    _judge_spin(run, productive, verdict)
    _judge_oversleep(run, verdict)
    _judge_longest_wait(run, obs, verdict)
    _judge_early_wake(run, obs, verdict)

    # (3) new input wakes the engine.
    t_new = run.arrivals[scenario.new_request_id]
    first = next((s["t"] for s in steps if scenario.new_request_id in s["scheduled"]), None)
    verdict.new_request_latency_ns = None if first is None else first - t_new
    handled = next((a[0] for a in obs["aborts"] if scenario.aborted_request_id in a[1] and a[0] >= run.t_abort), None)
    verdict.abort_latency_ns = None if handled is None else handled - run.t_abort

    verdict.failure = _first_failure(verdict, obs)
    return verdict


class _Replay:
    """One run's facts for ``judge``: the scenario's requests (user, ``max_tokens``, arrival),
    the sampling dispatches replayed through the spec limiter (R1-R5) and the ready times
    they imply."""

    def __init__(
        self, scenario: EngineWaitScenario, end_ns: int, wakeups: list[Any], arrived: dict[str, int] | None = None
    ) -> None:
        self.scenario, self.end_ns, self.wakeups = scenario, end_ns, wakeups
        self.user_of = {i.request_id: i.user for i in scenario.inputs if i.kind == "add"}
        self.max_tokens = {i.request_id: i.max_tokens for i in scenario.inputs if i.kind == "add"}
        # An input that arrives during a step (polling world) arrives when it reached the queue.
        self.arrivals = {
            i.request_id: (arrived or {}).get(i.request_id, i.at_ns) for i in scenario.inputs if i.kind == "add"
        }
        self.t_abort = next(i.at_ns for i in scenario.inputs if i.kind == "abort")
        self.sampled_by_user: dict[str, list[int]] = {}
        self.dispatch_times: dict[str, list[int]] = {}  # request id -> instants of its sampling dispatches
        self.expectations: list[tuple[str, int, int]] = []  # (user, dispatch instant, ready instant)
        self.replay_at: list[tuple[int, Any]] = []  # (instant of a step, replay state after it)

    def demand(self, user: str, t: int) -> bool:
        """``user`` still wants a token at ``t`` (``_has_demand``)."""
        return _has_demand(
            user,
            t,
            self.dispatch_times,
            self.user_of,
            self.max_tokens,
            self.arrivals,
            self.scenario.aborted_request_id,
            self.t_abort,
        )

    def replay(self, productive: list[dict[str, Any]], verdict: EngineWaitVerdict) -> None:
        """Replay the sampling dispatches through the spec limiter (R1-R5) for the ready times."""
        scenario, user_of = self.scenario, self.user_of
        sampled_by_user, dispatch_times, expectations = self.sampled_by_user, self.dispatch_times, self.expectations
        state = limiter.EMPTY
        self.replay_at.append((-1, state))
        for s in productive:
            users_now = []
            for rid in s["sampled"]:
                user = user_of.get(rid)
                if user is None:
                    continue
                state, granted = limiter.try_take(
                    state, user, Fraction(scenario.rates[user]), s["t"], scenario.burst_ns
                )
                verdict.over_grants += not granted
                dispatch_times.setdefault(rid, []).append(s["t"])
                sampled_by_user.setdefault(user, []).append(s["t"])
                users_now.append(user)
            self.replay_at.append((s["t"], state))
            for user in set(users_now):
                ready = limiter.ready_at_ns(state, user, scenario.burst_ns)
                if ready is not None and ready > s["t"]:
                    expectations.append((user, s["t"], ready))
        verdict.tokens = {u: len(ts) for u, ts in sampled_by_user.items()}


def _judge_spin(run: _Replay, productive: list[dict[str, Any]], verdict: EngineWaitVerdict) -> None:
    """(1) Spin: idle wake-ups (while some user still wants tokens) per interval between events."""
    scenario, end_ns, wakeups = run.scenario, run.end_ns, run.wakeups
    # Events: steps that ran the model, inputs, the end of the run.
    arrivals = set(run.arrivals.values()) | {run.t_abort}
    events = sorted({s["t"] for s in productive} | arrivals | {end_ns})
    idle_in: dict[int, int] = {}
    idle_times = []
    for t, ran in wakeups:
        if ran or not any(run.demand(u, t) for u in scenario.rates):
            continue  # a step that ran the model, or one with nobody left wanting a token
        idle_times.append(t)
        k = max(0, bisect.bisect_right(events, t) - 1)
        idle_in[k] = idle_in.get(k, 0) + 1
    verdict.idle_wakeups = len(idle_times)
    for k in idle_in:
        length = (events[k + 1] if k + 1 < len(events) else end_ns) - events[k]
        verdict.throttled_ns += length
        verdict.allowed_idle_wakeups += math.ceil(length / ARTICLE_RECHECK_NS) + SPIN_SLACK_WAKEUPS
    gaps = sorted(b - a for a, b in itertools.pairwise(idle_times))
    verdict.median_idle_gap_ns = gaps[len(gaps) // 2] if gaps else None


def _judge_oversleep(run: _Replay, verdict: EngineWaitVerdict) -> None:
    """(2a) Oversleep: a throttled user with demand gets its next token at its ready time."""
    end_ns, sampled_by_user, expectations = run.end_ns, run.sampled_by_user, run.expectations
    for user, at, ready in expectations:
        if not run.demand(user, ready):
            continue
        times = sampled_by_user[user]
        k = bisect.bisect_right(times, at)
        later = times[k : k + 1]
        if later:
            late = later[0] - ready
        elif end_ns > ready:
            late = end_ns - ready  # never dispatched again
        else:
            continue
        if late > verdict.max_lateness_ns:
            verdict.max_lateness_ns = late
            verdict.lateness_detail = (
                f"{user} became ready at {ready / MS:.3f} ms and its next token was dispatched "
                + (f"at {later[0] / MS:.3f} ms" if later else f"never (run ended at {end_ns / MS:.3f} ms)")
            )


def _judge_longest_wait(run: _Replay, obs: dict[str, Any], verdict: EngineWaitVerdict) -> None:
    """(2b) The longest wait while requests were pending (reported: how long a wait may be is
    bounded by the ready times, judged in (2a), and by new input, judged in (3))."""
    end_ns, wakeups = run.end_ns, run.wakeups
    # (2b) longest wait while requests were pending: gaps between wake-ups spanning a
    # pending fake wait (and the gap from the last wake-up to the end of the run).
    instants = [t for t, _ in wakeups] + [end_ns]
    pending_waits = sorted((w[0], w[1]) for w in obs["waits"] if w[2] and w[1] > w[0])
    starts = [w[0] for w in pending_waits]
    for a, b in itertools.pairwise(instants):
        k = bisect.bisect_left(starts, a)
        if k < len(starts) and starts[k] < b:
            verdict.max_wait_ns = max(verdict.max_wait_ns, b - a)


def _judge_early_wake(run: _Replay, obs: dict[str, Any], verdict: EngineWaitVerdict) -> None:
    """(2c) Early wake: a hinted wait on the input queue ends no earlier than the first ready time."""
    scenario, end_ns, replay_at = run.scenario, run.end_ns, run.replay_at
    # (2c) early wake: a wait on the input queue that timed out, other than the article's
    # 50 ms re-check (a wait of ARTICLE_RECHECK_NS, give or take a float timeout's rounding),
    # so that the wait hint ended it, must not end before the earliest
    # ready time (R5: rounded up) of the users with pending requests, from the replay at
    # the wait's start (nothing is dispatched during a wait).
    inputs_at = set(run.arrivals.values()) | {run.t_abort}
    replay_times = [t for t, _ in replay_at]
    for w in _merged_waits(obs["waits"]):
        start, end, pending, kind = w[0], w[1], w[2], w[3]
        if (
            kind != "input-queue"
            or not pending
            or not start < end < end_ns
            or end in inputs_at
            or abs(end - start - ARTICLE_RECHECK_NS) <= FLOAT_TIMEOUT_SLACK_NS
        ):
            continue
        at = replay_at[bisect.bisect_right(replay_times, start) - 1][1]
        readies = []
        for user in scenario.rates:
            if run.demand(user, end):
                ready = limiter.ready_at_ns(at, user, scenario.burst_ns)
                readies.append((start if ready is None else ready, user))
        if readies and min(readies)[0] - end > verdict.max_early_ns:
            ready, user = min(readies)
            verdict.max_early_ns = ready - end
            verdict.early_detail = (
                f"its wait on the input queue ended at {end} ns, {ready - end} ns before {user}'s "
                f"ready time {ready} ns, with every user with pending requests still refused"
            )
            # R5: a wake at floor(TAT - tau), 1 ns before ceil(TAT - tau), is ready_at rounded down
            exact = at.tat_ns[user] - scenario.burst_ns if user in at.tat_ns else None
            verdict.early_rounded_down = (
                exact is not None and exact.denominator != 1 and math.floor(exact) == end and ready - end == 1
            )


def _merged_waits(waits: list[list[Any]]) -> list[list[Any]]:
    """Waits on the input queue that follow each other without a gap, as one wait: Python's
    ``queue.Queue.get(timeout)`` waits again for what float rounding of its deadline leaves
    (e.g. 1 ns after a 50 ms wait), which is the same wait, not an early wake."""
    merged: list[list[Any]] = []
    for w in waits:
        last = merged[-1] if merged else None
        if (
            last is not None
            and w[3] == last[3] == "input-queue"
            and w[0] == last[1]
            and w[1] - w[0] <= FLOAT_TIMEOUT_SLACK_NS
        ):
            last[1] = w[1]
        else:
            merged.append(list(w))
    return merged


def _has_demand(
    user: str,
    ready: int,
    dispatch_times: dict[str, list[int]],
    user_of: dict[str, str],
    max_tokens: dict[str, int],
    arrivals: dict[str, int],
    aborted_id: str,
    t_abort: int,
) -> bool:
    """True if ``user`` has a request, arrived by ``ready``, still wanting tokens at ``ready``."""
    for rid, u in user_of.items():
        if u != user or arrivals[rid] > ready or (rid == aborted_id and t_abort <= ready):
            continue
        if bisect.bisect_left(dispatch_times.get(rid, []), ready) < max_tokens[rid]:
            return True
    return False


def _first_failure(v: EngineWaitVerdict, obs: dict) -> str | None:
    def ms(ns: int) -> str:
        return f"{ns / MS:.1f} ms"

    if obs.get("error"):
        return f"the engine loop raised: {obs['error'].strip().splitlines()[-1]}"
    if v.productive_steps == 0:
        return "the engine never ran the model: no request was scheduled in the R16 scenario"
    if v.idle_wakeups == 0:
        return (
            f"no user was ever throttled ({USER_A} got {v.tokens.get(USER_A, 0)} tokens at {A_RATE_TOKENS_PER_S} tok/s "
            f"in {ms(v.fake_ns)}, {v.over_grants} of them over the rate), so the engine wait could not be judged"
        )
    if v.idle_wakeups > v.allowed_idle_wakeups:
        how = (
            "stock vLLM's 1 ms idle loop"
            if v.median_idle_gap_ns is not None and v.median_idle_gap_ns <= 3 * STOCK_IDLE_SLEEP_NS // 2
            else f"a wake-up every {ms(v.median_idle_gap_ns or 0)}"
        )
        return (
            f"the engine spun: {v.idle_wakeups} wake-ups in {ms(v.throttled_ns)} while every user was throttled "
            f"({how}, at most {v.allowed_idle_wakeups} allowed); the article's engine waits until the next ready "
            f"time (at most 50 ms)"
        )
    if v.max_lateness_ns > LATENESS_TOLERANCE_NS:
        return (
            f"the engine overslept: {v.lateness_detail}, {ms(v.max_lateness_ns)} late; the article's engine wakes at "
            f"the next ready time of a throttled user"
        )
    if v.max_early_ns > 0 and v.early_rounded_down:
        v.rule = "R5"
        return (
            f"R5 broken: the engine woke early, at ready_at rounded down: {v.early_detail}; that instant is "
            f"floor(TAT - tau) of a TAT - tau that is not a whole ns, and R5's ready_at is ceil(TAT - tau) (a take "
            f"there is still refused); the article's engine waits until the earliest ready time (at most 50 ms)"
        )
    if v.max_early_ns > 0:
        return (
            f"the engine woke early: {v.early_detail}; the article's engine waits until the earliest ready time of a "
            f"throttled user (ready_at rounded up), or 50 ms"
        )
    if v.new_request_latency_ns is None or v.new_request_latency_ns > WAKE_TOLERANCE_NS:
        when = "never" if v.new_request_latency_ns is None else f"only after {ms(v.new_request_latency_ns)}"
        if v.polling:
            return (
                f"a new request did not wake the engine: {USER_B}'s request, taken by the engine during an empty "
                f"step, was scheduled {when}; after a step that took a request, the engine must not wait for a "
                f"throttled user's ready time (the request is pending and unscheduled, and the input queue is empty)"
            )
        return (
            f"a new request did not wake the engine: {USER_B}'s request arriving mid-wait was scheduled {when}; "
            f"the article's engine waits on its input queue, so a new request wakes it at once"
        )
    if v.abort_latency_ns is None or v.abort_latency_ns > WAKE_TOLERANCE_NS:
        when = "never" if v.abort_latency_ns is None else f"only after {ms(v.abort_latency_ns)}"
        return (
            f"an abort did not wake the engine: an abort arriving mid-wait reached the scheduler {when}; the "
            f"article's engine waits on its input queue, so an abort wakes it at once"
        )
    return None
