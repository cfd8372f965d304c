"""Mutation testing of the gate: every mutant of the catalogue must be rejected.

The catalogue (``catalogue(modules)``) is the reference's mutants (``adapter/mutants.py``)
plus the mutants of every catalogue module the caller names: a module on the import path
that registers its mutants as ``MUTANTS``, a tuple of ``adapter.mutants.Mutant``
(``load_mutants``). ``outrate conform --mutants --mutants-from MODULE`` names them (with
``--path`` for the directory that holds the module); this repository's article-style
mutants are ``article_mutants`` in the source checkout's test fixtures (``--path
tests/fixtures --mutants-from article_mutants``). The adapter itself imports no test code.

``kill(mutant, ...)`` hunts one mutant with the gate's own candidate checks: the
registry's plan (``adapter/registry.py``) for a gate run on the mutant at the chosen level,
configured as the mutant's users would configure it (its ``style`` and
``integer_rates``), cheapest check first, ``engine-wait/*`` (about 5 s each) after the
scenario checks, until one check fails. With ``white_box`` False (``--no-white-box``) the
exact-level checks (step identity with the spec through the observation interface) are
left out, so every kill comes from what vLLM exposes. A kill row records the check, the
level of the property that failed, the rule the failure names, whether the killing check
is black-box, the seconds, and the 1-minimal counterexample; and the counterexample is
re-run on the mutant's unmutated base class, which must pass it (``base_passes``): a kill
the base would suffer too is not the mutant's slip. A ``coverage`` failure is never a kill
(it names obligations the hunt's checks did not reach, not a behaviour of the mutant): the
hunt goes on, and a mutant no other check rejects is a survivor whose row carries the
shortfall (``coverage_shortfall``).
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from vllm_output_rate.adapter import gate_row, registry
from vllm_output_rate.adapter.candidate_import import import_named_module
from vllm_output_rate.adapter.configstyle import parse_config_style
from vllm_output_rate.adapter.counterexample import scenario_text
from vllm_output_rate.adapter.engine_wait import run_engine_wait
from vllm_output_rate.adapter.feature_off import run_feature_off
from vllm_output_rate.adapter.fidelity import StepScenario
from vllm_output_rate.adapter.levels import includes
from vllm_output_rate.adapter.lora_slots import LoraScenario, run_lora
from vllm_output_rate.adapter.mutants import MUTANTS, Mutant
from vllm_output_rate.adapter.not_binding import run_not_binding
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.adapter.scenarios import Scenario

MUTANTS_ATTRIBUTE = "MUTANTS"
"""The name under which a catalogue module registers its mutants (``load_mutants``)."""

# Cheapest first (seconds measured on the article-style classes in profile ci); a check
# not listed here (a row added later) runs after the listed scenario checks and before
# engine-wait; white-box rows (level exact) come last.
# The boundary scenarios come first among the scenario checks: each is built to reach one
# rule's edge, so the history a kill there leaves names that rule more often than a random
# scenario's (adapter/attribution.py).
CHECK_ORDER = (
    "feature-off/sync",
    "boundaries/sync",
    "invariants/sync",
    "rate-limit/sync",
    "not-binding/sync",
    "feature-off/async",
    "boundaries/async",
    "invariants/async",
    "rate-limit/async",
    "not-binding/async",
)
LATE_CHECKS = ("engine-wait/sync", "engine-wait/async", "white-box/sync", "white-box/async")

_RULE_IN_FAILURE = re.compile(r"\b(R\d+(?:/R\d+)*|crash)\b")  # "R1/R17": rules named together


@dataclass
class MutantResult:
    """One row of the kill table (and of the JSON ``"mutants"`` list).

    ``killed_by``: the rule id the failing check names; ``level``: the level of the failed
    property (``CheckResult.failed_level``); ``black_box``: the killing check uses only
    what vLLM exposes (every check but ``white-box/*`` and the exact-level observation
    invariants); ``base_passes``: the counterexample passes on the unmutated base class
    (None: not re-run); ``based_on``: "reference" or "article_style"; ``spurious``: failures
    of checks that the base class fails on the same counterexample too (not counted as
    kills: a defect of the base or of the gate, reported); ``not_judged``: why the mutant
    was not hunted at this level (its slip is a defect only from ``Mutant.level`` on, e.g.
    "not a defect below exact"): neither killed nor a survivor; ``coverage_shortfall``: the
    ``coverage`` row's failure in the hunt (obligations not reached), never a kill.
    """

    mutant: str
    rule: str
    killed: bool
    seconds: float
    counterexample_events: int = 0
    killed_by: str | None = None
    check: str | None = None
    failure: str | None = None
    counterexample: list[str] | None = None
    level: str | None = None
    black_box: bool | None = None
    base_passes: bool | None = None
    based_on: str = "reference"
    checks_run: int = 0
    spurious: list[str] = field(default_factory=list)
    not_judged: str | None = None
    coverage_shortfall: str | None = None

    @property
    def names_own_rule(self) -> bool:
        """The kill's failure names the mutant's rule (alone, or among rules that nothing
        black-box tells apart, written ``R1/R17``)."""
        return names_rule(self.killed_by, self.rule)

    @property
    def survived(self) -> bool:
        """Hunted at this level and not killed."""
        return not self.killed and self.not_judged is None

    def as_json(self) -> dict:
        return {
            "mutant": self.mutant,
            "rule": self.rule,
            "based_on": self.based_on,
            "killed": self.killed,
            "seconds": round(self.seconds, 3),
            "counterexample_events": self.counterexample_events,
            "killed_by": self.killed_by,
            "names_own_rule": self.names_own_rule,
            "check": self.check,
            "level": self.level,
            "black_box": self.black_box,
            "base_passes": self.base_passes,
            "checks_run": self.checks_run,
            "spurious": self.spurious,
            "not_judged": self.not_judged,
            "coverage_shortfall": self.coverage_shortfall,
            "failure": self.failure,
            "counterexample": self.counterexample,
        }


def names_rule(killed_by: str | None, rule: str) -> bool:
    """``killed_by`` (a rule id, ``R1/R17``, ``crash`` or None) names ``rule``."""
    return killed_by is not None and rule in killed_by.split("/")


def load_mutants(module: str) -> tuple[Mutant, ...]:
    """The mutants the catalogue module ``module`` (a dotted module name on the import path)
    registers as ``MUTANTS``: a tuple of ``adapter.mutants.Mutant``.

    Raises:
        ImportError: ``module`` does not import: it is not found (naming it; give ``--path``
            for its directory) or raises while it is imported (naming the exception,
            ``candidate_import.import_named_module``).
        ValueError: ``module`` has no ``MUTANTS`` tuple of ``Mutant``.
    """
    try:
        loaded = import_named_module(module)
    except ImportError as exc:
        hint = ": give --path DIR, the directory that holds it" if isinstance(exc, ModuleNotFoundError) else ""
        raise ImportError(f"mutant catalogue module {module!r} does not import ({exc}){hint}") from exc
    found = getattr(loaded, MUTANTS_ATTRIBUTE, None)
    if not isinstance(found, tuple) or not all(isinstance(m, Mutant) for m in found):
        raise ValueError(
            f"mutant catalogue module {module!r} has no {MUTANTS_ATTRIBUTE} tuple of "
            f"vllm_output_rate.adapter.mutants.Mutant (got {type(found).__name__}): register its mutants there"
        )
    return found


def catalogue(modules: Sequence[str] = ()) -> tuple[Mutant, ...]:
    """Every mutant: the reference's (``adapter/mutants.py``), then those of each catalogue
    module of ``modules`` in order (``load_mutants``; e.g. ``("article_mutants",)``)."""
    return MUTANTS + tuple(m for module in modules for m in load_mutants(module))


def _order(name: str) -> tuple[int, int]:
    if name in CHECK_ORDER:
        return (0, CHECK_ORDER.index(name))
    if name in LATE_CHECKS:
        return (2, LATE_CHECKS.index(name))
    return (1, 0)


def hunt_plan(
    mutant: Mutant,
    level: str = "should",
    profile: str = "ci",
    seed: int = 0,
    white_box: bool = False,
    save_dir: Path | None = None,
):
    """(options, planned checks in hunting order) for ``mutant``: the registry's plan of a
    gate run on it, candidate checks only, in the mutant's modes (``async_only``: async
    checks; no ``async_cls``: sync checks), exact-level ones only with ``white_box``."""
    style = parse_config_style(mutant.style) if mutant.style else None
    async_cls = mutant.cls if mutant.async_only else mutant.async_cls
    options = gate_row.GateOptions(
        scheduler_cls=mutant.cls,
        async_scheduler_cls=async_cls,
        level=level,
        profile=profile,
        seed=seed,
        style=style,
        integer_rates=mutant.integer_rates,
        sync_only=async_cls is None,
        spec_health=False,
        save_dir=save_dir,
    )
    planned = []
    for item in registry.plan(options):
        row = item.row
        if item.skip is not None or row.part != "candidate":
            continue
        if not white_box and row.level == "exact":
            continue
        if mutant.async_only and row.mode == "sync":
            continue
        planned.append(item)
    planned.sort(key=lambda item: _order(item.row.name))
    return options, planned


def _is_black_box(result) -> bool:
    return not result.name.startswith("white-box/") and result.failed_level != "exact"


def _named_rule(failure: str | None) -> str | None:
    match = _RULE_IN_FAILURE.search(failure or "")
    return match.group(1) if match else None


def _base_passes(mutant: Mutant, result, level: str, options) -> bool | None:
    """Re-run the saved counterexample of ``result`` on the mutant's base class: True if
    the base passes it (the kill is the slip's), None if it cannot be re-run."""

    async_mode = result.name.endswith("/async")
    base = mutant.base_async_cls if async_mode else mutant.base_cls
    if base is None:
        return None
    if result.name.startswith("engine-wait/"):
        return run_engine_wait(base, style=options.style, seed=options.seed).failure is None
    if result.saved is None:
        return None
    family = result.name.split("/")[0]
    if family == "lora-slots":  # a StepScenario of the LoRA-slot check (adapter/lora_slots.py)
        step = StepScenario.from_json(scenario_text(result.saved))
        return run_lora(base, LoraScenario(step.config, step.events), options.style).failure is None
    try:
        scenario = Scenario.from_json(scenario_text(result.saved))
    except (TypeError, KeyError, ValueError):
        return None  # not a rate-limit scenario (a step scenario of another check)
    if family == "feature-off":
        return run_feature_off(base, scenario, options.style).failure is None
    if family == "not-binding":
        return run_not_binding(base, scenario, options.style).failure is None
    if family in ("rate-limit", "invariants", "boundaries"):
        return run_scenario(base, scenario, level, options.style).failure is None
    return None  # a check whose scenarios this module does not know how to re-run


def kill(
    mutant: Mutant,
    level: str = "should",
    profile: str = "ci",
    seed: int = 0,
    white_box: bool = False,
    check_base: bool = True,
) -> MutantResult:
    """Run the gate's candidate checks on ``mutant`` (``hunt_plan``) until one rejects it.

    A mutant whose slip is a defect only from a higher level (``Mutant.level``) is not
    hunted: its row says ``not_judged`` ("not a defect below exact")."""

    started = time.monotonic()
    based_on = "article_style" if mutant.style else "reference"
    if not includes(level, getattr(mutant, "level", "must")):
        return MutantResult(
            mutant.name, mutant.rule, False, 0.0, based_on=based_on, not_judged=f"not a defect below {mutant.level}"
        )
    spurious: list[str] = []  # failures the base class shares (a gate or base defect, reported)
    shortfall: str | None = None  # the coverage row's failure: obligations not reached, not a kill
    with tempfile.TemporaryDirectory(prefix=f"outrate-mutant-{mutant.name}-") as tmp:
        options, planned = hunt_plan(mutant, level, profile, seed, white_box, Path(tmp))
        for n, item in enumerate(planned, 1):
            result = gate_row.run_planned(item, options, lambda: None)
            if result.result != "fail":
                continue
            if result.coverage is not None:  # obligations not reached: nothing the mutant did wrong
                shortfall = result.failure
                continue
            events = sum(1 for line in result.counterexample if not line.startswith("config:"))
            row = MutantResult(
                mutant.name,
                mutant.rule,
                True,
                0.0,
                events,
                _named_rule(result.failure),
                result.name,
                result.failure,
                list(result.counterexample),
                result.failed_level or result.level,
                _is_black_box(result),
                None,
                based_on,
                n,
            )
            row.seconds = time.monotonic() - started  # the base re-run is not part of the kill
            if check_base:
                row.base_passes = _base_passes(mutant, result, level, options)
                if row.base_passes is False:  # the base fails it too: not this slip's kill; hunt on
                    spurious.append(f"{result.name}: {result.failure}")
                    continue
            row.spurious = spurious
            return row
    return MutantResult(
        mutant.name,
        mutant.rule,
        False,
        time.monotonic() - started,
        based_on=based_on,
        checks_run=len(planned),
        spurious=spurious,
        coverage_shortfall=shortfall,
    )


def kill_all(
    level: str = "should",
    profile: str = "ci",
    seed: int = 0,
    white_box: bool = False,
    tick: Callable[[str], None] = lambda name: None,
    mutants: tuple[Mutant, ...] | None = None,
) -> list[MutantResult]:
    """``kill`` every mutant of ``mutants`` (default: the whole catalogue); ``tick`` is
    called with each mutant's name before it is hunted."""
    results = []
    for mutant in catalogue() if mutants is None else mutants:
        tick(mutant.name)
        results.append(kill(mutant, level, profile, seed, white_box))
    return results


def first_failure(mutant: Mutant, strategy, examples: int, seed: int, level: str = "should"):
    """The first scenario of ``strategy`` (``examples`` seeded Hypothesis examples, no
    shrinking) on which ``mutant`` fails, or None: the discovery tests' probe."""

    style = parse_config_style(mutant.style) if mutant.style else None
    cls = mutant.cls
    found: dict = {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
        print_blob=False,
        report_multiple_bugs=False,
    )
    @hseed(seed)
    @given(scenario=strategy)
    def prop(scenario):
        if "scenario" in found:
            return
        cls_here = mutant.async_cls if scenario.async_scheduling and mutant.async_cls else cls
        if run_scenario(cls_here, scenario, level, style).failure is not None:
            found["scenario"] = scenario

    prop()
    return found.get("scenario")
