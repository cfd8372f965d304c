"""Live engine: tokens/s off vs on, CPU while every user is throttled, RPC wake-up pings
(``vllm_output_rate.bench``, "Live"; the engines run in ``livebench.py`` children).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_output_rate.bench.common import (
    LIVE_CPU_TARGET_PERCENT,
    LIVE_RATIO_TARGET,
    PING_TIMEOUT_S,
    Plan,
)


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
    # deferred: livebench and what it loads cost ~0.1 s, kept off `outrate --help`
    from vllm_output_rate.livebench import ping_round_trips, run_child

    throughput = run_child(
        {"part": "throughput", "streams": plan.live_streams, "tokens": plan.live_tokens, "rounds": plan.live_rounds},
        tick=tick,
    )
    throttled_cfg = {
        "part": "throttled",
        "users": plan.live_throttled_users,
        "streams_per_user": 2,
        "tokens": plan.live_throttled_tokens,
        "rate": plan.live_throttled_rate,
    }
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
        "engine_worker_cpu_idle": sum(
            v for role, v in runs["with_wait"]["idle_cpu_percent"].items() if role != "front_end"
        ),
        "cpu_unit": "percent of one core",
        "ratio_target": LIVE_RATIO_TARGET,
        "engine_cpu_target": LIVE_CPU_TARGET_PERCENT,
        "throughput": throughput,
        "throttled_with_wait": runs["with_wait"],
        "throttled_wait_worker_spins": runs["wait_worker_spins"],
        "throttled_without_wait": runs["without_wait"],
        "pings": pings,
    }
