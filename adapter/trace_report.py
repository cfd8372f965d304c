"""The online trace checker's verdict (``adapter/trace_check.py``): ``TraceReport`` (every run
and every violation), with its per-run (``RunReport``), per-user (``UserSummary``: limit,
dispatches, busy periods, busy-period rate) and per-request (``RequestSummary``) records, and
the command-line rendering (``TraceReport.render``). Times ns, rates tokens/s.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.limiter import NS_PER_S


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
    rate: Fraction | None  # tokens/s; None: unlimited (R28)
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
                    f"  run {i} user {u.user}: limit {_limit(u.rate)}, "
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
                    f"  {str(u.user)[:24]:<24} {_limit(u.rate, ''):>11} {u.dispatches:>10} "
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


def _limit(rate: Fraction | None, unit: str = " tok/s") -> str:
    """A user's limit for the report: ``20 tok/s`` (``unit``), or ``unlimited`` (R28)."""
    return "unlimited" if rate is None else f"{float(rate):g}{unit}"
