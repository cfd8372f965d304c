"""``outrate bench --profile N [--profile-throttled F]``: cProfile of the reference's step
(and, with requests throttled, of the article-style peer's beside it)."""

from __future__ import annotations

import cProfile
import os
from pathlib import Path
from typing import Any

from vllm_output_rate.bench.common import (
    MAX_WARMUP_STEPS,
    STEP_NS,
    TINY_RATE_INTEGER,
)
from vllm_output_rate.bench.driver import _Driver, article_style


# -- profile ----------------------------------------------------------------------------
def profile_schedule(n: int, steps: int, top: int, fraction: float = 0.0, peer: bool = False) -> dict[str, Any]:
    """cProfile of ``steps`` sync steps of one scheduler at ``n`` running requests,
    ``fraction`` of them throttled (issue 27: "say where the rest goes").

    ``peer`` False: the reference; True: the article-style peer (``tests/fixtures/article_style``,
    integer rates, as the bench times it). With ``fraction`` 0 only ``schedule()`` is
    profiled (the not-binding profile of docs/PERFORMANCE.md); otherwise ``schedule()`` and
    ``update_from_output()``, the two calls the bench times (a throttled request saves in both).

    Returns ``{"total_us_per_step", "calls", "scheduler", "throttled_fraction", "top_self",
    "project_cumulative"}`` (µs per step under the profiler, which inflates small calls).

    Raises:
        RuntimeError: no steady state in the warm-up, or ``peer`` without the fixture.
    """
    driver = _warm_driver(n, steps, fraction, peer)
    scheduler = driver.scheduler
    both = fraction > 0
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        so = scheduler.schedule()
        profiler.disable()
        mro = driver._model_output(so)
        if both:
            profiler.enable()
        scheduler.update_from_output(so, mro)
        profiler.disable()
        driver.harness.clock.advance(STEP_NS)
    # One entry per function as pstats labels it (file, first line, name; builtins: "~", 0):
    # calls, time in the function itself, and with its callees (seconds).
    stats = {
        (
            ("~", 0, e.code) if isinstance(e.code, str) else (e.code.co_filename, e.code.co_firstlineno, e.code.co_name)
        ): e
        for e in profiler.getstats()
    }
    total_s = sum(e.inlinetime for e in stats.values())
    rows: list[dict[str, Any]] = []
    for (path, line, func), entry in stats.items():
        ncalls, tottime, cumtime = entry.callcount, entry.inlinetime, entry.totaltime
        rows.append(
            {
                "function": f"{_short(path)}:{line}({func})",
                "calls_per_step": ncalls / steps,
                "self_share": tottime / total_s,
                "cum_share": cumtime / total_s,
                "self_us_per_step": tottime / steps * 1e6,
                "cum_us_per_step": cumtime / steps * 1e6,
                "project": _is_project(path),
            }
        )
    by_self = sorted(rows, key=lambda r: r["self_share"], reverse=True)[:top]
    project = sorted((r for r in rows if r["project"]), key=lambda r: r["cum_share"], reverse=True)[:top]
    return {
        "total_us_per_step": total_s / steps * 1e6,
        "calls": "schedule+update_from_output" if both else "schedule",
        "scheduler": type(scheduler).__name__,
        "throttled_fraction": fraction,
        "top_self": by_self,
        "project_cumulative": project,
    }


def _warm_driver(n: int, steps: int, fraction: float, peer: bool) -> _Driver:
    """``profile_schedule``'s scheduler (the reference, or with ``peer`` the article-style
    one), warmed up to its steady state and sized for ``steps`` more.

    Raises:
        RuntimeError: no steady state, or ``peer`` without the fixture."""
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER

    total = MAX_WARMUP_STEPS + steps + 8
    if peer:
        found = article_style(False)
        if found is None:
            raise RuntimeError("the article-style peer (tests/fixtures/article_style) is not in this checkout")
        driver = _Driver(found[0], n, fraction, False, total, limited=True, style=found[1], tiny_rate=TINY_RATE_INTEGER)
    else:
        driver = _Driver(REFERENCE_SCHEDULER, n, fraction, False, total, limited=True)
    driver.warm_up()
    return driver


_REPO_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep


def _is_project(path: str) -> bool:
    return path.startswith(_REPO_ROOT) and "site-packages" not in path


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return path[len(_REPO_ROOT) :] if path.startswith(_REPO_ROOT) else path
