"""``outrate conform``: the conformance gate's checks, run and reported.

Each check is a named property with the rules it covers, run for a number of Hypothesis
examples set by the profile. A failing check keeps Hypothesis's shrunk counterexample
(a ``Scenario`` for the real-scheduler checks) and, when a directory is given, saves it
as JSON for ``outrate replay``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from vllm_output_rate.adapter import scenario_strategies
from vllm_output_rate.adapter.budgets import STEP_SCENARIO_MAX_STEPS
from vllm_output_rate.adapter.environment import stock_survives
from vllm_output_rate.adapter.fidelity import StepVerdict, base_scenarios, describe_failure, run_base, with_loras
from vllm_output_rate.adapter.gate_errors import exception_text, reraise_gate_error
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.limiter_diff import operations, run_differential
from vllm_output_rate.adapter.rule_naming import named_verdict
from vllm_output_rate.adapter.scenario_run import minimize, run_scenario
from vllm_output_rate.adapter.scenarios import Hunt, Verdict
from vllm_output_rate.adapter.whitebox import run_white_box, white_box_scenarios


def hunt_settings(examples: int) -> settings:
    """The Hypothesis settings of every gate hunt: ``examples`` scenarios, no deadline, no
    example database (a run depends only on its seed), every health check off, generate
    and shrink phases only, no reproduction blob printed."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
        print_blob=False,
    )


def check_limiter_differential(examples: int, seed: int, tick: Callable[[], None]) -> CheckResult:
    """R1-R6: spec limiter (exact rationals) vs reference limiter (scaled integers)."""
    result = CheckResult("limiter-differential", ["R1", "R2", "R3", "R4", "R5", "R6"], part="spec health")
    last: dict = {}

    @hunt_settings(examples)
    @hseed(seed)
    @given(ops=operations(60))
    def prop(ops):
        result.examples += 1
        result.steps += len(ops.ops)
        tick()
        message = run_differential(ops)
        last["ops"], last["message"] = ops, message
        assert message is None, message

    try:
        prop()
    except AssertionError:
        result.result = "fail"
        result.failure = last.get("message")
        seq = last.get("ops")
        result.counterexample = [repr(op) for op in seq.ops] if seq is not None else []
    return result


def _guarded(run: Callable, cls: str) -> Callable:
    """``run(scenario)`` with any exception of the class under test turned into a failing
    verdict (rule "crash", level must) instead of ending the gate -- if stock vLLM survives
    the same scenario (else ``environment.EnvironmentFailure``: no verdict)."""

    def guarded(scenario):
        try:
            return run(scenario)
        except Exception as exc:  # the candidate's own error is a finding, not a gate crash
            reraise_gate_error(exc)
            stock_survives(scenario, exc)
            return Verdict(0, f"{cls.rpartition('.')[2]} raised {exception_text(exc)}", "crash", None, level="must")

    return guarded


def check_scheduler(
    scheduler_cls: str,
    async_mode: bool,
    hunt: Hunt,
    pressured: bool = False,
    level: str = "exact",
    style=None,
    integer_rates: bool = False,
    burst_configurable: bool = False,
) -> CheckResult:
    """The scheduler scenario checks of ``adapter/judge.py`` on a real scheduler class,
    hunted as ``hunt`` says (``adapter/scenarios.Hunt``).

    ``pressured`` False: ``rate-limit/*``, ample resources, black-box (R2, R7, R11, R12, R14).
    ``pressured`` True: ``invariants/*``, KV/budget/seat pressure, aborts, PRIORITY, long
    runs; black-box checks that hold under pressure, plus at level exact the white-box
    invariants. ``level`` chooses the properties judged (``adapter/levels.py``), ``style``
    how the candidate is configured. A failure is shrunk by Hypothesis, then made
    1-minimal, and saved for replay.
    """
    tag = "async" if async_mode else "sync"
    kwargs: dict[str, Any] = {
        "async_scheduling": async_mode,
        "max_steps": hunt.max_steps,
        "integer_rates": integer_rates,
        "burst_configurable": burst_configurable,
    }
    if pressured:
        name, rules = f"invariants/{tag}", ["R1", "R2", "R6", "R7", "R9", "R11", "R12", "R16", "R17"]
        strategy = scenario_strategies.pressured_scenarios(**kwargs)
    else:
        name, rules = f"rate-limit/{tag}", ["R2", "R7", "R10", "R11", "R12", "R14", "R17"]
        strategy = scenario_strategies.scenarios(**kwargs)
    if async_mode:  # the under-grant and rotation checks need sync's immediate outputs
        rules = [r for r in rules if r not in ("R10", "R14")] + ["R8"]
    result = CheckResult(name, rules)
    run = _guarded(lambda scenario: run_scenario(scheduler_cls, scenario, level, style), scheduler_cls)
    failed = _hunt(result, strategy, run, hunt.examples, hunt.seed, hunt.tick)
    if failed is not None:
        scenario = minimize(scheduler_cls, failed[0], run=run)
        verdict = _guarded(lambda s: named_verdict(scheduler_cls, s, level, style), scheduler_cls)(
            scenario
        )  # named by the rule it breaks (adapter/attribution.py)
        _record_failure(result, verdict, scenario)
        _save_counterexample(result, scenario, hunt.save_dir)
    return result


def _record_failure(result: CheckResult, verdict, scenario) -> None:
    """Fill ``result`` from a failing scenario verdict (rule, level, 1-minimal events)."""
    result.result = "fail"
    result.failed_level = verdict.level
    where = f"step {verdict.step}: " if verdict.step is not None else ""
    result.failure = f"[{verdict.level}] {verdict.rule}: {where}{verdict.failure}"
    result.counterexample = scenario.events()


def _hunt(
    result: CheckResult, strategy, run: Callable, examples: int, seed: int, tick: Callable[[], None]
) -> tuple[Any, Any] | None:
    """Run ``run(scenario)`` on ``examples`` seeded Hypothesis scenarios of ``strategy``.

    Counts examples and steps into ``result``. Returns None if every verdict passed, else
    the (scenario, verdict) of the failure as Hypothesis left it after shrinking.
    """
    last: dict = {}

    @hunt_settings(examples)
    @hseed(seed)
    @given(scenario=strategy)
    def prop(scenario):
        result.examples += 1
        tick()
        verdict = run(scenario)
        result.steps += verdict.steps
        last["scenario"], last["verdict"] = scenario, verdict
        assert verdict.failure is None, verdict.failure

    try:
        prop()
    except AssertionError:
        return last["scenario"], last["verdict"]
    return None


def _save_counterexample(result: CheckResult, scenario, save_dir: Path | None) -> None:
    """Write the failing scenario's JSON to ``save_dir`` (replayable with ``outrate replay``)."""
    if save_dir is None:
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / f"counterexample-{result.name.replace('/', '-')}.json"
    path.write_text(scenario.to_json())
    result.saved = str(path)


def _check_step_scenarios(
    name: str,
    rules: list[str],
    strategy,
    run: Callable,
    examples: int,
    seed: int,
    tick: Callable[[], None],
    save_dir: Path | None,
    subject: str = "stock vLLM",
) -> CheckResult:
    """Run ``run(scenario)`` on ``examples`` generated step scenarios (``adapter/fidelity.py``);
    a failure keeps Hypothesis's shrunk scenario up to its first differing event (shrunk,
    not proven 1-minimal: the report says so). ``subject`` names the class in the message."""
    result = CheckResult(name, rules, minimal=False)
    failed = _hunt(result, strategy, run, examples, seed, tick)
    if failed is not None:
        scenario, verdict = failed
        result.result = "fail"
        result.failure = f"event {verdict.event_index}: {verdict.failure}".replace(": vLLM ", f": {subject} ")
        result.counterexample = describe_failure(scenario, verdict)
        _save_counterexample(result, scenario, save_dir)
    return result


def check_base_fidelity(
    async_mode: bool, examples: int, seed: int, tick: Callable[[], None], save_dir: Path | None
) -> CheckResult:
    """V1-V12, R18: the step spec predicts stock vLLM exactly, step for step (a quarter of
    the scenarios with LoRA adapter slots, V8 ``max_loras``)."""
    name = "base-fidelity/" + ("async" if async_mode else "sync")
    rules = [f"V{i}" for i in range(1, 12)] + (["V12"] if async_mode else []) + ["R18"]
    base = base_scenarios(async_mode, STEP_SCENARIO_MAX_STEPS)
    strategy = st.one_of(base, base, base, with_loras(base))
    result = _check_step_scenarios(name, rules, strategy, run_base, examples, seed, tick, save_dir)
    result.part = "spec health"
    return result


def _integer_rates_only(scenario: Any) -> bool:
    """A step scenario whose rates (default and overrides, tokens/s) are all whole numbers."""
    config = scenario.config
    rates = [r for _, r in config.user_rates_tokens_per_s]
    if config.default_rate_tokens_per_s is not None:
        rates.append(config.default_rate_tokens_per_s)
    return all(rate.denominator == 1 for rate in rates)


def check_white_box(
    scheduler_cls: str,
    async_mode: bool,
    hunt: Hunt,
    burst_configurable: bool = True,
    style=None,
    integer_rates: bool = False,
) -> CheckResult:
    """R1-R18 + V1-V12 (level exact): the step spec predicts the class under test exactly,
    including every field of its ``last_step_observation`` (charged, refunded, throttled,
    wait hint, TATs), on ``hunt.examples`` step scenarios (``hunt.max_steps`` unused: the
    step scenarios' own bound). ``burst_configurable`` False: only the article's 100 ms burst."""
    name = "white-box/" + ("async" if async_mode else "sync")
    rules = ["R1", "R2", "R4", "R6", "R7", "R9", "R10", "R11", "R12", "R13", "R14", "R15", "R16"]
    rules += ["R8", "V12"] if async_mode else []
    scenarios = white_box_scenarios(async_mode, STEP_SCENARIO_MAX_STEPS)
    strategy = st.one_of(scenarios, scenarios, scenarios, with_loras(scenarios))  # a quarter with LoRA (R13)
    if not burst_configurable:
        strategy = strategy.filter(lambda scenario: scenario.config.burst_ns == 100_000_000)
    if style is not None:  # output_rate.max_num_active_seqs is this project's key, not the article's flag
        strategy = strategy.filter(lambda scenario: scenario.config.output_rate_max_num_active_seqs is None)
    if integer_rates:
        strategy = strategy.filter(_integer_rates_only)
    result = _check_step_scenarios(
        name,
        rules,
        strategy,
        _guarded_step(lambda scenario: run_white_box(scenario, scheduler_cls, style=style), scheduler_cls),
        hunt.examples,
        hunt.seed,
        hunt.tick,
        hunt.save_dir,
        subject=scheduler_cls.rpartition(".")[2],
    )
    result.level = "exact"
    if result.result == "fail" and result.failure is not None:
        result.failed_level = "exact"
        result.failure = f"[exact] {result.failure}; {open_choice_hint(result.failure)}"
    return result


def _guarded_step(run: Callable, cls: str) -> Callable:
    """``run(step_scenario)`` with an exception of the class under test as a failing verdict
    (if stock vLLM survives the same scenario, as in ``_guarded``)."""

    def guarded(scenario):
        try:
            return run(scenario)
        except Exception as exc:  # the candidate's own error is a finding
            reraise_gate_error(exc)
            stock_survives(scenario, exc)
            return StepVerdict(0, 0, f"{cls.rpartition('.')[2]} raised {exception_text(exc)}", None)

    return guarded


# docs/SPEC.md "What the article leaves open": the row a white-box difference most likely
# comes from, by the field that differed first.
OPEN_CHOICES = (
    ("max_num_active_seqs", "how the active cap is configured"),
    ("tokens-per-second", "how rates are configured / fractional rates"),
    ("preempted", "which throttled requests are preferred victims (R13)"),
    ("wait_hint", "when the wait hint is taken (R16)"),
    ("admitted", "where a waiting request's user is checked (R10)"),
    ("waiting", "where a waiting request's user is checked (R10)"),
    ("running", "the order of a user's streams (R14) or the preferred victims (R13)"),
    ("tat_ns", "the burst and fractional rates (R2)"),
    ("charged", "where a waiting request's user is checked (R10)"),
    ("throttled", "which requests are recorded as throttled (R11, R13)"),
    ("scheduled", "where a waiting request's user is checked (R10), or the order of a user's streams (R14)"),
)


def open_choice_hint(failure: str) -> str:
    """One sentence naming the row of "What the article leaves open" (docs/SPEC.md) that an
    exact-level difference most likely comes from."""
    for key, row in OPEN_CHOICES:
        if key in failure:
            return (
                f"this is this project's decision, not the article's promise: see docs/SPEC.md "
                f"'What the article leaves open', row: {row}"
            )
    return "see docs/SPEC.md 'What the article leaves open'"
