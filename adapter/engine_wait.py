"""R16, black-box: vLLM's own engine-core loop, driven in-process on the gate's fake clock.

Rule R16: while every user with pending requests is throttled, the engine must neither
spin (stock vLLM 0.32 sleeps 1 ms per idle loop: ~1000 wake-ups/s) nor sleep past the next
ready time of a throttled user; a new request or an abort wakes it at once. A wait may last
until that ready time however far it is; the article's engine re-checks at least every
50 ms (``ARTICLE_RECHECK_NS``), an open choice the check accepts.
A candidate (the article's fork merges ``_output_rate_wakeup_ns`` at each refusal and
patches the engine core; the reference does it with a ``vllm.general_plugins`` hook) need
expose nothing: this check only watches *when* vLLM's loop steps.

How the loop is driven (``_drive``, in a fresh child process per candidate):

- The engine is a real ``vllm.v1.engine.core.EngineCoreProc``: ``object.__new__`` plus the
  few attributes its ZMQ constructor would set (queues, shutdown state, no DP, no
  coordinator), then vLLM's own ``EngineCore.__init__`` with a fake executor
  (``_GateExecutor``, a ``vllm.v1.executor.abstract.Executor`` without workers). That
  ``__init__`` loads the general plugins (``vllm.plugins.load_general_plugins()``), sizes
  the KV cache, and builds the scheduler from ``scheduler_config.scheduler_cls`` exactly as
  a served engine does. Then vLLM's ``run_busy_loop`` runs, with whatever the candidate or
  its plugin put into it.
- The model: the executor answers ``execute_model``/``sample_tokens`` with one fabricated
  token per sampling request (as ``adapter/harness.py`` does) and takes ``MODEL_STEP_NS``
  of fake time per step that computes tokens.
- Time: ``time.monotonic[_ns]``, ``perf_counter[_ns]``, ``time[_ns]`` read the fake clock
  (also the copies ``queue`` and ``threading`` keep); every blocking wait the loop can make
  -- ``time.sleep``, ``threading.Condition.wait`` and so ``queue.Queue.get(timeout)``,
  ``Event.wait`` -- advances the fake clock instead of sleeping. A wait on the engine's
  input queue returns at the earliest of its timeout and the fake instant a scripted input
  (new request, abort) is put into that queue; every other wait only times out (nothing
  else can notify it: the ZMQ threads are not running). The run is bounded in fake time
  (``RUN_NS``), loop iterations (``MAX_LOOP_ITERATIONS``) and wall time.
- Plugins: only the ``vllm.general_plugins`` entry points of the packages the candidate
  class is made of (its MRO's top-level packages) are loaded, through ``VLLM_PLUGINS``; so
  the reference's installed plugin never helps a foreign candidate, and every candidate
  gets a process whose vLLM classes no other check has patched.

Scenario (``engine_wait_scenario``): user A, ``A_RATE_TOKENS_PER_S`` with ``A_STREAMS``
streams and huge ``max_tokens``, and user C, ``C_RATE_TOKENS_PER_S`` with one such stream,
both throttled almost all the time with different ready times (A's emission interval is
not a whole number of ns, so its ready times are rounded up, R5); user B (unthrottled,
``B_RATE_TOKENS_PER_S``) sends one short request at a seeded instant in the middle of a
throttled wait; one of A's streams is aborted at another such instant.

Judgement (``judge``), from the observed wake-ups and dispatches only, with the spec
limiter (``spec/limiter.py``) replaying the dispatches to know each user's ready time:
(1) no spin, (2) no oversleep (each throttled user's next token within
``LATENESS_TOLERANCE_NS`` of its ready time; the longest wait is reported, not judged: a
wait of any length that ends by the next ready time is the rule), (2c) no
early wake (a wait on the input queue that timed out, other than one of ``ARTICLE_RECHECK_NS``, ends
no earlier than the next ready time of a user with pending requests: the wait is for the
earliest ready time, rounded up), (3) the new request is scheduled and the abort handled
within ``WAKE_TOLERANCE_NS`` of their arrival.

Polling world (``polling=True``, the multiproc executor's way): ``execute_model`` returns a
future that can ``poll()`` and ``wait_briefly()`` (``_PollingFuture``), and a step takes fake
time inside it. vLLM 0.34.0's ``EngineCore._wait_for_output`` then handles ADD/ABORT inputs
while a step runs (TP > 1, the CPU platform, the ``mp`` backend). In this world B's request
arrives *during an empty step* (the first one after its seeded instant): the engine takes it
in that step, after ``schedule()``, so the input queue is empty when the step ends, and an
engine that then waits for the next ready time keeps B waiting up to a throttled interval.
On releases whose step only calls ``result()`` the request stays queued and wakes the wait.

Async: an ``AsyncScheduler`` subclass runs with ``async_scheduling`` on, so vLLM's
``step_with_batch_queue`` (two batches in flight) drives it; vLLM's CPU platform turns
async scheduling off for a live engine, so the child turns it back on after the config is
built, as a GPU engine would have it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points, packages_distributions
from typing import Any

from vllm_output_rate.adapter.engine_shape import EngineShape, build_vllm_config
from vllm_output_rate.adapter.engine_wait_judge import judge
from vllm_output_rate.adapter.engine_wait_scenario import (
    CHILD_TIMEOUT_S,
    MS,
    EngineWaitScenario,
    EngineWaitVerdict,
    ScriptedInput,
    engine_wait_scenario,
)
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.harness import load_class

CHECK_NAME = "engine-wait/sync"
CHECK_NAME_ASYNC = "engine-wait/async"  # an AsyncScheduler class, through step_with_batch_queue


# =======================================================================================
# Parent side: pick plugins, build the config, run the child, judge.
# =======================================================================================
def candidate_plugins(cls: type) -> list[str]:
    """Names of the ``vllm.general_plugins`` entry points shipped with ``cls``'s code.

    A plugin belongs to the candidate if its entry point's top-level module is the top-level
    package of a class in ``cls.__mro__`` (vLLM itself and builtins excluded), or if it comes
    from the distribution that installs such a package.
    """
    tops = {klass.__module__.split(".")[0] for klass in cls.__mro__}
    tops -= {"vllm", "builtins", "abc", "typing"}
    dists_of = packages_distributions()
    dists = {name.lower() for top in tops for name in dists_of.get(top, [])}
    names = []
    for ep in entry_points(group="vllm.general_plugins"):
        top = ep.value.split(":")[0].split(".")[0]
        dist = getattr(getattr(ep, "dist", None), "name", None)
        if top in tops or (dist is not None and dist.lower() in dists):
            names.append(ep.name)
    return sorted(set(names))


def _build_config(scheduler_cls: str, async_mode: bool, scenario: EngineWaitScenario, style: Any):
    shape = EngineShape(max_num_seqs=8, async_scheduling=async_mode, output_rate=scenario.output_rate())
    config = style.build_vllm_config(shape) if style is not None else build_vllm_config(shape)
    config.scheduler_config.scheduler_cls = scheduler_cls
    return config, shape


def run_engine_wait(
    scheduler_cls: str,
    style: Any = None,
    seed: int = 0,
    *,
    plugins: Sequence[str] | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
    polling: bool = False,
) -> EngineWaitVerdict:
    """R16: run ``scheduler_cls`` inside vLLM's engine-core loop on a fake clock and judge it.

    Args:
        scheduler_cls: dotted path ``pkg.module.ClassName`` of a ``Scheduler`` or
            ``AsyncScheduler`` subclass (async runs vLLM's ``step_with_batch_queue``).
        style: an ``adapter.configstyle`` style (``build_vllm_config(shape)``); None:
            ``engine_shape.build_vllm_config``.
        seed: picks the arrival instants of the new request and of the abort.
        plugins: names of the ``vllm.general_plugins`` to load (``VLLM_PLUGINS``); None:
            those shipped with the candidate's packages (``candidate_plugins``); ``[]``: none.
        timeout_s: real seconds before the child process is killed.
        polling: the multiproc-like world (a polling future; B arrives during an empty step).
    Returns:
        The verdict; ``failure`` is None iff R16 held. A crash of the candidate or of the
        child becomes a failure naming it, never an exception.
    Raises:
        ValueError: ``scheduler_cls`` is not a dotted path to a class.
    """
    return run_engine_waits([(scheduler_cls, plugins, polling)], style=style, seed=seed, timeout_s=timeout_s)[0]


def run_engine_waits(
    candidates: Sequence[str | tuple[str, Sequence[str] | None] | tuple[str, Sequence[str] | None, bool]],
    style: Any = None,
    seed: int = 0,
    *,
    timeout_s: float = CHILD_TIMEOUT_S,
) -> list[EngineWaitVerdict]:
    """``run_engine_wait`` for several candidates, one child process for all of them.

    The child imports vLLM's engine core once (~10 s), then forks one process per candidate,
    so each one still starts with no plugin loaded and no vLLM class patched.
    ``candidates``: dotted class paths, or ``(path, plugins)`` pairs, or ``(path, plugins,
    polling)`` (``plugins`` and ``polling`` as in ``run_engine_wait``). Returns the verdicts
    in order.

    Raises:
        ValueError: a path is not a dotted path to a class.
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # deferred: vLLM costs seconds to import

    started = time.monotonic()
    verdicts: list[EngineWaitVerdict] = []
    runs: list[dict] = []
    for candidate in candidates:
        scheduler_cls, plugins, polling = (
            (candidate, None, False) if isinstance(candidate, str) else (*candidate, False)[:3]
        )
        scenario = engine_wait_scenario(seed, polling=bool(polling))
        cls = load_class(scheduler_cls)
        async_mode = issubclass(cls, AsyncScheduler)
        allowed = sorted(plugins) if plugins is not None else candidate_plugins(cls)
        verdict = EngineWaitVerdict(
            scheduler_cls, async_mode=async_mode, polling=bool(polling), seed=seed, plugins=list(allowed)
        )
        verdicts.append(verdict)
        try:
            config, shape = _build_config(scheduler_cls, async_mode, scenario, style)
        except Exception as error:  # a config the candidate refuses is its failure
            verdict.failure = f"the engine could not be configured for the R16 scenario: {error}"
            verdict.error = traceback.format_exc()
            continue
        runs.append(
            {
                "index": len(verdicts) - 1,
                "config": config,
                "shape": shape,
                "scenario": scenario,
                "plugins": list(allowed),
            }
        )
    observations = _run_child(runs, timeout_s) if runs else []
    for run, obs in zip(runs, observations):
        judge(obs, run["scenario"], verdicts[run["index"]])
    elapsed = time.monotonic() - started
    for verdict in verdicts:
        verdict.seconds = elapsed / max(1, len(verdicts))
    return verdicts


def check_engine_wait(scheduler_cls: str, seed: int, tick: Callable[[], None], style: Any = None):
    """The gate's ``engine-wait/sync`` row (rule R16): ``run_engine_wait`` as a ``CheckResult``.

    Two examples: the seeded scenario through vLLM's engine-core loop with plain futures,
    and again in the polling world (a multiproc-like future; B's request arrives during an
    empty step); the first failure is the row's. ``steps`` counts the loops' wake-ups. An
    ``AsyncScheduler`` class is driven through ``step_with_batch_queue`` and its row is
    named ``engine-wait/async``. ``tick`` is called once. Raises nothing for a failing
    candidate (``ValueError`` only for a malformed class path).
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # deferred: vLLM costs seconds to import

    name = CHECK_NAME_ASYNC if issubclass(load_class(scheduler_cls), AsyncScheduler) else CHECK_NAME
    result = CheckResult(name, ["R16"])
    tick()
    found = run_engine_waits([(scheduler_cls, None, False), (scheduler_cls, None, True)], style=style, seed=seed)
    result.examples = len(found)
    result.steps = sum(v.wakeups for v in found)
    result.seconds = sum(v.seconds for v in found)
    verdict = next((v for v in found if v.failure is not None), None)
    if verdict is not None:
        result.result = "fail"
        world = " (polling future, as vLLM's multiproc executor)" if verdict.polling else ""
        result.failure = f"{verdict.rule}{world}: {verdict.failure}"
        inputs = engine_wait_scenario(seed, polling=verdict.polling).inputs
        result.counterexample = [f"seed {seed}: {_describe(ev)}" for ev in inputs]
        result.counterexample.append(_numbers(verdict))
    return result


def _describe(ev: ScriptedInput) -> str:
    when = "during the first empty step from" if ev.during_step else "at"
    return f"{ev.kind} {ev.request_id} {when} {ev.at_ns / MS:.3f} ms"


def _numbers(v: EngineWaitVerdict) -> str:
    def ms(ns: int | None) -> str:
        return "never" if ns is None else f"{ns / MS:.3f} ms"

    return (
        f"{v.wakeups} wake-ups ({v.productive_steps} steps ran the model, {v.idle_wakeups} idle; allowed "
        f"{v.allowed_idle_wakeups} idle in {v.throttled_ns / MS:.1f} ms throttled); lateness {ms(v.max_lateness_ns)}; "
        f"longest wait {ms(v.max_wait_ns)}; new request {ms(v.new_request_latency_ns)}; abort {ms(v.abort_latency_ns)}"
    )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)  # set per candidate in its forked process
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("DO_NOT_TRACK", "1"),
    ):
        env.setdefault(key, value)
    # The child imports what this process can (as multiprocessing's spawn passes sys.path):
    # candidate classes defined in test modules or scripts resolve there too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    return env


def _run_child(runs: list[dict], timeout_s: float) -> list[dict]:
    """Run ``runs`` in one child (``_child_main``); one observation dict per run."""
    payload = pickle.dumps(runs)
    with tempfile.TemporaryDirectory(prefix="outrate-engine-wait-") as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "vllm_output_rate.adapter.engine_wait_child", tmp],
                input=payload,
                capture_output=True,
                timeout=timeout_s * len(runs),
                env=_child_env(),
            )
            tail = proc.stderr.decode(errors="replace")[-3000:]
            why = f"the engine-core child exited with code {proc.returncode} and no result:\n{tail}"
        except subprocess.TimeoutExpired:
            why = f"the engine-core child did not finish in {timeout_s * len(runs):.0f} s (killed)"
        observations = []
        for i in range(len(runs)):
            path = os.path.join(tmp, f"{i}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    observations.append(json.load(handle))
            else:
                observations.append({"error": why})
        return observations
