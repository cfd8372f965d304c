"""Every gate check that can fail saves a file whose printed re-run line reproduces it.

For each check kind (the candidate rows of ``adapter/registry.py``, sync and async, and
the crash rows) a known-wrong candidate of the project's own catalogue (adapter/mutants.py,
tests/fixtures/*candidates*.py, tests/fixtures/article_mutants.py) is judged by the gate's
own row (``gate_row.run_planned``, profile quick, seed 0); the ``re-run:`` line the gate
prints for the failure is run as printed, in a shell from the directory the gate ran in:
it must end ``FAIL`` with exactly the row's failure (level, rule and message), so a replay
that judged another check than the one that saved the file fails this test. The same line
with the reference class (``--scheduler-cls``, given after the file's) must end ``PASS``
naming the rule the reference keeps.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_output_rate import gate_plan
from vllm_output_rate.adapter import counterexample, gate_row
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = "tests/fixtures"
GATE = "gate_candidates"
ARTICLE = "article_style.scheduler"

# (row, class under test, level of the run, configured as the article's flags[, seed: default 0])
CASES = [
    ("rate-limit/sync", f"{GATE}.FirstTokenFree", "should", False),
    ("rate-limit/async", f"{GATE}.FirstTokenFreeAsync", "should", False),
    ("invariants/sync", "vllm_output_rate.adapter.mutants.RefundDispatched", "should", False),
    ("invariants/async", f"{GATE}.GrantWhenAllRefusedAsync", "should", False),
    ("boundaries/sync", f"{GATE}.BurstEdgeStrict", "should", False),
    ("boundaries/async", f"{GATE}.BurstEdgeStrictAsync", "should", False),
    ("feature-off/sync", f"{GATE}.RotatesWhenOff", "should", False),
    ("feature-off/async", f"{GATE}.RotatesWhenOffAsync", "should", False),
    ("not-binding/sync", f"{GATE}.SwapRotation", "should", False),
    ("not-binding/async", f"{ARTICLE}.ArticleAsyncScheduler", "should", True),
    ("engine-wait/sync", "article_mutants.ArticleNoEngineWait", "should", True),
    ("engine-wait/async", "article_mutants.ArticleNoEngineWaitAsync", "should", True),
    ("lora-slots/sync", "lora_candidates.NoLoraVictim", "should", False),
    ("lora-slots/async", "lora_candidates.NoLoraVictimAsync", "should", False),
    ("lora-slots/sync", "lora_candidates.NoLoraCount", "should", False, 3),  # a crash row (vLLM's max_loras assert)
    ("fair-residency/sync", "r20_candidates.NoResidencyCap", "exact", False),
    ("fair-residency/async", "r20_candidates.NoResidencyCapAsync", "exact", False),
    ("rate-change/sync", "r21_candidates.IgnoreRateChanges", "exact", False),
    ("white-box/sync", f"{GATE}.FirstTokenFree", "exact", False),
    ("white-box/async", f"{GATE}.FirstTokenFreeAsync", "exact", False),
]


# The cases whose printed line runs in a real shell (a fresh process, each costing a vLLM import);
# the others run the same printed line in this process. One of each config style and mode.
IN_A_SHELL = {
    ("rate-limit/sync", f"{GATE}.FirstTokenFree"),
    ("not-binding/async", f"{ARTICLE}.ArticleAsyncScheduler"),
    ("lora-slots/sync", "lora_candidates.NoLoraCount"),
}


def _gate_row(row: str, cls: str, level: str, article: bool, seed: int, save_dir: Path):
    """The gate's row ``row`` on ``cls`` (profile quick, ``seed``), its failure saved in ``save_dir``."""
    from vllm_output_rate.adapter.configstyle import parse_config_style

    is_async = row.endswith("/async")
    options = gate_row.GateOptions(
        scheduler_cls=REFERENCE_SCHEDULER if is_async else cls,
        async_scheduler_cls=cls if is_async else None,
        level=level,
        profile="quick",
        seed=seed,
        style=parse_config_style("engine-args") if article else None,
        integer_rates=article,
        save_dir=save_dir,
        paths=(FIXTURES,),
    )
    spec = next(s for s in gate_plan.registry() if s.name == row)
    return gate_row.run_planned(gate_row.PlannedRow(spec), options, lambda: None), options


def _printed_rerun(result, options) -> str:
    """The ``re-run:`` line ``outrate conform`` prints under the failed row."""
    from vllm_output_rate import cli_common, cli_conform_report

    with cli_common.console.capture() as captured:
        cli_conform_report._print_failures([result], cli_conform_report._gate_command(options, "additional-config"))
    lines = [line.strip() for line in captured.get().splitlines() if line.strip().startswith("re-run: ")]
    assert len(lines) == 1, captured.get()
    return lines[0].removeprefix("re-run: ")


def _shell(line: str) -> subprocess.CompletedProcess:
    """``line`` pasted into a shell in the repository root, with this environment's ``outrate`` first on PATH."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)  # the file's --path is what puts the candidate on the path
    return subprocess.run(line, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{r}-{c.rpartition('.')[2]}" for r, c, *_ in CASES])
def test_saved_counterexample_replays_the_check_that_saved_it(case, tmp_path, monkeypatch, request):
    row, cls, level, article, *rest = case
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / FIXTURES))
    if article or cls.startswith("article_mutants"):
        request.getfixturevalue("article_flags")  # article_style installs its flags on vLLM's EngineArgs
    result, options = _gate_row(row, cls, level, article, rest[0] if rest else 0, tmp_path)
    assert result.result in ("fail", "warning") and result.saved, (row, result.result, result.failure)
    rule = counterexample.rule_of(result.failure)  # None for white box: its text names the field, not a rule
    assert rule is not None or row.startswith("white-box/"), result.failure

    line = _printed_rerun(result, options)
    if (row, cls) in IN_A_SHELL:  # pasted into a shell: the quoting, the PATH, a fresh process
        failed = _shell(line)
        code, stdout, stderr = failed.returncode, failed.stdout, failed.stderr
    else:  # the same printed line, split as a shell splits it, run in this process (no vLLM import again)
        words = shlex.split(line)
        assert words[:2] == ["outrate", "replay"], line
        ran = CliRunner().invoke(main, words[1:])
        code, stdout, stderr = ran.exit_code, ran.output, repr(ran.exception)
    out = stdout.strip().splitlines()
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    assert out[-1] == f"FAIL {result.failure}", (line, out[-1], result.failure)
    assert out[0].startswith(f"replaying {row} "), out[0]
    print(f"{row} | {cls} | {line} | exit {code} | {out[-1][:160]}")  # the table of check kinds (-rP)

    reference = REFERENCE_ASYNC_SCHEDULER if row.endswith("/async") else REFERENCE_SCHEDULER
    again = [*shlex.split(line)[1:], "--scheduler-cls", reference, "--config-style", "additional-config"]
    fixed = CliRunner().invoke(main, again)
    assert fixed.exit_code == 0, fixed.output[-3000:]
    keeps = {"crash": "runs this scenario without crashing", None: "now passes this check on this scenario"}.get(
        rule, f"now keeps {rule} on this scenario"
    )
    last = fixed.output.strip().splitlines()[-1]
    assert last.startswith(f"PASS {row}: {reference.rpartition('.')[2]} {keeps}"), last


def test_path_takes_the_package_directory_or_the_one_above_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    classes = (f"{ARTICLE}.ArticleScheduler", None)
    assert gate_plan.import_dirs(("tests/fixtures/article_style",), classes) == ("tests/fixtures",)
    assert gate_plan.import_dirs(("tests/fixtures",), classes) == ("tests/fixtures",)
    assert gate_plan.import_dirs(("tests/fixtures/article_style",), ("other.mod.Cls",)) == (
        "tests/fixtures/article_style",
    )


def test_a_class_that_does_not_import_names_the_directory_that_works(monkeypatch):
    # Before: "No module named 'article_style' (is its directory on the path? give --path DIR)"
    # even with --path tests/fixtures/article_style given.
    monkeypatch.chdir(ROOT)
    hint = gate_plan.package_hint("article_style.scheduler.ArticleScheduler")
    assert hint == " (article_style is a package in tests/fixtures: give --path tests/fixtures)"
    assert "the directory that holds the package no_such_pkg" in gate_plan.package_hint("no_such_pkg.m.C", limit=50)


def _counterexample_file(tmp_path, **changes) -> Path:
    """A counterexample file of the current format (a rate-limit row), sections replaced by ``changes``."""
    import json

    from test_gate import one_stream_of_8_tokens_at_10_tok_s

    scenario = json.loads(
        one_stream_of_8_tokens_at_10_tok_s(prompt_len=3, step_interval_ns=10_000_000, num_steps=61).to_json()
    )
    data = {
        "format": counterexample.FORMAT,
        "format_version": counterexample.FORMAT_VERSION,
        "check": {"name": "rate-limit/sync", "judged_at": "should", "rule": "R2", "failed_level": "must",
                  "compares_with": counterexample.LIMITER_ORACLE, "failure": "[must] R2: step 2: over", "note": ""},
        "gate": {"config_style": "additional-config", "seed": 0, "vllm": "0.32.0", "outrate": "0.1.0"},
        "candidate": {"class": "vllm.v1.core.sched.scheduler.Scheduler", "paths": []},
        "scenario": scenario,
    }  # fmt: skip
    data.update(changes)
    path = tmp_path / "counterexample-rate-limit-sync.json"
    path.write_text(json.dumps(data))
    return path


def test_a_file_of_a_newer_format_names_the_release_that_wrote_it(tmp_path):
    path = _counterexample_file(tmp_path, format_version=99, gate={"outrate": "9.9.9"})
    run = CliRunner().invoke(main, ["replay", str(path)])
    assert run.exit_code == 2, run.output
    said = " ".join(run.output.split())
    assert "written by outrate 9.9.9 (counterexample format 99)" in said and "install outrate 9.9.9" in said


@pytest.mark.slow
def test_the_file_chooses_the_check_and_an_option_overrides_the_class(tmp_path):
    # Stock vLLM over-grants at 10 tok/s (R2); the file names it, so a bare replay fails it,
    # and --scheduler-cls naming the reference passes.
    path = _counterexample_file(tmp_path)
    run = CliRunner().invoke(main, ["replay", str(path)])
    assert run.exit_code == 1 and run.output.strip().splitlines()[-1].startswith("FAIL [must] R2: step 2:"), run.output
    assert run.output.startswith("replaying rate-limit/sync (level should;"), run.output
    fixed = CliRunner().invoke(main, ["replay", str(path), "--scheduler-cls", REFERENCE_SCHEDULER])
    assert fixed.exit_code == 0, fixed.output
    assert fixed.output.strip().splitlines()[-1] == (
        "PASS rate-limit/sync: RateLimitedScheduler now keeps R2 on this scenario (the gate's row failed: [must] R2)"
    )


def test_a_bare_scenario_file_of_outrate_conform_says_it_names_no_check(tmp_path):
    import json

    path = _counterexample_file(tmp_path)
    path.write_text(json.dumps(json.loads(path.read_text())["scenario"]))  # the format outrate 0.1.0 saved
    run = CliRunner().invoke(main, ["replay", str(path)])
    assert run.exit_code == 0, run.output  # judged on the reference, as before
    assert "names no check (saved by outrate 0.1.0 or earlier)" in " ".join(run.output.split())


def test_the_coverage_row_says_it_saves_no_scenario_and_gives_the_gate_command():
    from vllm_output_rate import cli_common, cli_conform_report
    from vllm_output_rate.adapter.gate_result import CheckResult

    row = CheckResult("coverage", ["R2"], result="fail", failure="[must] coverage: 1 obligation not reached")
    row.coverage = {"not_reached": ["boundary: burst-edge (0/1)"]}
    options = gate_row.GateOptions(scheduler_cls="pkg.Sched", profile="quick", seed=7, paths=("tests/fixtures",))
    with cli_common.console.capture() as captured:
        cli_conform_report._print_failures([row], cli_conform_report._gate_command(options, "engine-args"))
    out = " ".join(captured.get().split())
    assert "no scenario to save: coverage counts the obligations the whole run's checks reached" in out
    assert (
        "re-run: outrate conform --scheduler-cls pkg.Sched --sync-only --path tests/fixtures --config-style "
        "engine-args --level should --profile quick --seed 7"
    ) in out


def test_the_scenario_of_a_counterexample_file_reads_as_the_bare_scenario(tmp_path):
    # adapter/mutation.py re-runs a kill's saved scenario on the mutant's base: a file the
    # gate wrapped (gate_row.run_planned) must give the same scenario as a bare one.
    import json

    from vllm_output_rate.adapter.scenarios import Scenario

    path = _counterexample_file(tmp_path)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(json.loads(path.read_text())["scenario"]))
    assert Scenario.from_json(counterexample.scenario_text(path)) == Scenario.from_json(bare.read_text())
    assert counterexample.scenario_text(bare) == bare.read_text()


def test_the_article_style_verdict_in_the_docs_is_the_generated_table():
    # docs/SPEC.md said the article-style fixture passes --level should at seeds 0-9; the
    # gate rejects it at seed 0. The docs now link the manifest of a run, whose verdict line
    # names exactly the rows its table marks FAIL and WARNING.
    import re

    spec = (ROOT / "docs" / "SPEC.md").read_text()
    table = (ROOT / "docs" / "verdicts" / "article_style_should.md").read_text()
    assert "passes at seeds" not in spec and spec.count("](verdicts/article_style_should.md)") == 2
    assert table.startswith("<!-- Generated from a gate run") and "--level should --markdown" in table
    rows = {m[0]: m[1] for m in re.findall(r"^\| (\S+) +\|.*\| (PASS|FAIL|WARNING|NOT JUDGED) +\|$", table, re.M)}
    verdict = table.rpartition("Verdict line of the run: `")[2]
    failed = verdict.partition("REJECTED: ")[2].partition(" failed")[0].split(", ")
    assert sorted(failed) == sorted(name for name, result in rows.items() if result == "FAIL"), (verdict, rows)
    for name in (name for name, result in rows.items() if result == "WARNING"):
        assert name in verdict.partition("warning(s): ")[2], (name, verdict)


def test_a_white_box_observation_difference_names_the_class_under_test():
    # Before: "refunded (R9): reference [] != spec ['r1']" for any class, the reference or not.
    from types import SimpleNamespace

    from vllm_output_rate.adapter.whitebox import compare_white
    from vllm_output_rate.spec.events import Step

    white = {"now_ns": 5, "charged": ["r1"], "refunded": [], "throttled": [], "wait_hint_ns": None, "tat_ns": {}}
    obs = SimpleNamespace(now_ns=5, charged=["r1"], refunded=["r1"], throttled=[], wait_hint_ns=None, tat_ns={})
    harness = SimpleNamespace(cls_path="pkg.mod.NoRefund")
    failure = compare_white(Step(), SimpleNamespace(white=white), harness, obs, None)
    assert failure == "refunded (R9): NoRefund [] != spec ['r1']"
