"""``outrate bench``: what the rate limit costs, measured side by side in one run.

Scheduler step cost. For each number of running requests N, each mode (sync: vLLM's
``Scheduler``; async: ``AsyncScheduler``) and each throttled fraction, schedulers of four
kinds are built on the same engine shape with the same N requests: stock vLLM (feature
off, nothing throttled), the reference ``RateLimitedScheduler`` /
``RateLimitedAsyncScheduler``, the article-style implementation (the independent
implementation of the article kept as the gate's acceptance corpus,
``tests/fixtures/article_style``, configured through its hook; only when the checkout has
it) and the control, stock again. Every scheduler runs in a fresh process of its own
(spawned, ``bench/processes.py``): an engine core runs one scheduler class, and in one
process vLLM's call sites of the hooks, which CPython specializes for the function they
last called, would switch between the kinds' functions every round. Each kind has
``Plan.instances`` schedulers (3 by default, ``--instances``), each in a process of its
own; one scheduler or process can read a few percent slower or faster than another of the
same kind in every round, and a kind's value in a round is the median over its
schedulers. All are run to a decode steady state (every
request past its prefill, or throttled), then timed in interleaved rounds: a round is
``Plan.steps_for(N)`` steps of every scheduler in turn after ``Plan.rewarm_steps``
untimed ones (8 by default: a process resumes with cold caches), one process stepping while
the others wait (16 steps, or as many as make 4096 request-steps, up to 64: rounds of similar
length at every N), in an order drawn anew each round from a seeded generator
(``ORDER_SEED``), so a load change on the shared machine hits every kind alike and no kind
always follows the same other. With ``Plan.rebuild_each_round`` (the full plan) every
process builds and warms up a new scheduler before every round after the first: one
scheduler can read 2-4% slower or faster than the next one built in the same process, in
every round it is timed, and a new one each round makes that a per-round draw. Only ``schedule()`` + ``update_from_output()`` are
timed (the fabricated model output is built outside the timed region; async mode times a
step's ``schedule()`` with the delivery of the step in flight, as the engine core does), by
default on the stepping thread's CPU clock so that time spent descheduled while other jobs
hold the cores is left out (``--clock wall`` for perf_counter). A round's value is a kind's
median step, its steps on all its schedulers pooled (a few steps slowed by the shared
machine move a mean and not a median; ``ratio_block_means`` / ``control_ratio_block_means``
give the statistic used before, the median over schedulers of each one's mean step, from
the same run); the table reports the medians over rounds and ``ratio`` = median of the
per-round ratios reference / stock (robust to load drift; close to ``reference_us /
stock_us``); ``article_ratio`` is the article-style peer's, ``control_ratio`` the
control's (A/A: how far a ratio of two identical kinds, each in its own process, reads
from 1.0 in that run, the resolution of ``ratio``).

- throttled fraction 0: the limit is on with a rate of 10**9 tokens/s, never binding;
- 0.5 / 0.9: that share of the requests, spread evenly over the running order, belongs to
  users with 0.001 tokens/s who have spent their burst before the timed rounds (their
  streams stay resident and are skipped, R11); the others decode freely.

Requests: prompts of 4-19 tokens (block boundaries spread over steps), 4 streams per
user, ``max_tokens`` large enough that nothing finishes; max_num_seqs = N,
max_num_batched_tokens >= 4N, KV blocks for every token the run can produce.

Shared budget (R23-R26, ``shared``): the reference with ``output_rate.shared_budget_url``
against the single-engine reference at 64 and 256 running requests, both on the real clock,
in interleaved rounds, with a redis-server on a loopback port started for the run (the part
says why it was skipped without one): the per-step ratio shared / single, store round trips
per second and per generated token, at a rate that never binds and at 200 tokens/s per user
(module ``shared``).

Limiter: ``OutputRateLimiter.try_take`` (granted and refused) and ``refund`` operations
per second, in batches over 4096 users, median over repetitions.

Gate: differential steps/s of ``adapter.scenario_run.run_scenario`` on the reference (real
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

Layout: ``common`` (the plan, clock, targets), one module per benchmark (``scheduler``, ``shared``,
``limiter``, ``gate``, ``live``, and ``profiling`` for ``--profile``), ``render`` (tables and
the plot) and ``command`` (the ``outrate bench`` command).
"""

from vllm_output_rate.bench.command import bench
from vllm_output_rate.bench.common import (
    CLOCKS,
    FREE_RATE,
    FULL,
    LIMITER_USERS,
    LIVE_CPU_TARGET_PERCENT,
    LIVE_RATIO_TARGET,
    MAX_WARMUP_STEPS,
    MIN_STEADY_STEPS,
    PING_TIMEOUT_S,
    QUICK,
    STEP_NS,
    STREAMS_PER_USER,
    TINY_RATE,
    TINY_RATE_INTEGER,
    Plan,
    console,
)
from vllm_output_rate.bench.driver import (
    ARTICLE_ASYNC_SCHEDULER,
    ARTICLE_HOOK,
    ARTICLE_SCHEDULER,
    article_style,
    throttled_indices,
)
from vllm_output_rate.bench.gate import measure_gate, seeded_draws
from vllm_output_rate.bench.limiter import measure_limiter
from vllm_output_rate.bench.live import THROTTLED_RUNS, live_steps, measure_live
from vllm_output_rate.bench.profiling import profile_schedule
from vllm_output_rate.bench.render import machine, write_plot
from vllm_output_rate.bench.scheduler import SchedulerRow, measure_scheduler

__all__ = [
    "ARTICLE_ASYNC_SCHEDULER",
    "ARTICLE_HOOK",
    "ARTICLE_SCHEDULER",
    "CLOCKS",
    "FREE_RATE",
    "FULL",
    "LIMITER_USERS",
    "LIVE_CPU_TARGET_PERCENT",
    "LIVE_RATIO_TARGET",
    "MAX_WARMUP_STEPS",
    "MIN_STEADY_STEPS",
    "PING_TIMEOUT_S",
    "QUICK",
    "STEP_NS",
    "STREAMS_PER_USER",
    "THROTTLED_RUNS",
    "TINY_RATE",
    "TINY_RATE_INTEGER",
    "Plan",
    "SchedulerRow",
    "article_style",
    "bench",
    "console",
    "live_steps",
    "machine",
    "measure_gate",
    "measure_limiter",
    "measure_live",
    "measure_scheduler",
    "profile_schedule",
    "seeded_draws",
    "throttled_indices",
    "write_plot",
]
