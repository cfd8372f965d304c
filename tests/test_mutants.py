"""The gate rejects the mutants of its catalogue, black-box, naming a rule.

The catalogue (``adapter/mutation.py`` ``catalogue(modules)``) is the reference's mutants
(``adapter/mutants.py``) plus those of the catalogue modules the caller names; here, as in
``outrate conform --mutants --path tests/fixtures --mutants-from article_mutants``, the
mutants of the independent article-style implementation (``tests/fixtures/article_mutants.py``,
no observation interface, registered as its ``MUTANTS``). The whole catalogue is hunted by
``outrate conform --mutants --no-white-box`` (minutes); here: its shape, a representative
subset of kills (marker ``ci``), and Hypothesis-style discovery rates.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from vllm_output_rate.adapter.budgets import gate_budget
from vllm_output_rate.adapter.mutants import MUTANTS
from vllm_output_rate.adapter.mutation import catalogue, first_failure, hunt_plan, kill
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.adapter.scenario_strategies import scenarios
from vllm_output_rate.adapter.scenarios import Scenario

QUICK = gate_budget("quick")
RULES = tuple(f"R{i}" for i in range(1, 19))

FIXTURES = str(Path(__file__).resolve().parent / "fixtures")
if FIXTURES not in sys.path:  # the article-style mutants' catalogue module (and engine-wait's children)
    sys.path.insert(0, FIXTURES)
ARTICLE_MUTANTS_MODULE = "article_mutants"
CATALOGUE = catalogue((ARTICLE_MUTANTS_MODULE,))  # imports article_style, which installs the article's engine flags
_article_engine = importlib.import_module("article_style.engine")  # importable now
_article_flags = importlib.import_module("article_style.flags")

_article_flags.uninstall()  # stock vLLM for the modules collected after this one
BY_NAME = {m.name: m for m in CATALOGUE}


@pytest.fixture(scope="module", autouse=True)
def _article_flags_installed():
    """The article's flags on vLLM's EngineArgs while these tests run (the engine-args
    style needs them), undone afterwards."""
    _article_flags.install()
    yield
    _article_flags.uninstall()
    _article_engine.uninstall()


# -- the catalogue -----------------------------------------------------------------------------
def test_catalogue_has_40_mutants_half_on_article_style_covering_r1_to_r18():
    article = [m for m in CATALOGUE if m.style is not None]
    assert len(CATALOGUE) >= 40
    assert len(article) >= 20 and len(article) * 2 >= len(CATALOGUE)
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)
    assert set(RULES) <= {m.rule for m in CATALOGUE}, sorted(set(RULES) - {m.rule for m in CATALOGUE})
    for m in article:
        assert (m.style, m.integer_rates) == ("engine-args", True), m.name
        assert m.base_cls == "article_style.scheduler.ArticleScheduler"
        assert m.cls.startswith("article_mutants."), m.name


def test_article_mutants_have_no_observation_interface():
    from vllm_output_rate.adapter.harness import load_class

    for m in CATALOGUE:
        if m.style is None:
            continue
        for path in filter(None, (m.cls, m.async_cls)):
            cls = load_class(path)
            assert not hasattr(cls, "last_step_observation"), path
            assert cls.__module__ == "article_mutants"


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_every_mutant_docstring_names_its_rule_and_slip(mutant):
    doc = mutant.load().__doc__ or ""
    assert re.search(rf"\b{mutant.rule}\b", doc.splitlines()[0]), doc
    slip = re.search(r"^\s*Slip: (.+)", doc, re.MULTILINE)
    assert slip and len(slip.group(1).split()) >= 5, f"{mutant.name}: no 'Slip:' line saying which slip it models"


@pytest.mark.slow
def test_the_adapter_loads_a_mutant_catalogue_module_only_when_the_caller_names_it():
    import os
    import subprocess

    code = "\n".join(
        [
            "import sys",
            "from vllm_output_rate.adapter import mutation",
            "n = len(mutation.catalogue())",
            "assert 'article_style' not in sys.modules",
            "try:",
            "    mutation.load_mutants('article_mutants')",
            "except ImportError as exc:",
            "    assert 'article_mutants' in str(exc) and '--path' in str(exc), exc",
            "else:",
            "    raise AssertionError('loaded without its directory on the path')",
            f"sys.path.insert(0, {FIXTURES!r})",
            "print(n, len(mutation.catalogue(('article_mutants',))))",
        ]
    )
    env_path = [p for p in sys.path if p and p != FIXTURES and not p.endswith("tests/fixtures")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(env_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    ref, total = map(int, out.stdout.split()[-2:])
    assert ref == len(MUTANTS) and total == len(CATALOGUE)


def test_a_catalogue_module_without_a_mutants_tuple_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'json' has no MUTANTS tuple"):
        catalogue(("json",))


def test_no_adapter_module_names_the_tests_folder():
    # The catalogue is handed in by the caller (--mutants-from, the tests): no adapter code
    # path (docstrings aside) points into tests/.
    import ast

    adapter = Path(__file__).resolve().parent.parent / "adapter"
    named = []
    for path in sorted(adapter.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            if literal and re.search(r"(^|/)tests(/|$)", node.value):
                named.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert named == []


def test_hunt_plan_uses_the_registry_without_white_box_cheapest_first():
    options, planned = hunt_plan(BY_NAME["ArticleNoRotation"], "exact", "ci", 0, white_box=False)
    names = [p.row.name for p in planned]
    assert not any(n.startswith("white-box/") for n in names)
    assert names.index("rate-limit/sync") < names.index("engine-wait/sync")
    assert names[-2:] == ["engine-wait/sync", "engine-wait/async"]
    assert options.integer_rates and options.style is not None and options.style.name == "engine-args"
    _, with_white = hunt_plan(BY_NAME["NoRotation"], "exact", "ci", 0, white_box=True)
    assert [p.row.name for p in with_white][-1] == "white-box/sync"
    _, async_only = hunt_plan(BY_NAME["ArticleAsyncInFlightFree"], "should", "ci", 0)
    assert all(p.row.mode != "sync" for p in async_only)


# -- kills (a representative subset; the whole catalogue: outrate conform --mutants) ------------
CI_SUBSET = (
    "ArticleFirstTokenFree",  # R7, over-grant (invariants/sync)
    "ArticleOverridesIgnored",  # R1
    "ArticleAsyncInFlightFree",  # R8, async only
    "ArticleIdLowercased",  # R17, under-grant (rate-limit/sync)
    "ArticlePreemptThrottled",  # R11 should: preempted although KV is ample
    "ArticleRunningLoopIgnoresCap",  # R12 should: more than A running scheduled
    "ArticleNoRotation",  # R14 should: bounded bypass
    "ArticleRotatesWhenOff",  # R18: feature off differs from stock
    "RollingWindow",  # reference, R2
    "DropThrottled",  # reference, R11
)


@pytest.mark.slow
@pytest.mark.parametrize("name", CI_SUBSET)
def test_mutant_is_killed_black_box_in_profile_ci(name):
    mutant = BY_NAME[name]
    result = kill(mutant, "should", "ci", seed=0, white_box=False)
    assert result.killed, f"{name} ({mutant.rule}) survived: {result.spurious}"
    assert result.black_box and result.base_passes is True, result.failure
    assert result.killed_by and (result.killed_by.startswith("R") or result.killed_by == "crash")
    assert result.level in ("must", "should")
    assert result.counterexample and result.counterexample_events <= 12, result.counterexample


# -- discovery rates ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["RefundDispatched", "BudgetPerRequest"])
def test_r9_r2_discovery_at_least_95_of_100_seeds_in_profile_quick(name):
    # In the style of Hypothesis's own discovery tests: the bug must be found in >= 95 of
    # 100 independent seeds with the quick profile's budget (pressured scenarios for R9,
    # where refunds happen; ample ones for R2), black-box (level should).
    mutant = BY_NAME[name]
    from vllm_output_rate.adapter.scenario_strategies import pressured_scenarios

    strategy = (pressured_scenarios if name == "RefundDispatched" else scenarios)(
        async_scheduling=False, max_steps=QUICK.max_steps
    )
    found = sum(first_failure(mutant, strategy, QUICK.pressured, seed) is not None for seed in range(100))
    assert found >= 95, f"{name} found in only {found}/100 seeds"


# The item-1 boundaries' own examples: T not a whole ns, ready_at rounded down by 1 ns,
# cleanup at TAT = now + 1 ns (and within tau), `<` instead of `<=` at the burst edge.
BOUNDARY_ONLY = (
    "ArticleTruncatedInterval",
    "ArticleReadyAtRoundedDown",
    "ArticleCleanupOneNsAhead",
    "ArticleCleanupWithinBurst",
    "ArticleBurstEdgeStrict",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", BOUNDARY_ONLY)
def test_boundary_mutant_discovery_at_least_95_of_100_seeds_in_profile_quick(name, monkeypatch):
    """Boundary-only slips (1 ns at an edge, a fractional emission interval, cleanup at
    TAT = now + 1 ns): the ``boundaries/sync`` check of profile quick finds each in >= 95
    of 100 seeds, black-box. Discovery only: the rule a failure names (its probes) is left
    to the naming tests (tests/test_naming.py)."""
    boundaries = pytest.importorskip("vllm_output_rate.adapter.boundaries")
    monkeypatch.setattr(boundaries, "named_verdict", run_scenario)
    mutant = BY_NAME[name]
    found = 0
    for seed in range(100):
        options, planned = hunt_plan(mutant, "should", "quick", seed)
        check = next(p for p in planned if p.row.name == "boundaries/sync")
        result = check.row.observe(options, lambda: None)
        found += result.result == "fail"
    assert found >= 95, f"{name} found in only {found}/100 seeds"


def test_r9_counterexample_of_a_mutant_replays_from_json():
    mutant = BY_NAME["RefundDispatched"]
    from vllm_output_rate.adapter.scenario_strategies import pressured_scenarios

    scenario = first_failure(mutant, pressured_scenarios(async_scheduling=False, max_steps=10), 50, 3)
    assert scenario is not None
    again = Scenario.from_json(scenario.to_json())
    assert again == scenario
    assert run_scenario(mutant.cls, again, "should").failure is not None
    assert run_scenario(mutant.base_cls, again, "should").failure is None


# -- levels: a slip that is a defect only at exact is not hunted below it --------------------------
EXACT_ONLY = {"HeadOfLineBlocking", "ChargePromptChunks"}


def test_mutants_that_are_correct_below_exact_are_not_hunted_there():
    assert {m.name for m in CATALOGUE if m.level == "exact"} == EXACT_ONLY
    for name in EXACT_ONLY:
        mutant = BY_NAME[name]
        assert "level exact" in (mutant.load().__doc__ or ""), name
        for level in ("must", "should"):
            row = kill(mutant, level, "ci", seed=0)
            assert not row.killed and not row.survived and row.checks_run == 0
            assert row.not_judged == "not a defect below exact"
            assert row.as_json()["not_judged"] == "not a defect below exact"
    assert all(m.level == "must" for m in CATALOGUE if m.name not in EXACT_ONLY | SHOULD_ONLY)


# Slips that break only a design rule (R5 through the engine wait, R10-R16) and none of the
# article's promises: defects from level should, not hunted at must.
SHOULD_ONLY = {
    "NoPrefillAdvance",
    "NoActiveCapInRunningLoop",
    "ThrottledNotPreferredVictims",
    "ReadyAtRoundedDown",
    "WaitHintFromLatestUser",
    "ArticleRunningLoopIgnoresCap",
    "ArticleNoEngineWait",
    "ArticleOversleep",
    "ArticleSleepsForBudget",
    "ArticleVictimAcrossPriorities",
    "ArticleNoRotation",
    "ArticleLastServedLost",
    # issue 26's blind spots that break only a design rule
    "ArticleAdmitsOnePastCap",
    "ArticleSplitsPromptWhenChunkedOff",
    "ArticleRunningPrefillWaits",
    "ArticleRefusedWaitingEndsLoop",
    "ArticlePriorityVictimNotThrottled",
    "ArticleRotationMovesToFront",
}


def test_design_rule_only_mutants_are_should_level_and_not_hunted_at_must():
    assert {m.name for m in CATALOGUE if m.level == "should"} == SHOULD_ONLY
    for name in ("NoActiveCapInRunningLoop", "ArticleNoRotation"):
        row = kill(BY_NAME[name], "must", "ci", seed=0)
        assert not row.killed and not row.survived and row.checks_run == 0
        assert row.not_judged == "not a defect below should"


@pytest.mark.rules("R13")
def test_r13_priority_variant_boundary_kills_a_throttled_victim_taken_across_levels():
    # U1 (refused, priority 0) above V1, V2 (priority 1): vLLM's victim level is 1; the
    # article prefers throttled victims only within it, the slip at any level.
    from vllm_output_rate.adapter import boundaries
    from vllm_output_rate.adapter.configstyle import parse_config_style
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    mutant, style = BY_NAME["ArticleVictimAcrossPriorities"], parse_config_style("engine-args")
    for async_mode in (False, True):
        scenario = boundaries._solved("priority-throttled-victim-above", "5", async_mode, 0)
        cls, base = (mutant.async_cls, mutant.base_async_cls) if async_mode else (mutant.cls, mutant.base_cls)
        verdict = run_scenario(cls, scenario, "should", style)
        assert (verdict.rule, verdict.level) == ("R13", "should"), verdict
        assert "preempted u-r0 (priority 0)" in verdict.failure
        assert run_scenario(base, scenario, "should", style).failure is None
        assert (
            run_scenario(REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER, scenario, "should").failure
            is None
        )


def test_verdict_line_says_gate_too_weak_when_a_judged_mutant_survives():
    # `outrate conform --mutants` exits 1 when a mutant survives; its last line must say so,
    # never "ACCEPTED" (a mutant not judged at the level is neither killed nor a survivor).
    from types import SimpleNamespace

    from vllm_output_rate.cli_conform_report import _verdict_line

    results = [SimpleNamespace(part="candidate", result="pass", name="rate-limit/sync")]
    rows = [
        {"mutant": "A", "killed": True},
        {"mutant": "B", "killed": False},
        {"mutant": "C", "killed": False, "not_judged": "not a defect below should"},
    ]
    line = _verdict_line(results, "must", rows, 1.0)
    assert line.endswith("-- GATE TOO WEAK: 1 mutant(s) survived: B"), line
    assert "1/2 mutants killed (1 not a defect at this level)" in line
    assert _verdict_line(results, "must", rows[::2], 1.0).endswith("-- ACCEPTED")


def test_a_mutant_rejected_only_by_coverage_is_a_survivor_with_the_shortfall(monkeypatch):
    # `coverage` names obligations the hunt's checks did not reach, not something the mutant
    # did wrong: a mutant that passes every other check survives (GATE TOO WEAK), and its
    # row says what coverage was short of.
    from vllm_output_rate.adapter import gate_row, mutation, registry
    from vllm_output_rate.adapter.gate_result import CheckResult
    from vllm_output_rate.cli_conform_report import _verdict_line

    passing = gate_row.GateRow(
        "rate-limit/sync", "must", ("R2",), "sync", lambda b: 1, lambda call: CheckResult("rate-limit/sync", ["R2"])
    )
    planned = [gate_row.PlannedRow(passing), gate_row.PlannedRow(registry._coverage_row())]
    options = gate_row.GateOptions("pkg.Mutant", sync_only=True, profile="quick", spec_health=False)
    monkeypatch.setattr(mutation, "hunt_plan", lambda *args, **kwargs: (options, planned))
    row = kill(BY_NAME["NoRefund"], "should", "quick", seed=0)
    assert not row.killed and row.survived and row.checks_run == 2
    assert row.coverage_shortfall and row.coverage_shortfall.startswith("[must] coverage: not reached: ")
    assert row.as_json()["coverage_shortfall"] == row.coverage_shortfall
    results = [CheckResult("rate-limit/sync", ["R2"])]
    assert _verdict_line(results, "should", [row.as_json()], 1.0).endswith(
        "GATE TOO WEAK: 1 mutant(s) survived: NoRefund"
    )
