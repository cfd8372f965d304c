"""R16, engine-core side: the engine core waits for budget instead of spinning.

When a step ran no model, the engine core waits on its input queue until the earliest
ready time among users refused in that step instead of spinning in vLLM's 1 ms sleeps; a
new request or abort wakes it at once. Only while a waiting request is blocked on work
done in the background (its structured-output grammar being compiled, its KV cache being
received) is the wait capped at 50 ms (``BACKGROUND_RECHECK_NS``), so that such a request
is seen soon after it becomes schedulable. The same wrapper writes the operator log's
throttled-users line on time (``log_on_time``). Installed by the plugin
(``reference/plugin.py``, ``install_engine_wait``) with the feature on.

Source: docs/SPEC.md R16.
"""

from __future__ import annotations

import functools
import time

from vllm_output_rate.reference import vllm_compat
from vllm_output_rate.reference.hooks import OUR_WRAPPERS, feature_on

# R16: while a waiting request is blocked on work done in the background (a structured-output
# grammar being compiled, KV blocks being received), nothing wakes the engine's wait when that
# work ends; the engine core then re-checks at least this often. Otherwise it waits until the
# earliest ready time (or new input), however far away.
BACKGROUND_RECHECK_NS = 50_000_000
# vLLM's request states whose end the wait cannot see (``vllm.v1.request.RequestStatus`` names).
BACKGROUND_BLOCKED_STATES = ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_FSM", "WAITING_FOR_REMOTE_KVS")


def engine_wait_timeout_ns(core) -> int:
    """R16: how long the engine core may wait after a step that ran no model (0: don't).

    The scheduler's ``next_ready_ns()`` - now (the earliest ready time of a user refused in
    the step), capped at ``BACKGROUND_RECHECK_NS`` (50 ms) only while a waiting request is
    blocked on background work (``background_blocked``); and 0 unless: the scheduler offers
    ``next_ready_ns`` and some user was refused in the step, the feature is on, the engine
    is a single (non data-parallel) engine, and no batch that ran the model is still in
    flight (async scheduling / pipeline batch queue), and no input deferred during the step
    is pending (``vllm_compat.deferred_inputs``, 0.34.0). A new request or abort ends the
    wait at once (``wait_for_input``); one the engine took during the step (0.34.0, a
    polling executor future) means no wait at all (``_install_engine_wait``).
    """
    scheduler = getattr(core, "scheduler", None)
    next_ready_ns = getattr(scheduler, "next_ready_ns", None)
    if scheduler is None or next_ready_ns is None or not feature_on(getattr(core, "vllm_config", None)):
        return 0
    if getattr(core.vllm_config.parallel_config, "data_parallel_size", 1) > 1:
        return 0  # DP engines must keep stepping together (and DP is refused anyway)
    ready_ns = next_ready_ns()
    if ready_ns is None or not scheduler.has_requests():
        return 0
    if not _nothing_in_flight(core):
        return 0
    if vllm_compat.deferred_inputs(core):
        return 0  # inputs taken during the step are handled at the next loop: go there now
    clock_ns = getattr(scheduler, "clock_ns", time.monotonic_ns)
    now_ns = clock_ns()
    timeout_ns = max(0, ready_ns - now_ns)
    if background_blocked(scheduler):
        timeout_ns = min(BACKGROUND_RECHECK_NS, timeout_ns)
    log_due_ns = _operator_log_due_ns(scheduler)
    if log_due_ns is not None:  # the throttled-users line is written on time (log_on_time)
        timeout_ns = min(timeout_ns, max(0, log_due_ns - now_ns))
    return timeout_ns


def _operator_log_due_ns(scheduler) -> int | None:
    due = getattr(scheduler, "operator_log_due_ns", None)
    return None if due is None else due()


def log_on_time(core) -> bool:
    """Operator log: write the scheduler's throttled-users line when its interval ends, also
    when no ``schedule()`` runs then (``oplog.ThrottleLog``). Called after each engine step.

    With requests left, the R16 wait already ends at the line's due time
    (``engine_wait_timeout_ns``). With none left (the engine goes idle, vLLM's loop would
    block on its input queue), this waits on the input queue until the line is due (new
    input ends the wait at once; not while vLLM has idle callbacks to run, e.g. a pause
    waiting for the engine to drain). Then the line is written if due. Returns True if
    a line was written.
    """
    scheduler = getattr(core, "scheduler", None)
    flush = getattr(scheduler, "flush_operator_log", None)
    due_ns = _operator_log_due_ns(scheduler)
    if scheduler is None or flush is None or due_ns is None:
        return False
    clock_ns = getattr(scheduler, "clock_ns", time.monotonic_ns)
    if not scheduler.has_requests() and not vllm_compat.idle_callbacks(core):
        timeout_ns = due_ns - clock_ns()
        if timeout_ns > 0:
            wait_for_input(core.input_queue, timeout_ns / 1e9)
    return flush(clock_ns())


def background_blocked(scheduler) -> bool:
    """R16: True if one of ``scheduler.requests`` (vLLM's dict of unfinished requests) is in a
    state that background work ends (``BACKGROUND_BLOCKED_STATES``: a grammar being
    compiled, KV blocks being received), which no input wakes the engine for; also True
    if the requests cannot be read (an unknown layout: keep re-checking)."""
    # deferred: a vLLM engine module (seconds to import)
    from vllm.v1.request import RequestStatus

    blocked = {getattr(RequestStatus, name) for name in BACKGROUND_BLOCKED_STATES if hasattr(RequestStatus, name)}
    try:
        return any(request.status in blocked for request in scheduler.requests.values())
    except (AttributeError, TypeError):
        return True


def _nothing_in_flight(core) -> bool:
    """True if no dispatched batch that computes tokens awaits its result (batch queue)."""
    batch_queue = vllm_compat.batch_queue(core)
    if not batch_queue:
        return True
    try:
        return all(entry[1].total_num_scheduled_tokens == 0 for entry in batch_queue)
    except (AttributeError, IndexError, TypeError):
        return False  # an unknown layout: never delay in-flight results


def wait_for_input(input_queue, timeout_s: float) -> bool:
    """Block until ``input_queue`` holds an item or ``timeout_s`` passes; consume nothing.

    The engine core's own loop then handles the item as usual. The check and the wait are
    made under the queue's lock, so a request put in between still wakes the wait at once.
    Returns True if an item is waiting.
    """
    with input_queue.not_empty:
        if not input_queue.queue:
            input_queue.not_empty.wait(timeout_s)
        return bool(input_queue.queue)


def install_engine_wait() -> None:
    """R16: after a step that ran no model, wait on the input queue (``engine_wait_timeout_ns``)
    unless an input reached the engine during the step: with a polling executor future,
    vLLM 0.34.0 handles ADD/ABORT while a step runs (after ``schedule()``), so a request
    that arrived then is pending and unscheduled while the queue is empty. Every input is
    counted in ``_handle_client_request`` (``vllm_compat.count_inputs``)."""
    # deferred: a vLLM engine module (seconds to import)
    from vllm.v1.engine.core import EngineCoreProc

    original = getattr(EngineCoreProc, vllm_compat.ENGINE_STEP)

    @functools.wraps(original)
    def _process_engine_step(self) -> bool:
        inputs_before = vllm_compat.inputs_handled(self)
        model_executed = original(self)
        if not model_executed and vllm_compat.inputs_handled(self) == inputs_before:
            timeout_ns = engine_wait_timeout_ns(self)
            if timeout_ns > 0:
                wait_for_input(self.input_queue, timeout_ns / 1e9)
        log_on_time(self)
        return model_executed

    setattr(EngineCoreProc, vllm_compat.ENGINE_STEP, _process_engine_step)
    handler = EngineCoreProc.__dict__[vllm_compat.INPUT_HANDLER]
    if handler not in OUR_WRAPPERS:
        counting = vllm_compat.count_inputs(handler)
        OUR_WRAPPERS.add(counting)
        setattr(EngineCoreProc, vllm_compat.INPUT_HANDLER, counting)
