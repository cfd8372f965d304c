"""One scheduler of ``outrate bench``'s scheduler part on a ``Harness`` (``_Driver``), and
the arguments that make each kind of it (``kind_options``): stock vLLM, the reference, the
article-style peer and the control. Used in the bench's process (``--profile``, the shared
budget part) and in the schedulers' own processes (``bench/processes.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.vllm_compat import model_runner_output
from vllm_output_rate.bench.common import (
    CLOCKS,
    FREE_RATE,
    MAX_WARMUP_STEPS,
    MIN_STEADY_STEPS,
    STEP_NS,
    STREAMS_PER_USER,
    TINY_RATE,
    Plan,
)


# -- scheduler step cost ----------------------------------------------------------------
def throttled_indices(n: int, fraction: float) -> set[int]:
    """``round(n * fraction)`` request indices spread evenly over ``range(n)``."""
    k = round(n * fraction)
    return {(i * n) // k for i in range(k)} if k else set()


class _Driver:
    """One scheduler on a ``Harness``; ``step()`` returns the seconds spent in vLLM's calls."""

    build_number = 0  # which of its process's schedulers it is (bench/processes.py; 0: not numbered)

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


KINDS = ("stock", "reference", "control", "article")  # article: only where its fixture is importable


def kind_options(kind: str, n: int, fraction: float, async_mode: bool, plan: Plan, clock: str) -> dict[str, Any]:
    """``_Driver``'s arguments for one scheduler of ``kind`` at ``n`` running requests,
    ``fraction`` of them throttled, sized for the plan's warm-up and timed rounds, on the
    clock named ``clock`` (``article=True`` for the article-style peer, resolved where the
    driver is built). ``control`` is stock again.

    Raises:
        ValueError: an unknown ``kind``.
    """
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import (
        REFERENCE_ASYNC_SCHEDULER,
        REFERENCE_SCHEDULER,
        STOCK_ASYNC_SCHEDULER,
        STOCK_SCHEDULER,
    )

    common: dict[str, Any] = {
        "n": n,
        "fraction": fraction,
        "async_mode": async_mode,
        "total_steps": MAX_WARMUP_STEPS + plan.rounds * (plan.steps_for(n) + plan.rewarm_steps) + 8,
        "clock": CLOCKS[clock],
    }
    stock_path = STOCK_ASYNC_SCHEDULER if async_mode else STOCK_SCHEDULER
    if kind in ("stock", "control"):
        return {**common, "cls_path": stock_path, "limited": False}
    if kind == "reference":
        return {**common, "cls_path": REFERENCE_ASYNC_SCHEDULER if async_mode else REFERENCE_SCHEDULER, "limited": True}
    if kind == "article":
        return {**common, "cls_path": "", "limited": True, "article": True}
    raise ValueError(f"unknown scheduler kind {kind!r}; expected one of {', '.join(KINDS)}")
