"""Conformance levels, the check registry, NOT TESTED rows, R18 on the candidate, and the
pytest plugin giving the CLI's verdicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_output_rate import gate_plan
from vllm_output_rate.adapter import gate_row, registry
from vllm_output_rate.adapter.feature_off import check_feature_off
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, STOCK_SCHEDULER
from vllm_output_rate.adapter.levels import LEVELS, includes
from vllm_output_rate.adapter.scenarios import Hunt

FIXTURES = Path(__file__).parent / "fixtures"
OUTRATE = [sys.executable, "-m", "vllm_output_rate.cli"]
ENV = dict(
    os.environ,
    VLLM_LOGGING_LEVEL="ERROR",
    PYTHONPATH=os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")])),
)


def test_levels_are_ordered_and_bad_level_is_named():
    assert LEVELS == ("must", "should", "exact")
    assert includes("exact", "must") and includes("should", "must") and not includes("must", "should")
    with pytest.raises(ValueError, match="'strict'"):
        includes("strict", "must")


def test_plan_levels_and_parts():
    names = {
        lvl: [p.row.name for p in registry.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y", level=lvl))]
        for lvl in LEVELS
    }
    assert "white-box/sync" in names["exact"] and "white-box/sync" not in names["should"]
    assert "feature-off/sync" in names["must"] and "rate-limit/async" in names["must"]
    parts = {p.row.name: p.row.part for p in gate_plan.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y"))}
    for name in ("limiter-differential", "base-fidelity/sync", "base-fidelity/async", "proofs/z3", "model-check/quick"):
        assert parts[name] == "spec health"
    assert parts["rate-limit/sync"] == "candidate"
    # The adapter alone plans no row of proofs/ (the layers go one way); the top layer adds them last.
    adapter_only = [p.row.name for p in registry.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y"))]
    assert "proofs/z3" not in adapter_only and "model-check/quick" not in adapter_only
    full = [p.row.name for p in gate_plan.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y"))]
    assert full == adapter_only + ["proofs/z3", "model-check/quick", "proofs/shared-budget", "identity/bind"]


def test_plan_without_async_class_is_not_tested_unless_sync_only():
    planned = registry.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, None, spec_health=False))
    skipped = [p.row.name for p in planned if p.skip]
    assert skipped and all(name.endswith("/async") for name in skipped)
    only = registry.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, None, spec_health=False, sync_only=True))
    assert not any(p.row.name.endswith("/async") for p in only)


@pytest.mark.rules("R18")
def test_r18_candidate_that_rotates_with_feature_off_fails_must(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    result = check_feature_off("gate_candidates.RotatesWhenOff", False, Hunt(40, max_steps=30, save_dir=tmp_path))
    assert result.result == "fail"
    assert result.failure.startswith("[must] R18:") and "differs from stock vLLM" in result.failure
    assert "RotatesWhenOff" in result.failure and "feature OFF" in result.counterexample[0]
    good = check_feature_off(REFERENCE_SCHEDULER, False, Hunt(20, max_steps=30, save_dir=tmp_path))
    assert good.result == "pass" and good.examples == 20


def _conform_quick_must(scheduler_cls: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run ``outrate conform`` at the quick profile and level must without spec health.

    ``extra`` (CLI words) go before ``--scheduler-cls``; counterexamples are saved under
    ``tmp_path``. Returns the finished process (stdout and stderr as text).
    """
    return subprocess.run(
        OUTRATE
        + ["conform", "--profile", "quick", "--level", "must", "--no-spec-health", *extra]
        + ["--scheduler-cls", scheduler_cls, "--counterexamples", str(tmp_path)],
        capture_output=True,
        text=True,
        env=ENV,
    )


@pytest.mark.slow
def test_cli_without_async_class_exits_2_and_says_not_tested(tmp_path):
    run = _conform_quick_must("gate_candidates.ReferenceSyncOnly", tmp_path)
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert "NOT TESTED" in last and "rate-limit/async" in last
    only = _conform_quick_must("gate_candidates.ReferenceSyncOnly", tmp_path, "--sync-only")
    assert only.returncode == 0, only.stdout[-3000:]
    assert only.stdout.strip().splitlines()[-1].endswith("ACCEPTED")


def _plugin_verdicts(tmp_path, *args) -> dict[str, str]:
    (tmp_path / "test_patch.py").write_text("def test_own():\n    pass\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path / "test_patch.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    found = {
        name: verdict for verdict, name in re.findall(r"^(PASSED|FAILED) (?:\S*::)?outrate::(\S+)", run.stdout, re.M)
    }
    assert found, run.stdout[-3000:]
    return found


@pytest.mark.slow
def test_plugin_gives_the_cli_verdicts(tmp_path):
    out = tmp_path / "conform.json"
    _conform_quick_must(STOCK_SCHEDULER, tmp_path, "--sync-only", "--json", str(out))
    checks = json.loads(out.read_text())["checks"]
    # coverage is not judged in a run another check failed: the plugin reports it as skipped
    assert {c["name"]: c["result"] for c in checks}["coverage"] == "not judged"
    cli = {c["name"]: "PASSED" if c["result"] == "pass" else "FAILED" for c in checks if c["result"] != "not judged"}
    plugin = _plugin_verdicts(
        tmp_path,
        f"--outrate-scheduler={STOCK_SCHEDULER}",
        "--outrate-level=must",
        "--outrate-sync-only",
        "--outrate-profile=quick",
    )
    assert plugin == cli
    assert cli["rate-limit/sync"] == "FAILED" and cli["feature-off/sync"] == "PASSED"
