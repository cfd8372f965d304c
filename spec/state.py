"""The state of the step model: configuration, requests, scheduler state, observations.

Everything here is a frozen dataclass holding ints, strings, booleans, ``Fraction``s and
tuples. Nothing reads a clock, draws a random number or does I/O. Functions that change a
state return a new one.

Vocabulary is vLLM 0.32's (``running``, ``waiting``, ``num_computed_tokens``,
``num_output_placeholders``, ...), so that a reader can hold this file next to
``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/request.py``. The behaviour ids
V1-V12 (base vLLM) and R1-R18 (rate limit) are explained in ``spec/scheduler.py``.

Modelled configuration class (``EngineConfig``): a standard causal decoder, no prefix
caching (the gate turns it off: every admission starts at 0 computed tokens), no
speculative decoding, no KV connector, no multimodal inputs, no structured output,
no pipeline parallelism, watermark 0, ``long_prefill_token_threshold`` 0, one full-attention
KV cache group of ``num_blocks`` blocks (one of them is vLLM's reserved null block). LoRA
is modelled as adapter slots only (``max_loras``, each request's adapter id; V8): the
adapters' weights and ranks do not change scheduling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.versions import DEFAULT_PROFILE, VllmVersionProfile

FCFS = "fcfs"
PRIORITY = "priority"
POLICIES = (FCFS, PRIORITY)

# vLLM's RequestStatus values that the model needs (finished requests leave the state).
WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"

# Finish reasons as vLLM's FinishReason prints them.
STOP = "stop"
LENGTH = "length"
ABORT = "abort"

# Bounds (TigerBeetle style). A generated scenario stays far below each.
MAX_LIVE_REQUESTS: int = 1024
MAX_NUM_BLOCKS: int = 1 << 20
MAX_MODEL_LEN: int = 1 << 20
MAX_NUM_SEQS: int = 1024
NULL_BLOCKS: int = 1  # vLLM's BlockPool keeps one null block that is never handed out
# R6: idle users are forgotten every this many schedule() calls with the feature on.
CLEANUP_INTERVAL_STEPS: int = spec_limiter.CLEANUP_INTERVAL_STEPS


@dataclass(frozen=True)
class EngineConfig:
    """One engine's configuration, in vLLM's names.

    ``max_num_active_seqs`` is vLLM's upstream admission cap (counts every running
    request); with the feature on, R12 reinterprets it (see ``active_cap``).
    ``default_rate_tokens_per_s`` None means the feature is off (R18).
    """

    max_num_seqs: int = 8
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    block_size: int = 16
    num_blocks: int = 1024
    policy: str = FCFS
    async_scheduling: bool = False
    max_model_len: int = 2048
    default_rate_tokens_per_s: Fraction | None = None
    user_rates_tokens_per_s: tuple[tuple[str, Fraction | None], ...] = ()  # None: UNLIMITED (R28)
    output_rate_max_num_active_seqs: int | None = None
    burst_ns: int = spec_limiter.BURST_NS
    # R20: resident (running) requests one user may hold; None: no cap (the article's behaviour).
    max_num_seqs_per_user: int | None = None
    # V8: vLLM's ``--max-loras`` (adapters one step's batch may use); None: LoRA off
    # (``--enable-lora`` not given), and every request must be on the base model (lora 0).
    max_loras: int | None = None

    def __post_init__(self) -> None:
        # The configuration is one that vLLM 0.32 accepts (SchedulerConfig validation).
        assert 1 <= self.max_num_seqs <= MAX_NUM_SEQS, f"max_num_seqs {self.max_num_seqs}"
        assert self.max_num_active_seqs is None or 1 <= self.max_num_active_seqs <= self.max_num_seqs, (
            f"max_num_active_seqs {self.max_num_active_seqs} must be in [1, max_num_seqs={self.max_num_seqs}]"
        )
        assert self.max_num_batched_tokens >= 1, f"max_num_batched_tokens {self.max_num_batched_tokens}"
        assert self.chunked_prefill or self.max_num_batched_tokens >= self.max_model_len, (
            "without chunked prefill vLLM requires max_num_batched_tokens >= max_model_len"
        )
        assert self.block_size >= 1, f"block_size {self.block_size}"
        assert NULL_BLOCKS < self.num_blocks <= MAX_NUM_BLOCKS, f"num_blocks {self.num_blocks}"
        assert self.policy in POLICIES, f"policy {self.policy!r}"
        assert 2 <= self.max_model_len <= MAX_MODEL_LEN, f"max_model_len {self.max_model_len}"
        # R1/R3: rates are positive exact rationals; burst tau > 0.
        assert self.default_rate_tokens_per_s is None or self.default_rate_tokens_per_s > 0
        # R28: a user's rate may be UNLIMITED (None): no TAT, never refused (spec/tables.py).
        assert all(rate is None or rate > 0 for _, rate in self.user_rates_tokens_per_s), self.user_rates_tokens_per_s
        assert self.default_rate_tokens_per_s is not None or not self.user_rates_tokens_per_s, (
            "per-user rates need a default rate (the feature is off without one)"
        )
        assert self.burst_ns > 0, f"burst_ns {self.burst_ns}"
        # R20: a cap in [1, max_num_seqs], only with the feature on (reference/config.py refuses < 1,
        # reference/engine_checks.py > max_num_seqs).
        assert self.max_num_seqs_per_user is None or (
            self.rate_limited and 1 <= self.max_num_seqs_per_user <= self.max_num_seqs
        ), (
            f"max_num_seqs_per_user {self.max_num_seqs_per_user} needs the feature on and must be in "
            f"[1, max_num_seqs={self.max_num_seqs}]"
        )
        assert self.max_loras is None or self.max_loras >= 1, f"max_loras {self.max_loras} must be >= 1"

    @property
    def rate_limited(self) -> bool:
        """R18: the feature is on iff a default rate is configured."""
        return self.default_rate_tokens_per_s is not None

    @property
    def num_usable_blocks(self) -> int:
        """V5: blocks a request can ever get (the null block excluded)."""
        return self.num_blocks - NULL_BLOCKS

    @property
    def active_cap(self) -> int:
        """R12: the active cap A with the feature on (the output_rate key wins, then
        vLLM's flag, then ``max_num_seqs``; never above ``max_num_seqs``)."""
        cap = self.output_rate_max_num_active_seqs or self.max_num_active_seqs or self.max_num_seqs
        return min(cap, self.max_num_seqs)

    @property
    def upstream_admission_cap(self) -> int:
        """V8: vLLM's own admission cap into RUNNING (feature off)."""
        return self.max_num_active_seqs if self.max_num_active_seqs is not None else self.max_num_seqs

    def base_config(self) -> EngineConfig:
        """R19: the configuration of the base scheduler a rate-limited step is compared with:
        the feature off (R18), and the active cap A as vLLM's own admission cap (with no
        throttled request, R12's admission cap ``min(M, A + 0)`` is upstream's ``A``)."""
        cap = self.active_cap if self.rate_limited else self.max_num_active_seqs
        return replace(
            self,
            max_num_active_seqs=cap if cap is not None and cap < self.max_num_seqs else None,
            default_rate_tokens_per_s=None,
            user_rates_tokens_per_s=(),
            output_rate_max_num_active_seqs=None,
            burst_ns=spec_limiter.BURST_NS,
            max_num_seqs_per_user=None,
        )

    def with_rates(
        self, default_rate_tokens_per_s: Fraction, user_rates_tokens_per_s: tuple[tuple[str, Fraction], ...]
    ) -> EngineConfig:
        """R21: the same engine with another rate table (default and overrides, tokens/s).

        Raises:
            AssertionError: the feature is off (R18: a change cannot turn it on or off),
                or a rate is not positive.
        """
        assert self.rate_limited, "R21: rates can only change with the feature on (R18)"
        return replace(
            self,
            default_rate_tokens_per_s=default_rate_tokens_per_s,
            user_rates_tokens_per_s=tuple(user_rates_tokens_per_s),
        )

    def rate_of(self, user: str) -> Fraction | None:
        """R1: the user's rate in tokens/s (override, else the default); R28: None for an
        unlimited user."""
        assert self.default_rate_tokens_per_s is not None, "rate_of with the feature off"
        for name, rate in self.user_rates_tokens_per_s:
            if name == user:
                return rate
        return self.default_rate_tokens_per_s


@dataclass(frozen=True)
class RequestState:
    """One live request (vLLM ``Request``), the fields the scheduler reads or writes.

    ``arrival``: the index of its ``AddRequest`` (vLLM's ``arrival_time`` in the harness).
    ``num_sampling_dispatches``: how many sampling steps were dispatched for it so far,
    i.e. the output index of the next token the fabricated model samples.
    ``num_blocks``: KV blocks held (V5).
    """

    request_id: str
    user: str
    priority: int
    arrival: int
    prompt_len: int
    max_tokens: int
    eos_index: int | None
    status: str = WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    num_blocks: int = 0
    num_sampling_dispatches: int = 0
    num_preemptions: int = 0
    lora: int = 0  # V8: the LoRA adapter id (0: the base model)

    def __post_init__(self) -> None:
        # Counters are never negative; a waiting request holds no KV and computed nothing.
        assert self.status in (WAITING, RUNNING, PREEMPTED), self.status
        assert (
            min(
                self.num_computed_tokens,
                self.num_output_tokens,
                self.num_output_placeholders,
                self.num_in_flight_tokens,
                self.num_stale_output_tokens,
                self.num_blocks,
            )
            >= 0
        ), self
        assert self.status == RUNNING or (self.num_blocks == 0 and self.num_computed_tokens == 0), self
        assert self.num_output_tokens <= self.max_tokens, self

    @property
    def num_tokens(self) -> int:
        """vLLM ``Request.num_tokens``: prompt plus the outputs delivered so far."""
        return self.prompt_len + self.num_output_tokens

    @property
    def sampling_position(self) -> int:
        """R7: ``num_computed_tokens`` at which a scheduled chunk samples a token."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def queue_key(self) -> tuple[int, int]:
        """V8: PRIORITY order (vLLM ``Request.__lt__``): smaller priority, then earlier."""
        return (self.priority, self.arrival)


@dataclass(frozen=True)
class OutputEntry:
    """One request's part of a fabricated ``ModelRunnerOutput`` (in scheduled order).

    ``sampled``: the chunk reached the sampling position, one token was sampled;
    ``eos``: that token is EOS.
    """

    request_id: str
    num_scheduled_tokens: int
    sampled: bool
    eos: bool


@dataclass(frozen=True)
class Finished:
    """A request left the scheduler: vLLM's finish reason and its number of outputs."""

    request_id: str
    reason: str
    num_output_tokens: int


@dataclass(frozen=True)
class SchedulerState:
    """The whole model state between events.

    ``requests``: live requests in arrival order (finished ones are gone, as from vLLM's
    ``Scheduler.requests``). ``running``: vLLM's ``running`` list, in order. ``waiting``:
    the waiting queue in the order vLLM would pop it. ``in_flight``: async only, the
    model output of the last scheduled step, delivered by the next ``Step``/``Drain``.
    ``limiter``: per-user TATs (R1). ``last_served``: (user, priority, request id) of each
    group's last dispatched stream (R15). ``pending_rates``: R21's rate table waiting for the
    next ``schedule()``. ``turns``: R14's order of turns as the last cycle
    left it (``rate.turn_order``; never the order of ``running``). ``num_schedules``: ``schedule()`` calls with the
    feature on (R6 cadence). ``base``: the vLLM release whose behaviour the V-rules follow
    where releases differ (``spec/versions.py``); data chosen by the caller, never read
    from vLLM.
    """

    config: EngineConfig
    now_ns: int = 0
    requests: tuple[RequestState, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    num_free_blocks: int = -1
    in_flight: tuple[OutputEntry, ...] | None = None
    num_arrivals: int = 0
    num_schedules: int = 0
    limiter: spec_limiter.LimiterState = field(default_factory=spec_limiter.LimiterState)
    last_served: tuple[tuple[str, int, str], ...] = ()
    turns: tuple[str, ...] = ()
    base: VllmVersionProfile = DEFAULT_PROFILE
    # R21: a rate table waiting for the next schedule() (default, overrides); None: none.
    pending_rates: tuple[Fraction, tuple[tuple[str, Fraction], ...]] | None = None

    def __post_init__(self) -> None:
        # Bounded collections; every queued id is a live request; KV is conserved.
        assert len(self.requests) <= MAX_LIVE_REQUESTS, f"{len(self.requests)} live requests"
        assert len(self.running) <= self.config.max_num_seqs, f"V8: running {self.running} > max_num_seqs"
        assert (
            self.num_free_blocks == -1
            or self.num_free_blocks + sum(r.num_blocks for r in self.requests) == self.config.num_usable_blocks
        ), "V5: KV blocks not conserved"
        assert len(self.last_served) <= MAX_LIVE_REQUESTS, "R15: last_served unbounded"
        assert len(self.turns) <= self.config.max_num_seqs, "R14: turns hold running requests only"


def initial_state(config: EngineConfig, base: VllmVersionProfile = DEFAULT_PROFILE) -> SchedulerState:
    """The state of a freshly built scheduler: nothing queued, all KV blocks free.

    ``base``: the vLLM release the V-rules model where releases differ (``spec/versions.py``).
    """
    return SchedulerState(config=config, num_free_blocks=config.num_usable_blocks, base=base)


def find(state: SchedulerState, request_id: str) -> RequestState | None:
    """The live request ``request_id``, or None if it is unknown or finished."""
    for request in state.requests:
        if request.request_id == request_id:
            return request
    return None


def get(state: SchedulerState, request_id: str) -> RequestState:
    """The live request ``request_id`` (it must exist)."""
    request = find(state, request_id)
    assert request is not None, f"{request_id} is not a live request"
    return request


def with_request(
    state: SchedulerState, request_id: str, change: Callable[[RequestState], RequestState]
) -> SchedulerState:
    """``state`` with ``change`` applied to the live request ``request_id``."""
    requests = tuple(change(r) if r.request_id == request_id else r for r in state.requests)
    return replace(state, requests=requests)


def put_request(state: SchedulerState, request: RequestState) -> SchedulerState:
    """``state`` with the live request of ``request``'s id replaced by ``request``."""
    return with_request(state, request.request_id, lambda _: request)


def with_blocks(state: SchedulerState, request_id: str, num_blocks: int, **changes: Any) -> SchedulerState:
    """V5: ``request_id`` now holds ``num_blocks`` blocks (plus ``changes`` to its fields);
    the difference moves from or to the free pool in the same state change."""
    request = get(state, request_id)
    delta = num_blocks - request.num_blocks
    assert delta <= state.num_free_blocks, f"V5: {delta} blocks needed, {state.num_free_blocks} free"
    updated = replace(request, num_blocks=num_blocks, **changes)
    requests = tuple(updated if r.request_id == request_id else r for r in state.requests)
    return replace(state, requests=requests, num_free_blocks=state.num_free_blocks - delta)


def blocks_for(num_tokens: int, config: EngineConfig) -> int:
    """V5: blocks that hold ``num_tokens`` slots (capped at ``max_model_len``)."""
    return math.ceil(min(num_tokens, config.max_model_len) / config.block_size)


@dataclass(frozen=True)
class Observation:
    """What one event did (the comparison unit of the gate).

    Base (V-rules): ``scheduled`` (request id, tokens) in ``SchedulerOutput`` order;
    ``sampled``: ids whose chunk reaches the sampling position; ``preempted`` in
    preemption order; ``admitted`` from waiting in admission order; ``finished``: requests
    whose final output was delivered by this event (or that it aborted).
    Rate limit (R7-R16, empty with the feature off): ``charged`` in charge order,
    ``refunded``, ``throttled`` (sorted), ``wait_hint_ns``, and every user's TAT after the
    step (``tat_ns``, sorted by user); ``limit_bound``: some limit of the feature bound in
    the step (``rate.limit_binds``; False: R19 says the step is the base scheduler's).
    ``decided``: (request id, V-rule) of the decision the cycle took last about each request
    it looked at or passed over (why it was scheduled, skipped, preempted, admitted or not
    reached); it names the V-rule of a divergence (``adapter/drift.py``) and is not compared.
    ``lora_victims``: the part of ``preempted`` that R13 preempted at the step start to free
    a LoRA slot (not a KV shortage: I10 and I16 leave them out).
    """

    event: str
    now_ns: int
    scheduled: tuple[tuple[str, int], ...] = ()
    sampled: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    finished: tuple[Finished, ...] = ()
    delivered: tuple[OutputEntry, ...] = ()
    charged: tuple[str, ...] = ()
    refunded: tuple[str, ...] = ()
    throttled: tuple[str, ...] = ()
    wait_hint_ns: int | None = None
    tat_ns: tuple[tuple[str, Fraction], ...] = ()
    scheduled_running: int = 0
    rate_limited: bool = False
    limit_bound: bool = False
    decided: tuple[tuple[str, str], ...] = ()
    lora_victims: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cycle:
    """The working values of one ``schedule()`` call, discarded when it returns.

    ``state``: the scheduler state as the cycle has changed it so far.
    ``token_budget``: tokens left in this step's batch (V1).
    ``scheduled``: (request id, tokens) in ``SchedulerOutput`` order; while the running
    loop runs, every entry is a running request (R12 counts them).
    ``halted``: an allocation failure stopped the running loop (V6).
    Rate limit: ``now_ns`` is the cycle's one clock reading (R16); ``charged`` in charge
    order (R7); ``refused_users``: users refused in this cycle, not asked again;
    ``throttled``: running requests refused and skipped (R11); ``throttled_at_start``:
    the preferred victims of this cycle, in ``running`` order (R13); ``held_users``: users
    not refused at the start whose grants do not cover all their decoding streams, so that
    some of these are throttled at the start (R14: not their turn); ``turn_order``: R14's
    order of preference over ``running`` at the start (``running`` itself is never
    reordered); ``active_cap_reached``: R12 gave a running request 0 tokens (R19);
    ``residency_skipped``: waiting requests skipped because their user already held
    ``max_num_seqs_per_user`` running requests (R20). ``lora_victims``: running requests
    preempted at the cycle start to free a LoRA slot that another user's waiting request
    needs (R13, LoRA); they are in ``preempted`` too, but do not stop admission (V7 is
    about the running loop's preemptions).
    ``decided``: the V-rule trail of the cycle (``Observation.decided``).
    """

    state: SchedulerState
    token_budget: int
    scheduled: tuple[tuple[str, int], ...] = ()
    preempted: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    halted: bool = False
    now_ns: int = 0
    charged: tuple[str, ...] = ()
    refused_users: frozenset[str] = frozenset()
    throttled: frozenset[str] = frozenset()
    throttled_at_start: tuple[str, ...] = ()
    held_users: frozenset[str] = frozenset()
    turn_order: tuple[str, ...] = ()
    active_cap_reached: bool = False
    decided: tuple[tuple[str, str], ...] = ()
    residency_skipped: tuple[str, ...] = ()  # R20: waiting requests skipped, their user at its cap
    lora_victims: tuple[str, ...] = ()  # R13: preempted at the start to free a LoRA slot (no V7)

    def __post_init__(self) -> None:
        # V1: the budget is never overspent; R7: at most one charge per request per cycle.
        assert self.token_budget >= 0, f"V1: token budget overspent: {self.token_budget}"
        assert len(set(self.charged)) == len(self.charged), f"R7: charged twice in one step: {self.charged}"

    def decide(self, request_id: str, rule: str) -> Cycle:
        """The cycle with ``rule`` recorded as the reason for what happened to ``request_id``."""
        return replace(self, decided=self.decided + ((request_id, rule),))

    def scheduled_tokens(self, request_id: str) -> int:
        """Tokens scheduled for ``request_id`` in this cycle (0 if none)."""
        for rid, num_tokens in self.scheduled:
            if rid == request_id:
                return num_tokens
        return 0
