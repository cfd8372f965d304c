"""``outrate bench``: what the rate limit costs, measured side by side in one process.

Scheduler step cost. For each number of running requests N, each mode (sync: vLLM's
``Scheduler``; async: ``AsyncScheduler``) and each throttled fraction, two harnesses are
built on the same engine shape with the same N requests: stock vLLM (feature off, nothing
throttled) and the reference ``RateLimitedScheduler`` / ``RateLimitedAsyncScheduler``.
Both are run to a decode steady state (every request past its prefill, or throttled), then
timed in interleaved rounds: a round is ``steps_per_round`` steps of one class then the same
number of the other, the order alternating between rounds, so a load change on the shared
machine hits both alike. Only ``schedule()`` + ``update_from_output()`` are timed (the
fabricated model output is built outside the timed region; async mode times a step's
``schedule()`` with the delivery of the step in flight, as the engine core does), by
default on this thread's CPU clock so that time spent descheduled while other jobs hold
the cores is left out (``--clock wall`` for perf_counter). A
round's value is its mean per step; the table reports the medians over rounds and
``ratio`` = median of the per-round ratios reference / stock (robust to load drift;
close to ``reference_us / stock_us``). A third class, "article-style" (the independent
implementation of the article kept as the gate's acceptance corpus,
``tests/fixtures/article_style``, configured through its hook), is timed in the same
rounds when the checkout has it; ``article_ratio`` is its median per-round ratio to stock.

- throttled fraction 0: the limit is on with a rate of 10**9 tokens/s, never binding;
- 0.5 / 0.9: that share of the requests, spread evenly over the running order, belongs to
  users with 0.001 tokens/s who have spent their burst before the timed rounds (their
  streams stay resident and are skipped, R11); the others decode freely.

Requests: prompts of 4-19 tokens (block boundaries spread over steps), 4 streams per
user, ``max_tokens`` large enough that nothing finishes; max_num_seqs = N,
max_num_batched_tokens >= 4N, KV blocks for every token the run can produce.

Limiter: ``OutputRateLimiter.try_take`` (granted and refused) and ``refund`` operations
per second, in batches over 4096 users, median over repetitions.

Gate: differential steps/s of ``adapter.scenarios.run_scenario`` on the reference (real
vLLM scheduler + spec limiter after every step) on fixed-seed Hypothesis scenarios;
spec-only scenarios/s when ``vllm_output_rate.spec`` has a step model (a module ``step``
or ``scheduler`` with ``run_scenario(scenario)``), and model-checker states/s when
``vllm_output_rate.proofs.modelcheck`` has ``explore(max_states) -> int``; otherwise the
row says why it was skipped.

Live (``--live``, default on except with ``--quick``; or ``--only live``): a real vLLM
engine on this machine with the project's tiny model (dummy weights), in child processes
(``livebench.py``): (a) engine tokens/s with the feature off (stock ``Scheduler``), on
but never binding (``RateLimitedScheduler``, 10**9 tokens/s), and on with the worker idle
fix off (``VLLM_OUTPUT_RATE_WORKER_PARK=0``), three engines side by side, the same batch
through each in interleaved rounds; medians and the median per-round ratios on / off and
fix on / off. (b) engine-core and worker CPU use (percent of one core, psutil, over the
run's wall time) while every user is throttled, in three runs (``THROTTLED_RUNS``): the
plugin (R16 engine wait + worker idle fix), the wait with the worker spinning, and no
plugin (``VLLM_PLUGINS=""``); each with the stock idle baseline (no requests) and the
worker's wake-ups. (c) vLLM's RPC queue between two processes, the reader parking after
every read (lossless pings or vLLM's) or spinning: lost wake-up pings and round trips
(``livebench.ping_round_trips``).
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import pkgutil
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 130)

STEP_NS = 10_000_000  # fake clock advance per step: 10 ms
STREAMS_PER_USER = 4
FREE_RATE = 10**9  # tokens/s: the limit is on but never binds
TINY_RATE = 0.001  # tokens/s: one grant, then refused for 1000 s (the run lasts seconds)
# The article-style peer takes integer rates only: 1 token/s, one grant per throttled user per
# 100 steps of 10 ms, so its throttled share stays within a few requests of the plan.
TINY_RATE_INTEGER = 1
MAX_WARMUP_STEPS = 200
LIMITER_USERS = 4096
# The step clock. "cpu": this thread's CPU time (CLOCK_THREAD_CPUTIME_ID), which leaves out
# the time the thread waits while other jobs hold the (shared) cores; "wall": perf_counter.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


@dataclass(frozen=True)
class Plan:
    """How much to measure."""

    sizes: tuple[int, ...]
    fractions: tuple[float, ...]
    modes: tuple[str, ...]
    rounds: int
    steps_per_round: int
    limiter_batches: int
    gate_scenarios: int
    gate_max_steps: int
    live_rounds: int = 15
    live_streams: int = 64
    live_tokens: int = 256
    live_throttled_users: int = 4
    live_throttled_tokens: int = 6
    live_throttled_rate: float = 2.0
    live_ping_steps: int = 150


FULL = Plan(sizes=(16, 64, 256, 1024), fractions=(0.0, 0.5, 0.9), modes=("sync", "async"), rounds=41,
            steps_per_round=16, limiter_batches=15, gate_scenarios=40, gate_max_steps=40)
QUICK = Plan(sizes=(8, 16), fractions=(0.0, 0.5, 0.9), modes=("sync", "async"), rounds=3,
             steps_per_round=2, limiter_batches=3, gate_scenarios=3, gate_max_steps=10,
             live_rounds=2, live_streams=4, live_tokens=8, live_throttled_users=2, live_throttled_tokens=2,
             live_throttled_rate=4.0, live_ping_steps=20)
# Targets of the live section (reported, not asserted).
LIVE_RATIO_TARGET = 0.98  # on-but-not-binding tokens/s within 2% of off
# A read of vLLM's RPC queue that waits this long missed its wake-up ping (ping_round_trips).
PING_TIMEOUT_S = 0.25
LIVE_CPU_TARGET_PERCENT = 5.0  # engine core with every user throttled, with the wait plugin


# -- scheduler step cost ----------------------------------------------------------------
def throttled_indices(n: int, fraction: float) -> set[int]:
    """``round(n * fraction)`` request indices spread evenly over ``range(n)``."""
    k = round(n * fraction)
    return {(i * n) // k for i in range(k)} if k else set()


class _Driver:
    """One scheduler on a ``Harness``; ``step()`` returns the seconds spent in vLLM's calls."""

    def __init__(self, cls_path: str, n: int, fraction: float, async_mode: bool, total_steps: int,
                 limited: bool, clock: Callable[[], float] = time.thread_time, style: Any = None,
                 tiny_rate: float = TINY_RATE) -> None:
        from vllm_output_rate.adapter.harness import EngineShape, Harness

        self.max_tokens = total_steps + 64
        prompt_max = 4 + 15
        max_model_len = prompt_max + self.max_tokens + 16
        blocks_per_request = -(-max_model_len // 16) + 1
        throttled = throttled_indices(n, fraction)
        users = []
        free_count = throttled_count = 0
        for i in range(n):
            if i in throttled:
                users.append(f"t{throttled_count // STREAMS_PER_USER}")
                throttled_count += 1
            else:
                users.append(f"u{free_count // STREAMS_PER_USER}")
                free_count += 1
        output_rate = None
        if limited:
            output_rate = {
                "default_tokens_per_s": FREE_RATE,
                "user_tokens_per_s": {u: tiny_rate for u in set(users) if u.startswith("t")},
            }
        shape = EngineShape(
            max_num_seqs=n,
            max_num_batched_tokens=max(2048, 4 * n),
            chunked_prefill=True,
            block_size=16,
            num_blocks=n * blocks_per_request + 64,
            async_scheduling=async_mode,
            max_model_len=max_model_len,
            output_rate=output_rate,
        )
        self.harness = Harness(cls_path, shape, style=style)
        for i, user in enumerate(users):
            self.harness.add_request(f"r{i}", user, prompt_len=4 + (i % 16), max_tokens=self.max_tokens)
        self.n = n
        self.expected_throttled = len(throttled) if limited else 0
        self.async_mode = async_mode
        self.scheduler = self.harness.scheduler
        self._in_flight: tuple[Any, Any] | None = None  # async: (SchedulerOutput, ModelRunnerOutput) in flight
        self.steps = 0
        self.clock = clock

    def _model_output(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID

        requests = self.scheduler.requests
        ids = list(so.num_scheduled_tokens)
        tokens = [[] if requests[r].is_prefill_chunk else [NON_EOS_TOKEN_ID] for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=tokens)

    def step(self) -> float:
        clock = self.clock
        scheduler = self.scheduler
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        mro = self._model_output(so)
        if self.async_mode:
            deliver, self._in_flight = self._in_flight, (so, mro)
        else:
            deliver = (so, mro)
        t2 = t3 = 0.0
        if deliver is not None:
            t2 = clock()
            scheduler.update_from_output(*deliver)
            t3 = clock()
        self.harness.clock.advance(STEP_NS)
        self.steps += 1
        return (t1 - t0) + (t3 - t2)

    def throttled_now(self) -> int:
        observation = getattr(self.scheduler, "last_step_observation", None)
        return len(observation["throttled"]) if observation else 0

    def steady(self) -> bool:
        """Every request running; each one decoding, or throttled as planned."""
        scheduler = self.scheduler
        if len(scheduler.running) != self.n or scheduler.waiting:
            return False
        decoding = sum(1 for r in scheduler.running if r.num_output_tokens > 1)
        if getattr(scheduler, "last_step_observation", None) is None:  # no observation interface
            return decoding >= self.n - self.expected_throttled and self.steps >= 2 * MIN_STEADY_STEPS
        throttled = self.throttled_now()
        return throttled == self.expected_throttled and decoding >= self.n - self.expected_throttled

    def warm_up(self) -> None:
        while not self.steady():
            if self.steps >= MAX_WARMUP_STEPS:
                raise RuntimeError(
                    f"{self.harness.cls_path} with {self.n} requests: no decode steady state after "
                    f"{self.steps} steps (running {len(self.scheduler.running)}, throttled "
                    f"{self.throttled_now()} of {self.expected_throttled})")
            self.step()
        for _ in range(4):
            self.step()


@dataclass
class SchedulerRow:
    running: int
    throttled_fraction: float
    mode: str
    stock_us: float
    reference_us: float
    ratio: float
    throttled_requests: int = 0
    rounds: int = 0
    steps_per_round: int = 0
    ratio_min: float = 0.0
    ratio_max: float = 0.0
    article_us: float | None = None
    article_ratio: float | None = None


ARTICLE_SCHEDULER = "article_style.scheduler.ArticleScheduler"
ARTICLE_ASYNC_SCHEDULER = "article_style.scheduler.ArticleAsyncScheduler"
ARTICLE_HOOK = "hook:article_style.hook.configure"
MIN_STEADY_STEPS = 8  # warm-up steps a class without an observation gets before timing


def article_style(async_mode: bool) -> tuple[str, Any] | None:
    """(class path, config style) of the article-style implementation, or None when this
    checkout has no ``tests/fixtures/article_style`` (an installed wheel)."""
    import sys

    fixtures = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    if not (fixtures / "article_style").is_dir():
        return None
    if str(fixtures) not in sys.path:
        sys.path.insert(0, str(fixtures))
    from vllm_output_rate.adapter.configstyle import parse_config_style

    return (ARTICLE_ASYNC_SCHEDULER if async_mode else ARTICLE_SCHEDULER), parse_config_style(ARTICLE_HOOK)


def measure_scheduler(n: int, fraction: float, mode: str, plan: Plan, tick: Callable[[], None],
                      clock: str = "cpu") -> SchedulerRow:
    """Interleaved rounds of stock and reference at ``n`` running requests (module docstring)."""
    from vllm_output_rate.adapter.harness import (
        REFERENCE_ASYNC_SCHEDULER,
        REFERENCE_SCHEDULER,
        STOCK_ASYNC_SCHEDULER,
        STOCK_SCHEDULER,
    )

    async_mode = mode == "async"
    total = MAX_WARMUP_STEPS + plan.rounds * plan.steps_per_round + 8
    stock = _Driver(STOCK_ASYNC_SCHEDULER if async_mode else STOCK_SCHEDULER, n, fraction, async_mode, total,
                    limited=False, clock=CLOCKS[clock])
    reference = _Driver(REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER, n, fraction,
                        async_mode, total, limited=True, clock=CLOCKS[clock])
    peer = article_style(async_mode)
    article = (_Driver(peer[0], n, fraction, async_mode, total, limited=True, clock=CLOCKS[clock], style=peer[1],
                       tiny_rate=TINY_RATE_INTEGER) if peer is not None else None)
    drivers = [d for d in (stock, reference, article) if d is not None]
    for driver in drivers:
        driver.warm_up()
    gc.collect()
    means: dict[int, list[float]] = {id(d): [] for d in drivers}
    throttled_seen: set[int] = set()
    for k in range(plan.rounds):
        order = drivers[k % len(drivers):] + drivers[:k % len(drivers)]  # rotate who goes first
        for driver in order:
            spent = sum(driver.step() for _ in range(plan.steps_per_round))
            means[id(driver)].append(spent / plan.steps_per_round)
        throttled_seen.add(reference.throttled_now())
        tick()
    stock_means, ref_means = means[id(stock)], means[id(reference)]
    if throttled_seen != {reference.expected_throttled}:
        raise RuntimeError(f"throttled requests drifted during the timed rounds: {sorted(throttled_seen)}, "
                           f"planned {reference.expected_throttled}")
    ratios = [r / s for r, s in zip(ref_means, stock_means)]
    return SchedulerRow(
        running=n,
        throttled_fraction=fraction,
        mode=mode,
        stock_us=statistics.median(stock_means) * 1e6,
        reference_us=statistics.median(ref_means) * 1e6,
        ratio=statistics.median(ratios),
        throttled_requests=reference.expected_throttled,
        rounds=plan.rounds,
        steps_per_round=plan.steps_per_round,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        article_us=statistics.median(means[id(article)]) * 1e6 if article is not None else None,
        article_ratio=(statistics.median([a / s for a, s in zip(means[id(article)], stock_means)])
                       if article is not None else None),
    )


# -- limiter --------------------------------------------------------------------------
def measure_limiter(plan: Plan, tick: Callable[[], None]) -> dict[str, Any]:
    """Operations per second of the reference limiter (median over batches)."""
    from vllm_output_rate.reference.limiter import OutputRateLimiter

    users = [f"user-{i}" for i in range(LIMITER_USERS)]
    limiter = OutputRateLimiter(50, dict.fromkeys(users[::8], 3.5))
    refused = OutputRateLimiter(50, dict.fromkeys(users, TINY_RATE))
    now = 10**15  # a monotonic clock after ~11 days of uptime
    for u in users:
        refused.try_take(u, now)
    take, give_back, refused_take = limiter.try_take, limiter.refund, refused.try_take
    passes = 25
    ops = passes * len(users)
    rates: dict[str, list[float]] = {"try_take": [], "try_take_refused": [], "refund": []}
    clock = time.perf_counter
    for _ in range(plan.limiter_batches):
        spent_take = spent_refund = spent_refused = 0.0
        for _ in range(passes):
            now += 1_000_000_000  # one second: every user is granted again
            t0 = clock()
            for u in users:
                take(u, now)
            t1 = clock()
            for u in users:
                give_back(u)
            t2 = clock()
            for u in users:
                refused_take(u, now)
            t3 = clock()
            spent_take += t1 - t0
            spent_refund += t2 - t1
            spent_refused += t3 - t2
        rates["try_take"].append(ops / spent_take)
        rates["refund"].append(ops / spent_refund)
        rates["try_take_refused"].append(ops / spent_refused)
        tick()
    return {
        "try_take_per_s": statistics.median(rates["try_take"]),
        "try_take_refused_per_s": statistics.median(rates["try_take_refused"]),
        "refund_per_s": statistics.median(rates["refund"]),
        "users": len(users),
        "batches": plan.limiter_batches,
        "ops_per_batch": ops,
        "target_per_s": 1e6,
    }


# -- gate -------------------------------------------------------------------------------
def seeded_draws(strategy, count: int, seed: int = 0) -> list:
    """``count`` examples of a Hypothesis strategy, always the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    drawn: list = []

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(example=strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn[:count]


def _step_model() -> tuple[dict[str, Any] | None, str]:
    """The spec's step model and its scenario class, or (None, why they are not usable)."""
    try:
        from vllm_output_rate.adapter import fidelity
        from vllm_output_rate.spec import scheduler as spec_scheduler
        from vllm_output_rate.spec.events import Step
        from vllm_output_rate.spec.state import initial_state

        parts = {"run": spec_scheduler.run, "initial_state": initial_state, "Step": Step,
                 "scenarios": fidelity.base_scenarios, "run_step_scenario": fidelity.run_step_scenario,
                 "stock_cls": fidelity.base_scheduler_cls}
    except (ImportError, AttributeError) as exc:
        return None, (f"not available: the spec step model (vllm_output_rate.spec.scheduler.run) with its "
                      f"scenarios (vllm_output_rate.adapter.fidelity.base_scenarios) cannot be used: {exc}")
    return parts, "vllm_output_rate.spec.scheduler.run"


def _find_entry(package: str, modules: tuple[str, ...], attr: str) -> tuple[Callable | None, str]:
    """``attr`` of the first of ``package.modules`` defining it, or (None, why not)."""
    pkg = importlib.import_module(package)
    present = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    for name in modules:
        if name in present:
            module = importlib.import_module(f"{package}.{name}")
            entry = getattr(module, attr, None)
            if callable(entry):
                return entry, f"{package}.{name}.{attr}"
    wanted = " or ".join(f"{package}.{m}.{attr}" for m in modules)
    return None, f"not available: no {wanted} (modules there: {', '.join(present) or 'none'})"


def _rate_row(check: str, what: str, scenarios: int, steps: int, seconds: float) -> dict[str, Any]:
    return {"check": check, "what": what, "scenarios": scenarios, "steps": steps, "seconds": seconds,
            "scenarios_per_s": scenarios / seconds, "steps_per_s": steps / seconds}


def measure_gate(plan: Plan, tick: Callable[[], None]) -> dict[str, Any]:
    """Gate rates: rate-limit differential (real scheduler + spec limiter), spec-only step
    model and spec-vs-vLLM fidelity on the same seeded scenarios, model checker."""
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER
    from vllm_output_rate.adapter.scenarios import run_scenario, scenarios

    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    model, model_why = _step_model()
    for mode, cls in (("sync", REFERENCE_SCHEDULER), ("async", REFERENCE_ASYNC_SCHEDULER)):
        async_mode = mode == "async"
        drawn = seeded_draws(scenarios(async_scheduling=async_mode, max_steps=plan.gate_max_steps),
                             plan.gate_scenarios)
        run_scenario(cls, drawn[0])  # warm-up, untimed: first harness of this class
        steps = 0
        started = time.perf_counter()
        for scenario in drawn:
            steps += run_scenario(cls, scenario).steps
            tick()
        rows.append(_rate_row(f"differential/{mode}", f"adapter.scenarios.run_scenario on {cls.rsplit('.', 1)[1]}",
                              len(drawn), steps, time.perf_counter() - started))
        if model is None:
            continue
        try:
            step_scenarios = seeded_draws(model["scenarios"](async_scheduling=async_mode,
                                                             max_steps=plan.gate_max_steps), plan.gate_scenarios)
            steps = sum(sum(isinstance(e, model["Step"]) for e in sc.events) for sc in step_scenarios)
            model["run"](model["initial_state"](step_scenarios[0].config), step_scenarios[0].events)  # warm-up
            started = time.perf_counter()
            for sc in step_scenarios:
                model["run"](model["initial_state"](sc.config), sc.events)
            rows.append(_rate_row(f"spec-only/{mode}", "spec.scheduler.run on adapter.fidelity.base_scenarios",
                                  len(step_scenarios), steps, time.perf_counter() - started))
            stock_cls = model["stock_cls"](async_mode)
            model["run_step_scenario"](stock_cls, step_scenarios[0])  # warm-up, untimed
            steps = 0
            started = time.perf_counter()
            for sc in step_scenarios:
                steps += model["run_step_scenario"](stock_cls, sc).steps
            rows.append(_rate_row(f"fidelity/{mode}", f"adapter.fidelity.run_step_scenario, spec vs "
                                  f"{stock_cls.rsplit('.', 1)[1]}", len(step_scenarios), steps,
                                  time.perf_counter() - started))
        except Exception as exc:  # the step model is young: report, do not fail the benchmark
            skipped[f"spec-only/{mode}"] = f"not measured: the step model raised {type(exc).__name__}: {exc}"
    if model is None:
        skipped["spec-only"] = model_why
    explore, mc_where = _find_entry("vllm_output_rate.proofs", ("modelcheck",), "explore")
    if explore is not None:
        budget = 2_000 if plan.gate_scenarios <= QUICK.gate_scenarios else 200_000
        started = time.perf_counter()
        try:
            states = _explore_states(explore, budget)
        except Exception as exc:  # report, do not fail the benchmark
            skipped["model-checker"] = f"not measured: {type(exc).__name__}: {exc}"
        else:
            seconds = time.perf_counter() - started
            rows.append({"check": "model-checker", "what": mc_where, "states": states, "seconds": seconds,
                         "states_per_s": states / seconds})
    else:
        skipped["model-checker"] = mc_where
    return {"rows": rows, "skipped": skipped}


def _explore_states(explore: Callable, budget: int) -> int:
    """Distinct states the model checker explores in its first declared scope (<= budget)."""
    from vllm_output_rate.proofs import modelcheck

    scope = modelcheck.profile_scopes("quick")[0]
    result = explore(scope, max_states=budget, raise_on_bound=False)
    return int(getattr(result, "states", result))


# -- live engine ------------------------------------------------------------------------
def live_steps(plan: Plan) -> int:
    """Progress ticks of ``measure_live`` (rounds, the three throttled runs, the ping run)."""
    return plan.live_rounds + 4


# The throttled runs side by side (R16; docs/PERFORMANCE.md "Idle cost"): name -> the
# environment of the run. "wait": the plugin as shipped (engine wait + worker idle fix);
# "wait, worker spins": the worker-idle fix off; "no plugin": vLLM's own idle loop.
THROTTLED_RUNS = {
    "with_wait": {},
    "wait_worker_spins": {"VLLM_OUTPUT_RATE_WORKER_PARK": "0"},
    "without_wait": {"VLLM_PLUGINS": ""},
}


def measure_live(plan: Plan, tick: Callable[[], None]) -> dict[str, Any]:
    """Live engine: tokens/s off vs on-not-binding (and on with the worker-idle fix off),
    engine-core and worker CPU while every user is throttled in three set-ups, and the
    wake-up pings of vLLM's RPC queue (module docstring)."""
    from vllm_output_rate.livebench import ping_round_trips, run_child

    throughput = run_child({"part": "throughput", "streams": plan.live_streams, "tokens": plan.live_tokens,
                            "rounds": plan.live_rounds}, tick=tick)
    throttled_cfg = {"part": "throttled", "users": plan.live_throttled_users, "streams_per_user": 2,
                     "tokens": plan.live_throttled_tokens, "rate": plan.live_throttled_rate}
    runs: dict[str, dict[str, Any]] = {}
    for name, env in THROTTLED_RUNS.items():
        runs[name] = run_child(throttled_cfg, env)
        tick()
    steps = plan.live_ping_steps
    pings = {
        "lossless_park": ping_round_trips(lossless=True, park=True, steps=steps, timeout_s=PING_TIMEOUT_S),
        "vllm_park": ping_round_trips(lossless=False, park=True, steps=steps, timeout_s=PING_TIMEOUT_S),
        "vllm_spin": ping_round_trips(lossless=False, park=False, steps=steps, timeout_s=PING_TIMEOUT_S),
    }
    tick()

    def total(run: dict[str, Any]) -> float:
        return run["engine_and_workers_cpu_percent"]
    return {
        "tokens_per_s_off": throughput["tokens_per_s_off"],
        "tokens_per_s_on": throughput["tokens_per_s_on"],
        "ratio": throughput["ratio"],
        "worker_fix_ratio": throughput["worker_fix_ratio"],
        "engine_cpu_throttled_with_wait": runs["with_wait"]["engine_cpu_percent"],
        "engine_cpu_throttled_without_wait": runs["without_wait"]["engine_cpu_percent"],
        "engine_worker_cpu_throttled_with_wait": total(runs["with_wait"]),
        "engine_worker_cpu_throttled_wait_worker_spins": total(runs["wait_worker_spins"]),
        "engine_worker_cpu_throttled_without_wait": total(runs["without_wait"]),
        "engine_worker_cpu_idle": sum(v for role, v in runs["with_wait"]["idle_cpu_percent"].items()
                                      if role != "front_end"),
        "cpu_unit": "percent of one core",
        "ratio_target": LIVE_RATIO_TARGET,
        "engine_cpu_target": LIVE_CPU_TARGET_PERCENT,
        "throughput": throughput,
        "throttled_with_wait": runs["with_wait"],
        "throttled_wait_worker_spins": runs["wait_worker_spins"],
        "throttled_without_wait": runs["without_wait"],
        "pings": pings,
    }


# -- profile ----------------------------------------------------------------------------
def profile_schedule(n: int, steps: int, top: int) -> dict[str, Any]:
    """cProfile of the reference's ``schedule()`` at ``n`` running requests (limit not binding)."""
    import cProfile

    from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER

    driver = _Driver(REFERENCE_SCHEDULER, n, 0.0, False, MAX_WARMUP_STEPS + steps + 8, limited=True)
    driver.warm_up()
    scheduler = driver.scheduler
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        so = scheduler.schedule()
        profiler.disable()
        scheduler.update_from_output(so, driver._model_output(so))
        driver.harness.clock.advance(STEP_NS)
    # One entry per function as pstats labels it (file, first line, name; builtins: "~", 0):
    # calls, time in the function itself, and with its callees (seconds).
    stats = {(("~", 0, e.code) if isinstance(e.code, str) else (e.code.co_filename, e.code.co_firstlineno,
                                                                 e.code.co_name)): e for e in profiler.getstats()}
    total = sum(e.inlinetime for e in stats.values())
    rows: list[dict[str, Any]] = []
    for (path, line, func), entry in stats.items():
        ncalls, tottime, cumtime = entry.callcount, entry.inlinetime, entry.totaltime
        rows.append({"function": f"{_short(path)}:{line}({func})", "calls_per_step": ncalls / steps,
                     "self_share": tottime / total, "cum_share": cumtime / total,
                     "self_us_per_step": tottime / steps * 1e6, "cum_us_per_step": cumtime / steps * 1e6,
                     "project": _is_project(path)})
    by_self = sorted(rows, key=lambda r: r["self_share"], reverse=True)[:top]
    project = sorted((r for r in rows if r["project"]), key=lambda r: r["cum_share"], reverse=True)[:top]
    return {"total_us_per_step": total / steps * 1e6, "top_self": by_self, "project_cumulative": project}


_REPO_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep


def _is_project(path: str) -> bool:
    return path.startswith(_REPO_ROOT) and "site-packages" not in path


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return path[len(_REPO_ROOT):] if path.startswith(_REPO_ROOT) else path


# -- environment, tables, plot ------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _scheduler_table(rows: list[SchedulerRow], clock: str) -> Table:
    table = Table(title=f"scheduler step: schedule() + update_from_output(), {clock} µs per step (median of rounds)")
    for col in ("mode", "running", "throttled", "stock µs", "reference µs", "ratio", "ratio range",
                "article-style µs", "article-style ratio"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        style = "green" if r.ratio <= 1.03 else ("yellow" if r.ratio <= 1.10 else "red")
        table.add_row(r.mode, str(r.running), f"{r.throttled_fraction:.0%} ({r.throttled_requests})",
                      f"{r.stock_us:,.0f}", f"{r.reference_us:,.0f}", f"[{style}]{r.ratio:.3f}[/]",
                      f"{r.ratio_min:.2f}-{r.ratio_max:.2f}",
                      "-" if r.article_us is None else f"{r.article_us:,.0f}",
                      "-" if r.article_ratio is None else f"{r.article_ratio:.3f}")
    return table


def _limiter_table(lim: dict[str, Any]) -> Table:
    table = Table(title=f"OutputRateLimiter, {lim['users']} users, median of {lim['batches']} batches")
    table.add_column("operation")
    table.add_column("ops/s", justify="right")
    table.add_column("ns/op", justify="right")
    table.add_column("target >= 1e6/s")
    for name, key in (("try_take (granted)", "try_take_per_s"), ("try_take (refused)", "try_take_refused_per_s"),
                      ("refund", "refund_per_s")):
        rate = lim[key]
        table.add_row(name, f"{rate:,.0f}", f"{1e9 / rate:.0f}",
                      "[green]met[/]" if rate >= lim["target_per_s"] else "[red]missed[/]")
    return table


def _live_table(live: dict[str, Any]) -> Table:
    t = live["throughput"]
    table = Table(title=f"live engine (tiny model): {t['streams']} streams x {t['tokens_per_stream']} tokens, "
                        f"median of {t['rounds']} interleaved rounds; engine-core CPU with every user throttled")
    for col in ("measure", "value", "target", "result"):
        table.add_column(col, justify="left" if col in ("measure", "target") else "right")
    ok = live["ratio"] >= LIVE_RATIO_TARGET
    table.add_row("tokens/s, feature off", f"{live['tokens_per_s_off']:,.0f}", "", "")
    table.add_row("tokens/s, on, not binding", f"{live['tokens_per_s_on']:,.0f}", "", "")
    table.add_row("ratio on / off (median of per-round ratios; min-max)",
                  f"{live['ratio']:.3f} ({t['ratio_min']:.2f}-{t['ratio_max']:.2f})",
                  f">= {LIVE_RATIO_TARGET}", "[green]met[/]" if ok else "[red]missed[/]")
    if "ratio_quartiles" in t:
        q1, q3 = t["ratio_quartiles"]
        table.add_row("per-round ratio, quartiles", f"{q1:.3f}-{q3:.3f}", "", "")
    table.add_row("ratio of the median tokens/s", f"{live['tokens_per_s_on'] / live['tokens_per_s_off']:.3f}", "", "")
    if "worker_fix_ratio" in t:
        table.add_row("worker idle fix while decoding: tokens/s fix on / off (median of per-round ratios; "
                      "min-max)", f"{t['worker_fix_ratio']:.3f} ({t['worker_fix_ratio_min']:.2f}-"
                      f"{t['worker_fix_ratio_max']:.2f})", "~1", "")
        table.add_row("worker idle fix while decoding: engine CPU per token, fix on / off",
                      f"{t['worker_fix_cpu_ratio']:.3f}", "~1", "")
    cpu_ok = live["engine_cpu_throttled_with_wait"] < LIVE_CPU_TARGET_PERCENT
    table.add_row("engine CPU % throttled, wait plugin", f"{live['engine_cpu_throttled_with_wait']:.1f}",
                  f"< {LIVE_CPU_TARGET_PERCENT:g}", "[green]met[/]" if cpu_ok else "[red]missed[/]")
    table.add_row('engine CPU % throttled, VLLM_PLUGINS=""', f"{live['engine_cpu_throttled_without_wait']:.1f}",
                  "", "")
    if live.get("engine_worker_cpu_throttled_with_wait") is not None:
        both_ok = live["engine_worker_cpu_throttled_with_wait"] < LIVE_CPU_TARGET_PERCENT
        table.add_row("engine core + worker CPU % throttled, plugin",
                      f"{live['engine_worker_cpu_throttled_with_wait']:.1f}", f"< {LIVE_CPU_TARGET_PERCENT:g}",
                      "[green]met[/]" if both_ok else "[red]missed[/]")
        table.add_row('engine core + worker CPU % throttled, VLLM_PLUGINS=""',
                      f"{live['engine_worker_cpu_throttled_without_wait']:.1f}", "", "")
    return table


def _idle_table(live: dict[str, Any]) -> Table:
    """Idle cost (R16; issue 15 item 6): the throttled runs and the ping run side by side."""
    table = Table(title="every user throttled: CPU in percent of one core over the run's wall time "
                        "(engine core / worker / both), and the R2 minimum wall time")
    for col in ("set-up", "engine core", "worker", "both", "worker wake-ups/s", "wall s (min)", "stock idle (both)"):
        table.add_column(col, justify="left" if col == "set-up" else "right")
    names = {"with_wait": "plugin: R16 wait + worker idle fix",
             "wait_worker_spins": "R16 wait, worker spins (VLLM_OUTPUT_RATE_WORKER_PARK=0)",
             "without_wait": 'no plugin (VLLM_PLUGINS="")'}
    for key, label in names.items():
        run = live.get(f"throttled_{key}")
        if run is None:
            continue
        cpu, idle = run["cpu_percent"], run["idle_cpu_percent"]
        table.add_row(label, f"{cpu['engine_core']:.1f}", f"{cpu.get('worker', 0.0):.1f}",
                      f"{run['engine_and_workers_cpu_percent']:.1f}",
                      f"{run.get('wakeups_per_s', {}).get('worker', float('nan')):.0f}",
                      f"{run['wall_s']:.2f} ({run['min_wall_s']:.2f})",
                      f"{sum(v for role, v in idle.items() if role != 'front_end'):.1f}")
    pings = live.get("pings")
    if pings:
        labels = {"lossless_park": "pings: worker parks, lossless pings (plugin)",
                  "vllm_park": "pings: worker parks, vLLM's pings (SNDHWM 1)",
                  "vllm_spin": "pings: vLLM's 1 s spin"}
        for key, label in labels.items():
            r = pings[key]
            table.add_row(label, "", "", "", "", f"lost {r['lost']} of {r['messages']}",
                          f"round trip p50 {r['round_trip_us_p50']:.0f} µs, p99 {r['round_trip_us_p99']:.0f} µs")
    return table


def _gate_table(gate: dict[str, Any]) -> Table:
    table = Table(title="gate throughput")
    for col in ("check", "what", "scenarios", "steps", "seconds", "rate"):
        table.add_column(col, justify="left" if col in ("check", "what") else "right")
    for r in gate["rows"]:
        if "states_per_s" in r:
            rate = f"{r['states_per_s']:,.0f} states/s"
        else:
            rate = f"{r['scenarios_per_s']:,.1f} scenarios/s, {r['steps_per_s']:,.0f} steps/s"
        table.add_row(r["check"], r["what"], str(r.get("scenarios", "-")), str(r.get("steps", r.get("states", "-"))),
                      f"{r['seconds']:.1f}", rate)
    for name, _why in gate["skipped"].items():
        table.add_row(name, "skipped: not available (reason below)", "-", "-", "-", "-")
    return table


def write_plot(rows: list[SchedulerRow], path: Path, title: str) -> None:
    """Per-step cost against running requests (log-log) and the ratio to stock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cost, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {0.0: "tab:blue", 0.5: "tab:orange", 0.9: "tab:red"}
    for mode, dash in (("sync", "-"), ("async", "--")):
        mine = [r for r in rows if r.mode == mode]
        if not mine:
            continue
        sizes = sorted({r.running for r in mine})
        stock = [statistics.median([r.stock_us for r in mine if r.running == n]) for n in sizes]
        ax_cost.plot(sizes, stock, dash, color="black", marker="o", label=f"stock vLLM ({mode})")
        for fraction in sorted({r.throttled_fraction for r in mine}):
            sel = sorted((r for r in mine if r.throttled_fraction == fraction), key=lambda r: r.running)
            label = f"reference, {fraction:.0%} throttled ({mode})"
            ax_cost.plot([r.running for r in sel], [r.reference_us for r in sel], dash,
                         color=colors.get(fraction, "tab:green"), marker="s", label=label)
            ax_ratio.plot([r.running for r in sel], [r.ratio for r in sel], dash,
                          color=colors.get(fraction, "tab:green"), marker="s", label=label)
    for ax in (ax_cost, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("running requests")
        ax.grid(True, which="both", alpha=0.3)
    ax_cost.set_yscale("log")
    ax_cost.set_ylabel("µs per step (schedule + update_from_output)")
    ax_cost.set_title("per-step cost")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.axhline(1.03, color="grey", linewidth=0.8, linestyle=":")
    ax_ratio.annotate("1.03 (target, limit not binding)", (ax_ratio.get_xlim()[0], 1.03), xytext=(4, 3),
                      textcoords="offset points", fontsize=7, color="grey")
    ax_ratio.set_ylabel("reference / stock")
    ax_ratio.set_title("ratio to stock vLLM")
    ax_cost.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_sizes(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        sizes = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of integers, got {value!r}") from None
    if any(s < 1 for s in sizes):
        raise click.BadParameter(f"sizes must be >= 1, got {value!r}")
    return sizes


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the results as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG plot of per-step cost against running requests here.")
@click.option("--quick", is_flag=True, help="Tiny sizes and few repetitions (for tests); numbers are rough.")
@click.option("--sizes", default=None, metavar="N,N,...", help="Numbers of running requests to time.")
@click.option("--rounds", type=click.IntRange(1, 200), default=None,
              help="Interleaved rounds per configuration (default 41; --quick 3).")
@click.option("--clock", type=click.Choice(sorted(CLOCKS)), default="cpu", show_default=True,
              help="Step clock: this thread's CPU time (robust on a shared machine) or wall time.")
@click.option("--only", type=click.Choice(["scheduler", "limiter", "gate", "live"]), multiple=True,
              help="Run only these parts (repeatable); default: all.")
@click.option("--live/--no-live", default=None,
              help="Also start a real vLLM engine (tiny model) for the live section; default: on, off with --quick.")
@click.option("--profile", "profile_n", type=click.IntRange(1), default=None, metavar="N",
              help="Instead of the benchmark: cProfile the reference's schedule() at N running requests.")
def bench(json_path, plot_path, quick, sizes, rounds, clock, only, live, profile_n) -> None:
    """Measure the rate limit's cost: scheduler steps vs stock vLLM, limiter ops/s, gate rates."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    plan = QUICK if quick else FULL
    overrides: dict[str, Any] = {}
    if (parsed := _parse_sizes(sizes)) is not None:
        overrides["sizes"] = parsed
    if rounds is not None:
        overrides["rounds"] = rounds
    if overrides:
        plan = Plan(**{**asdict(plan), **overrides})
    parts = set(only) or {"scheduler", "limiter", "gate"}
    if live or (live is None and not only and not quick):
        parts.add("live")
    elif live is False:
        parts.discard("live")
    command = _command_line(json_path, plot_path, quick, sizes, rounds, clock, only, profile_n, live)
    started = time.monotonic()
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with console.status("importing vLLM"):
        import vllm

        import vllm_output_rate.reference.scheduler  # noqa: F401
    # vLLM's config warnings (e.g. about the gate's small engine shapes) are not results.
    logging.getLogger("vllm").setLevel(logging.ERROR)

    if profile_n is not None:
        steps = 20 if quick else 100
        with console.status(f"profiling the reference's schedule() at {profile_n} running requests"):
            prof = profile_schedule(profile_n, steps, top=25)
        head = (f"cProfile: RateLimitedScheduler.schedule() at {profile_n} running, limit not binding, {steps} steps, "
                f"{prof['total_us_per_step']:,.0f} µs/step under the profiler")
        for title, key in ((f"{head}; by self time", "top_self"),
                           ("project functions (vllm_output_rate) by cumulative time", "project_cumulative")):
            table = Table(title=title)
            for col in ("function", "calls/step", "self %", "cum %", "self µs/step", "cum µs/step"):
                table.add_column(col, justify="left" if col == "function" else "right")
            for r in prof[key]:
                table.add_row(r["function"], f"{r['calls_per_step']:.0f}", f"{100 * r['self_share']:.1f}",
                              f"{100 * r['cum_share']:.1f}", f"{r['self_us_per_step']:.0f}",
                              f"{r['cum_us_per_step']:.0f}")
            console.print(table)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({"profile": prof, "running": profile_n, "steps": steps,
                                             "command": command}, indent=2))
        return

    configs = [(n, f, m) for n in plan.sizes for m in plan.modes for f in plan.fractions]
    scheduler_rows: list[SchedulerRow] = []
    limiter: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    live_result: dict[str, Any] | None = None
    progress = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    with progress:
        if "scheduler" in parts:
            task = progress.add_task("scheduler", total=len(configs) * plan.rounds)
            for n, fraction, mode in configs:
                progress.update(task, description=f"scheduler {mode} N={n} throttled {fraction:.0%}")
                scheduler_rows.append(measure_scheduler(n, fraction, mode, plan, lambda: progress.advance(task),
                                                        clock))
            progress.update(task, description="scheduler")
        if "limiter" in parts:
            task = progress.add_task("limiter", total=plan.limiter_batches)
            limiter = measure_limiter(plan, lambda: progress.advance(task))
        if "gate" in parts:
            task = progress.add_task("gate (differential)", total=2 * plan.gate_scenarios)
            gate = measure_gate(plan, lambda: progress.advance(task))
        if "live" in parts:
            task = progress.add_task("live engine (tiny model)", total=live_steps(plan))
            live_result = measure_live(plan, lambda: progress.advance(task))

    env = machine()
    env["load_average_at_start"] = load_at_start
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    console.print(f"{when}; {env['cores']} cores, {env['cpu']}; vLLM {vllm.__version__}; Python {env['python']}; "
                  f"load average at the end {env['load_average']}; command: {command}")
    if scheduler_rows:
        console.print(_scheduler_table(scheduler_rows, clock))
    if limiter is not None:
        console.print(_limiter_table(limiter))
    if gate is not None:
        console.print(_gate_table(gate))
        for name, why in gate["skipped"].items():
            console.print(f"{name}: {why}")
    if live_result is not None:
        console.print(_live_table(live_result))
        console.print(_idle_table(live_result))
    if plot_path is not None and scheduler_rows:
        write_plot(scheduler_rows, plot_path,
                   f"outrate bench, vLLM {vllm.__version__}, {env['cores']} cores {env['cpu']}, {when}")
        console.print(f"wrote {plot_path}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "date": when,
            "command": command,
            "vllm_version": vllm.__version__,
            "machine": env,
            "quick": quick,
            "clock": clock,
            "plan": asdict(plan),
            "seconds": round(time.monotonic() - started, 1),
            "scheduler": [asdict(r) for r in scheduler_rows],
            "limiter": limiter,
            "gate": gate,
            "live": live_result,
        }
        json_path.write_text(json.dumps(report, indent=2, default=_json_default))
        console.print(f"wrote {json_path}")


def _json_default(value: Any) -> Any:
    return str(value)


def _command_line(json_path, plot_path, quick, sizes, rounds, clock, only, profile_n, live=None) -> str:
    """The command that reproduces this run (for the report)."""
    words = ["outrate", "bench"]
    words += ["--quick"] if quick else []
    words += ["--sizes", sizes] if sizes else []
    words += ["--rounds", str(rounds)] if rounds is not None else []
    words += ["--clock", clock] if clock != "cpu" else []
    for part in only:
        words += ["--only", part]
    words += [] if live is None else ["--live" if live else "--no-live"]
    words += ["--profile", str(profile_n)] if profile_n is not None else []
    words += ["--json", str(json_path)] if json_path is not None else []
    words += ["--plot", str(plot_path)] if plot_path is not None else []
    return " ".join(words)
