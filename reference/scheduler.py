"""``RateLimitedScheduler``: per-user output-rate limiting inside stock vLLM 0.32.0 and 0.33.0.

Subclasses of vLLM's ``Scheduler`` and ``AsyncScheduler`` that add the rules of
docs/SPEC.md without copying vLLM code. This module only wires vLLM's hooks to the
collaborators that hold the rules, around one ``StepRecord`` per ``schedule()``
(``reference/step_record.py``, the spec's ``Cycle``):

- ``limits.UserLimits``: identity (R17), the limiter (R1-R5, R23-R29), rate changes (R21);
- ``charging.Charging``: grants per step (R2), the refusal (R10/R11), the charges' commit
  (R7) and the single refund point (R9);
- ``residency.Residency``: the active cap (R12), residency (R20), LoRA counts (V8);
- ``victims.Victims``: requests throttled at the step start and preferred victims (R13);
- ``turns.Turns``: R14's turn order kept between steps, R15's last served;
- ``engine_wait.EngineWait``: the wait hint (R16) and the operator log's due line;
- ``observation.StepObserver``: the white-box observation, trace, metrics, shadow mode.

vLLM's hooks: ``schedule()`` is wrapped, and three hooks that vLLM's own loops call are
overridden. ``_reserve_prefill_lookahead`` -- the last cap on ``num_new_tokens`` in both
the running and the waiting loop, once per (step, request) reaching that point: here the
sampling decision is made: charge (R7), refuse and skip (R11), or cap a prefill at
position n-1 (R10); and the active cap of the running loop (R12) is applied.
``_handle_blocked_waiting_request`` -- each waiting request the waiting loop looks at: a
request whose user is refused and that cannot advance without sampling is skipped here,
so it never stops admission of later waiting requests (R10). ``max_num_active_reqs`` --
the waiting loop's admission cap, computed so that throttled requests do not count (R12).
After ``super().schedule()`` returns, the single refund point (R9) refunds every charge
whose request was not dispatched to sample.

The private methods named "seams" below are where subclasses (the gate's mutants and
candidates) change one rule; the collaborators call back through them.

Source: docs/SPEC.md "The scheduler rules (R7-R19)", R20, R21 and "Decisions".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.reference.charging import Charging
from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.engine_checks import check_engine_supported
from vllm_output_rate.reference.engine_wait import EngineWait
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.limits import UserLimits, resolve_user
from vllm_output_rate.reference.observation import StepObserver
from vllm_output_rate.reference.oplog import ThrottleLog, log_feature_off, log_limits
from vllm_output_rate.reference.residency import Residency
from vllm_output_rate.reference.section import OutputRateConfig
from vllm_output_rate.reference.step_record import StepRecord
from vllm_output_rate.reference.turns import Turns
from vllm_output_rate.reference.victims import Victims
from vllm_output_rate.reference.vllm_compat import INSTALLED_PROFILE
from vllm_output_rate.spec.versions import VllmVersionProfile

CLEANUP_INTERVAL_STEPS = 256  # R6
# Where the installed vLLM release differs near the hooks (docs/SPEC.md "vLLM versions"):
# the zero-token stop of the waiting loop (V8) and the LoRA count of its max_loras check.
VLLM_PROFILE: VllmVersionProfile = INSTALLED_PROFILE
_RUNNING = RequestStatus.RUNNING
# The seams a steady step (_steady_schedule) takes in line; a subclass replacing one of
# them gets the general path in every step.
_STEADY_SEAMS = (
    "_reset_step_state",
    "_survey_users",
    "_move_throttled_last",
    "_commit_grants",
    "_settle",
    "_steady",
    "_observe",
    "_end_step",
)
# The mixin is only ever combined with vLLM's Scheduler (the two classes at the end), whose
# attributes (running, waiting, requests, scheduler_config, ...) and methods it uses and
# overrides; the type checker is told so, the runtime class stays a plain mixin.
if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerHost
else:
    _SchedulerHost = object


class _RateLimitMixin(_SchedulerHost):
    """The rules R6-R21 layered on a vLLM V1 scheduler class (see module docstring)."""

    # The per-step shortcuts: the unconstrained step (no user can be refused: the hook only
    # records charges, counted per user once), the turn order kept between steps
    # (``Turns.hold``), the all-served R15 store, the in-place restore of ``running`` and
    # the hook's skip of requests throttled at the step start. Each decides exactly what
    # the general path decides (tests/test_shortcuts.py runs both step by step); False
    # (on a subclass or an instance) takes the general path everywhere.
    shortcuts: bool = True
    # The vLLM release's behaviour near the hooks; an instance attribute may replace it
    # (the tests show what each per-version workaround prevents).
    vllm_profile: VllmVersionProfile = VLLM_PROFILE
    # R17 seam: request -> user without raising (a subclass may replace it).
    _resolve_user = staticmethod(resolve_user)

    # -- construction ---------------------------------------------------------
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Parsed and checked before vLLM builds anything (KV manager, connectors): a bad or
        # unsupported configuration stops start-up with one message saying what to change.
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        additional = vllm_config.additional_config or {}
        cfg = parse_output_rate(additional.get("output_rate") if isinstance(additional, dict) else None)
        if cfg.enabled:  # R18: feature off, no checks at all
            check_engine_supported(vllm_config)
        super().__init__(*args, **kwargs)
        self.output_rate_config: OutputRateConfig = cfg
        self.clock_ns: Callable[[], int] = (
            time.monotonic_ns
        )  # R16: the only clock; the gate replaces it with its fake clock
        self.rate_limiter: OutputRateLimiter | None = None
        # vLLM's _reserve_prefill_lookahead changes a chunk only for an MTP drafter looking
        # ahead more than one token (speculative decoding, refused with the feature on);
        # otherwise it only clamps at 0, which the hot path does itself.
        self._base_lookahead = not cfg.enabled or cfg.shadow or self.num_prefill_lookahead > 1
        self._hook_fast = self._record_only = self._hook_charges_sample = self._steady_path = (
            False  # see _reserve_prefill_lookahead
        )
        self._limits = UserLimits(self, cfg)  # R17, R21 (the rates file is watched in every mode)
        self._engine_wait = EngineWait(self)
        self._observation = StepObserver(self)
        if not cfg.enabled:
            log_feature_off(type(self).__name__)  # operator log only; behaviour is the base's
            return  # R18: feature off, every override below defers to the base class
        if cfg.shadow:
            self._observation.start_shadow()  # Decision "Shadow mode": every override defers as with R18
            return
        self._init_collaborators()

    def _init_collaborators(self) -> None:
        """The feature on: the limiter (R1-R5), the caps (R12, R20), the operator log, the
        metrics, the charging, turns and victims, the trace, and R13's PRIORITY wrap."""
        cfg = self.output_rate_config
        self.rate_limiter = limiter = self._limits.make_limiter(cfg)
        self._residency = Residency(self, cfg)
        log_limits(type(self).__name__, cfg, self._residency.active_cap, self.max_num_running_reqs)  # operator log
        self._engine_wait.throttle_log = ThrottleLog(limiter.rate_of)
        self._observation.open_metrics()
        # The hook's short path: the active cap cannot bind, vLLM's hook only clamps at 0,
        # and ``_samples`` (R7) is ours, so it can be inlined.
        self._hook_fast = (
            not self._residency.cap_binds
            and not self._base_lookahead
            and type(self)._samples is _RateLimitMixin._samples
        )
        # R9: the hook is ours too, so in an unconstrained step every charge was made where
        # vLLM's last cap on num_new_tokens left a chunk reaching the sampling position by
        # the sum vLLM's own is_prefill_chunk uses (Charging.settle need not re-read it).
        self._hook_charges_sample = (
            self._hook_fast and type(self)._reserve_prefill_lookahead is _RateLimitMixin._reserve_prefill_lookahead
        )
        # The steady step in line (_steady_schedule): only where no seam it passes by is replaced.
        cls = type(self)
        self._steady_path = self._hook_charges_sample and all(
            getattr(cls, name) is getattr(_RateLimitMixin, name) for name in _STEADY_SEAMS
        )
        self._charging = Charging(self)
        self._turns = Turns(self)
        self._victims = Victims(self)
        self._steps = 0
        self._reset_step_state(0)
        if cfg.trace_path is not None:
            self._observation.open_trace(cfg.trace_path)
        if self.policy == SchedulingPolicy.PRIORITY:
            # R13: vLLM picks a PRIORITY victim inside schedule() right after a failed
            # allocate_slots; wrapping it lets a throttled request of that level go first.
            self._victims.base_allocate_slots = self.kv_cache_manager.allocate_slots
            self.kv_cache_manager.allocate_slots = self._victims.allocate_slots

    def _reset_step_state(self, now_ns: int) -> None:
        """Seam: a new ``StepRecord`` at ``now_ns`` (ns); the hook's shortest path off."""
        step = self._step = StepRecord(now_ns)
        self._record_only = False  # the hook's shortest path: unconstrained and _hook_fast
        self._charge = step.charged.append  # R7, bound for the hot path

    # -- R12: admission cap read by vLLM's waiting loop -------------------------
    @property
    def max_num_active_reqs(self) -> int:
        """R12/R13: vLLM's admission cap (requests); the base's with the feature off (R18)."""
        if getattr(self, "rate_limiter", None) is None:
            return self._base_max_num_active_reqs
        step = self._step
        if step.preempted_for_r13:
            return 0  # R13: like vLLM, admit nothing in a step that preempted
        # R12: admit iff len(running) < M and len(running) - throttled < A.
        return min(self.max_num_running_reqs, self._residency.active_cap + len(step.throttled))

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._base_max_num_active_reqs = value

    # -- R17 ------------------------------------------------------------------
    def _user(self, request: Request) -> str:
        """Seam, R17: ``request``'s user (``UserLimits.user``)."""
        return self._limits.user(request)

    def add_request(self, request: Request) -> None:
        """R17: resolve the identity once, at admission.

        Never raises for a bad identity: an exception here would stop the engine core and
        every request in it. The front end refuses such requests (``plugin.py``); one that
        still arrives is charged to ``__anonymous__`` and logged.
        """
        if self.rate_limiter is not None:
            self._limits.remember(request)
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        if self.rate_limiter is not None:
            rid = request.request_id
            self._limits.forget(rid)
            self._turns.left(rid)  # R14: only running requests take turns
            if self._limits.plan_shadow is not None:  # R29
                self._limits.plan_shadow.freed(rid)
            self._observation.freed(request)
        elif self._observation.shadow is not None:  # shadow mode: forget the request's user
            self._observation.freed(request)
        return super()._free_request(request, *args, **kwargs)

    # -- the step ---------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any):
        limiter = self.rate_limiter
        if limiter is None:
            if self._observation.shadow is not None:
                return self._shadow_schedule(*args, **kwargs)  # shadow mode: the base's schedule
            return super().schedule(*args, **kwargs)  # R18
        now_ns = self.clock_ns()  # R16: one clock read per schedule()
        limits, turns = self._limits, self._turns
        if limits.rates_watcher is not None or limits.pending_rates is not None:
            self._apply_pending_rates(now_ns)  # R21: at the step boundary, this step's clock
        if self._steady_path and self.shortcuts and self._steady(limits, turns, self._charging):
            return self._steady_schedule(now_ns, args, kwargs)
        self._reset_step_state(now_ns)
        step = self._step
        turns.take()  # R14
        step.turn_order = turns.order
        enough, short = self._survey_users()  # R2 at the step's clock, once per user
        stock_order = self._move_throttled_last(short) if short else None  # R11, R13, R14
        if short and self.lora_config is not None and step.throttled_at_start:
            self._free_lora_slot(short)  # R13, LoRA
        self._record_only = step.unconstrained = enough and self._hook_fast and self.shortcuts
        scheduler_output = super().schedule(*args, **kwargs)
        self._commit_grants()  # R2/R7: the charges of this step, into the limiter
        if stock_order is not None:
            self._victims.restore_order(step, stock_order)  # R13: only the choice of victims changed
        turns.running_after_step = len(self.running)  # R14: see Turns.hold
        step.refunded = self._settle(scheduler_output)  # R9
        plan_shadow = limits.plan_shadow
        would = plan_shadow.step(step.now_ns, scheduler_output, self.requests) if plan_shadow else ()
        self._end_step(step, scheduler_output, would)
        return scheduler_output

    def _end_step(self, step: StepRecord, scheduler_output: Any, would: Any) -> None:
        """The end of every step with the feature on: R6's clean-up every
        ``CLEANUP_INTERVAL_STEPS`` steps, the wait hint (R16), the operator log, /metrics and
        the trace (``would``: R29's would-be throttled request ids)."""
        self._steps += 1
        self._step_done(step, scheduler_output, would)

    def _step_done(self, step: StepRecord, scheduler_output: Any, would: Any) -> None:
        """``_end_step`` after its step count: R6's clean-up when due, the wait hint (R16),
        the operator log, /metrics and the trace."""
        if self._steps % CLEANUP_INTERVAL_STEPS == 0:
            limiter = self.rate_limiter
            assert limiter is not None, "called by schedule() with the feature on"
            limiter.cleanup_idle_users(step.now_ns)  # R6
            self._turns.forget_finished(self.requests)  # R15: keeps last_served bounded by the live requests
        self._observe(scheduler_output, step.refunded)
        self._engine_wait.log_step(step.now_ns, step.throttled, self._limits.users)  # operator log (oplog.py)
        self._observation.step_done(step, scheduler_output, would)  # /metrics, trace

    def _steady(self, limits: Any, turns: Any, charging: Any) -> bool:
        """R2/R14/R15 in O(1), after R21's rate change (if any) is installed: this step is a
        steady step, decided as the general path would decide it: the turn order holds with
        every group's last-served stream its last place (``Turns.hold``), the spare grants
        cover every request for one more step (``Charging.survey``'s O(1) path; a rate
        change drops them), and no R29 shadow plan is counted."""
        return (
            charging.spare_steps < charging.margin
            and charging.spare_version == limits.requests_version  # spare_taken == user_requests
            and turns.caught_up
            and not turns.shrunk
            and limits.plan_shadow is None
            and len(turns.order) == len(self.running) == turns.running_after_step
        )

    def _steady_schedule(self, now_ns: int, args: tuple, kwargs: dict):
        """``schedule()`` for a steady step (``_steady``): the general path without its turn
        order, survey and throttling calls, whose O(1) branches ``_steady`` has decided
        (``_steady_path``: no seam passed by is replaced; tests/test_shortcuts.py runs both
        paths side by side, step by step). Nobody can be refused (R2), so the hook only
        records charges (R7) and nothing is throttled. Where every request was charged and
        dispatched (the usual steady step), the end of the step is also in line: the
        charges as the last step's (``take_steady``), nothing to refund (R9), no wait hint
        (R16), and the operator log, R6's clean-up, /metrics and the trace only when due or
        on (``_step_done``)."""
        step = self._step = StepRecord(now_ns)
        step.unconstrained = step.steady = self._record_only = True  # R2: nobody can be refused
        self._charge = step.charged.append  # R7
        turns, charging = self._turns, self._charging
        step.turn_order = turns.order  # R14: the order held
        scheduler_output = super().schedule(*args, **kwargs)
        turns.running_after_step = len(self.running)  # R14: see Turns.hold
        if charging.all_served(step, scheduler_output.num_scheduled_tokens) and turns.caught_up:
            # Every request charged and dispatched. R2/R7: the same counts as the last step
            # (Charging.commit's steady branch). R9: none to refund (step.refunded stays
            # empty), as settle's all-served branch finds; R15: every group's last served
            # already its last place (turns.caught_up).
            charging.commit_steady(step)
            self._steps += 1
            observation = self._observation
            if (
                self._steps % CLEANUP_INTERVAL_STEPS
                and observation.metrics is None
                and observation.trace is None
                and self._engine_wait.steady_step_done(step)
            ):
                observation.cache = None  # what _step_done leaves after a step nobody was refused in
            else:
                self._step_done(step, scheduler_output, ())
            return scheduler_output
        charging.commit(step)  # R2/R7: the step's charges into the limiter
        step.refunded = charging.settle(step, scheduler_output)  # R9: the single refund point
        self._end_step(step, scheduler_output, ())
        return scheduler_output

    def _shadow_schedule(self, *args: Any, **kwargs: Any):
        """Shadow mode: vLLM's ``schedule()``, then count what would have been throttled
        (``StepObserver.shadow_step``) at this step's one clock reading (R16)."""
        now_ns = self.clock_ns()  # R16: one clock read per schedule()
        limits = self._limits
        if limits.rates_watcher is not None or limits.pending_rates is not None:
            self._apply_pending_rates(now_ns)  # R21: the shadow limiter's rates too
        scheduler_output = super().schedule(*args, **kwargs)
        self._observation.shadow_step(now_ns, scheduler_output)
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
        self._limits.queue_rates(default_tokens_per_s, dict(user_tokens_per_s or {}))

    def _apply_pending_rates(self, now_ns: int) -> None:
        """Seam, R21: install a queued table or a changed rates file at ``now_ns``
        (``UserLimits.apply_pending_rates``)."""
        self._limits.apply_pending_rates(now_ns)

    # -- after the step, between steps ------------------------------------------
    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        if not self.requests:
            self._observation.note_if_idle()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        result = super().finish_requests(*args, **kwargs)
        self._observation.note_if_idle()
        return result

    def shutdown(self) -> None:
        self._observation.close()
        super().shutdown()

    # -- the sampling decision (R7, R10-R12): vLLM's last cap on num_new_tokens ---------
    def _samples(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Seam, R7: the chunk reaches the sampling position (prompt + outputs + placeholders)."""
        return num_computed_tokens + num_new_tokens >= request.num_tokens + request.num_output_placeholders

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """R7, R10, R11, R12: the sampling decision for one (step, request); see module docstring.

        Called by vLLM once per request that reaches the end of the running or waiting loop;
        returns the tokens it may schedule (0: skip it this step). This is the hottest code
        of the feature (once per running request per step): charges count down a per-user
        allowance taken from the limiter once per step (``Charging.grants_left``) and are
        written back to the limiter in one operation per user after vLLM's loops
        (``Charging.commit``). The common configuration (no binding active cap, no MTP
        drafter, ``_samples`` not replaced) takes the short path below; ``_reserve_general``
        is the same decision with every case handled.
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
        step = self._step
        if self.shortcuts and request.request_id in step.skipped_at_start:
            return 0  # R11/R14: throttled at the step start; _refuse would skip it the same way
        end = request.num_tokens + request.num_output_placeholders
        if num_computed_tokens + num_new_tokens < end:
            return num_new_tokens  # R7: a prefill chunk that does not sample is not charged
        limits = self._limits
        user = limits.users.get(request.request_id) or limits.user(request)
        grants = step.grants
        left = grants.get(user)
        if left is None:
            left = self._charging.grants_left(step, user)
        if left and not (step.held and request.request_id in step.held):  # R14: its turn
            grants[user] = left - 1
            step.charged.append(request)  # R7: charged at dispatch
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
        step = self._step
        is_running = request.status is _RUNNING
        if is_running and len(step.scheduled_running) >= self._residency.active_cap:
            return 0  # R12: the step's batch already holds A running requests
        end = request.num_tokens + request.num_output_placeholders
        if self._samples(request, num_computed_tokens, num_new_tokens):  # R7: this chunk samples
            user = self._limits.user(request)
            if self._charging.grants_left(step, user) and not (step.held and request.request_id in step.held):  # R14
                step.grants[user] -= 1
                step.charged.append(request)  # R7: charged at dispatch
            else:
                num_new_tokens = self._refuse(request, user, num_computed_tokens, num_new_tokens, end)
        if num_new_tokens and is_running:
            step.scheduled_running.add(request.request_id)
        return num_new_tokens

    def _refuse(self, request: Request, user: str, num_computed_tokens: int, num_new_tokens: int, end: int) -> int:
        """Seam, R10/R11: ``user`` is refused (``Charging.refuse``): tokens to schedule, 0: skip."""
        return self._charging.refuse(self._step, request, user, num_computed_tokens, num_new_tokens, end)

    # -- seams of the step's collaborators (a subclass changes one rule here) -------------
    def _grants_left(self, user: str) -> int:
        """Seam, R2: grants ``user`` may still receive in this step (``Charging.grants_left``)."""
        return self._charging.grants_left(self._step, user)

    def _survey_users(self) -> tuple[bool, dict[str, int]]:
        """Seam, R2: ``(enough, short)`` at the step's clock reading (``Charging.survey``)."""
        return self._charging.survey(self._step)

    def _commit_grants(self) -> None:
        """Seam, R2/R7: the step's charges into the limiter (``Charging.commit``)."""
        self._charging.commit(self._step)

    def _settle(self, scheduler_output) -> list[str]:
        """Seam, R9: the single refund point (``Charging.settle``); the refunded request ids."""
        return self._charging.settle(self._step, scheduler_output)

    def _record_last_served(self, ids: list[str]) -> None:
        """Seam, R15: the last-served stream per group of the dispatched charges ``ids``
        (``Turns.record_last_served``)."""
        self._turns.record_last_served(ids)

    def _turn_order(self, streams: list[Request]) -> list[Request]:
        """Seam, R14: one user's running requests in this step's turn order (``Turns.turn_order``)."""
        return self._turns.turn_order(streams)

    def _move_throttled_last(self, short: dict[str, int]) -> list[Request] | None:
        """Seam, R11/R13/R14: throttle at the step start and move last
        (``Victims.move_throttled_last``); the order before the move, or None."""
        return self._victims.move_throttled_last(self._step, short)

    def _free_lora_slot(self, short: dict[str, int]) -> None:
        """Seam, R13 (LoRA): preempt the throttled holders of a needed adapter slot (``Victims.free_lora_slot``)."""
        self._victims.free_lora_slot(self._step, short)

    def _observe(self, scheduler_output, refunded: list[str]) -> None:
        """Seam, R16: the step is over: its wait hint (``EngineWait.step_done``); the
        observation dict is built only when read."""
        self._engine_wait.step_done(self._step, self.rate_limiter)
        self._observation.cache = None

    # -- the waiting loop (R10, R13, R20, V8) -------------------------------------------
    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        if self.rate_limiter is None:
            return True
        if self._residency.per_user_cap is not None and not self._below_residency_cap(request):
            return False  # R20: its user holds its cap of running requests; skipped, later ones still looked at
        step = self._step
        if not step.unconstrained:
            user = self._limits.user(request)
            if not self._charging.grants_left(step, user):
                step.refused_users.add(user)
                if not self._refused_may_proceed(request):
                    return False
                if self._residency.takes_new_lora_slot(request):
                    return False  # R13: a refused user takes no new adapter slot
        # V8 (0.32): skipped like vLLM's own max_loras skip.
        return self.vllm_profile.loras_counted_over_all_running or not self._lora_would_exceed(request)

    def _below_residency_cap(self, request: Request) -> bool:
        """Seam, R20: ``request``'s user is below ``max_num_seqs_per_user`` (``Residency.below_cap``)."""
        return self._residency.below_cap(self._step, request)

    def _refused_may_proceed(self, request: Request) -> bool:
        """Seam, R10: a refused user's waiting request may prefill short of sampling
        (``Residency.refused_may_proceed``)."""
        return self._residency.refused_may_proceed(request)

    def _lora_would_exceed(self, request: Request) -> bool:
        """Seam, V8: admitting ``request`` would exceed ``max_loras`` (``Residency.lora_would_exceed``)."""
        return self._residency.lora_would_exceed(request)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if self.rate_limiter is not None:
            step, rid = self._step, request.request_id
            step.scheduled_running.discard(rid)
            step.throttled.discard(rid)
            self._turns.left(rid)  # R14: only running requests take turns
            step.left_running += 1
        return super()._preempt_request(request, *args, **kwargs)

    # -- what the engine loop and the white box read ------------------------------------
    @property
    def last_step_observation(self) -> dict[str, Any] | None:
        """The white-box observation of the last ``schedule()`` (docs/OBSERVATION.md;
        ``StepObserver.last_step_observation``); None with the feature off or before a step."""
        return self._observation.last_step_observation()

    def next_ready_ns(self) -> int | None:
        """R16: earliest ready time among users refused in the last step, ns (None: none)."""
        wait = getattr(self, "_engine_wait", None)
        return None if wait is None else wait.next_ready_ns()

    def operator_log_due_ns(self) -> int | None:
        """Operator log (``oplog.py``): when the throttled-users line counted so far is due,
        in ns of ``clock_ns`` (None: nothing pending, or the feature off). The engine loop
        wakes for it while it waits for budget or idles (``reference/plugin.py``)."""
        wait = getattr(self, "_engine_wait", None)
        return None if wait is None else wait.operator_log_due_ns()

    def flush_operator_log(self, now_ns: int | None = None) -> bool:
        """Operator log: write the throttled-users line if it is due at ``now_ns`` (ns of
        ``clock_ns``; default: now), between ``schedule()`` calls. True if a line was written."""
        wait = getattr(self, "_engine_wait", None)
        return False if wait is None else wait.flush_operator_log(now_ns)


class RateLimitedScheduler(_RateLimitMixin, Scheduler):
    """vLLM (0.32.0, 0.33.0) ``Scheduler`` with per-user output-rate limiting (R6-R18)."""


class RateLimitedAsyncScheduler(_RateLimitMixin, AsyncScheduler):
    """vLLM (0.32.0, 0.33.0) ``AsyncScheduler`` with per-user output-rate limiting (R6-R18, P5)."""
