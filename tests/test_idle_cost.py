"""R16, worker side (docs/PERFORMANCE.md "Idle cost"; issue 15 item 6): the plugin caps the
spin window of vLLM's shared-memory queue reader in the worker process.

vLLM 0.32's ``SpinCondition.wait`` busy-loops (``sched_yield``) for ``busy_loop_s`` = 1 s
after each read before parking on its notify socket; an all-throttled engine core sends an
RPC at least every 50 ms (R16), so the worker never parked (100% of a core). The wrap caps
the window at ``VLLM_OUTPUT_RATE_READER_SPIN_MS`` (set by the front end with the feature
on), in ``VllmWorker-*`` processes only, and leaves vLLM's wait itself unchanged.
"""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from vllm_output_rate.reference import plugin


@pytest.fixture
def restore_wait():
    original = SpinCondition.wait
    yield original
    SpinCondition.wait = original


@pytest.mark.parametrize("text, cap", [(None, None), ("", None), ("2", 0.002), ("0.5", 0.0005), ("x", None),
                                       ("-1", None), ("1000", 1.0)])
def test_cap_read_from_the_environment(monkeypatch, text, cap):
    if text is None:
        monkeypatch.delenv(plugin.READER_SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.READER_SPIN_ENV, text)
    assert plugin.reader_spin_cap_s() == cap


def _as_process(monkeypatch, name: str) -> None:
    monkeypatch.setattr(multiprocessing.current_process(), "name", name)


def test_worker_reader_window_capped_and_vllm_wait_still_runs(monkeypatch, restore_wait):
    monkeypatch.setenv(plugin.READER_SPIN_ENV, "2")
    _as_process(monkeypatch, "VllmWorker-0")
    plugin._install_reader_spin_cap()
    assert SpinCondition.wait is not restore_wait
    reader = SimpleNamespace(is_reader=True, busy_loop_s=1.0, last_read=time.monotonic())
    SpinCondition.wait(reader)  # within the (capped) window: vLLM's own sched_yield path
    assert reader.busy_loop_s == 0.002
    plugin._install_reader_spin_cap()  # idempotent: not wrapped twice
    assert getattr(SpinCondition.wait, "__wrapped__", None) is restore_wait


@pytest.mark.parametrize("name", ["EngineCore", "MainProcess"])
def test_other_processes_keep_vllms_window(monkeypatch, restore_wait, name):
    monkeypatch.setenv(plugin.READER_SPIN_ENV, "2")
    _as_process(monkeypatch, name)
    plugin._install_reader_spin_cap()
    assert SpinCondition.wait is restore_wait


def test_feature_off_keeps_vllms_window(monkeypatch, restore_wait):
    monkeypatch.delenv(plugin.READER_SPIN_ENV, raising=False)  # R18: the front end sets it only when on
    _as_process(monkeypatch, "VllmWorker-0")
    plugin._install_reader_spin_cap()
    assert SpinCondition.wait is restore_wait
