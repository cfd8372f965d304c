"""A catalogue of deliberately wrong schedulers the gate must reject (``outrate conform --mutants``).

Each mutant is a small subclass of the reference scheduler that breaks exactly one rule,
named in ``MUTANTS`` with the rule it breaks. A gate that passes any of them has a blind
spot. Mutants that only misbehave in async mode subclass the async reference and are run
only by the async checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_output_rate.adapter.harness import load_class
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.scheduler import RateLimitedAsyncScheduler, RateLimitedScheduler


# -- R7: charge on dispatch of sampling steps only ---------------------------------------
class ChargePromptChunks(RateLimitedScheduler):
    """R7 broken: intermediate prefill chunks are charged too.

    Slip: the sampling test of the charge point dropped, so every scheduled chunk costs a token.

    A defect at level exact only (``Mutant.level`` "exact"): on vLLM's schedulers it is
    step for step the reference from the outside. A chunk that does not sample is one the
    token budget cut short (nothing else caps it below the prompt's end), so it spends the
    rest of the step's budget: no later request of the step can miss the grant it took, and
    R9 refunds that charge at the step's end, leaving the TAT where the reference leaves it
    (a take and its refund only lift a TAT behind the clock up to now, which grants the
    same). A refused chunk is capped at n - 1 (R10), which an intermediate chunk is
    already below. Only the observation (``charged``/``refunded``) shows the charge.
    Measured: no difference in ``num_scheduled_tokens``, sampling dispatches or
    preemptions on 348 scenarios (boundaries, pressured, ample; seed 1).
    """

    def _samples(self, request, num_computed_tokens, num_new_tokens):
        return True


class ChargeFirstChunkInstead(RateLimitedScheduler):
    """R7 broken: a prefill is charged at its first chunk, not at the chunk that samples.

    Slip: the charge placed where a request is admitted (its first chunk) instead of where it samples.
    """

    def _samples(self, request, num_computed_tokens, num_new_tokens):
        if request.num_output_tokens == 0 and request.num_output_placeholders == 0:
            return num_computed_tokens == 0
        return super()._samples(request, num_computed_tokens, num_new_tokens)


class ChargeOnModelOutput(RateLimitedAsyncScheduler):
    """R7 broken (async): the limiter is only asked at dispatch; the charge happens on model
    output. In sync mode that is the spec's outcome (the output arrives before the next
    ``schedule()``); with async scheduling the next step is decided before the last one's
    charges are taken, so a user gets more than its rate.

    Slip: charging settled in update_from_output (after the model ran), as a patch written
    for synchronous scheduling would, run with async scheduling.
    """

    def _commit_grants(self):
        return None  # decided at dispatch, but nothing taken there

    def _settle(self, scheduler_output):
        # Nothing was taken, so nothing to refund; R15's last-served streams are kept as the
        # reference keeps them (the slip is the charge point alone).
        scheduled = scheduler_output.num_scheduled_tokens
        self._record_last_served(
            [r.request_id for r in self._step.charged if r.request_id in scheduled and not r.is_prefill_chunk]
        )
        self._step.charged = []
        return []

    def update_from_output(self, scheduler_output, model_runner_output):
        if self.rate_limiter is None:  # the feature off: nothing to charge (R18 is not this slip)
            return super().update_from_output(scheduler_output, model_runner_output)
        for req_id, tokens in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if tokens and request is not None:
                self._force_take(self._user(request))
        return super().update_from_output(scheduler_output, model_runner_output)

    def _force_take(self, user: str) -> None:
        _take_regardless(self, user)


def _take_regardless(scheduler: RateLimitedScheduler, user: str) -> None:
    """One token taken from ``user``'s GCRA at the scheduler's last clock reading, granted
    or not (a refused take still advances the TAT by one emission interval)."""
    limiter = scheduler.rate_limiter
    assert limiter is not None, "a mutant of the feature on"
    if not limiter.try_take(user, scheduler._step.now_ns):
        limiter._tat[user] += (limiter._scales.get(user) or limiter._default).inc
    scheduler._charging.forget_spare()  # the last step's spare grants no longer hold


class TwoChargesInAsync(RateLimitedAsyncScheduler):
    """R7 broken (async): a request is charged twice for one dispatch in a step.

    Slip: in async mode the lookahead of the in-flight placeholder charged as a second dispatch.
    """

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        before = len(self._step.charged) if self.rate_limiter is not None else 0
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if (
            self.rate_limiter is not None
            and len(self._step.charged) > before
            and request.num_output_placeholders
            and self.rate_limiter.try_take(self._user(request), self._step.now_ns)
        ):
            self._step.charged.append(request)
        return n


class ChargeAbortInFlight(RateLimitedAsyncScheduler):
    """R7 broken (async): a request aborted while its step is in flight is charged once more.

    Slip: in async mode the abort path "settles" the step still in flight by taking a token
    for it, although that step was charged when it was dispatched (R7: one charge per
    dispatch; R8: a cancelled step stays charged, once). The user pays twice, so its other
    streams pause while the GCRA still grants them: an under-grant. Sync mode has no step in
    flight at an abort, and only the scenarios under pressure abort.
    """

    def finish_requests(self, request_ids, finished_status):
        if self.rate_limiter is not None and finished_status == RequestStatus.FINISHED_ABORTED:
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                request = self.requests.get(rid)
                if request is not None and request.num_output_placeholders > 0:
                    _take_regardless(self, self._user(request))
        return super().finish_requests(request_ids, finished_status)


# -- R9: the single refund point ----------------------------------------------------------
class NoRefund(RateLimitedScheduler):
    """R9 broken: charges of requests that were not dispatched are kept.

    Slip: the end-of-schedule() refund loop deleted as dead code.
    """

    def _settle(self, scheduler_output):
        keep_refund = self.rate_limiter.refund
        self.rate_limiter.refund = lambda user: None
        try:
            super()._settle(scheduler_output)
        finally:
            self.rate_limiter.refund = keep_refund
        return []


class DoubleRefund(RateLimitedScheduler):
    """R9 broken: an undispatched charge is refunded twice.

    Slip: a second refund of the same undispatched charge (two code paths both undo it).
    """

    def _settle(self, scheduler_output):
        refunded = super()._settle(scheduler_output)
        for req_id in refunded:
            self.rate_limiter.refund(self._limits.users.get(req_id, "__anonymous__"))
        return refunded + refunded


class RefundDispatched(RateLimitedScheduler):
    """R9 broken: the first dispatched charge of each step is refunded as well.

    Slip: an off-by-one in the refund loop that also undoes the first dispatched charge.
    """

    def _settle(self, scheduler_output):
        refunded = super()._settle(scheduler_output)
        dispatched = [r for r in self._step.charged if r.request_id not in refunded]
        if dispatched:
            self.rate_limiter.refund(self._user(dispatched[0]))
            refunded.append(dispatched[0].request_id)
        return refunded


# -- R10: throttled prefill ---------------------------------------------------------------
class HeadOfLineBlocking(RateLimitedScheduler):
    """R10 broken: a refused user's waiting request stops admission of later ones.

    Slip: a refused waiting request ends the waiting loop (head-of-line blocking of other users).

    vLLM 0.32 itself stops admission at a waiting request given 0 tokens, 0.33 only skips
    it (docs/SPEC.md "vLLM versions", V8); so the stop is made here, on both releases: the
    first refused waiting request that cannot advance without sampling ends admission for
    the step (the admission cap drops to 0), as 0.32 does without the reference's skip.

    A defect at level exact only: where a waiting request's user is checked is the
    article's open choice (docs/SPEC.md "What the article leaves open"); the article's own
    mechanism has the same head-of-line stop, so at must and should this is a correct
    implementation (``Mutant.level`` "exact": a hunt below exact skips it).
    """

    def _reset_step_state(self, now_ns: int) -> None:
        super()._reset_step_state(now_ns)
        self._admission_stopped = False

    @property
    def max_num_active_reqs(self) -> int:
        if getattr(self, "_admission_stopped", False):
            return 0
        return super().max_num_active_reqs

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._base_max_num_active_reqs = value

    def _handle_blocked_waiting_request(self, request):
        if not Scheduler._handle_blocked_waiting_request(self, request):
            return False
        if self.rate_limiter is None or self._step.unconstrained:
            return True
        user = self._user(request)
        if self._grants_left(user):
            return True
        self._step.refused_users.add(user)
        chunked = self.scheduler_config.enable_chunked_prefill
        if chunked and request.num_computed_tokens < request.num_tokens - 1:
            return True  # it can still advance short of sampling (R10)
        self._admission_stopped = True  # the broken part: nothing after it is admitted
        return False


class NoPrefillAdvance(RateLimitedScheduler):
    """R10 broken: with chunked prefill, a refused prefill waits instead of advancing to n-1.

    Slip: the n-1 prefill advance left out: a refused prefill gets 0 tokens.
    """

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        sample_pos = request.num_tokens + request.num_output_placeholders
        if self.rate_limiter is not None and 0 < n < num_new_tokens and num_computed_tokens + n == sample_pos - 1:
            self._step.scheduled_running.discard(request.request_id)
            if request.status == RequestStatus.RUNNING:
                self._step.throttled.add(request.request_id)
            return 0
        return n


# -- R11: skip, keep resident ---------------------------------------------------------------
class DropThrottled(RateLimitedScheduler):
    """R11 broken: throttled running requests are preempted (KV freed, recompute later).

    Slip: freeing the KV of a request that cannot run this step (preempting it).
    """

    def schedule(self, *args: Any, **kwargs: Any):
        output = super().schedule(*args, **kwargs)
        if self.rate_limiter is not None:
            for request in list(self.running):
                if request.request_id in self._step.throttled and request.request_id not in output.num_scheduled_tokens:
                    self.running.remove(request)
                    self._preempt_request(request, 0.0)
        return output


# -- R12: skip-not-count --------------------------------------------------------------------
class ThrottledCountTowardCap(RateLimitedScheduler):
    """R12 broken: throttled requests still count toward the active cap when admitting.

    Slip: the admission cap left at A instead of A + throttled.
    """

    @property
    def max_num_active_reqs(self) -> int:
        if getattr(self, "rate_limiter", None) is None:
            return self._base_max_num_active_reqs
        return min(self.max_num_running_reqs, self._residency.active_cap)

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._base_max_num_active_reqs = value


class NoActiveCapInRunningLoop(RateLimitedScheduler):
    """R12 broken: the running loop schedules every running request, ignoring A.

    Slip: the running loop's count of served requests reset at every request.
    """

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        if self.rate_limiter is not None:
            self._step.scheduled_running.clear()
        return super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)


# -- R13: preferred victims ------------------------------------------------------------------
class ThrottledNotPreferredVictims(RateLimitedScheduler):
    """R13 broken: vLLM's own victim choice, throttled or not.

    Slip: the preferred-victim reordering removed: vLLM's own last-running victim.
    """

    def _move_throttled_last(self, refused):
        running = list(self.running)
        stock = super()._move_throttled_last(refused)
        if stock is not None:
            self.running[:] = running
        return None


# -- R14/R15: rotation -------------------------------------------------------------------------
class NoRotation(RateLimitedScheduler):
    """R14 broken: same-user streams are served in list order; the first one starves the rest.

    Slip: the rotation at the start of schedule() never called.
    """

    def _turn_order(self, streams):
        return list(streams)


# -- R1/R2/R3/R5/R6: the limiter ----------------------------------------------------------------
class _LimiterSlip(RateLimitedScheduler):
    """A mutant whose slip is all in its limiter: the reference's set-up, then (with the
    feature on) ``rate_limiter`` replaced by ``_limiter(output_rate_config)``, by default
    ``limiter_cls`` built with the configured default rate, overrides and burst (ns)."""

    limiter_cls: type[OutputRateLimiter] = OutputRateLimiter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.rate_limiter is not None:
            self.rate_limiter = self._limiter(self.output_rate_config)

    def _limiter(self, cfg: Any) -> OutputRateLimiter:
        return self.limiter_cls(cfg.default_rate, cfg.user_rates, cfg.burst_ns)


class BurstOneSecond(_LimiterSlip):
    """R1 broken: burst tolerance tau of 1 s instead of 100 ms.

    Slip: the burst configured in the wrong unit (1 s instead of 100 ms).
    """

    def _limiter(self, cfg: Any) -> OutputRateLimiter:
        return OutputRateLimiter(cfg.default_rate, cfg.user_rates, 1_000_000_000)


class _RollingWindowLimiter(OutputRateLimiter):
    """A rolling one-second window of ``rate`` grants per user instead of GCRA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grants: dict[str, list[int]] = {}

    def try_take(self, user, now_ns):
        grants = [t for t in self._grants.get(user, []) if t > now_ns - 1_000_000_000]
        if len(grants) >= max(1, int(self.rate_of(user))):
            self._grants[user] = grants
            return False
        grants.append(now_ns)
        self._grants[user] = grants
        return super().try_take(user, now_ns) or True

    def allows(self, user, now_ns):
        return self.grants_at(user, now_ns) > 0

    def grants_at(self, user, now_ns):
        grants = [t for t in self._grants.get(user, []) if t > now_ns - 1_000_000_000]
        return max(0, max(1, int(self.rate_of(user))) - len(grants))

    def take_counts(self, counts, now_ns):  # also what take_many calls
        for user, count in counts.items():
            for _ in range(count):
                self.try_take(user, now_ns)


class RollingWindow(_LimiterSlip):
    """R2 broken: a rolling one-second window (bursty) instead of GCRA pacing.

    Slip: a rolling one-second window counter instead of GCRA.
    """

    limiter_cls = _RollingWindowLimiter


class _FloorReadyLimiter(OutputRateLimiter):
    def ready_at_ns(self, user):
        ready = super().ready_at_ns(user)  # ceil((TAT - tau) / p)
        s = self._scales.get(user) or self._default
        if ready is not None and ready * s.p != self._tat[user] - s.burst:
            ready -= 1  # the floor: 1 ns early wherever (TAT - tau) / p is not a whole ns
        return ready


class ReadyAtRoundedDown(_LimiterSlip):
    """R5 broken: ready_at (and so the wait hint) rounded down instead of up.

    Slip: floor division in ready_at (the wait hint names an instant 1 ns early).
    """

    limiter_cls = _FloorReadyLimiter


class _EagerCleanupLimiter(OutputRateLimiter):
    def cleanup_idle_users(self, now_ns):
        doomed = [u for u in self._tat if self.allows(u, now_ns)]
        for user in doomed:
            del self._tat[user]
        return len(doomed)


class CleanupActiveUsers(_LimiterSlip):
    """R6 broken: cleanup deletes users whose TAT is still ahead of now (within tau).

    Slip: "idle" taken as "allowed now" (TAT - now <= tau) instead of TAT <= now.
    """

    limiter_cls = _EagerCleanupLimiter


class BudgetPerRequest(RateLimitedScheduler):
    """R1 broken (P2): one budget (one TAT) per request instead of one per user.

    Slip: the bucket keyed by request id instead of user id.
    """

    @staticmethod
    def _resolve_user(request):
        return request.request_id


class IdentityFromOpenAIUserField(RateLimitedScheduler):
    """R17 broken: identity read from a ``user`` key (the OpenAI field), not ``output_rate_user``.

    Slip: identity read from the OpenAI ``user`` field instead of ``extra_args["output_rate_user"]``.
    """

    @staticmethod
    def _resolve_user(request):
        extra = request.sampling_params.extra_args or {}
        user = extra.get("user")
        return user if isinstance(user, str) else "__anonymous__"


class OverridesIgnored(_LimiterSlip):
    """R1 broken: per-user overrides ignored; everyone gets the default rate (R1: a user's
    rate is its override or the default).

    Slip: the per-user override map parsed but never passed to the limiter.
    """

    def _limiter(self, cfg: Any) -> OutputRateLimiter:
        return OutputRateLimiter(cfg.default_rate, None, cfg.burst_ns)


# -- R16: wait hint --------------------------------------------------------------------------------
class WaitHintFromLatestUser(RateLimitedScheduler):
    """R16 broken: the wait hint is the latest ready time among refused users, not the earliest.

    Slip: max() instead of min() over the refused users' ready times, in the hint the engine waits on.
    """

    def _observe(self, scheduler_output, refunded):
        super()._observe(scheduler_output, refunded)
        ready = [self.rate_limiter.ready_at_ns(u) for u in self._step.refused_users]
        ready = [t for t in ready if t is not None]
        self._step.wait_hint_ns = max(ready) if ready else None  # what next_ready_ns() gives the engine


@dataclass(frozen=True)
class Mutant:
    """One catalogue entry.

    ``cls``: dotted path of the mutant (the async class when ``async_only``);
    ``async_cls``: its async variant, if the slip is built for both modes (None and not
    ``async_only``: judged in sync mode only); ``rule``: the rule the slip breaks;
    ``style``: the ``--config-style`` its users configure it with (None:
    ``additional_config["output_rate"]``); ``integer_rates``: it takes integer rates only;
    ``base_cls`` / ``base_async_cls``: the unmutated classes it is a slip of (a
    counterexample must pass on them); ``boundary``: the boundary of issue 18 item 1 the
    slip sits on, if any; ``level``: the lowest conformance level at which the slip is a
    defect (a hunt at a lower level skips it: there it is a correct implementation, e.g.
    an open choice of the article that only ``exact`` decides). The class docstring's
    ``Slip:`` line says which slip of a real patch it models.
    """

    name: str
    rule: str
    cls: str
    async_only: bool = False
    async_cls: str | None = None
    style: str | None = None
    integer_rates: bool = False
    base_cls: str | None = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
    base_async_cls: str | None = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
    boundary: str | None = None
    level: str = "must"

    def load(self) -> type:
        """The mutant class (imports its module)."""
        return load_class(self.cls)


def _entry(cls: type, rule: str, async_only: bool = False, boundary: str | None = None, level: str = "must") -> Mutant:
    return Mutant(cls.__name__, rule, f"{__name__}.{cls.__name__}", async_only, boundary=boundary, level=level)


MUTANTS: tuple[Mutant, ...] = (
    _entry(ChargePromptChunks, "R7", level="exact"),  # black-box equivalent to the reference
    _entry(ChargeFirstChunkInstead, "R7"),
    _entry(ChargeOnModelOutput, "R7", async_only=True),
    _entry(TwoChargesInAsync, "R7", async_only=True),
    _entry(ChargeAbortInFlight, "R7", async_only=True),
    _entry(NoRefund, "R9"),
    _entry(DoubleRefund, "R9"),
    _entry(RefundDispatched, "R9"),
    _entry(HeadOfLineBlocking, "R10", level="exact"),  # the article's open choice below exact
    _entry(NoPrefillAdvance, "R10", level="should"),
    _entry(DropThrottled, "R11"),
    _entry(ThrottledCountTowardCap, "R12"),
    _entry(NoActiveCapInRunningLoop, "R12", level="should"),
    _entry(ThrottledNotPreferredVictims, "R13", level="should"),
    _entry(NoRotation, "R14"),
    _entry(BurstOneSecond, "R1"),
    _entry(RollingWindow, "R2"),
    _entry(ReadyAtRoundedDown, "R5", level="should"),
    _entry(CleanupActiveUsers, "R6"),
    _entry(BudgetPerRequest, "R1"),
    _entry(IdentityFromOpenAIUserField, "R17"),
    _entry(OverridesIgnored, "R1"),
    _entry(WaitHintFromLatestUser, "R16", level="should"),
)
