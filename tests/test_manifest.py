"""Issue 26 item 5: the candidate manifest (``[tool.outrate]``, ``outrate/manifest.py``) and,
end to end, the mode matrix of item 1 through ``outrate conform``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_output_rate import manifest
from vllm_output_rate.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
PYPROJECT = """
[project]
name = "my-fork"

[tool.outrate]
scheduler-cls = "my_fork.sched.MyScheduler"
async_scheduler_cls = "my_fork.sched.MyAsyncScheduler"
config-style = "engine-args"
integer-rates = true
burst-configurable = false
rate-change = false
path = "src"
require-modes = ["lora", "priority"]
level = "must"
profile = "quick"
"""


def test_pyproject_tool_outrate_becomes_conforms_defaults(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    path, table = manifest.find(tmp_path)
    assert path.name == "pyproject.toml"
    defaults = manifest.conform_defaults(path, table)
    assert defaults == {
        "scheduler_cls": "my_fork.sched.MyScheduler",
        "async_scheduler_cls": "my_fork.sched.MyAsyncScheduler",
        "config_style": "engine-args",
        "integer_rates": True,
        "burst_configurable": False,
        "rate_change": False,
        "paths": (str(tmp_path / "src"),),
        "require_modes": ("lora", "priority"),
        "level": "must",
        "profile": "quick",
    }


def test_outrate_toml_wins_and_may_hold_top_level_keys(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "outrate.toml").write_text('level = "exact"\nsync-only = true\n')
    path, table = manifest.find(tmp_path)
    assert path.name == "outrate.toml" and manifest.conform_defaults(path, table) == {
        "level": "exact",
        "sync_only": True,
    }
    assert manifest.find(tmp_path / "nowhere") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tool.outrate]\nlevle = 'must'\n", "unknown key 'levle' in [tool.outrate]; known keys: scheduler-cls"),
        ("[tool.outrate]\ninteger-rates = 'yes'\n", "integer-rates = 'yes': must be bool"),
        ("[tool.outrate]\nseed = true\n", "seed = True: must be int"),
        ("[tool.outrate]\npath = [1]\n", "path = [1]: must be a list of strings"),
        ("[tool.outrate\n", "pyproject.toml is not valid TOML"),
    ],
)
def test_a_bad_manifest_is_named_with_its_key_and_value(tmp_path, text, message):
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(manifest.ManifestError) as error:
        path, table = manifest.find(tmp_path)
        manifest.conform_defaults(path, table)
    assert message in str(error.value)


def test_conform_reads_the_manifest_of_the_working_directory_and_options_override_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.outrate]\nscheduler-cls = "vllm_output_rate.reference.limiter.X"\n')
    result = CliRunner().invoke(main, ["conform", "--sync-only"])
    assert result.exit_code == 2 and "vllm_output_rate.reference.limiter.X" in result.output  # the manifest's class
    other = "vllm_output_rate.reference.limiter.OutputRateLimiter"
    result = CliRunner().invoke(main, ["conform", "--sync-only", "--scheduler-cls", other])
    assert result.exit_code == 2 and "is not a vLLM scheduler class" in " ".join(result.output.split())
    assert "reference.limiter.X" not in result.output  # the option given overrides the manifest
    (tmp_path / "pyproject.toml").write_text('[tool.outrate]\nlevel = "bogus"\n')
    result = CliRunner().invoke(main, ["conform"])
    assert result.exit_code == 2 and "'bogus' is not one of 'must', 'should', 'exact'" in result.output
    (tmp_path / "pyproject.toml").write_text("[tool.outrate]\nlevle = 1\n")
    result = CliRunner().invoke(main, ["conform"])
    assert result.exit_code == 2 and "unknown key 'levle'" in result.output
    assert result.output.rstrip().endswith("Fix the candidate manifest (or run outrate conform elsewhere).")


# The gate's plan cut to one row, so the end-to-end run takes seconds (one subprocess:
# ``outrate conform`` ends with ``os._exit``).
_SMALL_GATE = """
import sys
from vllm_output_rate import gate_plan
full = gate_plan.plan
gate_plan.plan = lambda o: [p for p in full(o) if p.row.name == "lora-slots/sync"]
from vllm_output_rate.cli import main
sys.argv = ["outrate", "conform", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_conform_end_to_end_from_a_manifest_shows_lora_refused_and_require_mode_makes_it_fatal(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.outrate]\nscheduler-cls = "mode_candidates.RefusesLora"\npath = "{FIXTURES}"\n'
        'sync-only = true\nlevel = "should"\nprofile = "quick"\n'
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}

    def run(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", _SMALL_GATE, "--no-spec-health", *args]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    accepted = run("--json", "report.json")
    out = " ".join(accepted.stdout.split())
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "settings from the candidate manifest pyproject.toml [tool.outrate]" in out
    assert "candidate mode matrix" in out and "does not support LoRA" in out
    assert "lora-slots/sync NOT APPLICABLE (candidate): mode lora refused at start-up" in out
    assert out.rstrip().endswith("-- ACCEPTED"), out[-400:]
    assert "1 not applicable (mode refused at start-up): lora-slots/sync" in out
    fatal = run("--require-mode", "lora")
    out = " ".join(fatal.stdout.split())
    assert fatal.returncode == 1, fatal.stdout + fatal.stderr
    assert "[must] modes: mode lora is required (--require-mode lora) but refused" in out
    assert out.rstrip().endswith("-- REJECTED: modes failed"), out[-400:]
