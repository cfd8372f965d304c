"""R21, a user's rate changed without a restart (issue 15 item 3).

When a rate changes from ``r_old`` to ``r_new`` at ``now``, the user's lead over the clock
is kept in tokens: ``TAT' = now + ceil((TAT - now) x r_old / r_new)`` (whole ns, rounded
up), so the change hands out no burst and forgives no debt (docs/SPEC.md R21). Shown
here on the spec limiter and step model, on the reference limiter and scheduler (against
the spec, white box), on the rates file (the operator's interface, bad files included),
and on the gate's ``rate-change/*`` rows, which reject the reference with the change
applied the wrong way (TAT reset to now; TAT kept unchanged). The Z3 proofs are
``r21_window_bound_across_change`` and ``r21_no_burst_from_change``
(``tests/test_proofs_z3.py``); the live test is ``gpu_tests/test_live_rate_change.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.adapter.scenarios import Hunt
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, ChangeRates, Step
from vllm_output_rate.spec.state import EngineConfig, initial_state

MS = 1_000_000
RATES = st.sampled_from([Fraction(r) for r in ("0.5", "1", "2", "3", "7", "10", "20", "100", "1/3", "2.5")])


def _state(**tats: Fraction) -> spec_limiter.LimiterState:
    from types import MappingProxyType

    return spec_limiter.LimiterState(MappingProxyType(dict(tats)))


# -- the spec rule ------------------------------------------------------------------------
@pytest.mark.rules("R21")
def test_r21_lead_is_kept_in_tokens() -> None:
    # 10 tok/s, lead 150 ms = 1.5 tokens ahead; at 2 tok/s 1.5 tokens are 750 ms, at 20 tok/s 75 ms.
    now = 50 * MS
    tat = Fraction(200 * MS)
    assert spec_limiter.rescaled_tat_ns(tat, Fraction(10), Fraction(2), now) == now + 750 * MS
    assert spec_limiter.rescaled_tat_ns(tat, Fraction(10), Fraction(20), now) == now + 75 * MS
    # Unchanged rate: the TAT is kept exactly (a rational TAT is not rounded).
    odd = Fraction(10**9, 3) + now
    assert spec_limiter.rescaled_tat_ns(odd, Fraction(3), Fraction(3), now) == odd
    # A lead that is not a whole ns at the new rate is rounded up, never down.
    assert spec_limiter.rescaled_tat_ns(Fraction(now + 1), Fraction(1), Fraction(3), now) == now + 1
    assert spec_limiter.rescaled_tat_ns(Fraction(now + 10), Fraction(1), Fraction(3), now) == now + 4
    # Idle (TAT not ahead of the clock): forgotten, as R6 would.
    assert spec_limiter.rescaled_tat_ns(Fraction(now), Fraction(10), Fraction(2), now) is None


@pytest.mark.rules("R21")
@settings(max_examples=300, deadline=None)
@given(
    old=RATES, new=RATES, lead_ns=st.integers(0, 3 * 10**9), frac=st.integers(0, 6), later_ns=st.integers(0, 2 * 10**9)
)
def test_r21_rounding_never_hands_out_a_token(old, new, lead_ns, frac, later_ns) -> None:
    # Against the exact (unrounded) rule: at the change and at every later instant the
    # rounded TAT grants at most as many tokens, and at most one ns of lead more.
    now = 7 * MS
    tat = Fraction(now + lead_ns) + Fraction(frac, 7)
    rounded = spec_limiter.rescaled_tat_ns(tat, old, new, now)
    exact = now + (tat - now) * old / new
    if tat <= now:
        assert rounded is None
        return
    assert exact <= rounded < exact + 1
    state_rounded, state_exact = _state(u=rounded), _state(u=exact)
    for t in (now, now + later_ns):
        assert spec_limiter.grants_at(state_rounded, "u", new, t) <= spec_limiter.grants_at(state_exact, "u", new, t)


@pytest.mark.rules("R21")
@settings(max_examples=300, deadline=None)
@given(old=RATES, new=RATES, lead_ns=st.integers(0, 3 * 10**9))
def test_r21_no_burst_from_the_change(old, new, lead_ns) -> None:
    # The grants available at the instant of the change never grow when the rate falls or
    # stays, and grow by at most ceil(tau x (new - old)) when it rises (the growth of the
    # burst tolerance itself, in tokens): the change adds nothing of its own.
    now = 3 * MS
    before = _state(u=Fraction(now + lead_ns))
    after = spec_limiter.change_rates(before, lambda u: old, lambda u: new, now)
    g_old = spec_limiter.grants_at(before, "u", old, now)
    g_new = spec_limiter.grants_at(after, "u", new, now)
    growth = max(0, math.ceil(Fraction(spec_limiter.BURST_NS, 10**9) * (new - old)))
    assert g_new <= g_old + growth
    if new <= old:
        assert g_new <= g_old


def _greedy_grants(times: list[int], rate_at, change_ns: int, old: Fraction, new: Fraction) -> list[int]:
    """A user that asks for a token at every instant of ``times`` as often as the spec
    limiter grants, with the rate change (R21) applied at ``change_ns``."""
    state, granted, changed = spec_limiter.EMPTY, [], False
    for t in times:
        if not changed and t >= change_ns:
            state = spec_limiter.change_rates(state, lambda u: old, lambda u: new, change_ns)
            changed = True
        while True:
            state, ok = spec_limiter.try_take(state, "u", rate_at(t), t)
            if not ok:
                break
            granted.append(t)
    return granted


@pytest.mark.rules("R21")
@settings(max_examples=150, deadline=None)
@given(
    old=RATES,
    new=RATES,
    gaps=st.lists(st.integers(0, 400 * MS), min_size=2, max_size=25),
    change_index=st.integers(0, 24),
)
def test_r21_piecewise_window_bound_holds_across_a_change(old, new, gaps, change_index) -> None:
    times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    change_ns = times[min(change_index, len(times) - 1)]
    granted = _greedy_grants(times, lambda t: old if t < change_ns else new, change_ns, old, new)
    for i, start in enumerate(granted):
        for end in granted[i:]:
            count = sum(1 for t in granted if start <= t <= end)
            segments = ([(min(end, change_ns) - start, old)] if start < change_ns else []) + (
                [(end - max(start, change_ns), new)] if end >= change_ns else []
            )
            assert count <= spec_limiter.piecewise_window_bound_tokens(segments), (start, end, count, segments)
            if start >= change_ns:  # from the moment of the change: R2's bound at the new rate
                assert count <= spec_limiter.window_bound_tokens(end - start, new)


@pytest.mark.rules("R21")
def test_r21_reset_to_now_would_break_the_piecewise_bound() -> None:
    # The mutant the rule rules out: TAT := now at the change hands out a second burst.
    old = new = Fraction(10)
    state = spec_limiter.EMPTY
    granted = 0
    for _ in range(5):
        state, ok = spec_limiter.try_take(state, "u", old, 0)
        granted += ok
    state = spec_limiter.LimiterState()  # reset: as if the change forgave the lead
    for _ in range(5):
        state, ok = spec_limiter.try_take(state, "u", new, 0)
        granted += ok
    assert granted > spec_limiter.piecewise_window_bound_tokens([(0, old), (0, new)])
    kept = spec_limiter.change_rates(
        spec_limiter.try_take(spec_limiter.try_take(spec_limiter.EMPTY, "u", old, 0)[0], "u", old, 0)[0],
        lambda u: old,
        lambda u: Fraction(20),
        0,
    )
    assert spec_limiter.grants_at(kept, "u", Fraction(20), 0) == 1  # 2 tokens ahead of 3 at 20 tok/s


@pytest.mark.rules("R21")
def test_r21_default_change_and_moves_to_and_from_the_default() -> None:
    # a: override 5 -> default (now 20); b: default 10 -> override 2; c: default 10 -> 20; d: override 4 -> 4.
    old = EngineConfig(
        default_rate_tokens_per_s=Fraction(10), user_rates_tokens_per_s=(("a", Fraction(5)), ("d", Fraction(4)))
    )
    new = old.with_rates(Fraction(20), (("b", Fraction(2)), ("d", Fraction(4))))
    now = 100 * MS
    state = _state(
        a=Fraction(300 * MS),
        b=Fraction(300 * MS),
        c=Fraction(300 * MS),
        d=Fraction(10**9, 3) + now,
        e=Fraction(50 * MS),
    )
    after = spec_limiter.change_rates(state, old.rate_of, new.rate_of, now).tat_ns
    assert after["a"] == now + 50 * MS  # 1 token at 5/s = 1 token at 20/s
    assert after["b"] == now + 1000 * MS  # 2 tokens at 10/s = 2 tokens at 2/s
    assert after["c"] == now + 100 * MS
    assert after["d"] == state.tat_ns["d"]  # rate unchanged: TAT unchanged
    assert "e" not in after  # idle under a changed rate: forgotten (R6)


@pytest.mark.rules("R21")
def test_r21_step_model_applies_a_change_at_the_next_schedule_clock() -> None:
    config = EngineConfig(default_rate_tokens_per_s=Fraction(10), user_rates_tokens_per_s=(("a", Fraction(5)),))
    state = initial_state(config)
    history = invariants.DispatchHistory()
    events = [
        AddRequest("r0", "a", max_tokens=30),
        Step(),
        AdvanceClock(20 * MS),
        Step(),
        ChangeRates("10", (("a", "20"),)),
        AdvanceClock(30 * MS),
    ]
    for event in events:
        before = state
        state, obs = spec.step(state, event)
        history = invariants.advance_history(history, before, obs)
    # Pending: nothing applied yet, the clock moved after the change event.
    assert state.pending_rates is not None and state.config.rate_of("a") == 5
    tat_before = state.limiter.tat_ns["a"]  # 400 ms: 2 grants at 0 ms (burst), 5/s
    before = state
    state, obs = spec.step(state, Step())
    history = invariants.advance_history(history, before, obs)
    assert invariants.check(before, Step(), state, obs, history) is None
    now = 50 * MS
    lead_tokens = (tat_before - now) / (200 * MS)  # in tokens at 5/s (T = 200 ms)
    assert state.config.rate_of("a") == 20 and state.pending_rates is None
    # Rescaled at 50 ms (the step's clock), then the step's grants at 20 tok/s (50 ms each).
    charged = len(obs.charged)
    assert state.limiter.tat_ns["a"] == now + math.ceil(lead_tokens * 50 * MS) + charged * 50 * MS


@pytest.mark.rules("R21")
def test_r21_a_change_cannot_turn_the_feature_on() -> None:
    with pytest.raises(AssertionError, match="R18"):
        spec.step(initial_state(EngineConfig()), ChangeRates("10"))
    with pytest.raises(AssertionError, match="positive"):
        ChangeRates("0")


# -- the reference --------------------------------------------------------------------------
REFERENCE = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
DECIMAL_RATES = st.sampled_from([Fraction(r) for r in ("0.5", "1", "2", "3", "7", "10", "20", "100", "2.5", "0.333")])


@pytest.mark.rules("R21", "R3")
@settings(max_examples=200, deadline=None)
@given(
    default=DECIMAL_RATES,
    override=st.none() | DECIMAL_RATES,
    new_default=DECIMAL_RATES,
    new_override=st.none() | DECIMAL_RATES,
    takes=st.integers(0, 30),
    now=st.integers(0, 10**9),
    later=st.integers(0, 3 * 10**8),
)
def test_r21_reference_limiter_rescales_exactly_as_the_spec(
    default, override, new_default, new_override, takes, now, later
) -> None:
    from types import MappingProxyType

    from vllm_output_rate.reference.limiter import OutputRateLimiter

    old_users = {} if override is None else {"a": override}
    new_users = {} if new_override is None else {"b": new_override}
    limiter = OutputRateLimiter(default, old_users)
    for _ in range(takes):
        limiter.try_take("a", now)
        limiter.try_take("b", now)
    before = spec_limiter.LimiterState(MappingProxyType({u: limiter.tat_ns(u) for u in limiter.users()}))
    old_rate_of = OutputRateLimiter(default, old_users).rate_of
    limiter.change_rates(new_default, new_users, now + later)
    want = spec_limiter.change_rates(
        before, old_rate_of, OutputRateLimiter(new_default, new_users).rate_of, now + later
    )
    assert {u: limiter.tat_ns(u) for u in limiter.users()} == dict(want.tat_ns)
    assert limiter.rate_of("a") == (new_default) and limiter.rate_of("b") == (new_override or new_default)


def _change_scenario(async_scheduling: bool):
    from vllm_output_rate.adapter.fidelity import StepScenario

    config = EngineConfig(
        default_rate_tokens_per_s=Fraction(10),
        user_rates_tokens_per_s=(("a", Fraction(5)),),
        async_scheduling=async_scheduling,
    )
    events: list = [
        AddRequest("r0", "a", max_tokens=30),
        AddRequest("r1", "b", max_tokens=30),
        AddRequest("r2", "a", max_tokens=30),
    ]
    for _ in range(8):
        events += [Step(), AdvanceClock(33 * MS)]
    events += [ChangeRates("20", (("b", "2.5"),))]  # a moves to the default (faster), b to an override (slower)
    for _ in range(12):
        events += [Step(), AdvanceClock(17 * MS)]
    events += [ChangeRates("3", (("a", "7"),)), AdvanceClock(5 * MS)]  # applied at the next step's clock
    for _ in range(12):
        events += [Step(), AdvanceClock(40 * MS)]
    return StepScenario(config, tuple(events))


@pytest.mark.rules("R21")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_r21_reference_matches_the_spec_step_for_step_across_changes(async_scheduling) -> None:
    # White box: batch, charges, refunds, throttled, wait hint and every exact TAT, after
    # every step, with two changes written to the reference's rates file.
    from vllm_output_rate.adapter.whitebox import run_white_box

    verdict = run_white_box(_change_scenario(async_scheduling))
    assert verdict.failure is None, verdict
    assert verdict.steps == 32


def _harness(tmp_path, rates_file: bool = True, **output_rate):
    from vllm_output_rate.adapter.engine_shape import EngineShape
    from vllm_output_rate.adapter.harness import Harness

    section = {"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 5}, **output_rate}
    if rates_file:
        section["rates_file"] = str(tmp_path / "rates.json")
    return Harness(REFERENCE, EngineShape(output_rate=section))


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def error(self, fmt, *args) -> None:
        self.lines.append(("error", fmt % args))

    def warning(self, fmt, *args) -> None:
        self.lines.append(("warning", fmt % args))


@pytest.mark.rules("R21")
def test_r21_queued_change_waits_for_the_step_boundary(tmp_path) -> None:
    harness = _harness(tmp_path, rates_file=False)
    scheduler = harness.scheduler
    harness.add_request("r0", "a", max_tokens=20)
    harness.step()  # one request: one charge at 0 ns, TAT 200 ms at 5 tok/s
    assert scheduler.rate_limiter.tat_ns("a") == 200 * MS
    scheduler.update_output_rates(20, {})  # a moves to the default 20 tok/s
    # Not applied outside schedule(): the limiter still has the old rate and TAT.
    assert scheduler.rate_limiter.rate_of("a") == 5 and scheduler.rate_limiter.tat_ns("a") == 200 * MS
    harness.advance(100 * MS)
    harness.step()  # applied at 100 ms: lead 100 ms at 5/s = 0.5 token = 25 ms at 20/s; then one grant
    assert scheduler.rate_limiter.rate_of("a") == 20
    assert scheduler.rate_limiter.tat_ns("a") == 100 * MS + 25 * MS + 50 * MS
    assert scheduler.output_rate_config.default_rate == 20


@pytest.mark.rules("R21")
def test_r21_rates_file_reload_and_a_bad_file_keeps_the_limits(tmp_path) -> None:
    harness = _harness(tmp_path)
    scheduler, path = harness.scheduler, tmp_path / "rates.json"
    log = _Log()
    scheduler._limits.rates_watcher._logger = log
    harness.add_request("r0", "a", max_tokens=50)
    harness.step()
    assert log.lines and log.lines[0][0] == "warning" and "does not exist" in log.lines[0][1]
    path.write_text('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 5, "a": 50}}')
    harness.advance(10 * MS)
    harness.step()  # a key given twice: refused, logged, limits kept, no crash
    assert scheduler.rate_limiter.rate_of("a") == 5
    assert log.lines[-1][0] == "error" and "'a' is given twice" in log.lines[-1][1]
    assert "limits in force are kept" in log.lines[-1][1]
    harness.advance(10 * MS)
    harness.step()  # the same bad file: not read again, not logged again
    assert len([kind for kind, _ in log.lines if kind == "error"]) == 1
    temporary = tmp_path / "rates.tmp"
    temporary.write_text('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 40}}')
    temporary.replace(path)
    harness.advance(10 * MS)
    harness.step()
    assert scheduler.rate_limiter.rate_of("a") == 40 and scheduler._limits.rates_watcher.reloads == 1
    temporary.write_text("{not json")
    temporary.replace(path)
    harness.advance(10 * MS)
    harness.step()
    assert scheduler.rate_limiter.rate_of("a") == 40 and "not valid JSON" in log.lines[-1][1]
    path.unlink()
    harness.advance(10 * MS)
    harness.step()  # removed: the limits in force are kept
    assert scheduler.rate_limiter.rate_of("a") == 40


@pytest.mark.rules("R21")
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"default_tokens_per_s": 10, "default_tokens_per_s": 20}', "'default_tokens_per_s' is given twice"),
        ('{"default_tokens_per_s": 10, "user_token_per_s": {}}', "did you mean 'user_tokens_per_s'?"),
        ('{"default_tokens_per_s": 10, "burst_ms": 50}', "'burst_ms' cannot be changed without a restart"),
        ('{"user_tokens_per_s": {"a": 5}}', "no default_tokens_per_s"),
        ('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 0}}', "user_tokens_per_s['a'] must be > 0"),
        ('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 0.1234567891}}', "at most 9 decimal places"),
        ('{"default_tokens_per_s": "fast"}', "default_tokens_per_s must be a number"),
        ("[10]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_r21_rates_file_is_validated_like_start_up(text, message) -> None:
    from vllm_output_rate.reference.ratesfile import parse_rates_file
    from vllm_output_rate.reference.section import OutputRateConfigError

    with pytest.raises(OutputRateConfigError, match=r"rates file r\.json: ") as caught:
        parse_rates_file(text, "r.json")
    assert message in str(caught.value)


@pytest.mark.rules("R21")
def test_r21_start_up_reads_the_rates_file_and_refuses_a_bad_one(tmp_path) -> None:
    from vllm_output_rate.reference.config import parse_output_rate
    from vllm_output_rate.reference.section import OutputRateConfigError

    path = tmp_path / "rates.json"
    section = {"default_tokens_per_s": 10, "rates_file": str(path)}
    assert parse_output_rate(section).default_rate == 10  # no file yet: the section's rates, watched
    path.write_text('{"default_tokens_per_s": 2.5, "user_tokens_per_s": {"a": 7}}')
    config = parse_output_rate(section)
    assert config.default_rate == Fraction(5, 2) and config.user_rates == {"a": 7}
    path.write_text('{"default_tokens_per_s": -1}')
    with pytest.raises(OutputRateConfigError, match=f"rates file {path}: default_tokens_per_s must be > 0"):
        parse_output_rate(section)
    with pytest.raises(OutputRateConfigError, match="rates_file must be a non-empty string"):
        parse_output_rate({"default_tokens_per_s": 10, "rates_file": ""})


@pytest.mark.rules("R21", "R18")
def test_r21_a_change_cannot_turn_the_reference_on(tmp_path) -> None:
    from vllm_output_rate.adapter.engine_shape import EngineShape
    from vllm_output_rate.adapter.harness import Harness
    from vllm_output_rate.reference.section import OutputRateConfigError

    harness = Harness(REFERENCE, EngineShape())
    with pytest.raises(OutputRateConfigError, match="cannot turn it on"):
        harness.scheduler.update_output_rates(10)
    with pytest.raises(OutputRateConfigError, match="must be > 0"):
        _harness(tmp_path, rates_file=False).scheduler.update_output_rates(0)


@pytest.mark.rules("R21")
def test_r21_trace_records_the_change_and_the_checker_applies_it(tmp_path) -> None:
    import json

    from vllm_output_rate.adapter.trace_check import check_records, check_trace

    trace, rates = tmp_path / "trace.jsonl", tmp_path / "rates.json"
    harness = _harness(tmp_path, trace_path=str(trace))
    for i in range(3):
        harness.add_request(f"a{i}", "a", max_tokens=40)
    for n in range(200):
        if n == 30:  # a: 5 -> 50 tok/s, a reload at the step after
            rates.write_text('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 50}}')
        harness.step()
        harness.advance(20 * MS)
        if len(harness.finished) == 3:
            break
    harness.scheduler.shutdown()
    lines = trace.read_text().splitlines()
    changes = [json.loads(line)["rates"] for line in lines if '"rates"' in line]
    assert len(changes) == 1 and changes[0]["user_tokens_per_s"] == {"a": "50"}
    report = check_trace(trace, completions={rid: n for rid, (_, n) in harness.finished.items()})
    assert report.ok, report.summary()
    assert report.runs[0].rate_changes_ns == [changes[0]["now_ns"]] and report.runs[0].users["a"].rate == 50
    # Against a trace whose engine handed out a second burst at the change (TAT reset to now,
    # shown by moving every dispatch after the change forward to the change instant), R2-gcra fails.
    change_ns = changes[0]["now_ns"]
    forged, moved = [], 0
    for line in lines:
        record = json.loads(line)
        if "requests" in record and record["now_ns"] > change_ns and moved < 12:
            record["now_ns"] = change_ns  # the candidate dispatched these at the change instant
            moved += sum(1 for info in record["requests"].values() if info.get("sampled"))
        forged.append(json.dumps(record))
    bad = check_records(forged)
    assert not bad.ok and any(v.rule == "R2-gcra" for v in bad.violations), bad.summary()


# -- the gate ---------------------------------------------------------------------------------
REFERENCE_ASYNC = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"


@pytest.mark.rules("R21")
def test_r21_gate_passes_the_reference_and_rejects_wrong_changes(monkeypatch) -> None:
    from pathlib import Path

    from vllm_output_rate.adapter.rate_change import check_rate_change

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    for cls, async_mode in ((REFERENCE, False), (REFERENCE_ASYNC, True)):
        result = check_rate_change(cls, async_mode, Hunt(6))
        assert result.result == "pass", result.failure
    expected = {
        "ResetOnChange": "an over-grant",
        "KeepTatOnChange": "an under-grant",
        "IgnoreRateChanges": "an under-grant",
    }
    for name, finding in expected.items():
        result = check_rate_change(f"r21_candidates.{name}", False, Hunt(30))
        assert result.result == "fail" and result.failure.startswith("[exact] R21"), (name, result.failure)
        assert finding in result.failure, (name, result.failure)
        assert any("rates default=" in line for line in result.counterexample), result.counterexample


@pytest.mark.rules("R21")
def test_r21_white_box_rejects_a_reset_on_change(monkeypatch) -> None:
    from pathlib import Path

    from vllm_output_rate.adapter.whitebox import run_white_box

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    scenario = _change_scenario(False)
    verdict = run_white_box(scenario, "r21_candidates.ResetOnChange")
    # Found at the first step after the change: a dispatch the spec does not grant.
    assert verdict.failure is not None and isinstance(scenario.events[verdict.event_index - 1], ChangeRates), verdict
    assert verdict.failure.startswith("scheduled:"), verdict


@pytest.mark.rules("R21")
def test_r21_gate_rows_at_exact_unless_the_candidate_opts_in() -> None:
    from vllm_output_rate.adapter import gate_row, registry
    from vllm_output_rate.adapter.rate_change import check_rate_change

    specs = {s.name: s for s in registry.registry()}
    for name in ("rate-change/sync", "rate-change/async"):
        assert specs[name].level == "exact" and specs[name].rules == ("R21",) and specs[name].part == "candidate"
    plain = gate_row.GateOptions(scheduler_cls=REFERENCE, level="must", sync_only=True, spec_health=False)
    opted = gate_row.GateOptions(
        scheduler_cls=REFERENCE, level="must", sync_only=True, spec_health=False, rate_change=True
    )
    assert "rate-change/sync" not in [p.row.name for p in registry.plan(plain)]
    assert "rate-change/sync" in [p.row.name for p in registry.plan(opted)]
    assert specs["rate-change/sync"].level_for(opted) == "must"
    from vllm_output_rate.adapter.configstyle import parse_config_style

    result = check_rate_change(REFERENCE, False, Hunt(1), style=parse_config_style("engine-args"))
    assert result.result == "not tested" and "rates_file" in result.failure


@pytest.mark.rules("R21")
def test_r21_outrate_serve_rates_file_flag(tmp_path) -> None:
    import click

    from vllm_output_rate.serve import build_command
    from vllm_output_rate.serve_section import build_output_rate_section

    section = build_output_rate_section("10", None, None, None, rates_file="rates.json")
    assert section is not None and section["rates_file"] == str(Path.cwd() / "rates.json")  # absolute
    command = build_command("MODEL", [], "10", rates_file=str(tmp_path / "r.json"))
    assert f'"rates_file":"{tmp_path / "r.json"}"' in command[command.index("--additional-config") + 1]
    with pytest.raises(click.UsageError, match="--rates-file needs --default-user-output-tokens-per-second"):
        build_output_rate_section(None, None, None, None, rates_file="rates.json")
    (tmp_path / "bad.json").write_text('{"default_tokens_per_s": 10, "max_num_active_seqs": 2}')
    with pytest.raises(click.UsageError, match="'max_num_active_seqs' cannot be changed without a restart"):
        build_output_rate_section("10", None, None, None, rates_file=str(tmp_path / "bad.json"))


@pytest.mark.rules("R21")
def test_r21_shadow_mode_follows_the_rates_file(tmp_path) -> None:
    harness = _harness(tmp_path, shadow=True)
    scheduler = harness.scheduler
    assert scheduler.rate_limiter is None and scheduler._observation.shadow.limiter.rate_of("a") == 5
    (tmp_path / "rates.json").write_text('{"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 25}}')
    harness.add_request("r0", "a", max_tokens=4)
    harness.step()
    assert scheduler._observation.shadow.limiter.rate_of("a") == 25


# -- the model checker ------------------------------------------------------------------------
@pytest.mark.rules("R21")
def test_r21_model_checker_explores_rate_changes_and_catches_a_reset(monkeypatch) -> None:
    from types import MappingProxyType

    from vllm_output_rate.proofs import modelcheck as mc

    scope = mc.scope_by_name("async-rate-change")
    assert scope.rate_changes and scope.pinned is not None
    result = mc.explore(scope)
    assert result.as_json()["violations"] == 0 and (result.states, result.transitions) == scope.pinned

    def reset(state, old_rate_of, new_rate_of, now_ns):  # the mutant: a changed user's TAT := now
        return spec_limiter.LimiterState(
            MappingProxyType({u: t for u, t in state.tat_ns.items() if old_rate_of(u) == new_rate_of(u)})
        )

    monkeypatch.setattr(spec_limiter, "change_rates", reset)
    found = mc.explore(mc.scope_by_name("sync-rate-change"), stop_at_first=True).as_json()
    assert found["violations"] >= 1 and found["details"][0]["check"] == "I13", found["details"][:1]
    assert any(event.startswith("rates default=") for event in found["details"][0]["events"])
