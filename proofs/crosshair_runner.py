"""Running the CrossHair properties of ``crosshair_limiter.py`` in child processes
(``run_all``): CrossHair's tracer stays out of the caller's process, the properties are
shared out between ``jobs`` children by cost, records stream back as JSON lines, and a
wall-clock cap turns what is unfinished into ``unknown``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from vllm_output_rate.proofs.crosshair_check import DEFAULT_PER_CONDITION_TIMEOUT_S, CrossHairProperty
from vllm_output_rate.proofs.crosshair_limiter import BROKEN, BY_NAME, PROPERTIES
from vllm_output_rate.proofs.records import proof_record

# Wall-clock cap on a whole run_all() (seconds): unfinished properties become "unknown".
DEFAULT_WALL_TIMEOUT_S: float = 75.0


def _share_out(props: list[CrossHairProperty], jobs: int) -> list[list[CrossHairProperty]]:
    """Longest first, each to the least loaded child."""
    shares: list[list[CrossHairProperty]] = [[] for _ in range(jobs)]
    loads = [0.0] * jobs
    for prop in sorted(props, key=lambda p: -p.cost):
        i = loads.index(min(loads))
        shares[i].append(prop)
        loads[i] += prop.cost
    return [s for s in shares if s]


def run_all(
    per_condition_timeout: float = DEFAULT_PER_CONDITION_TIMEOUT_S,
    names: list[str] | None = None,
    include_broken: bool = False,
    jobs: int = 2,
    wall_timeout: float | None = DEFAULT_WALL_TIMEOUT_S,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Check properties in ``jobs`` child processes; one record per property, in catalogue
    order (see ``check_property``).

    ``names`` selects properties (default: all of ``PROPERTIES``, plus ``BROKEN`` if
    ``include_broken``). ``wall_timeout`` (seconds, None for none) caps the whole run:
    children still running then are killed and their unfinished properties reported
    ``unknown``. ``on_record`` is called with each record as soon as it arrives.
    """
    if names is None:
        props = list(PROPERTIES) + (list(BROKEN) if include_broken else [])
    else:
        props = [BY_NAME[n] for n in names]
    lines: queue.Queue = queue.Queue()
    start = time.monotonic()
    children = [_start_child(share, per_condition_timeout, lines) for share in _share_out(props, max(1, jobs))]
    deadline = None if wall_timeout is None else start + wall_timeout
    records, timed_out = _collect_records(lines, len(children), deadline, on_record)
    errors: list[str] = []
    for child in children:
        if child.poll() is None:
            child.kill()  # only the children started above, through their own handles
        _, err = child.communicate()
        if child.returncode not in (0, -9) and err:
            errors.append(err.strip().splitlines()[-1])
    elapsed = time.monotonic() - start
    why = (
        f"not finished within the {wall_timeout:g} s wall-clock cap"
        if timed_out
        else "checker process failed: " + ("; ".join(errors) or "no record")
    )
    out = []
    for prop in props:
        record = records.get(prop.name)
        if record is None:
            record = proof_record(
                prop.name,
                prop.rules,
                "crosshair",
                "unknown",
                round(elapsed, 3),
                conditions=[{"line": 0, "status": "unknown", "message": why}],
            )
            if on_record is not None:
                on_record(record)
        out.append(record)
    return out


def _start_child(share: list, per_condition_timeout: float, lines: queue.Queue) -> subprocess.Popen:
    """One checker process for the properties ``share``; a thread pumps its stdout lines
    into ``lines`` (then None when the stream closes)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm_output_rate.proofs.crosshair_limiter",
        "--per-condition-timeout",
        str(per_condition_timeout),
        "--only",
        *[p.name for p in share],
    ]
    child = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
    return child


def _collect_records(
    lines: queue.Queue, open_streams: int, deadline: float | None, on_record: Callable[[dict], None] | None
) -> tuple[dict[str, dict], bool]:
    """Read the JSON records of ``open_streams`` checker processes from ``lines`` until every
    stream closed or ``deadline`` (``time.monotonic()`` seconds; None: no limit) passed:
    ``(records by property name, True if the deadline cut it short)``."""
    records: dict[str, dict] = {}
    while open_streams:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            open_streams -= 1
            continue
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        records[record["name"]] = record
        if on_record is not None:
            on_record(record)
    return records, open_streams > 0


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put(None)
