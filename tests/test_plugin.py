"""The ``vllm.general_plugins`` hooks (``reference/plugin.py``), in-process.

- Beam search is refused at the serving entry when the feature is on (the OpenAI server's
  ``BeamSearchOnlineMixin.beam_search`` and ``LLM.beam_search``), and passes through to
  vLLM when it is off (R18).
- R16 engine wait: after a step that ran no model, vLLM's real
  ``EngineCoreProc._process_engine_step`` (wrapped) waits on the input queue until the
  next ready time, however far (capped at 50 ms only while a waiting request's grammar is
  being compiled or its KV blocks received); a request put on the queue wakes it at once;
  nothing is consumed from the queue; no wait when the feature is off, when no user was
  refused, when a batch that computes tokens is in flight, or for a data-parallel engine.

The engine-core object is a stand-in (``SimpleNamespace``) carrying exactly the attributes
vLLM's ``_process_engine_step`` and the wrapper read; building a real ``EngineCoreProc``
needs a worker process and ZMQ sockets (that path is covered by the live suites).
The HTTP-level refusals (400 for beam search and a bad identity) are checked live in
``gpu_tests/test_live_serve.py``.
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from vllm_output_rate.reference import core_wait, plugin

MS = 1_000_000
ON = {"output_rate": {"default_tokens_per_s": 10}}


@pytest.fixture(autouse=True, scope="module")
def registered():
    plugin.register()  # idempotent; vLLM may have loaded it already in this process


def _config(additional, dp: int = 1):
    return SimpleNamespace(additional_config=additional, parallel_config=SimpleNamespace(data_parallel_size=dp))


# -- beam search --------------------------------------------------------------------
def test_beam_search_refused_online_when_on():
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    serving = SimpleNamespace(engine_client=SimpleNamespace(vllm_config=_config(ON)))
    # Refused at the call, before any response starts (HTTP 400 in the server).
    with pytest.raises(plugin.OutputRateRequestError, match="beam search is not supported") as err:
        BeamSearchOnlineMixin.beam_search(serving, prompt={}, request_id="r", params=None)
    assert isinstance(err.value, ValueError)


def test_beam_search_passes_through_online_when_off():
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    serving = SimpleNamespace(engine_client=SimpleNamespace(vllm_config=_config({})))
    generator = BeamSearchOnlineMixin.beam_search(serving, prompt={}, request_id="r", params=None)
    assert hasattr(generator, "__anext__")  # vLLM's own async generator, not started
    generator.aclose().close()  # never started: closing it runs nothing


def test_beam_search_refused_offline_when_on():
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=_config(ON)))
    with pytest.raises(plugin.OutputRateRequestError, match="use_beam_search"):
        BeamSearchOfflineMixin.beam_search(llm, [{"prompt": "x"}], params=None)


def test_beam_search_offline_reaches_vllm_when_off():
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin

    # Feature off: vLLM's own beam_search runs (and fails on this stand-in's missing parts).
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=_config({})))
    with pytest.raises(AttributeError):
        BeamSearchOfflineMixin.beam_search(llm, [{"prompt": "x"}], params=None)


# -- R16 engine wait ------------------------------------------------------------------
class _Scheduler:
    """Stand-in scheduler: the part of ``RateLimitedScheduler`` the engine loop reads."""

    def __init__(self, ready_in_ns: int | None):
        self.clock_ns = time.monotonic_ns
        self._ready_ns = None if ready_in_ns is None else self.clock_ns() + ready_in_ns
        self.requests: dict[str, SimpleNamespace] = {}  # vLLM's unfinished requests (their status)

    def next_ready_ns(self):
        return self._ready_ns

    def has_requests(self):
        return True


def _core(ready_in_ns: int | None, additional=ON, dp: int = 1, batch_queue=None, model_executed: bool = False):
    """Stand-in ``EngineCoreProc`` for vLLM's ``_process_engine_step``: a step that ran no model."""
    core = SimpleNamespace(
        scheduler=_Scheduler(ready_in_ns),
        vllm_config=_config(additional, dp),
        input_queue=queue.Queue(),
        output_queue=queue.Queue(),
        batch_queue=batch_queue,
        steps=0,
    )

    def step_fn():
        core.steps += 1
        return {}, model_executed

    core.step_fn = step_fn
    core.post_step = lambda model_executed: None
    return core


def _timed_step(core) -> float:
    from vllm.v1.engine.core import EngineCoreProc

    started = time.monotonic()
    EngineCoreProc._process_engine_step(core)
    return time.monotonic() - started


@pytest.mark.rules("R16")
def test_r16_waits_until_next_ready_time():
    core = _core(ready_in_ns=30 * MS)
    assert core_wait.engine_wait_timeout_ns(core) > 25 * MS
    elapsed = _timed_step(core)
    assert 0.025 <= elapsed < 5.0, elapsed  # upper bound: far from any other wake-up, not a speed target
    assert core.steps == 1


@pytest.mark.rules("R16")
def test_r16_wait_lasts_until_a_far_ready_time_in_one_wake_up():
    # No re-check cap: a user at 0.1 tok/s ready in 10 s is waited for in one wait.
    core = _core(ready_in_ns=10_000 * MS)
    assert core_wait.engine_wait_timeout_ns(core) > 9_900 * MS
    core = _core(ready_in_ns=120 * MS)
    elapsed = _timed_step(core)
    assert 0.115 <= elapsed < 5.0, elapsed  # one wait to the ready time, well before the 10 s user's
    assert core.steps == 1


@pytest.mark.rules("R16")
@pytest.mark.parametrize("status", ["WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS"])
def test_r16_wait_rechecks_every_50_ms_while_background_work_can_unblock_a_request(status):
    from vllm.v1.request import RequestStatus

    core = _core(ready_in_ns=10_000 * MS)
    core.scheduler.requests = {
        "r1": SimpleNamespace(status=RequestStatus.RUNNING),
        "g1": SimpleNamespace(status=getattr(RequestStatus, status)),
    }
    assert core_wait.engine_wait_timeout_ns(core) == core_wait.BACKGROUND_RECHECK_NS
    core.scheduler.requests["g1"].status = RequestStatus.WAITING  # its grammar is ready
    assert core_wait.engine_wait_timeout_ns(core) > 9_900 * MS


@pytest.mark.rules("R16")
def test_r16_new_request_wakes_the_wait_at_once():
    core = _core(ready_in_ns=10_000 * MS)
    item = ("ADD", "request")
    threading.Timer(0.005, core.input_queue.put_nowait, args=(item,)).start()
    elapsed = _timed_step(core)
    assert elapsed < 5.0, f"woke after {elapsed * 1000:.1f} ms; the next ready time is in 10 s"
    assert core.input_queue.get_nowait() == item  # not consumed: vLLM's loop handles it


@pytest.mark.rules("R16")
def test_r16_queued_input_means_no_wait():
    core = _core(ready_in_ns=10_000 * MS)
    core.input_queue.put_nowait(("ABORT", ["r1"]))
    assert _timed_step(core) < 0.040
    assert core.input_queue.qsize() == 1


@pytest.mark.rules("R16")
@pytest.mark.parametrize(
    "core_kw",
    [
        {"ready_in_ns": None},  # nobody refused in the step
        {"ready_in_ns": -5 * MS},  # already ready
        {"ready_in_ns": 30 * MS, "additional": {}},  # R18: feature off
        {"ready_in_ns": 30 * MS, "dp": 2},  # data-parallel engines step together
        {"ready_in_ns": 30 * MS, "model_executed": True},  # the step ran the model
        # A batch that computes tokens is in flight (async scheduling / batch queue).
        {"ready_in_ns": 30 * MS, "batch_queue": [(None, SimpleNamespace(total_num_scheduled_tokens=3), None)]},
    ],
    ids=["none-refused", "already-ready", "feature-off", "data-parallel", "model-ran", "batch-in-flight"],
)
def test_r16_no_wait(core_kw):
    core = _core(**core_kw)
    if not core_kw.get("model_executed"):
        assert core_wait.engine_wait_timeout_ns(core) == 0
    # vLLM's own 1 ms idle sleep is all that remains.
    assert _timed_step(core) < 0.020


@pytest.mark.rules("R16")
def test_r16_empty_batches_in_flight_still_wait():
    empty = (None, SimpleNamespace(total_num_scheduled_tokens=0), None)
    core = _core(ready_in_ns=30 * MS, batch_queue=[empty])
    assert core_wait.engine_wait_timeout_ns(core) > 25 * MS


@pytest.mark.rules("R16")
def test_r16_unknown_batch_layout_never_waits():
    core = _core(ready_in_ns=30 * MS, batch_queue=["something new"])
    assert core_wait.engine_wait_timeout_ns(core) == 0


@pytest.mark.rules("R16")
def test_r16_scheduler_without_hint_never_waits():
    # A scheduler class that is not the reference (no next_ready_ns): stock behaviour.
    core = _core(ready_in_ns=30 * MS)
    core.scheduler = SimpleNamespace(has_requests=lambda: True)
    assert core_wait.engine_wait_timeout_ns(core) == 0


def test_wait_for_input_times_out_and_consumes_nothing():
    q = queue.Queue()
    started = time.monotonic()
    assert core_wait.wait_for_input(q, 0.02) is False
    assert time.monotonic() - started >= 0.019
    q.put("x")
    assert core_wait.wait_for_input(q, 5.0) is True
    assert q.get_nowait() == "x"


def test_r17_register_reinstalls_a_front_end_check_another_shim_removed():
    """A fork shim that saved ``EngineArgs.create_engine_config`` before our plugin wrapped it
    and later restored it must not silently remove the front-end configuration check."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_output_rate.reference import plugin

    plugin.register()
    ours = EngineArgs.__dict__["create_engine_config"]
    underneath = ours.__wrapped__  # what a shim installed before us would restore
    EngineArgs.create_engine_config = underneath
    try:
        plugin.register()
        assert EngineArgs.__dict__["create_engine_config"] is not underneath
        assert EngineArgs.__dict__["create_engine_config"].__wrapped__ is underneath
    finally:
        if EngineArgs.__dict__["create_engine_config"] is underneath:
            EngineArgs.create_engine_config = ours
