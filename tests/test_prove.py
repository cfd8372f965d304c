"""``outrate prove``: Z3 proofs and CrossHair contracts of the limiter rules R1-R6.

* One real run of ``python -m vllm_output_rate.cli prove --json PATH`` in a subprocess
  (about 30-60 s on the shared 2-core machine): the JSON shape, every Z3 property proved,
  nothing refuted, exit status 0.
* CrossHair refutes the deliberately broken limiters of ``proofs/crosshair_limiter.py``
  with a concrete counterexample (so "no counterexample" from the real run means something).
* The command's plumbing (exit status on a refutation, JSON on stdout) with canned records.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vllm_output_rate.cli import main
from vllm_output_rate.proofs import crosshair_limiter as chl
from vllm_output_rate.proofs import crosshair_runner as chr_
from vllm_output_rate.proofs import z3_limiter as zl

RESULTS = {"proved", "refuted", "unknown"}
KEYS = {"name", "rules", "tool", "result", "seconds"}
# Hard guard on the subprocess; the command caps its CrossHair phase at 75 s itself.
SUBPROCESS_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path_factory.mktemp("prove") / "prove.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.cli", "prove", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert path.exists(), proc.stdout + proc.stderr
    return proc, json.loads(path.read_text())


def _by_tool(doc: dict, tool: str) -> dict[str, dict]:
    return {p["name"]: p for p in doc["properties"] if p["tool"] == tool}


@pytest.mark.slow
def test_json_shape(run):
    _, doc = run
    props = doc["properties"]
    assert isinstance(props, list) and props
    for p in props:
        assert set(p) == KEYS, p
        assert isinstance(p["name"], str) and p["name"]
        assert isinstance(p["rules"], list) and p["rules"]
        assert all(isinstance(r, str) and re.fullmatch(r"R\d+", r) for r in p["rules"]), p
        assert p["tool"] in {"z3", "crosshair"}
        assert p["result"] in RESULTS
        assert isinstance(p["seconds"], float) and math.isfinite(p["seconds"]) and p["seconds"] >= 0
    names = [p["name"] for p in props]
    assert len(names) == len(set(names))
    assert set(_by_tool(doc, "z3")) == {p.name for p in zl.PROPERTIES}
    assert set(_by_tool(doc, "crosshair")) == {p.name for p in chl.PROPERTIES}


@pytest.mark.slow
def test_every_z3_property_proved(run):
    _, doc = run
    z3_props = _by_tool(doc, "z3")
    assert z3_props
    assert all(p["result"] == "proved" for p in z3_props.values()), z3_props


@pytest.mark.slow
def test_nothing_refuted_and_exit_zero(run):
    proc, doc = run
    refuted = [p for p in doc["properties"] if p["result"] == "refuted"]
    assert not refuted, (refuted, doc.get("notes"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The table was printed (the JSON went to the file).
    assert "ch_spec_vs_reference_step" in proc.stdout and "r2_window_bound" in proc.stdout


@pytest.mark.slow
def test_crosshair_unknowns_are_explained(run):
    """CrossHair may run out of budget on a loaded machine; then the note says why."""
    _, doc = run
    for name, p in _by_tool(doc, "crosshair").items():
        if p["result"] != "proved":
            assert doc["notes"].get(name), name


def test_broken_crosshair_functions_refuted():
    names = [p.name for p in chl.BROKEN]
    records = chr_.run_all(names=names, jobs=1, wall_timeout=60)
    assert [r["name"] for r in records] == names
    for r in records:
        assert r["result"] == "refuted", r
        assert r["tool"] == "crosshair"
        # CrossHair's counterexample: the call that breaks the contract.
        assert any("false when calling broken_" in c["message"] for c in r["conditions"]), r


def test_budget_exhaustion_is_unknown_never_proved():
    """Out of CPU budget (CrossHair's "Not confirmed.", or on a slow machine "Unable to meet
    precondition.": the budget ran out before one input met the preconditions) or past the
    wall-clock cap: unknown."""
    name = "ch_spec_vs_reference_step"  # needs ~14 CPU s to exhaust its paths
    (short_cpu,) = chr_.run_all(per_condition_timeout=0.5, names=[name], jobs=1, wall_timeout=60)
    assert short_cpu["result"] == "unknown", short_cpu
    assert short_cpu["conditions"][0]["message"] in ("Not confirmed.", "Unable to meet precondition."), short_cpu
    (short_wall,) = chr_.run_all(names=[name], jobs=1, wall_timeout=1)
    assert short_wall["result"] == "unknown", short_wall
    assert "wall-clock cap" in short_wall["conditions"][0]["message"]


def test_broken_functions_are_off_for_plain_crosshair_check():
    """``crosshair check`` of the module must not report the broken functions."""
    from crosshair.codeconfig import collect_options

    for p in chl.BROKEN:
        assert collect_options(p.fn).enabled is False, p.name
    for p in chl.PROPERTIES:
        assert collect_options(p.fn).enabled is not False, p.name


def _canned(monkeypatch, crosshair_result: str) -> None:
    def z3_run_all(timeout_ms=5000, variant="correct"):
        return [
            {
                "name": "z3_fake",
                "rules": ["R2"],
                "tool": "z3",
                "result": "proved",
                "seconds": 0.01,
                "vacuity_ok": True,
                "counterexample": None,
            }
        ]

    def ch_run_all(per_condition_timeout, names, jobs, wall_timeout, on_record):
        rec = {
            "name": "ch_fake",
            "rules": ["R5"],
            "tool": "crosshair",
            "result": crosshair_result,
            "seconds": 0.5,
            "conditions": [
                {
                    "line": 1,
                    "status": "refuted" if crosshair_result == "refuted" else "confirmed",
                    "message": "false when calling f(1)",
                }
            ],
        }
        on_record(rec)
        return [rec]

    monkeypatch.setattr(zl, "run_all", z3_run_all)
    monkeypatch.setattr(chr_, "run_all", ch_run_all)


def test_exit_status_nonzero_on_refutation(monkeypatch, tmp_path):
    _canned(monkeypatch, "refuted")
    out = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["prove", "--json", str(out)])
    assert result.exit_code == 1, result.output
    doc = json.loads(out.read_text())
    assert [p["result"] for p in doc["properties"]] == ["proved", "refuted"]
    assert "false when calling f(1)" in doc["notes"]["ch_fake"]


def test_bare_json_flag_writes_json_to_stdout(monkeypatch):
    _canned(monkeypatch, "proved")
    result = CliRunner().invoke(main, ["prove", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(p["name"], p["tool"], p["result"]) for p in doc["properties"]] == [
        ("z3_fake", "z3", "proved"),
        ("ch_fake", "crosshair", "proved"),
    ]
    assert "outrate prove" in result.stderr  # the table went to stderr


def test_proof_record_has_the_shared_keys_and_refuses_an_unknown_result():
    from vllm_output_rate.proofs.records import RECORD_KEYS, proof_record

    record = proof_record("p", ("R2", "R3"), "z3", "proved", 0.5, vacuity_ok=True)
    assert tuple(record)[: len(RECORD_KEYS)] == RECORD_KEYS
    assert record["rules"] == ["R2", "R3"] and record["vacuity_ok"] is True
    with pytest.raises(ValueError, match="'maybe' of p"):
        proof_record("p", (), "z3", "maybe", 0.0)
