"""Operator logs (``reference/oplog.py``; issue 15, item 2): the limits in force at start-up,
and a rate-limited summary of throttled users.

The real reference scheduler runs in-process (``adapter.harness.Harness``: fake clock,
fabricated model outputs); the lines are read from vLLM's logger ``vllm.output_rate``.
"""

from __future__ import annotations

import logging

import pytest

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, Harness
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.oplog import SUMMARY_INTERVAL_NS, limits_message

MS = 1_000_000


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def lines():
    logger = logging.getLogger("vllm.output_rate")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_logger_is_under_vllms_logger():
    # Under "vllm": vLLM's handler, format and VLLM_LOGGING_LEVEL apply (a logger outside it
    # would have no handler and INFO would be dropped).
    from vllm_output_rate.reference import oplog

    assert oplog.logger.name == "vllm.output_rate"


def test_startup_line_names_the_limits_in_force(lines):
    section = {
        "default_tokens_per_s": 100,
        "user_tokens_per_s": {"user-a": 20, "user-b": 0.5},
        "max_num_active_seqs": 2,
        "burst_ms": 250,
    }
    Harness(REFERENCE_SCHEDULER, EngineShape(max_num_seqs=8, output_rate=section))
    assert lines == [
        "output-rate limiting on (RateLimitedScheduler): default 100 tok/s; 2 override(s): 'user-a' 20 tok/s, "
        "'user-b' 0.5 tok/s; burst 250 ms; active cap 2 of 8 resident requests (max_num_seqs); trace off"
    ]


def test_startup_line_with_many_overrides_names_a_few_and_counts_the_rest():
    config = parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {f"u{i}": 1 for i in range(12)}})
    message = limits_message("RateLimitedScheduler", config, 64, 64)
    assert "12 override(s): 'u0' 1 tok/s, 'u1' 1 tok/s, 'u2' 1 tok/s, 'u3' 1 tok/s, 'u4' 1 tok/s and 7 more" in message
    assert "active cap = max_num_seqs = 64" in message
    third = limits_message(
        "X", parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {"x" * 100: 1}}), 1, 1
    )
    assert "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... 1 tok/s" in third  # a long id is cut at 40 characters


@pytest.mark.rules("R18")
def test_r18_startup_line_says_the_feature_is_off(lines):
    Harness(REFERENCE_SCHEDULER, EngineShape())
    assert len(lines) == 1 and lines[0].startswith("output-rate limiting off (RateLimitedScheduler)")


def test_throttled_users_summary_at_most_once_per_interval_top_users_first(lines):
    # "slow" 2 tok/s with 3 streams, "mid" 5 tok/s with 1, "fast" never throttled.
    section = {"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 2, "mid": 5}}
    h = Harness(REFERENCE_SCHEDULER, EngineShape(max_num_seqs=8, output_rate=section))
    lines.clear()
    for i in range(3):
        h.add_request(f"s{i}", "slow", max_tokens=200)
    h.add_request("m0", "mid", max_tokens=200)
    h.add_request("f0", "fast", max_tokens=200)
    steps = int(25 * SUMMARY_INTERVAL_NS / (10 * MS) / 10)  # 25 s of 10 ms steps
    throttled = {"slow": 0, "mid": 0}
    per_line = []  # the throttled request-steps seen through the observation, per logged interval
    for _ in range(steps):
        h.step()
        for rid in h.scheduler.last_step_observation["throttled"]:
            throttled["slow" if rid.startswith("s") else "mid"] += 1
        if len(lines) > len(per_line):
            per_line.append(throttled)
            throttled = {"slow": 0, "mid": 0}
        h.advance(10 * MS)
    # Lines at 10 s and 20 s (the first step only starts the interval): at most one per 10 s.
    assert len(lines) == 2, lines
    for line, counted in zip(lines, per_line):
        assert counted["slow"] > counted["mid"] > 0
        assert line == (
            "output-rate: 2 user(s) throttled in the last 10.0 s, by throttled request-steps: "
            f"'slow' {counted['slow']} (limit 2 tok/s), 'mid' {counted['mid']} (limit 5 tok/s)"
        )
    assert h.scheduler._engine_wait.throttle_log.lines == 2


def test_no_summary_while_nobody_is_throttled(lines):
    h = Harness(REFERENCE_SCHEDULER, EngineShape(output_rate={"default_tokens_per_s": 1000}))
    lines.clear()
    h.add_request("a", "u", max_tokens=50)
    for _ in range(50):
        h.step()
        h.advance(SUMMARY_INTERVAL_NS // 4)
    assert lines == []


# -- the line is written on time, also while no schedule() runs -------------------------
def _engine_core(h: Harness, section: dict, model_executed: bool):
    """Stand-in ``EngineCoreProc`` around the harness's scheduler for vLLM's real
    ``_process_engine_step`` (wrapped by the plugin): one step that did (not) run the model."""
    import queue
    from types import SimpleNamespace

    core = SimpleNamespace(
        scheduler=h.scheduler,
        input_queue=queue.Queue(),
        output_queue=queue.Queue(),
        batch_queue=None,
        vllm_config=SimpleNamespace(
            additional_config={"output_rate": section}, parallel_config=SimpleNamespace(data_parallel_size=1)
        ),
        _idle_state_callbacks=[],
        post_step=lambda executed: None,
    )
    core.step_fn = lambda: ({}, model_executed)
    return core


@pytest.fixture()
def fake_waits(monkeypatch):
    """The plugin's waits on the input queue advance the harness's fake clock (no sleeping)."""
    from vllm_output_rate.reference import core_wait, plugin

    plugin.register()
    waits: list[int] = []

    def install(h: Harness):
        def wait_for_input(input_queue, timeout_s: float) -> bool:
            waits.append(round(timeout_s * 1e9))
            h.advance(round(timeout_s * 1e9))
            return False

        monkeypatch.setattr(core_wait, "wait_for_input", wait_for_input)
        return waits

    return install


def _run_throttled(h: Harness, rate_user: str, streams: int, max_tokens: int, until_ns: int | None = None) -> None:
    for i in range(streams):
        h.add_request(f"{rate_user}{i}", rate_user, max_tokens=max_tokens)
    while h.scheduler.has_requests() and (until_ns is None or h.clock.now_ns() < until_ns):
        h.step()
        h.advance(10 * MS)


def _throttled_then_engine_step(section: dict, fake_waits, model_executed: bool, **run) -> tuple[Harness, list]:
    """Run user "slow" throttled on the harness (``_run_throttled``), then one engine step
    through vLLM's wrapped ``_process_engine_step``; returns the harness and the waits."""
    from vllm.v1.engine.core import EngineCoreProc

    h = Harness(REFERENCE_SCHEDULER, EngineShape(max_num_seqs=8, output_rate=section))
    waits = fake_waits(h)
    _run_throttled(h, "slow", streams=2, max_tokens=4, **run)
    assert h.clock.now_ns() < SUMMARY_INTERVAL_NS and h.scheduler._engine_wait.throttle_log.lines == 0
    EngineCoreProc._process_engine_step(_engine_core(h, section, model_executed))
    return h, waits


@pytest.mark.rules("R16")
def test_last_interval_before_the_engine_goes_idle_is_logged_when_it_ends(lines, fake_waits):
    # "slow" at 2 tok/s, 2 streams x 4 tokens: throttled, all done after ~2 s; then the
    # engine has no requests (an idle gap). The interval that started at 0 ends at 10 s:
    # its line is written then, not when the next request arrives.
    from vllm.v1.engine.core import EngineCoreProc

    section = {"default_tokens_per_s": 2}
    h, waits = _throttled_then_engine_step(section, fake_waits, model_executed=True)
    assert not h.scheduler.has_requests()
    lines[:] = [x for x in lines if x.startswith("output-rate: ")]  # not the start-up line
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "output-rate: 1 user(s) throttled in the last 10.0 s, by throttled request-steps: 'slow' "
    ), lines
    assert h.clock.now_ns() == SUMMARY_INTERVAL_NS and len(waits) == 1
    # Nothing counted since: the next idle step neither waits nor logs.
    EngineCoreProc._process_engine_step(_engine_core(h, section, model_executed=True))
    assert len(lines) == 1 and len(waits) == 1


@pytest.mark.rules("R16")
def test_line_is_logged_on_time_during_a_long_wait_for_budget(lines, fake_waits):
    # "slow" at 0.05 tok/s: after its burst its next token is 20 s away; the engine waits
    # for budget (R16) and wakes at 10 s for the line, not at the ready time.
    h, waits = _throttled_then_engine_step(
        {"default_tokens_per_s": 0.05}, fake_waits, model_executed=False, until_ns=100 * MS
    )
    assert h.scheduler.next_ready_ns() > SUMMARY_INTERVAL_NS
    lines[:] = [x for x in lines if x.startswith("output-rate: ")]  # not the start-up line
    assert len(lines) == 1 and "'slow' " in lines[0], lines
    assert len(waits) == 1 and SUMMARY_INTERVAL_NS <= h.clock.now_ns() < SUMMARY_INTERVAL_NS + 10 * MS
