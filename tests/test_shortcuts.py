"""The reference's per-step shortcuts decide exactly what its general path decides (issue 27).

``_RateLimitMixin.shortcuts`` (default True) turns on: the unconstrained step (no user can
be refused: the hook only records charges, counted per user once), the turn order kept
between steps (``Turns.hold``), the all-served R15 store (``Turns.group_last``), the in-place
restore of ``running`` after a step without preemption, and the hook's immediate skip of
a request throttled at the step start. With ``shortcuts = False`` every step takes the
general path.

Hypothesis runs the same scenario on two reference schedulers side by side, one of each,
and after every step compares everything the step decides: the batch in
``SchedulerOutput`` order, what was sampled, preempted, admitted and finished, the
white-box observation (charges, refunds, throttled, wait hint, every TAT), the order of
``running``, the turn order (R14) and the last-served streams (R15). The scenarios are the
gate's own strategies: ample ones (many unconstrained steps, users held to fewer grants
than streams) and pressured ones (preemption, small budgets, an active cap, PRIORITY,
aborts, runs past the R6 clean-up).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, Harness
from vllm_output_rate.adapter.scenario_run import _arrivals_and_aborts, build_harness
from vllm_output_rate.adapter.scenario_strategies import pressured_scenarios, scenarios
from vllm_output_rate.adapter.scenarios import DRAIN_STEP_LIMIT, RequestSpec, Scenario
from vllm_output_rate.reference.scheduler import RateLimitedScheduler, _RateLimitMixin

MS = 1_000_000


def _state(harness: Harness) -> tuple:
    """What a step leaves behind in the scheduler beside its trace: ``running`` order, the
    turn order (R14), the last-served streams (R15), the wait hint (R16)."""
    s = harness.scheduler
    return (
        [r.request_id for r in s.running],
        list(s._turns.order),
        dict(s._turns.last_served),
        s.next_ready_ns(),
    )


def run_side_by_side(scenario: Scenario) -> int:
    """``scenario`` on the reference with and without shortcuts, compared after every
    step (AssertionError naming the step and what differs). Returns the steps taken."""
    cls = REFERENCE_ASYNC_SCHEDULER if scenario.async_scheduling else REFERENCE_SCHEDULER
    fast, slow = build_harness(cls, scenario), build_harness(cls, scenario)
    slow.scheduler.shortcuts = False
    plans = [(sorted(scenario.requests, key=lambda r: r.at_step), scenario.abort_schedule()) for _ in (fast, slow)]
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        for harness, (pending, aborts) in zip((fast, slow), plans):
            _arrivals_and_aborts(harness, pending, aborts, step)
        if step >= scenario.num_steps and not fast.scheduler.requests and not plans[0][0]:
            return step
        got, want = fast.step(), slow.step()
        assert got == want, f"step {step}: the step differs\nshortcuts: {got}\ngeneral:   {want}"
        assert _state(fast) == _state(slow), f"step {step}: state differs\n{_state(fast)}\n{_state(slow)}"
        advances = scenario.advances_ns or ()
        delta = advances[step] if step < len(advances) else scenario.step_interval_ns
        fast.advance(delta)
        slow.advance(delta)
    return scenario.num_steps + DRAIN_STEP_LIMIT


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(max_steps=40))
def test_shortcuts_equal_the_general_path_on_ample_scenarios(scenario: Scenario) -> None:
    run_side_by_side(scenario)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=pressured_scenarios(max_steps=40))
def test_shortcuts_equal_the_general_path_under_pressure(scenario: Scenario) -> None:
    run_side_by_side(scenario)


def _bench_like(
    async_scheduling: bool, throttled_user_rate: float, cls: str | None = None, max_tokens: int = 200
) -> Harness:
    """12 streams of 3 users (4 each) decoding ``max_tokens`` tokens each with ample KV;
    user ``t`` at ``throttled_user_rate`` tokens/s, the others never bound (``cls``: the
    scheduler class path; default the reference)."""
    h = Harness(
        cls or (REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER),
        EngineShape(
            max_num_seqs=12,
            async_scheduling=async_scheduling,
            output_rate={"default_tokens_per_s": 10**9, "user_tokens_per_s": {"t": throttled_user_rate}},
        ),
    )
    for i in range(12):
        h.add_request(f"r{i}", ("a", "b", "t")[i % 3], prompt_len=4 + i, max_tokens=max_tokens)
    return h


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("shortcuts", [True, False])
def test_not_binding_steady_state_keeps_the_turn_order_and_skips_nothing(async_scheduling, shortcuts):
    # Not binding, every stream decodes every step: with the shortcuts the turn order is
    # the same object step after step (no rebuild), each step is unconstrained and the
    # R15 store is each group's last place; without them it is rebuilt every step.
    h = _bench_like(async_scheduling, 10**9)
    h.scheduler.shortcuts = shortcuts
    for _ in range(6):
        h.step()
        h.advance(10 * MS)
    kept = 0
    for _ in range(10):
        before = h.scheduler._turns.order
        trace = h.step()
        h.advance(10 * MS)
        assert trace.white["throttled"] == [] and len(trace.scheduled) == 12
        assert h.scheduler._step.unconstrained is shortcuts
        kept += h.scheduler._turns.order is before
    assert kept == (10 if shortcuts else 0)
    assert h.scheduler._turns.last_served == h.scheduler._turns.group_last


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_throttled_at_start_are_refused_by_the_hook_at_once(async_scheduling):
    # User t at 0.001 tok/s spends its burst, then its 4 streams are throttled at every
    # step start: the hook refuses them without asking for grants (StepRecord.skipped_at_start),
    # and the turn order is kept (t's group does not rotate while it is never served).
    h = _bench_like(async_scheduling, 0.001)
    for _ in range(8):
        h.step()
        h.advance(10 * MS)
    asked = []
    scheduler = h.scheduler
    real = scheduler._refuse
    scheduler._refuse = lambda request, *a: asked.append(request.request_id) or real(request, *a)
    before = scheduler._turns.order
    trace = h.step()
    assert sorted(trace.white["throttled"]) == ["r11", "r2", "r5", "r8"]
    assert set(scheduler._step.skipped_at_start) == {"r2", "r5", "r8", "r11"}
    assert asked == []
    assert scheduler._turns.order is before
    assert [r.request_id for r in scheduler.running] == [f"r{i}" for i in range(12)]  # R13 move undone


def test_a_finished_stream_rebuilds_the_turn_order():
    # A request that leaves (finished or preempted) marks the order shrunk; the next step
    # rebuilds it, so no group's last place names a request that is gone.
    h = _bench_like(False, 10**9)
    for _ in range(6):
        h.step()
        h.advance(10 * MS)
    h.abort("r5")
    assert h.scheduler._turns.shrunk
    h.step()
    assert not h.scheduler._turns.shrunk
    assert "r5" not in h.scheduler._turns.order and "r5" not in h.scheduler._turns.group_last.values()


def test_the_side_by_side_run_sees_a_difference(monkeypatch) -> None:
    # The comparison can fail: a shortcut that forgets R15 (no last-served stream stored
    # when every stream was served) differs from the general path within a few steps.
    scenario = Scenario(
        rates_tokens_per_s={},
        requests=tuple(RequestSpec(request_id=f"r{i}", user="u", prompt_len=4, max_tokens=12) for i in range(3)),
        step_interval_ns=10 * MS,
        num_steps=8,
        default_rate_tokens_per_s="1000",
    )
    general = _RateLimitMixin._record_last_served

    def forgetful(self, ids):
        return None if self.shortcuts else general(self, ids)

    monkeypatch.setattr(_RateLimitMixin, "_record_last_served", forgetful)
    with pytest.raises(AssertionError, match="state differs"):
        run_side_by_side(scenario)


def _survey_calls(async_scheduling: bool, shortcuts: bool, steps: int, stretch_margin: bool = False) -> tuple:
    """12 streams of 3 users (4 each) at 200 tok/s, a step every 25 ms (5 grants regained
    per step, 4 charged): per step, the limiter's ``grants_at`` calls, whether the survey
    took the O(1) path, and every TAT. ``stretch_margin``: the O(1) survey is told that
    the bounds cover every later step (a planted bug)."""
    h = Harness(
        REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER,
        EngineShape(max_num_seqs=12, async_scheduling=async_scheduling, output_rate={"default_tokens_per_s": 200}),
    )
    for i in range(12):
        h.add_request(f"r{i}", ("a", "b", "c")[i % 3], prompt_len=4 + i, max_tokens=steps + 8)
    scheduler = h.scheduler
    scheduler.shortcuts = shortcuts
    limiter = scheduler.rate_limiter
    calls: list[tuple[str, int]] = []
    real = limiter.grants_at
    limiter.grants_at = lambda user, now_ns: calls.append((user, now_ns)) or real(user, now_ns)
    seen = []
    for _ in range(steps):
        trace = h.step()
        h.advance(25 * MS)
        seen.append((list(calls), scheduler._step.steady, trace.white["tat_ns"]))
        calls.clear()
        if stretch_margin:
            scheduler._charging.margin = 10**9
    return tuple(seen)


@pytest.mark.rules("R2")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_r2_the_o1_survey_asks_the_limiter_exactly_when_the_full_survey_does(async_scheduling):
    # Each user's bound falls by 4 a step from its 21 idle grants (100 ms burst at 200
    # tok/s): the O(1) survey (Charging.survey, ``steady``) stands on it while it covers
    # another step, and the full survey asks the limiter once it does not. Without the
    # shortcuts every step takes the loop: both ask the limiter for the same users at the
    # same clock readings, and every TAT agrees.
    fast = _survey_calls(async_scheduling, True, 30)
    slow = _survey_calls(async_scheduling, False, 30)
    assert [(c, t) for c, _, t in fast] == [(c, t) for c, _, t in slow]
    steady = [s for _, s, _ in fast]
    assert sum(steady) >= 10 and not any(s for _, s, _ in slow)
    asked_after_start = [i for i, (c, _, _) in enumerate(fast) if c and i > 1]
    assert asked_after_start, "the bounds never ran out: the test does not reach the full survey"


def test_the_o1_survey_comparison_sees_a_margin_that_is_too_long():
    # The comparison above can fail: an O(1) survey that trusts its bounds past their
    # margin stops asking the limiter when the full survey asks it.
    fast = _survey_calls(False, True, 30, stretch_margin=True)
    slow = _survey_calls(False, False, 30)
    assert [c for c, _, _ in fast] != [c for c, _, _ in slow]


def _count_steady_steps(monkeypatch) -> list[str]:
    """Record the request ids of the scheduler of each step that took the steady step in
    line (``_steady_schedule``)."""
    seen: list[str] = []
    real = _RateLimitMixin._steady_schedule

    def counting(self, *args):
        seen.append(self.running[0].request_id if self.running else "")
        return real(self, *args)

    monkeypatch.setattr(_RateLimitMixin, "_steady_schedule", counting)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_steady_step_equals_the_general_path_through_a_rate_change_and_an_abort(async_scheduling, monkeypatch):
    # Not binding, every stream decoding: most steps take the steady step in line
    # (_steady_schedule). Halfway the rates change (R21: the spare grants go, the next
    # steps take the general path, then the steady one again) and a stream is aborted
    # (the turn order shrinks and is rebuilt). Step for step, the same decisions, TATs and
    # state as the general path.
    steady = _count_steady_steps(monkeypatch)
    fast, slow = _bench_like(async_scheduling, 10**9), _bench_like(async_scheduling, 10**9)
    slow.scheduler.shortcuts = False
    for i in range(40):
        if i == 15:
            for h in (fast, slow):
                h.scheduler.update_output_rates(10**8, {"t": 10**6})
        if i == 25:
            for h in (fast, slow):
                h.abort("r4")
        got, want = fast.step(), slow.step()
        assert got == want, f"step {i}: the step differs\nsteady: {got}\ngeneral: {want}"
        assert _state(fast) == _state(slow), f"step {i}: state differs"
        fast.advance(10 * MS)
        slow.advance(10 * MS)
    assert len(steady) >= 25, f"only {len(steady)} of 40 steps took the steady path"


@pytest.mark.parametrize("cls", ["SettleCounting", "ObserveCounting"])
def test_a_subclass_that_replaces_a_seam_never_takes_the_steady_step(cls, monkeypatch):
    # The steady step passes by the seams (_settle, _observe, _commit_grants, ...): a
    # subclass that replaces one gets the general path in every step, so its replacement
    # is called in every step.
    steady = _count_steady_steps(monkeypatch)
    h = _bench_like(False, 10**9, cls=f"{__name__}.{cls}")
    for _ in range(12):
        h.step()
        h.advance(10 * MS)
    assert not h.scheduler._steady_path and steady == [] and len(h.scheduler.settled) == 12


class SettleCounting(RateLimitedScheduler):
    """The reference with its R9 seam replaced by one that counts its calls."""

    def _settle(self, scheduler_output):
        self.settled = [*getattr(self, "settled", []), self._step.now_ns]
        return super()._settle(scheduler_output)


class ObserveCounting(RateLimitedScheduler):
    """The reference with its R16 seam (the end of a step) replaced by one that counts its calls."""

    def _observe(self, scheduler_output, refunded):
        self.settled = [*getattr(self, "settled", []), self._step.now_ns]
        super()._observe(scheduler_output, refunded)


def _count_in_line_ends(monkeypatch) -> list[bool]:
    """Record what each steady step's in-line end (``EngineWait.steady_step_done``, reached
    when every request was charged and dispatched) returned: True, done in line; False,
    the operator log was due and the step took ``_step_done``."""
    from vllm_output_rate.reference.engine_wait import EngineWait

    seen: list[bool] = []
    real = EngineWait.steady_step_done

    def counting(self, step):
        done = real(self, step)
        seen.append(done)
        return done

    monkeypatch.setattr(EngineWait, "steady_step_done", counting)
    return seen


@pytest.mark.rules("R6", "R9", "R16")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_r9_the_steady_step_ends_in_line_as_the_general_path_ends_through_clean_up_and_log_intervals(
    async_scheduling, monkeypatch
):
    # 300 steps of 50 ms, not binding, nothing finishing: the steady step ends in line (no refund, R9; no wait
    # hint, R16) where every request was charged and dispatched, except where R6's clean-up
    # (every 256 steps) or the operator log's 10 s interval falls due, where it takes the
    # general end. Step for step, the same decisions, TATs, wait hint, state and operator
    # log interval as the general path.
    ends = _count_in_line_ends(monkeypatch)
    fast, slow = (_bench_like(async_scheduling, 10**9, max_tokens=400) for _ in range(2))
    slow.scheduler.shortcuts = False
    for i in range(300):
        got, want = fast.step(), slow.step()
        assert got == want, f"step {i}: the step differs\nsteady: {got}\ngeneral: {want}"
        assert _state(fast) == _state(slow), f"step {i}: state differs"
        logs = [h.scheduler._engine_wait.throttle_log.next_ns for h in (fast, slow)]
        assert logs[0] == logs[1], f"step {i}: the operator log's interval differs: {logs}"
        assert fast.scheduler._steps == slow.scheduler._steps == i + 1
        fast.advance(50 * MS)
        slow.advance(50 * MS)
    assert ends.count(True) >= 250, f"only {ends.count(True)} of 300 steps ended in line"
    assert ends.count(False) >= 1, "the operator log never fell due in a steady step"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_steady_step_writes_the_trace_the_general_path_writes(async_scheduling, tmp_path, monkeypatch):
    # With the trace on, the steady step never ends in line: every step's trace line is
    # written, the same line the general path writes.
    ends = _count_in_line_ends(monkeypatch)
    steady = _count_steady_steps(monkeypatch)
    paths = [tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"]
    harnesses = []
    for path in paths:
        h = Harness(
            REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER,
            EngineShape(
                max_num_seqs=12,
                async_scheduling=async_scheduling,
                output_rate={"default_tokens_per_s": 10**9, "trace_path": str(path)},
            ),
        )
        for i in range(12):
            h.add_request(f"r{i}", ("a", "b", "t")[i % 3], prompt_len=4 + i, max_tokens=200)
        harnesses.append(h)
    fast, slow = harnesses
    slow.scheduler.shortcuts = False
    for i in range(30):
        assert fast.step() == slow.step(), f"step {i}: the step differs"
        fast.advance(10 * MS)
        slow.advance(10 * MS)
    for h in harnesses:
        h.scheduler.shutdown()
    assert len(steady) >= 20 and ends == []
    lines = [p.read_text().splitlines() for p in paths]
    assert len(lines[0]) >= 30 and lines[0] == lines[1]


@pytest.mark.rules("R9")
@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=pressured_scenarios(max_steps=40))
def test_r9_no_charge_of_an_unconstrained_all_served_step_is_a_prefill_chunk(scenario: Scenario) -> None:
    # Charging.settle does not read is_prefill_chunk in an unconstrained step in which
    # every request was charged and dispatched, when the hook is ours: each charge was
    # made where computed + new reached prompt + outputs + placeholders, the sum of vLLM's
    # own is_prefill_chunk of the chunk it dispatched. Check that on every such step of
    # the pressured scenarios (chunked prefill, small budgets, preemption, async).
    _assert_all_served_charges_sample(scenario)


def _assert_all_served_charges_sample(scenario: Scenario) -> int:
    """Run ``scenario`` on the reference; at each ``settle`` that takes the all-served
    shortcut without reading ``is_prefill_chunk``, assert no charge is a prefill chunk.
    Returns how many such steps there were."""
    from vllm_output_rate.reference.charging import Charging

    taken = []
    real = Charging.settle

    def checking(self, step, scheduler_output):
        if self.host._hook_charges_sample and self.all_served(step, scheduler_output.num_scheduled_tokens):
            chunks = [r.request_id for r in step.charged if r.is_prefill_chunk]
            assert not chunks, f"charged and dispatched as prefill chunks: {chunks}"
            taken.append(step.now_ns)
        return real(self, step, scheduler_output)

    cls = REFERENCE_ASYNC_SCHEDULER if scenario.async_scheduling else REFERENCE_SCHEDULER
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Charging, "settle", checking)
        harness = build_harness(cls, scenario)
        pending, aborts = sorted(scenario.requests, key=lambda r: r.at_step), scenario.abort_schedule()
        for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
            _arrivals_and_aborts(harness, pending, aborts, step)
            if step >= scenario.num_steps and not harness.scheduler.requests and not pending:
                break
            harness.step()
            harness.advance(scenario.step_interval_ns)
    return len(taken)


def _chunked_scenario(async_scheduling: bool) -> Scenario:
    """Four users' prompts of 100-190 tokens, one every third step, in chunks of a
    64-token budget, then decoding, never bound: unconstrained steps in which every
    request is charged and dispatched, some with a prompt chunk among them."""
    return Scenario(
        rates_tokens_per_s={},
        requests=tuple(
            RequestSpec(
                request_id=f"r{i}", user=f"u{i % 4}", prompt_len=100 + 30 * (i % 4), max_tokens=12, at_step=3 * i
            )
            for i in range(8)
        ),
        step_interval_ns=10 * MS,
        num_steps=40,
        default_rate_tokens_per_s="1000000",
        async_scheduling=async_scheduling,
        max_num_batched_tokens=64,
    )


@pytest.mark.rules("R9")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_r9_the_prefill_chunk_check_sees_a_hook_that_charges_every_chunk(async_scheduling, monkeypatch):
    # The check above can fail: a record-only hook that charges every chunk (prompt
    # chunks too) trips it once an all-served step holds a prefill chunk; the real hook
    # passes the same scenario with all-served steps checked.
    scenario = _chunked_scenario(async_scheduling)
    assert _assert_all_served_charges_sample(scenario) > 0
    real = _RateLimitMixin._reserve_prefill_lookahead

    def charge_every_chunk(self, request, num_computed_tokens, num_new_tokens):
        if self._record_only and num_new_tokens > 0:
            self._charge(request)
            return num_new_tokens
        return real(self, request, num_computed_tokens, num_new_tokens)

    monkeypatch.setattr(_RateLimitMixin, "_reserve_prefill_lookahead", charge_every_chunk)
    with pytest.raises(AssertionError, match="prefill chunks"):
        _assert_all_served_charges_sample(scenario)
