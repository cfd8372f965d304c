"""The online checker: verify an engine-side event trace (``output_rate.trace_path``).

Pure Python, no vLLM: it reads the JSON lines written by ``reference/trace.py`` (live
engine, ``outrate serve``, a soak run) and checks, per run (header) and per user, every
invariant that a live engine exposes:

- ``R2-window``: sampling dispatches of one user in any closed window of W ns are at
  most ``spec.limiter.window_bound_tokens(W, rate, tau)``. Checked exactly over all
  windows in O(n): with dispatch k at time t_k and rate p/q, a window [t_i, t_j] breaks
  the bound iff ``A_j - A_i > tau * p`` with ``A_k = k * q * 10**9 - p * t_k``.
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

Request ids: vLLM appends ``-XXXXXXXX`` (8 random characters) to the id a client or
``vllm.LLM`` gave; ``completions`` may use either form.

Use ``check_trace(path)`` for a finished run, ``check_trace(path, partial=True)`` while
the engine still writes (an incomplete last line is ignored).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Mapping

from vllm_output_rate.spec import limiter as spec_limiter

NS_PER_S = 1_000_000_000
ABORTED = "FINISHED_ABORTED"
MAX_VIOLATIONS = 200  # keep a broken trace's report readable


@dataclass(frozen=True)
class Violation:
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
    """One user's sampling dispatches in one run (engine side)."""

    user: str
    rate: Fraction
    dispatch_ns: list[int] = field(default_factory=list)

    @property
    def dispatches(self) -> int:
        return len(self.dispatch_ns)

    @property
    def span_s(self) -> float | None:
        if len(self.dispatch_ns) < 2:
            return None
        return (self.dispatch_ns[-1] - self.dispatch_ns[0]) / NS_PER_S

    @property
    def engine_rate(self) -> float | None:
        """The article's measure on the engine clock: dispatches / (first-to-last span)."""
        span = self.span_s
        return self.dispatches / span if span else None


@dataclass
class RequestSummary:
    user: str | None = None
    sampled: int = 0
    preempted: bool = False
    status: str | None = None  # set when freed
    output_tokens: int | None = None


@dataclass
class RunReport:
    header: dict[str, Any]
    steps: int = 0
    users: dict[str, UserSummary] = field(default_factory=dict)
    requests: dict[str, RequestSummary] = field(default_factory=dict)
    max_limiter_users: int = 0
    max_running: int = 0
    first_ns: int | None = None
    last_ns: int | None = None

    @property
    def async_scheduling(self) -> bool:
        return bool(self.header.get("async_scheduling"))


@dataclass
class TraceReport:
    runs: list[RunReport]
    violations: list[Violation]
    ignored_partial_line: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [f"{len(self.runs)} run(s), {sum(r.steps for r in self.runs)} steps, "
                 f"{len(self.violations)} violation(s)"]
        for i, run in enumerate(self.runs):
            for u in sorted(run.users.values(), key=lambda s: s.user):
                rate = "-" if u.engine_rate is None else f"{u.engine_rate:.2f}"
                lines.append(f"  run {i} user {u.user}: limit {float(u.rate):g} tok/s, "
                             f"{u.dispatches} dispatches, engine rate {rate} tok/s")
        lines += [f"  {v}" for v in self.violations[:20]]
        return "\n".join(lines)


def engine_id_matches(engine_id: str, client_id: str) -> bool:
    """vLLM's internal id is the client's id plus ``-`` and 8 random characters."""
    if engine_id == client_id:
        return True
    base, sep, suffix = engine_id.rpartition("-")
    return bool(sep) and len(suffix) == 8 and base == client_id


def read_runs(lines: Iterable[str], partial: bool = False) -> tuple[list[tuple[dict, list[dict]]], list[str], bool]:
    """Split trace lines into runs ``(header, records)``; returns (runs, errors, ignored tail)."""
    runs: list[tuple[dict, list[dict]]] = []
    errors: list[str] = []
    lines = list(lines)
    ignored = False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if partial and number == len(lines) and not line.endswith("\n"):
                ignored = True  # still being written
                continue
            errors.append(f"line {number}: not JSON ({exc.msg})")
            continue
        if not isinstance(record, dict):
            errors.append(f"line {number}: not a JSON object")
        elif "header" in record:
            runs.append((record["header"], []))
        elif not runs:
            errors.append(f"line {number}: record before any header")
        else:
            runs[-1][1].append(record)
    return runs, errors, ignored


def _rate_of(header: Mapping[str, Any], user: str) -> Fraction:
    overrides = header.get("user_tokens_per_s") or {}
    return Fraction(overrides.get(user, header["default_tokens_per_s"]))


class _Checker:
    def __init__(self) -> None:
        self.violations: list[Violation] = []

    def fail(self, rule: str, message: str, run: int = 0, step: int | None = None, user: str | None = None) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(Violation(rule, message, run, step, user))

    def run(self, index: int, header: dict, records: list[dict]) -> RunReport:
        report = RunReport(header)
        burst_ns = int(header.get("burst_ns", spec_limiter.BURST_NS))
        last_ns: int | None = None
        last_step: int | None = None
        for rec in records:
            if "requests" not in rec:  # idle / shutdown line: finishes only
                self.finishes(report, rec.get("finished") or {})
                continue
            step, now = rec["step"], rec["now_ns"]
            if last_ns is not None and now < last_ns:
                self.fail("clock", f"now_ns {now} < previous {last_ns}", index, step)
            if last_step is not None and step != last_step + 1:
                self.fail("clock", f"step {step} after step {last_step}", index, step)
            last_ns, last_step = now, step
            report.steps += 1
            report.first_ns = now if report.first_ns is None else report.first_ns
            report.last_ns = now
            report.max_limiter_users = max(report.max_limiter_users, rec.get("limiter_users", 0))
            report.max_running = max(report.max_running, rec.get("running", 0))
            # Finishes listed here happened before this step was scheduled.
            self.finishes(report, rec.get("finished") or {})
            self.step(index, report, rec)
        for user in report.users.values():
            self.window_bound(index, user, burst_ns)
            self.gcra_replay(index, user, burst_ns)
        for rid, req in report.requests.items():
            if req.status is not None and req.status != ABORTED:
                self.token_bounds(index, report, rid, req.output_tokens, f"engine output tokens ({req.status})")
        return report

    def finishes(self, report: RunReport, finished: Mapping[str, Any]) -> None:
        for rid, info in finished.items():
            req = report.requests.setdefault(rid, RequestSummary())
            req.status, req.output_tokens = info.get("status"), info.get("output_tokens")

    def step(self, index: int, report: RunReport, rec: dict) -> None:
        step, now = rec["step"], rec["now_ns"]
        charges, refunds = rec.get("charges", []), rec.get("refunds", [])
        twice = [rid for rid, n in Counter(charges).items() if n > 1]
        if twice:
            self.fail("R7-once", f"charged more than once in one step: {twice}", index, step)
        refund_count = Counter(refunds)
        if any(n > 1 for n in refund_count.values()):
            self.fail("R9-refund", f"refunded more than once: {sorted(r for r, n in refund_count.items() if n > 1)}",
                      index, step)
        stray = sorted(set(refunds) - set(charges))
        if stray:
            self.fail("R9-refund", f"refund without a charge in this step: {stray}", index, step)
        sampled = set()
        per_user: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])  # [net charges, dispatches]
        for rid, info in rec["requests"].items():
            user = info.get("user")
            req = report.requests.setdefault(rid, RequestSummary())
            if req.user is None:
                req.user = user
            elif user is not None and user != req.user:
                self.fail("R17-identity", f"request {rid} changed user {req.user!r} -> {user!r}", index, step, user)
            if info.get("throttled") and (info.get("tokens", 0) > 0 or info.get("charged")):
                self.fail("R11-throttled", f"throttled request {rid} was scheduled "
                          f"({info.get('tokens')} tokens, charged={info.get('charged')})", index, step, user)
            if info.get("sampled"):
                sampled.add(rid)
                req.sampled += 1
                if user not in report.users:
                    report.users[user] = UserSummary(user, _rate_of(report.header, user))
                report.users[user].dispatch_ns.append(now)
                per_user[user][1] += 1
        for rid in rec.get("preempted", []):
            report.requests.setdefault(rid, RequestSummary()).preempted = True
        net = Counter(charges) - Counter(refunds)
        for rid, n in net.items():
            per_user[(rec["requests"].get(rid) or {}).get("user")][0] += n
        if set(net) != sampled:
            self.fail("R7/R9-accounting", f"charged-not-refunded {sorted(net)} != dispatched to sample "
                      f"{sorted(sampled)}", index, step)
        for user, (charged, dispatched) in per_user.items():
            if charged != dispatched:
                self.fail("R7/R9-accounting", f"charges - refunds = {charged} != {dispatched} sampling dispatches",
                          index, step, user)

    def window_bound(self, index: int, user: UserSummary, burst_ns: int) -> None:
        """R2 bound over every window [t_i, t_j] of dispatch times, exactly, in O(n)."""
        p, q = user.rate.numerator, user.rate.denominator
        unit, limit = q * NS_PER_S, burst_ns * p
        best_i, min_a = 0, None
        for j, t in enumerate(user.dispatch_ns):
            a = j * unit - p * t
            if min_a is None or a < min_a:
                best_i, min_a = j, a
            if a - min_a > limit:
                i = best_i
                window = t - user.dispatch_ns[i]
                bound = spec_limiter.window_bound_tokens(window, user.rate, burst_ns)
                self.fail("R2-window", f"{j - i + 1} sampling dispatches in a window of {window / 1e6:.3f} ms "
                          f"(bound {bound} at {float(user.rate):g} tok/s)", index, None, user.user)
                return

    def gcra_replay(self, index: int, user: UserSummary, burst_ns: int) -> None:
        state = spec_limiter.EMPTY
        for k, t in enumerate(user.dispatch_ns):
            state, granted = spec_limiter.try_take(state, user.user, user.rate, t, burst_ns)
            if not granted:
                self.fail("R2-gcra", f"dispatch #{k} at {t} ns not allowed by GCRA "
                          f"(TAT {float(state.tat_ns[user.user]):.0f} ns)", index, None, user.user)
                return

    def token_bounds(self, index: int, report: RunReport, rid: str, tokens: int | None, what: str) -> None:
        req = report.requests[rid]
        if tokens is None:
            return
        upper = tokens + 1 if report.async_scheduling else tokens
        if req.preempted and report.async_scheduling:
            upper = None  # an in-flight output of a preempted request may be dropped
        if req.sampled < tokens or (upper is not None and req.sampled > upper):
            expected = f"{tokens}" if upper == tokens else f"{tokens}..{upper if upper is not None else 'any'}"
            self.fail("tokens", f"request {rid}: {req.sampled} sampling dispatches, {what} {tokens} "
                      f"(expected {expected})", index, None, req.user)


def check_records(lines: Iterable[str], completions: Mapping[str, int] | None = None,
                  cancelled: Iterable[str] = (), partial: bool = False) -> TraceReport:
    """Check trace lines (see module docstring). ``completions``: client id -> completion tokens."""
    runs, errors, ignored = read_runs(lines, partial)
    checker = _Checker()
    for error in errors:
        checker.fail("format", error, len(runs) - 1 if runs else 0)
    reports = [checker.run(i, header, records) for i, (header, records) in enumerate(runs)]
    if completions:
        cancelled = set(cancelled)
        for client_id, tokens in completions.items():
            found = [(i, rid) for i, run in enumerate(reports) for rid in run.requests
                     if engine_id_matches(rid, client_id)]
            if len(found) != 1:
                checker.fail("tokens", f"client request {client_id!r}: {len(found)} engine requests match it")
                continue
            i, rid = found[0]
            run = reports[i]
            if client_id in cancelled or rid in cancelled:
                if run.requests[rid].sampled < tokens:
                    checker.fail("tokens", f"cancelled request {rid}: {run.requests[rid].sampled} sampling "
                                 f"dispatches < {tokens} tokens received", i, None, run.requests[rid].user)
            else:
                checker.token_bounds(i, run, rid, tokens, "client completion_tokens")
    return TraceReport(reports, checker.violations, ignored)


def check_trace(path: str | Path, completions: Mapping[str, int] | None = None,
                cancelled: Iterable[str] = (), partial: bool = False) -> TraceReport:
    """Check the trace file at ``path``; ``partial=True`` while the engine still writes it."""
    with open(path, encoding="utf-8") as f:
        return check_records(f.readlines(), completions, cancelled, partial)
