"""``outrate conform`` and ``outrate replay`` refuse a candidate they cannot judge as a usage
error (exit 2, the last line says why, no traceback) before any check runs, never as a
rejected candidate (exit 1): a module that raises while it is imported (the candidate's,
a ``hook:`` configuration style's or a ``--mutants-from`` catalogue's), a module whose own
import is missing, and a scheduler class given in the wrong slot (a sync class as
``--async-scheduler-cls``, an ``AsyncScheduler`` as ``--scheduler-cls``).

Each test writes a small candidate package under its ``tmp_path``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from vllm_output_rate import cli_conform, gate_plan
from vllm_output_rate.adapter.candidate_import import CandidateImportError, import_named_module
from vllm_output_rate.adapter.harness import (
    REFERENCE_ASYNC_SCHEDULER,
    REFERENCE_SCHEDULER,
    STOCK_ASYNC_SCHEDULER,
    STOCK_SCHEDULER,
)
from vllm_output_rate.cli import main

OUTRATE = [sys.executable, "-m", "vllm_output_rate.cli"]
# The candidate package's modules: name -> source.
MODULES = {
    "__init__": "",
    "raising": 'raise RuntimeError("boom at import")\n',
    "broken": "def oops(:\n    pass\n",
    "deps": "import outrate_missing_dependency_of_the_candidate\n\n\nclass X:\n    pass\n",
    "hooks": 'raise ValueError("hook module boom")\n',
    "mutants": 'raise RuntimeError("catalogue boom")\n',
    "scheds": (
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n\n\n"
        "class Plain(Scheduler):\n    pass\n\n\n"
        "class Async(AsyncScheduler):\n    pass\n"
    ),
}
ASYNC_SLOT_PROBLEM = (
    "is not an AsyncScheduler (vllm.v1.core.sched.async_scheduler.AsyncScheduler) subclass: give the async class there"
)


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the candidate package (``MODULES``) under ``tmp_path / "pkgs"`` with a name of
    this test's own, and yield that name; the import path, ``PYTHONPATH`` (which
    ``outrate conform --path`` extends) and the package's cached modules are restored after."""
    name = f"usage_{tmp_path.name}"
    package = tmp_path / "pkgs" / name
    package.mkdir(parents=True)
    for module, source in MODULES.items():
        (package / f"{module}.py").write_text(source)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    yield name
    for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[loaded]


@pytest.fixture
def no_check_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``outrate conform`` fail loudly if it gets past its usage checks (the environment
    preflight is the first thing it runs after them)."""

    def reached(*_args, **_kwargs):
        raise AssertionError("outrate conform went on to run checks")

    monkeypatch.setattr(cli_conform, "_environment_first", reached)


def _invoke(*args: str) -> tuple[Result, str]:
    """Run ``outrate ARGS`` in this process: the result and the output's last line."""
    result = CliRunner().invoke(main, list(args))
    lines = result.output.strip().splitlines()
    return result, lines[-1] if lines else ""


def _assert_usage_error(result: Result, last: str, expected_end: str) -> None:
    """Exit 2 through click's usage-error path (not an exception escaping ``outrate``), no
    traceback, and the last line ends with ``expected_end``."""
    assert result.exit_code == 2, (result.exception, result.output)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert last.endswith(expected_end), last


@pytest.mark.parametrize(
    ("module", "said"),
    [("raising", "RuntimeError: boom at import"), ("broken", "SyntaxError: invalid syntax (broken.py, line 1)")],
)
def test_conform_refuses_a_candidate_module_that_raises_at_import(pkg, no_check_runs, module, said):
    # Before: the exception escaped outrate (a traceback, exit 1: "rejected").
    result, last = _invoke("conform", "--path", "pkgs", "--scheduler-cls", f"{pkg}.{module}.X", "--profile", "quick")
    _assert_usage_error(result, last, f"importing {pkg}.{module} failed: {said}")
    assert "--scheduler-cls" in last


@pytest.mark.slow
def test_conform_from_the_command_line_prints_no_traceback_for_a_raising_candidate(pkg, tmp_path):
    args = ["conform", "--path", "pkgs", "--scheduler-cls", f"{pkg}.raising.X", "--profile", "quick"]
    run = subprocess.run(OUTRATE + args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.endswith(f"importing {pkg}.raising failed: RuntimeError: boom at import"), last


def test_conform_names_a_missing_import_of_the_candidate_as_its_own(pkg, no_check_runs):
    # Before: "No module named '...' (usage_... is a package in pkgs: give --path pkgs)",
    # with --path pkgs given.
    result, last = _invoke("conform", "--path", "pkgs", "--scheduler-cls", f"{pkg}.deps.X", "--sync-only")
    dependency = "outrate_missing_dependency_of_the_candidate"
    _assert_usage_error(
        result, last, f"({dependency} is {pkg}.deps's own import: install it, or give --path for its directory too)"
    )
    assert f"importing {pkg}.deps failed: ModuleNotFoundError: No module named '{dependency}'" in last
    assert "is a package in pkgs" not in result.output


def test_conform_refuses_a_hook_module_that_raises_at_import(pkg, no_check_runs):
    args = ["conform", "--path", "pkgs", "--config-style", f"hook:{pkg}.hooks.place", "--sync-only"]
    result, last = _invoke(*args)
    _assert_usage_error(result, last, f"(importing {pkg}.hooks failed: ValueError: hook module boom)")
    assert "--config-style" in last


def test_conform_refuses_a_mutant_catalogue_that_raises_at_import(pkg, no_check_runs):
    result, last = _invoke("conform", "--path", "pkgs", "--mutants", "--mutants-from", f"{pkg}.mutants", "--sync-only")
    _assert_usage_error(result, last, f"(importing {pkg}.mutants failed: RuntimeError: catalogue boom)")
    assert "--mutants-from" in last and "give --path" not in last


def _counterexample_file(directory: Path) -> Path:
    """A counterexample file of ``outrate conform`` (a rate-limit row, stock vLLM) in ``directory``."""
    from test_replay_checks import _counterexample_file as counterexample_file

    return counterexample_file(directory)


@pytest.mark.parametrize("module", ["raising", "deps"])
def test_replay_refuses_a_class_whose_module_raises_at_import(pkg, tmp_path, module):
    path = _counterexample_file(tmp_path)
    result, last = _invoke("replay", str(path), "--path", "pkgs", "--scheduler-cls", f"{pkg}.{module}.X")
    said = {
        "raising": "RuntimeError: boom at import",
        "deps": "ModuleNotFoundError: No module named 'outrate_missing_dependency_of_the_candidate' "
        f"(outrate_missing_dependency_of_the_candidate is {pkg}.deps's own import: install it, or give --path "
        "for its directory too)",
    }[module]
    _assert_usage_error(result, last, f"importing {pkg}.{module} failed: {said}")
    assert "--scheduler-cls" in last and "is a package in pkgs" not in result.output


def test_conform_refuses_a_sync_class_given_as_the_async_one(pkg, no_check_runs):
    # Before: it ran, listed engine-wait/sync twice and no engine-wait/async.
    plain = f"{pkg}.scheds.Plain"
    args = ["conform", "--path", "pkgs", "--scheduler-cls", plain, "--async-scheduler-cls", plain, "--profile", "quick"]
    result, last = _invoke(*args)
    _assert_usage_error(result, last, f"--async-scheduler-cls {plain} {ASYNC_SLOT_PROBLEM}")
    assert last == f"Error: --async-scheduler-cls {plain} {ASYNC_SLOT_PROBLEM}"


def test_conform_refuses_an_async_class_given_as_the_sync_one(pkg, no_check_runs):
    given = f"{pkg}.scheds.Async"
    args = ["conform", "--path", "pkgs", "--scheduler-cls", given, "--async-scheduler-cls", given, "--profile", "quick"]
    result, last = _invoke(*args)
    _assert_usage_error(result, last, f"--scheduler-cls {given} is an AsyncScheduler: give it as --async-scheduler-cls")


@pytest.mark.parametrize(
    ("sync_cls", "async_cls"),
    [(REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER), (STOCK_SCHEDULER, STOCK_ASYNC_SCHEDULER)],
)
def test_each_slot_takes_the_reference_and_stock_classes_and_refuses_them_swapped(sync_cls, async_cls):
    # Stock AsyncScheduler is a Scheduler subclass too: the sync slot refuses it all the same.
    assert gate_plan.slot_problem(sync_cls, "S", False, "--async") is None
    assert gate_plan.slot_problem(async_cls, "A", True, "--async") is None
    assert gate_plan.slot_problem(async_cls, "A", False, "--async") == "A is an AsyncScheduler: give it as --async"
    assert gate_plan.slot_problem(sync_cls, "S", True, "--async") == f"S {ASYNC_SLOT_PROBLEM}"
    cli_conform._import_candidates(sync_cls, async_cls)  # no usage error


def test_only_a_module_that_is_not_found_stays_module_not_found(pkg, monkeypatch):
    # The --path hint is given for a ModuleNotFoundError only: the module or a package above it.
    monkeypatch.syspath_prepend(str(Path("pkgs").resolve()))
    for missing in (f"{pkg}.nosuch", "outrate_no_such_package.mod"):
        with pytest.raises(ModuleNotFoundError):
            import_named_module(missing)
    for module, said in (("deps", "ModuleNotFoundError"), ("raising", "RuntimeError"), ("broken", "SyntaxError")):
        with pytest.raises(CandidateImportError, match=f"^importing {pkg}.{module} failed: {said}: ") as error:
            import_named_module(f"{pkg}.{module}")
        assert not isinstance(error.value, ModuleNotFoundError)
