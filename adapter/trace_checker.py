"""The online trace checker's one implementation (``TraceChecker``): trace lines checked one at a
time, per run (header) and per user, as ``adapter/trace_check.py`` describes (R2 window and
GCRA replay per user in O(1) memory, charge and refund accounting, throttled requests,
identity, clock, token counts against the engine's and the client's).

``TraceChecker.line()`` takes each line in file order; ``end()`` gives the ``TraceReport``
(``adapter/trace_report.py``). Also the request-id match between a vLLM engine id and the
client's id (``engine_id_matches``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any

from vllm_output_rate.adapter.trace_report import RequestSummary, RunReport, TraceReport, UserSummary, Violation
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.properties import R2Window, net_charges

ABORTED = "FINISHED_ABORTED"
MAX_VIOLATIONS = 200  # keep a broken trace's report readable
ENGINE_SUFFIX_LEN = 8  # vLLM's id = client id + "-" + 8 random characters


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


def _rate(text: Any) -> Fraction | None:
    """A trace's rate (an exact fraction string, tokens/s) as a Fraction; None: ``"unlimited"`` (R28)."""
    return None if text == "unlimited" else Fraction(text)


def _rate_of(header: Mapping[str, Any], user: str) -> Fraction | None:
    """``user``'s rate (tokens/s; None: unlimited) by the header's (or a rates line's) two
    rate keys, for a user no step line has stated a rate for (``user_rates``)."""
    overrides = header.get("user_tokens_per_s") or {}
    return _rate(overrides.get(user, header["default_tokens_per_s"]))


class _UserWindow:
    """Running R2 state of one user in one run: O(1) memory whatever the dispatch count.

    R2-window is ``spec.properties.R2Window`` (the running minimum of
    ``k * q * 10**9 - p * t_k``); R2-gcra keeps the spec limiter state holding this user's
    TAT. Each check stops at its first violation (one report per user and run). Both are
    replayed on a clock that never goes back: a dispatch stamped before the user's previous
    one (a trace whose clock went back, already reported as ``clock``) counts at the
    previous time, as R2's windows and the limiter are defined on a monotonic clock.
    """

    __slots__ = ("burst_ns", "count", "gcra", "gcra_ok", "last_ns", "rate", "user", "window", "window_ok")

    def __init__(self, user: str, rate: Fraction | None, burst_ns: int) -> None:
        self.user, self.rate, self.burst_ns = user, rate, burst_ns
        self.count = 0
        self.window: R2Window | None = R2Window(rate, burst_ns) if rate is not None else None  # None: unlimited
        self.window_ok = self.gcra_ok = True
        self.gcra = spec_limiter.EMPTY
        self.last_ns = 0

    def dispatch(self, now_ns: int) -> list[tuple[str, str]]:
        """Add the next dispatch (at ``now_ns``); returns the (rule, message) pairs it breaks."""
        assert self.window is not None and self.rate is not None, "an unlimited user (R28) is not replayed"
        now_ns = self.last_ns = max(now_ns, self.last_ns)  # the clock never goes back here
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
        # R27-R29: rates the step lines stated (``user_rates``) since the header or the last
        # rates line; and users holding a window when a rates line did not give their new
        # rate (a plan table): the change's time, applied when their rate is next stated.
        self.stated: dict[str, Fraction | None] = {}
        self.pending: dict[str, int] = {}

    def rate_of(self, user: str) -> Fraction | None:
        """``user``'s rate now (tokens/s; None: unlimited): as stated by a step line, else by
        the header or the last rates line."""
        if user in self.stated:
            return self.stated[user]
        return _rate_of(self.report.header, user)


class TraceChecker:
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
        complete = "table" not in change  # today's table, written whole: every user's rate
        listed = header["user_tokens_per_s"]
        for user in run.windows:
            if user is None:  # R21: no anonymous key here (R17 resolves every request's user)
                continue
            if complete or user in listed:
                TraceChecker.change_rate(run, user, _rate_of(header, user), now)
            else:
                run.pending[user] = now  # a plan table: its rate comes with its next line
        run.report.header = header
        run.stated = {}  # the writer states every user's rate again after a change
        run.report.rate_changes_ns.append(now)

    @staticmethod
    def change_rate(run: _Run, user: str, new: Fraction | None, now: int) -> None:
        """R21: ``user``'s rate becomes ``new`` at ``now``: its replayed lead kept in tokens
        (``limiter.change_rates``), its R2 window restarted; to or from unlimited (R28) it
        holds no lead (an unlimited user is never charged)."""
        window = run.windows[user]
        old = window.rate
        if old == new:
            return
        if old is not None and new is not None:
            window.gcra = spec_limiter.change_rates(window.gcra, _constant(old), _constant(new), now)
        else:
            window.gcra = spec_limiter.EMPTY
        window.rate = new
        window.window = R2Window(new, window.burst_ns) if new is not None else None
        run.report.users[user].rate = new

    def stated_rates(self, run: _Run, rec: dict) -> None:
        """R27-R29: the rates a step line states (``user_rates``), before its dispatches. A
        user with a change pending gets it at the change's time; any other user whose
        stated rate differs from the one replayed changed rate with no rates line (a
        violation), and is replayed at the stated rate from this step on."""
        for user, text in (rec.get("user_rates") or {}).items():
            rate = run.stated[user] = _rate(text)
            if user not in run.windows:
                continue
            when = run.pending.pop(user, None)
            if when is None and run.windows[user].rate != rate:
                self.fail(
                    "R21-rates",
                    f"rate stated {text} tok/s, replayed at {run.windows[user].rate} tok/s, with no rates line between",
                    run.index,
                    rec.get("step"),
                    user,
                )
            self.change_rate(run, user, rate, rec["now_ns"] if when is None else when)

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
        self.stated_rates(run, rec)
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
            summary = run.report.users[user] = UserSummary(user, run.rate_of(user))
            run.windows[user] = _UserWindow(user, summary.rate, run.burst_ns)
        summary.add(now, self.keep_dispatch_ns)
        if not limited:
            summary.would_throttle += 1
            return
        if run.windows[user].rate is None:
            return  # R28: an unlimited user's dispatches are counted, never limited
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
