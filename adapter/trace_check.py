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
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.limiter import NS_PER_S
from vllm_output_rate.spec.properties import R2Window, net_charges

ABORTED = "FINISHED_ABORTED"
MAX_VIOLATIONS = 200  # keep a broken trace's report readable
READ_CHUNK_BYTES = 1 << 20  # TraceFollower reads the file in pieces of at most this size
ENGINE_SUFFIX_LEN = 8  # vLLM's id = client id + "-" + 8 random characters


@dataclass(frozen=True)
class Violation:
    """One broken invariant: ``rule`` (e.g. ``"R2-window"``), in run ``run`` (0-based
    header index), at trace step ``step`` (None: not tied to one step), for ``user``."""

    rule: str
    message: str
    run: int = 0
    step: int | None = None
    user: str | None = None

    def __str__(self) -> str:
        where = f"run {self.run}" + (f" step {self.step}" if self.step is not None else "")
        who = f" user {self.user!r}" if self.user is not None else ""
        return f"{self.rule}: {where}{who}: {self.message}"


@dataclass
class UserSummary:
    """One user's sampling dispatches in one run (engine side).

    ``dispatch_ns``: engine clock (ns) of every sampling dispatch, in trace order; left
    empty by ``TraceFollower(keep_dispatch_ns=False)``. ``dispatches`` and the first and
    last dispatch times are counted either way.
    """

    user: str
    rate: Fraction
    dispatch_ns: list[int] = field(default_factory=list)
    dispatches: int = field(init=False, default=0)
    first_dispatch_ns: int | None = field(init=False, default=None)
    last_dispatch_ns: int | None = field(init=False, default=None)
    busy_periods: int = field(init=False, default=0)  # see module docstring
    closed_busy_ns: int = field(init=False, default=0)  # summed spans of the closed periods
    period_first_ns: int | None = field(init=False, default=None)  # first dispatch of the open one
    would_throttle: int = field(init=False, default=0)  # shadow mode: dispatches over the limit

    def __post_init__(self) -> None:
        self.dispatches = len(self.dispatch_ns)
        if self.dispatch_ns:
            self.first_dispatch_ns, self.last_dispatch_ns = self.dispatch_ns[0], self.dispatch_ns[-1]
            self.busy_periods, self.period_first_ns = 1, self.dispatch_ns[0]

    def add(self, now_ns: int, keep: bool = True) -> None:
        """Count one sampling dispatch at ``now_ns``; ``keep``: also append it to ``dispatch_ns``."""
        if keep:
            self.dispatch_ns.append(now_ns)
        if self.first_dispatch_ns is None:
            self.first_dispatch_ns = now_ns
        if self.period_first_ns is None:
            self.period_first_ns = now_ns
            self.busy_periods += 1
        self.last_dispatch_ns = now_ns
        self.dispatches += 1

    def close_period(self) -> None:
        """The user has no request left in the engine: its open busy period ends."""
        if self.period_first_ns is not None and self.last_dispatch_ns is not None:
            self.closed_busy_ns += self.last_dispatch_ns - self.period_first_ns
            self.period_first_ns = None

    @property
    def busy_s(self) -> float:
        """Seconds of the busy periods (each from its first to its last dispatch), summed."""
        first, last = self.period_first_ns, self.last_dispatch_ns
        open_ns = 0 if first is None or last is None else last - first
        return (self.closed_busy_ns + open_ns) / NS_PER_S

    @property
    def busy_rate(self) -> float | None:
        """Dispatches per second of busy time (the article's measure per busy period, summed);
        None when no period holds two dispatches."""
        busy = self.busy_s
        return self.dispatches / busy if busy else None

    @property
    def span_s(self) -> float | None:
        """Seconds from the first to the last dispatch; None below two dispatches."""
        first, last = self.first_dispatch_ns, self.last_dispatch_ns
        if self.dispatches < 2 or first is None or last is None:
            return None
        return (last - first) / NS_PER_S

    @property
    def engine_rate(self) -> float | None:
        """The article's measure on the engine clock: dispatches / (first-to-last span)."""
        span = self.span_s
        return self.dispatches / span if span else None


@dataclass(slots=True)
class RequestSummary:
    """One engine request in one run: its user, sampling dispatches, and how it was freed."""

    user: str | None = None
    sampled: int = 0
    preempted: bool = False
    status: str | None = None  # set when freed
    output_tokens: int | None = None


@dataclass
class RunReport:
    """One run (one header line and its records); times are engine ns."""

    header: dict[str, Any]
    steps: int = 0
    users: dict[str, UserSummary] = field(default_factory=dict)
    requests: dict[str, RequestSummary] = field(default_factory=dict)
    max_limiter_users: int = 0
    max_running: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    rate_changes_ns: list[int] = field(default_factory=list)  # R21: engine ns of each rate change

    @property
    def async_scheduling(self) -> bool:
        return bool(self.header.get("async_scheduling"))

    @property
    def shadow(self) -> bool:
        """Shadow mode (docs/SPEC.md, Decision "Shadow mode"): nothing was throttled."""
        return bool(self.header.get("shadow"))


@dataclass
class TraceReport:
    """The checker's verdict: every run so far and every violation, each listed once.

    ``ignored_partial_line``: an unterminated last line was left unchecked (the engine
    is still writing it).
    """

    runs: list[RunReport]
    violations: list[Violation]
    ignored_partial_line: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [
            f"{len(self.runs)} run(s), {sum(r.steps for r in self.runs)} steps, {len(self.violations)} violation(s)"
        ]
        for i, run in enumerate(self.runs):
            for u in sorted(run.users.values(), key=lambda s: s.user):
                rate = "-" if u.busy_rate is None else f"{u.busy_rate:.2f}"
                lines.append(
                    f"  run {i} user {u.user}: limit {float(u.rate):g} tok/s, "
                    f"{u.dispatches} dispatches in {u.busy_periods} busy period(s) of "
                    f"{u.busy_s:.2f} s, {rate} tok/s"
                    + (f", {u.would_throttle} would be throttled (shadow)" if run.shadow else "")
                )
        lines += [f"  {v}" for v in self.violations[:20]]
        return "\n".join(lines)

    def render(self, source: str = "trace") -> list[str]:
        """The command-line report: per run, a header and one row per user; the violations;
        a verdict line last (``OK: ...`` or ``FAIL: ...``)."""
        lines = [
            f"{source}: {len(self.runs)} run(s), {sum(r.steps for r in self.runs)} steps, "
            f"{len(self.violations)} violation(s)"
        ]
        for i, run in enumerate(self.runs):
            h = run.header
            overrides = h.get("user_tokens_per_s") or {}
            span = (
                ""
                if run.first_ns is None or run.last_ns is None
                else f" over {(run.last_ns - run.first_ns) / NS_PER_S:.2f} s"
            )
            lines.append(
                f"run {i}: {h.get('scheduler', '?')} pid {h.get('pid', '?')}, "
                f"{'async' if run.async_scheduling else 'sync'}, default {h.get('default_tokens_per_s')} tok/s, "
                f"{len(overrides)} override(s), burst {int(h.get('burst_ns', spec_limiter.BURST_NS)) / 1e6:g} ms; "
                f"{run.steps} steps{span}, {len(run.requests)} requests"
                + (" (SHADOW mode: nothing throttled; R2 checked on the shadow limiter's grants)" if run.shadow else "")
            )
            if not run.users:
                lines.append("  no sampling dispatch")
                continue
            lines.append(
                f"  {'user':<24} {'limit tok/s':>11} {'dispatches':>10} {'busy periods':>12} {'busy s':>8} {'tok/s':>9}"
            )
            for u in sorted(run.users.values(), key=lambda s: s.user or ""):
                rate = "-" if u.busy_rate is None else f"{u.busy_rate:.2f}"
                lines.append(
                    f"  {str(u.user)[:24]:<24} {float(u.rate):>11g} {u.dispatches:>10} "
                    f"{u.busy_periods:>12} {u.busy_s:>8.2f} {rate:>9}"
                    + (f"  {u.would_throttle} would be throttled" if run.shadow else "")
                )
        if self.violations:
            lines.append("violations:")
            lines += [f"  {v}" for v in self.violations]
        if self.ignored_partial_line:
            lines.append("note: the unterminated last line was not checked (the engine is still writing it)")
        if self.violations:
            rules = Counter(v.rule for v in self.violations)
            shown = ", ".join(f"{rule} x{n}" for rule, n in sorted(rules.items()))
            lines.append(f"FAIL: {len(self.violations)} violation(s) ({shown})")
        elif not self.runs:
            lines.append(
                "FAIL: no run in the trace (no header line): nothing was checked; is it the file "
                "given as --trace-path / output_rate.trace_path?"
            )
        else:
            lines.append(f"OK: every check passed in {len(self.runs)} run(s)")
        return lines


def _base_id(engine_id: str) -> str | None:
    """The client id inside a vLLM engine id ``client-XXXXXXXX``, or None if none fits."""
    base, sep, suffix = engine_id.rpartition("-")
    return base if sep and len(suffix) == ENGINE_SUFFIX_LEN else None


def engine_id_matches(engine_id: str, client_id: str) -> bool:
    """vLLM's internal id is the client's id plus ``-`` and 8 random characters."""
    return engine_id == client_id or _base_id(engine_id) == client_id


def _constant(rate: Fraction) -> Callable[[str], Fraction]:
    """``user -> rate`` for one user's own rate (tokens/s), as ``spec.limiter.change_rates`` takes it."""
    return lambda _user: rate


def _rate_of(header: Mapping[str, Any], user: str) -> Fraction:
    overrides = header.get("user_tokens_per_s") or {}
    return Fraction(overrides.get(user, header["default_tokens_per_s"]))


class _UserWindow:
    """Running R2 state of one user in one run: O(1) memory whatever the dispatch count.

    R2-window is ``spec.properties.R2Window`` (the running minimum of
    ``k * q * 10**9 - p * t_k``); R2-gcra keeps the spec limiter state holding this user's
    TAT. Each check stops at its first violation (one report per user and run).
    """

    __slots__ = ("burst_ns", "count", "gcra", "gcra_ok", "rate", "user", "window", "window_ok")

    def __init__(self, user: str, rate: Fraction, burst_ns: int) -> None:
        self.user, self.rate, self.burst_ns = user, rate, burst_ns
        self.count = 0
        self.window = R2Window(rate, burst_ns)
        self.window_ok = self.gcra_ok = True
        self.gcra = spec_limiter.EMPTY

    def dispatch(self, now_ns: int) -> list[tuple[str, str]]:
        """Add the next dispatch (at ``now_ns``); returns the (rule, message) pairs it breaks."""
        broken = []
        k = self.count
        self.count += 1
        if self.window_ok:
            excess = self.window.add(now_ns)
            if excess is not None:
                self.window_ok = False
                broken.append(
                    (
                        "R2-window",
                        f"{excess.count} sampling dispatches in a window of "
                        f"{(excess.end_ns - excess.start_ns) / 1e6:.3f} ms (bound {excess.bound} at "
                        f"{float(self.rate):g} tok/s)",
                    )
                )
        if self.gcra_ok:
            self.gcra, granted = spec_limiter.try_take(self.gcra, self.user, self.rate, now_ns, self.burst_ns)
            if not granted:
                self.gcra_ok = False
                broken.append(
                    (
                        "R2-gcra",
                        f"dispatch #{k} at {now_ns} ns not allowed by GCRA "
                        f"(TAT {float(self.gcra.tat_ns[self.user]):.0f} ns)",
                    )
                )
        return broken


class _Run:
    """Streaming state of the run being read: clock, per-user R2 state, token re-checks."""

    def __init__(self, index: int, header: dict) -> None:
        self.index = index
        self.report = RunReport(header)
        self.burst_ns = int(header.get("burst_ns", spec_limiter.BURST_NS))
        self.last_ns: int | None = None
        self.last_step: int | None = None
        self.windows: dict[str | None, _UserWindow] = {}
        self.dirty: set[str] = set()  # freed, token-checked, then touched again: check at the end
        self.flagged: set[str] = set()  # token bounds found broken (reported once)
        self.live: dict[str, int] = {}  # user -> its requests seen and not yet freed (busy periods)


class _Checker:
    """The one implementation: checks trace lines one at a time (see module docstring).

    ``line()`` takes each line in file order; ``end()`` closes the checks of the last run
    and checks ``completions``. State: O(users + requests), no per-record objects.
    """

    def __init__(self, keep_dispatch_ns: bool = True) -> None:
        self.keep_dispatch_ns = keep_dispatch_ns
        self.violations: list[Violation] = []
        self.runs: list[RunReport] = []
        self.current: _Run | None = None
        self.line_number = 0
        self.ignored_partial_line = False

    # -- input ---------------------------------------------------------------------
    def fail(self, rule: str, message: str, run: int = 0, step: int | None = None, user: str | None = None) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(Violation(rule, message, run, step, user))

    def line(self, text: str, partial_tail: bool = False) -> None:
        """Check one line; ``partial_tail``: the unterminated last line of a file still written."""
        self.line_number += 1
        if not text.strip():
            return
        run = self.current.index if self.current is not None else 0
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if partial_tail:
                self.ignored_partial_line = True  # still being written
            else:
                self.fail("format", f"line {self.line_number}: not JSON ({exc.msg})", run)
            return
        if not isinstance(record, dict):
            self.fail("format", f"line {self.line_number}: not a JSON object", run)
        elif "header" in record:
            self.end_run()
            self.current = _Run(len(self.runs), record["header"])
            self.runs.append(self.current.report)
        elif self.current is None:
            self.fail("format", f"line {self.line_number}: record before any header", run)
        else:
            self.record(self.current, record)

    def report(self) -> TraceReport:
        return TraceReport(list(self.runs), list(self.violations), self.ignored_partial_line)

    # -- per record ----------------------------------------------------------------
    def record(self, run: _Run, rec: dict) -> None:
        report = run.report
        if "rates" in rec:  # R21: the rate table changed
            self.rates(run, rec["rates"])
            return
        if "requests" not in rec:  # idle / shutdown line: finishes only
            self.finishes(run, rec.get("finished") or {})
            return
        step, now = rec["step"], rec["now_ns"]
        if run.last_ns is not None and now < run.last_ns:
            self.fail("clock", f"now_ns {now} < previous {run.last_ns}", run.index, step)
        if run.last_step is not None and step != run.last_step + 1:
            self.fail("clock", f"step {step} after step {run.last_step}", run.index, step)
        run.last_ns, run.last_step = now, step
        report.steps += 1
        report.first_ns = now if report.first_ns is None else report.first_ns
        report.last_ns = now
        report.max_limiter_users = max(report.max_limiter_users, rec.get("limiter_users", 0))
        report.max_running = max(report.max_running, rec.get("running", 0))
        # Finishes listed here happened before this step was scheduled.
        self.finishes(run, rec.get("finished") or {})
        self.step(run, rec)

    @staticmethod
    def rates(run: _Run, change: Mapping[str, Any]) -> None:
        """R21: a rate change at ``change["now_ns"]``: each user whose rate changes keeps its
        replayed lead in tokens (``limiter.change_rates``, as the engine must), its R2 window
        restarts at the new rate (windows across the change are R21's piecewise bound), and
        its summary shows the new limit; users seen later get the new table."""
        now = int(change["now_ns"])
        header = {
            **run.report.header,
            "default_tokens_per_s": change["default_tokens_per_s"],
            "user_tokens_per_s": dict(change.get("user_tokens_per_s") or {}),
        }
        for user, window in run.windows.items():
            if user is None:  # R21: no anonymous key here (R17 resolves every request's user)
                continue
            old, new = window.rate, _rate_of(header, user)
            if old == new:
                continue
            window.gcra = spec_limiter.change_rates(window.gcra, _constant(old), _constant(new), now)
            window.rate, window.window = new, R2Window(new, window.burst_ns)
            run.report.users[user].rate = new
        run.report.header = header
        run.report.rate_changes_ns.append(now)

    def finishes(self, run: _Run, finished: Mapping[str, Any]) -> None:
        """Record freed requests and check the token bounds of those not aborted."""
        for rid, info in finished.items():
            req = run.report.requests.setdefault(rid, RequestSummary())
            if req.status is None and req.user is not None:
                left = run.live[req.user] = run.live.get(req.user, 1) - 1
                if left <= 0 and req.user in run.report.users:
                    run.report.users[req.user].close_period()  # the user is idle now
            req.status, req.output_tokens = info.get("status"), info.get("output_tokens")
            run.dirty.discard(rid)
            self.engine_tokens(run, rid)

    def engine_tokens(self, run: _Run, rid: str) -> None:
        req = run.report.requests[rid]
        if req.status is None or req.status == ABORTED or rid in run.flagged:
            return
        if not self.token_bounds(run.index, run.report, rid, req.output_tokens, f"engine output tokens ({req.status})"):
            run.flagged.add(rid)

    @staticmethod
    def touched(run: _Run, rid: str, req: RequestSummary) -> None:
        """A freed request changed again (a broken trace): re-check it at the end of the run."""
        if req.status is not None and req.status != ABORTED:
            run.dirty.add(rid)

    def step(self, run: _Run, rec: dict) -> None:
        index, report = run.index, run.report
        step = rec["step"]
        charges, refunds = rec.get("charges", []), rec.get("refunds", [])
        self.check_charge_lists(charges, refunds, index, step)
        sampled: set[str] = set()
        would: set[str] = set()
        per_user: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])  # [net charges, dispatches]
        for rid, info in rec["requests"].items():
            self.request_entry(run, rec, rid, info, sampled, would, per_user)
        for rid in rec.get("preempted", []):
            req = report.requests.setdefault(rid, RequestSummary())
            req.preempted = True
            self.touched(run, rid, req)
        net = net_charges(charges, refunds)
        for rid, n in net.items():
            per_user[(rec["requests"].get(rid) or {}).get("user")][0] += n
        if report.shadow:  # every dispatch is a shadow grant or a would-be throttle, never both
            if set(net) & would:
                self.fail(
                    "R7/R9-accounting",
                    f"shadow mode: charged and would-be throttled {sorted(set(net) & would)}",
                    index,
                    step,
                )
            sampled = sampled - would
        if set(net) != sampled:
            self.fail(
                "R7/R9-accounting",
                f"charged-not-refunded {sorted(net)} != dispatched to sample {sorted(sampled)}",
                index,
                step,
            )
        for user, (charged, dispatched) in per_user.items():
            if charged != dispatched:
                self.fail(
                    "R7/R9-accounting",
                    f"charges - refunds = {charged} != {dispatched} sampling dispatches",
                    index,
                    step,
                    user,
                )

    def check_charge_lists(self, charges: list[str], refunds: list[str], index: int, step: int) -> None:
        """R7/R9 on one step's lists: no request charged twice, none refunded twice, no
        refund without a charge in the same step."""
        twice = [rid for rid, n in Counter(charges).items() if n > 1]
        if twice:
            self.fail("R7-once", f"charged more than once in one step: {twice}", index, step)
        refund_count = Counter(refunds)
        if any(n > 1 for n in refund_count.values()):
            self.fail(
                "R9-refund",
                f"refunded more than once: {sorted(r for r, n in refund_count.items() if n > 1)}",
                index,
                step,
            )
        stray = sorted(set(refunds) - set(charges))
        if stray:
            self.fail("R9-refund", f"refund without a charge in this step: {stray}", index, step)

    def request_entry(
        self,
        run: _Run,
        rec: dict,
        rid: str,
        info: Any,
        sampled: set[str],
        would: set[str],
        per_user: dict[str | None, list[int]],
    ) -> None:
        """One request of a step record: its user (R17: never changes), R11 (a throttled
        request is not scheduled), and its sampling dispatch, replayed through R2 (added to
        ``sampled`` and ``per_user``) or, in shadow mode past the limit, to ``would``."""
        index, step, now = run.index, rec["step"], rec["now_ns"]
        user = info.get("user")
        req = run.report.requests.setdefault(rid, RequestSummary())
        if req.user is None:
            req.user = user
            if user is not None and req.status is None:
                run.live[user] = run.live.get(user, 0) + 1
        elif user is not None and user != req.user:
            self.fail("R17-identity", f"request {rid} changed user {req.user!r} -> {user!r}", index, step, user)
        if info.get("throttled") and (info.get("tokens", 0) > 0 or info.get("charged")):
            self.fail(
                "R11-throttled",
                f"throttled request {rid} was scheduled ({info.get('tokens')} tokens, charged={info.get('charged')})",
                index,
                step,
                user,
            )
        if info.get("sampled"):
            sampled.add(rid)
            req.sampled += 1
            self.touched(run, rid, req)
            if run.report.shadow and info.get("would_throttle"):
                # Shadow mode: dispatched although the limit was spent; not a grant, so it
                # is counted, not replayed through R2 (the shadow limiter's grants are).
                would.add(rid)
                self.dispatch(run, user, now, limited=False)
            else:
                self.dispatch(run, user, now)
                per_user[user][1] += 1

    def dispatch(self, run: _Run, user: str, now: int, limited: bool = True) -> None:
        """One sampling dispatch of ``user`` at ``now`` ns: summary, then R2-window and R2-gcra.

        ``limited`` False: a shadow-mode dispatch over the limit (counted, not checked by R2)."""
        summary = run.report.users.get(user)
        if summary is None:
            summary = run.report.users[user] = UserSummary(user, _rate_of(run.report.header, user))
            run.windows[user] = _UserWindow(user, summary.rate, run.burst_ns)
        summary.add(now, self.keep_dispatch_ns)
        if not limited:
            summary.would_throttle += 1
            return
        for rule, message in run.windows[user].dispatch(now):
            self.fail(rule, message, run.index, None, user)

    # -- end -----------------------------------------------------------------------
    def end_run(self) -> None:
        """The current run is over: re-check freed requests that changed after their check."""
        run, self.current = self.current, None
        if run is not None:
            for rid in run.report.requests:
                if rid in run.dirty:
                    self.engine_tokens(run, rid)

    def end(self, completions: Mapping[str, int] | None, cancelled: Iterable[str]) -> TraceReport:
        """Close the last run and check the client's ``completions`` (client id -> tokens)."""
        self.end_run()
        if completions:
            self.client_tokens(completions, set(cancelled))
        return self.report()

    def client_tokens(self, completions: Mapping[str, int], cancelled: set[str]) -> None:
        """tokens: each client stream matches one engine request whose dispatches fit its tokens.

        O(requests + clients): engine ids are indexed by themselves and by their client id.
        """
        by_client: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for i, run in enumerate(self.runs):
            for rid in run.requests:
                by_client[rid].append((i, rid))
                base = _base_id(rid)
                if base is not None:
                    by_client[base].append((i, rid))
        for client_id, tokens in completions.items():
            found = by_client.get(client_id, [])
            if len(found) != 1:
                self.fail("tokens", f"client request {client_id!r}: {len(found)} engine requests match it")
                continue
            i, rid = found[0]
            run = self.runs[i]
            req = run.requests[rid]
            if client_id in cancelled or rid in cancelled:
                if req.sampled < tokens:
                    self.fail(
                        "tokens",
                        f"cancelled request {rid}: {req.sampled} sampling dispatches < {tokens} tokens received",
                        i,
                        None,
                        req.user,
                    )
            else:
                self.token_bounds(i, run, rid, tokens, "client completion_tokens")

    def token_bounds(self, index: int, report: RunReport, rid: str, tokens: int | None, what: str) -> bool:
        """tokens: ``tokens`` outputs against the request's dispatches; False if broken."""
        req = report.requests[rid]
        if tokens is None:
            return True
        upper: int | None = tokens + 1 if report.async_scheduling else tokens
        if req.preempted and report.async_scheduling:
            upper = None  # an in-flight output of a preempted request may be dropped
        if req.sampled < tokens or (upper is not None and req.sampled > upper):
            expected = f"{tokens}" if upper == tokens else f"{tokens}..{upper if upper is not None else 'any'}"
            self.fail(
                "tokens",
                f"request {rid}: {req.sampled} sampling dispatches, {what} {tokens} (expected {expected})",
                index,
                None,
                req.user,
            )
            return False
        return True


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
        self._checker = _Checker(keep_dispatch_ns)
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
    checker = _Checker()
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
