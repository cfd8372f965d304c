"""R16 judged black-box through vLLM's own engine-core loop (``adapter/engine_wait.py``).

All candidates run in one child process (one vLLM import, one fork per candidate), so the
module costs one engine-core import plus about a second per candidate:

- the reference (``RateLimitedScheduler`` + its ``vllm.general_plugins`` engine wait) passes,
  and the new request and the abort are handled at the fake instant they arrive; so does
  ``RateLimitedAsyncScheduler`` through vLLM's ``step_with_batch_queue``;
- the reference without its plugin (``VLLM_PLUGINS`` empty) is stock vLLM's 1 ms idle loop:
  it fails with "spun";
- a reference whose wait hint is ``LATE_NS`` late fails with "overslept";
- a reference whose wait hint is 1 ns early (``ready_at`` rounded down, R5) fails with
  "woke early"; one whose hint is the latest ready time of the refused users instead of
  the earliest oversleeps for the other throttled user;
- a candidate that sleeps inside ``schedule()`` (the article's rejected first idea) neither
  spins nor oversleeps, but a request arriving mid-sleep waits: it fails on the new request;
- stock vLLM (no rate limit) throttles nobody: the wait cannot be judged, which is a failure;
- the polling world (a multiproc-like future; B's request arrives during an empty step): the
  reference passes on every release; the reference as it was before the R16 fix (it waited
  after an empty step even when the engine took a request during that step) fails it on a
  release whose engine handles inputs during a step (0.34.0), and passes where the request
  stays queued (0.32.0, 0.33.0).
"""

from __future__ import annotations

import time

import pytest

from vllm_output_rate.adapter import engine_wait as ew
from vllm_output_rate.adapter import engine_wait_judge as ewj
from vllm_output_rate.adapter import engine_wait_scenario as ews
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, STOCK_SCHEDULER
from vllm_output_rate.reference.scheduler import RateLimitedScheduler

MS = 1_000_000
LATE_NS = 20 * MS  # how late the oversleeping candidate's wait hint is


class LateHintScheduler(RateLimitedScheduler):
    """The reference, but its R16 wait hint is ``LATE_NS`` after the real ready time: the
    reference's plugin then waits past the throttled user's ready time."""

    def next_ready_ns(self):
        hint = super().next_ready_ns()
        return None if hint is None else hint + LATE_NS


class EarlyHintScheduler(RateLimitedScheduler):
    """The reference, but its R16 wait hint is 1 ns before the real ready time."""

    def next_ready_ns(self):
        hint = super().next_ready_ns()
        return None if hint is None else hint - 1


class RecheckEvery50msScheduler(RateLimitedScheduler):
    """The reference, but its wait hint is at most 50 ms ahead: the article's engine, which
    waits min(next ready time, 50 ms) -- an open choice R16 accepts."""

    def next_ready_ns(self):
        hint = super().next_ready_ns()
        return None if hint is None else min(hint, self.clock_ns() + ews.ARTICLE_RECHECK_NS)


class SleepInScheduleScheduler(RateLimitedScheduler):
    """The reference, but when a step schedules nothing it sleeps inside ``schedule()``
    until the next ready time (at most 50 ms) -- the engine cannot see input meanwhile."""

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        hint = self.next_ready_ns()
        if output.total_num_scheduled_tokens == 0 and hint is not None:
            time.sleep(min(ews.ARTICLE_RECHECK_NS, max(0, hint - self.clock_ns())) / 1e9)
        return output


class PreFixWaitScheduler(RateLimitedScheduler):
    """The reference as it was before the R16 fix for inputs taken during a step: its plugin
    waits after every empty step, as if no input had reached the engine meanwhile (the
    constructor, run in the engine core after the plugins loaded, removes the plugin's
    input counter from ``_handle_client_request``)."""

    def __init__(self, *args, **kwargs):
        from vllm.v1.engine.core import EngineCoreProc

        from vllm_output_rate.reference import vllm_compat

        handler = EngineCoreProc.__dict__[vllm_compat.INPUT_HANDLER]
        setattr(EngineCoreProc, vllm_compat.INPUT_HANDLER, getattr(handler, "__wrapped__", handler))
        super().__init__(*args, **kwargs)


HERE = __name__  # the module name the child imports these classes by (tests/ is on sys.path)
CANDIDATES = {
    "reference": (REFERENCE_SCHEDULER, None),
    "reference-async": (REFERENCE_ASYNC_SCHEDULER, None),
    "no-plugin": (REFERENCE_SCHEDULER, []),
    "late-hint": (f"{HERE}.LateHintScheduler", None),
    "early-hint": (f"{HERE}.EarlyHintScheduler", None),
    "recheck-50ms": (f"{HERE}.RecheckEvery50msScheduler", None),
    "rounded-down": ("vllm_output_rate.adapter.mutants.ReadyAtRoundedDown", None),
    "latest-hint": ("vllm_output_rate.adapter.mutants.WaitHintFromLatestUser", None),
    "sleep-in-schedule": (f"{HERE}.SleepInScheduleScheduler", []),
    "stock": (STOCK_SCHEDULER, None),
    "reference-polling": (REFERENCE_SCHEDULER, None, True),
    "pre-fix-polling": (f"{HERE}.PreFixWaitScheduler", ["output_rate"], True),
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, ews.EngineWaitVerdict]:
    results = ew.run_engine_waits(list(CANDIDATES.values()), seed=3)
    return dict(zip(CANDIDATES, results))


def test_reference_passes(verdicts):
    v = verdicts["reference"]
    assert v.failure is None, (v.failure, v.error)
    assert v.plugins == ["output_rate"] and v.engine_step == "step" and not v.async_mode
    assert v.stopped_by == "fake time" and v.fake_ns == ews.RUN_NS
    assert 0 < v.idle_wakeups <= v.allowed_idle_wakeups
    assert v.max_lateness_ns <= ews.LATENESS_TOLERANCE_NS
    # A at 3 tok/s (burst 100 ms, one token at a time) over 1.2 s: tokens at 0, 233.3,
    # 566.7, 900 ms; C at 5 tok/s: 0, 100, 300, ..., 1100 ms. Never woken early.
    assert v.tokens[ews.USER_A] == 4 and v.tokens[ews.USER_C] == 7 and v.tokens[ews.USER_B] == ews.B_MAX_TOKENS
    assert v.over_grants == 0 and v.max_early_ns == 0


@pytest.mark.rules("R16")
def test_r16_reference_wakes_only_at_ready_times_and_inputs(verdicts):
    # No 50 ms re-check: each wait lasts until the next ready time (C's every 200 ms, A's
    # between them), so an idle wake-up per throttled interval, not one per 50 ms.
    v = verdicts["reference"]
    assert v.max_wait_ns > 150 * MS, v.max_wait_ns
    assert v.idle_wakeups * 100 * MS < v.throttled_ns, (v.idle_wakeups, v.throttled_ns)
    assert v.idle_wakeups < verdicts["recheck-50ms"].idle_wakeups / 2


@pytest.mark.rules("R16")
def test_r16_the_articles_50_ms_recheck_is_accepted(verdicts):
    v = verdicts["recheck-50ms"]
    assert v.failure is None, (v.failure, v.error)
    assert v.max_wait_ns <= ews.ARTICLE_RECHECK_NS + ews.LATENESS_TOLERANCE_NS
    assert v.idle_wakeups * 20 * MS < v.throttled_ns


def test_async_reference_passes_through_the_batch_queue(verdicts):
    v = verdicts["reference-async"]
    assert v.async_mode and v.engine_step == "step_with_batch_queue"
    assert v.failure is None, (v.failure, v.error)
    assert 0 < v.idle_wakeups <= v.allowed_idle_wakeups
    assert v.tokens[ews.USER_A] == 4 and v.tokens[ews.USER_C] == 7 and v.tokens[ews.USER_B] == ews.B_MAX_TOKENS
    assert v.max_early_ns == 0


def test_new_input_wakes_the_reference_at_once(verdicts):
    v = verdicts["reference"]
    assert v.new_request_latency_ns is not None and v.new_request_latency_ns <= ews.WAKE_TOLERANCE_NS
    assert v.abort_latency_ns is not None and v.abort_latency_ns <= ews.WAKE_TOLERANCE_NS


def test_without_the_plugin_the_engine_spins(verdicts):
    v = verdicts["no-plugin"]
    assert v.plugins == []
    assert v.failure is not None and "spun" in v.failure and "1 ms idle loop" in v.failure, v.failure
    assert v.idle_wakeups > 10 * v.allowed_idle_wakeups
    # Stock pacing is still correct: about one wake-up per ms, nobody late by more than 1 ms.
    assert v.median_idle_gap_ns == ews.STOCK_IDLE_SLEEP_NS
    assert v.max_lateness_ns <= ews.LATENESS_TOLERANCE_NS


def test_a_late_wait_hint_oversleeps(verdicts):
    v = verdicts["late-hint"]
    assert v.failure is not None and "overslept" in v.failure, v.failure
    assert LATE_NS - ews.LATENESS_TOLERANCE_NS <= v.max_lateness_ns <= LATE_NS + ews.LATENESS_TOLERANCE_NS


@pytest.mark.parametrize("name", ["early-hint", "rounded-down"])
def test_a_wait_hint_before_the_ready_time_wakes_early(verdicts, name):
    # A's ready times are not whole ns (3 tok/s): a hint rounded down ends the wait 1 ns
    # early, within the lateness tolerance (one stock 1 ms sleep) but not at the ready time.
    v = verdicts[name]
    assert v.failure is not None and "woke early" in v.failure, v.failure
    assert v.max_early_ns == 1 and v.max_lateness_ns <= ews.LATENESS_TOLERANCE_NS


def test_a_wait_hint_of_the_latest_refused_user_oversleeps_for_the_other(verdicts):
    v = verdicts["latest-hint"]
    assert v.failure is not None and "overslept" in v.failure, v.failure
    assert v.max_lateness_ns > ews.LATENESS_TOLERANCE_NS


def test_sleeping_inside_schedule_misses_new_requests(verdicts):
    v = verdicts["sleep-in-schedule"]
    assert v.failure is not None and "new request did not wake" in v.failure, v.failure
    assert v.new_request_latency_ns is not None and v.new_request_latency_ns > ews.WAKE_TOLERANCE_NS


def test_a_scheduler_that_throttles_nobody_cannot_pass(verdicts):
    v = verdicts["stock"]
    assert v.failure is not None and "no user was ever throttled" in v.failure, v.failure


def test_check_row_names_the_rule(verdicts, monkeypatch):
    # The row runs the plain world and the polling world; the first failure is the row's.
    worlds = []

    def run_both(candidates, **kwargs):
        worlds.extend(polling for _, _, polling in candidates)
        return [verdicts["no-plugin"], verdicts["reference-polling"]]

    monkeypatch.setattr(ew, "run_engine_waits", run_both)
    row = ew.check_engine_wait(REFERENCE_SCHEDULER, seed=3, tick=lambda: None)
    assert worlds == [False, True] and row.examples == 2
    assert row.name == "engine-wait/sync" and row.rules == ["R16"]
    assert row.result == "fail" and row.failure.startswith("R16: the engine spun")
    monkeypatch.setattr(ew, "run_engine_waits", lambda *a, **k: [verdicts["reference"], verdicts["pre-fix-polling"]])
    row = ew.check_engine_wait(REFERENCE_SCHEDULER, seed=3, tick=lambda: None)
    failing = verdicts["pre-fix-polling"].failure is not None  # on a release that takes inputs during a step
    assert row.result == ("fail" if failing else "pass"), row.failure
    if failing:
        assert row.failure.startswith("R16 (polling future, as vLLM's multiproc executor): a new request")
        assert any("b0 during the first empty step from" in line for line in row.counterexample)


@pytest.mark.rules("R16")
def test_r16_reference_schedules_a_request_taken_during_an_empty_step(verdicts):
    v = verdicts["reference-polling"]
    assert v.polling and v.failure is None, (v.failure, v.error)
    assert v.new_request_latency_ns is not None and v.new_request_latency_ns <= ews.WAKE_TOLERANCE_NS
    assert v.tokens[ews.USER_B] == ews.B_MAX_TOKENS and v.max_lateness_ns <= ews.LATENESS_TOLERANCE_NS


@pytest.mark.rules("R16")
def test_r16_the_reference_before_the_fix_sleeps_through_a_request_taken_during_a_step(verdicts):
    from vllm_output_rate.adapter.vllm_compat import engine_core_handles_inputs_during_step

    v = verdicts["pre-fix-polling"]
    if engine_core_handles_inputs_during_step():  # 0.34.0: the engine took B during the empty step
        assert v.failure is not None and "taken by the engine during an empty step" in v.failure, v.failure
        assert v.new_request_latency_ns is not None and v.new_request_latency_ns > 10 * ews.WAKE_TOLERANCE_NS
    else:  # 0.32.0, 0.33.0: B stays in the input queue during the step and ends the wait
        assert v.failure is None, (v.failure, v.error)
        assert v.new_request_latency_ns is not None and v.new_request_latency_ns <= ews.WAKE_TOLERANCE_NS


def test_a_wait_that_queue_get_resumes_for_a_rounding_residual_is_one_wait():
    # queue.Queue.get(timeout=0.05) from 1 ms on waits 50 ms, then again for the 1 ns its float
    # deadline leaves: one 50 ms wait (the article's re-check), not an early wake at 51 ms.
    waits = [
        [1_000_000, 51_000_000, True, "input-queue"],
        [51_000_000, 51_000_001, True, "input-queue"],
        [51_000_001, 52_000_001, True, "sleep"],
        [52_000_001, 100_000_001, True, "input-queue"],
    ]
    assert ewj._merged_waits(waits) == [
        [1_000_000, 51_000_001, True, "input-queue"],
        [51_000_001, 52_000_001, True, "sleep"],
        [52_000_001, 100_000_001, True, "input-queue"],
    ]
