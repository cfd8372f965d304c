"""Operator logs (``reference/oplog.py``; issue 15, item 2): the limits in force at start-up,
and a rate-limited summary of throttled users.

The real reference scheduler runs in-process (``adapter.harness.Harness``: fake clock,
fabricated model outputs); the lines are read from vLLM's logger ``vllm.output_rate``.
"""

from __future__ import annotations

import logging

import pytest

from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, EngineShape, Harness
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
    section = {"default_tokens_per_s": 100, "user_tokens_per_s": {"user-a": 20, "user-b": 0.5},
               "max_num_active_seqs": 2, "burst_ms": 250}
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
    third = limits_message("X", parse_output_rate({"default_tokens_per_s": 10,
                                                   "user_tokens_per_s": {"x" * 100: 1}}), 1, 1)
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
        assert line == ("output-rate: 2 user(s) throttled in the last 10.0 s, by throttled request-steps: "
                        f"'slow' {counted['slow']} (limit 2 tok/s), 'mid' {counted['mid']} (limit 5 tok/s)")
    assert h.scheduler._throttle_log.lines == 2


def test_no_summary_while_nobody_is_throttled(lines):
    h = Harness(REFERENCE_SCHEDULER, EngineShape(output_rate={"default_tokens_per_s": 1000}))
    lines.clear()
    h.add_request("a", "u", max_tokens=50)
    for _ in range(50):
        h.step()
        h.advance(SUMMARY_INTERVAL_NS // 4)
    assert lines == []
