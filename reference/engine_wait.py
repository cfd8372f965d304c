"""The engine wait of the reference scheduler: when a step with work but no grants ends.

``EngineWait`` is the scheduler's collaborator for what the engine loop
(``reference/plugin.py``) asks between steps: R16's wait hint (the earliest instant a user
refused in the last step is granted again) and the operator log's next due line
(``oplog.py``), for which the loop also wakes while it waits for budget or idles.

Source: docs/SPEC.md R16; the operator log (issue 15).
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.reference.oplog import ThrottleLog
from vllm_output_rate.reference.step_record import StepRecord


def wait_hint_ns(limiter: Any, refused_users: set[str]) -> int | None:
    """R16: the earliest ready time (ns of the scheduler's clock) among ``refused_users``
    (``limiter.ready_at_ns``); None if none of them waits."""
    ready = [t for u in refused_users if (t := limiter.ready_at_ns(u)) is not None]
    return min(ready) if ready else None


class EngineWait:
    """R16 and the operator log for one scheduler (``host``).

    ``throttle_log``: the operator log of throttled users (None with the feature off);
    ``observed``: the last step's record (None before the first step), whose
    ``wait_hint_ns`` the engine waits on.
    """

    def __init__(self, host: Any) -> None:
        self.host = host
        self.throttle_log: ThrottleLog | None = None
        self.observed: StepRecord | None = None

    def step_done(self, step: StepRecord, limiter: Any) -> None:
        """R16: ``step`` is over: its wait hint, from ``limiter`` after the step's charges and refunds."""
        refused = step.refused_users
        step.wait_hint_ns = wait_hint_ns(limiter, refused) if refused else None
        self.observed = step

    def steady_step_done(self, step: StepRecord) -> bool:
        """R16 and the operator log for a steady step (nobody refused, nothing throttled):
        what ``step_done`` and ``log_step`` do, in O(1), unless the operator log's interval
        ends at the step's clock reading. True: done (no wait hint, the step observed);
        False: nothing done, the caller takes ``step_done`` and ``log_step``."""
        log = self.throttle_log
        assert log is not None, "the operator log is made with the limiter (or the shadow accounting)"
        if step.now_ns >= log.next_ns:
            return False
        self.observed = step  # its wait_hint_ns stays None: nobody was refused
        return True

    def next_ready_ns(self) -> int | None:
        """R16: earliest ready time among users refused in the last step, ns (None: none)."""
        observed = self.observed
        return None if observed is None else observed.wait_hint_ns

    def log_step(self, now_ns: int, throttled: Any, users: Any) -> None:
        """Operator log: count the step's ``throttled`` request ids (``users``: id -> user)."""
        log = self.throttle_log
        assert log is not None, "the operator log is made with the limiter (or the shadow accounting)"
        log.step(now_ns, throttled, users)

    def operator_log_due_ns(self) -> int | None:
        """Operator log (``oplog.py``): when the throttled-users line counted so far is due,
        in ns of ``clock_ns`` (None: nothing pending, or the feature off)."""
        log = self.throttle_log
        return None if log is None else log.due_ns()

    def flush_operator_log(self, now_ns: int | None = None) -> bool:
        """Operator log: write the throttled-users line if it is due at ``now_ns`` (ns of
        ``clock_ns``; default: now). True if a line was written."""
        log = self.throttle_log
        if log is None:
            return False
        return log.tick(self.host.clock_ns() if now_ns is None else now_ns)
