"""The environment is never the candidate's fault (adapter/environment.py, outrate/gate_environment.py).

- A stock class whose construction raises (as every ``VllmConfig`` did on vLLM 0.34.0 without
  triton-cpu): ``outrate conform`` stops with exit 3, one paragraph, no candidate verdict, no
  counterexample file, a JSON report with no checks.
- A candidate's exception is a crash only when the stock class survives the same scenario.
- On an unsupported release the drift hunt decides: a diverging V-rule is a no-verdict
  paragraph naming it with its counterexample; none gives the verdict-line clause.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_output_rate import gate_environment
from vllm_output_rate.adapter import environment

TRITON = "vLLM on x86 CPUs requires Triton (triton-cpu)."


class RaisingScheduler(Scheduler):
    """Stock vLLM on an environment that cannot build it: construction raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(TRITON)


class RaisingAsyncScheduler(AsyncScheduler):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(TRITON)


@pytest.fixture
def broken_stock(monkeypatch):
    monkeypatch.setattr(
        environment,
        "STOCK_CLASS_PATHS",
        {False: f"{__name__}.RaisingScheduler", True: f"{__name__}.RaisingAsyncScheduler"},
    )


def test_preflight_names_the_stock_class_and_the_error(broken_stock):
    what = environment.stock_preflight()
    assert what is not None and what.startswith("Stock vLLM's RaisingScheduler could not run in the gate's harness")
    assert TRITON in what
    paragraph = environment.environment_paragraph(what)
    assert paragraph.startswith("NO VERDICT (exit 3)") and "\n" not in paragraph
    assert "supported releases: 0.32.0, 0.33.0, 0.34.0" in paragraph and "make install VLLM=X.Y.Z" in paragraph


def test_a_stock_class_whose_construction_raises_stops_conform_with_exit_3_and_no_verdict(
    broken_stock, monkeypatch, tmp_path
):
    from click.testing import CliRunner

    from vllm_output_rate import cli

    def exit_now(code):  # conform ends with os._exit: keep the test process
        raise SystemExit(code)

    monkeypatch.setattr(cli.os, "_exit", exit_now)
    report, saved = tmp_path / "conform.json", tmp_path / "counterexamples"
    result = CliRunner().invoke(
        cli.main,
        ["conform", "--sync-only", "--level", "must", "--json", str(report), "--counterexamples", str(saved)],
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 3, result.output
    assert "NO VERDICT (exit 3)" in output and TRITON in output and "RaisingScheduler" in output
    assert not any(word in output for word in ("ACCEPTED", "REJECTED", "candidate checks passed"))
    assert not saved.exists() or not any(saved.iterdir())
    document = json.loads(report.read_text())
    assert document["exit_code"] == 3 and document["checks"] == [] and TRITON in document["no_verdict"]


def test_a_candidate_crash_is_the_candidates_only_when_stock_survives_the_same_scenario(monkeypatch):
    from vllm_output_rate.adapter import conform

    def candidate(scenario):
        raise ValueError("candidate bug")

    monkeypatch.setattr(environment, "run_on_stock", lambda scenario: None)
    verdict = conform._guarded(candidate, "pkg.Candidate")("scenario-stock-survives")
    assert verdict.rule == "crash" and "Candidate raised ValueError: candidate bug" in verdict.failure

    def stock_raises(scenario):
        raise RuntimeError(TRITON)

    monkeypatch.setattr(environment, "run_on_stock", stock_raises)
    with pytest.raises(environment.EnvironmentFailure) as failure:
        conform._guarded(candidate, "pkg.Candidate")("scenario-stock-raises")
    assert "candidate bug" in failure.value.what and TRITON in failure.value.what
    with pytest.raises(environment.EnvironmentFailure):
        conform._guarded_step(candidate, "pkg.Candidate")("step-scenario-stock-raises")


def test_preflight_passes_on_the_installed_release():
    assert environment.stock_preflight() is None


def _console() -> Console:
    return Console(file=io.StringIO(), width=200)


def _report(found=(), examples=None):
    return SimpleNamespace(found=list(found), examples=examples or {"sync": 150, "async": 150})


def test_unsupported_release_with_no_drift_says_so_on_the_verdict_line():
    calls = []

    def fake_drift(profile, version, warning, **kwargs):
        calls.append((profile.version, version, kwargs["examples"]))
        return _report()

    paragraph, clause = gate_environment.unsupported_release_drift(_console(), "0.35.1", fake_drift)
    assert paragraph is None
    assert clause == "on vLLM 0.35.1, not a supported release; base model held in 300 scenarios"
    assert calls == [("0.34.0", "0.35.1", gate_environment.DRIFT_EXAMPLES)]  # the nearest older rows
    assert gate_environment.version_notice("0.35.1").startswith("WARNING: vLLM 0.35.1 is not a supported version")


def test_unsupported_release_with_a_diverging_rule_has_no_verdict_and_names_it():
    entry = SimpleNamespace(
        rule="V6", mode="sync", failure="event 7: V6: scheduled: vLLM [] != spec [('r1', 1)]", counterexample=["a", "b"]
    )
    paragraph, clause = gate_environment.unsupported_release_drift(
        _console(), "0.35.0", lambda *a, **k: _report([entry])
    )
    assert clause is None and paragraph.startswith("NO VERDICT (exit 3)")
    assert "leaves the base model (0.34.0 rows) at V6: V6 (sync) event 7" in paragraph
    assert "1-minimal counterexample: a | b" in paragraph


def test_a_supported_release_runs_no_drift():
    def never(*args, **kwargs):
        raise AssertionError("no drift hunt on a supported release")

    assert gate_environment.unsupported_release_drift(_console(), "0.34.0+cpu", never) == (None, None)
    assert gate_environment.version_notice("0.33.0") is None


def test_stock_runs_a_rate_limit_scenario_to_its_end_and_a_broken_stock_does_not(broken_stock, monkeypatch):
    # The stock re-run drives the scenario's arrivals, aborts and steps, judging nothing:
    # real stock vLLM survives it; the broken stock raises, which is no verdict.
    from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario

    requests = (
        RequestSpec("r0", "u0", prompt_len=4, max_tokens=3),
        RequestSpec("r1", None, prompt_len=6, max_tokens=50, at_step=1, abort_at_step=3),
    )
    scenario = Scenario({"u0": "5"}, requests, step_interval_ns=1_000_000, num_steps=4)
    with pytest.raises(environment.EnvironmentFailure, match="Triton"):
        environment.stock_survives(scenario, ValueError("candidate bug"))
    monkeypatch.setattr(environment, "STOCK_CLASS_PATHS", {False: "vllm.v1.core.sched.scheduler.Scheduler"})
    environment.stock_survives(scenario, ValueError("candidate bug"))  # returns: the crash is the candidate's
