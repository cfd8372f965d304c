"""Gate rows ``lora-slots/{sync,async}`` (adapter/lora_slots.py): LoRA requests on any
candidate; the reference passes, a candidate that crashes or starves the other user's
adapter is rejected (issue 13 item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm

from vllm_output_rate.adapter import registry
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
from vllm_output_rate.adapter.lora_slots import check_lora
from vllm_output_rate.adapter.scenarios import Hunt
from vllm_output_rate.adapter.versions import installed_profile


@pytest.mark.rules("R13")
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_r13_lora_gate_passes_the_reference(async_mode):
    cls = REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER
    result = check_lora(cls, async_mode, Hunt(8))
    assert result.result == "pass", (result.failure, result.counterexample)
    assert result.examples == 8 and result.steps > 8 * 10


@pytest.mark.rules("R13")
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_r13_lora_gate_rejects_a_holder_that_never_gives_way(monkeypatch, async_mode):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    cls = "lora_candidates.NoLoraVictimAsync" if async_mode else "lora_candidates.NoLoraVictim"
    result = check_lora(cls, async_mode, Hunt(20))
    assert result.result == "fail" and result.failure.startswith("[should] R13"), result.failure
    assert "has not sampled" in result.failure


@pytest.mark.rules("R11")
def test_r11_lora_gate_rejects_a_candidate_that_crashes_on_0_32(monkeypatch):
    # Without any count of the throttled holder's adapter, vLLM 0.32 admits another adapter
    # beside it and its max_loras assertion fails in the next step (issue 13); 0.33 counts
    # every running request itself, so there the candidate only starves the other user.
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    result = check_lora("lora_candidates.NoLoraCount", False, Hunt(20))
    assert result.result == "fail", vllm.__version__
    if installed_profile().loras_counted_over_all_running:
        assert result.failure.startswith("[should] R13"), result.failure
    else:
        assert result.failure.startswith("[must] crash") and "AssertionError" in result.failure, result.failure


def test_lora_rows_registered_at_should_for_both_modes():
    specs = {s.name: s for s in registry.registry()}
    for name in ("lora-slots/sync", "lora-slots/async"):
        assert specs[name].level == "should" and specs[name].part == "candidate"
        assert set(specs[name].rules) == {"R11", "R13"}
