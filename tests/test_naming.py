"""Issue 18: black-box checks that stand alone, and kills that name the rule broken.

Each test runs one short scenario on a mutant (``adapter/mutants.py``, or the article-style
ones of ``tests/fixtures/article_mutants.py``) and on the unmutated implementations, and
checks the rule the failure names (``adapter/rule_naming.named_verdict``, which replays the
candidate's dispatches on the spec limiter changed in one rule, ``adapter/attribution.py``).
"""

from __future__ import annotations

import pytest
from test_gate import ONE_SEAT_FEW_BLOCKS, _abort_in_flight_scenario

from vllm_output_rate.adapter import boundaries
from vllm_output_rate.adapter.configstyle import parse_config_style
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.adapter.mutation import names_rule
from vllm_output_rate.adapter.rule_naming import named_verdict
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.adapter.scenarios import Hunt, RequestSpec, Scenario

MUTANTS = "vllm_output_rate.adapter.mutants"
ARTICLE = "article_style.scheduler.ArticleScheduler"
ARTICLE_ASYNC = "article_style.scheduler.ArticleAsyncScheduler"


def _engine_args():
    return parse_config_style("engine-args")


def _boundary(name: str, rate: str, async_mode: bool = False) -> Scenario:
    scenario = boundaries._solved(name, rate, async_mode, 0)
    assert scenario is not None, f"no model for {name} at {rate} tok/s"
    return scenario


def _throttled_holder_and_newcomer() -> Scenario:
    # A = 1: u0-r0 samples at t = 0 (1 tok/s: its next grant is at 1 s) and is throttled
    # from t = 1 ns; u1-r0 arrives then. len(running) - throttled = 1 - 1 = 0 < A: admitted.
    return Scenario(
        {"u0": "1"},
        (RequestSpec("u0-r0", "u0", 4, 3), RequestSpec("u1-r0", "u1", 4, 2, at_step=1)),
        1,
        4,
        default_rate_tokens_per_s="1000",
        max_num_active_seqs=1,
    )


@pytest.mark.rules("R12")
def test_r12_admission_with_throttled_requests_out_of_the_active_cap_is_judged_black_box(article_flags):
    scenario = _throttled_holder_and_newcomer()
    verdict = run_scenario(f"{MUTANTS}.ThrottledCountTowardCap", scenario, "must")
    assert verdict.rule == "R12" and verdict.level == "must", verdict
    assert "left u1-r0 (user 'u1') waiting" in verdict.failure and "throttled (['u0-r0']" in verdict.failure
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "exact").failure is None
    assert run_scenario(ARTICLE, scenario, "should", _engine_args()).failure is None


def _refused_prefill() -> Scenario:
    # u (1 tok/s) samples u-r0's first token at t = 0; u-r1 (8 prompt tokens) arrives at
    # t = 1 ns, its user refused: with chunked prefill it still advances to n - 1 = 7.
    return Scenario(
        {"u": "1"},
        (RequestSpec("u-r0", "u", 4, 3), RequestSpec("u-r1", "u", 8, 2, at_step=1)),
        1,
        4,
        default_rate_tokens_per_s="1000",
    )


@pytest.mark.rules("R10")
def test_r10_a_refused_prefill_left_waiting_is_rejected_black_box_at_should(article_flags):
    scenario = _refused_prefill()
    verdict = run_scenario(f"{MUTANTS}.NoPrefillAdvance", scenario, "should")
    assert verdict.rule == "R10" and verdict.level == "should", verdict
    assert "n - 1 = 7" in verdict.failure
    assert run_scenario(f"{MUTANTS}.NoPrefillAdvance", scenario, "must").failure is None  # a design rule
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "exact").failure is None
    assert run_scenario(ARTICLE, scenario, "should", _engine_args()).failure is None


@pytest.mark.rules("R7")
def test_r7_a_first_token_left_uncharged_after_a_prefix_cache_hit_is_named_r7():
    # u1-r0's prompt (5 tokens) starts with u0-r0's cached block (4 tokens): its only chunk
    # starts at token 4 (SchedulerOutput's num_computed_tokens), where a charge placed at a
    # prompt's first chunk never comes. Before the chunk start was read, no one-rule change
    # fitted and the kill named R2.
    scenario = Scenario(
        {},
        (RequestSpec("u0-r0", "u0", 4, 1), RequestSpec("u1-r0", "u1", 5, 1), RequestSpec("u1-r1", "u1", 1, 1)),
        999_999,
        3,
        chunked_prefill=False,
        prefix_caching=True,
        **ONE_SEAT_FEW_BLOCKS,
    )
    verdict = named_verdict(f"{MUTANTS}.ChargeFirstChunkInstead", scenario, "should")
    assert verdict.rule == "R7", verdict.failure
    # Charged at its first chunk, then refunded (that chunk does not sample): in effect the
    # final chunk is never asked about, which REFUND_PROBE's chunked prompt tells apart.
    assert "never asks about a final prefill chunk" in verdict.failure
    assert run_scenario(REFERENCE_SCHEDULER, scenario, "exact").failure is None


@pytest.mark.rules("R1", "R17")
def test_r1_r17_one_bucket_for_every_request_is_named_by_both_rules(article_flags):
    # One user at 3 tok/s, the default 1000 tok/s: one bucket at the default never refuses
    # it, like no limit at all; the probe at the slowest override as the default tells them
    # apart. One TAT for all users (R1) and every request keyed __anonymous__ (R17) are the
    # same limiter: both are named.
    verdict = named_verdict(
        "article_mutants.ArticleSharedBucket", _boundary("burst-edge", "3"), "should", _engine_args()
    )
    assert verdict.rule == "R1/R17", verdict.failure
    assert names_rule(verdict.rule, "R1") and names_rule(verdict.rule, "R17") and not names_rule("R14/R15", "R1")


@pytest.mark.rules("R10")
def test_r10_a_refusal_ignored_with_chunked_prefill_is_named_r10_not_no_limit(article_flags):
    # The n - 1 cap off by one lets every refused request sample with chunked prefill; the
    # probe without chunked prefill shows the limit, which stock vLLM does not have.
    verdict = named_verdict(
        "article_mutants.ArticleRefusedPrefillToN", _boundary("prefill-ends-n-1", "1"), "should", _engine_args()
    )
    assert verdict.rule == "R10", verdict.failure
    stock = named_verdict("vllm.v1.core.sched.scheduler.Scheduler", _boundary("prefill-ends-n-1", "1"), "should")
    assert stock.rule == "R2" and "no GCRA is applied" in stock.failure, stock.failure


@pytest.mark.rules("R8")
def test_r8_an_in_flight_step_taken_as_charged_is_named_r8_and_stock_async_r2(article_flags):
    scenario = _boundary("burst-edge", "20", async_mode=True)
    verdict = named_verdict("article_mutants.ArticleAsyncInFlightFree", scenario, "should", _engine_args())
    assert verdict.rule == "R8", verdict.failure
    stock = named_verdict("vllm.v1.core.sched.async_scheduler.AsyncScheduler", scenario, "should")
    assert stock.rule == "R2", stock.failure  # the probe in sync mode: no limit there either
    assert run_scenario(REFERENCE_ASYNC_SCHEDULER, scenario, "exact").failure is None


@pytest.mark.rules("R13", "R16")
def test_r16_a_lora_slot_failure_the_article_base_shares_is_not_a_kill_of_its_mutant(article_flags, tmp_path):
    # The article-style implementation fails lora-slots/* (its LoRA victim differs, issue
    # 13); that failure on an article-style mutant is the base's, not the mutant's slip: its
    # counterexample is re-run on the base, which fails it too. Before, lora-slots
    # counterexamples were not re-run and ArticleNoEngineWait (R16) counted as killed by R13.
    from vllm_output_rate.adapter import mutation
    from vllm_output_rate.adapter.lora_slots import check_lora

    mutant = next(m for m in mutation.load_mutants("article_mutants") if m.name == "ArticleNoEngineWait")
    options, _ = mutation.hunt_plan(mutant, "should", "quick", 0, False, tmp_path)
    result = check_lora(mutant.cls, False, Hunt(8, save_dir=tmp_path), options.style)
    assert result.result == "fail" and result.saved is not None, result.failure
    assert mutation._base_passes(mutant, result, "should", options) is False


@pytest.mark.rules("R3")
def test_r3_naming_probes_keep_fractional_rates_as_decimal_strings():
    # The probe at 25 x the rates wrote 12.5 tok/s as "625/2", which the candidate's
    # configuration cannot take (a float is parsed): that probe crashed and gave no evidence.
    from vllm_output_rate.adapter.rule_naming import naming_probes

    probes = naming_probes(_boundary("prefill-reaches-n", "12.5"))
    rates = [r for p in probes for r in (*p.rates_tokens_per_s.values(), p.default_rate_tokens_per_s)]
    assert "312.5" in rates and all(float(r) > 0 and "/" not in r for r in rates), rates


@pytest.mark.rules("R2", "R6")
def test_r2_idle_time_banked_is_told_apart_from_a_cleanup_slip(article_flags):
    # At the 256th schedule() both a limiter that banks idle time (no clamp to now, R2) and
    # one that deletes a user 1 ns ahead at the cleanup (R6) grant the same extra token; the
    # probe that idles 10 s and then sends a crowd, with no cleanup, parts them.
    scenario = _boundary("cleanup-tat-now+1ns", "5")
    verdict = named_verdict("article_mutants.ArticleNoClampToNow", scenario, "should", _engine_args())
    assert verdict.rule == "R2" and "without clamping" in verdict.failure, verdict.failure
    other = named_verdict("article_mutants.ArticleCleanupOneNsAhead", scenario, "should", _engine_args())
    assert other.rule == "R6", other.failure


@pytest.mark.rules("R7", "R8")
def test_r7_an_abort_that_charges_the_step_in_flight_again_is_named_r7():
    # Aborted with its step in flight, u0-r0 is charged once more at the abort: the extra
    # take is recorded where the abort happens, so the kill no longer reads as a charge kept
    # at the refund point (R9), which fits the same run one step later.
    verdict = named_verdict(f"{MUTANTS}.ChargeAbortInFlight", _abort_in_flight_scenario(), "must")
    assert verdict.rule == "R7" and "aborted with a step in flight" in verdict.failure, verdict.failure


# Kills each named by its rule from one boundary probe: (mutant, (boundary, rate tok/s), the
# rule named, words of the failure). Article-style mutants run with the article's engine
# flags. The comment above each row says what the probe shows and what the kill named before.
NAMED_KILLS = {
    # Charged, then preempted in the same step; then, waiting at the head of the queue, the
    # request is charged and fails its KV allocation step after step: every one of those
    # charges is due back. Before the blocked waiting head was recorded the kill named R11.
    "r9-charge-kept-after-preemption-and-failed-admissions": (
        f"{MUTANTS}.NoRefund",
        ("charged-then-preempted", "1"),
        "R9",
        "keeps the charge",
    ),
    # Decode steps refunded at the end of schedule(): a stream's turn is decided while the
    # charge still stands. Applied at once, the refund left the hypothesis granting a paused
    # stream of the crowd probe, and the kill named R2 (no limit at all).
    "r9-refunds-of-dispatched-charges-at-the-end-of-schedule": (
        "article_mutants.ArticleRefundsRunningDispatches",
        ("burst-edge", "3"),
        "R9",
        "dispatched charges of running requests",
    ),
    # The article-style implementation cleans up at the start of the 256th schedule(): a
    # slip there (TAT <= now + 1 ns deleted) was named R2 (a burst edge 1 ns late) while the
    # cleanup was modelled at the end of the step only.
    "r6-cleanup-slip-at-the-start-of-schedule": (
        "article_mutants.ArticleCleanupOneNsAhead",
        ("cleanup-tat-now+1ns", "5"),
        "R6",
        "start of schedule()",
    ),
    # Keyed by request id, every bucket runs at the default rate (no override names a
    # request): one stream at 20 tok/s looks unlimited until the probe at the slowest
    # override as the default; the kill named R2 (no limit at all) before.
    "r1-buckets-keyed-by-request-id-miss-the-overrides": (
        f"{MUTANTS}.BudgetPerRequest",
        ("burst-edge", "20"),
        "R1",
        "one bucket per request",
    ),
    # In the crowd probe five first tokens are refused at t = 0, each prefill held at n - 1
    # (R10): those refusals are recorded, and a limiter whose refusal advances the TAT then
    # explains the pauses that follow. Before, the kill was left at R11 (under-grant).
    "r2-refusal-advancing-the-tat-from-prefills-held-at-n-minus-1": (
        "article_mutants.ArticleRefusalAdvancesTat",
        ("burst-edge", "3"),
        "R2",
        "advances the TAT on a refused take",
    ),
    # Charged at its first chunk (then refunded: that chunk did not sample), the prompt's
    # final chunk is never asked about and samples even when its user is refused; without
    # that slip in the catalogue of changes, only "any refusal ignored with chunked prefill"
    # (R10) fitted.
    "r7-final-prefill-chunk-never-asked-not-r10": (
        f"{MUTANTS}.ChargeFirstChunkInstead",
        ("prefill-reaches-n", "12.5"),
        "R7",
        "never asks about a final prefill chunk",
    ),
}


@pytest.mark.rules("R1", "R2", "R6", "R7", "R9", "R10")
@pytest.mark.parametrize("case", NAMED_KILLS)
def test_r1_r2_r6_r7_r9_r10_a_boundary_probe_kill_is_named_by_the_rule_broken(case, request):
    mutant, (boundary, rate), rule, words = NAMED_KILLS[case]
    style = ()
    if mutant.startswith("article_mutants."):
        request.getfixturevalue("article_flags")
        style = (_engine_args(),)
    verdict = named_verdict(mutant, _boundary(boundary, rate), "should", *style)
    assert verdict.rule == rule and words in verdict.failure, verdict.failure
