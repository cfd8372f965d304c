"""``outrate bench --profile N``: cProfile of the reference's ``schedule()``."""

from __future__ import annotations

import cProfile
import os
from pathlib import Path
from typing import Any

from vllm_output_rate.bench.common import (
    MAX_WARMUP_STEPS,
    STEP_NS,
)
from vllm_output_rate.bench.scheduler import _Driver


# -- profile ----------------------------------------------------------------------------
def profile_schedule(n: int, steps: int, top: int) -> dict[str, Any]:
    """cProfile of the reference's ``schedule()`` at ``n`` running requests (limit not binding)."""
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
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
    stats = {
        (
            ("~", 0, e.code) if isinstance(e.code, str) else (e.code.co_filename, e.code.co_firstlineno, e.code.co_name)
        ): e
        for e in profiler.getstats()
    }
    total = sum(e.inlinetime for e in stats.values())
    rows: list[dict[str, Any]] = []
    for (path, line, func), entry in stats.items():
        ncalls, tottime, cumtime = entry.callcount, entry.inlinetime, entry.totaltime
        rows.append(
            {
                "function": f"{_short(path)}:{line}({func})",
                "calls_per_step": ncalls / steps,
                "self_share": tottime / total,
                "cum_share": cumtime / total,
                "self_us_per_step": tottime / steps * 1e6,
                "cum_us_per_step": cumtime / steps * 1e6,
                "project": _is_project(path),
            }
        )
    by_self = sorted(rows, key=lambda r: r["self_share"], reverse=True)[:top]
    project = sorted((r for r in rows if r["project"]), key=lambda r: r["cum_share"], reverse=True)[:top]
    return {"total_us_per_step": total / steps * 1e6, "top_self": by_self, "project_cumulative": project}


_REPO_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep


def _is_project(path: str) -> bool:
    return path.startswith(_REPO_ROOT) and "site-packages" not in path


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return path[len(_REPO_ROOT) :] if path.startswith(_REPO_ROOT) else path
