"""The scenario judge: a rate-limit ``Scenario`` (``adapter/scenarios.py``) on a real
scheduler, judged step by step against the spec limiter.

A ``Scenario`` is plain data (JSON-able, replayable): an engine shape, per-user rates, a
list of requests each arriving at some step, a fixed clock advance between steps. Running
it drives a ``Harness`` and applies these checks after every step (black-box: only what
vLLM exposes is used, so any scheduler class can be judged):

- R2/R7 grant: each user's sampling dispatches in the step, replayed as ``try_take`` on
  the exact spec limiter at the step's time, must all be granted (no over-grant);
- R11/R2 pause only when refused (sync mode): if one of the user's unfinished requests
  did not sample in the step, the spec limiter must refuse one more take (the limit, not
  something else, paused it; the scenarios give ample token budget, KV and seats);
- R2 window bound: in every window [t_i, t_j] of step times, a user's sampling dispatches
  <= floor((t_j - t_i + tau) x rate) + 1;
- R11 pause-not-truncate: at the end every request finished with exactly ``max_tokens``
  outputs, or ``eos_index + 1`` if its EOS came first.

Ample sync scenarios also check R11 "kept resident" (no preemption) and R14 rotation.
Ample async scenarios check the under-grant (P4) for the requests with a token left to
dispatch (outputs plus in-flight placeholders below ``max_tokens``); a pressured scenario
with ``ample_from_step`` (its author guarantees seats, budget and KV from that step on)
checks it from that step; before it (and in every pressured scenario), sync and async, the
running requests are judged in each step that left token budget, preempted nothing and did
not fill the active cap (``judge_grants.pressured_under_grant_check``). At should, R13 is
judged black-box: under PRIORITY no victim above vLLM's victim level, under FCFS no victim
granted for all its user's running requests while a throttled request the running loop
already passed keeps its KV (``judge_should._fcfs_victim_check``: both timings of "throttled",
the article's and ours).
At should, ``adapter/step_checks.py`` closes the blind spots of issue 26: R12 a batch within
the active cap, R10 no split prompt without chunked prefill and a running refused prefill
advanced to n - 1, R13 throttled victims within the PRIORITY level, R14 other users' places
in ``running`` kept; head-of-line blocking caused by the limit (a refused waiting request
that could advance ends admission, R10/P4) is told apart from vLLM's own stops; under FCFS
the under-grant check also judges steps that preempted. n > 1 requests are drawn as vLLM's
front end builds them (``parallel_children``: children sharing one ``SamplingParams``).
Scenarios with resource pressure (``pressured_scenarios``) are judged by the black-box
checks that still hold under pressure plus the white-box invariants on the scheduler's
observation (docs/OBSERVATION.md): charges minus refunds equal sampling dispatches (R7,
R9), refunds only of this step's charges, once (R9), throttled never scheduled (R11),
scheduled running requests <= max_num_active_seqs (R12), every user's TAT equal to the
spec limiter's replay (R1-R6), and the wait hint the earliest ready time (R16).

``_Judge`` keeps the replay and the run's history; its collaborators judge one concern
each (every function takes the judge): ``judge_record`` (the step start and the records
for naming a rule), ``judge_grants`` (P4 under-grant, R11, R12 seats), ``judge_admission``
(R10, R12 at admission), ``judge_should`` (R12 cap, R13 victims, R14/R15 turns, the blind
spots of ``step_checks``) and ``judge_observation`` (the white box, level exact).
"""

from __future__ import annotations

from fractions import Fraction

from vllm_output_rate.adapter import (
    attribution,
    coverage_observe,
    judge_admission,
    judge_grants,
    judge_observation,
    judge_record,
    judge_should,
)
from vllm_output_rate.adapter.gate_errors import reraise_gate_error
from vllm_output_rate.adapter.levels import includes
from vllm_output_rate.adapter.scenarios import Scenario, Verdict, spec_limiter_user
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import properties as spec_properties


class _Judge:
    """Per-step checks of one scenario run; keeps the spec limiter replay.

    A failure is ``(rule, level, message)``; messages name the class under test.
    """

    def __init__(self, scenario: Scenario, harness, level: str) -> None:
        self.scenario = scenario
        self.harness = harness
        self.name = harness.cls_path.rpartition(".")[2]
        self.should = includes(level, "should")
        self.exact = includes(level, "exact")
        self.by_id = {r.request_id: r for r in scenario.requests}
        self.state = spec_limiter.EMPTY
        self.history: dict[str, list[int]] = {}  # user -> time of each sampling dispatch
        self.last_sample_step: dict[str, int] = {}  # request id -> last step it sampled
        self.bypassed: dict[str, int] = {}  # R14: request id -> same-user grants since it last sampled
        self.bypass_bound: dict[str, int] = {}  # R14: request id -> the largest bound since then
        self.steps = 0
        self.start: judge_record.StepStart | None = None  # what vLLM's requests looked like before this step
        self.records: list[attribution.StepRecord] = []  # the black-box history, for naming a rule
        self.nameable = False  # the failure is one of the dispatch replay (``named``)
        self.aborted_in_flight: list[str] = []  # aborted before this step with a step in flight
        self.triggers_seen: set[tuple[str, str]] = set()  # ``crash_triggers`` held before a step that ran

    def crash_triggers(self) -> list[tuple[str, str]]:
        """The rare events of the rate layer due in the next ``schedule()``, as (rule, what),
        from what vLLM exposes (``before_step`` first): R6 its cleanup cadence; R14 a user's
        last-served stream (the one of its resident streams that sampled last, alone in
        its step) is the last of them in ``running``, so the next turn wraps around."""
        due = []
        if (self.steps + 1) % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            due.append(("R6", "the cleanup of idle users is due (every 256th schedule())"))
        assert self.start is not None, "before_step() first"
        groups: dict[tuple[str, int], list[str]] = {}
        for rid in self.start.running:
            if rid in self.by_id and rid in self.last_sample_step:
                groups.setdefault((self.user_of(rid), self.by_id[rid].priority), []).append(rid)
        for members in groups.values():
            latest = max(self.last_sample_step[rid] for rid in members)
            served = [rid for rid in members if self.last_sample_step[rid] == latest]
            if len(members) > 1 and served == [members[-1]]:
                due.append(("R14", "a user's turn wraps around: its last-served stream is the last of its streams"))
                break
        return due

    def crash_verdict(self, step: int, exc: Exception, held: list[tuple[str, str]]) -> Verdict | None:
        """The candidate raised ``exc`` in the ``schedule()`` of ``step``: a verdict naming the
        rule whose rare event (``crash_triggers``) is due for the first time in the run at
        that step, when exactly one is; else None (an unnamed crash). Re-raises an error of
        the gate's own code."""
        reraise_gate_error(exc)
        first = [t for t in held if t not in self.triggers_seen]
        if len(first) != 1:
            return None
        rule, what = first[0]
        failure = (
            f"{self.name} raised {type(exc).__name__}: {exc} in the schedule() of step {step}, the first step of "
            f"the run in which {what} ({rule}): a crash on {rule}'s path"
        )
        return Verdict(self.steps, failure, rule, step, level="must")

    def before_step(self) -> None:
        """Record, from vLLM's own ``Request`` fields, the state the next ``schedule()``
        starts from: ``running`` in order and, per unfinished request, whether only its
        sampling position is left (decoding, R10) and whether it still has a token to
        dispatch (outputs plus in-flight placeholders below ``max_tokens``, V3)."""
        scheduler = self.harness.scheduler
        decoding, demand, fresh, in_flight, untouched = set(), set(), set(), set(), set()
        for rid, r in scheduler.requests.items():
            placeholders = getattr(r, "num_output_placeholders", 0)
            if placeholders > 0:
                in_flight.add(rid)
            elif r.num_output_tokens == 0:
                fresh.add(rid)
            if r.num_computed_tokens == 0:
                untouched.add(rid)
            if r.num_computed_tokens >= r.num_tokens + placeholders - 1:
                decoding.add(rid)
            last_in_flight = placeholders > 0 and (
                r.num_computed_tokens + 2 - placeholders >= r.num_prompt_tokens + r.max_tokens
            )
            if r.num_output_tokens + placeholders < r.max_tokens and not last_in_flight:
                demand.add(rid)
        head = None
        if self.scenario.policy == "fcfs" and scheduler.waiting:
            first = next(iter(scheduler.waiting))
            head = (first.request_id, first.num_tokens - first.num_computed_tokens)
        self.start = judge_record.StepStart(
            [r.request_id for r in scheduler.running], decoding, demand, fresh, in_flight, untouched, head
        )

    def user_of(self, rid: str) -> str:
        """The R17 bucket of request ``rid``."""
        user = self.by_id[rid].user
        return spec_limiter_user(user)

    def _replay_dispatches(self, trace) -> tuple[str, str, str] | None:
        """R2 (must): replay the step's sampling dispatches (``trace.sampled``, at
        ``trace.now_ns``) on the spec GCRA, one take each, into ``state`` and ``history``.
        The first dispatch the GCRA refuses is a failure, named from the dispatch replay
        (``named``); the dispatches after it are not replayed."""
        scenario, now = self.scenario, trace.now_ns
        for rid in trace.sampled:
            user = self.user_of(rid)
            self.state, granted = spec_limiter.try_take(
                self.state, user, scenario.rate_of(user), now, scenario.burst_ns
            )
            if not granted:
                return self.named(
                    "R2",
                    "must",
                    (
                        f"{self.name} dispatched {rid} (user {user!r}) to sample at t={now} ns although the GCRA "
                        f"(rate {scenario.rate_of(user)} tokens/s, burst {scenario.burst_ns // 1_000_000} ms) "
                        f"refuses it: over the user's rate"
                    ),
                )
            self.history.setdefault(user, []).append(now)
        return None

    def _under_grant_checks(
        self, step: int, trace, unfinished: list[str], resident: set[str], state_before
    ) -> tuple[str, str, str] | None:
        """P4 for the regime of ``step`` (``state_before``: the replay at the step's start):
        ample and sync, ``_ample_sync_checks``; ample under async scheduling, or past the
        pressure, ``judge_grants.under_grant_check`` alone; under pressure,
        ``judge_grants.pressured_under_grant_check``. The first failure, or None."""
        scenario = self.scenario
        if scenario.ample and not scenario.async_scheduling:
            return self._ample_sync_checks(step, trace, unfinished, resident, state_before)
        if scenario.ample_at(step):
            # Async (ample, or ample from a step on), or sync past the pressure: the
            # under-grant check (P4) alone, for the requests that still have a token to
            # dispatch (async: the last one may be in flight).
            demand = self.start.demand if self.start is not None else set(unfinished)
            return judge_grants.under_grant_check(self, trace, [r for r in unfinished if r in demand], resident)
        # under pressure, sync and async: where the article fixes the outcome
        return judge_grants.pressured_under_grant_check(self, trace, unfinished)

    def after_step(self, step: int, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
        """Judge the step ``step`` just run (``trace``: its black-box facts; ``unfinished``
        and ``resident``: request ids after it): replay its dispatches (R2), the under-grant
        checks of its regime (P4, R11, R12), the window bound (R2), then at level should
        the active cap (R12), victim choice (R13) and ``judge_should._blind_spot_checks``, and at level
        exact the white-box checks. Returns the first failure as (rule, level, message), or
        None; with the feature off it only records coverage."""
        self.steps += 1
        scenario, now = self.scenario, trace.now_ns
        # obligations reached (adapter/coverage_observe.py)
        coverage_observe.observe(self, step, trace, unfinished, resident)
        if not scenario.feature_on:
            return None
        state_before = self.state  # the replay at the step's start (before its dispatches)
        judge_record.record(self, trace)
        failure = self._replay_dispatches(trace)
        if failure:
            return failure
        if self.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            self.state = spec_limiter.cleanup_idle_users(self.state, now)  # R6, same cadence
        failure = self._under_grant_checks(step, trace, unfinished, resident, state_before)
        if failure:
            return failure
        for rid in trace.sampled:
            self.last_sample_step[rid] = step
        window_failure = _window_violation(self.history, scenario)
        if window_failure:
            return self.named("R2", "must", f"{self.name}: {window_failure}")
        if self.should:
            failure = judge_should.should_checks(self, trace, resident, state_before)
            if failure:
                return failure
        return judge_observation.white_box_failure(self, trace) if self.exact else None

    def _ample_sync_checks(
        self, step: int, trace, unfinished: list[str], resident: set[str], state_before=None
    ) -> tuple[str, str, str] | None:
        failure = judge_grants.under_grant_check(
            self, trace, unfinished, resident
        ) or judge_admission.admission_cap_check(self, trace, unfinished, resident)
        if failure or not self.should:
            return failure
        if trace.preempted:
            return (
                "R11",
                "should",
                (
                    f"{self.name} preempted {trace.preempted} although KV and seats are ample: "
                    "the article keeps throttled requests resident"
                ),
            )
        failure = judge_admission.prefill_advance_check(self, trace, unfinished, state_before)
        return failure or judge_should.bypass_check(self, step, trace, unfinished)

    def named(self, rule: str, level: str, text: str) -> tuple[str, str, str]:
        """A rate failure of the dispatch replay: ``run_scenario(attribute=True)`` names
        its rule from the whole run (``name_rule``)."""
        self.nameable = True
        return rule, level, text

    def record_only(self, step: int, trace, unfinished: list[str], resident: set[str]) -> None:
        """After a rate failure: record the step's black-box facts and the pauses the judge
        would hold to be the limiter's, judging nothing."""
        self.steps += 1
        scenario, now = self.scenario, trace.now_ns
        judge_record.record(self, trace)
        for rid in trace.sampled:
            user = self.user_of(rid)
            self.state, _ = spec_limiter.try_take(self.state, user, scenario.rate_of(user), now, scenario.burst_ns)
        if self.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            self.state = spec_limiter.cleanup_idle_users(self.state, now)
        if scenario.ample and not scenario.async_scheduling:
            judge_grants.under_grant_check(self, trace, unfinished, resident)
        elif scenario.ample_at(step):
            demand = self.start.demand if self.start is not None else set(unfinished)
            judge_grants.under_grant_check(self, trace, [r for r in unfinished if r in demand], resident)
        else:
            judge_grants.pressured_under_grant_check(self, trace, unfinished)

    def naming_history(self) -> tuple[attribution.Context, list[attribution.StepRecord]]:
        """(the scenario's facts, the recorded steps) for ``adapter/attribution.py``."""
        scenario = self.scenario
        ctx = attribution.Context(
            {rid: r.user for rid, r in self.by_id.items()},
            {u: Fraction(r) for u, r in scenario.rates_tokens_per_s.items()},
            Fraction(scenario.default_rate_tokens_per_s),
            scenario.burst_ns,
            scenario.chunked_prefill,
            scenario.async_scheduling,
        )
        return ctx, self.records

    def _grants_at(self, state, user: str, now: int, at_most: int) -> int:
        """How many takes (up to ``at_most``) the replay ``state`` grants ``user`` at ``now``."""
        rate, burst, n = self.scenario.rate_of(user), self.scenario.burst_ns, 0
        while n < at_most:
            state, granted = spec_limiter.try_take(state, user, rate, now, burst)
            if not granted:
                break
            n += 1
        return n


def _window_violation(history: dict[str, list[int]], scenario: Scenario) -> str | None:
    """R2 bound on the newest dispatch time against every earlier start time."""
    for user, times in history.items():
        rate = scenario.rate_of(user)
        excess = spec_properties.window_excess(times, rate, scenario.burst_ns)
        if excess is not None:
            return (
                f"user {user!r}: {excess.count} sampling dispatches in [{excess.start_ns}, {excess.end_ns}] ns "
                f"> bound {excess.bound} = floor((W + tau) x {rate}) + 1: over the user's rate"
            )
    return None
