"""Scheduler step cost with the multi-engine shared budget (R23-R26): the reference
scheduler with ``output_rate.shared_budget_url`` against the single-engine reference,
timed in interleaved rounds (``vllm_output_rate.bench``, "Shared budget").

Both run the same N requests (4 streams per user) on the real monotonic clock (the store
answers on its own real clock), each user at the same rate: 10**9 tokens/s (the limit
never binds; one lease covers a user until the lease expires) and ``BINDING_RATE``
tokens/s (every user is held to its rate; the shared one leases L = 10 grants per
round trip). Each step is followed by ``MODEL_S`` of real time with the GIL free (a real
engine's forward pass), in which the store's refill thread runs. A redis-server on a loopback port is started for the run. Reported per row:
the median per-step cost of each (plan clock), the median per-round ratio shared /
single, store round trips per second of the timed rounds' wall time (the refill thread's
leases and returns) and per generated token of the shared scheduler, and the tokens/s each of the two
generated (with a binding rate: users x rate plus the burst, if the refill keeps up).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.bench.common import CLOCKS, FREE_RATE, Plan
from vllm_output_rate.bench.driver import _Driver
from vllm_output_rate.redis_server import RedisServer

BINDING_RATE = 200  # tokens/s per user: T = 5 ms, lease size L = 10
SHARED_SIZES = (64, 256)
WARMUP_S = 1.0  # real time before the timed rounds: past the start-up hold (R26), leases flowing
MODEL_S = 0.002  # real time per step outside the timed region: the model's forward pass, GIL released
MAX_WARMUP = 1500  # steps (the tiny model's 4096 positions bound max_tokens)


class _RealClockDriver(_Driver):
    """The reference on ``n`` requests of 4-stream users at ``rate`` tokens/s each, on the
    real monotonic clock; with ``url``, sharing every user's budget through that store."""

    def __init__(self, n: int, rate: float, url: str | None, total_steps: int, clock: Callable[[], float]) -> None:
        # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
        from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, Harness

        super().__init__(REFERENCE_SCHEDULER, n, 0.0, False, total_steps, limited=True, clock=clock)
        section: dict[str, Any] = {"default_tokens_per_s": rate}
        if url is not None:
            section["shared_budget_url"] = url
        old = self.harness
        self.harness = Harness(REFERENCE_SCHEDULER, dataclasses.replace(old.shape, output_rate=section))
        for rid, request in old.scheduler.requests.items():
            self.harness.add_request(
                rid,
                request.sampling_params.extra_args["output_rate_user"],
                prompt_len=request.num_prompt_tokens,
                max_tokens=self.max_tokens,
            )
        self.scheduler = self.harness.scheduler
        self.scheduler.clock_ns = time.monotonic_ns
        self.started = time.monotonic()

    def step(self) -> float:
        """One timed step, then ``MODEL_S`` of real time in which the GIL is free (as during
        a real engine's forward pass), so the refill thread runs as it would in an engine."""
        spent = super().step()
        time.sleep(MODEL_S)
        return spent

    def steady(self) -> bool:
        """Every request resident and past its first token, and the warm-up time spent."""
        scheduler = self.scheduler
        return (
            len(scheduler.running) == self.n
            and not scheduler.waiting
            and time.monotonic() - self.started >= WARMUP_S
            and all(r.num_output_tokens >= 1 for r in scheduler.running)
        )

    max_warmup_steps = MAX_WARMUP
    settle_steps = 0

    def no_steady_state(self) -> str:
        return (
            f"shared-budget bench with {self.n} requests: no steady state after "
            f"{self.steps} steps (running {len(self.scheduler.running)})"
        )

    def tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.scheduler.running)

    def close(self) -> None:
        close = getattr(self.scheduler.rate_limiter, "close", None)
        if close is not None:
            close()


@dataclass
class SharedRow:
    running: int
    rate_tokens_per_s: float
    single_us: float
    shared_us: float
    ratio: float
    ratio_min: float
    ratio_max: float
    round_trips_per_s: float
    round_trips_per_token: float
    users: int
    tokens_per_s: float
    single_tokens_per_s: float
    rounds: int
    steps_per_round: int


def measure_shared(
    n: int, rate: float, url: str, plan: Plan, tick: Callable[[], None], clock: str = "cpu"
) -> SharedRow:
    """Interleaved rounds of the single-engine and the shared-budget reference (module docstring)."""
    steps = plan.steps_for(n)
    total = MAX_WARMUP + plan.rounds * steps + 8
    single = _RealClockDriver(n, rate, None, total, CLOCKS[clock])
    shared = _RealClockDriver(n, rate, url, total, CLOCKS[clock])
    drivers = [single, shared]
    try:
        for driver in drivers:
            driver.warm_up()
        gc.collect()
        means: dict[int, list[float]] = {id(d): [] for d in drivers}
        limiter = shared.scheduler.rate_limiter
        trips0, tokens0, single0 = limiter.round_trips, shared.tokens(), single.tokens()
        wall0 = time.monotonic()
        for k in range(plan.rounds):
            for driver in drivers if k % 2 == 0 else drivers[::-1]:
                spent = sum(driver.step() for _ in range(steps))
                means[id(driver)].append(spent / steps)
            tick()
        wall = time.monotonic() - wall0
        trips, tokens = limiter.round_trips - trips0, shared.tokens() - tokens0
        single_tokens = single.tokens() - single0
    finally:
        for driver in drivers:
            driver.close()
    ratios = [s / r for s, r in zip(means[id(shared)], means[id(single)])]
    return SharedRow(
        running=n,
        rate_tokens_per_s=rate,
        single_us=statistics.median(means[id(single)]) * 1e6,
        shared_us=statistics.median(means[id(shared)]) * 1e6,
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        round_trips_per_s=trips / wall,
        round_trips_per_token=trips / tokens if tokens else float("nan"),
        users=len({r.sampling_params.extra_args["output_rate_user"] for r in shared.scheduler.requests.values()}),
        tokens_per_s=tokens / wall,
        single_tokens_per_s=single_tokens / wall,
        rounds=plan.rounds,
        steps_per_round=steps,
    )


def shared_configs(plan: Plan) -> list[tuple[int, float]]:
    """(running requests, rate) of each row: 64 and 256 (or the plan's sizes with --quick),
    not binding and binding."""
    sizes = SHARED_SIZES if max(plan.sizes) >= max(SHARED_SIZES) else plan.sizes[:2]
    return [(n, rate) for n in sizes for rate in (FREE_RATE, BINDING_RATE)]


def measure_all_shared(plan: Plan, tick: Callable[[], None], clock: str = "cpu") -> dict[str, Any]:
    """Every row of ``shared_configs`` against one redis-server started for the run, or
    ``{"skipped": reason}`` when ``redis-server`` or the ``redis`` package is missing."""
    server = RedisServer()
    try:
        server.start()
    except (RuntimeError, ImportError) as exc:
        return {"skipped": str(exc), "rows": []}
    try:
        rows = [measure_shared(n, rate, server.url, plan, tick, clock) for n, rate in shared_configs(plan)]
    finally:
        server.kill()
    return {"skipped": None, "rows": [dataclasses.asdict(r) for r in rows]}
