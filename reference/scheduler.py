"""``RateLimitedScheduler``: per-user output-rate limiting inside stock vLLM 0.32.0 and 0.33.0.

Subclasses of vLLM's ``Scheduler`` and ``AsyncScheduler`` that add the rules of
docs/SPEC.md without copying vLLM code. ``schedule()`` is wrapped, and three hooks that
vLLM's own loops call are overridden:

- ``_reserve_prefill_lookahead`` -- the last cap on ``num_new_tokens`` in both the running
  and the waiting loop, called once per (step, request) reaching that point. Here the
  sampling decision is made: charge (R7), refuse and skip (R11), or cap a prefill at
  position n-1 (R10); and the active cap of the running loop (R12) is applied.
- ``_handle_blocked_waiting_request`` -- called for each waiting request the waiting loop
  looks at. A request whose user is refused and that cannot advance without sampling is
  skipped here, so it never stops admission of later waiting requests (R10).
- ``max_num_active_reqs`` -- read by the waiting loop as its admission cap; computed so
  that throttled requests do not count (R12).

After ``super().schedule()`` returns, the single refund point (R9) refunds every charge
whose request was not dispatched to sample.

R13 (preferred victims): for the duration of ``super().schedule()`` the requests throttled
at the step start sit at the end of ``running`` (FCFS victims are ``running[-1]``); under
PRIORITY, ``kv_cache_manager.allocate_slots`` is wrapped so that a failed allocation of a
running request first preempts a throttled request of vLLM's victim priority level.

R14 (turns) and R19 (not binding = stock): ``running`` is never reordered, since vLLM spends
the token budget in its order. A separate turn order (``_take_turns``, kept between steps)
decides only which decoding streams of a user whose grants do not cover them all get the
grants; the others are throttled at the step start (``_move_throttled_last``, ``_held``).

Source: docs/SPEC.md "The scheduler rules (R7-R19)", R20, R21 and "Decisions".
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from itertools import filterfalse
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.reference.config import check_engine_supported, parse_output_rate
from vllm_output_rate.reference.identity import ANONYMOUS_USER, validate_extra_args
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.metrics import MetricsRecorder
from vllm_output_rate.reference.oplog import ThrottleLog, log_feature_off, log_limits
from vllm_output_rate.reference.oplog import logger as oplog_logger
from vllm_output_rate.reference.ratesfile import RatesFileWatcher, RateTable
from vllm_output_rate.reference.ratesfile import describe as describe_rates
from vllm_output_rate.reference.section import OutputRateConfig, OutputRateConfigError
from vllm_output_rate.reference.shadow import ShadowAccounting
from vllm_output_rate.reference.trace import TraceWriter, rank_trace_path
from vllm_output_rate.reference.vllm_compat import INSTALLED_PROFILE
from vllm_output_rate.spec.versions import VllmVersionProfile

CLEANUP_INTERVAL_STEPS = 256  # R6
# Where the installed vLLM release differs near the hooks (docs/SPEC.md "vLLM versions"):
# the zero-token stop of the waiting loop (V8) and the LoRA count of its max_loras check.
VLLM_PROFILE: VllmVersionProfile = INSTALLED_PROFILE
_RUNNING = RequestStatus.RUNNING
_REQUEST_ID = operator.attrgetter("request_id")
_IS_PREFILL_CHUNK = operator.attrgetter("is_prefill_chunk")
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
logger = logging.getLogger(__name__)
# The mixin is only ever combined with vLLM's Scheduler (the two classes at the end), whose
# attributes (running, waiting, requests, scheduler_config, ...) and methods it uses and
# overrides; the type checker is told so, the runtime class stays a plain mixin.
if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerHost
else:
    _SchedulerHost = object


def group_key(user: str, priority: int) -> str:
    """R14/R15: the key of a (user, priority) group of streams, a str (its hash is cached)."""
    return f"{priority}\x1f{user}"


def user_of(request: Request) -> str:
    """R17: the rate-limit identity of a request (see ``identity.py``).

    Raises:
        ValueError: bad ``output_rate_user`` value, naming it.
    """
    params = request.sampling_params
    return validate_extra_args(params.extra_args if params is not None else None)


def _decoding(r: Request) -> bool:
    """R10/R14: only the sampling position is left (a decoding stream), and its last output
    is not already in flight (V3)."""
    return (
        r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - 1
        and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
    )


class _RateLimitMixin(_SchedulerHost):
    """The rules R6-R18 layered on a vLLM V1 scheduler class (see module docstring)."""

    # The per-step shortcuts: the unconstrained step (no user can be refused: the hook only
    # records charges, counted per user once), the turn order kept between steps
    # (``_turns_hold``), the all-served R15 store, the in-place restore of ``running`` and
    # the hook's skip of requests throttled at the step start. Each decides exactly what
    # the general path decides (tests/test_shortcuts.py runs both step by step); False
    # (on a subclass or an instance) takes the general path everywhere.
    shortcuts: bool = True

    # -- construction ---------------------------------------------------------
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Parsed and checked before vLLM builds anything (KV manager, connectors): a bad or
        # unsupported configuration stops start-up with one message saying what to change.
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        additional = vllm_config.additional_config or {}
        output_rate_config = parse_output_rate(additional.get("output_rate") if isinstance(additional, dict) else None)
        if output_rate_config.enabled:  # R18: feature off, no checks at all
            check_engine_supported(vllm_config)
        super().__init__(*args, **kwargs)
        self._init_config_state(output_rate_config)
        if not self.output_rate_config.enabled:
            log_feature_off(type(self).__name__)  # operator log only; behaviour is the base's
            return  # R18: feature off, every override below defers to the base class
        if self.output_rate_config.shadow:
            self._start_shadow()  # Decision "Shadow mode": every override defers as with R18
            return
        cfg = self.output_rate_config
        self._init_limiter(cfg)
        self._init_metrics(cfg)
        self._init_bookkeeping()
        self._init_rotation_state()
        self._steps = 0
        self._reset_step_state(0)
        if cfg.trace_path is not None:
            self._open_trace(cfg.trace_path)
        if self.policy == SchedulingPolicy.PRIORITY:
            # R13: vLLM picks a PRIORITY victim inside schedule() right after a failed
            # allocate_slots; wrapping it lets a throttled request of that level go first.
            self._base_allocate_slots = self.kv_cache_manager.allocate_slots
            self.kv_cache_manager.allocate_slots = self._allocate_slots_throttled_victims_first

    def _init_config_state(self, output_rate_config: OutputRateConfig) -> None:
        """The state every mode has (feature off, shadow, on): the parsed configuration, the
        clock (R16), empty limiter/trace/log/metrics slots, the R20 cap and the R21 rate
        watcher (opened here when ``rates_file`` is set)."""
        self.output_rate_config: OutputRateConfig = output_rate_config
        # R16: the only clock; the gate replaces it with its fake clock.
        self.clock_ns: Callable[[], int] = time.monotonic_ns
        self.rate_limiter: OutputRateLimiter | None = None
        self._trace: TraceWriter | None = None  # engine-side event trace (reference/trace.py)
        # vLLM's _reserve_prefill_lookahead changes a chunk only for an MTP drafter looking
        # ahead more than one token (speculative decoding, refused with the feature on);
        # otherwise it only clamps at 0, which the hot path below does itself.
        self._base_lookahead = not output_rate_config.enabled or self.num_prefill_lookahead > 1
        self._hook_fast = False  # see _reserve_prefill_lookahead
        self._record_only = False  # see _reserve_prefill_lookahead
        self._throttle_log: ThrottleLog | None = None  # operator log of throttled users (oplog.py)
        # R20: resident (running) requests one user may hold; None: no cap (the default).
        self._per_user_cap: int | None = (
            output_rate_config.max_num_seqs_per_user if output_rate_config.enabled else None
        )
        self._shadow: ShadowAccounting | None = None  # shadow mode (reference/shadow.py)
        self._metrics: MetricsRecorder | None = None  # /metrics snapshot (reference/metrics.py)
        self._step_taken: dict[str, int] = {}  # user -> charges of the last step (for the metrics)
        # R21: rate changes without a restart, applied at the start of schedule() only.
        self._rates_watcher: RatesFileWatcher | None = (
            RatesFileWatcher(output_rate_config.rates_file, burst_ns=output_rate_config.burst_ns)
            if output_rate_config.rates_file
            else None
        )
        if self._rates_watcher is not None:
            self._rates_watcher.prime(output_rate_config.rate_table)  # the start-up table is in force
            self._rates_watcher.start_thread()  # with a large file, its reader process starts now, not in a step
        self._plan_shadow: ShadowAccounting | None = None  # R29: would-be throttles of shadow plans
        self._pending_rates: RateTable | None = None  # queued by update_output_rates (any thread)
        self._rates_lock = threading.Lock()

    def _init_limiter(self, cfg: OutputRateConfig) -> None:
        """The feature on: the limiter (R1-R5; R23-R26 with ``shared_budget_url``), the active
        cap (R12), the operator log of the limits, and the throttle log."""
        if cfg.shared_budget_url is not None:  # R23-R26: one budget per user across engines
            from vllm_output_rate.reference.shared_budget import SharedBudgetLimiter

            self.rate_limiter = SharedBudgetLimiter(
                cfg.default_rate,
                cfg.user_rates,
                cfg.burst_ns,
                url=cfg.shared_budget_url,
                clock_ns=lambda: self.clock_ns(),
            )
        else:  # R27-R29: the rates file's table when there is one
            self.rate_limiter = OutputRateLimiter(cfg.default_rate, cfg.user_rates, cfg.burst_ns, table=cfg.rate_table)
            self._plan_shadow_for(self.rate_limiter.table)
        # R12: with the feature on, max_num_active_seqs means "requests in a step's batch".
        self._active_cap = min(
            cfg.max_num_active_seqs or self.scheduler_config.max_num_active_seqs or self.max_num_running_reqs,
            self.max_num_running_reqs,
        )
        # R12 needs the set of running requests given tokens only if the cap can bind.
        self._cap_binds = self._active_cap < self.max_num_running_reqs
        log_limits(type(self).__name__, cfg, self._active_cap, self.max_num_running_reqs)  # operator log
        self._throttle_log = ThrottleLog(self.rate_limiter.rate_of)

    def _init_metrics(self, cfg: OutputRateConfig) -> None:
        """The /metrics snapshot (``reference/metrics.py``), written once at start-up so the
        limits and the shadow flag show before the first request; None unless the front end
        set its directory."""
        self._metrics = MetricsRecorder.from_env(cfg)
        if self._metrics is not None:
            self._metrics.write(self.clock_ns())

    def _init_bookkeeping(self) -> None:
        """The hook's short path and the per-request bookkeeping: users (R17), requests per
        user, and the spare grants ``_survey_users`` reads."""
        # The hook's short path: the active cap cannot bind, vLLM's hook only clamps at 0,
        # and ``_samples`` (R7) is ours, so it can be inlined.
        self._hook_fast = (
            not self._cap_binds and not self._base_lookahead and type(self)._samples is _RateLimitMixin._samples
        )
        self._user_cache: dict[str, str] = {}  # request id -> user (R17, resolved once)
        self._user_requests: dict[str, int] = {}  # user -> requests in the scheduler (any state)
        # user -> spare grants at the last step's clock reading, minus ``_spare_taken`` (a
        # lower bound on grants_at(user, now) for every later now: ``_survey_users``).
        self._spare: dict[str, int] = {}
        self._spare_taken: dict[str, int] = {}

    def _init_rotation_state(self) -> None:
        """R14/R15: the groups of streams, the last request served per group, and the order
        of turns."""
        self._group_cache: dict[str, str] = {}  # request id -> group_key(user, priority) (R14/R15)
        self._last_served: dict[str, str] = {}  # group key (user, priority) -> request id (R15)
        # R14: the order of turns the last step left (request ids of running requests; the
        # requests that left are removed as they leave). Never the order of ``running``.
        self._turns: dict[str, None] = {}
        self._turn_pos: dict[str, int] | None = None  # its places, when asked (``_turn_position``)
        self._streams_of: dict[str, list[Request]] | None = None  # user -> running requests (``_index_streams``)
        self._running_place: dict[Request, int] = {}  # request -> place in ``running`` (the same)
        # request -> num_computed_tokens when ``_short_streams`` last found it decoding (the same)
        self._decoding_seen: dict[Request, int] = {}
        # group key -> its last request id in ``_turns`` as built (R15: the last place).
        self._group_last: dict[str, str] = {}
        # A request left ``_turns`` since it was built (freed or preempted): rebuild it.
        self._turns_shrunk = True
        # len(running) when the last schedule() returned: between steps vLLM only removes
        # from ``running`` (a finish, an abort, a streaming request's pause), so a change
        # says some request left, also one that left without a hook here.
        self._running_after_step = -1

    def _open_trace(self, trace_path: str, **header: Any) -> None:
        """Open this engine's event trace (``reference/trace.py``; per data-parallel rank):
        its header names the class, the scheduling mode, the rates and tau (``header``:
        more keys, e.g. ``shadow``)."""
        cfg = self.output_rate_config
        self._trace = TraceWriter(
            rank_trace_path(trace_path, self.vllm_config),
            {
                "scheduler": type(self).__name__,
                "async_scheduling": isinstance(self, AsyncScheduler),
                "default_tokens_per_s": str(cfg.default_rate),
                "user_tokens_per_s": {u: str(r) for u, r in cfg.user_rates.items()},
                "burst_ns": cfg.burst_ns,
                **header,
            },
        )

    def _reset_step_state(self, now_ns: int) -> None:
        self._now_ns = now_ns
        self._charged: list[Request] = []  # R7: in charge order
        self._refused_users: set[str] = set()  # users refused in this step: not asked again
        self._throttled: set[str] = set()  # running requests refused and skipped (R11)
        self._scheduled_running: set[str] = set()  # running requests given tokens (R12)
        self._throttled_at_start: list[Request] = []  # R13: preferred victims of this step
        self._skipped_at_start: set[str] = set()  # their ids (the hook refuses them at once)
        self._left_running = 0  # requests preempted in this step (``_restore_order``)
        self._held: set[str] = set()  # R14: throttled at the start although the user has grants
        self._preempted_for_r13 = False  # R13: we preempted; the waiting loop must not run
        self._unconstrained = False  # no user can be refused in this step (_survey_users)
        self._record_only = False  # the hook's shortest path: _unconstrained and _hook_fast
        self._charge = self._charged.append
        self._charged_ids: list[str] | None = None  # ids of _charged, once computed
        self._resident: Counter | None = None  # R20: user -> running requests, from the first waiting look
        self._resident_seen = 0  # R20: len(running) when _resident was last brought up to date

    # -- R12: admission cap read by vLLM's waiting loop -------------------------
    @property
    def max_num_active_reqs(self) -> int:
        if getattr(self, "rate_limiter", None) is None:
            return self._base_max_num_active_reqs
        if self._preempted_for_r13:
            return 0  # R13: like vLLM, admit nothing in a step that preempted
        # R12: admit iff len(running) < M and len(running) - throttled < A.
        return min(self.max_num_running_reqs, self._active_cap + len(self._throttled))

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._base_max_num_active_reqs = value

    # -- R17 ------------------------------------------------------------------
    def _user(self, request: Request) -> str:
        user = self._user_cache.get(request.request_id)
        if user is None:
            user = self._remember_user(request)
        return user

    def _remember_user(self, request: Request) -> str:
        """R17: resolve ``request``'s user once and cache it with its R14 group key."""
        user = self._user_cache[request.request_id] = self._resolve_user(request)
        self._group_cache[request.request_id] = group_key(user, request.priority)
        self._user_requests[user] = self._user_requests.get(user, 0) + 1
        return user

    @staticmethod
    def _resolve_user(request: Request) -> str:
        """R17 without raising: a bad identity is logged and charged to ``__anonymous__``."""
        try:
            return user_of(request)
        except ValueError as exc:
            logger.error("request %s: %s; charged to %s", request.request_id, exc, ANONYMOUS_USER)
            return ANONYMOUS_USER

    def add_request(self, request: Request) -> None:
        """R17: resolve the identity once, at admission.

        Never raises for a bad identity: an exception here would stop the engine core and
        every request in it. The front end refuses such requests (``plugin.py``); one that
        still arrives is charged to ``__anonymous__`` and logged.
        """
        if self.rate_limiter is not None:
            self._remember_user(request)
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        if self.rate_limiter is not None:
            user = self._user_cache.pop(request.request_id, None)
            if user is not None:
                left = self._user_requests[user] - 1
                if left:
                    self._user_requests[user] = left
                else:
                    del self._user_requests[user]
            self._group_cache.pop(request.request_id, None)
            self._turns.pop(request.request_id, None)  # R14: only running requests take turns
            self._turns_shrunk = True
            self._turn_pos = None
            if self._plan_shadow is not None:  # R29
                self._plan_shadow.freed(request.request_id)
            if self._trace is not None:
                self._trace.note_freed(request.request_id, request.status.name, request.num_output_tokens)
        elif self._shadow is not None:  # shadow mode: forget the request's user
            self._shadow.freed(request.request_id)
            if self._trace is not None:
                self._trace.note_freed(request.request_id, request.status.name, request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)

    # -- the step ---------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any):
        limiter = self.rate_limiter
        if limiter is None:
            if self._shadow is not None:
                return self._shadow_schedule(*args, **kwargs)  # shadow mode: the base's schedule
            return super().schedule(*args, **kwargs)  # R18
        self._reset_step_state(self.clock_ns())  # R16: one clock read per schedule()
        if self._rates_watcher is not None or self._pending_rates is not None:
            self._apply_pending_rates(self._now_ns)  # R21: at the step boundary, this step's clock
        self._take_turns()  # R14
        enough, short = self._survey_users()  # R2 at the step's clock, once per user
        stock_order = self._move_throttled_last(short) if short else None  # R11, R13, R14
        if short and self.lora_config is not None and self._throttled_at_start:
            self._free_lora_slot(short)  # R13, LoRA
        self._record_only = self._unconstrained = enough and self._hook_fast and self.shortcuts
        scheduler_output = super().schedule(*args, **kwargs)
        self._commit_grants()  # R2/R7: the charges of this step, into the limiter
        if stock_order is not None:
            self._restore_order(stock_order)  # R13: only the choice of victims changed
        self._running_after_step = len(self.running)  # R14: see _turns_hold
        refunded = self._settle(scheduler_output)  # R9
        would = self._plan_shadow.step(self._now_ns, scheduler_output, self.requests) if self._plan_shadow else ()
        self._steps += 1
        if self._steps % CLEANUP_INTERVAL_STEPS == 0:
            limiter.cleanup_idle_users(self._now_ns)  # R6
            # R15: forget streams that left the scheduler (rotation ignores them anyway),
            # so this map stays bounded by the live requests.
            self._last_served = {k: rid for k, rid in self._last_served.items() if rid in self.requests}
        self._observe(scheduler_output, refunded)
        throttle_log = self._throttle_log
        assert throttle_log is not None, "the operator log is made with the limiter (__init__)"
        throttle_log.step(self._now_ns, self._throttled, self._user_cache)  # operator log (oplog.py)
        if self._metrics is not None:  # /metrics (reference/metrics.py); snapshot at most once per second
            cache = self._user_cache
            self._metrics.step(
                self._now_ns,
                self._step_taken,
                self._throttled.union(would) if would else self._throttled,  # R29: would-be throttles too
                cache.get,
                map(cache.get, refunded) if refunded else (),
                limiter,
            )
        if self._trace is not None:
            self._trace_step(scheduler_output, refunded)
        return scheduler_output

    # -- R21: a rate change without a restart --------------------------------------------
    def update_output_rates(
        self, default_tokens_per_s: object, user_tokens_per_s: Mapping[str, object] | None = None
    ) -> None:
        """R21: queue a new rate table (tokens/s), applied at the start of the next
        ``schedule()`` at that step's clock reading, never in the middle of one.

        Validated now, as at start-up; thread-safe (a lock guards the queue only). The
        rates file (``output_rate.rates_file``) is the operator's interface; this is for
        code in the engine-core process. A queued table wins over a file change seen in
        the same step.

        Raises:
            OutputRateConfigError: the feature is off (R18: a change cannot turn it on),
                or a bad rate (naming the user and value).
        """
        if not self.output_rate_config.enabled:
            raise OutputRateConfigError(
                "update_output_rates: output-rate limiting is off for this engine (no default_tokens_per_s at "
                "start-up); a rate change cannot turn it on: restart with a default rate"
            )
        config = parse_output_rate(
            {"default_tokens_per_s": default_tokens_per_s, "user_tokens_per_s": dict(user_tokens_per_s or {})}
        )
        assert config.default_rate is not None
        table = RateTable.flat(config.default_rate, dict(config.user_rates))
        table.prepare(self.output_rate_config.burst_ns)
        with self._rates_lock:
            self._pending_rates = table

    def _apply_pending_rates(self, now_ns: int) -> None:
        """R21: install a queued table or a changed rates file at ``now_ns`` (the start of
        ``schedule()``): each user keeps its lead in tokens (``OutputRateLimiter.install``),
        the spare-grant bounds of ``_survey_users`` are dropped (they were for the old
        rates), and the log, the metrics' limit gauges and the trace learn the new table.

        O(users holding a TAT + labels), whatever the table's size: the table was read,
        validated and prepared (scales, labels, log line) off the step (``RatesFileWatcher``;
        ``RateTable.prepare``), so installing it is a swap."""
        table = self._rates_watcher.poll() if self._rates_watcher is not None else None
        if self._pending_rates is not None:
            with self._rates_lock:
                table, self._pending_rates = self._pending_rates, None
        if table is None:
            return
        if self.rate_limiter is not None:
            limiter = self.rate_limiter
        else:  # R21 in shadow mode: the shadow limiter's rates
            assert self._shadow is not None
            limiter = self._shadow.limiter
        if self._shared_budget_refuses(table):
            return
        prepared = table.prepare(self.output_rate_config.burst_ns)
        changed = limiter.install(prepared.for_view(limiter.shadow_view), now_ns)
        if self.rate_limiter is not None:
            self._spare, self._spare_taken = {}, {}  # lower bounds at the old rates
            self._plan_shadow_for(table, now_ns)  # R29
        default = table.default_rate if table.default_rate is not None else self.output_rate_config.default_rate
        self.output_rate_config = replace(
            self.output_rate_config, default_rate=default, user_rates=table.user_rates, rate_table=table
        )
        if self._metrics is not None:  # the table's labels get their own series (bounded)
            self._metrics.rates_changed(table)
        if self._trace is not None:
            self._trace.rates_changed(now_ns, table, limiter.users())
        oplog_logger.info(
            "output-rate limits changed without a restart (R21): %s; %d user(s) rescaled, lead kept in tokens",
            describe_rates(table),
            changed,
        )
        if self._rates_watcher is not None:  # the replaced table is emptied off the step
            shadow = self._plan_shadow.limiter.replaced if self._plan_shadow is not None else ()
            self._rates_watcher.retire(*limiter.replaced, *shadow)

    def _shared_budget_refuses(self, table: RateTable) -> bool:
        """R23-R26 keep one rate per user in the store: a plan table (R27-R29) is refused
        (logged; the limits in force are kept)."""
        if self.output_rate_config.shared_budget_url is None or table.is_flat:
            return False
        oplog_logger.error(
            "output-rate: rates file %s: plans, patterns and unlimited users (R27-R29) are not supported with "
            "shared_budget_url; the limits in force are kept (write default_tokens_per_s and user_tokens_per_s only)",
            self.output_rate_config.rates_file,
        )
        return True

    def _plan_shadow_for(self, table: Any, now_ns: int = 0) -> None:
        """R29: the shadow accounting of the table's shadow plans (None without one). Its
        limiter counts only shadow plans' users (the enforcing limiter has them unlimited)."""
        if not table.has_shadow:
            self._plan_shadow = None
            return
        prepared = table.prepare(self.output_rate_config.burst_ns).shadow
        if self._plan_shadow is None:
            self._plan_shadow = ShadowAccounting(
                self.output_rate_config, self._resolve_user, only_shadow_plans=table, prepared=prepared
            )
        else:
            self._plan_shadow.only_shadow_plans = table
            self._plan_shadow.limiter.install(prepared, now_ns)

    # -- shadow mode (Decision "Shadow mode"; reference/shadow.py) ------------------------
    def _start_shadow(self) -> None:
        """Shadow mode: no ``rate_limiter``, so every override takes its R18 path (vLLM's
        own); a ``ShadowAccounting`` replays each step's sampling dispatches afterwards."""
        cfg = self.output_rate_config
        self._base_lookahead = True  # _reserve_prefill_lookahead: vLLM's own (R18 path)
        self._shadow = ShadowAccounting(cfg, self._resolve_user)
        would_cap = min(
            cfg.max_num_active_seqs or self.scheduler_config.max_num_active_seqs or self.max_num_running_reqs,
            self.max_num_running_reqs,
        )
        log_limits(type(self).__name__, cfg, would_cap, self.max_num_running_reqs)  # operator log
        self._throttle_log = ThrottleLog(self._shadow.limiter.rate_of, shadow=True)
        self._metrics = MetricsRecorder.from_env(cfg)  # None unless the front end set the directory
        if self._metrics is not None:  # the limits and the shadow flag show before the first request
            self._metrics.write(self.clock_ns())
        if cfg.trace_path is not None:
            self._open_trace(cfg.trace_path, shadow=True)

    def _shadow_schedule(self, *args: Any, **kwargs: Any):
        """Shadow mode: vLLM's ``schedule()``, then count what would have been throttled.

        The base class decides everything; afterwards the step's sampling dispatches are
        replayed through the shadow limiter at this step's one clock reading (R16). The
        would-be throttled requests go to the operator log, the metrics and the trace.
        """
        now_ns = self.clock_ns()  # R16: one clock read per schedule()
        if self._rates_watcher is not None or self._pending_rates is not None:
            self._apply_pending_rates(now_ns)  # R21: the shadow limiter's rates too
        scheduler_output = super().schedule(*args, **kwargs)
        shadow, throttle_log = self._shadow, self._throttle_log
        assert shadow is not None and throttle_log is not None, "shadow mode is set up by _start_shadow"
        would = shadow.step(now_ns, scheduler_output, self.requests)
        throttle_log.step(now_ns, would, shadow.users)  # operator log: would-be throttled
        if self._metrics is not None:  # /metrics: every dispatch granted, would-be throttles counted
            self._metrics.step(now_ns, shadow.step_dispatches, would, shadow.users.get, (), shadow.limiter)
        if self._trace is not None:
            self._trace_shadow_step(now_ns, scheduler_output, would)
        return scheduler_output

    def _trace_shadow_step(self, now_ns: int, scheduler_output, would: list[str]) -> None:
        """One shadow-mode trace line: ``charges`` are the shadow limiter's grants, and
        ``would_throttle`` lists the dispatches an enforcing scheduler would have refused."""
        shadow, trace = self._shadow, self._trace
        assert shadow is not None and trace is not None, "called by _shadow_schedule with the trace on"
        granted, would_set = set(shadow.last_granted), set(would)
        requests: dict[str, dict[str, Any]] = {}
        for rid, tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            sampled = request is not None and not request.is_prefill_chunk
            requests[rid] = {
                "user": shadow.user(rid, self.requests),
                "tokens": tokens,
                "sampled": sampled,
                "charged": rid in granted,
                "refunded": False,
                "throttled": False,
                "would_throttle": rid in would_set,
            }
        trace.write_step(
            shadow.steps - 1,
            now_ns,
            requests,
            shadow.last_granted,
            [],
            sorted(scheduler_output.preempted_req_ids),
            len(self.running),
            len(self.waiting),
            len(shadow.limiter),
            extra={"would_throttle": would},
        )

    # -- the engine-side event trace (output_rate.trace_path; reference/trace.py) -------
    def _trace_step(self, scheduler_output, refunded: list[str]) -> None:
        """One trace line from this step's own data (charges, refunds, throttled, batch)."""
        trace, limiter = self._trace, self.rate_limiter
        assert trace is not None and limiter is not None, "called by schedule() with the trace on"
        scheduled = scheduler_output.num_scheduled_tokens
        charged = [r.request_id for r in self._charged]
        charged_set, refunded_set, throttled = set(charged), set(refunded), self._throttled
        requests: dict[str, dict[str, Any]] = {}
        for rid in [*scheduled, *charged, *sorted(throttled)]:
            if rid in requests:
                continue
            request = self.requests.get(rid)
            tokens = scheduled.get(rid, 0)
            user = self._user_cache.get(rid)
            if user is None and request is not None:
                user = self._user(request)
            requests[rid] = {
                "user": user,
                "tokens": tokens,
                "sampled": tokens > 0 and request is not None and not request.is_prefill_chunk,
                "charged": rid in charged_set,
                "refunded": rid in refunded_set,
                "throttled": rid in throttled,
            }
        trace.write_step(
            self._steps - 1,
            self._now_ns,
            requests,
            charged,
            refunded,
            sorted(scheduler_output.preempted_req_ids),
            len(self.running),
            len(self.waiting),
            len(limiter),
        )

    def _note_if_idle(self) -> None:
        """No request left (after outputs or a finish): mark the trace idle and write the
        metrics snapshot, each only if it is on."""
        if self.requests:
            return
        if self._trace is not None:
            self._trace.idle(self.clock_ns())
        if self._metrics is not None:
            self._metrics_idle()

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        self._note_if_idle()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        result = super().finish_requests(*args, **kwargs)
        self._note_if_idle()
        return result

    def _metrics_idle(self) -> None:
        """No request left: write the metrics snapshot now (exact counters while idle)."""
        metrics, shadow = self._metrics, self._shadow
        assert metrics is not None, "called with the metrics on"
        limiter = self.rate_limiter if self.rate_limiter is not None or shadow is None else shadow.limiter
        metrics.write(self.clock_ns(), limiter)

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
        super().shutdown()

    def _take_turns(self) -> None:
        """R14: this step's turn order (spec ``rate.turn_order``), kept for the next step.

        The order the last step left (``_turns``), then the running requests new to it in
        ``running`` order; within it each (user, priority) group rotated within its own
        places so that the stream after the group's last-served one comes first. If the
        last-served stream is no longer running (or is already last), that group keeps its
        order. ``running`` itself is never reordered (R19). O(running); when that order is
        this step's (``_turns_hold``), it is kept as it is.
        """
        if self.shortcuts and self._turns_hold():
            return  # the same order: its places (_turn_position) and streams (_streams_of) too
        self._turn_pos = None
        turns, cache = self._turns, self._group_cache
        base = [r for r in self.running if r.request_id in turns]
        if len(base) > 1:
            known = {r.request_id: r for r in base}
            base = [known[rid] for rid in turns if rid in known]
        base += [r for r in self.running if r.request_id not in turns]
        places: dict[str, list[int]] = {}
        for index, request in enumerate(base):
            key = cache.get(request.request_id)
            if key is None:
                self._user(request)
                key = cache[request.request_id]
            places.setdefault(key, []).append(index)
        order = list(base)
        for key, slots in places.items():
            last = self._last_served.get(key)
            if last is None or len(slots) < 2:
                continue
            members = [base[i] for i in slots]
            pos = next((k for k, r in enumerate(members) if r.request_id == last), None)
            if pos is None or pos == len(members) - 1:
                continue
            for slot, request in zip(slots, members[pos + 1 :] + members[: pos + 1]):
                order[slot] = request
        turns = self._turns = dict.fromkeys(map(_REQUEST_ID, order))
        self._group_last = dict(zip(map(cache.__getitem__, turns), turns))  # later places win: the last
        self._turns_shrunk = False
        self._streams_of = None

    def _index_streams(self) -> dict[str, list[Request]]:
        """R11/R14: each user's running requests in ``running`` order (``_streams_of``) and
        each request's place in ``running`` (``_running_place``), built when first asked
        after the turn order was built and kept while it holds (``running`` is then the
        same list in the same order: it changes only by preemption, admission and removal,
        each of which ends the hold)."""
        users = self._user_cache
        streams: dict[str, list[Request]] = {}
        for r in self.running:
            streams.setdefault(users[r.request_id], []).append(r)
        self._streams_of = streams
        self._running_place = dict(zip(self.running, range(len(self.running))))
        self._decoding_seen = {}
        return streams

    def _turns_hold(self) -> bool:
        """R14: the order the last step left is this step's turn order, as ``_take_turns``
        would build it: the same running requests, and no group's last-served stream (R15)
        is one of its running streams other than its last, so no group rotates.

        The same requests: none left (in a step only through ``_preempt_request``, which
        marks ``_turns_shrunk``; between steps ``running`` only shrinks, so its length is
        that of the last step's end) and none joined (``_turns`` as long as ``running``).
        O(1), and O(groups) in C; O(groups) in Python only while some group's last-served
        stream is not its last place."""
        turns, running = self._turns, self.running
        if self._turns_shrunk or not len(turns) == len(running) == self._running_after_step:
            return False
        last_served, group_last = self._last_served, self._group_last
        if group_last.items() <= last_served.items():
            return True  # every group's last-served stream is its last
        get = last_served.get
        return all((s := get(key)) is None or s == last or s not in turns for key, last in group_last.items())

    def _turn_position(self) -> dict[str, int]:
        """R14/R15: request id -> place in this step's turn order (built when first asked
        after the order was built or a request left it)."""
        if self._turn_pos is None:
            turns = self._turns
            self._turn_pos = dict(zip(turns, range(len(turns))))
        return self._turn_pos

    def _turn_order(self, streams: list[Request]) -> list[Request]:
        """R14: one user's running requests (``streams``, in ``running`` order) in this
        step's turn order (``_take_turns``)."""
        position = self._turn_position()
        return sorted(streams, key=lambda r: position[r.request_id])

    def _move_throttled_last(self, short: dict[str, int]) -> list[Request] | None:
        """R11, R13, R14: find the requests throttled at the step start and stable-move
        them to the end of ``running`` for the duration of vLLM's loops.

        ``short``: users whose grants at the step's clock reading (``_survey_users``,
        exact) are fewer than their requests, with those grants. A user's *decoding*
        streams (only the sampling position left, R10; last output not already in
        flight, V3) beyond its grants, in its turn order (``_turn_order``), are throttled
        at the start: all of them if the user is refused (a refusal holds for the whole
        step, grants only push TAT up; no turn order needed), otherwise those whose turn
        it is not (``_held``): the user's grants go to the others (R14). The running loop
        skips them anyway; the move changes only vLLM's victims (FCFS: ``running[-1]``;
        PRIORITY: see ``_allocate_slots_throttled_victims_first``). They are recorded as
        throttled (R11/R12) and their users for the wait hint (R16) even if the active
        cap stops the running loop before it reaches them. Returns the order before the
        move, or None if nothing moved. O(running).
        """
        running = self.running
        cache = self._user_cache
        if self.shortcuts:  # O(short users' streams), from the index kept with the turn order
            throttled, streams = self._short_streams(short)
        else:
            throttled, streams = [], {}
            for r in running:
                user = cache.get(r.request_id) or self._user(r)
                grants = short.get(user)
                if grants is None:
                    continue
                if grants:
                    streams.setdefault(user, []).append(r)
                elif _decoding(r):
                    throttled.append(r)
        held: list[Request] = []
        for user, mine in streams.items():
            grants = short[user]
            decoding = [r for r in self._turn_order(mine) if _decoding(r)]
            if len(decoding) > grants:
                held += decoding[grants:]
        if held:
            self._held.update(map(_REQUEST_ID, held))  # R14: not its turn
            passed = set(held).union(throttled)
            throttled = list(filter(passed.__contains__, running))
        self._throttled_at_start = throttled
        ids = list(map(_REQUEST_ID, throttled))
        self._skipped_at_start = set(ids)
        self._throttled.update(ids)
        self._refused_users.update(map(cache.__getitem__, ids))
        if not throttled or running[-len(throttled) :] == throttled:
            return None
        stock_order = list(running)
        moved = set(throttled)
        running[:] = [*filterfalse(moved.__contains__, running), *throttled]
        return stock_order

    def _short_streams(self, short: dict[str, int]) -> tuple[list[Request], dict[str, list[Request]]]:
        """R11/R14: the refused users' decoding streams in ``running`` order, and the running
        requests of the other ``short`` users (in ``running`` order, per user), from
        ``_streams_of``.

        A stream found decoding in an earlier step of the same index whose
        ``num_computed_tokens`` has not moved since is still decoding: not scheduled since,
        so its prompt + outputs + placeholders and outputs + placeholders are unchanged (an
        output in flight that arrives adds a token and removes a placeholder); a preemption
        (the only way back, with the KV connectors refused) rebuilds the index."""
        streams_of = self._streams_of
        if streams_of is None:
            streams_of = self._index_streams()
        seen = self._decoding_seen.get
        throttled: list[Request] = []
        streams: dict[str, list[Request]] = {}
        refused = 0
        for user, grants in short.items():
            mine = streams_of.get(user)
            if mine is None:
                continue
            if grants:
                streams[user] = mine
            else:  # _decoding, inline, unless known from an earlier step
                throttled += [
                    r
                    for r in mine
                    if seen(r) == r.num_computed_tokens
                    or (
                        r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - 1
                        and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
                    )
                ]
                refused += 1
        if refused > 1:
            throttled.sort(key=self._running_place.__getitem__)
        self._decoding_seen.update(zip(throttled, map(_NUM_COMPUTED, throttled)))
        return throttled, streams

    def _restore_order(self, stock_order: list[Request]) -> None:
        """R13: put ``running`` back in the order vLLM alone would have left it.

        vLLM only removes (preempts) and appends (admits) during ``schedule()``; with no
        preemption in the step, ``running`` is the moved order followed by the admitted.
        """
        running = self.running
        if self.shortcuts and not self._left_running:
            running[:] = [*stock_order, *running[len(stock_order) :]]
            return
        present = set(running)
        before = set(stock_order)
        admitted = [r for r in running if r not in before]
        running[:] = [r for r in stock_order if r in present] + admitted

    def _allocate_slots_throttled_victims_first(self, request: Request, *args: Any, **kwargs: Any):
        """R13 under PRIORITY: before vLLM preempts, preempt a throttled request of its level.

        vLLM's victim is the max (priority, arrival_time) of ``running``; when an allocation
        for a running request fails, a request throttled at the step start with that same
        priority (the latest arrival first) is preempted instead and the allocation retried.
        These requests sit after the running loop's position (``_move_throttled_last``), so
        removing one does not disturb the loop. Waiting-loop allocations are not touched.
        """
        new_blocks = self._base_allocate_slots(request, *args, **kwargs)
        while new_blocks is None and request.status == RequestStatus.RUNNING and self.running:
            level = max(r.priority for r in self.running)
            candidates = [
                r
                for r in self._throttled_at_start
                if r.status == RequestStatus.RUNNING
                and r is not request
                and r.priority == level
                and self._request_blocks_can_be_freed(r)
            ]
            if not candidates:
                break
            victim = max(candidates, key=lambda r: r.arrival_time)
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic(), drop_stale_output=self.requires_kv_delivery)
            self._preempted_for_r13 = True
            new_blocks = self._base_allocate_slots(request, *args, **kwargs)
        return new_blocks

    def _samples(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """R7: the chunk reaches the sampling position (prompt + outputs + placeholders)."""
        return num_computed_tokens + num_new_tokens >= request.num_tokens + request.num_output_placeholders

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """R7, R10, R11, R12: the sampling decision for one (step, request); see module docstring.

        Called by vLLM once per request that reaches the end of the running or waiting loop;
        returns the tokens it may schedule (0: skip it this step). This is the hottest code
        of the feature (once per running request per step): charges count down a per-user
        allowance taken from the limiter once per step (``_grants_left``) and are written
        back to the limiter in one operation per user after vLLM's loops (``_commit_grants``).
        The common configuration (no binding active cap, no MTP drafter, ``_samples`` not
        replaced) takes the short path below; ``_reserve_general`` is the same decision
        with every case handled.
        """
        if self._record_only:  # no user can be refused in this step: only record charges
            if num_new_tokens <= 0:
                return 0  # vLLM's hook, without an MTP drafter, only clamps at 0
            if num_computed_tokens + num_new_tokens >= request.num_tokens + request.num_output_placeholders:
                self._charge(request)  # R7: charged at dispatch, counted per user at commit
            return num_new_tokens
        if not self._hook_fast:
            return self._reserve_general(request, num_computed_tokens, num_new_tokens)
        if num_new_tokens <= 0:
            return 0  # vLLM's hook, without an MTP drafter, only clamps at 0
        if self.shortcuts and request.request_id in self._skipped_at_start:
            return 0  # R11/R14: throttled at the step start; _refuse would skip it the same way
        end = request.num_tokens + request.num_output_placeholders
        if num_computed_tokens + num_new_tokens < end:
            return num_new_tokens  # R7: a prefill chunk that does not sample is not charged
        user = self._user_cache.get(request.request_id) or self._user(request)
        grants = self._grants
        left = grants.get(user)
        if left is None:
            left = self._grants_left(user)
        if left and not (self._held and request.request_id in self._held):  # R14: its turn
            grants[user] = left - 1
            self._charged.append(request)  # R7: charged at dispatch
            return num_new_tokens
        return self._refuse(request, user, num_computed_tokens, num_new_tokens, end)

    def _reserve_general(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """``_reserve_prefill_lookahead`` for every configuration (R7, R10, R11, R12, R18)."""
        if self._base_lookahead:
            num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
            if self.rate_limiter is None:
                return num_new_tokens  # R18
        elif num_new_tokens < 0:
            num_new_tokens = 0
        if num_new_tokens == 0:
            return 0
        is_running = request.status is _RUNNING
        if is_running and len(self._scheduled_running) >= self._active_cap:
            return 0  # R12: the step's batch already holds A running requests
        end = request.num_tokens + request.num_output_placeholders
        if self._samples(request, num_computed_tokens, num_new_tokens):  # R7: this chunk samples
            user = self._user(request)
            if self._grants_left(user) and not (self._held and request.request_id in self._held):  # R14
                self._grants[user] -= 1
                self._charged.append(request)  # R7: charged at dispatch
            else:
                num_new_tokens = self._refuse(request, user, num_computed_tokens, num_new_tokens, end)
        if num_new_tokens and is_running:
            self._scheduled_running.add(request.request_id)
        return num_new_tokens

    def _refuse(self, request: Request, user: str, num_computed_tokens: int, num_new_tokens: int, end: int) -> int:
        """R10/R11: ``user`` is refused; advance a prefill to n-1 or skip the request (0)."""
        self._refused_users.add(user)
        # R10: with chunked prefill, advance to the position just before sampling.
        capped = end - 1 - num_computed_tokens
        if capped <= 0 or not self.scheduler_config.enable_chunked_prefill:
            if request.status is _RUNNING:
                self._throttled.add(request.request_id)  # R11: skip, keep resident
            return 0
        return min(num_new_tokens, capped)

    def _grants_left(self, user: str) -> int:
        """R2: grants ``user`` may still receive in this step (the limiter asked once per step)."""
        left = self._grants.get(user)
        if left is None:
            limiter = self.rate_limiter
            assert limiter is not None, "the hooks ask for grants with the feature on only"
            left = self._grants[user] = self._grants_at_start[user] = limiter.grants_at(user, self._now_ns)
        return left

    def _survey_users(self) -> tuple[bool, dict[str, int]]:
        """R2 at the step's clock reading, once per user with requests in the scheduler.

        Returns ``(enough, short)``: ``enough`` if every user can be granted one token
        per request it has (each request is charged at most once per step, R7, so then no
        user is refused in this step and the hook only records charges); ``short``, the
        users granted fewer tokens now than they have requests, with their exact grants
        (0: refused; R13, R14, R16). The limiter is asked only for users whose
        spare grants from the last step do not cover their requests: spare grants at an
        earlier clock reading are a lower bound now, as grants only grow with time and
        with refunds. Seeds this step's allowances (``_grants``) with the result: exact
        where the limiter was asked, otherwise a lower bound that the user's requests
        cannot use up in one step. O(users).
        """
        spare, taken, limiter, now = self._spare, self._spare_taken, self.rate_limiter, self._now_ns
        assert limiter is not None, "called by schedule() with the feature on"
        bound: dict[str, int] = {}
        short: dict[str, int] = {}
        for user, requests in self._user_requests.items():
            grants = spare.get(user, 0) - taken.get(user, 0)
            if grants < requests:
                grants = limiter.grants_at(user, now)
                if grants < requests:
                    short[user] = grants
            bound[user] = grants
        self._grants_at_start = bound
        self._grants = dict(bound)
        return not short, short

    def _commit_grants(self) -> None:
        """R2/R7: write this step's charges to the limiter in one ``take_counts``.

        Equal to one ``try_take`` per charge at the step's clock reading (``limiter.py``).
        Also keeps, per user, the grants left at this clock reading (``_survey_users``).
        """
        limiter, now = self.rate_limiter, self._now_ns
        assert limiter is not None, "called by schedule() with the feature on"
        if self._unconstrained:
            if len(self._charged) == len(self._user_cache):  # every request charged (once, R7): its user's count
                counted = dict(self._user_requests)
            else:
                ids = self._charged_ids = list(map(_REQUEST_ID, self._charged))
                counted = Counter(map(self._user_cache.__getitem__, ids))
            limiter.take_counts(counted, now)
            self._spare, self._spare_taken = self._grants_at_start, counted
            self._step_taken = counted  # the metrics' granted tokens (reference/metrics.py)
            return
        left = self._grants
        taken = {u: n - left[u] for u, n in self._grants_at_start.items() if n > left[u]}
        limiter.take_counts(taken, now)
        self._spare, self._spare_taken = left, {}
        self._step_taken = taken  # the metrics' granted tokens (reference/metrics.py)

    # The vLLM release's behaviour near the hooks; an instance attribute may replace it
    # (the tests show what each per-version workaround prevents).
    vllm_profile: VllmVersionProfile = VLLM_PROFILE

    @staticmethod
    def _lora_id(request: Request) -> int:
        """V8: the request's LoRA adapter id (0: the base model)."""
        lora = request.lora_request
        return lora.lora_int_id if lora is not None and lora.lora_int_id > 0 else 0

    def _counted_loras(self) -> set[int]:
        """V8 (+ R11): the adapters the waiting loop counts against ``max_loras`` (spec
        ``scheduler.counted_loras``): on vLLM 0.33 those of every running request; on 0.32
        those of the running requests scheduled or throttled in this step and of those
        admitted so far.

        That is every running request but one vLLM's running loop skips because it is done
        once the output in flight arrives (async): its placeholders already carry it to
        ``max_tokens`` (V3), or it has no room left below ``max_model_len`` (V4: given 0
        tokens); it is never scheduled again. Throttled requests count (R11: resident,
        they keep their adapter's slot); vLLM 0.32 alone counts only the scheduled ones.
        """
        counted = set()
        every = self.vllm_profile.loras_counted_over_all_running  # V8 (0.33): every running request counts
        room_end = self.max_model_len - self.num_sampled_tokens_per_step
        for r in self.running:
            lora = self._lora_id(r)
            if every and lora:
                counted.add(lora)
                continue
            if not lora or r.num_computed_tokens >= room_end:
                continue  # V4: no room left, it finishes on its output in flight
            if r.num_output_placeholders > 0 and (
                r.num_computed_tokens + 2 - r.num_output_placeholders >= r.num_prompt_tokens + r.max_tokens
            ):
                continue  # V3: its placeholders already reach max_tokens
            counted.add(lora)
        return counted

    def _lora_would_exceed(self, request: Request) -> bool:
        """V8, LoRA: admitting ``request`` would make the counted adapters exceed ``max_loras``.

        vLLM 0.32 counts only the LoRAs of running requests scheduled in this step, so a
        throttled request's LoRA (R11: resident but not scheduled) would not count, a new LoRA
        would be admitted beside it, and the step that serves both would exceed
        ``max_loras`` (vLLM's assertion). Counted here with the throttled ones
        (``_counted_loras``); vLLM 0.33 counts every running request itself.
        """
        lora = self._lora_id(request)
        if self.lora_config is None or not lora:
            return False
        counted = self._counted_loras()
        return lora not in counted and len(counted) >= self.lora_config.max_loras

    def _takes_new_lora_slot(self, request: Request) -> bool:
        """R13, LoRA: ``request`` is on an adapter no counted request uses (spec ``rate.lora_gate``)."""
        lora = self._lora_id(request)
        return self.lora_config is not None and bool(lora) and lora not in self._counted_loras()

    def _free_lora_slot(self, short: dict[str, int]) -> None:
        """R13, LoRA: preempt the throttled holders of an adapter slot another user needs.

        Spec ``rate.free_lora_slot``: with ``max_loras`` adapters in use by ``running``, the
        first waiting request (queue order) on another adapter whose user is granted now
        names the need; an adapter all of whose running requests were throttled at the
        step start, with their users refused (``short`` 0) and none of them the needing
        request's user, is freed: the one of the last such request in ``running`` order,
        its holders preempted last first (vLLM's ``_preempt_request``: blocks freed, back
        to the front of ``waiting``). vLLM's waiting loop then runs (these preemptions are
        not the running loop's, V7). O(running + waiting).
        """
        in_use: dict[int, list[Request]] = {}
        for r in self.running:
            lora = self._lora_id(r)
            if lora:
                in_use.setdefault(lora, []).append(r)
        if len(in_use) < self.lora_config.max_loras:
            return
        needing = None
        for w in self.waiting:
            lora = self._lora_id(w)
            if lora and lora not in in_use and self._grants_left(self._user(w)):
                needing = w
                break
        if needing is None:
            return
        needing_user = self._user(needing)
        at_start = {id(r) for r in self._throttled_at_start}

        def freeable(holders: list[Request]) -> bool:
            return all(
                id(r) in at_start and short.get(self._user(r)) == 0 and self._user(r) != needing_user for r in holders
            )

        candidates = [r for r in self.running if (lora := self._lora_id(r)) and freeable(in_use[lora])]
        if not candidates:
            return
        now = time.monotonic()
        for victim in reversed(in_use[self._lora_id(candidates[-1])]):
            self.running.remove(victim)
            self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        if self.rate_limiter is None:
            return True
        if self._per_user_cap is not None and not self._below_residency_cap(request):
            return False  # R20: its user holds its cap of running requests; skipped, later ones still looked at
        if not self._unconstrained:
            user = self._user(request)
            if not self._grants_left(user):
                self._refused_users.add(user)
                if not self._refused_may_proceed(request):
                    return False
                if self._takes_new_lora_slot(request):
                    return False  # R13: a refused user takes no new adapter slot
        # V8 (0.32): skipped like vLLM's own max_loras skip.
        return self.vllm_profile.loras_counted_over_all_running or not self._lora_would_exceed(request)

    def _refused_may_proceed(self, request: Request) -> bool:
        """R10: a refused user's waiting request proceeds only if it can prefill without
        sampling; otherwise it is skipped and later waiting requests are still admitted."""
        if not self.scheduler_config.enable_chunked_prefill:
            return False
        if not self.vllm_profile.zero_token_waiting_stops_admission:
            # V8 (0.33): the 0 tokens _refuse gives it at the last cap skip just this request.
            return True
        # V8 (0.32): a waiting request given 0 tokens there would stop admission of every
        # later one, so one that can only sample is skipped here, before it is sized.
        num_computed_tokens = request.num_computed_tokens
        if num_computed_tokens == 0:
            # R10: a fresh admission starts at its prefix-cache hit, which vLLM caps at
            # num_tokens - 1 and so can leave only the sampling token: look it up as vLLM
            # is about to (a side-effect-free lookup).
            num_computed_tokens = self._get_local_prefix_cache_hit(request)[1]
        return num_computed_tokens < request.num_tokens - 1

    def _below_residency_cap(self, request: Request) -> bool:
        """R20: ``request``'s user holds fewer than ``max_num_seqs_per_user`` running requests.

        Counted over ``running`` at the first waiting request vLLM's waiting loop looks at in
        this step, then kept up to date with the requests the loop admits (vLLM only appends
        to ``running`` there; nothing is removed once the waiting loop runs). O(running) once
        per step, O(1) per waiting request.
        """
        running = self.running
        resident = self._resident
        if resident is None:
            resident = self._resident = Counter(map(self._user, running))
        else:
            for admitted in running[self._resident_seen :]:
                resident[self._user(admitted)] += 1
        self._resident_seen = len(running)
        cap = self._per_user_cap
        assert cap is not None, "called only with the R20 cap set"
        return resident[self._user(request)] < cap

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if self.rate_limiter is not None:
            self._scheduled_running.discard(request.request_id)
            self._throttled.discard(request.request_id)
            self._turns.pop(request.request_id, None)  # R14: only running requests take turns
            self._turns_shrunk = True
            self._turn_pos = None
            self._left_running += 1
        return super()._preempt_request(request, *args, **kwargs)

    def _settle(self, scheduler_output) -> list[str]:
        """R9: the single refund point; R15: record the last-served stream per group."""
        scheduled = scheduler_output.num_scheduled_tokens
        charged = self._charged
        if self._all_served(scheduled) and not any(map(_IS_PREFILL_CHUNK, charged)):
            self._last_served.update(self._group_last)  # R15: each group's last place
            return []
        ids = self._charged_ids
        if ids is None:
            ids = list(map(_REQUEST_ID, charged))
        if all(map(scheduled.__contains__, ids)) and not any(map(_IS_PREFILL_CHUNK, charged)):
            # Every charge was dispatched to sample (the usual step): nothing to refund.
            self._record_last_served(ids)
            return []
        refunded = []
        served = []
        cache, limiter = self._user_cache, self.rate_limiter
        assert limiter is not None, "called by schedule() with the feature on"
        for request in charged:
            rid = request.request_id
            user = cache.get(rid) or self._user(request)
            if rid in scheduled and not request.is_prefill_chunk:
                served.append(rid)
            else:
                limiter.refund(user)  # R4/R9
                refunded.append(rid)
        self._record_last_served(served)
        return refunded

    def _all_served(self, scheduled: Mapping[str, int]) -> bool:
        """R9/R15 in O(1): every request in the scheduler was charged in this unconstrained
        step and each one is in ``scheduled``, and they are this step's turn order as built.

        The charges are distinct requests of the scheduler (R7: at most one per request per
        step), so as many charges as requests means every request; with no preemption and
        as many running requests as turns, nothing joined or left, so ``running`` holds them
        all and ``scheduled`` (a subset of ``running``) as many is all of them."""
        return (
            self.shortcuts
            and self._unconstrained
            and not self._left_running
            and not self._turns_shrunk
            and len(self._charged) == len(self._user_cache) == len(self.running) == len(self._turns) == len(scheduled)
        )

    def _record_last_served(self, ids: list[str]) -> None:
        """R15: of this step's dispatched charges ``ids``, the one of each (user, priority)
        group that comes last in the step's turn order followed by the requests admitted
        in it (in ``running`` order) becomes the group's last served (spec
        ``rate.next_last_served``). When ``ids`` are exactly the turn order as built, that
        is each group's last place (``_group_last``). O(ids log ids) in C."""
        if not ids:
            return
        turns = self._turns
        if self.shortcuts and not self._turns_shrunk and len(ids) == len(turns) and turns.keys() == set(ids):
            self._last_served.update(self._group_last)
            return
        position = self._turn_position()
        ordered = sorted(filter(position.__contains__, ids), key=position.__getitem__)
        if len(ordered) < len(ids):  # admitted in this step: after every turn, in running order
            late = len(position)
            admitted = {r.request_id: late + i for i, r in enumerate(self.running) if r.request_id not in position}
            rest = [rid for rid in ids if rid not in position]
            ordered += sorted(rest, key=lambda rid: admitted.get(rid, late))
        groups = self._group_cache
        self._last_served.update(zip(map(groups.__getitem__, ordered), ordered))  # later wins: the last

    def _observe(self, scheduler_output, refunded: list[str]) -> None:
        """Record this step's decisions; the observation dict is built only when read."""
        limiter = self.rate_limiter
        assert limiter is not None, "called by schedule() with the feature on"
        ready = [t for u in self._refused_users if (t := limiter.ready_at_ns(u)) is not None]
        self._wait_hint_ns = min(ready) if ready else None
        self._step_record = (self._now_ns, self._charged, refunded, self._throttled)
        self._observation_cache: dict[str, Any] | None = None

    @property
    def last_step_observation(self) -> dict[str, Any] | None:
        """The white-box observation of the last ``schedule()`` (docs/OBSERVATION.md).

        Built on first read after a step, from the step's record and the limiter state
        (``update_from_output`` never touches the limiter, so it is the state the step left).
        """
        if self.rate_limiter is None or getattr(self, "_step_record", None) is None:
            return None
        if self._observation_cache is None:
            now_ns, charged, refunded, throttled = self._step_record
            limiter = self.rate_limiter
            self._observation_cache = {
                "now_ns": now_ns,
                "charged": [r.request_id for r in charged],
                "refunded": refunded,
                "throttled": sorted(throttled),
                "wait_hint_ns": self._wait_hint_ns,
                "tat_ns": {u: limiter.tat_ns(u) for u in limiter.users()},
            }
        return self._observation_cache

    def next_ready_ns(self) -> int | None:
        """R16: earliest ready time among users refused in the last step (None: none)."""
        return getattr(self, "_wait_hint_ns", None)

    def operator_log_due_ns(self) -> int | None:
        """Operator log (``oplog.py``): when the throttled-users line counted so far is due,
        in ns of ``clock_ns`` (None: nothing pending, or the feature off). The engine loop
        wakes for it while it waits for budget or idles (``reference/plugin.py``)."""
        log = getattr(self, "_throttle_log", None)
        return None if log is None else log.due_ns()

    def flush_operator_log(self, now_ns: int | None = None) -> bool:
        """Operator log: write the throttled-users line if it is due at ``now_ns`` (ns of
        ``clock_ns``; default: now), between ``schedule()`` calls. True if a line was written."""
        log = getattr(self, "_throttle_log", None)
        if log is None:
            return False
        return log.tick(self.clock_ns() if now_ns is None else now_ns)


class RateLimitedScheduler(_RateLimitMixin, Scheduler):
    """vLLM (0.32.0, 0.33.0) ``Scheduler`` with per-user output-rate limiting (R6-R18)."""


class RateLimitedAsyncScheduler(_RateLimitMixin, AsyncScheduler):
    """vLLM (0.32.0, 0.33.0) ``AsyncScheduler`` with per-user output-rate limiting (R6-R18, P5)."""
