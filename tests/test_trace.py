"""The engine-side event trace (``output_rate.trace_path``) and its online checker.

The reference scheduler runs in-process (``adapter.harness.Harness``: fake clock,
fabricated model outputs) with tracing on; ``adapter.trace_check`` must accept its
traces, and must reject synthetic traces that break each invariant it checks.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, Harness
from vllm_output_rate.adapter.trace_check import check_records, check_trace
from vllm_output_rate.adapter.trace_checker import engine_id_matches
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.section import OutputRateConfigError
from vllm_output_rate.spec.limiter import window_bound_tokens

MS = 1_000_000


# -- configuration -----------------------------------------------------------------
def test_trace_path_parsed():
    cfg = parse_output_rate({"default_tokens_per_s": 10, "trace_path": "/tmp/x.jsonl"})
    assert cfg.trace_path == "/tmp/x.jsonl"
    assert parse_output_rate({"default_tokens_per_s": 10}).trace_path is None


@pytest.mark.parametrize("bad", [3, True, ["/tmp/x"], "", "  "])
def test_trace_path_must_be_a_string(bad):
    with pytest.raises(OutputRateConfigError, match="trace_path must be a non-empty string") as err:
        parse_output_rate({"default_tokens_per_s": 10, "trace_path": bad})
    assert repr(bad) in str(err.value)


# -- the reference scheduler writes a trace the checker accepts ---------------------
def _drive(h: Harness, steps: int, before_step) -> bool:
    """Step ``h`` (10 ms apart) until every request finished, at most ``steps`` times;
    ``before_step(n)`` before step ``n``. True if every request finished."""
    for n in range(steps):
        if len(h.finished) == len(h.num_outputs) and h._in_flight is None:
            return True
        if not h.scheduler.has_requests() and h._in_flight is not None:
            h.drain()
            continue
        before_step(n)
        h.step()
        h.advance(10 * MS)
    return len(h.finished) == len(h.num_outputs) and h._in_flight is None


def _run(async_scheduling: bool, path, eos_first: bool = True, abort: str | None = None, tag: str = "") -> Harness:
    cls = REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER
    section = {"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 20}, "trace_path": str(path)}
    h = Harness(cls, EngineShape(async_scheduling=async_scheduling, output_rate=section))
    for i in range(3):
        h.add_request(f"{tag}slow{i}", "slow", max_tokens=10, eos_index=4 if (i == 0 and eos_first) else None)
    h.add_request(f"{tag}fast0", "fast", prompt_len=40, max_tokens=12)
    if not _drive(h, 400, lambda n: h.abort(abort) if abort is not None and n == 20 else None):
        raise AssertionError("not finished")
    return h


def test_trace_written_and_checked(async_scheduling, tmp_path):
    path = tmp_path / "trace.jsonl"
    h = _run(async_scheduling, path)
    # Complete once the scheduler is idle, before shutdown (the live test reads it then).
    report = check_trace(path, completions={rid: n for rid, (_, n) in h.finished.items()})
    assert report.ok, report.summary()
    h.scheduler.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header = lines[0]["header"]
    assert header["async_scheduling"] is async_scheduling
    assert header["user_tokens_per_s"] == {"slow": "20"} and header["default_tokens_per_s"] == "100"
    steps = [r for r in lines[1:] if "requests" in r]
    assert [r["step"] for r in steps] == list(range(len(steps)))
    assert any(info["throttled"] for r in steps for info in r["requests"].values())  # "slow" was paced
    finished = {rid: info for r in lines for rid, info in (r.get("finished") or {}).items()}
    assert finished["slow0"] == {"status": "FINISHED_STOPPED", "output_tokens": 5}
    assert finished["fast0"] == {"status": "FINISHED_LENGTH_CAPPED", "output_tokens": 12}
    run = report.runs[0]
    assert run.users["slow"].rate == 20 and run.users["fast"].rate == 100
    assert run.users["slow"].dispatches == 5 + 10 + 10
    assert run.requests["fast0"].sampled == 12
    assert run.max_limiter_users >= 1


PLAN_TABLE = {
    "default_plan": "free",
    "plans": {"free": {"tokens_per_s": 20}, "pro": {"tokens_per_s": 200}, "internal": {"unlimited": True}},
    "users": {"acme": "pro", "team/*": "internal"},
}


def _plan_table_run(tmp_path, async_scheduling: bool, change: dict | None = None) -> tuple[Harness, list[dict]]:
    """Users on a plan (acme: pro, 200 tok/s), a pattern (team/bob: unlimited) and the
    default plan (x: free, 20 tok/s) from a rates file in force at start-up, three streams
    each; ``change``: a new table written at step 15. Returns the harness and the lines."""
    rates, trace = tmp_path / "rates.json", tmp_path / "trace.jsonl"
    rates.write_text(json.dumps(PLAN_TABLE))
    cls = REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER
    section = {"default_tokens_per_s": 20, "rates_file": str(rates), "trace_path": str(trace)}
    h = Harness(cls, EngineShape(async_scheduling=async_scheduling, output_rate=section))
    for user in ("acme", "team/bob", "x"):
        for i in range(3):
            h.add_request(f"{user}-{i}", user, max_tokens=30)
    _drive(h, 400, lambda n: rates.write_text(json.dumps(change)) if change is not None and n == 15 else None)
    h.scheduler.shutdown()
    return h, [json.loads(line) for line in trace.read_text().splitlines()]


@pytest.mark.rules("R27", "R28")
def test_r27_the_checker_replays_each_user_at_its_plan_pattern_or_unlimited_rate(async_scheduling, tmp_path):
    # The header's two rate keys say 20 tok/s for everyone; the engine limits acme at 200
    # (its plan) and team/bob not at all (its pattern's plan): each step line states the
    # rate of its users that no line stated yet, and the checker replays that rate.
    h, lines = _plan_table_run(tmp_path, async_scheduling)
    report = check_trace(tmp_path / "trace.jsonl", completions={rid: n for rid, (_, n) in h.finished.items()})
    assert report.ok, report.summary()
    users = report.runs[0].users
    assert (users["acme"].rate, users["team/bob"].rate, users["x"].rate) == (200, None, 20)
    assert users["team/bob"].dispatches == 90 and "unlimited" in report.summary()
    stated = [r["user_rates"] for r in lines if "user_rates" in r]
    assert stated[0] == {"acme": "200", "team/bob": "unlimited", "x": "20"} and len(stated) == 1
    # The same dispatches judged at the header's 20 tok/s break R2: the statement is needed.
    unstated = [json.dumps({k: v for k, v in r.items() if k != "user_rates"}) for r in lines]
    assert {"R2-window", "R2-gcra"} <= {v.rule for v in check_records(unstated).violations}


@pytest.mark.rules("R21", "R27", "R28")
def test_r21_a_plan_table_change_is_replayed_for_users_the_rates_line_does_not_name(tmp_path):
    # At step 15 acme moves to a 50 tok/s plan and team/* from unlimited to 30 tok/s. The
    # rates line of a plan table names only the users holding a budget; the others' new
    # rates come with their next step line, applied at the change's time.
    change = {
        "default_plan": "free",
        "plans": {"free": {"tokens_per_s": 20}, "basic": {"tokens_per_s": 50}, "slow": {"tokens_per_s": 30}},
        "users": {"acme": "basic", "team/*": "slow"},
    }
    h, lines = _plan_table_run(tmp_path, False, change)
    report = check_trace(tmp_path / "trace.jsonl", completions={rid: n for rid, (_, n) in h.finished.items()})
    assert report.ok, report.summary()
    users = report.runs[0].users
    assert (users["acme"].rate, users["team/bob"].rate, users["x"].rate) == (50, 30, 20)
    assert len(report.runs[0].rate_changes_ns) == 1
    # A stated rate that differs from the replayed one with no rates line before it.
    forged = [json.dumps(r) for r in lines if "rates" not in r]
    assert "R21-rates" in {v.rule for v in check_records(forged).violations}


def test_trace_with_abort_and_second_run_appends(tmp_path):
    path = tmp_path / "trace.jsonl"
    h1 = _run(False, path, abort="slow1")
    h1.scheduler.shutdown()
    h2 = _run(True, path, tag="b-")
    h2.scheduler.shutdown()
    completions = {rid: n for h in (h1, h2) for rid, (_, n) in h.finished.items()}
    report = check_trace(path, completions=completions, cancelled={"slow1"})
    assert report.ok, report.summary()
    assert len(report.runs) == 2
    assert report.runs[0].requests["slow1"].status == "FINISHED_ABORTED"


def test_trace_off_costs_nothing(tmp_path):
    h = Harness(REFERENCE_SCHEDULER, EngineShape(output_rate={"default_tokens_per_s": 100}))
    assert h.scheduler._observation.trace is None
    h.add_request("a", "u", max_tokens=2)
    h.step()
    assert list(tmp_path.iterdir()) == []


# -- the checker on synthetic traces ------------------------------------------------
HEADER = {
    "header": {
        "version": 1,
        "async_scheduling": False,
        "default_tokens_per_s": "10",
        "user_tokens_per_s": {"slow": "1"},
        "burst_ns": 100 * MS,
    }
}


def _step(step, now_ms, reqs, charges=None, refunds=(), finished=None, preempted=()):
    """reqs: {rid: (user, tokens, sampled, throttled)}; charges default: the sampled ones."""
    requests = {
        rid: {"user": u, "tokens": t, "sampled": s, "charged": False, "refunded": False, "throttled": th}
        for rid, (u, t, s, th) in reqs.items()
    }
    if charges is None:
        charges = [rid for rid, (_, _, s, _) in reqs.items() if s]
    for rid in charges:
        requests.setdefault(rid, {"user": "u", "tokens": 0, "sampled": False, "throttled": False})["charged"] = True
    for rid in refunds:
        requests[rid]["refunded"] = True
    return {
        "step": step,
        "now_ns": now_ms * MS,
        "requests": requests,
        "charges": list(charges),
        "refunds": list(refunds),
        "preempted": list(preempted),
        "running": len(reqs),
        "waiting": 0,
        "limiter_users": 1,
        "finished": finished or {},
    }


def _lines(*records, header=HEADER):
    return [json.dumps(r) + "\n" for r in (header, *records)]


def _rules(report):
    return sorted({v.rule for v in report.violations})


def test_checker_accepts_a_paced_user():
    # rate 10/s, tau 100 ms: grants at 0, 0 (burst: floor(0.1 x 10) + 1 = 2), then every 100 ms.
    recs = [_step(0, 0, {"a": ("u", 4, True, False), "b": ("u", 4, True, False)})]
    recs += [_step(k, 100 * k, {"a": ("u", 1, True, False)}) for k in range(1, 10)]
    recs.append(
        {
            "now_ns": None,
            "finished": {
                "a": {"status": "FINISHED_LENGTH_CAPPED", "output_tokens": 10},
                "b": {"status": "FINISHED_ABORTED", "output_tokens": 1},
            },
        }
    )
    report = check_records(_lines(*recs), completions={"a": 10})
    assert report.ok, report.summary()
    assert report.runs[0].users["u"].dispatches == 11


def test_checker_window_bound_violation():
    # Three dispatches at t=0 exceed the idle burst of 2 at 10 tok/s.
    recs = [_step(0, 0, {"a": ("u", 1, True, False), "b": ("u", 1, True, False), "c": ("u", 1, True, False)})]
    report = check_records(_lines(*recs))
    assert _rules(report) == ["R2-gcra", "R2-window"]
    assert "3 sampling dispatches in a window of 0.000 ms (bound 2" in str(report.violations[0]) + str(
        report.violations[1]
    )


def test_checker_accounting_double_charge_refund_and_throttled():
    recs = [
        _step(0, 0, {"a": ("u", 1, True, False)}, charges=["a", "a"], refunds=["a"]),  # charged twice
        _step(1, 500, {"a": ("u", 1, True, False)}, charges=[]),  # dispatched without a charge
        _step(2, 1000, {"a": ("u", 1, False, False)}, charges=["a"]),  # charged, not dispatched, no refund
        _step(3, 1500, {"a": ("u", 1, True, True)}),  # throttled yet scheduled
        _step(4, 2000, {"a": ("u", 0, False, False)}, charges=[], refunds=["a"]),  # refund without charge
    ]
    report = check_records(_lines(*recs))
    assert _rules(report) == ["R11-throttled", "R7-once", "R7/R9-accounting", "R9-refund"]
    steps = sorted({v.step for v in report.violations if v.rule == "R7/R9-accounting"})
    assert steps == [1, 2]


def test_checker_clock_identity_and_format():
    recs = [_step(0, 100, {"a": ("u", 1, True, False)}), _step(2, 50, {"a": ("v", 1, True, False)})]
    lines = _lines(*recs) + ["{not json\n"]
    assert _rules(check_records(lines)) == ["R17-identity", "clock", "format"]
    # While the engine writes, an unterminated last line is skipped.
    partial = _lines(_step(0, 0, {"a": ("u", 1, True, False)})) + ['{"step": 1, "now']
    report = check_records(partial, partial=True)
    assert report.ok and report.ignored_partial_line
    assert _rules(check_records(["{}\n"])) == ["format"]  # a record before any header


def test_checker_clock_going_back_is_reported_not_a_crash():
    # The slow user (1 tok/s) dispatched at 1 s, then at a step stamped 0 s: the checker
    # reports the clock and replays R2 on a clock that never goes back (two grants at 1 s:
    # over the bound), instead of asking R2 about a window of -1 s (an AssertionError).
    recs = [_step(0, 1000, {"a": ("slow", 1, True, False)}), _step(1, 0, {"a": ("slow", 1, True, False)})]
    report = check_records(_lines(*recs))
    assert _rules(report) == ["R2-gcra", "R2-window", "clock"]
    assert "now_ns 0 < previous 1000000000" in next(v.message for v in report.violations if v.rule == "clock")


def test_checker_lost_and_duplicated_tokens():
    recs = [_step(k, 200 * k, {"a-12345678": ("u", 1, True, False)}) for k in range(5)]
    recs.append({"now_ns": None, "finished": {"a-12345678": {"status": "FINISHED_STOPPED", "output_tokens": 5}}})
    assert check_records(_lines(*recs), completions={"a": 5}).ok
    assert _rules(check_records(_lines(*recs), completions={"a": 6})) == ["tokens"]  # a token lost
    assert _rules(check_records(_lines(*recs), completions={"a": 4})) == ["tokens"]  # one duplicated (sync)
    assert check_records(_lines(*recs), completions={"a": 4}, cancelled={"a"}).ok  # cancelled: >= only
    assert _rules(check_records(_lines(*recs), completions={"b": 4})) == ["tokens"]  # unknown request
    # Async: one dispatch past a stop is allowed, two are not.
    async_header = {"header": {**HEADER["header"], "async_scheduling": True}}
    recs[-1]["finished"]["a-12345678"]["output_tokens"] = 4
    assert check_records(_lines(*recs, header=async_header), completions={"a": 4}).ok
    assert _rules(check_records(_lines(*recs, header=async_header), completions={"a": 3})) == ["tokens"]
    assert engine_id_matches("chatcmpl-x-abcdefgh", "chatcmpl-x") and not engine_id_matches("a-1", "a")


@pytest.mark.parametrize("seed", range(20))
def test_window_check_matches_brute_force(seed):
    # The O(n) window check agrees with every pair (i, j) checked by window_bound_tokens.
    rnd = random.Random(seed)
    rate = Fraction(rnd.choice([1, 3, 10, 20]), rnd.choice([1, 2]))
    t, times = 0, []
    for _ in range(rnd.randint(2, 40)):
        t += rnd.choice([0, 0, 10, 30, 50, 100, 400]) * MS
        times.append(t)
    brute_ok = all(
        j - i + 1 <= window_bound_tokens(times[j] - times[i], rate)
        for i in range(len(times))
        for j in range(i, len(times))
    )
    header = {"header": {**HEADER["header"], "default_tokens_per_s": str(rate)}}
    recs = [_step(k, t // MS, {f"r{k}": ("u", 1, True, False)}) for k, t in enumerate(times)]
    report = check_records(_lines(*recs, header=header))
    assert ("R2-window" not in _rules(report)) == brute_ok
    if "R2-window" in _rules(report):
        assert "R2-gcra" in _rules(report)  # GCRA conformance implies the window bound


# -- the command line (outrate check-trace FILE, python -m ...trace_check FILE; issue 15) ----
FAST_HEADER = {
    "header": {
        **HEADER["header"],
        "pid": 7,
        "scheduler": "RateLimitedScheduler",
        "default_tokens_per_s": "100",
        "user_tokens_per_s": {},
    }
}


def _client_run(first_step: int, start_ms: int, rid: str, n: int = 200) -> list[dict]:
    """One client stream of user "u" paced at exactly 100 tok/s (a dispatch every 10 ms), then freed."""
    recs = [_step(first_step + k, start_ms + 10 * k, {rid: ("u", 1, True, False)}) for k in range(n)]
    recs.append({"now_ns": None, "finished": {rid: {"status": "FINISHED_LENGTH_CAPPED", "output_tokens": n}}})
    return recs


def _write(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(lines))
    return path


def _cli(*args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.adapter.trace_check", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_rate_over_busy_periods_not_diluted_by_idle_time_between_client_runs():
    # One engine run, two client runs of 200 tokens 20 s apart: the article's first-to-last
    # measure gives 400 / 23.99 s = 16.7 tok/s for a 100 tok/s user; busy periods give ~100.
    recs = _client_run(0, 0, "a") + _client_run(200, 22_000, "b")
    report = check_records(_lines(*recs, header=FAST_HEADER))
    assert report.ok, report.summary()
    user = report.runs[0].users["u"]
    assert user.engine_rate == pytest.approx(400 / 23.99, rel=1e-3)  # the diluted figure
    assert user.busy_periods == 2
    assert user.busy_s == pytest.approx(2 * 1.99)
    assert user.busy_rate == pytest.approx(400 / 3.98)  # 100.5 tok/s: the +1 of each period's first token
    assert "100.50 tok/s" in report.summary() and "18." not in report.summary()


def test_check_trace_command_reports_per_run_and_exits_0(tmp_path):
    # Two engine runs (two headers) of the same user: one row per run, never merged.
    lines = _lines(*_client_run(0, 0, "a"), header=FAST_HEADER) + _lines(
        *_client_run(0, 600_000, "b"), header={"header": {**FAST_HEADER["header"], "pid": 8}}
    )
    path = _write(tmp_path, lines)
    proc = _cli(str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"{path}: 2 run(s), 400 steps, 0 violation(s)"
    assert out[1].startswith(
        "run 0: RateLimitedScheduler pid 7, sync, default 100 tok/s, 0 override(s), burst 100 ms; 200 steps over 1.99 s"
    )
    assert out[2].split() == ["user", "limit", "tok/s", "dispatches", "busy", "periods", "busy", "s", "tok/s"]
    assert out[3].split() == ["u", "100", "200", "1", "1.99", "100.50"]
    assert out[4].startswith("run 1: RateLimitedScheduler pid 8")
    assert out[6].split() == ["u", "100", "200", "1", "1.99", "100.50"]
    assert out[-1] == "OK: every check passed in 2 run(s)"


def test_check_trace_command_exits_1_on_a_violation_2_unreadable_never_silent(tmp_path):
    bad = _write(
        tmp_path,
        _lines(_step(0, 0, {"a": ("u", 1, True, False), "b": ("u", 1, True, False), "c": ("u", 1, True, False)})),
        "bad.jsonl",
    )
    proc = _cli(str(bad))
    assert proc.returncode == 1
    assert "violations:" in proc.stdout and "R2-window: run 0 user 'u': 3 sampling dispatches" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "FAIL: 2 violation(s) (R2-gcra x1, R2-window x1)"
    empty = _write(tmp_path, [], "empty.jsonl")
    proc = _cli(str(empty))
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1].startswith("FAIL: no run in the trace")
    proc = _cli(str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "cannot read trace" in proc.stderr


def test_outrate_check_trace_is_the_same_command(tmp_path):
    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    good = _write(tmp_path, _lines(*_client_run(0, 0, "a"), header=FAST_HEADER))
    result = CliRunner().invoke(main, ["check-trace", str(good)])
    assert result.exit_code == 0 and result.output.splitlines()[-1] == "OK: every check passed in 1 run(s)"
    bad = _write(
        tmp_path,
        _lines(_step(0, 0, {"a": ("u", 1, True, False), "b": ("u", 1, True, False), "c": ("u", 1, True, False)})),
        "bad.jsonl",
    )
    result = CliRunner().invoke(main, ["check-trace", str(bad)])
    assert result.exit_code == 1 and "FAIL: 2 violation(s)" in result.output


def test_trace_path_under_a_regular_file_is_refused_at_start_up(tmp_path):
    # It used to pass validation and crash the engine core in os.makedirs (FileExistsError,
    # buried in the engine-core log) after vLLM had started.
    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(OutputRateConfigError, match="exists and is not a directory") as err:
        parse_output_rate({"default_tokens_per_s": 10, "trace_path": str(blocker / "t.jsonl")})
    assert "remove it to turn tracing off" in str(err.value)
    with pytest.raises(OutputRateConfigError, match="is a directory, not a file"):
        parse_output_rate({"default_tokens_per_s": 10, "trace_path": str(tmp_path)})
    # Missing parents are still fine: the trace creates them when it opens.
    assert parse_output_rate({"default_tokens_per_s": 10, "trace_path": str(tmp_path / "new" / "t.jsonl")}).trace_path
