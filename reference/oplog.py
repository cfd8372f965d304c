"""Operator logs of the output-rate feature: the limits in force, and who is throttled.

Two kinds of INFO lines, through vLLM's logger (``vllm.logger.init_logger``) under the name
``vllm.output_rate``, so they carry vLLM's format and process prefix (``(EngineCore
pid=...)``) and follow ``VLLM_LOGGING_LEVEL`` (a logger outside ``vllm.`` would have no
handler and INFO would be dropped):

- at start-up, once per scheduler (``limits_message``)::

    output-rate limiting on (RateLimitedScheduler): default 100 tok/s; 2 override(s):
    'user-a' 20 tok/s, 'user-b' 100 tok/s; burst 100 ms; active cap 16 of 64 resident
    requests (max_num_seqs); trace off

  or, with our class and no ``output_rate`` default (R18), ``output-rate limiting off ...``;
- while users are throttled, at most once per ``SUMMARY_INTERVAL_NS`` (10 s) of the
  scheduler's clock (``ThrottleLog``)::

    output-rate: 2 user(s) throttled in the last 10.0 s, by throttled request-steps:
    'user-a' 1834 (limit 20 tok/s), 'user-b' 12 (limit 100 tok/s)

  A *throttled request-step* is one running request skipped in one ``schedule()``
  because its user's budget was spent (R11). Nothing is logged in an interval without
  throttling. In shadow mode the line reads ``... user(s) WOULD BE throttled (shadow mode)
  ... by WOULD BE throttled request-steps``: sampling dispatches that an enforcing
  scheduler would have refused (tokens above the limit).

  The line is due when its interval ends, also when no ``schedule()`` runs then: while the
  engine waits for budget (R16) or has no requests left, the engine loop (the plugin's
  engine wait, ``reference/plugin.py``) wakes at ``due_ns()`` and calls ``tick``, so the
  last interval before a pause or an idle gap is logged on time, not when the next
  request arrives.

Cost on the scheduler's hot path: one method call per ``schedule()``; with requests
throttled, one C-level ``Counter.update`` over their ids. Formatting happens only when a
line is written. Memory: one counter per user throttled in the current interval.

Source: docs/SPEC.md "Configuration" (operator-visible behaviour).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from fractions import Fraction

from vllm.logger import init_logger

from vllm_output_rate.reference.section import OutputRateConfig

logger = init_logger("vllm.output_rate")

SUMMARY_INTERVAL_NS = 10_000_000_000  # at most one throttled-users line per 10 s
TOP_USERS = 5  # users named in a throttled-users line
NAMES_SHOWN = 5  # overrides named in the start-up line
NAME_CHARS = 40  # a user id is cut to this many characters in a log line


def shown_user(user: str | None) -> str:
    """A user id for a log line: its ``repr``, cut at ``NAME_CHARS`` characters."""
    text = repr(user)
    return text if len(text) <= NAME_CHARS else text[: NAME_CHARS - 3] + "..."


def shown_rate(rate: Fraction) -> str:
    """``20``, ``0.5`` or ``1/3``: a rate as exact as it was configured (R3)."""
    if rate.denominator == 1:
        return str(rate.numerator)
    as_float = float(rate)
    return repr(as_float) if Fraction(repr(as_float)) == rate else str(rate)


def limits_message(scheduler: str, config: OutputRateConfig, active_cap: int, max_num_seqs: int) -> str:
    """The start-up line: default, overrides (count, the first few named), burst, active cap."""
    overrides = config.user_rates
    assert config.default_rate is not None, "limits_message is for a configuration with the feature on (R18)"
    named = ", ".join(
        f"{shown_user(u)} {'unlimited' if r is None else shown_rate(r) + ' tok/s'}"
        for u, r in list(overrides.items())[:NAMES_SHOWN]
    )
    more = len(overrides) - NAMES_SHOWN
    users = (
        f"{len(overrides)} override(s)" + (f": {named}" if named else "") + (f" and {more} more" if more > 0 else "")
    )
    table = getattr(config, "rate_table", None)
    if table is not None and not table.is_flat:  # R27-R29: plans, patterns, unlimited users
        users = f"rate table: {table.describe()}"
    cap = (
        f"active cap {active_cap} of {max_num_seqs} resident requests (max_num_seqs)"
        if active_cap < max_num_seqs
        else f"active cap = max_num_seqs = {max_num_seqs} (throttled requests cannot give their place away)"
    )
    trace = f"trace {config.trace_path}" if config.trace_path else "trace off"
    if config.shadow:  # Decision "Shadow mode": nothing is throttled, the cap is not applied
        cap = (
            f"active cap {active_cap} of {max_num_seqs} not applied"
            if active_cap < max_num_seqs
            else f"max_num_seqs {max_num_seqs}"
        )
        return (
            f"output-rate limiting in SHADOW mode ({scheduler}): would-be throttles are counted and reported, "
            f"nothing is throttled; default {shown_rate(config.default_rate)} tok/s; {users}; "
            f"burst {config.burst_ns / 1_000_000:g} ms; {cap}; {trace}"
        )
    return (
        f"output-rate limiting on ({scheduler}): default {shown_rate(config.default_rate)} tok/s; {users}; "
        f"burst {config.burst_ns / 1_000_000:g} ms; {cap}; {trace}"
    )


def log_limits(scheduler: str, config: OutputRateConfig, active_cap: int, max_num_seqs: int) -> None:
    """Write the start-up line (feature on)."""
    logger.info("%s", limits_message(scheduler, config, active_cap, max_num_seqs))


def log_feature_off(scheduler: str) -> None:
    """Write the start-up line of our class with the feature off (R18)."""
    logger.info(
        'output-rate limiting off (%s): no additional_config["output_rate"]["default_tokens_per_s"]; '
        "the scheduler behaves exactly like vLLM's (R18)",
        scheduler,
    )


class ThrottleLog:
    """Counts throttled request-steps per user and logs the top users at most once per interval.

    ``step(now_ns, throttled, user_of)`` is called once per ``schedule()`` with the ids of
    the requests throttled in it and the request id -> user map.
    """

    __slots__ = ("counts", "interval_ns", "lines", "next_ns", "rate_of", "since_ns", "what")

    def __init__(
        self,
        rate_of: Callable[[str], Fraction | None],
        interval_ns: int = SUMMARY_INTERVAL_NS,
        shadow: bool = False,
    ) -> None:
        self.counts: Counter[str | None] = Counter()  # user -> throttled request-steps this interval
        self.next_ns = 0  # the first step only starts the interval
        self.since_ns: int | None = None
        self.interval_ns = interval_ns
        self.rate_of = rate_of
        self.lines = 0  # lines written (for tests)
        # Shadow mode: the counts are dispatches an enforcing scheduler would have refused.
        self.what = "WOULD BE throttled (shadow mode)" if shadow else "throttled"

    def step(self, now_ns: int, throttled: Collection[str], user_of: Mapping[str, str]) -> None:
        """One ``schedule()`` at ``now_ns``: count ``throttled``, and log if the interval is over."""
        if throttled:
            self.counts.update(map(user_of.get, throttled))
        if now_ns >= self.next_ns:
            self.flush(now_ns)

    def due_ns(self) -> int | None:
        """When the pending line is due (ns, the scheduler's clock): the end of the current
        interval if anyone was counted in it, else None (nothing to write)."""
        return self.next_ns if self.counts and self.since_ns is not None else None

    def tick(self, now_ns: int) -> bool:
        """Between ``schedule()`` calls (the engine waiting or idle) at ``now_ns``: write the
        pending line if it is due (``due_ns() <= now_ns``). Returns True if a line was written."""
        due = self.due_ns()
        if due is None or now_ns < due:
            return False
        self.flush(now_ns)
        return True

    def flush(self, now_ns: int) -> None:
        """Log the interval ending at ``now_ns`` (if anyone was throttled) and start the next.

        The first call only starts the first interval (what it counted belongs to it).
        """
        if self.since_ns is not None and self.counts:
            top = self.counts.most_common(TOP_USERS)
            parts = []
            for user, n in top:
                try:
                    rate = self.rate_of(user) if user is not None else None
                    limit = f"limit {shown_rate(rate)} tok/s" if rate is not None else "limit ?"
                except (KeyError, TypeError, ValueError):
                    limit = "limit ?"
                parts.append(f"{shown_user(user)} {n} ({limit})")
            rest = len(self.counts) - len(top)
            if rest > 0:
                parts.append(f"{rest} more user(s) {sum(self.counts.values()) - sum(n for _, n in top)}")
            logger.info(
                "output-rate: %d user(s) %s in the last %.1f s, by %s request-steps: %s",
                len(self.counts),
                self.what,
                (now_ns - self.since_ns) / 1e9,
                self.what.split(" (")[0],
                ", ".join(parts),
            )
            self.lines += 1
            self.counts.clear()
        self.since_ns = now_ns
        self.next_ns = now_ns + self.interval_ns
