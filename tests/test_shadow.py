"""Shadow mode (docs/SPEC.md, Decision "Shadow mode"; issue 15): ``output_rate.shadow: true``
counts and reports what would be throttled and throttles nothing.

- configuration: the key is validated like the others (a JSON boolean; a typo gets the
  nearest key);
- the gate's ``shadow/{sync,async}`` check (level exact): the reference in shadow mode is
  stock vLLM step for step with binding rates, and a scheduler that still enforces in
  shadow mode is rejected with the first differing step;
- the shadow limiter really counts: a user over its limit gets every token (as stock) and
  the would-be throttled dispatches are exactly the tokens above the GCRA's grants;
- the trace (``trace_path``) marks would-be throttles and passes the online checker;
  the throttled-users log line says WOULD BE throttled.
"""

from __future__ import annotations

import json
import logging
from fractions import Fraction

import pytest

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.feature_off import SHADOW, check_shadow, run_shadow
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, STOCK_SCHEDULER, Harness
from vllm_output_rate.adapter.scenarios import Hunt, RequestSpec, Scenario
from vllm_output_rate.adapter.trace_check import check_trace
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.scheduler import RateLimitedScheduler
from vllm_output_rate.reference.section import OutputRateConfigError
from vllm_output_rate.spec import limiter as spec_limiter

MS = 1_000_000


class EnforcingInShadow(RateLimitedScheduler):
    """A wrong scheduler: ignores ``shadow`` and keeps enforcing the limit."""

    def __init__(self, *args, **kwargs):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        vllm_config.additional_config["output_rate"].pop("shadow", None)
        super().__init__(*args, **kwargs)


ENFORCING_IN_SHADOW = f"{__name__}.EnforcingInShadow"


# -- configuration ------------------------------------------------------------------
def test_shadow_key_parsed_default_off():
    assert parse_output_rate({"default_tokens_per_s": 5}).shadow is False
    assert parse_output_rate({"default_tokens_per_s": 5, "shadow": True}).shadow is True


@pytest.mark.parametrize("bad", ["true", 1, 0, None, [True]])
def test_shadow_must_be_a_json_boolean_naming_the_value(bad):
    with pytest.raises(
        OutputRateConfigError, match=r"shadow must be true or false.*got " + repr(bad).replace("[", r"\[")
    ):
        parse_output_rate({"default_tokens_per_s": 5, "shadow": bad})


def test_shadow_typo_names_the_nearest_key():
    with pytest.raises(OutputRateConfigError, match=r"'shadw' \(did you mean 'shadow'\?\)"):
        parse_output_rate({"default_tokens_per_s": 5, "shadw": True})


def test_shadow_without_default_refused_like_any_section():
    with pytest.raises(OutputRateConfigError, match="without default_tokens_per_s"):
        parse_output_rate({"shadow": True})


# -- the gate check -------------------------------------------------------------------
def test_shadow_registered_at_level_exact_candidate_part(registered_at_level):
    assert registered_at_level("shadow", "exact", below="should") == ("shadow",)


def test_shadow_check_accepts_the_reference(async_scheduling):
    cls = REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER
    result = check_shadow(cls, async_scheduling, Hunt(25, seed=1, max_steps=40))
    assert result.result == "pass", result.failure
    assert result.level == "exact" and result.examples >= 25


def _over_limit_scenario(async_scheduling: bool = False) -> Scenario:
    """User u at 10 tok/s with 3 streams of 30 tokens, 10 ms steps: 300 tok/s of demand."""
    return Scenario(
        rates_tokens_per_s={"u": "10"},
        step_interval_ns=10 * MS,
        num_steps=40,
        requests=tuple(RequestSpec(f"u{i}", "u", 4, 30) for i in range(3)),
        async_scheduling=async_scheduling,
    )


def test_shadow_check_rejects_a_scheduler_that_still_enforces(tmp_path):
    verdict = run_shadow(ENFORCING_IN_SHADOW, _over_limit_scenario())
    assert verdict.failure is not None and verdict.rule == "shadow" and verdict.level == "exact"
    assert "in shadow mode" in verdict.failure and "batch" in verdict.failure
    result = check_shadow(ENFORCING_IN_SHADOW, False, Hunt(20, seed=1, max_steps=40, save_dir=tmp_path))
    assert result.result == "fail" and result.saved is not None


def test_shadow_check_not_tested_for_a_style_that_cannot_express_it():
    from vllm_output_rate.adapter.configstyle import EngineArgsStyle

    result = check_shadow(REFERENCE_SCHEDULER, False, Hunt(5, max_steps=10), style=EngineArgsStyle())
    assert result.result == "not tested" and "cannot express" in result.failure


# -- what shadow mode counts ------------------------------------------------------------
def _run_over_limit(cls: str, output_rate, trace=None, steps: int = 40, async_scheduling: bool = False):
    section = dict(output_rate) if output_rate is not None else None
    if section is not None and trace is not None:
        section["trace_path"] = str(trace)
    h = Harness(cls, EngineShape(max_num_seqs=4, async_scheduling=async_scheduling, output_rate=section))
    for i in range(3):
        h.add_request(f"u{i}", "u", prompt_len=4, max_tokens=30)
    batches, would = [], []
    for _ in range(steps):
        out = h.step()
        batches.append(dict(out.scheduled))
        observation = getattr(h.scheduler, "_observation", None)  # None: the stock scheduler
        shadow = observation.shadow if observation is not None else None
        would.append(list(shadow.last_would) if shadow is not None else None)
        h.advance(10 * MS)
    h.drain()
    return h, batches, would


def test_shadow_grants_everything_and_counts_exactly_the_tokens_above_the_limit(tmp_path, async_scheduling):
    cls = REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER
    stock = "vllm.v1.core.sched.async_scheduler.AsyncScheduler" if async_scheduling else STOCK_SCHEDULER
    trace = tmp_path / "trace.jsonl"
    h, batches, would = _run_over_limit(
        cls, {"default_tokens_per_s": 10, **SHADOW}, trace=trace, async_scheduling=async_scheduling
    )
    _, stock_batches, _ = _run_over_limit(stock, None, async_scheduling=async_scheduling)
    assert batches == stock_batches  # nothing throttled: the base class's schedule
    assert h.scheduler.last_step_observation is None and h.scheduler.next_ready_ns() is None  # no R16 wait
    h.scheduler.shutdown()
    # Replay every sampling dispatch, in batch order, through the exact spec limiter at the
    # step's clock: granted <=> a shadow charge, refused <=> a would-be throttle.
    state, refused = spec_limiter.LimiterState(), 0
    for record in (json.loads(line) for line in trace.read_text().splitlines()):
        for rid, info in (record.get("requests") or {}).items():
            if not info["sampled"]:
                continue
            state, ok = spec_limiter.try_take(state, "u", Fraction(10), record["now_ns"])
            assert ok == info["charged"] and ok != info["would_throttle"], (record["step"], rid)
            refused += not ok
    assert refused == sum(len(w) for w in would) > 60  # 90 tokens, about 5 + 10 x 0.4 s granted


def test_shadow_trace_marks_would_be_throttles_and_passes_the_checker(tmp_path):
    trace = tmp_path / "trace.jsonl"
    h, _batches, would = _run_over_limit(REFERENCE_SCHEDULER, {"default_tokens_per_s": 10, **SHADOW}, trace=trace)
    h.scheduler.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["header"]["shadow"] is True
    steps = [r for r in lines if "requests" in r]
    flagged = sum(len(r["would_throttle"]) for r in steps)
    assert flagged == sum(len(w) for w in would) > 0
    assert not any(info["throttled"] for r in steps for info in r["requests"].values())
    report = check_trace(trace)
    assert report.ok, report.summary()
    (run,) = report.runs
    assert run.shadow and run.users["u"].would_throttle == flagged
    assert run.users["u"].dispatches == 90  # every token dispatched (3 x 30)
    assert "would be throttled" in report.summary()


def test_shadow_log_line_says_would_be_throttled(caplog):
    from vllm_output_rate.reference import oplog

    caplog.set_level(logging.INFO, logger="vllm.output_rate")
    oplog.logger.propagate = True
    try:
        h = Harness(
            REFERENCE_SCHEDULER,
            EngineShape(
                max_num_seqs=4, output_rate={"default_tokens_per_s": 10, "user_tokens_per_s": {"u": 5}, **SHADOW}
            ),
        )
        for i in range(3):
            h.add_request(f"u{i}", "u", prompt_len=4, max_tokens=400)
        for _ in range(120):
            h.step()
            h.advance(100 * MS)
    finally:
        oplog.logger.propagate = False
    text = caplog.text
    assert "SHADOW mode" in text and "nothing is throttled" in text
    assert "WOULD BE throttled (shadow mode) in the last" in text and "'u'" in text and "limit 5 tok/s" in text


# -- outrate serve --shadow -------------------------------------------------------------
def test_serve_shadow_flag_goes_into_the_section():
    import shlex

    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    result = CliRunner().invoke(
        main, ["serve", "MODEL", "--default-user-output-tokens-per-second", "10", "--shadow", "--print-command"]
    )
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.strip())
    section = json.loads(argv[argv.index("--additional-config") + 1])["output_rate"]
    assert section == {"default_tokens_per_s": 10, "shadow": True}
    assert "--shadow" not in argv  # ours, not vLLM's
    refused = CliRunner().invoke(main, ["serve", "MODEL", "--shadow", "--print-command"])
    assert refused.exit_code == 2 and "--shadow needs --default-user-output-tokens-per-second" in refused.output
    inside = CliRunner().invoke(
        main,
        [
            "serve",
            "MODEL",
            "--default-user-output-tokens-per-second",
            "10",
            "--additional-config",
            '{"output_rate": {"shadow": true}}',
            "--print-command",
        ],
    )
    assert inside.exit_code == 2 and "shadow -> --shadow" in inside.output
