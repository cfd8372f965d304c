"""``outrate bench``: the report's structure (no timing thresholds: the machine is shared)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest
from click.testing import CliRunner

from vllm_output_rate.bench import QUICK, throttled_indices
from vllm_output_rate.cli import main


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_throttled_indices_count_and_spread():
    assert throttled_indices(16, 0.0) == set()
    assert len(throttled_indices(16, 0.5)) == 8
    assert len(throttled_indices(1024, 0.9)) == 922
    assert throttled_indices(8, 0.5) == {0, 2, 4, 6}
    assert all(0 <= i < 10 for i in throttled_indices(10, 0.9))


@pytest.mark.slow
def test_bench_quick_json_structure(tmp_path):
    report = tmp_path / "bench.json"
    plot = tmp_path / "scaling.png"
    result = CliRunner().invoke(main, ["bench", "--quick", "--json", str(report), "--plot", str(plot)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(report.read_text())

    rows = data["scheduler"]
    assert isinstance(rows, list)
    expected = {(n, f, m) for n in QUICK.sizes for f in QUICK.fractions for m in QUICK.modes}
    assert {(r["running"], r["throttled_fraction"], r["mode"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert isinstance(r["running"], int) and r["running"] > 0
        assert isinstance(r["throttled_fraction"], float) and 0.0 <= r["throttled_fraction"] < 1.0
        assert r["mode"] in ("sync", "async")
        for key in ("stock_us", "reference_us", "ratio"):
            assert _positive_finite(r[key]), (key, r)
        assert r["throttled_requests"] == round(r["running"] * r["throttled_fraction"])
        # The article-style peer (tests/fixtures/article_style) is timed in the same rounds,
        # with the reference / article-style column (issue 27: <= 0.87 when throttled).
        for key in ("article_us", "article_ratio", "reference_article_ratio"):
            assert _positive_finite(r[key]), (key, r)
        # The control: a second stock scheduler in the same rounds (A/A), the resolution of "ratio".
        assert _positive_finite(r["control_ratio"]), r
        assert r["instances"] == QUICK.instances == 1, r
        # Issue 27: the per-request cost over stock from this row's medians, beside the
        # try_take floor from the limiter part of the same run.
        assert r["per_request_over_stock_us"] == (r["reference_us"] - r["stock_us"]) / r["running"], r
        assert r["try_take_floor_us"] == 1e6 / data["limiter"]["try_take_per_s"], r

    shared = data["shared"]  # R23-R26: a redis-server is started for the run (.ci/run installs it)
    assert shared["skipped"] is None, shared["skipped"]
    assert {(r["running"], r["rate_tokens_per_s"]) for r in shared["rows"]} == {
        (n, rate) for n in QUICK.sizes[:2] for rate in (10**9, 200)
    }
    for r in shared["rows"]:
        for key in ("single_us", "shared_us", "ratio", "tokens_per_s"):
            assert _positive_finite(r[key]), (key, r)
        # At 10^9 tok/s one lease (L = rate x 50 ms) can cover the whole measured window, so
        # no round trip may fall in it; at 200 tok/s (L = 10) the store is asked while it runs.
        binding = r["rate_tokens_per_s"] == 200
        for key in ("round_trips_per_s", "round_trips_per_token"):
            assert _positive_finite(r[key]) if binding else (math.isfinite(r[key]) and r[key] >= 0), (key, r)
        assert r["round_trips_per_token"] < 1  # a lease covers several grants (L >= 10 at these rates)

    limiter = data["limiter"]
    for key in ("try_take_per_s", "try_take_refused_per_s", "refund_per_s"):
        assert _positive_finite(limiter[key]), key
    assert limiter["target_per_s"] == 1e6

    gate = data["gate"]
    checks = {row["check"]: row for row in gate["rows"]}
    for mode in ("sync", "async"):
        row = checks[f"differential/{mode}"]
        assert row["scenarios"] == QUICK.gate_scenarios
        assert _positive_finite(row["steps_per_s"])
    # Spec-only and model-checker rates are measured when those exist, else skipped with a reason.
    for name in ("spec-only", "model-checker"):
        measured = [row for check, row in checks.items() if check.startswith(name)]
        reasons = [why for check, why in gate["skipped"].items() if check.startswith(name)]
        assert measured or reasons, name
        assert all(why.startswith("not ") for why in reasons), reasons
        for row in measured:
            assert _positive_finite(row.get("steps_per_s", row.get("states_per_s"))), row

    import vllm

    assert data["vllm_version"] == vllm.__version__  # the installed release (0.32.0 or 0.33.0)
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert data["command"].startswith("outrate bench --quick")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_live_throughput_summary_takes_a_round_whose_engine_cpu_did_not_move():
    # A short round can read 0 µs of CPU per token for an engine (its processes' CPU time
    # did not tick): the per-round CPU ratios skip it instead of dividing by 0, which made
    # the live bench part fail (ZeroDivisionError) on a fresh clone's make test.
    from vllm_output_rate.livebench import _throughput_summary

    rates = {"off": [100.0, 110.0], "on": [99.0, 108.0], "on_spin": [98.0, 109.0]}
    cpu_us = {"off": [500.0, 520.0], "on": [510.0, 530.0], "on_spin": [0.0, 530.0]}
    summary = _throughput_summary(rates, cpu_us, 2, 4, 8)
    assert summary["worker_fix_cpu_ratio"] == 1.0  # only the second round counts
    assert summary["engine_cpu_ratio"] == statistics.median([510 / 500, 530 / 520])
    none = _throughput_summary(rates, cpu_us | {"on_spin": [0.0, 0.0]}, 2, 4, 8)
    assert none["worker_fix_cpu_ratio"] is None


@pytest.mark.slow
def test_scheduler_row_per_request_cost_and_try_take_floor_come_from_the_run():

    from vllm_output_rate.bench.render import _scheduler_table
    from vllm_output_rate.bench.scheduler import measure_scheduler, set_try_take_floor

    plan = replace(QUICK, rounds=2, steps_per_round=2)
    rows = [measure_scheduler(8, 0.5, "sync", plan, lambda: None)]
    row = rows[0]
    assert row.per_request_over_stock_us == (row.reference_us - row.stock_us) / row.running
    assert row.try_take_floor_us is None  # set once per run, after the scheduler part

    # The limiter part ran: its try_take/s is the floor, for every row.
    assert set_try_take_floor(rows, {"try_take_per_s": 2_500_000.0}) == 0.4
    assert row.try_take_floor_us == 0.4
    # It did not: a short try_take run of the reference limiter measures one.
    floor = set_try_take_floor(rows, None)
    assert _positive_finite(floor) and row.try_take_floor_us == floor

    table = _scheduler_table(rows, "cpu")
    headers = [column.header for column in table.columns]
    assert headers[-2:] == ["per request over stock µs", "try_take floor µs"]
    control = headers.index("stock / stock (control)")
    assert list(table.columns[control].cells) == [f"{row.control_ratio:.3f}"]
    assert "reference / article-style" in headers
    assert list(table.columns[-1].cells) == [f"{floor:.3f}"]
    assert list(table.columns[-2].cells) == [f"{row.per_request_over_stock_us:+.2f}"]


@pytest.mark.slow
def test_every_scheduler_runs_in_a_process_of_its_own_the_control_being_stock_again():
    # An engine core runs one scheduler class; the bench runs every scheduler in a fresh
    # process of its own (bench/processes.py), Plan.instances per kind. The A/A control is
    # built like stock (same class, same requests, feature off), so control / stock
    # measures only the bench's resolution.
    import os

    from vllm_output_rate.bench.scheduler import SchedulerKinds

    plan = replace(QUICK, rounds=2, steps_per_round=2, instances=1)
    with SchedulerKinds(1) as kinds:
        assert kinds.build(8, 0.5, False, plan, "cpu") == 4
        seen = {kind: [process.call("describe") for process in group] for kind, group in kinds.processes.items()}
        timed = kinds.run("reference", 0, 2, 1)
        assert len(timed) == 2 and min(timed) > 0 and kinds.throttled("reference", 0) == 4
        with pytest.raises(ValueError, match=r"hold 1 scheduler\(s\) of each kind, the plan asks for 3"):
            from vllm_output_rate.bench.scheduler import measure_scheduler

            measure_scheduler(8, 0.5, "sync", replace(plan, instances=3), lambda: None, kinds=kinds)
        # Plan.rebuild_each_round: a new scheduler in every process before every round
        # after the first (rounds=2: the cell's build and one more), warmed up as the first.
        row = measure_scheduler(8, 0.5, "sync", replace(plan, rebuild_each_round=True), lambda: None, kinds=kinds)
        assert row.throttled_requests == 4 and row.rounds == 2
        # At turn 0 process s holds slot s (kind s % kinds); at every other turn the slots
        # go to the processes in a drawn order (the same every run), each process holding
        # what SchedulerKinds.processes says.
        size = len(kinds.pool)
        assert size == len(kinds.kinds) == len(seen)
        assert kinds.assignment(0) == list(range(size))
        turns = [kinds.assignment(t) for t in range(1, 9)]
        assert all(sorted(a) == list(range(size)) for a in turns) and len({tuple(a) for a in turns}) > 1
        assert turns == [kinds.assignment(t) for t in range(1, 9)]
        looks = {kind: (group[0][0]["class"], group[0][0]["limited"]) for kind, group in seen.items()}
        for turn in range(3):
            assert kinds.build(8, 0.5, False, plan, "cpu", turn) == 4
            held = [p.call("describe")[0] for p in kinds.pool]
            for k, kind in enumerate(kinds.kinds):
                process = kinds.assignment(turn)[k]
                assert kinds.processes[kind] == [kinds.pool[process]]
                assert (held[process]["class"], held[process]["limited"]) == looks[kind]
    assert [d["build"] for d in held] == [6] * size  # the test's build, the cell's two, the turns'
    assert {d["build"] for group in seen.values() for described in group for d in described} == {1}
    assert set(seen) >= {"stock", "reference", "control"}
    pids = [d["pid"] for group in seen.values() for described in group for d in described]
    assert len(pids) == len(seen) and len(set(pids)) == len(pids) and os.getpid() not in pids
    requests = seen["stock"][0][0]["requests"]
    for kind, group in seen.items():
        assert len(group) == 1 and all(len(described) == 1 for described in group)
        looks = {(described[0]["class"], described[0]["limited"]) for described in group}
        if kind in ("stock", "control"):
            assert looks == {("Scheduler", False)}
        elif kind == "reference":
            assert looks == {("RateLimitedScheduler", True)}
        assert all(described[0]["requests"] == requests for described in group)


@pytest.mark.slow
def test_a_kind_that_cannot_be_built_is_named_in_the_error():
    from vllm_output_rate.bench.processes import KindProcess
    from vllm_output_rate.bench.scheduler import kind_options

    process = KindProcess("reference")
    options = {**kind_options("reference", 2, 0.0, False, QUICK, "cpu"), "cls_path": "no.such.Scheduler"}
    try:
        with pytest.raises(RuntimeError, match=r"reference scheduler: .*no\.such"):
            process.call("build", options)
        assert process.call("describe") == []  # the process still answers
    finally:
        process.close()
    with pytest.raises(ValueError, match="unknown scheduler kind 'peer'"):
        kind_options("peer", 8, 0.0, False, QUICK, "cpu")


class _FixedKinds:
    """A stand-in for ``SchedulerKinds``: every scheduler "takes" a fixed time per step,
    except the steps ``slow`` names ((kind, index) -> seconds of its first steps)."""

    def __init__(
        self, seconds: dict[str, list[float]], throttled: int, slow: dict[tuple[str, int], list[float]] | None = None
    ) -> None:
        self.processes = dict.fromkeys(seconds)
        self.seconds = seconds
        self.slow = slow or {}
        self.steps: dict[tuple[str, int], int] = {}
        self.throttled_requests = throttled
        self.rewarms: set[int] = set()

    def run(self, kind: str, index: int, steps: int, rewarm: int = 0) -> list[float]:
        self.steps[kind, index] = self.steps.get((kind, index), 0) + steps
        self.rewarms.add(rewarm)
        timed = [self.seconds[kind][index]] * steps
        first = self.slow.get((kind, index), [])
        timed[: len(first)] = first
        return timed

    def throttled(self, kind: str, index: int) -> int:
        return self.throttled_requests


def test_each_kind_is_the_median_of_its_instances_timed_in_the_same_rounds():
    # Plan.instances schedulers of each kind, each stepped the same number of steps in every
    # round; a kind's per-round value is the median over its instances, so one process that
    # reads slow (or fast) in every round does not move its kind (the mean would: stock
    # 1.4, reference 2.1 below).
    from vllm_output_rate.bench import scheduler as bench_scheduler
    from vllm_output_rate.bench.common import FULL
    from vllm_output_rate.bench.common import MAX_WARMUP_STEPS as FULL_MAX_WARMUP_STEPS

    assert FULL.instances == 3 and QUICK.instances == 1
    plan = replace(QUICK, rounds=3, steps_per_round=2, instances=3, rewarm_steps=4)
    seconds = {"stock": [1.0, 1.0, 2.2], "reference": [2.0, 0.3, 4.0], "control": [1.0, 3.0, 1.5]}
    kinds = _FixedKinds(seconds, throttled=0)
    medians = bench_scheduler._timed_rounds(kinds, 0, plan, 5, lambda: None)
    assert medians == {"stock": [1.0] * 3, "reference": [2.0] * 3, "control": [1.5] * 3}
    assert kinds.steps == {(kind, i): 15 for kind in ("stock", "reference", "control") for i in (0, 1, 2)}
    assert kinds.rewarms == {4}  # every round of every scheduler starts with the untimed steps
    # The requests' max_tokens cover the untimed steps too.
    total = bench_scheduler.kind_options("reference", 8, 0.0, False, plan, "cpu")["total_steps"]
    assert total == FULL_MAX_WARMUP_STEPS + 3 * (plan.steps_for(8) + 4) + 8
    with pytest.raises(RuntimeError, match=r"throttled requests drifted .*\[0\], planned 4"):
        bench_scheduler._timed_rounds(kinds, 4, plan, 5, lambda: None)


def test_a_few_slow_steps_move_the_block_means_and_not_the_median_step():
    # The shared machine slows the steps of one stretch and not the next: two steps of one
    # stock scheduler taking 10x and 6x (as if the host stalled) raise that scheduler's
    # mean step, and so stock's value with the old statistic (median over schedulers of
    # each one's mean step; reference / stock reads 0.5 instead of 1.0), but the median of
    # the pooled steps stays at the steady step's time.
    from vllm_output_rate.bench import scheduler as bench_scheduler

    plan = replace(QUICK, rounds=2, steps_per_round=5, instances=3)
    seconds = {"stock": [1.0, 1.0, 1.0], "reference": [1.0, 1.0, 1.0], "control": [1.0, 1.0, 1.0]}
    slow = {("stock", 0): [10.0, 6.0], ("stock", 1): [3.0, 4.0]}
    means: dict[str, list[float]] = {}
    medians = bench_scheduler._timed_rounds(_FixedKinds(seconds, 0, slow), 0, plan, 5, lambda: None, None, means)
    assert medians == {kind: [1.0, 1.0] for kind in seconds}
    assert means["stock"] == [2.0, 2.0]  # the schedulers' means 3.8, 2.0, 1.0
    assert means["reference"] == means["control"] == [1.0, 1.0]
    assert bench_scheduler._median_ratio(means["reference"], means["stock"]) == 0.5


def test_rebuild_each_round_builds_a_new_scheduler_before_every_round_after_the_first():
    # One scheduler can read 2-4% slow or fast in every round it is timed, and the next one
    # built in the same process not (docs/PERFORMANCE.md, "How the bench measures"): with
    # Plan.rebuild_each_round every round after the first starts with new schedulers, so
    # that reading is a per-round draw; a rebuild that plans other throttled requests is
    # an error, not a changed cell.
    from vllm_output_rate.bench import scheduler as bench_scheduler
    from vllm_output_rate.bench.common import FULL

    assert FULL.rebuild_each_round and not QUICK.rebuild_each_round
    plan = replace(QUICK, rounds=4, steps_per_round=2, instances=1)
    seconds = {"stock": [1.0], "reference": [2.0], "control": [1.0]}
    kinds = _FixedKinds(seconds, throttled=3)
    events: list[str] = []
    run = kinds.run

    def logged_run(kind: str, index: int, steps: int, rewarm: int = 0) -> float:
        events.append("run")
        return run(kind, index, steps, rewarm)

    def rebuild(turn: int) -> int:
        events.append(f"build {turn}")
        return 3

    kinds.run = logged_run  # type: ignore[method-assign]
    medians = bench_scheduler._timed_rounds(kinds, 3, plan, 5, lambda: None, rebuild)
    assert medians == {"stock": [1.0] * 4, "reference": [2.0] * 4, "control": [1.0] * 4}
    assert events == ["run"] * 3 + [e for k in (1, 2, 3) for e in [f"build {k}"] + ["run"] * 3]
    with pytest.raises(RuntimeError, match="a rebuilt scheduler planned 5 throttled requests, the first 3"):
        bench_scheduler._timed_rounds(kinds, 3, plan, 5, lambda: None, lambda turn: 5)


def test_profile_throttled_profiles_the_reference_and_the_article_style_peer(tmp_path):
    # Issue 27, "say where the rest goes": with requests throttled, both schedulers' steps
    # (schedule() and update_from_output()) under cProfile, and the ratio of their totals.
    report = tmp_path / "profile.json"
    args = ["bench", "--quick", "--profile", "8", "--profile-throttled", "0.5", "--json", str(report)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(report.read_text())
    ref, peer = data["profile"], data["peer_profile"]
    assert ref["scheduler"] == "RateLimitedScheduler" and peer["scheduler"] == "ArticleScheduler"
    for prof in (ref, peer):
        assert prof["calls"] == "schedule+update_from_output" and prof["throttled_fraction"] == 0.5
        assert _positive_finite(prof["total_us_per_step"])
    assert data["reference_peer_ratio"] == ref["total_us_per_step"] / peer["total_us_per_step"]
    assert any("reference/" in r["function"] for r in ref["project_cumulative"])
    assert any("article_style/" in r["function"] for r in peer["project_cumulative"])
    assert not any("article_style/" in r["function"] for r in ref["project_cumulative"])
    assert "--profile 8 --profile-throttled 0.5" in data["command"]


def test_profile_throttled_without_profile_is_refused_naming_the_value():
    result = CliRunner().invoke(main, ["bench", "--profile-throttled", "0.5"])
    assert result.exit_code == 2
    assert "--profile-throttled 0.5 needs --profile N" in result.output


def test_rounds_are_sized_by_work_within_the_model_context():
    # A round holds about 4096 request-steps (64 steps at 16 and 64 running, 16 at 256 and
    # 1024), never fewer than steps_per_round, and the timed steps of all rounds stay
    # within MAX_TIMED_STEPS (the requests' max_tokens must fit the tiny model) whatever
    # --rounds asks; --quick keeps its 2-step rounds.
    from vllm_output_rate.bench.common import FULL, MAX_TIMED_STEPS

    assert [FULL.steps_for(n) for n in (16, 64, 256, 1024)] == [64, 64, 16, 16]
    assert [replace(FULL, rounds=11).steps_for(n) for n in (64, 128, 256)] == [64, 32, 16]
    for rounds in (1, 11, 41, 50, 100, 200):
        plan = replace(FULL, rounds=rounds)
        for n in (1, 8, 16, 64, 256, 1024):
            steps = plan.steps_for(n)
            assert steps >= plan.steps_per_round
            assert rounds * (steps + plan.rewarm_steps) <= max(MAX_TIMED_STEPS, rounds * (plan.steps_per_round + 8))
    assert QUICK.steps_for(8) == 2
