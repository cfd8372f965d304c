"""The engine-side event trace: one JSON line per ``schedule()`` (``output_rate.trace_path``).

Written by the reference scheduler only when ``additional_config["output_rate"]["trace_path"]``
is set; read by ``vllm_output_rate.adapter.trace_check`` (the online checker). Off, it
costs one attribute check per step.

File format (JSON lines, appended; one run = one header line followed by its records):

- header: ``{"header": {"version": 1, "pid", "scheduler", "async_scheduling",
  "default_tokens_per_s": "20", "user_tokens_per_s": {"u": "1/3"}, "burst_ns"}}`` --
  rates as exact fractions written as strings;
- step: ``{"step", "now_ns", "requests": {req_id: {"user", "tokens", "sampled", "charged",
  "refunded", "throttled"}}, "charges": [req_id...], "refunds": [req_id...],
  "preempted": [req_id...], "running", "waiting", "limiter_users", "finished": {req_id: {"status", "output_tokens"}}}``.
  ``requests`` holds every request scheduled, charged or throttled in the step;
  in shadow mode (header ``"shadow": true``, docs/SPEC.md Decision "Shadow mode")
  ``throttled`` is always false, ``charges`` are the shadow limiter's grants, and each
  request and the step carry ``would_throttle`` (the sampling dispatches an enforcing
  scheduler would have refused; every sampled request is charged or would-be throttled);
  ``charges``/``refunds`` are in call order (a duplicate would be a bug: R7/R9);
  ``finished`` lists the requests freed since the previous line (finished or aborted),
  with their output-token count at that moment; ``limiter_users`` is the number of users
  holding a TAT (R6 keeps it bounded);
  A step also carries ``"user_rates": {user: "200" | "unlimited"}`` for each of its users
  whose rate the trace has not stated since the header or the last rates line: the rate
  the engine's limiter applies to that user (a plan, a pattern, an unlimited user, R27-R29),
  which the header's two rate keys cannot say;
- rates (R21): ``{"rates": {"now_ns", "default_tokens_per_s", "user_tokens_per_s"}}`` --
  the rate table changed at ``now_ns`` (a rates-file reload), before that step's record;
- idle: ``{"now_ns", "finished": {...}}`` -- written when the scheduler runs out of
  requests, so the trace is complete whenever the engine is idle.

Writes are buffered; the file is flushed every ``FLUSH_INTERVAL_NS`` of scheduler time,
whenever the scheduler becomes idle, and at shutdown (``close``, also registered with
``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any, TextIO

FLUSH_INTERVAL_NS = 500_000_000  # flush at least every 0.5 s of steps
TRACE_VERSION = 1
_BUFFER_BYTES = 1 << 16


def _close_ref(ref: weakref.ref[TraceWriter]) -> None:
    writer = ref()
    if writer is not None:
        writer.close()


def rank_trace_path(path: str, vllm_config: Any) -> str:
    """The trace file of this engine: ``path`` for data-parallel rank 0 (and any engine
    without data parallelism), ``path.dp<k>`` for rank k > 0, so that each rank's scheduler
    writes its own file (R23-R26 share the budget between them).

    The rank is ``parallel_config.data_parallel_index``: vLLM runs the ranks of a dense
    model as independent engines with ``data_parallel_size`` reset to 1 and keeps the
    original rank only there (``data_parallel_rank`` for MoE ranks, which keep the size)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    rank = getattr(parallel, "data_parallel_index", None)
    if not isinstance(rank, int):
        rank = getattr(parallel, "data_parallel_rank", 0)
    return f"{path}.dp{rank}" if isinstance(rank, int) and rank > 0 else path


MAX_TRACED_USERS = 1024  # R21: rates of at most this many users in one rates line


class TraceWriter:
    """Appends the trace of one scheduler to ``path`` (see module docstring)."""

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: TextIO | None = open(path, "a", buffering=_BUFFER_BYTES, encoding="utf-8")
        self._dumps = json.JSONEncoder(separators=(",", ":")).encode
        self._last_flush_ns: int | None = None
        self.finished: dict[str, dict[str, Any]] = {}  # freed since the last line
        self.rated: set[str] = set()  # users whose rate a line stated since the header or the last change
        self._write(self._file, {"header": {"version": TRACE_VERSION, "pid": os.getpid(), **header}})
        self._file.flush()
        atexit.register(_close_ref, weakref.ref(self))

    def _write(self, file: TextIO, record: dict[str, Any]) -> None:
        file.write(self._dumps(record))
        file.write("\n")

    def note_freed(self, request_id: str, status: str, output_tokens: int) -> None:
        self.finished[request_id] = {"status": status, "output_tokens": output_tokens}

    def write_step(
        self,
        step: int,
        now_ns: int,
        requests: dict[str, dict[str, Any]],
        charges: Iterable[str],
        refunds: Iterable[str],
        preempted: list[str],
        running: int,
        waiting: int,
        limiter_users: int,
        extra: dict[str, Any] | None = None,
    ) -> None:
        file = self._file
        if file is None:
            return
        record = {
            "step": step,
            "now_ns": now_ns,
            "requests": requests,
            "charges": list(charges),
            "refunds": list(refunds),
            "preempted": preempted,
            "running": running,
            "waiting": waiting,
            "limiter_users": limiter_users,
            "finished": self.finished,
        }
        if extra:
            record.update(extra)
        self.finished = {}
        self._write(file, record)
        if self._last_flush_ns is None or now_ns - self._last_flush_ns >= FLUSH_INTERVAL_NS:
            file.flush()
            self._last_flush_ns = now_ns

    def new_user_rates(
        self, requests: Mapping[str, Mapping[str, Any]], rate_of: Callable[[str], Fraction | None]
    ) -> dict[str, str]:
        """R27-R29: the rate of each user of ``requests`` (a step's ``requests`` map) that no
        line has stated since the header or the last rates line, as ``user -> "200"``
        (tokens/s, an exact fraction) or ``"unlimited"`` (``rate_of`` returned None), now
        stated. O(requests)."""
        rated = self.rated
        new: dict[str, str] = {}
        for info in requests.values():
            user = info.get("user")
            if user is not None and user not in rated:
                rated.add(user)
                rate = rate_of(user)
                new[user] = "unlimited" if rate is None else str(rate)
        return new

    def rates_changed(self, now_ns: int, table: Any, holders: Iterable[str] = ()) -> None:
        """R21: the rate table changed at ``now_ns`` (before that step's record); rates as
        exact fraction strings, like the header's. Today's table (``RateTable.is_flat``) of
        at most ``MAX_TRACED_USERS`` users is written whole; a larger or plan table (R27)
        as its default, the rates of ``holders`` (the users holding a TAT: the ones whose
        lead the change rescales) and its size, so the line stays bounded (R28's unlimited
        users are listed as ``"unlimited"``)."""
        file = self._file
        if file is None:
            return
        if table.is_flat and len(table.user_rates) <= MAX_TRACED_USERS:
            users = {u: str(r) for u, r in table.user_rates.items()}
            extra: dict[str, Any] = {}
        else:
            users = {}
            for user in list(holders)[:MAX_TRACED_USERS]:
                rate = table.rate_of(user)
                users[user] = "unlimited" if rate is None else str(rate)
            extra = {"table": {"plans": len(table.plans), "users": len(table.exact), "patterns": len(table.prefixes)}}
        default = table.default_entry.rate
        record = {
            "now_ns": now_ns,
            "default_tokens_per_s": "unlimited" if default is None else str(default),
            "user_tokens_per_s": users,
            **extra,
        }
        self._write(file, {"rates": record})
        self.rated = set()  # every user's rate is stated again at its next line (the new table's)
        file.flush()

    def idle(self, now_ns: int) -> None:
        """The scheduler has no requests left: write pending finishes and flush."""
        file = self._file
        if file is None:
            return
        if self.finished:
            self._write(file, {"now_ns": now_ns, "finished": self.finished})
            self.finished = {}
        file.flush()
        self._last_flush_ns = now_ns

    def close(self) -> None:
        file = self._file
        if file is None:
            return
        try:
            if self.finished:
                self._write(file, {"now_ns": None, "finished": self.finished})
                self.finished = {}
            file.close()
        finally:
            self._file = None
