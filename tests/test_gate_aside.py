"""``outrate conform`` runs the proofs/ spec-health rows in a worker process beside the
candidate checks (``outrate/cli_conform._run_plan``, ``proofs/gate_checks.run_aside``): the rows
come back as if run in place, and a dead worker falls back to running the row in-process."""

from __future__ import annotations

import os

import pytest

from vllm_output_rate import cli_conform
from vllm_output_rate.adapter import gate_row
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.proofs import gate_checks

ROW = "proofs/z3"  # the fastest of the three rows (about 1 s)


def _plan(*names: str) -> list[gate_row.PlannedRow]:
    specs = {spec.name: spec for spec in gate_checks.spec_health_checks()}
    return [gate_row.PlannedRow(specs[name]) for name in names]


def _options() -> gate_row.GateOptions:
    return gate_row.GateOptions(REFERENCE_SCHEDULER, REFERENCE_ASYNC_SCHEDULER, profile="quick", spec_health=True)


def test_run_aside_gives_the_row_run_in_place() -> None:
    aside = gate_checks.run_aside(ROW)
    in_place = gate_row.run_planned(_plan(ROW)[0], _options(), lambda: None)
    fields = ("name", "rules", "result", "examples", "failure", "counterexample")
    assert [getattr(aside, f) for f in fields] == [getattr(in_place, f) for f in fields]
    assert aside.result == "pass" and aside.examples > 0 and aside.seconds > 0


def test_run_aside_refuses_a_name_that_is_not_a_proofs_row() -> None:
    with pytest.raises(KeyError, match="rate-limit/sync"):
        gate_checks.run_aside("rate-limit/sync")


def test_run_plan_runs_the_proofs_rows_in_the_worker(monkeypatch) -> None:
    def not_here(*args, **kwargs):
        raise AssertionError("a proofs/ row ran in the gate's own process")

    monkeypatch.setattr(gate_row, "run_planned", not_here)
    (result,) = cli_conform._run_plan(_plan(ROW), _options())
    assert (result.name, result.result, result.part, result.level) == (ROW, "pass", "spec health", "must")


def test_run_plan_falls_back_to_running_the_row_here_when_the_worker_dies(monkeypatch) -> None:
    ran = []
    real = gate_row.run_planned

    def here(item, options, tick):
        ran.append(item.row.name)
        return real(item, options, tick)

    # The worker's entry replaced by one that fails at once (os._exit takes one argument,
    # it is given two: the worker ends with a TypeError before sending anything).
    monkeypatch.setattr(gate_checks, "serve_aside", os._exit)
    monkeypatch.setattr(gate_row, "run_planned", here)
    (result,) = cli_conform._run_plan(_plan(ROW), _options())
    assert ran == [ROW] and result.result == "pass" and result.part == "spec health"


def test_the_worker_is_stopped_when_the_run_ends_early() -> None:
    aside = cli_conform._Aside(["model-check/quick"])  # about 20 s of work
    aside.close()
    assert not aside.proc.is_alive() and aside.proc.exitcode is not None
