"""Naming the rule a counterexample breaks: ``named_verdict`` runs the counterexample and
its ``naming_probes`` (the same requests with more outputs, faster rates, idle users, a
crowd, other modes, twin users, ``REFUND_PROBE``) to their ends, and finds the one-rule
change of the spec limiter that explains the candidate's whole run
(``adapter/attribution.py``).
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from fractions import Fraction

from vllm_output_rate.adapter import attribution
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario, Verdict

PROBE_TOKEN_FACTOR = 4  # a naming probe asks this many times each request's outputs (at most PROBE_MAX_TOKENS)
PROBE_MIN_TOKENS = 32  # and, KV ample, at least this many: past a 1 s burst at 20 tok/s (R1's slip of tau shows)
PROBE_MAX_TOKENS = 64
PROBE_RATE_FACTOR = 25  # the faster probe's rates, x the counterexample's
PROBE_CROWD = 6  # the crowd probe runs each named user's requests this many times over


def naming_probes(scenario: Scenario) -> list[Scenario]:
    """Scenarios derived from a counterexample that give the rule naming more of the
    candidate's behaviour to explain (``named_verdict``): the same requests, arrivals and
    clock with more outputs each (longer decoding, more pacing decisions), also without
    EOS, and, for a scenario under pressure, also without it (ample seats, budget and KV,
    no aborts: every pause is then the limiter's); the counterexample at 25 x its rates
    (pressure kept: two refund slips part there); each named user idle 10 s, then a crowd
    of its requests (``_idle_probes``); the named users' requests six times over
    (a crowd of first tokens); in async mode, also in sync mode (a slip
    of the step in flight, R8, acts only in async); with chunked prefill, also without it
    (a slip of the n - 1 advance, R10, acts only with it); and those requests again beside copies
    for a twin of each named user at the same rate (one bucket or one per user?), and, with
    per-user overrides, that again with the slowest override as every user's rate (a limiter
    at the default rate, or none at all, then shows); under pressure, ``REFUND_PROBE`` (a
    refund given twice, R9, and a TAT forgotten, R4, part there)."""
    least = PROBE_MIN_TOKENS if scenario.num_blocks is None else 0  # a small KV cache must still hold them
    longer = tuple(
        replace(r, max_tokens=min(PROBE_MAX_TOKENS, max(r.max_tokens * PROBE_TOKEN_FACTOR, r.max_tokens + 8, least)))
        for r in scenario.requests
    )
    # (``ample_from_step`` is the author's guarantee for the original requests, not for longer ones.)
    probes = [replace(scenario, requests=longer, ample_from_step=None)]
    if any(r.eos_index is not None for r in longer):
        probes.append(
            replace(scenario, requests=tuple(replace(r, eos_index=None) for r in longer), ample_from_step=None)
        )
    unpressured = tuple(replace(r, abort_at_step=None) for r in longer)
    if not scenario.ample:  # the same without pressure: every pause is then the limiter's (evidence)
        probes.append(
            replace(scenario, requests=unpressured, max_num_seqs=None, max_num_batched_tokens=None, num_blocks=None)
        )
    # The same, pressure kept, at 25 x every rate: a user's lead can then exceed two
    # emission intervals, where a refund given twice (R9) and a TAT forgotten (R4) differ.
    faster = {u: str(Decimal(r) * PROBE_RATE_FACTOR) for u, r in scenario.rates_tokens_per_s.items()}
    probes.append(
        replace(
            scenario,
            rates_tokens_per_s=faster,
            default_rate_tokens_per_s=str(Decimal(scenario.default_rate_tokens_per_s) * PROBE_RATE_FACTOR),
        )
    )
    probes += _mode_probes(scenario, unpressured)
    probes += _twin_probes(scenario, unpressured)
    probes += _idle_probes(scenario)
    if not scenario.ample:  # a refund slip acts only under pressure
        probes.append(REFUND_PROBE)
    return probes


# R4 vs R9: a charge refunded while its user's TAT is more than one emission interval ahead.
# User b at 20 tokens/s (T = 50 ms, tau = 100 ms = 2 T) on 4 KV blocks of 16, FCFS. Step 0
# (t = 0) a-r0 (prompt 17, 2 blocks) and b-r0 (prompt 4) sample; step 1 (1 ms) b-r0 decodes
# and b-r1 (prompt 16, arrived with b-r2 and b-r3 behind it) is charged, then its allocation
# fails: refunded, b's TAT is 100 ms. Step 2 (2 ms) a-r0 and b-r0 have finished and b's
# three requests are admitted: the spec grants 1 (lead 98 ms), a refund given twice 2 (lead
# 48 ms), a TAT forgotten on the refund 3 (a fresh bucket).
REFUND_PROBE = Scenario(
    rates_tokens_per_s={"b": "20"},
    default_rate_tokens_per_s="1000",
    requests=(
        RequestSpec("a-r0", "a", 17, 2),
        RequestSpec("b-r0", "b", 4, 2),
        RequestSpec("b-r1", "b", 16, 4, at_step=1),
        RequestSpec("b-r2", "b", 4, 4, at_step=1),
        RequestSpec("b-r3", "b", 4, 4, at_step=1),
    ),
    step_interval_ns=1_000_000,
    num_steps=8,
    num_blocks=4,
)


PROBE_IDLE_NS = 10_000_000_000  # the idle probe's gap between a user's first token and its crowd


def _idle_probes(scenario: Scenario) -> list[Scenario]:
    """Each named user samples one token, idles 10 s, then a crowd of ``PROBE_CROWD`` of its
    requests arrives together, well before any cleanup (R6): a limiter that banks idle time
    (no clamp of the TAT up to now, R2) grants the whole crowd, one with a cleanup slip does
    not."""
    users = sorted({r.user for r in scenario.requests if r.user is not None})
    if not users:
        return []
    first = tuple(RequestSpec(f"{u}~i0", u, 4, 1) for u in users)
    crowd = tuple(RequestSpec(f"{u}~i{k}", u, 4, 1, at_step=2) for u in users for k in range(1, PROBE_CROWD + 1))
    return [
        replace(
            scenario,
            requests=first + crowd,
            num_steps=4,
            advances_ns=(1, PROBE_IDLE_NS),
            step_interval_ns=1_000_000,
            ample_from_step=None,
            max_num_seqs=None,
            max_num_batched_tokens=None,
            num_blocks=None,
            max_num_active_seqs=None,
        )
    ]


def _mode_probes(scenario: Scenario, unpressured: tuple[RequestSpec, ...]) -> list[Scenario]:
    """``naming_probes``' variants of ``unpressured`` (the longer requests, no aborts) with
    ample resources: a crowd of the named users' requests, the same in sync mode (async
    scenarios), the same without chunked prefill (chunked scenarios)."""
    probes: list[Scenario] = []
    # Each named user's requests six times over, arriving together: first tokens alone then
    # pass the burst (a limiter that charges only them, R9, refuses; no limiter does not).
    crowd = tuple(
        replace(r, request_id=f"{r.request_id}~c{k}")
        for k in range(1, PROBE_CROWD)
        for r in unpressured
        if r.user is not None
    )
    if crowd:
        probes.append(
            replace(
                scenario,
                requests=unpressured + crowd,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
                max_num_active_seqs=None,
            )
        )
    if scenario.async_scheduling:  # the same in sync mode: a slip of the in-flight step (R8) or not?
        probes.append(
            replace(
                scenario,
                requests=unpressured,
                async_scheduling=False,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
            )
        )
    if scenario.chunked_prefill:  # the same without chunked prefill: R10's n - 1 advance or not?
        probes.append(
            replace(
                scenario,
                requests=unpressured,
                chunked_prefill=False,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
            )
        )
    return probes


def _twin_probes(scenario: Scenario, unpressured: tuple[RequestSpec, ...]) -> list[Scenario]:
    """``naming_probes``' twin variants: ``unpressured`` beside copies for a twin of each
    named user at the same rate, and that again with the slowest override as the default."""
    probes: list[Scenario] = []
    # The same requests again for a second user of the same rate (one bucket or two?).
    twin = {u: f"{u}~2" for u in {r.user for r in scenario.requests if r.user is not None}}
    if twin:
        copies = tuple(
            replace(r, request_id=f"{r.request_id}~2", user=twin[r.user]) for r in unpressured if r.user is not None
        )
        rates = dict(scenario.rates_tokens_per_s) | {
            twin[u]: r for u, r in scenario.rates_tokens_per_s.items() if u in twin
        }
        twins = replace(
            scenario,
            requests=unpressured + copies,
            rates_tokens_per_s=rates,
            max_num_seqs=None,
            max_num_batched_tokens=None,
            num_blocks=None,
            max_num_active_seqs=None,
        )
        probes.append(twins)
        if scenario.rates_tokens_per_s:  # and with the slowest override as the default (does the default bind?)
            slowest = min(scenario.rates_tokens_per_s.values(), key=Fraction)
            probes.append(replace(twins, rates_tokens_per_s={}, default_rate_tokens_per_s=slowest))
    return probes


# The dispatch replay's properties (over-grant, window bound, under-grant), and the rate
# layer's should-level ones (R12 active cap, R13 victims, R14/R15 turns): a slip of the
# limiter underneath shows in them too, and is named when the dispatches contradict the spec
# limiter (``attribution.attribute``); when they do not, the property's own rule stands.
NAMEABLE_RULES = ("R2", "R10", "R11", "R12", "R13", "R14/R15")


def named_verdict(scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None) -> Verdict:
    """``run_scenario`` on a counterexample, with a failure of the dispatch replay named
    by the rule it breaks (``adapter/attribution.py``): the one-rule change of the spec
    limiter that explains the candidate's whole run on the counterexample and on its
    ``naming_probes`` (each run to its end, recorded). Without one, or for any other
    failure, the verdict is ``run_scenario``'s."""
    verdict = run_scenario(scheduler_cls, scenario, level, style, attribute=True)
    if verdict.failure is None or verdict.history is None or verdict.rule not in NAMEABLE_RULES:
        return verdict
    histories = [verdict.history]
    for probe in naming_probes(scenario):
        try:
            probe_verdict = run_scenario(scheduler_cls, probe, level, style, attribute=True)
        except Exception:  # a probe the candidate crashes on gives no evidence
            continue
        if probe_verdict.history is not None:
            histories.append(probe_verdict.history)
    found = attribution.attribute(histories)
    if found is None:
        return verdict
    hyp, others = found
    name = scheduler_cls.rpartition(".")[2]
    text = (
        f"{attribution.message(name, hyp, others, sum(len(h) for _, h in histories), len(histories))}. "
        f"Seen first: {verdict.failure}"
    )
    return replace(verdict, failure=text, rule=hyp.rule)
