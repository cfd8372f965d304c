"""Identity and limits of the reference scheduler: who a request is charged to, and at what rate.

``UserLimits`` is the scheduler's collaborator for R17 (each request's user, resolved once
at admission, and its R14/R15 group), the limiter it builds (R1-R5; R23-R26 with a shared
budget; R27-R29 with a rates file) and R21 (rate changes without a restart, applied at the
start of a ``schedule()`` only). ``user_of`` and ``group_key`` are the pure pieces.

Source: docs/SPEC.md R17, R21, R23-R29.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.identity import ANONYMOUS_USER, validate_extra_args
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.oplog import logger as oplog_logger
from vllm_output_rate.reference.ratesfile import RatesFileWatcher, RateTable
from vllm_output_rate.reference.ratesfile import describe as describe_rates
from vllm_output_rate.reference.section import OutputRateConfig, OutputRateConfigError
from vllm_output_rate.reference.shadow import ShadowAccounting
from vllm_output_rate.reference.shared_budget import SharedBudgetLimiter

logger = logging.getLogger("vllm_output_rate.reference.scheduler")


def group_key(user: str, priority: int) -> str:
    """R14/R15: the key of a (user, priority) group of streams, a str (its hash is cached)."""
    return f"{priority}\x1f{user}"


def user_of(request: Any) -> str:
    """R17: the rate-limit identity of a request (see ``identity.py``).

    Raises:
        ValueError: bad ``output_rate_user`` value, naming it.
    """
    params = request.sampling_params
    return validate_extra_args(params.extra_args if params is not None else None)


def resolve_user(request: Any) -> str:
    """R17 without raising: a bad identity is logged and charged to ``__anonymous__``."""
    try:
        return user_of(request)
    except ValueError as exc:
        logger.error("request %s: %s; charged to %s", request.request_id, exc, ANONYMOUS_USER)
        return ANONYMOUS_USER


class UserLimits:
    """R17, R21, R23-R29: requests' users and the limits in force, for one scheduler (``host``).

    ``users``: request id -> user (R17, resolved once, by the host's ``_resolve_user``);
    ``user_requests``: user -> requests in the scheduler (any state); ``groups``: request
    id -> ``group_key(user, priority)`` (R14/R15); ``requests_version``: counts every change
    of ``user_requests`` (a steady step compares it in O(1), ``Charging.spare_version``).
    R21: ``rates_watcher`` (the rates file, when set), ``pending_rates`` (a table queued by
    ``update_output_rates``, any thread, guarded by ``rates_lock``); R29: ``plan_shadow``,
    the shadow accounting of shadow plans.
    """

    def __init__(self, host: Any, config: OutputRateConfig) -> None:
        self.host = host
        self.users: dict[str, str] = {}
        self.user_requests: dict[str, int] = {}
        self.requests_version = 0
        self.groups: dict[str, str] = {}
        self.rates_watcher: RatesFileWatcher | None = (
            RatesFileWatcher(config.rates_file, burst_ns=config.burst_ns) if config.rates_file else None
        )
        if self.rates_watcher is not None:
            self.rates_watcher.prime(config.rate_table)  # the start-up table is in force
            self.rates_watcher.start_thread()  # with a large file, its reader process starts now, not in a step
        self.plan_shadow: ShadowAccounting | None = None
        self.pending_rates: RateTable | None = None
        self.rates_lock = threading.Lock()

    # -- R17 ------------------------------------------------------------------
    def user(self, request: Any) -> str:
        """R17: ``request``'s user (resolved and remembered on first sight)."""
        user = self.users.get(request.request_id)
        if user is None:
            user = self.remember(request)
        return user

    def remember(self, request: Any) -> str:
        """R17: resolve ``request``'s user once and cache it with its R14 group key."""
        user = self.users[request.request_id] = self.host._resolve_user(request)
        self.groups[request.request_id] = group_key(user, request.priority)
        self.user_requests[user] = self.user_requests.get(user, 0) + 1
        self.requests_version += 1
        return user

    def forget(self, request_id: str) -> None:
        """R17: ``request_id`` left the scheduler (freed): drop its user and group."""
        user = self.users.pop(request_id, None)
        if user is not None:
            self.requests_version += 1
            left = self.user_requests[user] - 1
            if left:
                self.user_requests[user] = left
            else:
                del self.user_requests[user]
        self.groups.pop(request_id, None)

    # -- the limiter ---------------------------------------------------------
    def make_limiter(self, cfg: OutputRateConfig) -> OutputRateLimiter:
        """R1-R5: the feature on's limiter; R23-R26 with ``shared_budget_url`` (one budget per
        user across engines), else R27-R29 (the rates file's table when there is one)."""
        if cfg.shared_budget_url is not None:
            host = self.host
            return SharedBudgetLimiter(
                cfg.default_rate,
                cfg.user_rates,
                cfg.burst_ns,
                url=cfg.shared_budget_url,
                clock_ns=lambda: host.clock_ns(),
            )
        limiter = OutputRateLimiter(cfg.default_rate, cfg.user_rates, cfg.burst_ns, table=cfg.rate_table)
        self.plan_shadow_for(limiter.table)
        return limiter

    # -- R21: a rate change without a restart ---------------------------------
    def queue_rates(self, default_tokens_per_s: object, user_tokens_per_s: dict[str, object]) -> None:
        """R21: validate (as at start-up, tokens/s) and queue a new flat rate table.

        Raises:
            OutputRateConfigError: the feature is off (R18: a change cannot turn it on), or
                a bad rate (naming the user and value).
        """
        if not self.host.output_rate_config.enabled:
            raise OutputRateConfigError(
                "update_output_rates: output-rate limiting is off for this engine (no default_tokens_per_s at "
                "start-up); a rate change cannot turn it on: restart with a default rate"
            )
        config = parse_output_rate(
            {"default_tokens_per_s": default_tokens_per_s, "user_tokens_per_s": user_tokens_per_s}
        )
        assert config.default_rate is not None
        table = RateTable.flat(config.default_rate, dict(config.user_rates))
        table.prepare(self.host.output_rate_config.burst_ns)
        with self.rates_lock:
            self.pending_rates = table

    def apply_pending_rates(self, now_ns: int) -> None:
        """R21: install a queued table or a changed rates file at ``now_ns`` (the start of
        ``schedule()``): each user keeps its lead in tokens (``OutputRateLimiter.install``),
        the spare-grant bounds of the charging survey are dropped (they were for the old
        rates), and the log, the metrics' limit gauges and the trace learn the new table.

        O(users holding a TAT + labels), whatever the table's size: the table was read,
        validated and prepared (scales, labels, log line) off the step (``RatesFileWatcher``;
        ``RateTable.prepare``), so installing it is a swap."""
        table = self.rates_watcher.poll() if self.rates_watcher is not None else None
        if self.pending_rates is not None:
            with self.rates_lock:
                table, self.pending_rates = self.pending_rates, None
        if table is None:
            return
        host = self.host
        observer = host._observation
        if host.rate_limiter is not None:
            limiter = host.rate_limiter
        else:  # R21 in shadow mode: the shadow limiter's rates
            assert observer.shadow is not None
            limiter = observer.shadow.limiter
        if self.shared_budget_refuses(table):
            return
        cfg = host.output_rate_config
        prepared = table.prepare(cfg.burst_ns)
        changed = limiter.install(prepared.for_view(limiter.shadow_view), now_ns)
        if host.rate_limiter is not None:
            host._charging.forget_spare()  # lower bounds at the old rates
            self.plan_shadow_for(table, now_ns)  # R29
        default = table.default_rate if table.default_rate is not None else cfg.default_rate
        host.output_rate_config = replace(cfg, default_rate=default, user_rates=table.user_rates, rate_table=table)
        observer.rates_changed(now_ns, table, limiter)
        oplog_logger.info(
            "output-rate limits changed without a restart (R21): %s; %d user(s) rescaled, lead kept in tokens",
            describe_rates(table),
            changed,
        )
        if self.rates_watcher is not None:  # the replaced table is emptied off the step
            shadow = self.plan_shadow.limiter.replaced if self.plan_shadow is not None else ()
            self.rates_watcher.retire(*limiter.replaced, *shadow)

    def shared_budget_refuses(self, table: RateTable) -> bool:
        """R23-R26 keep one rate per user in the store: a plan table (R27-R29) is refused
        (logged; the limits in force are kept)."""
        cfg = self.host.output_rate_config
        if cfg.shared_budget_url is None or table.is_flat:
            return False
        oplog_logger.error(
            "output-rate: rates file %s: plans, patterns and unlimited users (R27-R29) are not supported with "
            "shared_budget_url; the limits in force are kept (write default_tokens_per_s and user_tokens_per_s only)",
            cfg.rates_file,
        )
        return True

    def plan_shadow_for(self, table: Any, now_ns: int = 0) -> None:
        """R29: the shadow accounting of the table's shadow plans (None without one). Its
        limiter counts only shadow plans' users (the enforcing limiter has them unlimited)."""
        if not table.has_shadow:
            self.plan_shadow = None
            return
        cfg = self.host.output_rate_config
        prepared = table.prepare(cfg.burst_ns).shadow
        if self.plan_shadow is None:
            self.plan_shadow = ShadowAccounting(
                cfg, self.host._resolve_user, only_shadow_plans=table, prepared=prepared
            )
        else:
            self.plan_shadow.only_shadow_plans = table
            self.plan_shadow.limiter.install(prepared, now_ns)
