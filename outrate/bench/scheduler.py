"""Scheduler step cost: stock vLLM, the reference and the article-style implementation timed
in interleaved rounds at N running requests (``vllm_output_rate.bench``, "Scheduler step cost").
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from vllm_output_rate.bench.common import QUICK, Plan
from vllm_output_rate.bench.driver import KINDS, article_style, kind_options
from vllm_output_rate.bench.limiter import measure_limiter


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
    # Schedulers (each in a process of its own) of each kind timed in the cell
    # (Plan.instances); µs and ratios are of the median over a kind's instances.
    instances: int = 1
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
    # ``ratio`` and ``control_ratio`` from the statistic the bench used before (a round's
    # value: the median over a kind's schedulers of each one's mean step), in the same run.
    ratio_block_means: float | None = None
    control_ratio_block_means: float | None = None


class SchedulerKinds:
    """The scheduler part's processes: ``instances`` x the kinds (``KINDS``; the
    article-style peer only where ``article_style`` finds it) ``KindProcess`` es, kept for a
    whole run, each holding one scheduler of one kind and configuration at a time.

    Which kind a process holds moves with ``build``'s ``turn``: the schedulers are slots
    (kind, index), slot ``s = index * kinds + k`` (``k``: the kind's place in ``kinds``);
    at turn 0 process ``s`` holds slot ``s``, at every other turn the slots go to the
    processes in an order drawn from a generator seeded with ``ORDER_SEED`` and the turn
    (``assignment``), the same every run. One process can read 2-4% slower or faster
    than another in every round, whatever scheduler it holds (docs/PERFORMANCE.md, "How
    the bench measures"); moving the kinds over the processes spreads that over every
    kind. Drawn, not rotated: with a rotation every kind's scheduler is built in a
    process that held the same other kind the round before. A context manager;
    ``close()`` ends them.

    Raises:
        ValueError: ``instances`` < 1.
    """

    def __init__(self, instances: int = 1) -> None:
        # deferred: multiprocessing is only needed when the scheduler part runs
        from vllm_output_rate.bench.processes import KindProcess

        if instances < 1:
            raise ValueError(f"instances must be >= 1, got {instances!r}")
        self.kinds = [k for k in KINDS if k != "article" or article_style(False) is not None]
        self.instances = instances
        self.pool: list[Any] = []
        # kind -> its schedulers' processes at the last build's turn (index: the instance)
        self.processes: dict[str, list[Any]] = {}
        try:
            for _ in range(instances * len(self.kinds)):
                self.pool.append(KindProcess("scheduler"))
        except BaseException:
            self.close()
            raise
        self._assign(0)

    def __enter__(self) -> SchedulerKinds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def assignment(self, turn: int) -> list[int]:
        """Slot -> the index in ``pool`` of the process that holds it at ``turn`` (a
        permutation; class docstring)."""
        size = len(self.pool)
        if turn == 0:
            return list(range(size))
        return random.Random(ORDER_SEED * 1_000_003 + turn).sample(range(size), size)

    def _assign(self, turn: int) -> None:
        """Give the slots to the processes as ``assignment(turn)`` says."""
        held = self.assignment(turn)
        self.processes = {
            kind: [self.pool[held[i * len(self.kinds) + k]] for i in range(self.instances)]
            for k, kind in enumerate(self.kinds)
        }
        for kind, group in self.processes.items():
            for process in group:
                process.kind = kind  # its error messages name the kind it holds

    def close(self) -> None:
        """End every process."""
        for process in self.pool:
            process.close()
        self.pool, self.processes = [], {}

    def build(self, n: int, fraction: float, async_mode: bool, plan: Plan, clock: str, turn: int = 0) -> int:
        """One scheduler for this configuration in every process, of the kind its slot at
        ``turn`` names (class docstring), all built and warmed up at once; the reference's
        planned throttled requests.

        Raises:
            RuntimeError: a scheduler could not be built or found no steady state (the
                message names the kind).
        """
        self._assign(turn)
        for kind, group in self.processes.items():
            options = kind_options(kind, n, fraction, async_mode, plan, clock)
            for process in group:
                process.send("build", options)
        planned = {kind: [process.result() for process in group] for kind, group in self.processes.items()}
        return planned["reference"][0]

    def run(self, kind: str, index: int, steps: int, rewarm: int = 0) -> list[float]:
        """The CPU seconds of each of ``steps`` steps of scheduler ``index`` of ``kind``,
        after ``rewarm`` untimed ones (``Plan.rewarm_steps``)."""
        return self.processes[kind][index].call("run", steps, rewarm)

    def throttled(self, kind: str, index: int) -> int:
        """Throttled requests in the last step of scheduler ``index`` of ``kind``."""
        return self.processes[kind][index].call("throttled")

    def drop(self) -> None:
        """Free every scheduler of the last configuration."""
        for process in self.pool:
            process.call("drop")


ORDER_SEED = 27  # seeds the rounds' orders (_timed_rounds) and the kinds' draws (SchedulerKinds.assignment)


def _timed_rounds(
    kinds: SchedulerKinds,
    planned: int,
    plan: Plan,
    steps: int,
    tick: Callable[[], None],
    rebuild: Callable[[int], int] | None = None,
    block_means: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Kind -> per round, the median of the seconds of every step its ``plan.instances``
    schedulers took in the round (pooled); every scheduler runs ``steps`` steps a round,
    one at a time, in an order drawn anew each round from a generator seeded with
    ``ORDER_SEED``. ``block_means`` (when given) gets, per kind and round, the statistic
    the bench used before: the median over the schedulers of each one's mean step.
    ``rebuild`` (``plan.rebuild_each_round``): called with the round's number before every
    round after the first, it builds and warms up a new scheduler in every process (the
    kinds moved over the processes, ``SchedulerKinds.build``'s ``turn``) and returns the
    reference's planned throttled requests.

    Medians, not means: a steady step does the same work every time, and the shared
    machine slows the steps of one stretch of 10-100 ms and not the next, so a few slow
    steps move a mean step and not the median one; one process in several also reads
    2-4% slower than its kind's others in every round (docs/PERFORMANCE.md, "How the bench
    measures"), whose steps a median over the pooled steps of three outweighs. What a
    median leaves out is work done only in rare steps: the reference's R6 clean-up (every
    256 steps) and operator log (every 10 s of the fake clock).

    Raises:
        RuntimeError: the reference's throttled requests drifted from ``planned``, or a
            rebuilt scheduler planned another number.
    """
    names, instances = list(kinds.processes), plan.instances
    # A new order every round, drawn from a seeded generator (the same every run): which
    # kind a scheduler follows sets how cold its caches are after the other's round, and a
    # fixed rotation had every stock scheduler follow an article-style one.
    everyone = [(kind, i) for i in range(instances) for kind in names]
    order = random.Random(ORDER_SEED)
    medians: dict[str, list[float]] = {kind: [] for kind in names}
    throttled_seen: set[int] = set()
    for k in range(plan.rounds):
        if rebuild is not None and k > 0:
            again = rebuild(k)
            if again != planned:
                raise RuntimeError(f"a rebuilt scheduler planned {again} throttled requests, the first {planned}")
        spent: dict[str, list[list[float]]] = {kind: [[] for _ in range(instances)] for kind in names}
        for kind, i in order.sample(everyone, len(everyone)):
            spent[kind][i] = kinds.run(kind, i, steps, plan.rewarm_steps)
        for kind in names:
            medians[kind].append(statistics.median(itertools.chain.from_iterable(spent[kind])))
            if block_means is not None:
                block_means.setdefault(kind, []).append(statistics.median(map(statistics.fmean, spent[kind])))
        throttled_seen.update(kinds.throttled("reference", i) for i in range(instances))
        tick()
    if throttled_seen != {planned}:
        raise RuntimeError(
            f"throttled requests drifted during the timed rounds: {sorted(throttled_seen)}, planned {planned}"
        )
    return medians


def _median_ratio(top: list[float], bottom: list[float]) -> float:
    """The median over rounds of ``top[k] / bottom[k]``."""
    return statistics.median(t / b for t, b in zip(top, bottom))


def measure_scheduler(
    n: int,
    fraction: float,
    mode: str,
    plan: Plan,
    tick: Callable[[], None],
    clock: str = "cpu",
    kinds: SchedulerKinds | None = None,
) -> SchedulerRow:
    """Interleaved rounds of stock, reference, article-style and control at ``n`` running
    requests, ``plan.instances`` schedulers of each, every one in a process of its own
    (``kinds``, or processes started and ended for this call; module docstring), built
    anew every round with the kinds moved over the processes when
    ``plan.rebuild_each_round`` (``SchedulerKinds``); the row's µs are medians over rounds
    of a kind's median step in the round, its steps on all its instances pooled
    (``_timed_rounds``), its ratios medians over rounds of those medians' ratios.

    Raises:
        ValueError: ``kinds`` holds another number of processes per kind than
            ``plan.instances``.
        RuntimeError: a scheduler could not be built or found no steady state, or the
            throttled requests drifted.
    """
    own = kinds is None
    if kinds is None:
        kinds = SchedulerKinds(plan.instances)
    elif kinds.instances != plan.instances:
        raise ValueError(
            f"the processes hold {kinds.instances} scheduler(s) of each kind, the plan asks for {plan.instances}"
        )
    try:
        planned = kinds.build(n, fraction, mode == "async", plan, clock)
        steps = plan.steps_for(n)
        rebuild = partial(kinds.build, n, fraction, mode == "async", plan, clock) if plan.rebuild_each_round else None
        block_means: dict[str, list[float]] = {}
        per_round = _timed_rounds(kinds, planned, plan, steps, tick, rebuild, block_means)
    finally:
        if own:
            kinds.close()
    if not own:
        kinds.drop()
    stock_rounds, ref_rounds, article_rounds = per_round["stock"], per_round["reference"], per_round.get("article")
    ratios = [r / s for r, s in zip(ref_rounds, stock_rounds)]
    stock_us, reference_us = statistics.median(stock_rounds) * 1e6, statistics.median(ref_rounds) * 1e6
    return SchedulerRow(
        running=n,
        throttled_fraction=fraction,
        mode=mode,
        stock_us=stock_us,
        reference_us=reference_us,
        ratio=statistics.median(ratios),
        throttled_requests=planned,
        rounds=plan.rounds,
        steps_per_round=steps,
        instances=plan.instances,
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        article_us=statistics.median(article_rounds) * 1e6 if article_rounds is not None else None,
        article_ratio=_median_ratio(article_rounds, stock_rounds) if article_rounds is not None else None,
        reference_article_ratio=_median_ratio(ref_rounds, article_rounds) if article_rounds is not None else None,
        per_request_over_stock_us=(reference_us - stock_us) / n,
        control_ratio=_median_ratio(per_round["control"], stock_rounds),
        ratio_block_means=_median_ratio(block_means["reference"], block_means["stock"]),
        control_ratio_block_means=_median_ratio(block_means["control"], block_means["stock"]),
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
