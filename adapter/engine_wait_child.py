"""R16's child process: vLLM's engine core on the fake clock (``python -m`` this module).

``_child_main`` imports vLLM's engine core once, then forks one process per candidate;
``_drive`` builds a real ``EngineCoreProc`` around the candidate with the gate's worker-less
executor (``_GateExecutor``: fabricated model outputs, fake step time), observes the loop
(``_instrument``) and runs vLLM's ``run_busy_loop`` in the fake world
(``adapter/engine_wait_world.py``). The parent (``adapter/engine_wait.py``) reads one JSON
observation per run.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any

from vllm_output_rate.adapter.engine_shape import build_kv_cache_config
from vllm_output_rate.adapter.engine_wait_scenario import MODEL_STEP_NS, POLLING_EMPTY_STEP_NS
from vllm_output_rate.adapter.engine_wait_world import RunOver, World, polling_future_class
from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID
from vllm_output_rate.adapter.vllm_compat import model_runner_output, prepare_engine_core

_RESULT_SCHEMA = 1


def _fabricated_output(scheduler_output, sampled: list[str]):
    """One non-EOS token per sampling request (``harness`` fabricates the same)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    chosen = set(sampled)
    return model_runner_output(req_ids, [[NON_EOS_TOKEN_ID] if r in chosen else [] for r in req_ids])


_WORLD: World | None = None  # the child's world (one run per child process)
_SHAPE: Any = None  # the child's EngineShape (adapter/harness.py), set with _WORLD


def _done(value: Any) -> Any:
    """A finished ``concurrent.futures.Future`` holding ``value``."""
    future: Future = Future()
    future.set_result(value)
    return future


def _step_future(value: Any, empty: bool) -> Any:
    """A step's future: plain and finished, or in the polling world one that takes the step's
    fake time (``POLLING_EMPTY_STEP_NS`` for an empty step, else ``MODEL_STEP_NS``)."""
    world = _WORLD
    if world is None or not world.scenario.polling:
        return _done(value)
    return polling_future_class()(world, value, POLLING_EMPTY_STEP_NS if empty else MODEL_STEP_NS, empty)


class _GateExecutorMethods:
    """The gate executor's behaviour, mixed into vLLM's ``Executor`` by ``_executor_class``: no
    workers, a fixed KV cache (``_SHAPE``), fabricated model outputs, fake step time.
    ``empty_output``: vLLM's ``EMPTY_MODEL_RUNNER_OUTPUT`` (set on the class that mixes it in)."""

    empty_output: Any = None

    def _init_executor(self) -> None:
        self._spec = build_kv_cache_config(_SHAPE).kv_cache_groups[0].kv_cache_spec
        self._pending = None

    def get_kv_cache_specs(self):
        return [{"layer.0": self._spec}]

    def determine_available_memory(self):
        return [self._spec.page_size_bytes * (_SHAPE.num_blocks + 8)]

    def set_kv_cache_layout(self, layout_name: str, *extra) -> None:
        # Later releases pass more arguments (Executor.set_kv_cache_layout); only the layout is kept.
        self.kv_cache_layout = layout_name

    def initialize_from_config(self, kv_cache_configs) -> None:
        self.kv_cache_configs = kv_cache_configs

    def compile_or_warm_up_model(self) -> None:
        return None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        result = [None]
        return _done(result) if non_block else result

    def execute_model(self, scheduler_output, non_block: bool = False):
        empty = scheduler_output.total_num_scheduled_tokens == 0
        if empty:
            value = self.empty_output
        else:
            world = _WORLD
            assert world is not None, "the child sets _WORLD before it builds the engine"
            sampled = world.sampled_of.pop(id(scheduler_output), [])
            if not (world.scenario.polling and non_block):
                world.model_step()  # the polling future takes the step's time instead
            self._pending, value = _fabricated_output(scheduler_output, sampled), None
        return _step_future(value, empty) if non_block else value

    def sample_tokens(self, grammar_output, non_block: bool = False):
        value, self._pending = self._pending, None
        return _done(value) if non_block else value

    def take_draft_token_ids(self):
        return None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _executor_class():
    """The gate's executor class: ``_GateExecutorMethods`` on vLLM's ``Executor``."""
    # deferred: vLLM costs seconds to import (the child imports it once, before it forks)
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT  # deferred: vLLM

    class _GateExecutor(_GateExecutorMethods, Executor):
        """An executor without workers: fixed KV cache, fabricated model outputs, fake time."""

        empty_output = EMPTY_MODEL_RUNNER_OUTPUT

        def get_supported_kv_cache_layouts(self):
            from vllm.v1.kv_cache_layout import KVCacheLayout  # deferred: vLLM, as above

            return [[layout.name for layout in KVCacheLayout]]

    return _GateExecutor


def _build_engine(world: World, vllm_config):
    """A real ``EngineCoreProc`` without its ZMQ handshake: vLLM's ``EngineCore.__init__``
    with the gate's executor (which loads the general plugins and builds the scheduler)."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState  # deferred: vLLM

    engine = object.__new__(EngineCoreProc)
    world.engine = engine
    # The attributes EngineCoreProc.__init__ sets around its handshake (single engine, no
    # data parallelism, no coordinator, no tensor IPC), then vLLM's own EngineCore set-up.
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    engine.engine_index = 0
    engine.engines_running = False
    engine.shutdown_state = EngineShutdownState.RUNNING
    prepare_engine_core(engine)  # the per-release attributes (adapter/vllm_compat.py)
    engine.tensor_ipc_receiver = None
    engine.has_coordinator = False
    engine.frontend_stats_publish_address = None
    engine.publish_dp_lb_stats = False
    engine.last_counts = (0, 0)
    engine.process_input_queue_block = True
    engine._init_data_parallel(vllm_config)
    EngineCore.__init__(engine, vllm_config, _executor_class(), log_stats=False)
    engine.enable_fault_tolerance = False
    _instrument(world, engine)
    return engine


def _instrument(world: World, engine) -> None:
    """Observe (never change) the loop: wrap the instance's ``step_fn`` and the scheduler's
    ``schedule`` / ``finish_requests`` to record fake instants."""
    scheduler = engine.scheduler
    if hasattr(scheduler, "clock_ns"):
        scheduler.clock_ns = world.clock.now_ns  # as the harness does (the reference's clock)
    step_fn = engine.step_fn
    world.step_fn_name = getattr(step_fn, "__name__", type(step_fn).__name__)
    schedule = scheduler.schedule
    finish_requests = scheduler.finish_requests

    def observed_step_fn(*args, **kwargs):
        world.check_bounds()
        t = world.clock.now_ns()
        before = len(world.steps)
        try:
            return step_fn(*args, **kwargs)
        finally:
            ran = any(s["tokens"] > 0 for s in world.steps[before:])
            world.wakeups.append([t, ran])

    def observed_schedule(*args, **kwargs):
        t = world.clock.now_ns()
        so = schedule(*args, **kwargs)
        sampled = [
            rid
            for rid in so.num_scheduled_tokens
            if (r := scheduler.requests.get(rid)) is not None and not r.is_prefill_chunk
        ]
        world.sampled_of[id(so)] = sampled
        world.steps.append(
            {
                "t": t,
                "tokens": so.total_num_scheduled_tokens,
                "scheduled": list(so.num_scheduled_tokens),
                "sampled": sampled,
            }
        )
        return so

    def observed_finish_requests(request_ids, *args, **kwargs):
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or [])
        world.aborts.append([world.clock.now_ns(), ids])
        return finish_requests(request_ids, *args, **kwargs)

    engine.step_fn = observed_step_fn
    scheduler.schedule = observed_schedule
    scheduler.finish_requests = observed_finish_requests


def _drive(payload: dict) -> dict:
    """Child: build the engine around the candidate and run vLLM's busy loop on fake time."""
    global _WORLD, _SHAPE
    config, scenario = payload["config"], payload["scenario"]
    _SHAPE = payload["shape"]
    if _SHAPE.async_scheduling:
        config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turned it off
    config.cache_config.num_gpu_blocks_override = _SHAPE.num_blocks
    world = _WORLD = World(scenario)
    obs: dict[str, Any] = {"schema": _RESULT_SCHEMA}
    with world.installed():
        try:
            engine = _build_engine(world, config)
        except BaseException:  # the candidate's constructor failed
            obs["error"] = traceback.format_exc()
            return obs
        obs["step_fn"] = world.step_fn_name
        world.loop_thread, world.looping = threading.get_ident(), True
        try:
            engine.run_busy_loop()
            obs["stopped_by"] = "loop returned"
        except RunOver as over:
            obs["stopped_by"] = over.why
        except SystemExit:
            obs["stopped_by"] = "loop exited"
        except BaseException:  # the candidate raised inside the loop
            obs["error"] = traceback.format_exc()
            obs["stopped_by"] = "error"
        world.looping = False
        obs.update(
            end_ns=world.clock.now_ns(),
            wakeups=world.wakeups,
            steps=world.steps,
            waits=world.waits,
            aborts=world.aborts,
            arrivals=world.arrived,
            async_scheduling=bool(getattr(engine, "async_scheduling", False)),
            batch_queue=engine.batch_queue is not None,
            real_seconds=world._real_perf() - world.wall_start,
        )
    return obs


def _child_main(out_dir: str) -> None:
    """Child entry: import vLLM's engine core once, then fork one process per run (each
    sets its own ``VLLM_PLUGINS`` before vLLM loads any plugin) and wait for it."""
    # deferred: the expensive import, shared by every fork
    import vllm.plugins
    import vllm.v1.engine.core  # deferred: vLLM's engine core, ~10 s

    runs = pickle.load(sys.stdin.buffer)
    assert not vllm.plugins.plugins_loaded, "plugins must load in each candidate's own process"
    for i, run in enumerate(runs):
        out_path = os.path.join(out_dir, f"{i}.json")
        pid = os.fork() if hasattr(os, "fork") and len(runs) > 1 else 0
        if pid == 0:
            os.environ["VLLM_PLUGINS"] = ",".join(run["plugins"])
            try:
                obs = _drive(run)
            except BaseException:  # reported, never raised
                obs = {"error": traceback.format_exc()}
            with open(out_path, "w") as handle:
                json.dump(obs, handle)
            if len(runs) > 1:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        else:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    _child_main(sys.argv[1])
