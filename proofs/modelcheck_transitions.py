"""The model checker's transition system (``proofs/modelcheck.py``): the events enabled
in a world, and one transition: the spec's step plus the checks made on it (invariants,
I7 in ledger form, R6 cleanup, F1 bypass counts, R20 fair admission).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_output_rate.proofs.modelcheck_reduction import World
from vllm_output_rate.proofs.modelcheck_scopes import MS, Compiled, interval_ns
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.state import Observation, SchedulerState

CHECK_IDS = (
    "assert",
    "I1",
    "I2",
    "I3",
    "I4",
    "I5",
    "I6",
    "I7",
    "I8",
    "I9",
    "I10",
    "I11",
    "I12",
    "I13",
    "I14",
    "I15",
    "I16",
    "I17",
    "I18",
    "I19",
    "R6",
    "F1",
    "liveness-a",
    "liveness-b",
    "F2",
)


def enabled_events(world: World, cs: Compiled, depth: int, concrete: bool) -> list[Event]:
    """The scope's events enabled in ``world`` at ``depth`` (module docstring).

    New request ids: ``<user>-<k>`` in concrete runs (replayable, never reused); ``n`` in
    canonical worlds, whose live ids are ``q0, q1, ...``.
    """
    events: list[Event] = [Step()]
    if cs.scope.drain and world.state.in_flight is not None:
        events.append(Drain())
    events.extend(cs.clock_events)
    if cs.scope.horizon is not None and depth >= cs.scope.horizon:
        return events
    if world.changes_done < len(cs.rate_changes):  # R21: the next rate table
        events.append(cs.rate_changes[world.changes_done])
    for ui, user in enumerate(cs.users):
        seen = set()
        for stream in world.pending[ui]:
            if stream in seen:
                continue
            seen.add(stream)
            rid = f"{user}-{world.added[ui]}" if concrete else "n"
            prompt, max_tokens, eos, prio = stream
            events.append(
                AddRequest(rid, user=user, priority=prio, prompt_len=prompt, max_tokens=max_tokens, eos_index=eos)
            )
    if world.aborts_left > 0:
        events.extend(Abort(r.request_id) for r in world.state.requests)
    return events


@dataclass
class Outcome:
    """One transition: the successor world (None if the spec raised), the observation,
    and the violations found as (check id, message)."""

    world: World | None
    obs: Observation | None
    violations: list[tuple[str, str]]


def _check_id(message: str) -> str:
    head = message.split(" ", 1)[0].split(":", 1)[0]
    return head if head in CHECK_IDS else "assert"


def transition(world: World, event: Event, cs: Compiled) -> Outcome:
    """Apply ``event`` to ``world`` and check every per-transition property."""
    before = world.state
    try:
        after, obs = spec.step(before, event)
    except AssertionError as error:
        return Outcome(None, None, [("assert", f"spec assertion: {error}")])
    violations: list[tuple[str, str]] = []
    pending, aborts_left, added = world.pending, world.aborts_left, world.added
    ledger, bypass, changes_done = world.ledger, world.bypass, world.changes_done
    if isinstance(event, ChangeRates):
        changes_done += 1
    if isinstance(event, AddRequest):
        ui = cs.uidx[event.user]
        stream = (event.prompt_len, event.max_tokens, event.eos_index, event.priority)
        rest = list(pending[ui])
        rest.remove(stream)
        pending = pending[:ui] + (tuple(rest),) + pending[ui + 1 :]
        added = added[:ui] + (added[ui] + 1,) + added[ui + 1 :]
    elif isinstance(event, Abort):
        aborts_left -= 1
    history = None
    if isinstance(event, Step):
        users_of = {r.request_id: r.user for r in before.requests}
        if cs.rate_limited:
            if before.pending_rates is not None:  # R21: the step installed a rate table first
                ledger = _rerate_ledger(ledger, before, after, obs.now_ns, cs)
            ledger, found = _advance_ledger(ledger, users_of, obs, cs, after if cs.rate_changes else None)
            violations.extend(found)
            history = invariants.DispatchHistory(
                ledger_tat_ns=tuple((u, t) for u, t in zip(cs.users, ledger) if t is not None)
            )
            violations.extend(_check_cleanup(after, cs))
            bypass, found = _advance_bypass(bypass, before, after, obs, users_of, cs)
            violations.extend(found)
            if cs.scope.fair_admission:
                violations.extend(_check_fair_admission(before, obs, users_of))  # F2 (R20)
    try:
        message = invariants.check(before, event, after, obs, history)
    except AssertionError as error:
        message = f"spec assertion in an invariant: {error}"
    if message:
        violations.insert(0, (_check_id(message), message))
    return Outcome(World(after, pending, ledger, bypass, aborts_left, added, changes_done), obs, violations)


def _rerate_ledger(ledger, before: SchedulerState, after: SchedulerState, now: int, cs: Compiled):
    """R21: the dispatch ledger keeps each changed user's lead in tokens, as the limiter must."""
    out = []
    for user, current in zip(cs.users, ledger):
        old, new = before.config.rate_of(user), after.config.rate_of(user)
        if current is not None and old != new:
            # R28: to or from unlimited, no ledger TAT is kept (as DispatchHistory.rerate)
            current = None if old is None or new is None else spec_limiter.rescaled_tat_ns(current, old, new, now)
        out.append(current)
    return tuple(out)


def _advance_ledger(ledger, users_of, obs, cs: Compiled, after: SchedulerState | None = None):
    """I7 in ledger form: each sampling dispatch at ``t`` needs ``L - t <= tau``; then
    ``L := max(L, t) + T`` (module docstring)."""
    found = []
    now = obs.now_ns
    ledger = list(ledger)
    for rid in obs.sampled:
        user = users_of[rid]
        interval = cs.interval[user] if after is None else interval_ns(after.config.rate_of(user))
        if interval is None:
            continue  # R28: an unlimited user: never refused, no window bound
        ui = cs.uidx[user]
        current = ledger[ui]
        if current is not None and current - now > cs.burst:
            found.append(
                (
                    "I7",
                    f"I7 (R2): user {user}: a sampling dispatch at {now} ns with the dispatch ledger "
                    f"{float(current - now) / MS:g} ms ahead (> tau {cs.burst / MS:g} ms): the window "
                    f"bound floor((W + tau) x rate) + 1 is exceeded for some window ending now",
                )
            )
        ledger[ui] = max(current if current is not None else now, now) + interval  # R21: the rate in force
    return tuple(ledger), found


def _check_cleanup(after: SchedulerState, cs: Compiled) -> list[tuple[str, str]]:
    """R6: cleanup at this instant must not change the canonical limiter (module docstring)."""
    now = after.now_ns
    cleaned = spec_limiter.cleanup_idle_users(after.limiter, now)
    kept = {u: t for u, t in after.limiter.tat_ns.items() if t > now}
    got = {u: t for u, t in cleaned.tat_ns.items() if t > now}
    if kept != got or any(u not in after.limiter.tat_ns for u in cleaned.tat_ns):
        return [
            (
                "R6",
                f"R6: cleanup at {now} ns changes the limiter: {dict(after.limiter.tat_ns)} -> "
                f"{dict(cleaned.tat_ns)} (only users with TAT <= now may be forgotten)",
            )
        ]
    return []


def _advance_bypass(bypass, before, after, obs, users_of, cs: Compiled):
    """F1 (R14): count consecutive bypasses of throttled streams by same-group streams."""
    prio = {r.request_id: r.priority for r in before.requests}
    served: dict[tuple[str, int], set[str]] = {}
    for rid in obs.sampled:
        if rid in obs.charged:
            served.setdefault((users_of[rid], prio[rid]), set()).add(rid)
    running = set(after.running)
    new = {rid: n for rid, n in bypass.items() if rid in running and rid not in obs.sampled}
    found = []
    for rid in obs.throttled:
        group = (users_of[rid], prio[rid])
        if served.get(group, set()) - {rid} and rid in running and rid not in obs.sampled:
            new[rid] = new.get(rid, 0) + 1
            bound = cs.bypass_bound.get(group[1], 0)
            if new[rid] > bound:
                found.append(
                    (
                        "F1",
                        f"F1 (R14): {rid} of user {group[0]} (priority {group[1]}) throttled "
                        f"{new[rid]} steps in a row while other streams of its group were served "
                        f"(rotation allows at most {bound})",
                    )
                )
    return new, found


def _check_fair_admission(before: SchedulerState, obs: Observation, users_of: dict[str, str]):
    """F2 (R20, bounded admission delay): in a scope whose users at their cap C still leave
    a slot (users x C <= M), a waiting request whose user holds fewer than C running
    requests and is not refused at the step's instant is admitted in that very Step: its
    admission delay is one step. Scopes that declare F2 give the token budget and KV room
    for every admission, so only another user's flood could hold it back, and R20 keeps the
    flood at C. (Without R20, the flood's throttled streams hold every slot: caught.)"""
    config = before.config
    cap = config.max_num_seqs_per_user
    assert cap is not None, "F2 scopes set max_num_seqs_per_user (R20)"
    held: dict[str, int] = {}
    for rid in [r for r in before.running if r not in obs.preempted] + list(obs.admitted):
        held[users_of[rid]] = held.get(users_of[rid], 0) + 1  # after schedule(), admissions included
    for rid in before.waiting:
        user = users_of[rid]
        if rid in obs.admitted or held.get(user, 0) >= cap:
            continue
        if not spec_limiter.allows(before.limiter, user, before.now_ns, config.burst_ns):
            continue
        return [
            (
                "F2",
                f"F2 (R20): {rid} of user {user} waits a step although its user holds {held.get(user, 0)} "
                f"< max_num_seqs_per_user={cap} running requests ({len(before.running)} of "
                f"max_num_seqs={config.max_num_seqs} slots taken at the step's start): another user's "
                "flood holds back its admission",
            )
        ]
    return []


def _is_progress_event(event: Event) -> bool:
    return isinstance(event, (Step, AdvanceClock))
