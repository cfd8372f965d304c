"""R16's child-side fake world (``World``): the fake clock, the scripted inputs put into the
engine's input queue, fake blocking waits, and the recorded observations; and the polling
future of the multiproc-like world (``polling_future_class``).

Used by the child process (``adapter/engine_wait_child.py``); times ns.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue as queue_module
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any
from unittest import mock

from vllm_output_rate.adapter.engine_wait_scenario import (
    MAX_LOOP_ITERATIONS,
    MODEL_STEP_NS,
    PROMPT_LEN,
    WALL_LIMIT_S,
    EngineWaitScenario,
)
from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID, FakeClock, patched_time
from vllm_output_rate.adapter.tinymodel import EOS_TOKEN_ID


# =======================================================================================
# Child side: vLLM's engine core on the fake clock.
# =======================================================================================
class RunOver(BaseException):
    """Ends the run from inside the loop (a BaseException: vLLM's ``except Exception`` and its
    fault-tolerance wrapper let it through)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class World:
    """The child's fake world: clock, scripted inputs, recorded observations."""

    def __init__(self, scenario: EngineWaitScenario) -> None:
        self.clock = FakeClock()
        self.scenario = scenario
        self.script = list(scenario.inputs)
        self.engine: Any = None  # the EngineCoreProc, once built
        self.wakeups: list[list] = []  # [t, ran the model]
        self.steps: list[dict] = []
        self.waits: list[list] = []  # [start, end, pending, kind]
        self.aborts: list[list] = []  # [t, ids]
        self.sampled_of: dict[int, list[str]] = {}  # id(SchedulerOutput) -> sampling ids
        self.wall_start = time.perf_counter()
        self._real_perf = time.perf_counter
        self.iterations = 0
        # Waits are faked only in the engine loop's thread while the loop runs; set-up and
        # any other thread (vLLM's helpers) keep real waits.
        self.looping = False
        self.loop_thread: int | None = None
        self.step_fn_name = ""
        self.in_empty_step = False  # inside an empty step's polling future (polling world)
        self.arrived: dict[str, int] = {}  # during-step request id -> instant it reached the input queue

    # -- time -----------------------------------------------------------------------
    def _deliver_due(self) -> None:
        # deferred: vLLM costs seconds to import; the child has it loaded by now
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType  # deferred: vLLM

        engine = self.engine
        due = [i for i in self.script if i.at_ns <= self.clock.now_ns() and (self.in_empty_step or not i.during_step)]
        for item in due if engine is not None else ():
            self.script.remove(item)
            if item.during_step:  # its arrival is when it came, not its scripted lower bound
                self.arrived[item.request_id] = self.clock.now_ns()
            if item.kind == "add":
                params = SamplingParams(max_tokens=item.max_tokens, extra_args={"output_rate_user": item.user})
                params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
                ecr = EngineCoreRequest(
                    request_id=item.request_id,
                    prompt_token_ids=[NON_EOS_TOKEN_ID + 1 + i for i in range(PROMPT_LEN)],
                    mm_features=None,
                    sampling_params=params,
                    pooling_params=None,
                    arrival_time=self.clock.now_ns() / 1e9,
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                )
                # What vLLM's input thread does before queueing an ADD.
                message = (EngineCoreRequestType.ADD, engine.preprocess_add_request(ecr))
            else:
                message = (EngineCoreRequestType.ABORT, [item.request_id])
            q = engine.input_queue
            if q.mutex.locked():  # we are inside a wait on the queue's condition: hold its lock
                q._put(message)
                q.unfinished_tasks += 1
            else:
                q.put_nowait(message)

    def _next_input_ns(self) -> float:
        """The next instant a scripted input can arrive outside a step (waits never see
        ``during_step`` inputs)."""
        return min((i.at_ns for i in self.script if not i.during_step), default=math.inf)

    def next_step_input_ns(self, empty: bool) -> float:
        """The next instant a scripted input can arrive during a step (``during_step``
        inputs only during an empty one)."""
        return min((i.at_ns for i in self.script if empty or not i.during_step), default=math.inf)

    def advance_in_step(self, to_ns: int, empty: bool) -> None:
        """Inside a step's polling future: move the clock to ``to_ns`` (never back) and
        deliver the inputs due by then (``during_step`` ones too if the step is empty)."""
        self.clock.advance(max(0, to_ns - self.clock.now_ns()))
        self.in_empty_step = empty
        try:
            self._deliver_due()
        finally:
            self.in_empty_step = False

    def block(self, timeout_s: float | None, wake_on_input: bool, kind: str) -> bool:
        """A blocking wait: advance the fake clock to its end (its timeout, or for a wait on
        the input queue the next scripted input), deliver due inputs, record it.

        Returns True if the input queue holds an item afterwards (a wait on it was woken).
        Raises ``RunOver`` at the end of fake time, or for a wait that could never end.
        """
        start = self.clock.now_ns()
        limit = math.inf if timeout_s is None else start + max(0, math.ceil(timeout_s * 1e9))
        target = min(limit, self._next_input_ns()) if wake_on_input else limit
        engine = self.engine
        pending = bool(getattr(engine, "scheduler", None) is not None and engine.scheduler.has_requests())
        if target == math.inf:
            self.waits.append([start, start, pending, kind])
            raise RunOver("idle with no more input" if wake_on_input else f"a {kind} wait without timeout")
        end = min(int(target), max(self.scenario.run_ns, start))
        self.clock.advance(end - start)
        self.waits.append([start, end, pending, kind])
        self._deliver_due()
        if end < target:
            raise RunOver("fake time")
        q = getattr(engine, "input_queue", None)
        return wake_on_input and q is not None and bool(q.queue)

    def model_step(self) -> None:
        """One model step that computes tokens: ``MODEL_STEP_NS`` of fake time, then the inputs due."""
        self.clock.advance(MODEL_STEP_NS)
        self._deliver_due()

    def check_bounds(self) -> None:
        """Count a loop iteration; raises ``RunOver`` past ``run_ns`` of fake time,
        ``MAX_LOOP_ITERATIONS`` iterations or ``WALL_LIMIT_S`` real seconds."""
        self.iterations += 1
        if self.clock.now_ns() >= self.scenario.run_ns:
            raise RunOver("fake time")
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise RunOver("loop iterations")
        if self._real_perf() - self.wall_start > WALL_LIMIT_S:
            raise RunOver("wall time")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Fake clocks and fake blocking waits, for the whole child."""
        world = self
        real_sleep = time.sleep

        def fake_sleep(seconds: float) -> None:
            if not world.looping or threading.get_ident() != world.loop_thread:
                return real_sleep(seconds)
            world.block(max(0.0, float(seconds)), wake_on_input=False, kind="sleep")

        real_condition_wait = threading.Condition.wait

        def fake_condition_wait(cond, timeout=None):
            if not world.looping or threading.get_ident() != world.loop_thread:
                return real_condition_wait(cond, timeout)  # set-up, or another thread: real
            engine = world.engine
            on_input = engine is not None and cond is getattr(getattr(engine, "input_queue", None), "not_empty", None)
            return world.block(timeout, wake_on_input=on_input, kind="input-queue" if on_input else "condition")

        with patched_time(self.clock), contextlib.ExitStack() as patches:
            # time.monotonic is the fake clock's here; each patch is undone when the block ends.
            for owner, name, fake in (
                (time, "sleep", fake_sleep),
                (time, "perf_counter_ns", self.clock.now_ns),
                (time, "time_ns", self.clock.now_ns),
                (queue_module, "time", time.monotonic),
                (threading, "_time", time.monotonic),
                (threading.Condition, "wait", fake_condition_wait),
            ):
                patches.enter_context(mock.patch.object(owner, name, fake))
            yield


@functools.cache
def polling_future_class():
    """The polling world's future class (``_PollingFuture``, a ``concurrent.futures.Future``), built once."""

    class _PollingFuture(Future):
        """A step's result as vLLM's multiproc executor returns it: ``poll()`` (done yet?)
        and ``wait_briefly(pending, deadline)`` (wait until done, ``pending`` is non-empty
        or ``time.monotonic()`` reaches ``deadline``); the step lasts ``duration_ns`` of fake
        time, during which due inputs reach the engine's input queue."""

        def __init__(self, world: World, value: Any, duration_ns: int, empty: bool) -> None:
            super().__init__()
            self._world, self._value, self._empty = world, value, empty
            self._done_at = world.clock.now_ns() + duration_ns

        def _settle(self) -> bool:
            if not self.done() and self._world.clock.now_ns() >= self._done_at:
                self.set_result(self._value)
            return self.done()

        def poll(self) -> bool:
            self._world.advance_in_step(self._world.clock.now_ns(), self._empty)
            return self._settle()

        def wait_briefly(self, pending: Any, deadline: float) -> None:
            if len(pending):
                return
            until = min(self._done_at, math.ceil(deadline * 1e9), self._world.next_step_input_ns(self._empty))
            self._world.advance_in_step(int(until), self._empty)
            self._settle()

        def result(self, timeout: float | None = None) -> Any:
            if not self.done():
                self._world.advance_in_step(self._done_at, self._empty)
                self._settle()
            return super().result(timeout)

    return _PollingFuture
