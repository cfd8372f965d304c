"""The online checker: verify an engine-side event trace (``output_rate.trace_path``).

Pure Python, no vLLM: it reads the JSON lines written by ``reference/trace.py`` (live
engine, ``outrate serve``, a soak run) and checks, per run (header) and per user, every
invariant that a live engine exposes:

- ``R2-window``: sampling dispatches of one user in any closed window of W ns are at
  most ``spec.limiter.window_bound_tokens(W, rate, tau)``. Checked exactly over all
  windows in O(n) time and O(1) memory per user: with dispatch k at time t_k and rate
  p/q, a window [t_i, t_j] breaks the bound iff ``A_j - A_i > tau * p`` with
  ``A_k = k * q * 10**9 - p * t_k``, so a running minimum of A suffices.
- ``R2-gcra``: the user's dispatch sequence replayed through the exact spec limiter
  (``spec.limiter.try_take``) is granted at every dispatch. Charges refunded in the same
  step can only make the engine's own TAT higher, never lower, so this is sound.
- ``R7-once``: no request is charged twice in one step.
- ``R9-refund``: refunds are of this step's charges, each at most once.
- ``R7/R9-accounting``: per step, charged minus refunded == dispatched to sample.
- ``R11-throttled``: a throttled request is neither scheduled nor charged in that step.
- ``R17-identity``: a request keeps one user for its whole life.
- ``clock``: ``now_ns`` never goes back and steps count up.
- ``tokens``: for a request that finished (not aborted): engine output tokens ==
  sampling dispatches (sync); ``<= dispatches <= +1`` (async: one step may be in flight
  past a stop). A preempted request only needs dispatches >= outputs (async may drop
  the in-flight output). Given the client's ``completion_tokens`` (``completions``), the
  same bounds hold for every stream not cancelled, and for a cancelled one
  ``dispatches >= tokens received``.
- ``format``: a line that is not a JSON object, or a record before any header.

Every check is streaming: records are checked as they arrive and each violation is
reported once. ``TraceFollower(path)`` follows a file that the engine still writes
(``poll()`` reads only the bytes appended since the previous poll, ``finish()`` gives the
final verdict); ``check_trace(path)`` and ``check_records(lines)`` check a whole trace at
once with the same machinery. Memory is O(users + requests), plus one int per sampling
dispatch while dispatch times are kept (``UserSummary.dispatch_ns``, for plots).

Request ids: vLLM appends ``-XXXXXXXX`` (8 random characters) to the id a client or
``vllm.LLM`` gave; ``completions`` may use either form.

Rates are reported per run and per user, over the user's *busy periods*: a period starts
at the user's first sampling dispatch while it has no other request in the engine and
ends at its last dispatch before its last request is freed. Idle time between two client
runs against one engine therefore does not dilute the rate (a 100 tok/s user measured
over two 2 s bursts 20 s apart is ~100 tok/s, not ~18), and two engine runs (headers)
are never merged.

Command line (also ``outrate check-trace FILE``)::

    python -m vllm_output_rate.adapter.trace_check FILE [--partial]

prints every run's users (limit, dispatches, busy periods, busy seconds, rate) and every
violation, then one verdict line; exit 0 if every check passed, 1 on a violation or when
the file holds no run at all, 2 if the file cannot be read.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from vllm_output_rate.adapter.trace_checker import TraceChecker
from vllm_output_rate.adapter.trace_report import TraceReport

READ_CHUNK_BYTES = 1 << 20  # TraceFollower reads the file in pieces of at most this size


class TraceFollower:
    """Incremental checker of a trace file the engine is still appending to.

    Each ``poll()`` reads only the bytes appended since the previous one (a byte offset
    is kept; an unterminated last line stays unread until its newline arrives) and checks
    the new records: ``clock``, ``R7-once``, ``R9-refund``, ``R7/R9-accounting``,
    ``R11-throttled``, ``R17-identity`` per record, ``R2-window`` and ``R2-gcra`` per
    user with O(1) running state, ``tokens`` when a request is freed. A violation is
    listed once, when found, and stays in every later report (``report.violations[n:]``
    are those found after a report with ``n``).

    Memory: O(users + requests) across all runs, plus one int per sampling dispatch in
    ``UserSummary.dispatch_ns`` unless ``keep_dispatch_ns=False``.

    Args:
        path: the trace file (JSON lines, ``reference/trace.py``). It need not exist
            until the first ``poll()``.
        keep_dispatch_ns: keep every dispatch time (ns) for plots.
    """

    def __init__(self, path: str | Path, keep_dispatch_ns: bool = True) -> None:
        self.path = Path(path)
        self.offset = 0  # bytes of the file checked so far: always the end of a whole line
        self._checker = TraceChecker(keep_dispatch_ns)
        self._tail = b""  # unterminated bytes seen at the last read (re-read next time)
        self._done = False

    def poll(self) -> TraceReport:
        """Check the lines appended since the last poll; returns the report so far.

        The runs are live objects (later polls update them); the end-of-run checks of the
        run still being written wait for a new header or ``finish()``.

        Raises:
            FileNotFoundError / OSError: the file cannot be read.
            ValueError: the file is shorter than what was already checked (truncated or
                replaced).
            RuntimeError: after ``finish()``.
        """
        self._read()
        report = self._checker.report()
        report.ignored_partial_line = bool(self._tail.strip())
        return report

    def finish(
        self, completions: Mapping[str, int] | None = None, cancelled: Iterable[str] = (), partial: bool = False
    ) -> TraceReport:
        """Read the rest of the file and return the final verdict.

        The last line is checked even without its newline (``partial=True``: it is
        skipped if it is not JSON yet, ``ignored_partial_line``). Then the last run's
        end checks run and, given ``completions`` (client or engine request id ->
        completion tokens received) and ``cancelled`` (ids the client aborted), the
        ``tokens`` check of each client stream. The follower cannot be used after.

        Raises:
            the errors of ``poll()``.
        """
        self._read()
        self._done = True
        if self._tail:
            self._checker.line(self._tail.decode("utf-8", errors="replace"), partial_tail=partial)
            self.offset += len(self._tail)
            self._tail = b""
        return self._checker.end(completions, cancelled)

    def _read(self) -> None:
        if self._done:
            raise RuntimeError("TraceFollower.finish() was called already")
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset:
                raise ValueError(f"{self.path}: {size} bytes < {self.offset} already checked (truncated?)")
            f.seek(self.offset)
            carry = b""
            while chunk := f.read(READ_CHUNK_BYTES):
                data = carry + chunk
                cut = data.rfind(b"\n") + 1
                for text in data[:cut].decode("utf-8", errors="replace").split("\n")[:-1]:
                    self._checker.line(text)
                self.offset += cut
                carry = data[cut:]
        self._tail = carry


def check_records(
    lines: Iterable[str],
    completions: Mapping[str, int] | None = None,
    cancelled: Iterable[str] = (),
    partial: bool = False,
) -> TraceReport:
    """Check a whole trace given as lines (see module docstring for the rules).

    Args:
        lines: the trace's lines, each one JSON record (a trailing newline is optional).
        completions: client (or engine) request id -> completion tokens received.
        cancelled: ids of the streams the client aborted.
        partial: the engine still writes: an unterminated last line that is not JSON yet
            is skipped (``ignored_partial_line``) instead of reported.
    Returns:
        the ``TraceReport``; a malformed line is a ``format`` violation, never an error.
    """
    checker = TraceChecker()
    previous: str | None = None
    for text in lines:
        if previous is not None:
            checker.line(previous)
        previous = text
    if previous is not None:
        checker.line(previous, partial_tail=partial and not previous.endswith("\n"))
    return checker.end(completions, cancelled)


def check_trace(
    path: str | Path, completions: Mapping[str, int] | None = None, cancelled: Iterable[str] = (), partial: bool = False
) -> TraceReport:
    """Check the trace file at ``path`` at once; ``partial=True`` while the engine still writes it.

    Same as ``TraceFollower(path).finish(completions, cancelled, partial)``; arguments and
    result as ``check_records``. Raises ``OSError`` if the file cannot be read.
    """
    return TraceFollower(path).finish(completions, cancelled, partial)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_output_rate.adapter.trace_check FILE`` (and ``outrate check-trace FILE``).

    Prints the report (``TraceReport.render``) and returns the exit code: 0 every check
    passed, 1 a violation or no run in the file, 2 the file cannot be read.
    """
    parser = argparse.ArgumentParser(
        prog="python -m vllm_output_rate.adapter.trace_check",
        description="Check an engine-side event trace (output_rate.trace_path): per-run, per-user rates "
        "and every invariant; exit 1 on a violation.",
    )
    parser.add_argument("file", help="the trace file (JSON lines)")
    parser.add_argument(
        "--partial", action="store_true", help="the engine still writes the file: skip an unterminated last line"
    )
    args = parser.parse_args(argv)
    try:
        report = check_trace(args.file, partial=args.partial)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read trace {args.file}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.render(args.file)))
    return 0 if report.ok and report.runs else 1


if __name__ == "__main__":
    sys.exit(main())
