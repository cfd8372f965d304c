"""``RateLimitedScheduler``: per-user output-rate limiting inside stock vLLM 0.32.0.

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

Source: semantics.md R7-R18; seed article, "Scheduler" section.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.reference.config import OutputRateConfig, check_engine_supported, parse_output_rate
from vllm_output_rate.reference.identity import ANONYMOUS_USER, validate_extra_args
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.trace import TraceWriter

CLEANUP_INTERVAL_STEPS = 256  # R6
logger = logging.getLogger(__name__)


def user_of(request: Request) -> str:
    """R17: the rate-limit identity of a request (see ``identity.py``).

    Raises:
        ValueError: bad ``output_rate_user`` value, naming it.
    """
    params = request.sampling_params
    return validate_extra_args(params.extra_args if params is not None else None)


class _RateLimitMixin:
    """The rules R6-R18 layered on a vLLM V1 scheduler class (see module docstring)."""

    # -- construction ---------------------------------------------------------
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Parsed and checked before vLLM builds anything (KV manager, connectors): a bad or
        # unsupported configuration stops start-up with one message saying what to change.
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        additional = vllm_config.additional_config or {}
        output_rate_config = parse_output_rate(
            additional.get("output_rate") if isinstance(additional, dict) else None
        )
        if output_rate_config.enabled:  # R18: feature off, no checks at all
            check_engine_supported(vllm_config)
        super().__init__(*args, **kwargs)
        self.output_rate_config: OutputRateConfig = output_rate_config
        # R16: the only clock; the gate replaces it with its fake clock.
        self.clock_ns: Callable[[], int] = time.monotonic_ns
        self.rate_limiter: OutputRateLimiter | None = None
        self._trace: TraceWriter | None = None  # engine-side event trace (reference/trace.py)
        if not self.output_rate_config.enabled:
            return  # R18: feature off, every override below defers to the base class
        cfg = self.output_rate_config
        self.rate_limiter = OutputRateLimiter(cfg.default_rate, cfg.user_rates, cfg.burst_ns)
        # R12: with the feature on, max_num_active_seqs means "requests in a step's batch".
        self._active_cap = min(
            cfg.max_num_active_seqs or self.scheduler_config.max_num_active_seqs or self.max_num_running_reqs,
            self.max_num_running_reqs,
        )
        self._user_cache: dict[str, str] = {}  # request id -> user (R17, resolved once)
        self._last_served: dict[tuple[str, int], str] = {}  # (user, priority) -> request id (R15)
        self._steps = 0
        self._reset_step_state(0)
        if cfg.trace_path is not None:
            self._trace = TraceWriter(cfg.trace_path, {
                "scheduler": type(self).__name__,
                "async_scheduling": isinstance(self, AsyncScheduler),
                "default_tokens_per_s": str(cfg.default_rate),
                "user_tokens_per_s": {u: str(r) for u, r in cfg.user_rates.items()},
                "burst_ns": cfg.burst_ns,
            })
        if self.policy == SchedulingPolicy.PRIORITY:
            # R13: vLLM picks a PRIORITY victim inside schedule() right after a failed
            # allocate_slots; wrapping it lets a throttled request of that level go first.
            self._base_allocate_slots = self.kv_cache_manager.allocate_slots
            self.kv_cache_manager.allocate_slots = self._allocate_slots_throttled_victims_first

    def _reset_step_state(self, now_ns: int) -> None:
        self._now_ns = now_ns
        self._charged: list[Request] = []  # R7: in charge order
        self._refused_users: set[str] = set()  # users refused in this step: not asked again
        self._throttled: set[str] = set()  # running requests refused and skipped (R11)
        self._scheduled_running: set[str] = set()  # running requests given tokens (R12)
        self._throttled_at_start: list[Request] = []  # R13: preferred victims of this step
        self._preempted_for_r13 = False  # R13: we preempted; the waiting loop must not run

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
            user = self._user_cache[request.request_id] = self._resolve_user(request)
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
            self._user_cache[request.request_id] = self._resolve_user(request)
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        if self.rate_limiter is not None:
            self._user_cache.pop(request.request_id, None)
            if self._trace is not None:
                self._trace.note_freed(request.request_id, request.status.name, request.num_output_tokens)
        return super()._free_request(request, *args, **kwargs)

    # -- the step ---------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any):
        if self.rate_limiter is None:
            return super().schedule(*args, **kwargs)  # R18
        self._reset_step_state(self.clock_ns())  # R16: one clock read per schedule()
        self._rotate_running()  # R14
        stock_order = self._move_throttled_last()  # R13
        scheduler_output = super().schedule(*args, **kwargs)
        if stock_order is not None:
            self._restore_order(stock_order)  # R13: only the choice of victims changed
        refunded = self._settle(scheduler_output)  # R9
        self._steps += 1
        if self._steps % CLEANUP_INTERVAL_STEPS == 0:
            self.rate_limiter.cleanup_idle_users(self._now_ns)  # R6
            # R15: forget streams that left the scheduler (rotation ignores them anyway),
            # so this map stays bounded by the live requests.
            self._last_served = {k: rid for k, rid in self._last_served.items() if rid in self.requests}
        self._observe(scheduler_output, refunded)
        if self._trace is not None:
            self._trace_step(scheduler_output, refunded)
        return scheduler_output

    # -- the engine-side event trace (output_rate.trace_path; reference/trace.py) -------
    def _trace_step(self, scheduler_output, refunded: list[str]) -> None:
        """One trace line from this step's own data (charges, refunds, throttled, batch)."""
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
        self._trace.write_step(self._steps - 1, self._now_ns, requests, charged, refunded,
                               sorted(scheduler_output.preempted_req_ids), len(self.running),
                               len(self.waiting), len(self.rate_limiter))

    def _trace_if_idle(self) -> None:
        if self._trace is not None and not self.requests:
            self._trace.idle(self.clock_ns())

    def update_from_output(self, *args: Any, **kwargs: Any):
        outputs = super().update_from_output(*args, **kwargs)
        if self._trace is not None:
            self._trace_if_idle()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any):
        result = super().finish_requests(*args, **kwargs)
        if self._trace is not None:
            self._trace_if_idle()
        return result

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
        super().shutdown()

    def _rotate_running(self) -> None:
        """R14: same-user same-priority streams: the one after the last served goes first.

        Only the slots these streams occupy are permuted; all others keep their place.
        If the last-served stream is no longer running, that group keeps its order.
        """
        groups: dict[tuple[str, int], list[int]] = {}
        running, cache = self.running, self._user_cache
        for index, request in enumerate(running):
            user = cache.get(request.request_id) or self._user(request)
            groups.setdefault((user, request.priority), []).append(index)
        for key, slots in groups.items():
            last = self._last_served.get(key)
            if last is None or len(slots) < 2:
                continue
            members = [running[i] for i in slots]
            pos = next((k for k, r in enumerate(members) if r.request_id == last), None)
            if pos is None or pos == len(members) - 1:
                continue
            rotated = members[pos + 1 :] + members[: pos + 1]
            for slot, request in zip(slots, rotated):
                running[slot] = request

    def _move_throttled_last(self) -> list[Request] | None:
        """R13: stable-move the requests throttled at the step start to the end of ``running``.

        Throttled at the start: the user is refused at ``now`` (a refusal holds for the
        whole step, grants only push TAT up), only the sampling position is left (R10) and
        its last output is not already in flight (async: vLLM skips those itself). The
        running loop skips them anyway; the move changes only vLLM's victims (FCFS:
        ``running[-1]``; PRIORITY: see ``_allocate_slots_throttled_victims_first``).
        They are recorded as throttled (R11/R12) and their users as refused (R16) even if
        the active cap stops the running loop before it reaches them. Returns the order
        before the move, or None if nothing moved.
        """
        running = self.running
        limiter, now = self.rate_limiter, self._now_ns
        # One allows() per known user, not per request; nothing to scan if nobody is refused.
        refused = {u for u in limiter.users() if not limiter.allows(u, now)}
        if not refused:
            return None
        cache = self._user_cache
        throttled = [
            r
            for r in running
            if (cache.get(r.request_id) or self._user(r)) in refused
            and r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - 1
            and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
        ]
        self._throttled_at_start = throttled
        self._throttled.update(r.request_id for r in throttled)
        self._refused_users.update(self._user(r) for r in throttled)
        if not throttled or running[-len(throttled) :] == throttled:
            return None
        stock_order = list(running)
        moved = {id(r) for r in throttled}
        running[:] = [r for r in running if id(r) not in moved] + throttled
        return stock_order

    def _restore_order(self, stock_order: list[Request]) -> None:
        """R13: put ``running`` back in the order vLLM alone would have left it.

        vLLM only removes (preempts) and appends (admits) during ``schedule()``.
        """
        present = {id(r) for r in self.running}
        before = {id(r) for r in stock_order}
        admitted = [r for r in self.running if id(r) not in before]
        self.running[:] = [r for r in stock_order if id(r) in present] + admitted

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
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self.rate_limiter is None or num_new_tokens == 0:
            return num_new_tokens
        is_running = request.status == RequestStatus.RUNNING
        if is_running and len(self._scheduled_running) >= self._active_cap:
            return 0  # R12: the step's batch already holds A running requests
        if self._samples(request, num_computed_tokens, num_new_tokens):
            user = self._user(request)
            if user not in self._refused_users and self.rate_limiter.try_take(user, self._now_ns):
                self._charged.append(request)  # R7: charged at dispatch
            else:
                self._refused_users.add(user)
                # R10: with chunked prefill, advance to the position just before sampling.
                capped = request.num_tokens + request.num_output_placeholders - 1 - num_computed_tokens
                if not self.scheduler_config.enable_chunked_prefill or capped <= 0:
                    if is_running:
                        self._throttled.add(request.request_id)  # R11: skip, keep resident
                    return 0
                num_new_tokens = min(num_new_tokens, capped)
        if is_running:
            self._scheduled_running.add(request.request_id)
        return num_new_tokens

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        if self.rate_limiter is None:
            return True
        user = self._user(request)
        if user not in self._refused_users and self.rate_limiter.allows(user, self._now_ns):
            return True
        self._refused_users.add(user)
        # R10: a refused user's waiting request proceeds only if it can prefill without
        # sampling; otherwise it is skipped and later waiting requests are still admitted
        # (vLLM 0.32 stops admission at a waiting request given 0 tokens).
        if not self.scheduler_config.enable_chunked_prefill:
            return False
        num_computed_tokens = request.num_computed_tokens
        if num_computed_tokens == 0:
            # R10: a fresh admission starts at its prefix-cache hit, which vLLM caps at
            # num_tokens - 1 and so can leave only the sampling token: look it up as vLLM
            # is about to (a side-effect-free lookup).
            num_computed_tokens = self._get_local_prefix_cache_hit(request)[1]
        return num_computed_tokens < request.num_tokens - 1

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if self.rate_limiter is not None:
            self._scheduled_running.discard(request.request_id)
            self._throttled.discard(request.request_id)
        return super()._preempt_request(request, *args, **kwargs)

    def _settle(self, scheduler_output) -> list[str]:
        """R9: the single refund point; R15: record the last-served stream per user."""
        scheduled = scheduler_output.num_scheduled_tokens
        refunded = []
        for request in self._charged:
            dispatched = request.request_id in scheduled and not request.is_prefill_chunk
            user = self._user(request)
            if dispatched:
                self._last_served[(user, request.priority)] = request.request_id  # R15
            else:
                self.rate_limiter.refund(user)  # R4/R9
                refunded.append(request.request_id)
        return refunded

    def _observe(self, scheduler_output, refunded: list[str]) -> None:
        """Record this step's decisions; the observation dict is built only when read."""
        limiter = self.rate_limiter
        ready = [limiter.ready_at_ns(u) for u in self._refused_users]
        ready = [t for t in ready if t is not None]
        self._wait_hint_ns = min(ready) if ready else None
        self._step_record = (self._now_ns, self._charged, refunded, self._throttled)
        self._observation_cache = None

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


class RateLimitedScheduler(_RateLimitMixin, Scheduler):
    """vLLM 0.32.0 ``Scheduler`` with per-user output-rate limiting (R6-R18)."""


class RateLimitedAsyncScheduler(_RateLimitMixin, AsyncScheduler):
    """vLLM 0.32.0 ``AsyncScheduler`` with per-user output-rate limiting (R6-R18, P5)."""
