"""Rate tables of real size (R21, R27-R29): what a reload and a metrics second cost a step.

For N = 1,000, 10,000 and 100,000 users (with ``TABLE_PATTERNS`` prefix patterns, three
plans, a shadow plan and up to ``DETAILED`` detailed users) the reference
``RateLimitedScheduler`` runs ``RUNNING`` decoding requests of table users on the gate's
in-process harness (fake clock, 10 ms per step, so a metrics snapshot is due every 100
steps), with the /metrics recorder on. While it steps, the rates file is replaced by a
changed table of the same size ``RELOADS`` times; each time it steps on until the new
table is in force (read, validated and prepared off the step, R21).

Per size:

- ``reload_stall_ms``: the longest time one ``schedule()`` spent on a reload
  (``_apply_pending_rates``: the file check and, at the swap, the install; CPU time of the
  engine's thread), as issue 32 measured the earlier code's parse in the step;
- ``watcher_longest_chunk_ms``: the longest the watcher's thread held the GIL at once (its
  CPU time between two pauses, a garbage collection it triggered included): the most a
  step waits for it; ``reload_with_gil_wait_ms`` is the sum of the two;
- ``snapshot_stall_ms``: the longest metrics work of one step with a snapshot due
  (counters copied and handed to the writer thread); ``writer_longest_chunk_ms`` and
  ``snapshot_with_gil_wait_ms`` as for the reload;
- ``reload_step_excess_ms`` / ``snapshot_step_excess_ms``: wall clock, the longest
  ``schedule()`` of those steps minus the median ``schedule()`` before the first reload,
  median over the reloads: what the step lost in all, other processes' load on a shared
  machine included (a loaded 2-core machine alone shows gaps of several ms);
- ``reload_s``: wall clock from the file's replacement to the table in force (median).

CPU times: ``time.thread_time``, robust on a shared machine as the scheduler bench's
default clock.

Target (issue 32): ``reload_stall_ms`` and ``snapshot_stall_ms`` <= 1 at 100,000 users on
2 cores. Before (issue 32's measurement of the earlier code): 194 ms and 216 ms.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rich.table import Table

from vllm_output_rate.adapter.engine_shape import EngineShape

# The harness replaces time.perf_counter (and monotonic) by its fake clock during a step:
# the real clocks, taken before any step.
_WALL = time.perf_counter
_CPU = time.thread_time

SIZES = (1_000, 10_000, 100_000)
TABLE_PATTERNS = 1_000
DETAILED = 1_000  # detailed users (at most N / 10)
RUNNING = 64
RELOADS = 3
STEP_NS = 10_000_000
# Wall time between two steps while a reload is pending (the forward pass this bench has none of).
STEP_GAP_S = 0.002
TARGET_MS = 1.0
BEFORE_MS = {"reload_stall_ms": 194.0, "snapshot_stall_ms": 216.0}  # issue 32, at 100,000 users


def table_json(users: int, variant: int) -> str:
    """A rates file of ``users`` users on three plans (``variant`` changes the rates)."""
    plans = {
        "free": {"tokens_per_s": 20 + variant},
        "pro": {"tokens_per_s": 200 + variant},
        "trial": {"tokens_per_s": 50, "shadow": True},
        "internal": {"unlimited": True},
    }
    detailed = min(DETAILED, users // 10)
    entries: dict[str, Any] = {}
    for i in range(users):
        plan = ("free", "pro", "trial")[i % 3]
        entries[f"user-{i:06d}"] = {"plan": plan, "detailed": True} if i < detailed else plan
    for i in range(TABLE_PATTERNS):
        entries[f"team-{i:04d}/*"] = "internal" if i % 2 else "pro"
    return json.dumps({"default_plan": "free", "plans": plans, "users": entries})


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


class _Timed:
    """Wraps a bound method; adds the CPU time of this thread in each call (s) to ``last``
    (wall time on a shared machine counts other processes' load too)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method, self.last = method, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = _CPU()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.last += _CPU() - start


def _tables_harness(users: int, directory: str, path: str) -> Any:
    """The gate's in-process harness (fake clock) running the reference scheduler with the
    rates file ``path`` and the /metrics recorder on (writing under ``directory``, as an
    engine core's recorder), holding ``RUNNING`` decoding requests of table users (one in
    four a ``team-NNNN/svc`` pattern user). The metrics environment is restored after."""
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, Harness
    from vllm_output_rate.reference import metrics  # deferred: loads prometheus_client (~75 ms), off `outrate --help`

    saved = {k: os.environ.get(k) for k in (metrics.ENV_DIR, metrics.ENV_OWNER)}
    os.environ[metrics.ENV_DIR], os.environ[metrics.ENV_OWNER] = directory, "1"  # an engine core's recorder
    try:
        h = Harness(
            REFERENCE_SCHEDULER,
            EngineShape(
                max_num_seqs=RUNNING,
                max_num_batched_tokens=4 * RUNNING,
                num_blocks=RUNNING * 64,
                max_model_len=4096,
                output_rate={"default_tokens_per_s": 20, "rates_file": path},
            ),
        )
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    for i in range(RUNNING):
        user = f"user-{(i * users) // RUNNING:06d}" if i % 4 else f"team-{i:04d}/svc"
        h.add_request(f"r{i}", user, prompt_len=4, max_tokens=3000)
    return h


def _reload_rounds(
    scheduler: Any,
    step: Callable[[], tuple[float, float, float, bool]],
    path: str,
    users: int,
    reloads: int,
    base: float,
    tick: Callable[[], None],
) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """``reloads`` times: replace the rates file ``path`` by a changed table of ``users``
    users (R21) and ``step()`` until the scheduler's limiter holds the new table, then a
    metrics second (100 steps) more; ``tick()`` after each reload. ``step()`` returns
    (wall s, apply CPU s, metrics CPU s, snapshot due); ``base`` is the median step (wall s).

    Returns ``(reload_apply, reload_excess, latency, snapshot_in, snapshot_excess)``, in s:
    per reload the longest apply CPU time, the longest step's wall time over ``base`` (at
    least 0) and the wall time from the write to the table in force; per step with a
    snapshot due the metrics CPU time and the wall time over ``base``.
    Raises ``RuntimeError`` when a table is not in force 120 s after its file was written.
    """
    reload_apply: list[float] = []
    reload_excess: list[float] = []
    snapshot_in: list[float] = []
    snapshot_excess: list[float] = []
    latency: list[float] = []
    for r in range(reloads):
        limiter_table = scheduler.rate_limiter.table
        _write_atomically(path, table_json(users, r + 1))
        written = _WALL()
        worst_apply = worst_wall = 0.0
        while scheduler.rate_limiter.table is limiter_table:
            wall, applied, metric, due = step()
            worst_apply, worst_wall = max(worst_apply, applied), max(worst_wall, wall)
            if due:
                snapshot_in.append(metric)
                snapshot_excess.append(max(0.0, wall - base))
            if _WALL() - written > 120:
                raise RuntimeError(f"the table of {users} users was not in force 120 s after the file was written")
            # Between steps, as a real engine's forward pass would, leave the watcher thread
            # the interpreter: on a loaded machine a step loop that never yields runs past the
            # harness's step bound before the table is read (about 0.5 ms a step here).
            time.sleep(STEP_GAP_S)
        latency.append(_WALL() - written)
        reload_apply.append(worst_apply)
        reload_excess.append(max(0.0, worst_wall - base))
        for _ in range(100):  # a metrics second after the reload
            wall, _applied, metric, due = step()
            if due:
                snapshot_in.append(metric)
                snapshot_excess.append(max(0.0, wall - base))
        tick()
    return reload_apply, reload_excess, latency, snapshot_in, snapshot_excess


def measure_size(users: int, reloads: int, tick: Callable[[], None]) -> dict[str, Any]:
    """One size (module docstring); ``tick()`` after each reload."""
    directory = tempfile.mkdtemp(prefix="outrate-bench-tables-")
    path = os.path.join(directory, "rates.json")
    text = table_json(users, 0)
    _write_atomically(path, text)
    h = _tables_harness(users, directory, path)
    scheduler = h.scheduler
    recorder = scheduler._observation.metrics
    assert recorder is not None, "the bench needs the /metrics recorder"
    apply_timer = scheduler._apply_pending_rates = _Timed(scheduler._apply_pending_rates)
    metrics_timer = recorder.step = _Timed(recorder.step)

    def step() -> tuple[float, float, float, bool]:
        apply_timer.last = metrics_timer.last = 0.0
        due = h.clock.now_ns() >= recorder.next_ns
        start = _WALL()
        h.step()
        wall = _WALL() - start
        h.advance(STEP_NS)
        return wall, apply_timer.last, metrics_timer.last, due

    baseline = [step()[0] for _ in range(150)]
    base = statistics.median(baseline)
    reload_apply, reload_excess, latency, snapshot_in, snapshot_excess = _reload_rounds(
        scheduler, step, path, users, reloads, base, tick
    )
    recorder.flush()
    watcher = scheduler._limits.rates_watcher
    reload_in_step, watcher_chunk = max(reload_apply), watcher.pacer.longest
    snapshot_in_step = max(snapshot_in)
    writer_chunk = recorder.pacer.longest if recorder.pacer is not None else 0.0
    return {
        "users": users,
        "patterns": TABLE_PATTERNS,
        "file_bytes": len(text),
        "running": RUNNING,
        "reloads": reloads,
        "snapshots": len(snapshot_in),
        "baseline_step_ms": _ms(base),
        "reload_stall_ms": _ms(reload_in_step),
        "watcher_longest_chunk_ms": _ms(watcher_chunk),
        "reload_with_gil_wait_ms": _ms(reload_in_step + watcher_chunk),
        "snapshot_stall_ms": _ms(snapshot_in_step),
        "writer_longest_chunk_ms": _ms(writer_chunk),
        "snapshot_with_gil_wait_ms": _ms(snapshot_in_step + writer_chunk),
        "reload_step_excess_ms": _ms(statistics.median(reload_excess)),
        "snapshot_step_excess_ms": _ms(statistics.median(snapshot_excess)),
        "reload_s": round(statistics.median(latency), 3),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def measure_tables(quick: bool, tick: Callable[[], None]) -> dict[str, Any]:
    """Every size (``SIZES``), ``RELOADS`` reloads each (1 with ``quick``)."""
    reloads = 1 if quick else RELOADS
    rows = [measure_size(n, reloads, tick) for n in SIZES]
    return {"rows": rows, "target_ms": TARGET_MS, "before_at_100000_users": BEFORE_MS}


def tables_steps(quick: bool) -> int:
    """The progress bar's total: one tick per reload."""
    return len(SIZES) * (1 if quick else RELOADS)


def tables_table(result: dict[str, Any]) -> Any:
    """The printed table: one row per size, the stalls beside the target and the numbers
    issue 32 measured before (at 100,000 users)."""
    before = result["before_at_100000_users"]
    table = Table(
        title=(
            f"rate tables: what a schedule() spends on a reload and on a metrics second (ms; target <= "
            f"{result['target_ms']:g} at 100,000 users; before: {before['reload_stall_ms']:g} and "
            f"{before['snapshot_stall_ms']:g})"
        )
    )
    columns = (
        ("users", "users"),
        ("file KiB", "file_bytes"),
        ("reload_stall_ms", "reload_stall_ms"),
        ("ratio to before", None),
        ("watcher chunk", "watcher_longest_chunk_ms"),
        ("snapshot_stall_ms", "snapshot_stall_ms"),
        ("writer chunk", "writer_longest_chunk_ms"),
        ("step excess (wall) reload / snapshot", None),
        ("reload s", "reload_s"),
    )
    for name, _key in columns:
        table.add_column(name, justify="right")
    for row in result["rows"]:
        ratio = row["reload_stall_ms"] / before["reload_stall_ms"]
        table.add_row(
            f"{row['users']:,}",
            f"{row['file_bytes'] / 1024:,.0f}",
            f"{row['reload_stall_ms']:.3f}",
            f"{ratio:.4f}",
            f"{row['watcher_longest_chunk_ms']:.3f}",
            f"{row['snapshot_stall_ms']:.3f}",
            f"{row['writer_longest_chunk_ms']:.3f}",
            f"{row['reload_step_excess_ms']:.1f} / {row['snapshot_step_excess_ms']:.1f}",
            f"{row['reload_s']:.2f}",
        )
    return table
