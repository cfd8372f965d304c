"""The pytest plugin runs the gate inside another project's test suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, STOCK_SCHEDULER


def _pytest(tmp_path, *args):
    (tmp_path / "test_patch.py").write_text("def test_own():\n    assert sum([1, 1]) == 2\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path / "test_patch.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


# The plugin's items are the gate's planned rows; a test here selects a few with ``-k`` (a
# whole gate run costs minutes). That every planned row passes the reference is asserted by
# tests/test_gate.py::test_cli_conform_quick_writes_json_and_rejects_stock (the CLI, the same
# rows), and that the plugin gives the CLI's verdict row for row by
# tests/test_levels.py::test_plugin_gives_the_cli_verdicts.
PLUGIN_SUBSET = "test_own or modes or rate-limit or feature-off"


@pytest.mark.rules("R2")
def test_r2_plugin_passes_the_reference(tmp_path):
    run = _pytest(
        tmp_path,
        f"--outrate-scheduler={REFERENCE_SCHEDULER}",
        f"--outrate-async-scheduler={REFERENCE_ASYNC_SCHEDULER}",
        "-k",
        PLUGIN_SUBSET,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    from vllm_output_rate.adapter import gate_row, registry

    planned = registry.plan(
        gate_row.GateOptions(REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, profile="quick", spec_health=False)
    )
    selected = [p for p in planned if p.row.name.split("/")[0] in ("rate-limit", "feature-off")]
    assert len(selected) == 4, [p.row.name for p in planned]  # sync and async of each
    assert f"{len(selected) + 2} passed" in run.stdout  # the patch's own test, the mode matrix, the selected checks


@pytest.mark.rules("R2")
def test_r2_plugin_rejects_stock_vllm_with_counterexample(tmp_path):
    run = _pytest(tmp_path, f"--outrate-scheduler={STOCK_SCHEDULER}", "-k", "rate-limit and not async")
    assert run.returncode == 1
    assert "rate-limit/sync FAILED: [must] R2" in run.stdout
    assert "counterexample:" in run.stdout


def test_plugin_adds_nothing_without_the_option_and_loads_no_vllm(tmp_path):
    run = _pytest(tmp_path)
    assert run.returncode == 0 and "1 passed" in run.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, vllm_output_rate.pytest_plugin; "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--outrate-scheduler=nosuch.mod.Cls"], "--outrate-scheduler=nosuch.mod.Cls: No module named 'nosuch'"),
        (
            [f"--outrate-scheduler={REFERENCE_SCHEDULER}", "--outrate-async-scheduler=collections.OrderedDict"],
            "--outrate-async-scheduler=collections.OrderedDict: collections.OrderedDict is not a vLLM scheduler class",
        ),
        (
            [f"--outrate-scheduler={REFERENCE_ASYNC_SCHEDULER}", "--outrate-sync-only"],
            f"--outrate-scheduler={REFERENCE_ASYNC_SCHEDULER} is an AsyncScheduler: give it as --outrate-async-scheduler",
        ),
    ],
)
def test_plugin_refuses_a_class_it_cannot_judge_as_a_usage_error(tmp_path, args, named):
    """A bad class path is the operator's mistake: a pytest usage error (exit 4) naming the
    option, no check run, no counterexample saved; not a candidate crash."""
    run = _pytest(tmp_path, *args)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert named in run.stderr
    assert any(why in run.stderr for why in ("set PYTHONPATH", "not a vLLM scheduler", "is an AsyncScheduler:"))
    assert not (tmp_path / "reports").exists()


def test_plugin_stops_before_any_check_when_engine_args_refuse_fractional_rates(tmp_path):
    """The article's flags parse integer rates: without --outrate-integer-rates every
    scenario with a fractional rate would read as a candidate crash, so the run stops with a
    usage error naming the option instead; with it, the checks run."""
    fixtures = Path(__file__).parent / "fixtures"
    common = [
        f"-opythonpath={fixtures}",
        "--outrate-scheduler=article_style.scheduler.ArticleScheduler",
        "--outrate-config-style=engine-args",
        "--outrate-sync-only",
        "--outrate-level=must",
    ]
    run = _pytest(tmp_path, *common)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--outrate-integer-rates: the candidate's engine arguments refuse the fractional rate 3.5" in run.stderr
    assert "got 3.5" in run.stderr and not (tmp_path / "reports").exists()
    run = _pytest(tmp_path, *common, "--outrate-integer-rates", "-k", "rate-limit")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]


def test_a_warning_passes_with_a_gate_warning_and_a_refused_mode_is_skipped():
    from vllm_output_rate.adapter.gate_result import CheckResult
    from vllm_output_rate.pytest_plugin import outcome

    assert outcome(CheckResult("not-binding/sync", ["R19"], result="warning")) == "warn"
    assert outcome(CheckResult("lora-slots/sync", ["R13"], result="not applicable")) == "skip"
    assert outcome(CheckResult("coverage", [], result="not judged")) == "skip"
    assert outcome(CheckResult("rate-limit/sync", ["R2"], result="fail")) == "fail"
    assert outcome(CheckResult("rate-limit/async", ["R2"], result="not tested")) == "fail"
    assert outcome(CheckResult("modes", ["R18"])) == "pass"
