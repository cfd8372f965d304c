"""What every benchmark of ``outrate bench`` shares: the plan (how much to measure), the
step clock, the targets reported beside the numbers, and the console.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

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
    # Rounds sized by work: at least this many request-steps per round (N running x steps),
    # so that a round at small N is not a few ms, which reads mostly noise; 0: always
    # ``steps_per_round`` (steps_for).
    round_request_steps: int = 0
    # Rounds of a discarded scheduler cell (the first configuration) run before the timed
    # ones: the first cell timed in a fresh process read the reference about 2% slower
    # than the same cell after one, when all kinds shared a process (docs/PERFORMANCE.md,
    # "How the bench measures"); 0: none.
    warmup_rounds: int = 0
    # Schedulers of each kind per scheduler cell, each in a process of its own, timed in the
    # same rounds; a kind's µs per step is the median over its instances. One process can
    # read a few percent slower or faster than another of the same kind in every round
    # (docs/PERFORMANCE.md, "How the bench measures"); the median leaves it out.
    instances: int = 1
    # Untimed steps each scheduler takes at the start of each of its rounds: its process
    # waited while the others stepped, and their rounds took its caches (an engine core
    # steps without such pauses; docs/PERFORMANCE.md, "How the bench measures").
    rewarm_steps: int = 0
    # A new scheduler in every process before every round after the first (built and
    # warmed up as the first), the kinds moved over the processes (SchedulerKinds): one
    # scheduler can read 2-4% slower or faster than the next one built in the same process,
    # and one process than another, in every round (docs/PERFORMANCE.md, "How the bench
    # measures"); this makes both per-round draws spread over every kind, which the medians
    # over instances and rounds leave out. False: one scheduler per process for the cell.
    rebuild_each_round: bool = False

    def steps_for(self, running: int) -> int:
        """Steps per round at ``running`` requests: ``steps_per_round``, raised to
        ``round_request_steps // running`` (at most ``MAX_STEPS_PER_ROUND``) and kept within
        ``MAX_TIMED_STEPS`` over the plan's rounds with their ``rewarm_steps`` (the
        requests' ``max_tokens`` must stay within the tiny model's context)."""
        by_work = min(MAX_STEPS_PER_ROUND, self.round_request_steps // max(running, 1))
        return max(self.steps_per_round, min(by_work, MAX_TIMED_STEPS // self.rounds - self.rewarm_steps))


# A round of at most this many steps, and at most this many timed steps in all (rounds x
# steps) when rounds are sized by work (Plan.steps_for).
MAX_STEPS_PER_ROUND = 64
MAX_TIMED_STEPS = 3200

FULL = Plan(
    sizes=(16, 64, 256, 1024),
    fractions=(0.0, 0.5, 0.9),
    modes=("sync", "async"),
    rounds=41,
    steps_per_round=16,
    round_request_steps=4096,
    warmup_rounds=2,
    instances=3,
    rewarm_steps=8,
    rebuild_each_round=True,
    limiter_batches=15,
    gate_scenarios=40,
    gate_max_steps=40,
)
QUICK = Plan(
    sizes=(8, 16),
    fractions=(0.0, 0.5, 0.9),
    modes=("sync", "async"),
    rounds=3,
    steps_per_round=2,
    limiter_batches=3,
    gate_scenarios=3,
    gate_max_steps=10,
    live_rounds=2,
    live_streams=4,
    live_tokens=8,
    live_throttled_users=2,
    live_throttled_tokens=2,
    live_throttled_rate=4.0,
    live_ping_steps=20,
)
# Targets of the scheduler section (reported, not asserted): reference / stock with the limit
# on but not binding, and reference / article-style with 50% or 90% of the requests throttled.
NOT_BINDING_TARGET = 1.02
THROTTLED_VS_ARTICLE_TARGET = 0.87
# Targets of the live section (reported, not asserted).
LIVE_RATIO_TARGET = 0.98  # on-but-not-binding tokens/s within 2% of off
# A read of vLLM's RPC queue that waits this long missed its wake-up ping (ping_round_trips).
PING_TIMEOUT_S = 0.25
LIVE_CPU_TARGET_PERCENT = 5.0  # engine core with every user throttled, with the wait plugin
MIN_STEADY_STEPS = 8  # warm-up steps a class without an observation gets before timing
