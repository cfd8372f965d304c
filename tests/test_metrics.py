"""The ``vllm:output_rate_*`` series (reference/metrics.py; issue 15 item 1).

The scheduler (in the gate's harness, with ``VLLM_OUTPUT_RATE_METRICS_DIR`` set as the
front end sets it for a spawned engine core) writes the per-label snapshot; the collector
turns it into prometheus families on a registry; labels stay {named users} + ``other``
whatever the number of users; the lead decays at scrape time; nothing is written in the
process that set the directory, or with the variable unset (the gate itself).
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, Harness
from vllm_output_rate.reference import metrics
from vllm_output_rate.reference.config import parse_output_rate

MS = 1_000_000


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(metrics.ENV_OWNER, "1")  # some other process set it: we are its engine core
    return tmp_path


def _snapshot(directory) -> dict:
    (path,) = directory.glob("engine-*.json")
    return json.loads(path.read_text())


def _run(output_rate: dict, users: list[str | None], tokens: int = 20, steps: int = 60):
    h = Harness(REFERENCE_SCHEDULER, EngineShape(max_num_seqs=len(users) + 1, output_rate=output_rate))
    for i, user in enumerate(users):
        h.add_request(f"r{i}", user, prompt_len=4, max_tokens=tokens)
    for _ in range(steps):
        h.step()
        h.advance(10 * MS)
    return h


def _finish(h, limit: int = 2000) -> None:
    """Step (10 ms apart) until every request has finished."""
    for _ in range(limit):
        if not h.scheduler.requests:
            return
        h.step()
        h.advance(10 * MS)
    raise AssertionError("requests did not finish")


def test_snapshot_counts_granted_throttled_and_leads_per_label(metrics_dir):
    # "slow" (named, 20 tok/s) with 2 streams is throttled; "x" and anonymous share "other" (1000 tok/s).
    h = _run({"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 20}}, ["slow", "slow", "x", None])
    _finish(h)  # everything finishes: the idle flush writes exact counters
    snap = _snapshot(metrics_dir)
    labels = snap["labels"]
    assert set(labels) == {"slow", "other"}
    assert labels["slow"]["granted"] == 40 and labels["other"]["granted"] == 40  # every token, sync: exact
    assert labels["slow"]["throttled_request_steps"] > 0 and labels["other"]["throttled_request_steps"] == 0
    assert labels["slow"]["throttled_seconds"] > 0.5 and labels["other"]["throttled_seconds"] == 0
    assert (labels["slow"]["limit_tokens_per_second"], labels["other"]["limit_tokens_per_second"]) == (20, 1000)
    assert snap["throttled_requests"] == 0 and snap["shadow"] is False  # idle now


def test_throttled_seconds_and_lead_while_throttled(metrics_dir):
    h = _run({"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 10}}, ["slow", "slow"], tokens=50, steps=150)
    recorder = h.scheduler._observation.metrics
    recorder.write(h.scheduler.clock_ns(), h.scheduler.rate_limiter)
    snap = _snapshot(metrics_dir)
    slow = snap["labels"]["slow"]
    # 150 steps x 10 ms = 1.5 s, 2 streams at 10 tok/s: throttled almost the whole time.
    assert 1.2 <= slow["throttled_seconds"] <= 1.5
    assert 0 < slow["lead_seconds"] <= 0.1 + 0.1  # TAT - now <= tau + T after a grant (R2)
    assert snap["throttled_requests"] >= 1
    assert slow["granted"] <= int((1.49 + 0.1) * 10) + 1  # the window bound over the run


def test_labels_stay_bounded_with_many_users(metrics_dir):
    users = [f"anon-{i}" for i in range(40)] + ["vip"]
    h = _run({"default_tokens_per_s": 5, "user_tokens_per_s": {"vip": 1000}}, users, tokens=3, steps=30)
    recorder = h.scheduler._observation.metrics
    for counter in (recorder.granted, recorder.throttled_steps, recorder.refunds, recorder.throttled_ns):
        assert set(counter) <= {"vip", "other"}
    recorder.write(h.scheduler.clock_ns(), h.scheduler.rate_limiter)
    assert set(_snapshot(metrics_dir)["labels"]) == {"vip", "other"}


def test_collector_yields_the_families_on_a_registry(metrics_dir):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    h = _run({"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 20}}, ["slow", "slow", "x"])
    _finish(h)
    registry = CollectorRegistry()
    registry.register(metrics.OutputRateCollector(str(metrics_dir)))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("vllm:output_rate_granted_tokens_total", (("user", "slow"),))] == 40
    assert samples[("vllm:output_rate_granted_tokens_total", (("user", "other"),))] == 20
    assert samples[("vllm:output_rate_throttled_request_steps_total", (("user", "slow"),))] > 0
    assert samples[("vllm:output_rate_throttled_request_steps_total", (("user", "other"),))] == 0
    assert samples[("vllm:output_rate_limit_tokens_per_second", (("user", "slow"),))] == 20
    assert ("vllm:output_rate_refunds_total", (("user", "slow"),)) in samples
    assert ("vllm:output_rate_throttled_seconds_total", (("user", "other"),)) in samples
    assert ("vllm:output_rate_lead_seconds", (("user", "slow"),)) in samples
    assert samples[("vllm:output_rate_throttled_requests", ())] == 0
    assert samples[("vllm:output_rate_shadow", ())] == 0
    assert samples[("vllm:output_rate_snapshot_age_seconds", ())] >= 0


def test_lead_decays_at_scrape_time(tmp_path):
    (tmp_path / "engine-7.json").write_text(
        json.dumps(
            {
                "version": 1,
                "pid": 7,
                "now_ns": 10_000_000_000,
                "shadow": False,
                "throttled_requests": 1,
                "labels": {
                    "other": {
                        "granted": 3,
                        "throttled_request_steps": 1,
                        "refunds": 0,
                        "throttled_seconds": 0.5,
                        "lead_seconds": 0.5,
                        "limit_tokens_per_second": 2.0,
                    }
                },
            }
        )
    )
    collector = metrics.OutputRateCollector(str(tmp_path), clock_ns=lambda: 10_200_000_000)
    families = {f.name: f for f in collector.collect()}
    assert families["vllm:output_rate_lead_seconds"].samples[0].value == pytest.approx(0.3)
    assert families["vllm:output_rate_snapshot_age_seconds"].samples[0].value == pytest.approx(0.2)
    late = metrics.OutputRateCollector(str(tmp_path), clock_ns=lambda: 20_000_000_000)
    assert {f.name: f for f in late.collect()}["vllm:output_rate_lead_seconds"].samples[0].value == 0


def test_shadow_mode_counts_would_be_throttles_as_throttled(metrics_dir):
    h = Harness(
        REFERENCE_SCHEDULER,
        EngineShape(
            max_num_seqs=3,
            output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 10}, "shadow": True},
        ),
    )
    for i in range(2):
        h.add_request(f"r{i}", "slow", prompt_len=4, max_tokens=20)
    would = 0
    for _ in range(30):
        h.step()
        would += len(h.scheduler._observation.shadow.last_would)
        h.advance(10 * MS)
    _finish(h)
    snap = _snapshot(metrics_dir)
    slow = snap["labels"]["slow"]
    assert snap["shadow"] is True
    assert slow["granted"] == 40  # everything dispatched (nothing throttled)
    assert slow["throttled_request_steps"] == would > 20  # 40 tokens in ~0.2 s at 10 tok/s: most over
    assert slow["throttled_seconds"] > 0


def test_no_recorder_without_the_variable_or_in_the_owner_process(monkeypatch, tmp_path):
    config = parse_output_rate({"default_tokens_per_s": 5})
    monkeypatch.delenv(metrics.ENV_DIR, raising=False)
    assert metrics.MetricsRecorder.from_env(config) is None
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(metrics.ENV_OWNER, str(os.getpid()))
    assert metrics.MetricsRecorder.from_env(config) is None  # the front end itself never writes
    monkeypatch.setenv(metrics.ENV_OWNER, "1")
    assert metrics.MetricsRecorder.from_env(config) is not None


def test_ensure_metrics_dir_sets_a_new_private_directory_per_engine(monkeypatch, tmp_path):
    # A directory inherited from a parent process (a test runner that built an engine
    # before starting `vllm serve`) holds another engine's snapshots: never reused.
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(metrics.ENV_OWNER, "1")
    directory = metrics.ensure_metrics_dir()
    assert directory != str(tmp_path)
    assert os.environ[metrics.ENV_DIR] == directory and os.environ[metrics.ENV_OWNER] == str(os.getpid())
    assert os.stat(directory).st_mode & 0o777 == 0o700
    again = metrics.ensure_metrics_dir()
    assert again != directory and os.environ[metrics.ENV_DIR] == again


def test_stat_logger_plugin_is_a_vllm_stat_logger_registered_by_entry_point():
    from importlib.metadata import entry_points

    from vllm.v1.metrics.loggers import StatLoggerBase

    (ep,) = [e for e in entry_points(group="vllm.stat_logger_plugins") if e.name == "output_rate"]
    cls = ep.load()
    assert issubclass(cls, StatLoggerBase)


@pytest.mark.parametrize("shadow", [False, True], ids=["enforcing", "shadow"])
def test_snapshot_written_at_start_up_before_any_request(metrics_dir, shadow):
    # Dashboards and alerts on the limit or on shadow=1 see the series from start-up, not
    # only after the first request (it used to be empty until the first step).
    Harness(
        REFERENCE_SCHEDULER,
        EngineShape(
            max_num_seqs=2,
            output_rate={"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 10}, "shadow": shadow},
        ),
    )
    snap = _snapshot(metrics_dir)
    assert snap["shadow"] is shadow
    assert {k: v["limit_tokens_per_second"] for k, v in snap["labels"].items()} == {"slow": 10.0, "other": 100.0}
    assert all(v["granted"] == 0 for v in snap["labels"].values())


@pytest.mark.rules("R21")
def test_r21_a_named_user_moved_to_the_default_keeps_its_series_at_the_default_rate(metrics_dir, tmp_path):
    # A rates file that drops a start-up override: the user's label keeps its series with the
    # default's limit (the snapshot used to raise KeyError for the dropped user).
    from fractions import Fraction

    rates = tmp_path / "rates.json"
    h = Harness(
        REFERENCE_SCHEDULER,
        EngineShape(
            max_num_seqs=3,
            output_rate={"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 10}, "rates_file": str(rates)},
        ),
    )
    h.add_request("r0", "slow", prompt_len=4, max_tokens=20)
    h.step()
    h.advance(10 * MS)
    h.change_rates(Fraction(50), [])
    for _ in range(3):
        h.step()
        h.advance(10 * MS)
    h.scheduler._observation.metrics.write(h.clock.now_ns(), h.scheduler.rate_limiter)
    snap = _snapshot(metrics_dir)
    assert {k: v["limit_tokens_per_second"] for k, v in snap["labels"].items()} == {"slow": 50.0, "other": 50.0}
    assert snap["labels"]["slow"]["granted"] >= 2


def _rates_file_run(metrics_dir, tmp_path, new_users: list[str]) -> dict:
    """Start with the override "slow" 10 tok/s; a rates-file change names ``new_users`` at
    2 tok/s (their requests arrive after it); step 1 s; return the snapshot."""
    from fractions import Fraction

    rates = tmp_path / "rates.json"
    h = Harness(
        REFERENCE_SCHEDULER,
        EngineShape(
            max_num_seqs=len(new_users) + 2,
            output_rate={"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 10}, "rates_file": str(rates)},
        ),
    )
    h.add_request("s0", "slow", prompt_len=4, max_tokens=200)
    h.step()
    h.advance(10 * MS)
    h.change_rates(Fraction(100), [("slow", Fraction(10))] + [(u, Fraction(2)) for u in new_users])
    for i, user in enumerate(new_users):
        h.add_request(f"n{i}", user, prompt_len=4, max_tokens=200)
    for _ in range(100):
        h.step()
        h.advance(10 * MS)
    h.scheduler._observation.metrics.write(h.clock.now_ns(), h.scheduler.rate_limiter)
    return _snapshot(metrics_dir)


@pytest.mark.rules("R21")
def test_r21_a_user_first_named_in_the_rates_file_gets_its_own_series(metrics_dir, tmp_path):
    snap = _rates_file_run(metrics_dir, tmp_path, ["tier-b"])
    labels = snap["labels"]
    assert set(labels) == {"slow", "tier-b", "other"}
    assert labels["tier-b"]["limit_tokens_per_second"] == 2.0
    # 2 tok/s over ~1 s: the burst (1) and about 2 more; throttled in the other steps.
    assert 2 <= labels["tier-b"]["granted"] <= 4 and labels["tier-b"]["throttled_request_steps"] > 50
    assert labels["other"]["granted"] == 0 and labels["other"]["throttled_request_steps"] == 0


@pytest.mark.rules("R21")
def test_r21_labels_named_by_rates_file_changes_stay_bounded(metrics_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_ADDED_LABELS", 2)
    snap = _rates_file_run(metrics_dir, tmp_path, ["b1", "b2", "b3"])
    labels = snap["labels"]
    assert set(labels) == {"slow", "b1", "b2", "other"}  # the start-up name, 2 added (in table order), other
    assert labels["other"]["granted"] >= 1  # b3, past the bound, is counted in other
