"""Limiter: ``OutputRateLimiter`` operations per second over 4096 users (``vllm_output_rate.bench``, "Limiter")."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from vllm_output_rate.bench.common import (
    LIMITER_USERS,
    TINY_RATE,
    Plan,
)
from vllm_output_rate.reference.limiter import OutputRateLimiter


# -- limiter --------------------------------------------------------------------------
def measure_limiter(plan: Plan, tick: Callable[[], None]) -> dict[str, Any]:
    """Operations per second of the reference limiter (median over batches)."""
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
