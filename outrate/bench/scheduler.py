"""Scheduler step cost: stock vLLM, the reference and the article-style implementation timed
in interleaved rounds at N running requests (``vllm_output_rate.bench``, "Scheduler step cost").
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.vllm_compat import model_runner_output
from vllm_output_rate.bench.common import (
    CLOCKS,
    FREE_RATE,
    MAX_WARMUP_STEPS,
    MIN_STEADY_STEPS,
    QUICK,
    STEP_NS,
    STREAMS_PER_USER,
    TINY_RATE,
    TINY_RATE_INTEGER,
    Plan,
)
from vllm_output_rate.bench.limiter import measure_limiter


# -- scheduler step cost ----------------------------------------------------------------
def throttled_indices(n: int, fraction: float) -> set[int]:
    """``round(n * fraction)`` request indices spread evenly over ``range(n)``."""
    k = round(n * fraction)
    return {(i * n) // k for i in range(k)} if k else set()


class _Driver:
    """One scheduler on a ``Harness``; ``step()`` returns the seconds spent in vLLM's calls."""

    def __init__(
        self,
        cls_path: str,
        n: int,
        fraction: float,
        async_mode: bool,
        total_steps: int,
        limited: bool,
        clock: Callable[[], float] = time.thread_time,
        style: Any = None,
        tiny_rate: float = TINY_RATE,
    ) -> None:
        # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
        from vllm_output_rate.adapter.harness import Harness

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
        # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
        from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID

        requests = self.scheduler.requests
        ids = list(so.num_scheduled_tokens)
        tokens = [[] if requests[r].is_prefill_chunk else [NON_EOS_TOKEN_ID] for r in ids]
        return model_runner_output(ids, tokens)

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

    max_warmup_steps = MAX_WARMUP_STEPS
    settle_steps = 4  # steps taken after the steady state is reached, before timing

    def warm_up(self) -> None:
        """Step until ``steady()``, then ``settle_steps`` more.

        Raises:
            RuntimeError: no steady state within ``max_warmup_steps`` (``no_steady_state()``).
        """
        while not self.steady():
            if self.steps >= self.max_warmup_steps:
                raise RuntimeError(self.no_steady_state())
            self.step()
        for _ in range(self.settle_steps):
            self.step()

    def no_steady_state(self) -> str:
        """What ``warm_up`` raises when the steady state never came."""
        return (
            f"{self.harness.cls_path} with {self.n} requests: no decode steady state after "
            f"{self.steps} steps (running {len(self.scheduler.running)}, throttled "
            f"{self.throttled_now()} of {self.expected_throttled})"
        )


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
    # median over rounds of reference / article-style (issue 27 target: <= 0.87 when throttled)
    reference_article_ratio: float | None = None
    # What the reference adds over stock per running request and step, in µs:
    # (reference_us - stock_us) / running (negative: the reference's step was the cheaper).
    per_request_over_stock_us: float = 0.0
    # The floor of any per-request charge beside it: one granted try_take of the reference
    # limiter, in µs, measured in the same run (set_try_take_floor); None until set.
    try_take_floor_us: float | None = None
    # The control: median over rounds of a second stock scheduler / stock, built and timed
    # in the same rounds (A/A). How far from 1.0 a ratio of identical schedulers reads in
    # this run: the resolution of ``ratio``. None when the control was not run.
    control_ratio: float | None = None


ARTICLE_SCHEDULER = "article_style.scheduler.ArticleScheduler"
ARTICLE_ASYNC_SCHEDULER = "article_style.scheduler.ArticleAsyncScheduler"
ARTICLE_HOOK = "hook:article_style.hook.configure"


def article_style(async_mode: bool) -> tuple[str, Any] | None:
    """(class path, config style) of the article-style implementation, or None when this
    checkout has no ``tests/fixtures/article_style`` (an installed wheel)."""
    # deferred: adapter.configstyle loads unittest.mock and the config parsers (~0.2 s), kept off `outrate --help`
    from vllm_output_rate.adapter.configstyle import parse_config_style

    fixtures = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
    if not (fixtures / "article_style").is_dir():
        return None
    if str(fixtures) not in sys.path:
        sys.path.insert(0, str(fixtures))

    return (ARTICLE_ASYNC_SCHEDULER if async_mode else ARTICLE_SCHEDULER), parse_config_style(ARTICLE_HOOK)


def _drivers(
    n: int, fraction: float, async_mode: bool, plan: Plan, clock: str
) -> tuple[_Driver, _Driver, _Driver | None, _Driver]:
    """The stock, reference, (where its fixture is importable) article-style and control
    (a second stock) drivers at ``n`` running requests, ``fraction`` of them throttled,
    each sized for the plan's warm-up and timed rounds, all on the clock named ``clock``."""
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import (
        REFERENCE_ASYNC_SCHEDULER,
        REFERENCE_SCHEDULER,
        STOCK_ASYNC_SCHEDULER,
        STOCK_SCHEDULER,
    )

    total = MAX_WARMUP_STEPS + plan.rounds * plan.steps_for(n) + 8
    stock, control = (
        _Driver(
            STOCK_ASYNC_SCHEDULER if async_mode else STOCK_SCHEDULER,
            n,
            fraction,
            async_mode,
            total,
            limited=False,
            clock=CLOCKS[clock],
        )
        for _ in range(2)
    )
    reference = _Driver(
        REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER,
        n,
        fraction,
        async_mode,
        total,
        limited=True,
        clock=CLOCKS[clock],
    )
    peer = article_style(async_mode)
    article = (
        _Driver(
            peer[0],
            n,
            fraction,
            async_mode,
            total,
            limited=True,
            clock=CLOCKS[clock],
            style=peer[1],
            tiny_rate=TINY_RATE_INTEGER,
        )
        if peer is not None
        else None
    )
    return stock, reference, article, control


def measure_scheduler(
    n: int, fraction: float, mode: str, plan: Plan, tick: Callable[[], None], clock: str = "cpu"
) -> SchedulerRow:
    """Interleaved rounds of stock and reference at ``n`` running requests (module docstring)."""
    stock, reference, article, control = _drivers(n, fraction, mode == "async", plan, clock)
    drivers = [d for d in (stock, reference, article, control) if d is not None]
    steps = plan.steps_for(n)
    for driver in drivers:
        driver.warm_up()
    gc.collect()
    means: dict[int, list[float]] = {id(d): [] for d in drivers}
    throttled_seen: set[int] = set()
    for k in range(plan.rounds):
        order = drivers[k % len(drivers) :] + drivers[: k % len(drivers)]  # rotate who goes first
        for driver in order:
            spent = sum(driver.step() for _ in range(steps))
            means[id(driver)].append(spent / steps)
        throttled_seen.add(reference.throttled_now())
        tick()
    stock_means, ref_means = means[id(stock)], means[id(reference)]
    if throttled_seen != {reference.expected_throttled}:
        raise RuntimeError(
            f"throttled requests drifted during the timed rounds: {sorted(throttled_seen)}, "
            f"planned {reference.expected_throttled}"
        )
    ratios = [r / s for r, s in zip(ref_means, stock_means)]
    stock_us, reference_us = statistics.median(stock_means) * 1e6, statistics.median(ref_means) * 1e6
    return SchedulerRow(
        running=n,
        throttled_fraction=fraction,
        mode=mode,
        stock_us=stock_us,
        reference_us=reference_us,
        ratio=statistics.median(ratios),
        throttled_requests=reference.expected_throttled,
        rounds=plan.rounds,
        steps_per_round=steps,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        article_us=statistics.median(means[id(article)]) * 1e6 if article is not None else None,
        article_ratio=(
            statistics.median([a / s for a, s in zip(means[id(article)], stock_means)]) if article is not None else None
        ),
        reference_article_ratio=(
            statistics.median([r / a for r, a in zip(ref_means, means[id(article)])]) if article is not None else None
        ),
        per_request_over_stock_us=(reference_us - stock_us) / n,
        control_ratio=statistics.median([c / s for c, s in zip(means[id(control)], stock_means)]),
    )


FLOOR_LIMITER_BATCHES = 3  # the short try_take run when the limiter part is not selected


def try_take_floor_us(limiter: dict[str, Any] | None) -> float:
    """The ``try_take`` floor in µs: one granted ``try_take`` of the reference limiter.

    ``limiter`` is the limiter part's result (``measure_limiter``) when it ran: its
    ``try_take_per_s`` is reused. Otherwise ``measure_limiter`` is run for
    ``FLOOR_LIMITER_BATCHES`` batches (about a second) and its ``try_take_per_s`` taken.
    """
    if limiter is None:
        limiter = measure_limiter(replace(QUICK, limiter_batches=FLOOR_LIMITER_BATCHES), lambda: None)
    return 1e6 / limiter["try_take_per_s"]


def set_try_take_floor(rows: list[SchedulerRow], limiter: dict[str, Any] | None) -> float:
    """Set ``try_take_floor_us`` of every row to ``try_take_floor_us(limiter)``; returns it."""
    floor = try_take_floor_us(limiter)
    for row in rows:
        row.try_take_floor_us = floor
    return floor
