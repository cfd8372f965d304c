"""Invariants of the step model, checked after every spec step by the gate.

Each invariant is a small function over (the state before, the event, the state after,
the observation) returning None when it holds, or a message naming the rule and the
values that break it. ``check`` runs them all. The window bound (I7) also needs the
user's earlier dispatch times: ``DispatchHistory`` carries them (bounded).

| id | property | rules |
|---|---|---|
| I1 | charges minus refunds equal the sampling dispatches of the step | R7, R9 |
| I2 | no request is charged twice in a step | R7 |
| I3 | a refund is only for a charged request that was not dispatched to sample, once | R4, R9 |
| I4 | a throttled request is not scheduled at all in that step | R11 |
| I5 | running requests scheduled in a step <= the active cap A | R12 |
| I6 | ``len(running) <= max_num_seqs``; after an admission, ``len(running) - throttled <= A`` | V8, R12 |
| I7 | a user's sampling dispatches in any window of W ns <= floor((W + tau) x rate) + 1 | R2 |
| I8 | pause, not truncate: a request ends at its EOS (``eos_index + 1`` outputs), at ``max_tokens`` (or ``max_model_len``), or by abort | R11, P3 |
| I9 | a step schedules at most ``max_num_batched_tokens`` tokens, each chunk > 0 | V1 |
| I10 | no admission in a step that preempted | V7 |
| I11 | KV blocks are conserved: free + held = usable blocks | V5 |
| I12 | with the feature off nothing is charged, refunded or throttled | R18 |
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.events import Event, Step
from vllm_output_rate.spec.state import ABORT, LENGTH, STOP, Observation, SchedulerState, find

MAX_HISTORY_PER_USER: int = 4096  # I7 looks back this many dispatches per user (bounded)


def i1_charges_match_dispatches(after: SchedulerState, obs: Observation) -> str | None:
    """I1 (R7, R9): charged - refunded == sampled, as multisets."""
    net = Counter(obs.charged) - Counter(obs.refunded)
    if net != Counter(obs.sampled):
        return f"I1 (R7/R9): charged {obs.charged} - refunded {obs.refunded} != sampled {obs.sampled}"
    return None


def i2_one_charge_per_request(obs: Observation) -> str | None:
    """I2 (R7): at most one charge per request per step."""
    if len(set(obs.charged)) != len(obs.charged):
        return f"I2 (R7): a request charged twice: {obs.charged}"
    return None


def i3_refunds_only_undispatched_charges(obs: Observation) -> str | None:
    """I3 (R4, R9): refunded is a subset of charged, each once, none dispatched."""
    if len(set(obs.refunded)) != len(obs.refunded):
        return f"I3 (R9): a charge refunded twice: {obs.refunded}"
    if not set(obs.refunded) <= set(obs.charged):
        return f"I3 (R9): refund without a charge: refunded {obs.refunded}, charged {obs.charged}"
    if set(obs.refunded) & set(obs.sampled):
        return f"I3 (R9): refunded a dispatched request: {sorted(set(obs.refunded) & set(obs.sampled))}"
    return None


def i4_throttled_not_scheduled(obs: Observation) -> str | None:
    """I4 (R11): a throttled request is skipped: it gets no tokens in that step."""
    scheduled = {rid for rid, _ in obs.scheduled}
    if scheduled & set(obs.throttled):
        return f"I4 (R11): throttled but scheduled: {sorted(scheduled & set(obs.throttled))}"
    return None


def i5_active_cap(after: SchedulerState, obs: Observation) -> str | None:
    """I5 (R12): running requests scheduled in one step <= A."""
    if obs.scheduled_running > after.config.active_cap:
        return f"I5 (R12): {obs.scheduled_running} running requests scheduled > A={after.config.active_cap}"
    return None


def i6_seats(after: SchedulerState, obs: Observation) -> str | None:
    """I6 (V8, R12): resident requests <= M; an admission leaves running - throttled <= A."""
    config = after.config
    if len(after.running) > config.max_num_seqs:
        return f"I6 (V8): {len(after.running)} running > max_num_seqs={config.max_num_seqs}"
    if config.rate_limited and obs.admitted:
        throttled_running = len(set(obs.throttled) & set(after.running))
        if len(after.running) - throttled_running > config.active_cap:
            return (f"I6 (R12): admitted {obs.admitted} with {len(after.running)} running, "
                    f"{throttled_running} throttled > A={config.active_cap}")
    return None


@dataclass(frozen=True)
class DispatchHistory:
    """I7: each user's sampling-dispatch times (ns), the newest last, bounded."""

    times_ns: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def of(self, user: str) -> tuple[int, ...]:
        for u, times in self.times_ns:
            if u == user:
                return times
        return ()

    def add(self, user: str, now_ns: int) -> "DispatchHistory":
        times = (self.of(user) + (now_ns,))[-MAX_HISTORY_PER_USER:]
        rest = tuple((u, t) for u, t in self.times_ns if u != user)
        return replace(self, times_ns=rest + ((user, times),))


def i7_window_bound(history: DispatchHistory, user: str, after: SchedulerState) -> str | None:
    """I7 (R2): every window ending at the user's newest dispatch respects the bound."""
    times = history.of(user)
    rate = after.config.rate_of(user)
    for i, start in enumerate(times):
        count = len(times) - i
        bound = spec_limiter.window_bound_tokens(times[-1] - start, rate, after.config.burst_ns)
        if count > bound:
            return f"I7 (R2): user {user}: {count} dispatches in [{start}, {times[-1]}] ns > bound {bound}"
    return None


def i8_pause_not_truncate(before: SchedulerState, obs: Observation) -> str | None:
    """I8 (R11, P3): every finish is EOS, max_tokens / max_model_len, or an abort."""
    for done in obs.finished:
        request = find(before, done.request_id)
        assert request is not None, f"{done.request_id} finished without being live"
        if done.reason == STOP and done.num_output_tokens != (request.eos_index or 0) + 1:
            return f"I8: {done.request_id} stopped with {done.num_output_tokens} outputs, EOS at {request.eos_index}"
        if done.reason == LENGTH and done.num_output_tokens != request.max_tokens and (
                request.prompt_len + done.num_output_tokens < before.config.max_model_len):
            return f"I8 (P3): {done.request_id} cut at {done.num_output_tokens} < max_tokens {request.max_tokens}"
        if done.reason not in (STOP, LENGTH, ABORT):
            return f"I8: {done.request_id} finished with reason {done.reason!r}"
    return None


def i9_budget(after: SchedulerState, obs: Observation) -> str | None:
    """I9 (V1): the batch fits the token budget; every chunk is positive."""
    total = sum(n for _, n in obs.scheduled)
    if total > after.config.max_num_batched_tokens or any(n <= 0 for _, n in obs.scheduled):
        return f"I9 (V1): batch {obs.scheduled} over budget {after.config.max_num_batched_tokens}"
    return None


def i10_no_admission_after_preemption(obs: Observation) -> str | None:
    """I10 (V7): a step that preempted admits nothing."""
    if obs.preempted and obs.admitted:
        return f"I10 (V7): preempted {obs.preempted} and admitted {obs.admitted} in one step"
    return None


def i11_kv_conserved(after: SchedulerState) -> str | None:
    """I11 (V5): free + held blocks = usable blocks; only running requests hold blocks."""
    held = sum(r.num_blocks for r in after.requests)
    if held + after.num_free_blocks != after.config.num_usable_blocks:
        return f"I11 (V5): {held} held + {after.num_free_blocks} free != {after.config.num_usable_blocks}"
    return None


def i12_feature_off(after: SchedulerState, obs: Observation) -> str | None:
    """I12 (R18): with the feature off, no rate-limit decision is ever made."""
    if not after.config.rate_limited and (obs.charged or obs.refunded or obs.throttled or obs.tat_ns):
        return f"I12 (R18): feature off but charged={obs.charged} refunded={obs.refunded} throttled={obs.throttled}"
    return None


def check(
    before: SchedulerState, event: Event, after: SchedulerState, obs: Observation,
    history: DispatchHistory | None = None,
) -> str | None:
    """Run every invariant that applies to this event; the first violation, or None.

    With ``history`` given, I7 is checked too; it must already hold this step's
    dispatches (``advance_history(history, before, obs)``).
    """
    found = i8_pause_not_truncate(before, obs) or i11_kv_conserved(after) or i12_feature_off(after, obs)
    if found or not isinstance(event, Step):
        return found
    found = (i6_seats(after, obs) or i9_budget(after, obs) or i10_no_admission_after_preemption(obs))
    if found or not after.config.rate_limited:
        return found
    found = (i1_charges_match_dispatches(after, obs) or i2_one_charge_per_request(obs)
             or i3_refunds_only_undispatched_charges(obs) or i4_throttled_not_scheduled(obs)
             or i5_active_cap(after, obs))
    if found or history is None:
        return found
    for user in sorted({find(before, rid).user for rid in obs.sampled if find(before, rid) is not None}):
        found = i7_window_bound(history, user, after)
        if found:
            return found
    return None


def advance_history(history: DispatchHistory, before: SchedulerState, obs: Observation) -> DispatchHistory:
    """I7: record the step's sampling dispatches at the step's instant."""
    for rid in obs.sampled:
        request = find(before, rid)
        assert request is not None, f"{rid} sampled without being live"
        history = history.add(request.user, obs.now_ns)
    return history
