"""R16, worker side (docs/PERFORMANCE.md "Idle cost"; issue 15 item 6): with the feature on,
the multiproc executor's worker parks after an empty ``execute_model`` RPC instead of
busy-polling vLLM's shared-memory queue for 1 s, and the engine core's wake-up pings on that
queue are lossless.

vLLM 0.32's ``SpinCondition.wait`` busy-loops (``sched_yield``) while ``now <= last_read +
busy_loop_s`` (1 s) and only then parks on the queue's zmq notify socket; an all-throttled
engine core sends an (empty) RPC at least every 50 ms (R16), so the worker never parked
(100% of a core). Parking alone is not enough: vLLM's PUB notify socket has ``SNDHWM`` 1 and
drops a ping sent within about 1 ms of the previous one, so a parked reader missed it and
slept until vLLM's 5 s re-check (how many depends on timing, so it is measured, not asserted:
``make bench`` counts lost pings and the round trip side by side).
CPU percentages are measured by ``make bench`` (side by side), not asserted here.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

from vllm_output_rate.livebench import ping_round_trips
from vllm_output_rate.reference import worker_park
from vllm_output_rate.reference.hooks import OUR_WRAPPERS

ON = SimpleNamespace(additional_config={"output_rate": {"default_tokens_per_s": 5.0}})
OFF = SimpleNamespace(additional_config={})


@pytest.fixture
def originals(monkeypatch):
    """vLLM's executor functions, restored after the test (the install replaces them). If an
    earlier test of the session installed the plugin already, its wrappers are taken off
    first, so every test starts from vLLM's own functions."""
    installed = WorkerProc._execute_worker_rpc in OUR_WRAPPERS

    def vllms(function):
        return function.__wrapped__ if installed else function  # one layer: the four are ours together

    saved = {
        "init_executor": vllms(MultiprocExecutor._init_executor),
        "collective_rpc": vllms(MultiprocExecutor.collective_rpc),
        "init_queues": vllms(WorkerProc._init_message_queues),
        "execute_rpc": vllms(WorkerProc._execute_worker_rpc),
    }
    monkeypatch.setattr(MultiprocExecutor, "_init_executor", saved["init_executor"])
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", saved["collective_rpc"])
    monkeypatch.setattr(WorkerProc, "_init_message_queues", saved["init_queues"])
    monkeypatch.setattr(WorkerProc, "_execute_worker_rpc", saved["execute_rpc"])
    return saved


@pytest.mark.parametrize(
    "config, env, parks",
    [
        (ON, None, True),
        (ON, "1", True),
        (ON, "", True),
        (ON, " 0 ", False),
        (ON, "0", False),
        (OFF, None, False),
        (None, None, False),
    ],
)
def test_r16_worker_parks_only_with_the_feature_on_unless_turned_off(monkeypatch, config, env, parks):
    if env is None:
        monkeypatch.delenv(worker_park.WORKER_PARK_ENV, raising=False)
    else:
        monkeypatch.setenv(worker_park.WORKER_PARK_ENV, env)
    assert worker_park.worker_park_enabled(config) is parks


def _step(tokens: int) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.total_num_scheduled_tokens = tokens
    return output


def test_r16_only_an_execute_model_that_schedules_nothing_is_an_empty_step():
    assert worker_park.is_empty_step_rpc(("execute_model", (_step(0),), {}, 0))
    assert not worker_park.is_empty_step_rpc(("execute_model", (_step(3),), {}, 0))
    assert not worker_park.is_empty_step_rpc(("sample_tokens", (None,), {}, 0))
    assert not worker_park.is_empty_step_rpc((b"\x80pickled", (), {}, None))
    assert not worker_park.is_empty_step_rpc(("execute_model", (), {}, 0))
    assert not worker_park.is_empty_step_rpc("garbage")


def _worker_proc(park: bool, reader) -> tuple[WorkerProc, list]:
    """A WorkerProc shell around ``reader`` whose worker records the RPCs it ran."""
    ran: list = []
    proc = WorkerProc.__new__(WorkerProc)
    proc.worker = SimpleNamespace(execute_model=lambda out: ran.append(out.total_num_scheduled_tokens) or "result")
    proc.rank = 0
    proc.rpc_broadcast_mq = reader
    proc.handle_output = lambda output: ran.append(output)
    proc._output_rate_park = park
    return proc, ran


def _spinning(condition) -> bool:
    """Whether vLLM's ``SpinCondition.wait`` would busy-loop now instead of parking."""
    return time.monotonic() <= condition.last_read + condition.busy_loop_s


def test_r16_worker_rpc_runs_as_vllm_then_parks_after_an_empty_step_only(originals):
    worker_park.install_worker_park()
    assert WorkerProc._execute_worker_rpc is not originals["execute_rpc"]
    worker_park.install_worker_park()  # idempotent: not wrapped twice
    assert WorkerProc._execute_worker_rpc.__wrapped__ is originals["execute_rpc"]
    condition = SimpleNamespace(is_reader=True, last_read=time.monotonic(), busy_loop_s=1.0)
    reader = SimpleNamespace(_spin_condition=condition)

    proc, ran = _worker_proc(True, reader)
    proc._execute_worker_rpc(("execute_model", (_step(4),), {}, 0))
    assert ran == [4, "result"] and _spinning(condition)  # decoding: vLLM's 1 s window stays
    proc._execute_worker_rpc(("execute_model", (_step(0),), {}, 0))
    assert ran[2:] == [0, "result"] and not _spinning(condition)  # the engine core waits: park
    condition.last_read = time.monotonic()  # vLLM's record_read at the next message
    assert _spinning(condition)

    off, ran_off = _worker_proc(False, reader)
    off._execute_worker_rpc(("execute_model", (_step(0),), {}, 0))
    assert ran_off == [0, "result"] and _spinning(condition)  # feature off: vLLM's spin


@pytest.mark.parametrize("config, expected", [(ON, True), (OFF, False)])
def test_r16_worker_records_at_queue_setup_whether_to_park(originals, monkeypatch, config, expected):
    monkeypatch.delenv(worker_park.WORKER_PARK_ENV, raising=False)
    monkeypatch.setattr(WorkerProc, "_init_message_queues", lambda self, handle, vllm_config: None)
    worker_park.install_worker_park()
    proc = WorkerProc.__new__(WorkerProc)
    proc._init_message_queues(None, config)
    assert proc._output_rate_park is expected


class _Socket:
    """Records the options set on a notify socket."""

    def __init__(self) -> None:
        self.options: list[tuple[int, int]] = []

    def setsockopt(self, option: int, value: int) -> None:
        self.options.append((option, value))


def test_r16_engine_core_pings_lossless_only_while_the_worker_may_be_parked(originals, monkeypatch):
    import zmq

    monkeypatch.delenv(worker_park.WORKER_PARK_ENV, raising=False)
    sent: list[tuple[str, bool]] = []

    def init_executor(self) -> None:  # vLLM's, reduced to the RPC queue it builds
        self.rpc_broadcast_mq = SimpleNamespace(
            _spin_condition=SimpleNamespace(is_reader=False, local_notify_socket=_Socket())
        )

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        sent.append((method, getattr(self, "_output_rate_lossless", False)))
        return method

    monkeypatch.setattr(MultiprocExecutor, "_init_executor", init_executor)
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", collective_rpc)
    worker_park.install_worker_park()
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.vllm_config = ON
    executor._init_executor()
    socket = executor.rpc_broadcast_mq._spin_condition.local_notify_socket
    steps = [
        ("execute_model", 5),
        ("sample_tokens", None),
        ("execute_model", 0),
        ("execute_model", 0),
        ("execute_model", 2),
        ("sample_tokens", None),
        ("execute_model", 0),
        ("add_lora", None),
        ("execute_model", 1),
    ]
    for method, tokens in steps:
        args = (_step(tokens),) if tokens is not None else (None,)
        assert executor.collective_rpc(method, args=args, unique_reply_rank=0) == method  # vLLM's call, its result
    # Lossless exactly for the sends that follow an empty step (the worker parked after it).
    assert [lossless for _method, lossless in sent] == [False, False, False, True, True, False, False, True, False]
    assert socket.options == [(zmq.XPUB_NODROP, 1), (zmq.XPUB_NODROP, 0), (zmq.XPUB_NODROP, 1), (zmq.XPUB_NODROP, 0)]

    executor_off = MultiprocExecutor.__new__(MultiprocExecutor)
    executor_off.vllm_config = OFF
    executor_off._init_executor()
    sent.clear()
    executor_off.collective_rpc("execute_model", args=(_step(0),))
    executor_off.collective_rpc("execute_model", args=(_step(1),))
    assert executor_off.rpc_broadcast_mq._spin_condition.local_notify_socket.options == []  # feature off: vLLM's


def test_r16_park_reader_marks_only_a_reader():
    writer = MessageQueue(1, 1)
    reader = SimpleNamespace(
        _spin_condition=SimpleNamespace(is_reader=True, last_read=time.monotonic(), busy_loop_s=1.0)
    )
    assert worker_park.park_reader(reader) and not _spinning(reader._spin_condition)
    assert not worker_park.park_reader(writer)
    assert not worker_park.park_reader(SimpleNamespace(_spin_condition=None))


def test_r16_lossless_pings_wake_a_parked_reader_every_time():
    result = ping_round_trips(lossless=True, park=True, steps=300, timeout_s=1.0)
    assert result["messages"] == 600 and result["lost"] == 0
