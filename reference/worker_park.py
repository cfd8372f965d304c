"""R16, worker side: the worker parks while the engine core waits (docs/PERFORMANCE.md "Idle cost").

With the feature on, a ``VllmWorker-*`` process's RPC reader parks on its notify socket
right after an ``execute_model`` RPC that scheduled no token (the engine core is about to
wait or to idle), instead of busy-polling vLLM's shared-memory queue for 1 s; the next RPC
resets vLLM's window, so a decoding engine keeps vLLM's spin. The engine core makes the
ping of the RPC that follows an empty step lossless (``zmq.XPUB_NODROP`` on the queue's
notify socket, only while the worker may be parked: vLLM's ``SNDHWM`` of 1 silently drops
a ping sent within about 1 ms of the previous one, and a parked reader then sleeps until
vLLM's 5 s re-check). ``VLLM_OUTPUT_RATE_WORKER_PARK=0`` in the server's environment turns
both off (vLLM's own spin; ``WORKER_PARK_ENV``). Installed by the plugin
(``reference/plugin.py``, ``install_worker_park``).

Source: docs/SPEC.md R16, docs/PERFORMANCE.md "Idle cost".
"""

from __future__ import annotations

import functools
import os
from typing import Any

import zmq

from vllm_output_rate.reference.hooks import OUR_WRAPPERS, feature_on

# R16, worker side (docs/PERFORMANCE.md "Idle cost"): vLLM 0.32's multiproc executor worker
# reads its RPCs from a shared-memory queue whose reader (``SpinCondition.wait``) busy-polls
# with sched_yield for 1 s after each message before it parks on the queue's zmq notify
# socket. An all-throttled engine core sends an empty ``execute_model`` RPC at every wake-up
# (each ready time), more often than once a second, so the worker never parks: 100% of a core. With the feature on, the
# worker parks right after an empty ``execute_model`` and the engine core's pings are made
# lossless; this variable set to "0" turns both off (vLLM's own behaviour).
WORKER_PARK_ENV = "VLLM_OUTPUT_RATE_WORKER_PARK"


def worker_park_enabled(vllm_config) -> bool:
    """R16, worker side: whether this engine's worker parks after an empty step.

    True with the feature on (R18) unless ``VLLM_OUTPUT_RATE_WORKER_PARK`` is "0"
    (``WORKER_PARK_ENV``; any other value, or unset, leaves it on).
    """
    return feature_on(vllm_config) and os.environ.get(WORKER_PARK_ENV, "").strip() != "0"


def make_pings_lossless(message_queue, on: bool = True) -> bool:
    """R16, worker side: the writer of vLLM's shm ``MessageQueue`` never drops a wake-up ping
    (``on``), or drops as vLLM's does (``on=False``).

    vLLM's writer publishes one ping per ``enqueue`` on a zmq PUB socket with ``SNDHWM`` 1,
    and PUB drops a message when its pipe is at the high-water mark: a ping sent within
    about 1 ms of the previous one (before the socket has processed the credit its I/O
    thread returned) is lost, and a reader parked on it sleeps until vLLM's 5 s re-check.
    ``zmq.XPUB_NODROP`` makes that send wait for the credit instead. A socket option, set
    through zmq on vLLM's socket; vLLM's queue is otherwise untouched. Returns True if set
    (False: the queue has no local readers, so no notify socket).
    """
    condition = getattr(message_queue, "_spin_condition", None)
    socket = getattr(condition, "local_notify_socket", None)
    if condition is None or condition.is_reader or socket is None:
        return False
    socket.setsockopt(zmq.XPUB_NODROP, 1 if on else 0)
    return True


def park_reader(message_queue) -> bool:
    """R16, worker side: the next wait of this shm ``MessageQueue`` reader parks at once.

    vLLM's reader busy-polls while ``now <= last_read + busy_loop_s`` (1 s); this marks
    the last read as long past, so the next ``SpinCondition.wait`` goes straight to vLLM's
    poll on the notify socket (woken by the next ``enqueue``'s ping, re-checked every 5 s
    by vLLM). vLLM's own ``record_read`` at the next message restores the window. Returns
    True if the queue has a local reader to park.
    """
    condition = getattr(message_queue, "_spin_condition", None)
    if condition is None or not getattr(condition, "is_reader", False):
        return False
    condition.last_read = float("-inf")
    return True


def is_empty_step_rpc(rpc_request) -> bool:
    """True for an ``execute_model`` RPC whose ``SchedulerOutput`` schedules no token.

    ``rpc_request`` is the multiproc executor's ``(method, args, kwargs, output_rank)``.
    That is the RPC the engine core sends before it waits for budget (R16) or idles.
    """
    try:
        method, args, _kwargs, _rank = rpc_request
    except (TypeError, ValueError):
        return False
    if method != "execute_model" or not args:
        return False
    return getattr(args[0], "total_num_scheduled_tokens", None) == 0


def install_worker_park() -> None:
    """Wrap the multiproc executor on both sides (R16, worker side; module docstring).

    Worker: ``WorkerProc._init_message_queues`` records whether to park
    (``worker_park_enabled``); ``WorkerProc._execute_worker_rpc`` runs the RPC as vLLM
    does, then after an empty ``execute_model`` parks the RPC reader (``park_reader``).
    Engine core: ``MultiprocExecutor.collective_rpc`` (every RPC to the workers goes through
    it) makes the RPC queue's pings lossless (``make_pings_lossless``) for the sends that
    follow an empty ``execute_model`` -- the worker may be parked then -- and vLLM's again
    once a non-empty RPC is sent (the worker is awake and spinning: a decoding engine's
    sends stay exactly vLLM's, never waiting on the ping's credit).
    """
    try:
        # deferred: a vLLM engine module (seconds to import)
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    except ImportError:  # another vLLM layout: nothing to do (vLLM's spin stays)
        return
    if WorkerProc._execute_worker_rpc in OUR_WRAPPERS:
        return

    init_executor = MultiprocExecutor._init_executor

    @functools.wraps(init_executor)
    def _init_executor(self) -> None:
        init_executor(self)
        self._output_rate_park = worker_park_enabled(getattr(self, "vllm_config", None))

    collective_rpc = MultiprocExecutor.collective_rpc

    @functools.wraps(collective_rpc)
    def _collective_rpc(self, method, *args: Any, **kwargs: Any):
        if getattr(self, "_output_rate_park", False):
            rpc_args = kwargs.get("args", args[1] if len(args) > 1 else ())
            # The worker parks after an empty execute_model (below): the ping of the next
            # message it reads must not be dropped; after any other RPC it spins (vLLM's).
            lossless = getattr(self, "_output_rate_after_empty", False)
            if lossless != getattr(self, "_output_rate_lossless", False):
                make_pings_lossless(self.rpc_broadcast_mq, lossless)
                self._output_rate_lossless = lossless
            self._output_rate_after_empty = is_empty_step_rpc((method, rpc_args, {}, None))
        return collective_rpc(self, method, *args, **kwargs)

    init_queues = WorkerProc._init_message_queues

    @functools.wraps(init_queues)
    def _init_message_queues(self, input_shm_handle, vllm_config) -> None:
        init_queues(self, input_shm_handle, vllm_config)
        self._output_rate_park = worker_park_enabled(vllm_config)

    execute_rpc = WorkerProc._execute_worker_rpc

    @functools.wraps(execute_rpc)
    def _execute_worker_rpc(self, rpc_request) -> None:
        execute_rpc(self, rpc_request)
        if getattr(self, "_output_rate_park", False) and is_empty_step_rpc(rpc_request):
            park_reader(self.rpc_broadcast_mq)

    OUR_WRAPPERS.add(_execute_worker_rpc)
    MultiprocExecutor._init_executor = _init_executor
    MultiprocExecutor.collective_rpc = _collective_rpc
    WorkerProc._init_message_queues = _init_message_queues
    WorkerProc._execute_worker_rpc = _execute_worker_rpc
