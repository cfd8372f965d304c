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
| I13 | each user's TAT equals the GCRA replay of its sampling dispatches (up to idle) | R4, R7, R9 |
| I14 | the wait hint is some user's ready time, no later than any throttled user's | R5, R16 |
| I15 | a request throttled at the start of a step is preempted before any other (same priority under PRIORITY) | R13 |
| I16 | a step preempts only when KV really ran short (a throttled request keeps its blocks otherwise) | R11, V6 |
| I17 | a waiting request is admitted unless refused and unable to prefill, or admission stopped | R10, R12, P4 |
| I18 | a step in which no limit binds is the base scheduler's step from the same state | R19 |
| I19 | with ``max_num_seqs_per_user`` C, no user holds more than C running requests after a step | R20 |

I13-I17 were added with the model checker (``proofs/modelcheck.py``): each one is the
property whose absence let a spec mutation through (docs/SPEC_MUTATIONS.md). I13 needs the
dispatch ledger that ``advance_history`` keeps in ``DispatchHistory`` (exact, one number
per user, never truncated).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import properties as spec_properties
from vllm_output_rate.spec import rate as spec_rate
from vllm_output_rate.spec import scheduler as spec_scheduler
from vllm_output_rate.spec.events import Event, Step
from vllm_output_rate.spec.state import (
    ABORT,
    FCFS,
    LENGTH,
    STOP,
    Observation,
    SchedulerState,
    blocks_for,
    find,
    get,
)

MAX_HISTORY_PER_USER: int = 4096  # I7 looks back this many dispatches per user (bounded)


def i1_charges_match_dispatches(after: SchedulerState, obs: Observation) -> str | None:
    """I1 (R7, R9): charged - refunded == sampled, as multisets."""
    if spec_properties.net_charges(obs.charged, obs.refunded) != Counter(obs.sampled):
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
            return (
                f"I6 (R12): admitted {obs.admitted} with {len(after.running)} running, "
                f"{throttled_running} throttled > A={config.active_cap}"
            )
    return None


@dataclass(frozen=True)
class DispatchHistory:
    """I7: each user's sampling-dispatch times (ns), the newest last, bounded.

    I13: ``ledger_tat_ns``, each user's GCRA replay of all its sampling dispatches (exact
    ns, ``L := max(L, t) + T`` per dispatch at ``t``), what the limiter's TAT must equal.
    """

    times_ns: tuple[tuple[str, tuple[int, ...]], ...] = ()
    ledger_tat_ns: tuple[tuple[str, Fraction], ...] = ()

    def of(self, user: str) -> tuple[int, ...]:
        for u, times in self.times_ns:
            if u == user:
                return times
        return ()

    def ledger_of(self, user: str) -> Fraction | None:
        for u, tat in self.ledger_tat_ns:
            if u == user:
                return tat
        return None

    def replay(self, user: str, now_ns: int, interval_ns: Fraction) -> DispatchHistory:
        """I13: one sampling dispatch of ``user`` at ``now_ns`` enters the ledger."""
        tat = self.ledger_of(user)
        new_tat = max(tat if tat is not None else Fraction(now_ns), Fraction(now_ns)) + interval_ns
        rest = tuple((u, t) for u, t in self.ledger_tat_ns if u != user)
        return replace(self, ledger_tat_ns=rest + ((user, new_tat),))

    def rerate(
        self, old_rate_of: Callable[[str], Fraction | None], new_rate_of: Callable[[str], Fraction | None], now_ns: int
    ) -> DispatchHistory:
        """R21: the rate table changed at ``now_ns``. I13: each changed user's ledger TAT is
        rescaled as the limiter's is (``limiter.rescaled_tat_ns``). I7: a changed user's
        window history restarts, since I7 judges one rate; windows across the change are
        R21's piecewise bound (Z3 ``r21_window_bound_across_change``, gate ``rate-change/*``),
        and every window from the change on holds R2's bound at the new rate."""
        changed = {u for u, _ in self.times_ns + self.ledger_tat_ns if old_rate_of(u) != new_rate_of(u)}
        ledger = []
        for user, tat in self.ledger_tat_ns:
            old, new = old_rate_of(user), new_rate_of(user)
            kept: Fraction | None = tat
            if user in changed:
                if old is None or new is None:
                    continue  # R28: to or from unlimited: no ledger TAT kept
                kept = spec_limiter.rescaled_tat_ns(tat, old, new, now_ns)
            if kept is not None:
                ledger.append((user, kept))
        times = tuple((u, t) for u, t in self.times_ns if u not in changed)
        return replace(self, times_ns=times, ledger_tat_ns=tuple(ledger))

    def add(self, user: str, now_ns: int) -> DispatchHistory:
        times = (self.of(user) + (now_ns,))[-MAX_HISTORY_PER_USER:]
        rest = tuple((u, t) for u, t in self.times_ns if u != user)
        return replace(self, times_ns=rest + ((user, times),))


def i7_window_bound(history: DispatchHistory, user: str, after: SchedulerState) -> str | None:
    """I7 (R2): every window ending at the user's newest dispatch respects the bound."""
    rate = after.config.rate_of(user)
    if rate is None:
        return None  # R28: an unlimited user has no window bound
    excess = spec_properties.window_excess(history.of(user), rate, after.config.burst_ns)
    if excess is not None:
        return (
            f"I7 (R2): user {user}: {excess.count} dispatches in [{excess.start_ns}, {excess.end_ns}] ns "
            f"> bound {excess.bound}"
        )
    return None


def i8_pause_not_truncate(before: SchedulerState, obs: Observation) -> str | None:
    """I8 (R11, P3): every finish is EOS, max_tokens / max_model_len, or an abort."""
    for done in obs.finished:
        request = find(before, done.request_id)
        assert request is not None, f"{done.request_id} finished without being live"
        if done.reason == STOP and done.num_output_tokens != (request.eos_index or 0) + 1:
            return f"I8: {done.request_id} stopped with {done.num_output_tokens} outputs, EOS at {request.eos_index}"
        if (
            done.reason == LENGTH
            and done.num_output_tokens != request.max_tokens
            and (request.prompt_len + done.num_output_tokens < before.config.max_model_len)
        ):
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
    """I10 (V7): a step whose running loop preempted admits nothing (R13's LoRA victims,
    preempted at the step start to free an adapter slot, are not the running loop's)."""
    if any(rid not in obs.lora_victims for rid in obs.preempted) and obs.admitted:
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


def i13_limiter_matches_ledger(history: DispatchHistory, after: SchedulerState) -> str | None:
    """I13 (R4, R7, R9): the limiter charged exactly the sampling dispatches, net of refunds.

    For every user, ``max(TAT, now)`` equals ``max(L, now)`` where ``L`` is the GCRA
    replay of the user's sampling dispatches (a TAT <= now, or none, is idle, R6). A charge
    that is refunded in the same step leaves ``max(TAT, now)`` unchanged, so only a
    missing, doubled or misplaced charge or refund breaks it.
    """
    now = Fraction(after.now_ns)
    users = set(after.limiter.tat_ns) | {u for u, _ in history.ledger_tat_ns}
    for user in sorted(users):
        tat = after.limiter.tat_ns.get(user)
        ledger = history.ledger_of(user)
        effective_tat = now if tat is None else max(tat, now)
        effective_ledger = now if ledger is None else max(ledger, now)
        if effective_tat != effective_ledger:
            return (
                f"I13 (R4/R7/R9): user {user}: limiter TAT {float(effective_tat):.0f} ns != "
                f"{float(effective_ledger):.0f} ns, the replay of its sampling dispatches (now {after.now_ns})"
            )
    return None


def i14_wait_hint(before: SchedulerState, after: SchedulerState, obs: Observation) -> str | None:
    """I14 (R5, R16): ``wait_hint_ns`` is the ready time ``ceil(TAT - tau)`` of some known
    user, no later than that of any user throttled in the step; None only if no throttled
    user has a TAT left."""
    burst = after.config.burst_ns
    ready = {u: math.ceil(t - burst) for u, t in after.limiter.tat_ns.items()}
    users = {r.user for r in before.requests if r.request_id in set(obs.throttled)}
    throttled_ready = [ready[u] for u in sorted(users) if u in ready]
    hint = obs.wait_hint_ns
    if hint is None:
        if throttled_ready:
            return f"I14 (R16): users {sorted(users)} throttled with ready times {throttled_ready} but no wait hint"
        return None
    if hint not in ready.values():
        return f"I14 (R5): wait hint {hint} ns is no user's ready time {sorted(ready.values())}"
    if throttled_ready and hint > min(throttled_ready):
        return f"I14 (R16): wait hint {hint} ns after the earliest throttled user's ready time {min(throttled_ready)}"
    return None


def i15_preferred_victims(before: SchedulerState, obs: Observation) -> str | None:
    """I15 (R13): no request outside the throttled-at-start set is preempted while one of
    that set is still running (PRIORITY: one of the victim's own priority)."""
    if not obs.preempted:
        return None
    requests = {r.request_id: r for r in before.requests}
    throttled = spec_rate.start_turns(before)[0]  # R11/R14: refused, or not their turn
    for i, victim in enumerate(obs.preempted):
        if victim in throttled:
            continue
        gone = set(obs.preempted[:i])
        for rid in throttled:
            if rid in gone or rid == victim:
                continue
            if before.config.policy == FCFS or requests[rid].priority == requests[victim].priority:
                return f"I15 (R13): {victim} preempted while the throttled {rid} was still running"
    return None


def _blocks_after_schedule(before: SchedulerState, after: SchedulerState, obs: Observation) -> dict[str, int]:
    """V5: the blocks each request running at the end of ``schedule()`` held then (the
    output delivered by the same event may have finished some of them since)."""
    scheduled = dict(obs.scheduled)
    live_after = {r.request_id: r for r in after.requests}
    held = {}
    for rid in tuple(before.running) + tuple(obs.admitted):
        if rid in obs.preempted:
            continue
        if rid in live_after:
            held[rid] = live_after[rid].num_blocks
        else:
            request = get(before, rid)
            held[rid] = max(
                request.num_blocks, blocks_for(request.num_computed_tokens + scheduled.get(rid, 0), before.config)
            )
    return held


def i16_preemption_needed(before: SchedulerState, after: SchedulerState, obs: Observation) -> str | None:
    """I16 (R11, V6): a step preempts only when an allocation really failed.

    At the last failed allocation, the blocks held by the requests then running plus the
    allocating request's need exceeded the usable blocks. Those requests are the ones that
    stayed running (their blocks at the end of ``schedule()`` are an upper bound) and the
    last victim (at most the blocks of its whole sampling position). So that upper bound
    must exceed the usable blocks; if it does not, some victim was preempted for nothing.
    R13's LoRA victims (``obs.lora_victims``) free an adapter slot, not blocks: left out.
    """
    if not obs.preempted or all(rid in obs.lora_victims for rid in obs.preempted):
        return None
    config = before.config
    held = sum(_blocks_after_schedule(before, after, obs).values())
    last = get(before, obs.preempted[-1])
    peak = max(last.num_blocks, blocks_for(last.sampling_position, config))
    if held + peak <= config.num_usable_blocks:
        return (
            f"I16 (R11/V6): preempted {list(obs.preempted)} although the survivors' {held} blocks plus the last "
            f"victim's {peak} fit the {config.num_usable_blocks} usable blocks"
        )
    return None


def i17_admission_not_held_back(before: SchedulerState, after: SchedulerState, obs: Observation) -> str | None:
    """I17 (R10, R12, P4): a throttled user never holds back another's admission.

    In a step that preempted nothing, every waiting request that was not admitted is owed
    a reason: its user is refused and it cannot prefill (R10: without chunked prefill, or
    nothing short of sampling left), or the waiting loop may have stopped at it or at a
    request ahead of it (V8: token budget spent, ``len(running)`` at the R12 admission cap
    ``min(M, A + throttled)``, too few tokens without chunked prefill, too few free blocks
    for its whole sequence). Each stop condition is evaluated with the values at the end
    of ``schedule()``, which are the values at the stop (nothing is admitted after it); a
    refused user is still refused after the step (grants only push TAT up; the only
    refunds in such a step are of a charge at the loop's stop). So a missing reason means
    admission stopped short or skipped a request it owed a place.
    """
    if obs.preempted:
        return None
    config = before.config
    held = _blocks_after_schedule(before, after, obs)
    free = config.num_usable_blocks - sum(held.values())
    budget = config.max_num_batched_tokens - sum(n for _, n in obs.scheduled)
    num_running = len(before.running) + len(obs.admitted)
    cap = min(config.max_num_seqs, config.active_cap + len(obs.throttled))
    admitted = set(obs.admitted)
    for rid in before.waiting:
        if rid in admitted:
            continue
        request = get(before, rid)
        if (
            budget == 0
            or num_running >= cap
            or (not config.chunked_prefill and request.num_tokens > budget)
            or blocks_for(request.num_tokens, config) > free
        ):
            return None  # admission may have stopped here; nothing behind it is owed a place
        if (
            config.max_num_seqs_per_user is not None
            and _resident_after_schedule(before, obs)[request.user] >= config.max_num_seqs_per_user
        ):
            continue  # R20: its user holds its cap of running requests; skipped, the loop goes on
        if request.lora > 0:
            continue  # V8/R13: skipped when its adapter finds no slot (max_loras), the loop goes on
        refused = not spec_limiter.allows(after.limiter, request.user, after.now_ns, config.burst_ns)
        can_prefill = config.chunked_prefill and request.num_computed_tokens < request.num_tokens - 1
        if refused and not can_prefill:
            continue  # R10: skipped, the loop goes on
        return (
            f"I17 (R10/R12/P4): {rid} (user {request.user}) waits although nothing stopped admission before "
            f"it: budget {budget}, running {num_running} < cap {cap}, {free} free blocks, "
            f"user {'refused' if refused else 'not refused'}"
        )
    return None


def _resident_after_schedule(before: SchedulerState, obs: Observation) -> Counter[str]:
    """R20: running requests per user right after ``schedule()`` (before the step's
    deliveries): ``running`` before the step, less the preempted, plus the admitted."""
    preempted = set(obs.preempted)
    ids = [rid for rid in before.running if rid not in preempted] + list(obs.admitted)
    return Counter(get(before, rid).user for rid in ids)


def i19_residency_cap(before: SchedulerState, obs: Observation) -> str | None:
    """I19 (R20): with ``max_num_seqs_per_user`` C, no user holds more than C running
    requests right after ``schedule()`` (deliveries only remove requests).

    Requests become running only by admission, and R20 admits none of a user at C."""
    cap = before.config.max_num_seqs_per_user
    if cap is None:
        return None
    held = _resident_after_schedule(before, obs)
    over = sorted(u for u, n in held.items() if n > cap)
    if over:
        return f"I19 (R20): user {over[0]} holds {held[over[0]]} running requests > max_num_seqs_per_user={cap}"
    return None


def i18_not_binding_is_stock(
    before: SchedulerState, event: Event, after: SchedulerState, obs: Observation
) -> str | None:
    """I18 (R19): a step in which no limit of the feature bound (``obs.limit_bound``
    False) is the base scheduler's step from the same state: the same batch in the same
    order, sampling dispatches, preemptions, admissions, deliveries and finishes, and the
    same requests, ``running``, ``waiting``, free blocks and output in flight after it.
    The base runs ``config.base_config()`` (feature off, A as vLLM's admission cap)."""
    if not obs.rate_limited or obs.limit_bound:
        return None
    base_after, base_obs = spec_scheduler.step(replace(before, config=before.config.base_config()), event)
    for name in ("scheduled", "sampled", "preempted", "admitted", "delivered", "finished"):
        got, want = getattr(obs, name), getattr(base_obs, name)
        if got != want:
            return (
                f"I18 (R19): no limit bound, but {name} {got} != the base scheduler's {want}: "
                "a rate limit that does not bind must not change the schedule"
            )
    for name in ("requests", "running", "waiting", "num_free_blocks", "in_flight"):
        got, want = getattr(after, name), getattr(base_after, name)
        if got != want:
            return f"I18 (R19): no limit bound, but {name} after the step {got} != the base scheduler's {want}"
    return None


def check(
    before: SchedulerState,
    event: Event,
    after: SchedulerState,
    obs: Observation,
    history: DispatchHistory | None = None,
) -> str | None:
    """Run every invariant that applies to this event; the first violation, or None.

    With ``history`` given, I7 and I13 are checked too; it must already hold this step's
    dispatches (``advance_history(history, before, obs)``).
    """
    found = i8_pause_not_truncate(before, obs) or i11_kv_conserved(after) or i12_feature_off(after, obs)
    if found or not isinstance(event, Step):
        return found
    found = i6_seats(after, obs) or i9_budget(after, obs) or i10_no_admission_after_preemption(obs)
    if found or not after.config.rate_limited:
        return found
    found = (
        i1_charges_match_dispatches(after, obs)
        or i2_one_charge_per_request(obs)
        or i3_refunds_only_undispatched_charges(obs)
        or i4_throttled_not_scheduled(obs)
        or i5_active_cap(after, obs)
    )
    if found:
        return found
    if history is not None:
        for user in sorted({request.user for rid in obs.sampled if (request := find(before, rid)) is not None}):
            found = i7_window_bound(history, user, after)
            if found:
                return found
        found = i13_limiter_matches_ledger(history, after)
        if found:
            return found
    return (
        i14_wait_hint(before, after, obs)
        or i15_preferred_victims(before, obs)
        or i16_preemption_needed(before, after, obs)
        or i17_admission_not_held_back(before, after, obs)
        or i18_not_binding_is_stock(before, event, after, obs)
        or i19_residency_cap(before, obs)
    )


def advance_history(history: DispatchHistory, before: SchedulerState, obs: Observation) -> DispatchHistory:
    """I7, I13: record the step's sampling dispatches at the step's instant (and, with the
    feature on, replay them into the ledger). R21: a rate change the step applied first
    rescales the ledger at the step's instant, and the step's dispatches use the new rates."""
    config = before.config
    if config.rate_limited and before.pending_rates is not None and obs.event == "step":
        config = config.with_rates(*before.pending_rates)
        history = history.rerate(before.config.rate_of, config.rate_of, obs.now_ns)
    for rid in obs.sampled:
        request = find(before, rid)
        assert request is not None, f"{rid} sampled without being live"
        history = history.add(request.user, obs.now_ns)
        rate = config.rate_of(request.user) if config.rate_limited else None
        if rate is not None:  # R28: an unlimited user's dispatches are not charged (no ledger TAT)
            history = history.replay(request.user, obs.now_ns, spec_limiter.emission_interval_ns(rate))
    return history
