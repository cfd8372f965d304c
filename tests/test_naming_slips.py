"""Issue 18: kills that name the rule broken, for slips whose first failure looks like
another rule's (a refund that forgets the TAT, a charge taken on model output) and for
crashes (``adapter/judge._Judge.crash_verdict``)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_output_rate.adapter import boundaries
from vllm_output_rate.adapter.configstyle import parse_config_style
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.adapter.rule_naming import REFUND_PROBE, named_verdict
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.reference.scheduler import RateLimitedScheduler

MUTANTS = "vllm_output_rate.adapter.mutants"
ARTICLE = "article_style.scheduler.ArticleScheduler"


def _boundary(name: str, rate: str, async_mode: bool = False):
    scenario = boundaries._solved(name, rate, async_mode, 0)
    assert scenario is not None, f"no model for {name} at {rate} tok/s"
    return scenario


@pytest.mark.rules("R4", "R9")
def test_r4_a_refund_that_forgets_the_tat_is_named_r4_and_a_refund_given_twice_r9(article_flags):
    # At 1 tok/s (T > tau) a refund given twice and a TAT forgotten leave the same bucket;
    # REFUND_PROBE refunds a charge while the TAT is 2 T ahead, where they part. Before it
    # the kill was named R9.
    style = parse_config_style("engine-args")
    scenario = _boundary("charged-then-preempted", "1")
    verdict = named_verdict("article_mutants.ArticleRefundForgetsUser", scenario, "should", style)
    assert verdict.rule == "R4" and "forgets the user's TAT on a refund" in verdict.failure, verdict.failure
    twice = named_verdict(f"{MUTANTS}.DoubleRefund", scenario, "should")
    assert twice.rule == "R9" and "refunds an undispatched charge twice" in twice.failure, twice.failure
    assert run_scenario(ARTICLE, REFUND_PROBE, "should", style).failure is None
    assert run_scenario(REFERENCE_SCHEDULER, REFUND_PROBE, "exact").failure is None


@pytest.mark.rules("R7")
def test_r7_a_charge_taken_on_model_output_over_grants_in_async_and_is_named_r7():
    # The next step is decided before the last one's output (and so its charges) arrives.
    scenario = _boundary("burst-edge", "20", async_mode=True)
    verdict = named_verdict(f"{MUTANTS}.ChargeOnModelOutput", scenario, "should")
    assert verdict.rule == "R7" and "only when the model's output for it is delivered" in verdict.failure, (
        verdict.failure
    )
    assert run_scenario(REFERENCE_ASYNC_SCHEDULER, scenario, "exact").failure is None


class CrashOnFirstSchedule(RateLimitedScheduler):
    """A candidate whose first ``schedule()`` raises: no rare event is due then."""

    def schedule(self, *args: Any, **kwargs: Any):
        raise RuntimeError("broken from the start")


class CrashAtCleanup(RateLimitedScheduler):
    """A candidate whose 256th ``schedule()`` (R6's cleanup cadence) raises."""

    calls = 0

    def schedule(self, *args: Any, **kwargs: Any):
        self.calls += 1
        if self.calls == 256:
            raise KeyError("cleanup")
        return super().schedule(*args, **kwargs)


@pytest.mark.rules("R14")
def test_r14_a_crash_in_the_first_step_whose_turn_wraps_is_named_r14(article_flags):
    style = parse_config_style("engine-args")
    verdict = named_verdict(
        "article_mutants.ArticleRotationWrapCrash", _boundary("prefill-ends-n-1", "20"), "should", style
    )
    assert verdict.rule == "R14" and "IndexError" in verdict.failure and "turn wraps around" in verdict.failure, (
        verdict.failure
    )


@pytest.mark.rules("R6")
def test_r6_a_crash_at_the_cleanup_cadence_is_named_r6_and_one_at_the_start_is_not_named():
    scenario = _boundary("cleanup-tat-now", "2")
    verdict = named_verdict(f"{__name__}.CrashAtCleanup", scenario, "should")
    assert verdict.rule == "R6" and "cleanup of idle users is due" in verdict.failure, verdict.failure
    with pytest.raises(RuntimeError, match="broken from the start"):
        named_verdict(f"{__name__}.CrashOnFirstSchedule", scenario, "should")
