"""R19 for any candidate: a rate limit that does not bind does not change the schedule.

The same rate-limit scenario runs on the candidate with the feature ON but every rate set
to 10^6 tokens/s (``never_binding``: far above what any scenario can use, so no user is
ever refused), and on stock vLLM's ``Scheduler`` / ``AsyncScheduler`` with no output-rate
configuration. After every step the two ``SchedulerOutput``s must agree on the batch
(request ids and ``num_scheduled_tokens``, in order), the preemptions, the admissions and
the finishes (``adapter.feature_off.first_difference``, the comparison R18 uses).

This is what the rotation stall breaks: the article rotates a user's streams by swapping
their places in ``running`` at each step start, and vLLM spends the token budget in
``running`` order, so a long prompt moved ahead takes the whole budget of several steps
and another user's decoding stream gets nothing, with no limit binding at all
(docs/SPEC.md, R19 and Decision R14). ``stall_scenarios`` generates that shape on purpose;
the check also draws the generic ample and pressured scenarios.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from hypothesis import strategies as st

from vllm_output_rate.adapter.feature_off import PairedCheck, verdict_against_stock
from vllm_output_rate.adapter.scenario_strategies import STEP_INTERVALS_NS, pressured_scenarios, scenarios
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario, Verdict, spec_limiter_user
from vllm_output_rate.spec import limiter as spec_limiter

NEVER_BINDING_RATE = "1000000"  # tokens/s: 100 001 grants in one 100 ms burst (R2)


def never_binding(scenario: Scenario) -> Scenario:
    """``scenario`` with the feature on, every rate (default and overrides) 10^6 tokens/s and
    the article's fixed 100 ms burst.

    Raises:
        AssertionError: some user could be refused in it (a gate bug, not the candidate's):
            a user's sampling dispatches are at most the sum over its requests of
            ``max_tokens + 1`` (async may dispatch once after EOS), and any sequence of at
            most ``floor(tau x rate) + 1`` takes is granted by GCRA whatever its timing (R2).
    """
    scenario = replace(
        scenario,
        feature_on=True,
        burst_ms=None,
        default_rate_tokens_per_s=NEVER_BINDING_RATE,
        rates_tokens_per_s=dict.fromkeys(scenario.rates_tokens_per_s, NEVER_BINDING_RATE),
    )
    grants = spec_limiter.idle_burst_grants(Fraction(NEVER_BINDING_RATE), scenario.burst_ns)
    demand: dict[str, int] = {}
    for r in scenario.requests:
        user = spec_limiter_user(r.user)
        demand[user] = demand.get(user, 0) + r.max_tokens + 1
    assert max(demand.values(), default=0) <= grants, f"R19: a user may be refused at {NEVER_BINDING_RATE} tok/s"
    return scenario


@st.composite
def stall_scenarios(draw, async_scheduling: bool | None = None) -> Scenario:
    """Hypothesis strategy: the rotation-stall shape (docs/SPEC.md, Decision R14).

    User ``v`` has a decoding stream and, 1-5 steps later, sends a long prompt (40-400
    tokens); user ``w`` (sometimes also a third user) decodes beside it; a small token
    budget (8-32, chunked prefill) so that the long prompt takes several steps; sometimes a
    second decoding stream of ``v`` and an anonymous user's stream.
    """
    long_prompt = draw(st.integers(40, 400))
    budget = draw(st.integers(8, 32))
    arrival = draw(st.integers(1, 5))
    requests = [RequestSpec("v-r0", "v", draw(st.integers(1, 8)), draw(st.integers(8, 40)))]
    if draw(st.booleans()):
        requests.append(RequestSpec("v-r1", "v", draw(st.integers(1, 8)), draw(st.integers(8, 40))))
    requests.append(RequestSpec("w-r0", "w", draw(st.integers(1, 8)), draw(st.integers(8, 40))))
    if draw(st.booleans()):
        requests.append(
            RequestSpec(
                "x-r0", None, draw(st.integers(1, 8)), draw(st.integers(4, 40)), at_step=draw(st.integers(0, arrival))
            )
        )
    requests.append(RequestSpec("v-long", "v", long_prompt, draw(st.integers(1, 8)), at_step=arrival))
    return Scenario(
        rates_tokens_per_s={"v": NEVER_BINDING_RATE},
        requests=tuple(requests),
        step_interval_ns=draw(st.sampled_from(STEP_INTERVALS_NS)),
        num_steps=arrival + draw(st.integers(1, 12)),
        chunked_prefill=True,
        async_scheduling=draw(st.booleans()) if async_scheduling is None else async_scheduling,
        max_num_batched_tokens=budget,
    )


def not_binding_scenarios(async_scheduling: bool, max_steps: int):
    """Every scenario shape the R19 check draws: the stall shape, ample and pressured."""
    return st.one_of(
        stall_scenarios(async_scheduling=async_scheduling),
        scenarios(async_scheduling=async_scheduling, max_steps=max_steps),
        pressured_scenarios(async_scheduling=async_scheduling, max_steps=max_steps),
    )


def run_not_binding(scheduler_cls: str, scenario: Scenario, style=None) -> Verdict:
    """R19 (level should): ``scenario`` with every rate at 10^6 tokens/s (``never_binding``)
    on ``scheduler_cls``, against the same scenario with no output-rate configuration on
    stock vLLM (``adapter.feature_off.base_class``): identical batches, preemptions,
    admissions and finishes, step for step. ``failure`` names the first difference.
    ``style``: how the candidate is configured (``adapter/configstyle.py``).
    """
    return verdict_against_stock(
        scheduler_cls,
        never_binding(scenario),
        style,
        "R19",
        "should",
        lambda d: (
            f"with no user throttled (every rate {NEVER_BINDING_RATE} tokens/s), {d.name} scheduled {d.where} "
            f"{d.field} {d.got!r} where stock vLLM {d.stock} has {d.want!r}: a rate limit that does not bind must "
            "not change the schedule. vLLM spends the token budget in `running` order; the article's own rotation "
            "(swapping a user's streams in `running` at each step start) fails this too, starving other users' "
            "streams behind a long prompt moved ahead"
        ),
    )


#: R19 (level should): ``run_not_binding`` on seeded scenarios (``not_binding_scenarios``:
#: the stall shape, ample, pressured); a failure is shrunk, made 1-minimal and saved with
#: its rates at 10^6 tokens/s; rows ``not-binding/{sync,async}``.
check_not_binding = PairedCheck(
    "not-binding",
    ("R19", "R14"),
    "should",
    not_binding_scenarios,
    run_not_binding,
    never_binding,
)
