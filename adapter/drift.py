"""``outrate drift``: where does the installed vLLM leave the spec's base model, per V-rule?

Spec health, not a verdict on a candidate: base fidelity (stock vLLM with the feature off,
``adapter/fidelity.py``) is hunted with Hypothesis on the installed vLLM, in sync and async
mode, against the base model of a chosen release (``spec/versions.py``; default: the
installed vLLM's own rows). Every divergence is named by its V-rule
(``adapter/divergence.py``). For each rule the first divergence found is reported with

- its counterexample, shrunk by Hypothesis (kept on the same rule) and then made
  1-minimal over events (removing any single event makes that rule's divergence go away);
- the time it took to find and to minimize.

After a rule is found the hunt goes on with that rule's divergences counted as agreement,
until a round of ``examples`` scenarios finds no new rule or the time budget is spent. A
clean run on a supported release (its own rows) reports nothing; run with
``base_version="0.32.0"`` on vLLM 0.33.0, it reports the V6 change (PRIORITY
self-preemption no longer ends the running loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import given
from hypothesis import seed as hseed

from vllm_output_rate.adapter.conform import hunt_settings
from vllm_output_rate.adapter.fidelity import StepScenario, StepVerdict, base_scenarios, describe_failure, run_base
from vllm_output_rate.adapter.gate_result import fields_as_json
from vllm_output_rate.spec.versions import VllmVersionProfile

DRIFT_MAX_STEPS = 40  # scenario length, as the gate's base-fidelity check
MAX_ROUNDS = 12  # bound on hunts per mode (each finds one new rule or ends the mode)


@dataclass
class RuleDrift:
    """The first divergence found for one V-rule."""

    rule: str
    mode: str
    failure: str
    counterexample: list[str]
    events: int
    seconds_to_find: float
    seconds_to_minimize: float
    examples: int
    scenario: StepScenario

    def as_json(self) -> dict:
        """JSON-ready form (the scenario in the replayable step-scenario format)."""
        return fields_as_json(self, RULE_DRIFT_JSON_KEYS, rounded={"seconds_to_find": 2, "seconds_to_minimize": 2})


RULE_DRIFT_JSON_KEYS = (
    "rule",
    "mode",
    "failure",
    "counterexample",
    "events",
    "seconds_to_find",
    "seconds_to_minimize",
    "examples",
)


@dataclass
class DriftReport:
    """Everything one drift run found, per mode."""

    vllm_version: str
    base_version: str
    warning: str | None
    found: list[RuleDrift] = field(default_factory=list)
    examples: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    complete: dict[str, bool] = field(default_factory=dict)  # the mode ended with a clean round


class _Found(Exception):
    pass


def _verdict(scenario: StepScenario, base: VllmVersionProfile) -> StepVerdict:
    """Base fidelity of ``scenario``; a scenario the spec itself rejects (an event
    reduction that makes it ill-formed) counts as agreement."""
    try:
        return run_base(scenario, base)
    except AssertionError:
        return StepVerdict()


def _diverges(scenario: StepScenario, base: VllmVersionProfile, rule: str) -> StepVerdict | None:
    verdict = _verdict(scenario, base)
    return verdict if verdict.failure is not None and verdict.rule == rule else None


def _through_failure(scenario: StepScenario, verdict: StepVerdict) -> StepScenario:
    """``scenario`` cut after the event at which ``verdict`` failed (later ones cannot matter)."""
    assert verdict.event_index is not None, "a failed verdict names its event"
    return replace(scenario, events=scenario.events[: verdict.event_index + 1])


def one_minimal(
    scenario: StepScenario, base: VllmVersionProfile, rule: str, tick: Callable[[], None] = lambda: None
) -> tuple[StepScenario, StepVerdict]:
    """Remove single events while ``rule``'s divergence remains; the result is 1-minimal.

    Events after the first differing one are cut first (they cannot matter). Bounded: every
    accepted removal shortens the scenario.
    """
    verdict = _diverges(scenario, base, rule)
    assert verdict is not None, f"the scenario does not diverge on {rule}"
    scenario = _through_failure(scenario, verdict)
    changed = True
    while changed:
        changed = False
        for i in range(len(scenario.events) - 1, -1, -1):
            candidate = replace(scenario, events=scenario.events[:i] + scenario.events[i + 1 :])
            tick()
            found = _diverges(candidate, base, rule)
            if found is not None:
                scenario, verdict = _through_failure(candidate, found), found
                changed = True
                break
    return scenario, verdict


def _hunt_once(
    async_mode: bool,
    base: VllmVersionProfile,
    known: set[str],
    examples: int,
    seed: int,
    tick: Callable[[], None],
    counter: list[int],
) -> tuple[StepScenario, StepVerdict] | None:
    """One Hypothesis hunt for a divergence of a rule not in ``known``, shrunk on that rule."""
    target: dict[str, Any] = {}  # the first rule found, and its scenario and verdict

    @hunt_settings(examples)
    @hseed(seed)
    @given(scenario=base_scenarios(async_mode, DRIFT_MAX_STEPS))
    def prop(scenario: StepScenario) -> None:
        counter[0] += 1
        tick()
        verdict = _verdict(scenario, base)
        if verdict.failure is None or verdict.rule in known:
            return
        rule = target.setdefault("rule", verdict.rule)
        if verdict.rule == rule:  # shrinking stays on the first rule found
            target["scenario"], target["verdict"] = scenario, verdict
            raise _Found(rule)

    try:
        prop()
    except _Found:
        return target["scenario"], target["verdict"]
    return None


def drift(
    base: VllmVersionProfile,
    vllm_version: str,
    warning: str | None,
    examples: int = 300,
    seed: int = 0,
    modes: tuple[bool, ...] = (False, True),
    time_budget_s: float | None = None,
    tick: Callable[[], None] = lambda: None,
    on_found: Callable[[RuleDrift], None] = lambda _: None,
) -> DriftReport:
    """Hunt base-fidelity divergences per V-rule on the installed vLLM (module docstring).

    ``examples``: scenarios per hunt; ``time_budget_s``: stop starting new hunts after this.
    ``on_found`` is called as soon as a rule's minimized counterexample is ready.
    """
    started = time.monotonic()
    report = DriftReport(vllm_version, base.version, warning)
    known: set[str] = set()
    for async_mode in modes:
        mode = "async" if async_mode else "sync"
        counter = [0]
        report.complete[mode] = False
        for round_index in range(MAX_ROUNDS):
            if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                break
            t0 = time.monotonic()
            hit = _hunt_once(async_mode, base, known, examples, seed + round_index, tick, counter)
            if hit is None:
                report.complete[mode] = True
                break
            found_at = time.monotonic()
            scenario, verdict = hit
            rule = verdict.rule or "V?"
            scenario, verdict = one_minimal(scenario, base, rule, tick)
            entry = RuleDrift(
                rule,
                mode,
                f"event {verdict.event_index}: {verdict.failure}",
                describe_failure(scenario, verdict),
                len(scenario.events),
                found_at - t0,
                time.monotonic() - found_at,
                counter[0],
                scenario,
            )
            known.add(rule)
            report.found.append(entry)
            on_found(entry)
        report.examples[mode] = counter[0]
    report.seconds = time.monotonic() - started
    return report
