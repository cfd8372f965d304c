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

import bisect
import contextlib
import functools
import itertools
import json
import math
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any
from unittest import mock

MS = 1_000_000  # ns per millisecond

# -- the rule ---------------------------------------------------------------------------
ARTICLE_RECHECK_NS = 50 * MS
"""The article's engine waits min(next ready time, 50 ms): it re-checks at least this often
even if no throttled user is ready sooner. R16 does not require it (the reference waits until
the ready time); the check accepts it: a wait of this length that ends before a ready time is
not an early wake, and the spin bound allows one idle wake-up per this much throttled time."""

STOCK_IDLE_SLEEP_NS = 1 * MS
"""vLLM 0.32 ``EngineCoreProc._process_engine_step``: ``time.sleep(0.001)`` after a step that
ran no model while requests remain -- the spin R16 forbids when every user is throttled."""

# -- tolerances -------------------------------------------------------------------------
LATENESS_TOLERANCE_NS = 1 * MS + 10_000
"""How late (ns) a throttled user's next token may be dispatched after its ready time: one stock 1 ms idle sleep (vLLM's own
``_process_engine_step`` still sleeps it before a plugin's wait) plus 10 us for float-second
timeouts; it also covers a ready time that falls inside a ``MODEL_STEP_NS`` model step."""

FLOAT_TIMEOUT_SLACK_NS = 10_000
"""How far (ns) a wait's length may differ from the timeout it was given in float seconds."""

WAKE_TOLERANCE_NS = 1 * MS + 10_000
"""How long (ns) after its arrival a new request may be first scheduled, or an abort handed
to the scheduler: at most one stock 1 ms idle sleep (not interruptible) plus 10 us."""

SPIN_SLACK_WAKEUPS = 2
"""Idle wake-ups allowed per throttled interval on top of ceil(interval / ARTICLE_RECHECK_NS): the step
that finds everyone refused, and one at an interval's edge."""

# -- the scenario -----------------------------------------------------------------------
USER_A = "user-a"
USER_B = "user-b"
USER_C = "user-c"
A_RATE_TOKENS_PER_S = 3
"""User A's rate (the default rate): a token every 333.33... ms, one at a time (burst
100 ms); the emission interval 10**9 / 3 ns is not whole, so A's ready times are not whole
ns either and a ready time rounded down (R5) wakes the engine 1 ns early."""
C_RATE_TOKENS_PER_S = 5
"""User C's override: a token every 200 ms, one stream; C's ready times fall between A's,
so an engine waiting for the latest ready time (not the earliest) wakes late for one."""
A_STREAMS = 2
A_MAX_TOKENS = 1_000
"""Large: A's streams never finish in the run (and within the tiny model's 2048 positions)."""
B_RATE_TOKENS_PER_S = 1000
"""User B's override: B is never throttled in its short request."""
B_MAX_TOKENS = 4
PROMPT_LEN = 4
RUN_NS = 1_200 * MS
"""Fake time (ns) the engine runs: A's tokens at 0, 233.3, 566.7, 900 ms, C's every 200 ms
from 100 ms on."""
NEW_REQUEST_WINDOW_NS = (320 * MS, 480 * MS)
"""B's request arrives at a seeded instant in here: after C's token at 300 ms, inside A's
throttled interval 233-567 ms."""
ABORT_WINDOW_NS = (720 * MS, 880 * MS)
"""One of A's streams is aborted at a seeded instant in here (A's interval 567-900 ms)."""
MODEL_STEP_NS = 200_000
"""Fake time (ns) one model step that computes tokens takes."""
POLLING_EMPTY_STEP_NS = 5_000
"""Fake time (ns) an empty step takes in the polling world (the executor's round trip for a
step with no token); inside the 10 us slack of ``WAKE_TOLERANCE_NS``, so a request taken
during an empty step may still be scheduled after one stock 1 ms idle sleep."""

# -- bounds -----------------------------------------------------------------------------
MAX_LOOP_ITERATIONS = 20_000
"""Engine-loop iterations after which a run stops (stock vLLM needs ~1,200 for ``RUN_NS``)."""
WALL_LIMIT_S = 60.0
"""Real seconds after which the child stops the loop (a wait the gate cannot drive)."""
CHILD_TIMEOUT_S = 240.0
"""Real seconds after which the parent kills the child process."""

CHECK_NAME = "engine-wait/sync"
CHECK_NAME_ASYNC = "engine-wait/async"  # an AsyncScheduler class, through step_with_batch_queue
_RESULT_SCHEMA = 1


@dataclass(frozen=True)
class ScriptedInput:
    """One input put into the engine's input queue at fake instant ``at_ns``.

    ``kind`` "add" (a request of ``user`` with ``max_tokens``) or "abort" (of ``request_id``).
    ``during_step``: the input arrives during the first empty engine step at or after
    ``at_ns`` (polling world), never during a wait.
    """

    at_ns: int
    kind: str
    request_id: str
    user: str = ""
    max_tokens: int = 0
    during_step: bool = False


@dataclass(frozen=True)
class EngineWaitScenario:
    """The seeded R16 scenario: inputs, rates, run length (all times ns)."""

    inputs: tuple[ScriptedInput, ...]
    rates: dict[str, int]  # user -> tokens/s
    burst_ns: int
    run_ns: int
    new_request_id: str
    aborted_request_id: str
    polling: bool = False  # the multiproc-like world: steps return a polling future

    def output_rate(self) -> dict[str, Any]:
        """The ``output_rate`` section of ``EngineShape`` for this scenario."""
        return {
            "default_tokens_per_s": A_RATE_TOKENS_PER_S,
            "user_tokens_per_s": {USER_B: B_RATE_TOKENS_PER_S, USER_C: C_RATE_TOKENS_PER_S},
        }


def engine_wait_scenario(seed: int = 0, polling: bool = False) -> EngineWaitScenario:
    """The R16 scenario for ``seed`` (only the arrival instants of B's request and the abort vary).

    ``polling``: the multiproc-like world, where B's request arrives during an empty step.
    """
    from vllm_output_rate.spec.limiter import BURST_NS

    rng = random.Random(seed)
    t_new = rng.randrange(*NEW_REQUEST_WINDOW_NS)
    t_abort = rng.randrange(*ABORT_WINDOW_NS)
    inputs = [ScriptedInput(0, "add", f"a{i}", USER_A, A_MAX_TOKENS) for i in range(A_STREAMS)]
    inputs.append(ScriptedInput(0, "add", "c0", USER_C, A_MAX_TOKENS))
    inputs.append(ScriptedInput(t_new, "add", "b0", USER_B, B_MAX_TOKENS, during_step=polling))
    inputs.append(ScriptedInput(t_abort, "abort", f"a{A_STREAMS - 1}"))
    return EngineWaitScenario(
        inputs=tuple(sorted(inputs, key=lambda i: i.at_ns)),
        rates={USER_A: A_RATE_TOKENS_PER_S, USER_B: B_RATE_TOKENS_PER_S, USER_C: C_RATE_TOKENS_PER_S},
        burst_ns=BURST_NS,
        run_ns=RUN_NS,
        new_request_id="b0",
        aborted_request_id=f"a{A_STREAMS - 1}",
        polling=polling,
    )


@dataclass
class EngineWaitVerdict:
    """The R16 verdict on one candidate (times in ns, counts of loop events).

    ``failure``: None if R16 held, else one sentence in the article's terms.
    ``wakeups``: engine-loop iterations (``step_fn`` calls) in the run; ``idle_wakeups``
    those that scheduled no token; ``throttled_ns`` the fake time of the intervals in which
    idle wake-ups happened (every user with pending requests throttled) and
    ``allowed_idle_wakeups`` the bound for them. ``max_lateness_ns``: the latest dispatch of
    a throttled user's next token after its ready time; ``max_wait_ns`` the longest gap
    between wake-ups while requests were pending; ``new_request_latency_ns`` /
    ``abort_latency_ns``: arrival to first scheduled / to the scheduler's
    ``finish_requests`` (None: never); in the polling world B's arrival is the instant it
    reached the input queue, during an empty step. ``plugins``: the general plugins allowed to load;
    ``max_early_ns``: how long before the next ready time of a user with pending
    requests a wait on the input queue, other than one of ``ARTICLE_RECHECK_NS``, timed out (0:
    never early); ``seconds``: real seconds of the run (a batch's time shared equally);
    ``engine_step``: the engine's step function (``step``, or ``step_with_batch_queue`` for
    async scheduling); ``over_grants``: sampling dispatches the spec limiter refuses (an R2
    matter, reported, not judged here); ``stopped_by``: what ended the run; ``rule``: the
    rule the failure names (R16; R5 when the early wake is at ``floor(TAT - tau)``, 1 ns
    before ``ready_at``: the rounding of R5 broken, ``early_rounded_down``).
    """

    scheduler_cls: str
    async_mode: bool = False
    polling: bool = False  # the multiproc-like world (``_PollingFuture``)
    failure: str | None = None
    rule: str = "R16"
    seed: int = 0
    fake_ns: int = 0
    wakeups: int = 0
    productive_steps: int = 0
    idle_wakeups: int = 0
    throttled_ns: int = 0
    allowed_idle_wakeups: int = 0
    median_idle_gap_ns: int | None = None
    max_lateness_ns: int = 0
    lateness_detail: str = ""
    max_early_ns: int = 0
    early_detail: str = ""
    early_rounded_down: bool = False  # the early wake is at floor(TAT - tau): R5's rounding, not R16's wait
    max_wait_ns: int = 0
    new_request_latency_ns: int | None = None
    abort_latency_ns: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    over_grants: int = 0
    plugins: list[str] = field(default_factory=list)
    stopped_by: str = ""
    engine_step: str = ""
    seconds: float = 0.0
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict."""
        return asdict(self)


# =======================================================================================
# Parent side: pick plugins, build the config, run the child, judge.
# =======================================================================================
def candidate_plugins(cls: type) -> list[str]:
    """Names of the ``vllm.general_plugins`` entry points shipped with ``cls``'s code.

    A plugin belongs to the candidate if its entry point's top-level module is the top-level
    package of a class in ``cls.__mro__`` (vLLM itself and builtins excluded), or if it comes
    from the distribution that installs such a package.
    """
    from importlib.metadata import entry_points, packages_distributions

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
    from vllm_output_rate.adapter.harness import EngineShape, build_vllm_config

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
            ``harness.build_vllm_config``.
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
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_output_rate.adapter.harness import load_class

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
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_output_rate.adapter.conform import CheckResult
    from vllm_output_rate.adapter.harness import load_class

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
                [sys.executable, "-m", "vllm_output_rate.adapter.engine_wait", tmp],
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


# =======================================================================================
# Judgement: pure, from the observation.
# =======================================================================================
def judge(obs: dict, scenario: EngineWaitScenario, verdict: EngineWaitVerdict) -> EngineWaitVerdict:
    """Fill ``verdict`` from the child's observation ``obs`` of ``scenario`` (rule R16).

    ``obs``: ``wakeups`` (fake instants of loop iterations, each with whether it ran the
    model), ``steps`` (each ``schedule()``: instant, scheduled and sampling request ids),
    ``waits`` (fake blocking waits: start, end, requests pending), ``aborts`` (instants of
    ``finish_requests`` calls and their ids), ``end_ns``, ``stopped_by``, ``error``.
    """
    if obs.get("error") and "end_ns" not in obs:
        verdict.failure = f"the engine could not be built around the candidate: {obs['error'].strip().splitlines()[-1]}"
        verdict.error = obs["error"]
        return verdict
    end_ns = obs["end_ns"]
    verdict.fake_ns = end_ns
    verdict.stopped_by = obs.get("stopped_by", "")
    verdict.engine_step = obs.get("step_fn", "")
    steps = obs["steps"]
    wakeups = obs["wakeups"] or [[s["t"], s["tokens"] > 0] for s in steps]
    verdict.wakeups = len(wakeups)
    productive = [s for s in steps if s["tokens"] > 0]
    verdict.productive_steps = len(productive)
    run = _Replay(scenario, end_ns, wakeups, obs.get("arrivals", {}))
    run.replay(productive, verdict)
    _judge_spin(run, productive, verdict)
    _judge_oversleep(run, verdict)
    _judge_longest_wait(run, obs, verdict)
    _judge_early_wake(run, obs, verdict)

    # (3) new input wakes the engine.
    t_new = run.arrivals[scenario.new_request_id]
    first = next((s["t"] for s in steps if scenario.new_request_id in s["scheduled"]), None)
    verdict.new_request_latency_ns = None if first is None else first - t_new
    handled = next((a[0] for a in obs["aborts"] if scenario.aborted_request_id in a[1] and a[0] >= run.t_abort), None)
    verdict.abort_latency_ns = None if handled is None else handled - run.t_abort

    verdict.failure = _first_failure(verdict, obs)
    return verdict


class _Replay:
    """One run's facts for ``judge``: the scenario's requests (user, ``max_tokens``, arrival),
    the sampling dispatches replayed through the spec limiter (R1-R5) and the ready times
    they imply."""

    def __init__(
        self, scenario: EngineWaitScenario, end_ns: int, wakeups: list[Any], arrived: dict[str, int] | None = None
    ) -> None:
        self.scenario, self.end_ns, self.wakeups = scenario, end_ns, wakeups
        self.user_of = {i.request_id: i.user for i in scenario.inputs if i.kind == "add"}
        self.max_tokens = {i.request_id: i.max_tokens for i in scenario.inputs if i.kind == "add"}
        # An input that arrives during a step (polling world) arrives when it reached the queue.
        self.arrivals = {
            i.request_id: (arrived or {}).get(i.request_id, i.at_ns) for i in scenario.inputs if i.kind == "add"
        }
        self.t_abort = next(i.at_ns for i in scenario.inputs if i.kind == "abort")
        self.sampled_by_user: dict[str, list[int]] = {}
        self.dispatch_times: dict[str, list[int]] = {}  # request id -> instants of its sampling dispatches
        self.expectations: list[tuple[str, int, int]] = []  # (user, dispatch instant, ready instant)
        self.replay_at: list[tuple[int, Any]] = []  # (instant of a step, replay state after it)

    def demand(self, user: str, t: int) -> bool:
        """``user`` still wants a token at ``t`` (``_has_demand``)."""
        return _has_demand(
            user,
            t,
            self.dispatch_times,
            self.user_of,
            self.max_tokens,
            self.arrivals,
            self.scenario.aborted_request_id,
            self.t_abort,
        )

    def replay(self, productive: list[dict[str, Any]], verdict: EngineWaitVerdict) -> None:
        """Replay the sampling dispatches through the spec limiter (R1-R5) for the ready times."""
        from vllm_output_rate.spec import limiter

        scenario, user_of = self.scenario, self.user_of
        sampled_by_user, dispatch_times, expectations = self.sampled_by_user, self.dispatch_times, self.expectations
        state = limiter.EMPTY
        self.replay_at.append((-1, state))
        for s in productive:
            users_now = []
            for rid in s["sampled"]:
                user = user_of.get(rid)
                if user is None:
                    continue
                state, granted = limiter.try_take(
                    state, user, Fraction(scenario.rates[user]), s["t"], scenario.burst_ns
                )
                verdict.over_grants += not granted
                dispatch_times.setdefault(rid, []).append(s["t"])
                sampled_by_user.setdefault(user, []).append(s["t"])
                users_now.append(user)
            self.replay_at.append((s["t"], state))
            for user in set(users_now):
                ready = limiter.ready_at_ns(state, user, scenario.burst_ns)
                if ready is not None and ready > s["t"]:
                    expectations.append((user, s["t"], ready))
        verdict.tokens = {u: len(ts) for u, ts in sampled_by_user.items()}


def _judge_spin(run: _Replay, productive: list[dict[str, Any]], verdict: EngineWaitVerdict) -> None:
    """(1) Spin: idle wake-ups (while some user still wants tokens) per interval between events."""
    scenario, end_ns, wakeups = run.scenario, run.end_ns, run.wakeups
    # Events: steps that ran the model, inputs, the end of the run.
    arrivals = set(run.arrivals.values()) | {run.t_abort}
    events = sorted({s["t"] for s in productive} | arrivals | {end_ns})
    idle_in: dict[int, int] = {}
    idle_times = []
    for t, ran in wakeups:
        if ran or not any(run.demand(u, t) for u in scenario.rates):
            continue  # a step that ran the model, or one with nobody left wanting a token
        idle_times.append(t)
        k = max(0, bisect.bisect_right(events, t) - 1)
        idle_in[k] = idle_in.get(k, 0) + 1
    verdict.idle_wakeups = len(idle_times)
    for k in idle_in:
        length = (events[k + 1] if k + 1 < len(events) else end_ns) - events[k]
        verdict.throttled_ns += length
        verdict.allowed_idle_wakeups += math.ceil(length / ARTICLE_RECHECK_NS) + SPIN_SLACK_WAKEUPS
    gaps = sorted(b - a for a, b in itertools.pairwise(idle_times))
    verdict.median_idle_gap_ns = gaps[len(gaps) // 2] if gaps else None


def _judge_oversleep(run: _Replay, verdict: EngineWaitVerdict) -> None:
    """(2a) Oversleep: a throttled user with demand gets its next token at its ready time."""
    end_ns, sampled_by_user, expectations = run.end_ns, run.sampled_by_user, run.expectations
    for user, at, ready in expectations:
        if not run.demand(user, ready):
            continue
        times = sampled_by_user[user]
        k = bisect.bisect_right(times, at)
        later = times[k : k + 1]
        if later:
            late = later[0] - ready
        elif end_ns > ready:
            late = end_ns - ready  # never dispatched again
        else:
            continue
        if late > verdict.max_lateness_ns:
            verdict.max_lateness_ns = late
            verdict.lateness_detail = (
                f"{user} became ready at {ready / MS:.3f} ms and its next token was dispatched "
                + (f"at {later[0] / MS:.3f} ms" if later else f"never (run ended at {end_ns / MS:.3f} ms)")
            )


def _judge_longest_wait(run: _Replay, obs: dict[str, Any], verdict: EngineWaitVerdict) -> None:
    """(2b) The longest wait while requests were pending (reported: how long a wait may be is
    bounded by the ready times, judged in (2a), and by new input, judged in (3))."""
    end_ns, wakeups = run.end_ns, run.wakeups
    # (2b) longest wait while requests were pending: gaps between wake-ups spanning a
    # pending fake wait (and the gap from the last wake-up to the end of the run).
    instants = [t for t, _ in wakeups] + [end_ns]
    pending_waits = sorted((w[0], w[1]) for w in obs["waits"] if w[2] and w[1] > w[0])
    starts = [w[0] for w in pending_waits]
    for a, b in itertools.pairwise(instants):
        k = bisect.bisect_left(starts, a)
        if k < len(starts) and starts[k] < b:
            verdict.max_wait_ns = max(verdict.max_wait_ns, b - a)


def _judge_early_wake(run: _Replay, obs: dict[str, Any], verdict: EngineWaitVerdict) -> None:
    """(2c) Early wake: a hinted wait on the input queue ends no earlier than the first ready time."""
    from vllm_output_rate.spec import limiter

    scenario, end_ns, replay_at = run.scenario, run.end_ns, run.replay_at
    # (2c) early wake: a wait on the input queue that timed out, other than the article's
    # 50 ms re-check (a wait of ARTICLE_RECHECK_NS, give or take a float timeout's rounding),
    # so that the wait hint ended it, must not end before the earliest
    # ready time (R5: rounded up) of the users with pending requests, from the replay at
    # the wait's start (nothing is dispatched during a wait).
    inputs_at = set(run.arrivals.values()) | {run.t_abort}
    replay_times = [t for t, _ in replay_at]
    for w in _merged_waits(obs["waits"]):
        start, end, pending, kind = w[0], w[1], w[2], w[3]
        if (
            kind != "input-queue"
            or not pending
            or not start < end < end_ns
            or end in inputs_at
            or abs(end - start - ARTICLE_RECHECK_NS) <= FLOAT_TIMEOUT_SLACK_NS
        ):
            continue
        at = replay_at[bisect.bisect_right(replay_times, start) - 1][1]
        readies = []
        for user in scenario.rates:
            if run.demand(user, end):
                ready = limiter.ready_at_ns(at, user, scenario.burst_ns)
                readies.append((start if ready is None else ready, user))
        if readies and min(readies)[0] - end > verdict.max_early_ns:
            ready, user = min(readies)
            verdict.max_early_ns = ready - end
            verdict.early_detail = (
                f"its wait on the input queue ended at {end} ns, {ready - end} ns before {user}'s "
                f"ready time {ready} ns, with every user with pending requests still refused"
            )
            # R5: a wake at floor(TAT - tau), 1 ns before ceil(TAT - tau), is ready_at rounded down
            exact = at.tat_ns[user] - scenario.burst_ns if user in at.tat_ns else None
            verdict.early_rounded_down = (
                exact is not None and exact.denominator != 1 and math.floor(exact) == end and ready - end == 1
            )


def _merged_waits(waits: list[list[Any]]) -> list[list[Any]]:
    """Waits on the input queue that follow each other without a gap, as one wait: Python's
    ``queue.Queue.get(timeout)`` waits again for what float rounding of its deadline leaves
    (e.g. 1 ns after a 50 ms wait), which is the same wait, not an early wake."""
    merged: list[list[Any]] = []
    for w in waits:
        last = merged[-1] if merged else None
        if (
            last is not None
            and w[3] == last[3] == "input-queue"
            and w[0] == last[1]
            and w[1] - w[0] <= FLOAT_TIMEOUT_SLACK_NS
        ):
            last[1] = w[1]
        else:
            merged.append(list(w))
    return merged


def _has_demand(
    user: str,
    ready: int,
    dispatch_times: dict[str, list[int]],
    user_of: dict[str, str],
    max_tokens: dict[str, int],
    arrivals: dict[str, int],
    aborted_id: str,
    t_abort: int,
) -> bool:
    """True if ``user`` has a request, arrived by ``ready``, still wanting tokens at ``ready``."""
    for rid, u in user_of.items():
        if u != user or arrivals[rid] > ready or (rid == aborted_id and t_abort <= ready):
            continue
        if bisect.bisect_left(dispatch_times.get(rid, []), ready) < max_tokens[rid]:
            return True
    return False


def _first_failure(v: EngineWaitVerdict, obs: dict) -> str | None:
    def ms(ns: int) -> str:
        return f"{ns / MS:.1f} ms"

    if obs.get("error"):
        return f"the engine loop raised: {obs['error'].strip().splitlines()[-1]}"
    if v.productive_steps == 0:
        return "the engine never ran the model: no request was scheduled in the R16 scenario"
    if v.idle_wakeups == 0:
        return (
            f"no user was ever throttled ({USER_A} got {v.tokens.get(USER_A, 0)} tokens at {A_RATE_TOKENS_PER_S} tok/s "
            f"in {ms(v.fake_ns)}, {v.over_grants} of them over the rate), so the engine wait could not be judged"
        )
    if v.idle_wakeups > v.allowed_idle_wakeups:
        how = (
            "stock vLLM's 1 ms idle loop"
            if v.median_idle_gap_ns is not None and v.median_idle_gap_ns <= 3 * STOCK_IDLE_SLEEP_NS // 2
            else f"a wake-up every {ms(v.median_idle_gap_ns or 0)}"
        )
        return (
            f"the engine spun: {v.idle_wakeups} wake-ups in {ms(v.throttled_ns)} while every user was throttled "
            f"({how}, at most {v.allowed_idle_wakeups} allowed); the article's engine waits until the next ready "
            f"time (at most 50 ms)"
        )
    if v.max_lateness_ns > LATENESS_TOLERANCE_NS:
        return (
            f"the engine overslept: {v.lateness_detail}, {ms(v.max_lateness_ns)} late; the article's engine wakes at "
            f"the next ready time of a throttled user"
        )
    if v.max_early_ns > 0 and v.early_rounded_down:
        v.rule = "R5"
        return (
            f"R5 broken: the engine woke early, at ready_at rounded down: {v.early_detail}; that instant is "
            f"floor(TAT - tau) of a TAT - tau that is not a whole ns, and R5's ready_at is ceil(TAT - tau) (a take "
            f"there is still refused); the article's engine waits until the earliest ready time (at most 50 ms)"
        )
    if v.max_early_ns > 0:
        return (
            f"the engine woke early: {v.early_detail}; the article's engine waits until the earliest ready time of a "
            f"throttled user (ready_at rounded up), or 50 ms"
        )
    if v.new_request_latency_ns is None or v.new_request_latency_ns > WAKE_TOLERANCE_NS:
        when = "never" if v.new_request_latency_ns is None else f"only after {ms(v.new_request_latency_ns)}"
        if v.polling:
            return (
                f"a new request did not wake the engine: {USER_B}'s request, taken by the engine during an empty "
                f"step, was scheduled {when}; after a step that took a request, the engine must not wait for a "
                f"throttled user's ready time (the request is pending and unscheduled, and the input queue is empty)"
            )
        return (
            f"a new request did not wake the engine: {USER_B}'s request arriving mid-wait was scheduled {when}; "
            f"the article's engine waits on its input queue, so a new request wakes it at once"
        )
    if v.abort_latency_ns is None or v.abort_latency_ns > WAKE_TOLERANCE_NS:
        when = "never" if v.abort_latency_ns is None else f"only after {ms(v.abort_latency_ns)}"
        return (
            f"an abort did not wake the engine: an abort arriving mid-wait reached the scheduler {when}; the "
            f"article's engine waits on its input queue, so an abort wakes it at once"
        )
    return None


# =======================================================================================
# Child side: vLLM's engine core on the fake clock.
# =======================================================================================
class _RunOver(BaseException):
    """Ends the run from inside the loop (a BaseException: vLLM's ``except Exception`` and its
    fault-tolerance wrapper let it through)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _World:
    """The child's fake world: clock, scripted inputs, recorded observations."""

    def __init__(self, scenario: EngineWaitScenario) -> None:
        from vllm_output_rate.adapter.harness import FakeClock

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
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType

        from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID
        from vllm_output_rate.adapter.tinymodel import EOS_TOKEN_ID

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
        Raises ``_RunOver`` at the end of fake time, or for a wait that could never end.
        """
        start = self.clock.now_ns()
        limit = math.inf if timeout_s is None else start + max(0, math.ceil(timeout_s * 1e9))
        target = min(limit, self._next_input_ns()) if wake_on_input else limit
        engine = self.engine
        pending = bool(getattr(engine, "scheduler", None) is not None and engine.scheduler.has_requests())
        if target == math.inf:
            self.waits.append([start, start, pending, kind])
            raise _RunOver("idle with no more input" if wake_on_input else f"a {kind} wait without timeout")
        end = min(int(target), max(self.scenario.run_ns, start))
        self.clock.advance(end - start)
        self.waits.append([start, end, pending, kind])
        self._deliver_due()
        if end < target:
            raise _RunOver("fake time")
        q = getattr(engine, "input_queue", None)
        return wake_on_input and q is not None and bool(q.queue)

    def model_step(self) -> None:
        self.clock.advance(MODEL_STEP_NS)
        self._deliver_due()

    def check_bounds(self) -> None:
        self.iterations += 1
        if self.clock.now_ns() >= self.scenario.run_ns:
            raise _RunOver("fake time")
        if self.iterations > MAX_LOOP_ITERATIONS:
            raise _RunOver("loop iterations")
        if self._real_perf() - self.wall_start > WALL_LIMIT_S:
            raise _RunOver("wall time")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Fake clocks and fake blocking waits, for the whole child."""
        import queue as queue_module
        import threading

        from vllm_output_rate.adapter.harness import patched_time

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


def _fabricated_output(scheduler_output, sampled: list[str]):
    """One non-EOS token per sampling request (``harness`` fabricates the same)."""
    from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID
    from vllm_output_rate.adapter.vllm_compat import model_runner_output

    req_ids = list(scheduler_output.num_scheduled_tokens)
    chosen = set(sampled)
    return model_runner_output(req_ids, [[NON_EOS_TOKEN_ID] if r in chosen else [] for r in req_ids])


@functools.cache
def _polling_future_class():
    from concurrent.futures import Future

    class _PollingFuture(Future):
        """A step's result as vLLM's multiproc executor returns it: ``poll()`` (done yet?)
        and ``wait_briefly(pending, deadline)`` (wait until done, ``pending`` is non-empty
        or ``time.monotonic()`` reaches ``deadline``); the step lasts ``duration_ns`` of fake
        time, during which due inputs reach the engine's input queue."""

        def __init__(self, world: _World, value: Any, duration_ns: int, empty: bool) -> None:
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


_WORLD: _World | None = None  # the child's world (one run per child process)
_SHAPE: Any = None  # the child's EngineShape (adapter/harness.py), set with _WORLD


def _done(value: Any) -> Any:
    """A finished ``concurrent.futures.Future`` holding ``value``."""
    from concurrent.futures import Future

    future: Future = Future()
    future.set_result(value)
    return future


def _step_future(value: Any, empty: bool) -> Any:
    """A step's future: plain and finished, or in the polling world one that takes the step's
    fake time (``POLLING_EMPTY_STEP_NS`` for an empty step, else ``MODEL_STEP_NS``)."""
    world = _WORLD
    if world is None or not world.scenario.polling:
        return _done(value)
    return _polling_future_class()(world, value, POLLING_EMPTY_STEP_NS if empty else MODEL_STEP_NS, empty)


def _executor_class():
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from vllm_output_rate.adapter.harness import build_kv_cache_config

    class _GateExecutor(Executor):
        """An executor without workers: fixed KV cache, fabricated model outputs, fake time."""

        def _init_executor(self) -> None:
            self._spec = build_kv_cache_config(_SHAPE).kv_cache_groups[0].kv_cache_spec
            self._pending = None

        def get_kv_cache_specs(self):
            return [{"layer.0": self._spec}]

        def determine_available_memory(self):
            return [self._spec.page_size_bytes * (_SHAPE.num_blocks + 8)]

        def get_supported_kv_cache_layouts(self):
            from vllm.v1.kv_cache_layout import KVCacheLayout

            return [[layout.name for layout in KVCacheLayout]]

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
                value = EMPTY_MODEL_RUNNER_OUTPUT
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

    return _GateExecutor


def _build_engine(world: _World, vllm_config):
    """A real ``EngineCoreProc`` without its ZMQ handshake: vLLM's ``EngineCore.__init__``
    with the gate's executor (which loads the general plugins and builds the scheduler)."""
    import queue

    from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState

    from vllm_output_rate.adapter.vllm_compat import prepare_engine_core

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


def _instrument(world: _World, engine) -> None:
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
    import threading

    global _WORLD, _SHAPE
    config, scenario = payload["config"], payload["scenario"]
    _SHAPE = payload["shape"]
    if _SHAPE.async_scheduling:
        config.scheduler_config.async_scheduling = True  # vLLM's CPU platform turned it off
    config.cache_config.num_gpu_blocks_override = _SHAPE.num_blocks
    world = _WORLD = _World(scenario)
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
        except _RunOver as over:
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
    import vllm.plugins
    import vllm.v1.engine.core  # the expensive import, shared by every fork

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
