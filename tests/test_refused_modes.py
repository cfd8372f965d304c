"""Issue 26 item 1: engine modes a candidate refuses at start-up (``adapter/modes.py``).

The candidates are ``tests/fixtures/mode_candidates.py``: the reference with LoRA refused
at construction (feature on; feature off too; a bare assert instead of a refusal).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_output_rate.adapter import gate_row, mode_probe, modes, registry
from vllm_output_rate.adapter.conform import check_white_box
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.scenarios import Hunt

FIXTURES = Path(__file__).parent / "fixtures"
REFUSES = "mode_candidates.RefusesLora"
REFUSES_ASYNC = "mode_candidates.RefusesLoraAsync"
ON = {"default_tokens_per_s": 10}


@pytest.fixture(autouse=True)
def _fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def options(cls: str = REFUSES, async_cls: str | None = REFUSES_ASYNC, **kwargs) -> gate_row.GateOptions:
    return gate_row.GateOptions(scheduler_cls=cls, async_scheduler_cls=async_cls, **kwargs)


def test_the_matrix_shows_lora_refused_with_its_message_and_the_other_modes_supported():
    matrix = mode_probe.probe(options(), ["lora", "priority", "async"])
    assert list(matrix) == ["async", "lora", "priority"]  # in MODES order
    assert matrix["lora"].status == modes.REFUSED
    assert matrix["lora"].message.startswith("ValueError: the output-rate limit does not support LoRA")
    assert matrix["lora"].feature_off is None  # built with the feature off: R18 holds
    assert matrix["priority"].status == matrix["async"].status == modes.SUPPORTED
    assert modes.refused(matrix) == {"lora": matrix["lora"].message}
    row = gate_row.modes_result(matrix, options())
    assert row.result == "pass" and [m["status"] for m in row.modes] == ["supported", "refused", "supported"]


def test_rows_that_need_a_refused_mode_are_not_applicable_and_do_not_change_the_exit_code():
    opts = options(level="should", spec_health=False)
    planned = registry.plan(opts)
    assert {"lora", "async", "priority", "no-chunked-prefill"} <= set(gate_row.modes_used(planned))
    marked = gate_row.apply_modes(planned, {"lora": "ValueError: no LoRA"})
    lora_rows = [p for p in marked if p.not_applicable]
    assert [p.row.name for p in lora_rows] == ["lora-slots/sync", "lora-slots/async"]
    result = gate_row.run_planned(lora_rows[0], opts, lambda: None)
    assert result.result == "not applicable"
    assert result.failure == "mode lora refused at start-up (ValueError: no LoRA)"
    assert gate_row.exit_code([result]) == 0


def test_require_mode_makes_the_refusal_fatal():
    opts = options(require_modes=("lora",))
    row = gate_row.modes_result(mode_probe.probe(opts, ["priority"]), opts)  # a required mode is probed anyway
    assert row.result == "fail" and gate_row.exit_code([row]) == 1
    assert row.failure.startswith("[must] modes: mode lora is required (--require-mode lora) but refused")
    with pytest.raises(ValueError, match="unknown engine mode 'beam'"):
        options(require_modes=("beam",))


@pytest.mark.rules("R18")
def test_r18_a_refusal_with_the_feature_off_fails():
    opts = options("mode_candidates.RefusesLoraAlways", None, sync_only=True)
    matrix = mode_probe.probe(opts, ["lora"])
    assert matrix["lora"].status == modes.REFUSED and "does not support LoRA" in matrix["lora"].feature_off
    row = gate_row.modes_result(matrix, opts)
    assert row.result == "fail" and row.failed_level == "must"
    assert row.failure.startswith("[must] R18: RefusesLoraAlways refuses mode lora")
    assert "with the feature OFF too" in row.failure


def test_a_bare_assertion_while_built_is_a_crash_not_a_refusal():
    opts = options("mode_candidates.AssertsOnLora", None, sync_only=True)
    matrix = mode_probe.probe(opts, ["lora"])
    assert matrix["lora"].status == modes.CRASHED and matrix["lora"].message == "AssertionError: "
    row = gate_row.modes_result(matrix, opts)
    assert row.result == "fail" and row.failure.startswith("[must] crash: mode lora")


def test_refusing_skips_feature_on_harnesses_of_the_mode_only():
    lora_on = EngineShape(max_loras=1, output_rate=ON)
    with modes.refusing({"lora": "ValueError: no LoRA"}):
        with pytest.raises(modes.ModeRefused, match="mode lora refused at start-up"):
            Harness(REFUSES, lora_on)
        Harness(REFUSES, EngineShape(max_loras=1))  # feature off: judged (R18), never skipped
        Harness(REFUSES, EngineShape(output_rate=ON))
    with pytest.raises(ValueError, match="does not support LoRA"):  # outside a gate run: the class refuses
        Harness(REFUSES, lora_on)


@pytest.mark.slow
def test_a_row_that_draws_the_refused_mode_leaves_its_scenarios_out_instead_of_crashing():
    # white-box draws LoRA in a quarter of its scenarios: without the probe each is a crash
    crashed = check_white_box(REFUSES, False, Hunt(12, seed=1))
    assert crashed.result == "fail" and "does not support LoRA" in crashed.failure
    with modes.refusing({"lora": "ValueError: no LoRA"}):
        result = check_white_box(REFUSES, False, Hunt(12, seed=1))
    assert result.result == "pass", result.failure
    assert result.examples >= 12
