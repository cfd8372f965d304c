"""R27-R29: rate tables of real size (reference/ratetable.py): plans, prefix patterns,
unlimited users, per-plan shadow, the reload off the step and the bounded /metrics."""

from __future__ import annotations

import json
import os
import threading
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.feature_off import first_difference
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, Harness
from vllm_output_rate.adapter.not_binding import not_binding_scenarios
from vllm_output_rate.adapter.scenarios import feature_off
from vllm_output_rate.reference import metrics, ratesfile
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.limiter import UNLIMITED_GRANTS, OutputRateLimiter
from vllm_output_rate.reference.ratesfile import MAX_RATES_FILE_BYTES, RatesFileWatcher, parse_rates_file
from vllm_output_rate.reference.ratetable import MAX_DETAILED, OTHER
from vllm_output_rate.reference.section import OutputRateConfigError

MS = 1_000_000
PLANS = {
    "free": {"tokens_per_s": 20},
    "pro": {"tokens_per_s": 200},
    "trial": {"tokens_per_s": 5, "shadow": True},
    "internal": {"unlimited": True},
}


def table_text(**extra) -> str:
    return json.dumps({"default_plan": "free", "plans": PLANS, **extra})


@pytest.mark.rules("R27")
def test_r27_most_specific_entry_wins_exact_then_longest_prefix_then_default() -> None:
    table = parse_rates_file(
        table_text(
            users={
                "team-a/*": "pro",
                "team-a/ops/*": "internal",
                "team-a/ops/bob": {"tokens_per_s": 7},
                "carol": {"plan": "pro", "tokens_per_s": 300, "detailed": True},
            },
            user_tokens_per_s={"dave": 75},
        )
    )
    assert table.rate_of("team-a/x") == 200 and table.lookup("team-a/x").label == "pro"
    assert table.rate_of("team-a/ops/eve") is None  # the longer prefix wins: unlimited
    assert table.rate_of("team-a/ops/bob") == 7  # the exact user wins over both prefixes
    assert table.rate_of("team-b/x") == 20 and table.lookup("team-b/x").label == "free"  # the default plan
    assert table.rate_of("carol") == 300 and table.lookup("carol").label == "carol"  # detailed: its own label
    assert table.rate_of("dave") == 75 and table.lookup("dave").label == "dave"  # today's form, labelled
    assert table.lookup("team-a/x") is table.lookup("team-a/x")  # cached per user id
    limiter = OutputRateLimiter(None, table=table)
    assert [limiter.rate_of(u) for u in ("team-a/x", "team-a/ops/bob", "zed")] == [200, 7, 20]


@pytest.mark.rules("R21", "R27")
def test_r27_todays_two_keys_stay_valid() -> None:
    table = parse_rates_file('{"default_tokens_per_s": 2.5, "user_tokens_per_s": {"a": 7}}')
    assert table.is_flat and table.default_rate == Fraction(5, 2) and table.user_rates == {"a": 7}
    assert table.rate_of("a") == 7 and table.rate_of("b") == Fraction(5, 2)
    assert parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 3}}).user_rates == {"a": 3}


@pytest.mark.rules("R27")
@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"users": {"alice": "gold"}}, "users['alice']: plan 'gold' is not in plans"),
        ({"users": {"alice": {"plan": "prp"}}}, "(did you mean 'pro'?)"),
        (
            {"users": {"alice": "pro"}, "user_tokens_per_s": {"alice": 5}},
            "user_tokens_per_s['alice'] and users['alice'] both name user 'alice' (a tie",
        ),
        ({"default_tokens_per_s": 5}, "default_tokens_per_s and default_plan both give the default (a tie)"),
        ({"plans": {"x": {"tokens_per_s": 5, "unlimited": True}}}, "plans['x']: an unlimited plan has no rate"),
        ({"users": {"team-*-a": "pro"}}, "users['team-*-a']: a pattern is a prefix followed by one '*'"),
        ({"users": {"*": "pro"}}, "users['*']: a pattern is a prefix"),
        ({"users": {"*team": "pro"}}, "users['*team']: a pattern is a prefix"),
        ({"users": {"bob": {"tokens_per_s": 5, "unlimited": True}}}, "users['bob']: an unlimited user has no rate"),
        ({"users": {"bob": {"plan": "pro", "detaled": True}}}, "'detaled' (did you mean 'detailed'?)"),
        ({"users": {"bob": {"tokens_per_s": 0}}}, "users['bob'].tokens_per_s must be > 0"),
        ({"plans": {"other": {"tokens_per_s": 1}}}, "plans['other']: 'other' and names with '*' are reserved"),
        ({"users": {"team/*": {"plan": "pro", "detailed": True}}}, "a pattern has no /metrics label"),
        ({"default_plan": "gold"}, "default_plan 'gold' is not in plans"),
    ],
)
def test_r27_bad_entries_are_refused_naming_the_entry(table, message) -> None:
    data = {"default_plan": "free", "plans": {**PLANS, **table.pop("plans", {})}, **table}
    with pytest.raises(OutputRateConfigError) as caught:
        parse_rates_file(json.dumps(data), "r.json")
    assert str(caught.value).startswith("rates file r.json: ")
    assert message in str(caught.value), str(caught.value)


@pytest.mark.rules("R21", "R27")
def test_r27_a_bad_file_keeps_the_table_in_force_and_names_the_entry(tmp_path) -> None:
    path = tmp_path / "rates.json"
    path.write_text(table_text(users={"alice": "pro"}))
    lines: list[str] = []
    logger = type("L", (), {"error": lambda self, f, *a: lines.append(f % a), "warning": lambda *a: None})()
    watcher = RatesFileWatcher(str(path), logger=logger, burst_ns=100 * MS)
    limiter = OutputRateLimiter(None, table=watcher.load_initial())
    in_force = limiter.table
    bad = [
        table_text(users={"alice": "gold"}),
        table_text(users={"alice": "pro"}, user_tokens_per_s={"alice": 1}),
        table_text(plans={**PLANS, "x": {"tokens_per_s": 1, "unlimited": True}}),
        table_text(users={"a*b": "pro"}),
    ]
    for i, text in enumerate(bad):
        (tmp_path / "t").write_text(text + " " * i)
        (tmp_path / "t").replace(path)
        assert watcher.poll() is None
        assert limiter.table is in_force and limiter.rate_of("alice") == 200
    assert [
        next(k for k in ("'gold'", "a tie", "unlimited plan has no rate", "users['a*b']") if k in line)
        for line in lines
    ] == ["'gold'", "a tie", "unlimited plan has no rate", "users['a*b']"]
    assert all("limits in force are kept" in line for line in lines)
    with open(tmp_path / "t", "w") as handle:  # over the size limit: refused before it is read
        handle.truncate(MAX_RATES_FILE_BYTES + 1)
    (tmp_path / "t").replace(path)
    assert watcher.poll() is None and watcher.wait_ready(30)
    assert watcher.poll() is None and f"> {MAX_RATES_FILE_BYTES}" in lines[-1]


def _json_values():
    rates = st.one_of(st.integers(-2, 10**10), st.floats(allow_nan=True), st.just("unlimited"), st.booleans())
    keys = st.sampled_from(["free", "pro", "gold", "a", "a*", "*", "team/*", "x*y", "other", "", "detailed"])
    entry = st.one_of(
        st.sampled_from(["free", "pro", "gold", 3]),
        st.dictionaries(
            st.sampled_from(["plan", "tokens_per_s", "unlimited", "detailed", "shadow", "x"]), rates | keys
        ),
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "default_tokens_per_s": rates,
            "default_plan": keys,
            "plans": st.dictionaries(keys, st.one_of(entry, rates)),
            "users": st.dictionaries(keys, st.one_of(entry, rates)),
            "user_tokens_per_s": st.dictionaries(keys, rates),
            "burst_ms": st.integers(),
            "plan": st.just(1),
        },
    )


@pytest.mark.rules("R27", "R28", "R29")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(_json_values(), st.text(max_size=40), st.lists(st.integers(), max_size=3)))
def test_r27_loader_fuzz_accepts_or_raises_the_config_error_and_never_changes_the_table(data) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    in_force = parse_rates_file(table_text(users={"alice": "pro"}))
    limiter = OutputRateLimiter(None, table=in_force)
    try:
        table = parse_rates_file(text, "f.json")
    except OutputRateConfigError as exc:
        assert str(exc).startswith("rates file f.json: ") and len(str(exc)) > len("rates file f.json: ")
        assert limiter.table is in_force and limiter.rate_of("alice") == 200
        return
    # Accepted: every user resolves to a rate or unlimited, and the table installs.
    for user in ("alice", "a", "team/x", "zz"):
        entry = table.lookup(user)
        assert entry.rate is None or entry.rate > 0
    limiter.install(table.prepare(100 * MS).enforced, 0)
    assert limiter.table is table


@pytest.mark.rules("R28")
def test_r28_unlimited_user_holds_no_tat_and_has_nothing_to_refund() -> None:
    table = parse_rates_file(table_text(users={"svc": {"unlimited": True}, "bob": "pro"}))
    limiter = OutputRateLimiter(None, table=table)
    assert limiter.grants_at("svc", 0) == UNLIMITED_GRANTS and limiter.try_take("svc", 0)
    limiter.take_counts({"svc": 10**6, "bob": 2}, 0)
    limiter.refund("svc")  # nothing to refund: no KeyError
    assert "svc" not in limiter.users() and limiter.tat_ns("svc") is None and limiter.ready_at_ns("svc") is None
    assert limiter.tat_ns("bob") == 10 * MS  # 2 tokens at 200 tok/s
    # bob becomes unlimited: its TAT is dropped; then limited again: it starts idle (R6).
    limiter.install(parse_rates_file(table_text(users={"bob": "internal"})).prepare(100 * MS).enforced, 1)
    assert "bob" not in limiter.users() and limiter.is_unlimited("bob")
    limiter.install(parse_rates_file(table_text(users={"bob": "pro"})).prepare(100 * MS).enforced, 2)
    assert limiter.grants_at("bob", 2) == 21 and limiter.grants_at("new", 2) == 3  # idle: a full burst at 200 tok/s


def _unlimited_rates_file(tmp_path) -> dict:
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"default_plan": "internal", "plans": {"internal": {"unlimited": True}}}))
    return {"rates_file": str(path)}


@pytest.mark.rules("R28", "R19")
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.slow
def test_r28_every_user_unlimited_is_stock_step_for_step(tmp_path_factory, data) -> None:
    # The scenarios' own rates bind (the gate's ample and pressured shapes, 1-10 tok/s);
    # the rates file makes everyone unlimited: the schedule must be stock vLLM's.
    async_mode = data.draw(st.booleans())
    scenario = data.draw(not_binding_scenarios(async_mode, 30))
    extra = _unlimited_rates_file(tmp_path_factory.mktemp("unl"))
    from dataclasses import replace

    scenario = replace(scenario, feature_on=True, default_rate_tokens_per_s="1", rates_tokens_per_s={})
    cls = REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER
    steps, difference = first_difference(cls, scenario, feature_off(scenario), None, extra)
    assert difference is None, difference
    assert steps > 0


@pytest.mark.rules("R28")
def test_r28_unlimited_users_are_never_throttled_and_their_tokens_counted(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(metrics.ENV_OWNER, "1")
    path = tmp_path / "rates.json"
    path.write_text(table_text(users={"svc": {"unlimited": True, "detailed": True}, "slow": {"tokens_per_s": 10}}))
    h = Harness(
        REFERENCE_SCHEDULER,
        EngineShape(max_num_seqs=4, output_rate={"default_tokens_per_s": 1, "rates_file": str(path)}),
    )
    for i in range(2):
        h.add_request(f"s{i}", "svc", prompt_len=4, max_tokens=40)
    h.add_request("w0", "slow", prompt_len=4, max_tokens=40)
    svc_tokens = slow_tokens = 0
    for _ in range(20):
        trace = h.step()
        h.advance(10 * MS)
        assert not any(rid.startswith("s") for rid in trace.white["throttled"])
        svc_tokens += sum(1 for rid in trace.sampled if rid.startswith("s"))
        slow_tokens += sum(1 for rid in trace.sampled if rid.startswith("w"))
    assert svc_tokens == 40 and slow_tokens <= 4  # 2 streams x 20 steps; 10 tok/s over 200 ms + burst
    assert "svc" not in h.scheduler.rate_limiter.users()
    h.scheduler._observation.metrics.write(h.clock.now_ns(), h.scheduler.rate_limiter)
    snap = json.loads(next(tmp_path.glob("engine-*.json")).read_text())
    assert snap["labels"]["svc"]["granted"] == 40 and snap["labels"]["svc"]["limit_tokens_per_second"] == float("inf")


def _two_plan_run(tmp_path, trial: dict, events) -> tuple[list, Harness]:
    path = tmp_path / f"rates-{len(list(tmp_path.iterdir()))}.json"
    plans = {"basic": {"tokens_per_s": 20}, "trial": trial}
    path.write_text(json.dumps({"default_plan": "basic", "plans": plans, "users": {"t*": "trial"}}))
    h = Harness(
        REFERENCE_SCHEDULER,
        EngineShape(
            max_num_seqs=6, max_num_batched_tokens=32, output_rate={"default_tokens_per_s": 1, "rates_file": str(path)}
        ),
    )
    batches = []
    for step, adds in enumerate(events):
        for rid, user, prompt, tokens in adds:
            h.add_request(rid, user, prompt_len=prompt, max_tokens=tokens)
        trace = h.step()
        batches.append((list(trace.scheduled.items()), sorted(trace.white["throttled"])))
        h.advance(10 * MS if step % 3 else 30 * MS)
    return batches, h


_request = st.tuples(st.sampled_from(["t1", "t2", "b1", "b2"]), st.integers(1, 40), st.integers(1, 30))


@pytest.mark.rules("R29")
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arrivals=st.lists(st.lists(_request, max_size=2), min_size=5, max_size=25),
    rate=st.sampled_from([1, 3, 7.5, 40]),
)
@pytest.mark.slow
def test_r29_enforced_users_schedule_does_not_depend_on_the_shadow_plan(tmp_path_factory, arrivals, rate) -> None:
    # Plan "trial" in shadow at `rate` against the same plan unlimited: the same schedule,
    # step for step (the enforced "basic" users' grants and throttles included), and the
    # shadow accounting counts would-be throttles of trial users only.
    events, n = [], 0
    for adds in arrivals:
        events.append([(f"r{(n := n + 1)}", user, prompt, tokens) for user, prompt, tokens in adds])
    events += [[]] * 20
    tmp = tmp_path_factory.mktemp("shadow")
    shadow, h = _two_plan_run(tmp, {"tokens_per_s": rate, "shadow": True}, events)
    unlimited, _ = _two_plan_run(tmp, {"unlimited": True}, events)
    assert shadow == unlimited
    plan_shadow = h.scheduler._limits.plan_shadow
    assert plan_shadow is not None and all(u.startswith("t") for u in plan_shadow.step_dispatches)
    assert all(h.scheduler._limits.users.get(rid, "t").startswith("t") for rid in plan_shadow.last_would)


@pytest.mark.rules("R29")
def test_r29_shadow_plan_counts_would_be_throttles_in_metrics(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(metrics.ENV_OWNER, "1")
    events = [[("r1", "t1", 4, 60), ("r2", "t1", 4, 60), ("r3", "b1", 4, 60)]] + [[]] * 30
    _, h = _two_plan_run(tmp_path, {"tokens_per_s": 5, "shadow": True}, events)
    h.scheduler._observation.metrics.write(h.clock.now_ns(), h.scheduler.rate_limiter)
    snap = json.loads(next(tmp_path.glob("engine-*.json")).read_text())["labels"]
    assert snap["trial"]["throttled_request_steps"] > 20  # would-be throttles, counted
    assert snap["trial"]["granted"] == h.num_outputs["r1"] + h.num_outputs["r2"] > 50  # nothing throttled
    assert snap["basic"]["throttled_request_steps"] > 0  # basic (20 tok/s) is enforced


@pytest.mark.rules("R21", "R27")
def test_r21_a_large_table_is_read_and_validated_off_the_step(tmp_path, monkeypatch) -> None:
    path = tmp_path / "rates.json"
    watcher = RatesFileWatcher(str(path), burst_ns=100 * MS)
    readers: list[str] = []
    real = ratesfile.parse_rates_file

    def spy(text, where="rates file"):
        readers.append(threading.current_thread().name)
        return real(text, where)

    monkeypatch.setattr(ratesfile, "parse_rates_file", spy)
    path.write_text('{"default_tokens_per_s": 3}')
    assert watcher.poll().default_rate == 3 and readers == ["MainThread"]  # small: in the step
    users = {f"user-{i:05d}": "pro" for i in range(5000)}
    path.write_text(table_text(users={**users, "team/*": "internal"}))
    assert watcher.poll() is None  # handed to the watcher thread
    assert watcher.wait_ready(60)
    table = watcher.poll()  # ready: an O(1) hand-over
    assert readers == ["MainThread"]  # parsed by the reader process, not in this one
    assert table.rate_of("user-04999") == 200 and table.rate_of("team/x") is None and table.rate_of("z") == 20
    assert table.lookup("user-00001").source == "users" and table.labels == tuple(PLANS)
    assert table.signature == ratesfile._signature(path.stat())
    assert table._prepared is not None and table._prepared.burst_ns == 100 * MS  # prepared by the thread
    assert watcher.poll() is None and watcher.reloads == 2
    path.write_text(table_text(users={**users, "bad": "gold"}))
    assert watcher.poll() is None and watcher.wait_ready(60) and watcher.poll() is None  # refused there
    assert watcher.errors == 1


@pytest.mark.rules("R21")
def test_r21_a_failed_reader_process_is_retried_and_the_table_comes_in_force(tmp_path, monkeypatch) -> None:
    # The watcher thread's work failed once (the reader process could not be started, as
    # with EFAULT below): the thread must neither die nor give that version of the file up.
    path = tmp_path / "rates.json"
    watcher = RatesFileWatcher(str(path), burst_ns=100 * MS)
    watcher.retry_s = 0.01
    real, calls = ratesfile.subprocess.Popen, []

    def flaky(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) <= 2:  # the start-up reader (retired marker), then the first read
            raise OSError(14, "Bad address")
        return real(*args, **kwargs)

    monkeypatch.setattr(ratesfile.subprocess, "Popen", flaky)
    users = {f"user-{i:05d}": "pro" for i in range(3000)}
    path.write_text(table_text(users=users))
    assert watcher.poll() is None  # large: handed to the watcher thread
    assert watcher.wait_ready(60)
    table = watcher.poll()
    assert table is not None and table.rate_of("user-02999") == 200
    assert watcher.failures == 2 and watcher.errors == 0 and watcher._thread.is_alive()
    path.write_text(table_text(users={**users, "user-x": "free"}))  # the next version still loads
    assert watcher.poll() is None and watcher.wait_ready(60)
    assert watcher.poll().rate_of("user-x") == 20 and watcher.failures == 2


@pytest.mark.rules("R21")
def test_r21_the_reader_process_starts_while_another_thread_changes_the_environment(tmp_path) -> None:
    # Without an explicit env=, the reader's exec reads the C library's environ while this
    # thread reallocates it (os.environ grows): "[Errno 14] Bad address" in about 1 start
    # in 5 here. The watcher passes a copy of os.environ.
    path = tmp_path / "rates.json"
    path.write_text(table_text(users={f"user-{i:05d}": "pro" for i in range(3000)}))
    watcher = RatesFileWatcher(str(path))
    failed: list[OSError] = []

    def starts() -> None:
        for _ in range(20):
            try:
                watcher._reader_process()
            except OSError as exc:
                failed.append(exc)
            watcher._stop_reader()

    added: list[str] = []
    thread = threading.Thread(target=starts)
    thread.start()
    try:
        while thread.is_alive():
            added.append(f"OUTRATE_TEST_ENV_{len(added)}")
            os.environ[added[-1]] = "x"
            if len(added) % 5000 == 0:
                for key in added[-5000:]:
                    os.environ.pop(key, None)
    finally:
        thread.join()
        for key in added:
            os.environ.pop(key, None)
    assert failed == []


@pytest.mark.rules("R27")
def test_r27_metrics_series_stay_bounded_at_100000_users(tmp_path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    n = 100_000
    users = {f"user-{i:06d}": ("pro" if i % 3 else "free") for i in range(n)}
    for i in range(0, 2000, 2):  # 1,000 detailed users
        users[f"user-{i:06d}"] = {"plan": "pro", "detailed": True}
    patterns = {f"team-{i:04d}/*": "internal" for i in range(1000)}
    table = parse_rates_file(table_text(users={**users, **patterns}, user_tokens_per_s={"x": 1}))
    recorder = metrics.MetricsRecorder(str(tmp_path), table.user_rates, Fraction(1), table=table)
    limiter = OutputRateLimiter(None, table=table)
    every = [*users, *(f"team-{i:04d}/u" for i in range(1000)), "stranger", "x"]
    recorder.step(10**9, dict.fromkeys(every, 1), [], lambda rid: rid, (), limiter)
    recorder.step(2 * 10**9, dict.fromkeys(every[:5000], 1), every[:3000], lambda rid: rid, (), limiter)
    assert recorder.flush()
    registry = CollectorRegistry()
    registry.register(metrics.OutputRateCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    series = [line for line in text.splitlines() if line.startswith("vllm:output_rate_")]
    plans, detailed = len(PLANS), 1000 + 1  # the detailed users and x (today's form: a label of its own)
    assert len(series) <= 6 * (plans + detailed + 1) + 3, len(series)
    granted = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in series
        if line.startswith("vllm:output_rate_granted_tokens_total{")
    }
    assert sum(granted.values()) == len(every) + 5000  # every token counted, summed into its label
    assert granted["internal"] == 1000 and granted[OTHER] == 0 and granted["free"] > 30_000
    assert MAX_DETAILED == 1024


_ids = st.text(alphabet="ab/-", min_size=1, max_size=5)


@pytest.mark.rules("R27", "R29")
@settings(max_examples=200, deadline=None)
@given(
    exact=st.dictionaries(_ids, st.sampled_from(["free", "pro", "trial", "internal"]), max_size=4),
    prefixes=st.dictionaries(_ids, st.sampled_from(["free", "pro", "trial", "internal"]), max_size=4),
    users=st.lists(_ids, min_size=1, max_size=8),
)
def test_r27_lookup_is_the_specs_most_specific_entry(exact, prefixes, users) -> None:
    from vllm_output_rate.spec import tables

    table = parse_rates_file(table_text(users={**exact, **{f"{p}*": plan for p, plan in prefixes.items()}}))

    def spec_entry(plan: str) -> tables.TableEntry:
        body = PLANS[plan]
        rate = None if body.get("unlimited") else Fraction(body["tokens_per_s"])
        return tables.TableEntry(rate, bool(body.get("shadow")))

    spec_exact = {u: spec_entry(plan) for u, plan in exact.items()}
    spec_prefixes = {p: spec_entry(plan) for p, plan in prefixes.items()}
    for user in users:
        want = tables.resolve(spec_exact, spec_prefixes, spec_entry("free"), user)
        got = table.lookup(user)
        assert (got.rate, got.shadow) == (want.rate, want.shadow), user
        assert got.enforced_rate == tables.enforced_rate(want)


@pytest.mark.rules("R28")
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["take", "refund", "advance", "rerate"]), st.sampled_from(["u", "x"])), max_size=30
    )
)
def test_r28_reference_limiter_is_the_spec_with_unlimited_users(ops) -> None:
    # "u" switches between unlimited and 10 tok/s at each rerate; "x" stays at 5 tok/s.
    from vllm_output_rate.spec import limiter as spec_limiter

    rates = [{"u": None, "x": Fraction(5)}, {"u": Fraction(10), "x": Fraction(5)}]
    phase, now, state = 0, 0, spec_limiter.EMPTY

    def table(i: int):
        users = {"x": {"tokens_per_s": 5}, "u": {"unlimited": True} if rates[i]["u"] is None else {"tokens_per_s": 10}}
        return parse_rates_file(table_text(users=users))

    ref = OutputRateLimiter(None, table=table(0))
    taken: list[str] = []  # charges of the current instant (R9: refunds only of those)
    for op, user in ops:
        rate = rates[phase][user]
        if op == "take":
            state, granted = spec_limiter.try_take(state, user, rate, now)
            assert ref.try_take(user, now) == granted
            if granted:
                taken.append(user)
        elif op == "refund" and user in taken:
            taken.remove(user)
            state = spec_limiter.refund(state, user, rate)
            ref.refund(user)
        elif op == "advance":
            now, taken = now + 37 * MS, []
        elif op == "rerate":
            old = phase
            phase, taken = 1 - phase, []
            state = spec_limiter.change_rates(state, rates[old].get, rates[phase].get, now)
            ref.install(table(phase).prepare(100 * MS).enforced, now)
        assert {u: ref.tat_ns(u) for u in ref.users()} == dict(state.tat_ns)
        assert ref.allows(user, now) == spec_limiter.allows(state, user, now)


@pytest.mark.rules("R28")
def test_r28_model_checker_scope_with_an_unlimited_user_beside_a_throttled_one() -> None:
    # The spec with user a unlimited (rate None: no TAT, never refused) beside b at 10 tok/s:
    # every invariant holds on every reachable state (I13: the limiter holds exactly the
    # charges of the ledger, none for a), b is throttled in some, and the scope is in the
    # gate's quick profile (model-check/quick).
    from vllm_output_rate.proofs import modelcheck as mc

    scope = mc.scope_by_name("sync-unlimited")
    assert dict(scope.config.user_rates_tokens_per_s) == {"a": None}
    result = mc.explore(scope)
    assert not result.violations, result.violations
    assert result.coverage["throttled"] > 0 and result.coverage["not_binding"] > 0
    assert "sync-unlimited" in [s.name for s in mc.profile_scopes("quick")]


@pytest.mark.rules("R27")
def test_r27_start_up_line_names_the_plan_table(tmp_path) -> None:
    from vllm_output_rate.reference.oplog import limits_message

    path = tmp_path / "rates.json"
    path.write_text(table_text(users={"svc-*": "internal"}))
    config = parse_output_rate({"default_tokens_per_s": 1, "rates_file": str(path)})
    line = limits_message("RateLimitedScheduler", config, 8, 8)
    assert "rate table: default plan 'free'; 4 plan(s): free 20 tok/s, pro 200 tok/s, trial 5 tok/s (shadow)" in line
    assert "internal unlimited" in line and "1 pattern(s)" in line


@pytest.mark.rules("R21", "R27")
@pytest.mark.slow
def test_r21_tables_bench_measures_a_reload_off_the_step() -> None:
    # outrate bench --only tables on one small size: the reload is installed (through the
    # reader process: 2,000 users are more than 16 KiB), its cost in the step and the
    # watcher's longest chunk are measured, and a snapshot step was timed.
    from vllm_output_rate.bench import tables

    row = tables.measure_size(2_000, 1, lambda: None)
    assert row["file_bytes"] > ratesfile.INLINE_BYTES and row["reloads"] == 1 and row["snapshots"] >= 1
    assert 0 < row["reload_stall_ms"] < 1_000 and row["watcher_longest_chunk_ms"] > 0
    assert row["snapshot_stall_ms"] > 0 and row["writer_longest_chunk_ms"] > 0 and row["reload_s"] > 0
    rendered = tables.tables_table({"rows": [row], "target_ms": 1.0, "before_at_100000_users": tables.BEFORE_MS})
    assert rendered.row_count == 1
