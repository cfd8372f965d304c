"""``outrate conform``: the conformance gate's checks, run and reported.

Each check is a named property with the rules it covers, run for a number of Hypothesis
examples set by the profile. A failing check keeps Hypothesis's shrunk counterexample
(a ``Scenario`` for the real-scheduler checks) and, when a directory is given, saves it
as JSON for ``outrate replay``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

PROFILES = {
    # examples per check: limiter differential, real scheduler sync / async (ample), each
    # invariants check (pressure), and per check when hunting one mutant
    "quick": {"limiter": 200, "sync": 25, "async": 15, "pressured": 20, "mutant": 25, "max_steps": 30},
    "ci": {"limiter": 1500, "sync": 120, "async": 60, "pressured": 120, "mutant": 60, "max_steps": 40},
    "release": {"limiter": 20000, "sync": 1500, "async": 800, "pressured": 1500, "mutant": 400, "max_steps": 80},
}

# Step-spec checks, examples per check: base fidelity (spec vs stock vLLM) and white box
# (spec vs the class under test), sync and async; every scenario has up to 40 steps.
STEP_SPEC_PROFILES = {
    "quick": {"base_sync": 30, "base_async": 20, "white_sync": 30, "white_async": 20},
    "ci": {"base_sync": 300, "base_async": 200, "white_sync": 300, "white_async": 200},
    "release": {"base_sync": 3000, "base_async": 2000, "white_sync": 3000, "white_async": 2000},
}
STEP_SCENARIO_MAX_STEPS = 40


@dataclass
class CheckResult:
    """One row of the gate's table (and of the JSON report)."""

    name: str
    rules: list[str]
    examples: int = 0
    steps: int = 0
    result: str = "pass"
    seconds: float = 0.0
    counterexample: list[str] = field(default_factory=list)
    failure: str | None = None
    saved: str | None = None

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "rules": self.rules,
            "examples": self.examples,
            "steps": self.steps,
            "result": self.result,
            "seconds": round(self.seconds, 3),
            "failure": self.failure,
            "counterexample": self.counterexample,
            "saved": self.saved,
        }


def _settings(examples: int) -> settings:
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
    from vllm_output_rate.adapter.limiter_diff import operations, run_differential

    result = CheckResult("limiter-differential", ["R1", "R2", "R3", "R4", "R5", "R6"])
    last: dict = {}

    @_settings(examples)
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


def check_scheduler(
    scheduler_cls: str,
    async_mode: bool,
    examples: int,
    max_steps: int,
    seed: int,
    tick: Callable[[], None],
    save_dir: Path | None,
    pressured: bool = False,
) -> CheckResult:
    """The scheduler scenario checks of ``adapter/scenarios.py`` on a real scheduler class.

    ``pressured`` False: ``rate-limit/*``, ample resources, black-box (R2, R7, R11, R14).
    ``pressured`` True: ``invariants/*``, KV/budget/seat pressure, aborts, PRIORITY, long
    runs; black-box checks that hold under pressure plus the white-box invariants.
    A failure is shrunk by Hypothesis, then made 1-minimal, and saved for replay.
    """
    from vllm_output_rate.adapter.scenarios import minimize, pressured_scenarios, run_scenario, scenarios

    tag = "async" if async_mode else "sync"
    if pressured:
        name, rules = f"invariants/{tag}", ["R1", "R2", "R6", "R7", "R9", "R11", "R12", "R16"]
        strategy = pressured_scenarios(async_scheduling=async_mode, max_steps=max_steps)
    else:
        name, rules = f"rate-limit/{tag}", ["R2", "R7", "R10", "R11", "R14"]
        strategy = scenarios(async_scheduling=async_mode, max_steps=max_steps)
    if async_mode:  # the under-grant and rotation checks need sync's immediate outputs
        rules = [r for r in rules if r not in ("R10", "R14")] + ["R8"]
    result = CheckResult(name, rules)
    failed = _hunt(result, strategy, lambda scenario: run_scenario(scheduler_cls, scenario), examples, seed, tick)
    if failed is not None:
        scenario = minimize(scheduler_cls, failed[0])
        verdict = run_scenario(scheduler_cls, scenario)
        result.result = "fail"
        result.failure = f"{verdict.rule}: step {verdict.step}: {verdict.failure}"
        result.counterexample = scenario.events()
        _save_counterexample(result, scenario, save_dir)
    return result


def _hunt(result: CheckResult, strategy, run: Callable, examples: int, seed: int,
          tick: Callable[[], None]) -> tuple[Any, Any] | None:
    """Run ``run(scenario)`` on ``examples`` seeded Hypothesis scenarios of ``strategy``.

    Counts examples and steps into ``result``. Returns None if every verdict passed, else
    the (scenario, verdict) of the failure as Hypothesis left it after shrinking.
    """
    last: dict = {}

    @_settings(examples)
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
) -> CheckResult:
    """Run ``run(scenario)`` on ``examples`` generated step scenarios (``adapter/fidelity.py``);
    a failure keeps Hypothesis's shrunk scenario up to its first differing event."""
    from vllm_output_rate.adapter.fidelity import describe_failure

    result = CheckResult(name, rules)
    failed = _hunt(result, strategy, run, examples, seed, tick)
    if failed is not None:
        scenario, verdict = failed
        result.result = "fail"
        result.failure = f"event {verdict.event_index}: {verdict.failure}"
        result.counterexample = describe_failure(scenario, verdict)
        _save_counterexample(result, scenario, save_dir)
    return result


def check_base_fidelity(
    async_mode: bool, examples: int, seed: int, tick: Callable[[], None], save_dir: Path | None
) -> CheckResult:
    """V1-V12, R18: the step spec predicts stock vLLM 0.32.0 exactly, step for step."""
    from vllm_output_rate.adapter.fidelity import base_scenarios, run_base

    name = "base-fidelity/" + ("async" if async_mode else "sync")
    rules = [f"V{i}" for i in range(1, 12)] + (["V12"] if async_mode else []) + ["R18"]
    return _check_step_scenarios(name, rules, base_scenarios(async_mode, STEP_SCENARIO_MAX_STEPS), run_base,
                                 examples, seed, tick, save_dir)


def check_white_box(
    scheduler_cls: str, async_mode: bool, examples: int, seed: int, tick: Callable[[], None],
    save_dir: Path | None,
) -> CheckResult:
    """R1-R18 + V1-V12: the step spec predicts the class under test exactly, including every
    field of its ``last_step_observation`` (charged, refunded, throttled, wait hint, TATs)."""
    from vllm_output_rate.adapter.whitebox import run_white_box, white_box_scenarios

    name = "white-box/" + ("async" if async_mode else "sync")
    rules = ["R1", "R2", "R4", "R6", "R7", "R9", "R10", "R11", "R12", "R13", "R14", "R15", "R16"]
    rules += ["R8", "V12"] if async_mode else []
    return _check_step_scenarios(name, rules, white_box_scenarios(async_mode, STEP_SCENARIO_MAX_STEPS),
                                 lambda scenario: run_white_box(scenario, scheduler_cls),
                                 examples, seed, tick, save_dir)


def check_proofs(tick: Callable[[], None]) -> CheckResult:
    """R1-R6 for all inputs: the Z3 proofs of ``proofs/z3_limiter.py`` (``outrate prove``
    adds the CrossHair contracts, which take about a minute)."""
    from vllm_output_rate.proofs.z3_limiter import run_all

    result = CheckResult("proofs/z3", ["R1", "R2", "R3", "R4", "R5", "R6"])
    for record in run_all():
        tick()
        result.examples += 1
        if record["result"] != "proved" or not record.get("vacuity_ok", True):
            result.result = "fail"
            result.failure = f"{record['name']}: {record['result']}"
            result.counterexample.append(str(record.get("counterexample")))
    return result


def check_model(tick: Callable[[], None]) -> CheckResult:
    """Every invariant in every state of the quick scopes of the model checker over the spec
    (``outrate check --profile ci|release`` explores the larger ones)."""
    from vllm_output_rate.proofs.modelcheck import explore, profile_scopes

    result = CheckResult("model-check/quick", ["I1-I17", "F1", "R6", "liveness"])
    for scope in profile_scopes("quick"):
        tick()
        outcome = explore(scope)
        result.examples += 1
        result.steps += outcome.states
        if outcome.violations:
            name, violation = next(iter(outcome.violations.items()))
            result.result = "fail"
            result.failure = f"scope {scope.name}: {name}: {violation}"
    return result
