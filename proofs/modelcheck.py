"""Explicit-state model checking of the step spec over small declared scopes.

``spec.scheduler.step`` is a deterministic function of (state, event). For a *scope* -- a
small engine configuration, a few users each with a finite multiset of streams, a few
clock increments, a budget of aborts -- this module enumerates, breadth first, every
state reachable by any interleaving of the scope's events, checks every invariant of
``spec/invariants.py`` on every transition, and then checks two liveness properties on
the explored graph. A violation comes out as the *shortest* event sequence (BFS parents)
that exhibits it, written as a ``StepScenario`` JSON file (``adapter/fidelity.py``) that
replays on real vLLM with ``python -m vllm_output_rate.adapter.fidelity FILE``.

The checker's transition system
-------------------------------
A checker state ("world") is the spec's ``SchedulerState`` plus what the events still
may do: each user's pending streams (not yet added), the aborts left, and two pieces of
bookkeeping the checker needs for properties over whole runs (below): each user's
dispatch ledger (I7, I13) and each resident stream's bypass count (F1). Enabled events:
``Step``; ``AdvanceClock(d)`` for each declared increment ``d``; ``Drain`` (async scopes
that declare it, when output is in flight); ``AddRequest`` of any user's pending stream
and ``Abort`` of any live request, and (R21) ``ChangeRates`` of the scope's next rate
table, while fewer than ``horizon`` events have happened (``horizon`` None: always).
Every state keeps ``Step`` and ``AdvanceClock`` enabled, so liveness is decided exactly
on the explored graph.

Canonical states (what makes the state space finite and small)
--------------------------------------------------------------
Two worlds with the same canonical form have the same future up to renaming and a shift
of time, so only one is explored. Each reduction is sound for a stated reason:

- *Clock.* Nothing in ``step`` depends on absolute time, only on ``TAT - now`` (R2, R5,
  R6 are all written in differences). The canonical world has ``now_ns = 0`` and every
  TAT replaced by its lead ``TAT - now``. A TAT ``<= now`` is dropped: R6 says such a
  user behaves exactly as an unknown one (``allows`` is true, ``max(TAT, now) = now``).
  The leads are bounded (``<= tau + T`` after any grant), so the clock adds finitely many
  states although it advances forever.
- *Cleanup cadence.* ``num_schedules`` only decides *when* R6 cleanup runs. Cleanup only
  deletes TATs ``<= now`` and last-served entries of requests that left, both of which the
  canonical form drops anyway. The checker *verifies* this after every ``Step``: it
  applies ``limiter.cleanup_idle_users`` to the new state and requires the canonical
  limiter to be unchanged (check "R6"). Hence ``num_schedules`` is dropped.
- *Request names and counters.* Live requests are renamed ``q0, q1, ...`` in arrival
  order and their ``arrival`` replaced by that rank (only the order of arrivals matters:
  PRIORITY compares ``(priority, arrival)``, R13 takes the latest arrival);
  ``num_preemptions`` (read by nothing) is zeroed; in-flight outputs and last-served
  entries of requests that left are dropped (``deliver`` drops such output, R14 ignores
  a last-served stream that is not running; scopes never reuse a request id); R14's
  ``turns`` keep only running requests (``turn_order`` drops the others); an empty
  in-flight output equals none.
- *Symmetry over users.* Users with the same rate are interchangeable: nothing in the
  spec compares user names, and the checker state carries each user's pending streams
  and ledger with the user. Within each class of equal-rate users, names are assigned in
  a canonical order: users with live requests by their first live arrival, the others by
  (pending streams, TAT lead, ledger lead); users tied on the latter are identical, so
  the choice between them does not matter.

States are stored as 128-bit BLAKE2b fingerprints of the canonical key (hash compaction,
as TLC does with 64 bits): the chance that two distinct states collide, silently merging
them, is below ``n^2 / 2^129`` (< 10^-26 at 10^6 states).

Properties
----------
- Every transition: ``invariants.check`` (I1-I18; I7's window bound is evaluated by the
  checker in ledger form, see below) and any ``AssertionError`` raised inside the spec
  (check "assert").
- I7 in ledger form: for each user the checker replays GCRA over the user's *sampling
  dispatches* (not the limiter's charges): ``L := max(L, t) + T`` per dispatch at time
  ``t``. A dispatch sequence satisfies the window bound "dispatches in any window of W
  ns <= floor((W + tau) x rate) + 1" iff every dispatch happens at ``t >= L - tau``
  (after k dispatches from idle, ``L = max_j (t_j + (k - j + 1) T)``, so ``t_{k+1} >=
  L - tau`` is exactly the bound for every window ``[t_j, t_{k+1}]``). So the check is
  exact over the whole, unbounded history, with one number per user. Counterexamples
  are confirmed with ``invariants.i7_window_bound`` on the concrete history.
- F1 (R14, bounded bypass): a running stream refused (throttled) in a step in which
  another stream of its (user, priority) group was dispatched has been bypassed; its
  count resets when it is dispatched or leaves ``running``. Rotation guarantees at most
  (streams of one user at that priority in the scope - 1) consecutive bypasses.
- I18 (R19, not binding = stock): in every Step in which no limit binds (no user refused
  or held, nothing throttled, the active cap never reached), the spec's step equals the
  base scheduler's step from the same state (``invariants.i18_not_binding_is_stock``);
  coverage ``not_binding`` counts those steps per scope.
- Liveness (a): from every reachable state, a state where every live request has
  finished is reachable by ``Step`` and ``AdvanceClock`` events alone (no adds, aborts
  or drains): every request that is not aborted eventually finishes.
- Liveness (b): no reachable state holds work from which no ``Step``/``AdvanceClock``
  sequence ever schedules a token ("engine healthy but stuck").
  Both by backward reachability on the explored graph (exact: every explored state has
  all its ``Step``/``AdvanceClock`` successors explored).

Scopes and profiles live in ``proofs/modelcheck_scopes.json`` with their pinned numbers
of distinct states and transitions (``tests/test_modelcheck.py``).

``python -m vllm_output_rate.proofs.modelcheck --profile quick`` runs a profile;
``--pin`` rewrites the pinned counts of the profile's scopes (deliberately, after a spec
change); ``--mutations`` runs the spec-mutation table and writes docs/SPEC_MUTATIONS.md.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import marshal
import math
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import rate as spec_rate
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.state import (
    EngineConfig,
    Observation,
    OutputEntry,
    RequestState,
    SchedulerState,
    blocks_for,
    initial_state,
)

MANIFEST_PATH = Path(__file__).with_name("modelcheck_scopes.json")
REPO_ROOT = Path(__file__).resolve().parent.parent
MUTATIONS_DOC = REPO_ROOT / "docs" / "SPEC_MUTATIONS.md"
MS = 1_000_000
MAX_SCOPE_STATES = 20_000_000  # no scope may declare more (memory: ~100 bytes per state)
MAX_STREAMS_PER_SCOPE = 12
LIVENESS_TAIL_ROUNDS = 8  # a liveness counterexample ends with this many rounds of steps and clock advances
PROGRESS_EVERY = 2000  # states between two progress reports

CHECK_IDS = ("assert", "I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13", "I14",
             "I15", "I16", "I17", "I18", "I19", "R6", "F1", "liveness-a", "liveness-b", "F2")
NEW_CHECKS = ("I13", "I14", "I15", "I16", "I17", "F1", "R6")  # added with the checker (docs/SPEC_MUTATIONS.md)
ORIGINAL_INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12")


# -- scopes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """One request a user may send: sizes, EOS index (None: never), priority."""

    prompt_len: int
    max_tokens: int
    eos_index: int | None = None
    priority: int = 0

    def as_tuple(self) -> tuple:
        return (self.prompt_len, self.max_tokens, self.eos_index, self.priority)


@dataclass(frozen=True)
class Scope:
    """A declared finite scope: engine configuration, users and their streams, events.

    ``users``: (name, streams) in a fixed order. ``clock_ns``: the ``AdvanceClock``
    increments. ``max_aborts``: aborts allowed over a whole run. ``drain``: async only,
    ``Drain`` events enabled. ``horizon``: adds and aborts only within the first
    ``horizon`` events (None: any time). ``max_states``: asserted bound on distinct states.
    ``pinned``: the manifest's expected (states, transitions), None if not pinned.
    """

    name: str
    config: EngineConfig
    users: tuple[tuple[str, tuple[Stream, ...]], ...]
    clock_ns: tuple[int, ...] = (50 * MS, 100 * MS)
    max_aborts: int = 0
    drain: bool = False
    horizon: int | None = None
    max_states: int = 100_000
    pinned: tuple[int, int] | None = None
    note: str = ""
    fair_admission: bool = False  # F2 (R20): checked; needs max_num_seqs_per_user C with users x C <= M
    # R21: rate tables the operator may install, each once and in this order, at any point
    # within the horizon (``ChangeRates``); the feature must be on.
    rate_changes: tuple[ChangeRates, ...] = ()

    def __post_init__(self) -> None:
        c = self.config
        names = [u for u, _ in self.users]
        assert names and len(set(names)) == len(names), f"{self.name}: user names must be distinct: {names}"
        assert all("-" not in u for u in names), f"{self.name}: user names may not contain '-'"
        num_streams = sum(len(s) for _, s in self.users)
        assert 1 <= num_streams <= MAX_STREAMS_PER_SCOPE, f"{self.name}: {num_streams} streams"
        assert 0 <= self.max_aborts <= num_streams, f"{self.name}: max_aborts {self.max_aborts}"
        assert not self.drain or c.async_scheduling, f"{self.name}: Drain only in async scopes"
        assert self.horizon is None or self.horizon >= 1, f"{self.name}: horizon {self.horizon}"
        assert 1 <= self.max_states <= MAX_SCOPE_STATES, f"{self.name}: max_states {self.max_states}"
        assert all(d > 0 for d in self.clock_ns), f"{self.name}: clock increments must be > 0"
        assert c.rate_limited or not self.clock_ns, f"{self.name}: feature off, the clock changes nothing"
        assert c.rate_limited or not self.rate_changes, f"{self.name}: R21 rate changes need the feature on"
        # vLLM refuses to start unless one max_model_len sequence fits in the KV cache, and
        # its front end rejects prompts of max_model_len tokens or more (fidelity EXCLUSIONS).
        assert blocks_for(c.max_model_len, c) <= c.num_usable_blocks, (
            f"{self.name}: max_model_len {c.max_model_len} does not fit {c.num_usable_blocks} blocks of {c.block_size}")
        for _, streams in self.users:
            for s in streams:
                assert 1 <= s.prompt_len < c.max_model_len and s.max_tokens >= 1, f"{self.name}: {s}"
                assert s.priority == 0 or c.policy == "priority", f"{self.name}: priority under FCFS"

        # F2 (R20): with every user at its cap C a slot is still free (users x C <= M).
        assert not self.fair_admission or (
            c.max_num_seqs_per_user is not None and len(self.users) * c.max_num_seqs_per_user <= c.max_num_seqs), (
            f"{self.name}: fair_admission needs max_num_seqs_per_user C with users x C <= max_num_seqs")

    @property
    def user_names(self) -> tuple[str, ...]:
        return tuple(u for u, _ in self.users)


def scope_from_json(data: dict) -> Scope:
    """A scope from its manifest entry (see ``proofs/modelcheck_scopes.json``)."""
    c = dict(data["config"])
    rates = c.pop("user_rates", {})
    default = c.pop("default_rate", None)
    burst_ms = c.pop("burst_ms", 100)
    config = EngineConfig(
        default_rate_tokens_per_s=None if default is None else Fraction(default),
        user_rates_tokens_per_s=tuple((u, Fraction(r)) for u, r in rates.items()),
        burst_ns=int(Fraction(burst_ms) * MS),
        **c,
    )
    users = tuple((name, tuple(Stream(*s) for s in streams)) for name, streams in data["users"].items())
    pinned = data.get("pinned")
    return Scope(
        name=data["name"],
        config=config,
        users=users,
        clock_ns=tuple(int(Fraction(ms) * MS) for ms in data.get("clock_ms", [50, 100])),
        max_aborts=data.get("max_aborts", 0),
        drain=data.get("drain", False),
        horizon=data.get("horizon"),
        max_states=data["max_states"],
        pinned=None if pinned is None else (pinned["states"], pinned["transitions"]),
        note=data.get("note", ""),
        fair_admission=data.get("fair_admission", False),
        rate_changes=tuple(ChangeRates(t["default"], tuple(sorted(t.get("users", {}).items())))
                           for t in data.get("rate_changes", [])),
    )


def load_manifest(path: Path = MANIFEST_PATH) -> dict:
    with open(path) as handle:
        return json.load(handle)


def profile_scopes(profile: str, path: Path = MANIFEST_PATH) -> list[Scope]:
    """The scopes of ``profile`` (quick, ci, release), in manifest order."""
    manifest = load_manifest(path)
    assert profile in manifest["profiles"], f"unknown profile {profile!r}: {sorted(manifest['profiles'])}"
    wanted = set(manifest["profiles"][profile])
    scopes = [scope_from_json(s) for s in manifest["scopes"] if s["name"] in wanted]
    assert len(scopes) == len(wanted), f"profile {profile} names scopes missing from the manifest"
    return scopes


def scope_by_name(name: str, path: Path = MANIFEST_PATH) -> Scope:
    for data in load_manifest(path)["scopes"]:
        if data["name"] == name:
            return scope_from_json(data)
    raise KeyError(name)


class Compiled:
    """Per-scope constants used on the hot path."""

    def __init__(self, scope: Scope) -> None:
        config = scope.config
        self.scope = scope
        self.config = config
        self.users = scope.user_names
        self.uidx = {u: i for i, u in enumerate(self.users)}
        self.identity = {u: u for u in self.users}
        self.rate_limited = config.rate_limited
        self.burst = config.burst_ns
        self.interval = {u: spec_limiter.emission_interval_ns(config.rate_of(u)) for u in self.users} \
            if self.rate_limited else {}
        # Symmetry classes: users of equal rate (feature off: all users are alike).
        by_rate: dict[Any, list[str]] = {}
        for u in self.users:
            by_rate.setdefault(config.rate_of(u) if self.rate_limited else None, []).append(u)
        # R21: after a change users of one rate may differ, so no symmetry with rate changes.
        self.classes = [sorted(c) for c in by_rate.values() if len(c) > 1] if not scope.rate_changes else []
        self.rate_changes = scope.rate_changes
        # F1 bound, per priority: the most streams one user has at that priority, minus one
        # (the same for every user, so that renaming users keeps it).
        self.bypass_bound: dict[int, int] = {}
        for _, streams in scope.users:
            for prio in {s.priority for s in streams}:
                count = sum(s.priority == prio for s in streams)
                self.bypass_bound[prio] = max(self.bypass_bound.get(prio, 0), count - 1)
        self.clock_events = tuple(AdvanceClock(d) for d in scope.clock_ns)
        self.async_mode = config.async_scheduling


# -- worlds ----------------------------------------------------------------------------
class World:
    """A checker state: the spec state plus the checker's own bookkeeping.

    ``pending``: per user (scope order), the sorted stream tuples not yet added.
    ``ledger``: per user, the GCRA replay of its sampling dispatches (absolute ns) or None.
    ``bypass``: request id -> consecutive bypasses (F1), only non-zero entries.
    ``added``: per user, streams added so far (names concrete request ids; not in the key).
    ``changes_done``: R21, how many of the scope's rate tables were installed (in the key).
    """

    __slots__ = ("aborts_left", "added", "bypass", "changes_done", "ledger", "pending", "state")

    def __init__(self, state, pending, ledger, bypass, aborts_left, added, changes_done: int = 0) -> None:
        self.state: SchedulerState = state
        self.pending: tuple[tuple[tuple, ...], ...] = pending
        self.ledger: tuple[Fraction | None, ...] = ledger
        self.bypass: dict[str, int] = bypass
        self.aborts_left: int = aborts_left
        self.added: tuple[int, ...] = added
        self.changes_done = changes_done


def initial_world(cs: Compiled) -> World:
    scope = cs.scope
    pending = tuple(tuple(sorted((s.as_tuple() for s in streams), key=_stream_order)) for _, streams in scope.users)
    return World(initial_state(scope.config), pending, (None,) * len(cs.users), {}, scope.max_aborts,
                 (0,) * len(cs.users))


def _stream_order(stream: tuple) -> tuple:
    prompt, max_tokens, eos, prio = stream
    return (prompt, max_tokens, -1 if eos is None else eos, prio)


def _frac(value: Fraction | None) -> tuple[int, int]:
    if value is None:
        return (0, 1)
    return (value.numerator, value.denominator)


def _pending_sig(pending: tuple) -> tuple:
    return tuple((p, m, -1 if e is None else e, q) for p, m, e, q in pending)


def _user_mapping(world: World, cs: Compiled, leads: dict[str, Any], ledger_leads: dict[str, Any]) -> dict[str, str]:
    """Old user name -> canonical name: within each class of interchangeable users
    (``cs.classes``), users that hold requests in order of their first request, then the
    others by pending arrivals, limiter lead and ledger lead (``leads``: ns ahead of now)."""
    mapping = cs.identity
    if cs.classes:
        mapping = dict(mapping)
        first: dict[str, int] = {}
        for i, r in enumerate(world.state.requests):
            if r.user not in first:
                first[r.user] = i
        for cls in cs.classes:
            def order(u: str):
                if u in first:
                    return (0, first[u])
                return (1, _pending_sig(world.pending[cs.uidx[u]]), _frac(leads.get(u)), _frac(ledger_leads.get(u)))
            for new, old in zip(cls, sorted(cls, key=order)):
                mapping[old] = new
    return mapping


def canonical_key(world: World, cs: Compiled) -> tuple[bytes, tuple]:
    """The fingerprint of ``world``'s canonical form (module docstring), and what
    ``canonical_world`` needs to build that form."""
    st = world.state
    now = st.now_ns
    leads = {u: t - now for u, t in st.limiter.tat_ns.items() if t > now}
    ledger_leads = {cs.users[i]: t - now for i, t in enumerate(world.ledger) if t is not None and t > now}
    requests = st.requests
    mapping = _user_mapping(world, cs, leads, ledger_leads)
    index = {r.request_id: i for i, r in enumerate(requests)}
    running = set(st.running)
    # Limiter keys are users; a mutated spec may key by request id (then renamed like the
    # request, and dropped once the request left: ids are never reused).
    new_leads = {(mapping[u] if u in mapping else f"q{index[u]}"): lead for u, lead in leads.items()
                 if u in mapping or u in index}
    inverse = {new: old for old, new in mapping.items()}
    pending = tuple(world.pending[cs.uidx[inverse[u]]] for u in cs.users)
    ledger = tuple(ledger_leads.get(inverse[u]) for u in cs.users)
    uidx = cs.uidx
    in_flight = None
    if st.in_flight:
        in_flight = tuple((index[e.request_id], e.num_scheduled_tokens, e.sampled, e.eos)
                          for e in st.in_flight if e.request_id in index) or None
    key = (
        tuple((uidx[mapping[r.user]], r.priority, r.prompt_len, r.max_tokens, r.eos_index, r.status,
               r.num_computed_tokens, r.num_output_tokens, r.num_output_placeholders, r.num_in_flight_tokens,
               r.num_stale_output_tokens, r.num_blocks, r.num_sampling_dispatches) for r in requests),
        tuple(index[x] for x in st.running),
        tuple(index[x] for x in st.waiting),
        in_flight,
        tuple(sorted((u, _frac(lead)) for u, lead in new_leads.items())),
        tuple(_frac(t) for t in ledger),
        tuple(sorted((uidx[mapping[u]], p, index[rid]) for u, p, rid in st.last_served if rid in index)),
        tuple(index[rid] for rid in st.turns if rid in running),  # R14: only running requests take turns
        pending,
        tuple(sorted((index[rid], n) for rid, n in world.bypass.items() if rid in index and n > 0)),
        world.aborts_left,
        world.changes_done,  # R21: with pending_rates, the rate table in force and the one to come
        st.pending_rates is not None,
    )
    # marshal version 2: no object sharing, so equal keys always give equal bytes.
    digest = hashlib.blake2b(marshal.dumps(key, 2), digest_size=16).digest()
    return digest, (mapping, index, new_leads, pending, ledger, inverse)


def canonical_world(world: World, cs: Compiled, context: tuple) -> World:
    """The canonical form itself (a world whose state is a real spec state): ``now_ns``
    0, TATs as leads, requests ``q0, q1, ...`` in arrival order, users renamed."""
    mapping, index, new_leads, pending, ledger, inverse = context
    st = world.state
    ids = {rid: f"q{i}" for rid, i in index.items()}
    new_requests = []
    for i, r in enumerate(st.requests):
        rid = ids[r.request_id]
        user = mapping[r.user]
        if r.request_id == rid and r.user == user and r.arrival == i and r.num_preemptions == 0:
            new_requests.append(r)
        else:
            new_requests.append(RequestState(
                rid, user, r.priority, i, r.prompt_len, r.max_tokens, r.eos_index, r.status, r.num_computed_tokens,
                r.num_output_tokens, r.num_output_placeholders, r.num_in_flight_tokens, r.num_stale_output_tokens,
                r.num_blocks, r.num_sampling_dispatches, 0))
    in_flight = None
    if st.in_flight:
        in_flight = tuple(e if e.request_id == ids[e.request_id] else
                          OutputEntry(ids[e.request_id], e.num_scheduled_tokens, e.sampled, e.eos)
                          for e in st.in_flight if e.request_id in ids) or None
    limiter = spec_limiter.LimiterState(MappingProxyType({u: new_leads[u] for u in sorted(new_leads)}))
    last_served = tuple(sorted((mapping[u], p, ids[rid]) for u, p, rid in st.last_served if rid in ids))
    running = set(st.running)
    turns = tuple(ids[rid] for rid in st.turns if rid in running)
    added = tuple(world.added[cs.uidx[inverse[u]]] for u in cs.users)
    bypass = {ids[rid]: n for rid, n in world.bypass.items() if rid in ids and n > 0}
    rep_state = SchedulerState(
        config=st.config, now_ns=0, requests=tuple(new_requests), running=tuple(ids[x] for x in st.running),
        waiting=tuple(ids[x] for x in st.waiting), num_free_blocks=st.num_free_blocks, in_flight=in_flight,
        num_arrivals=len(new_requests), num_schedules=0, limiter=limiter, last_served=last_served, turns=turns,
        pending_rates=st.pending_rates)
    return World(rep_state, pending, ledger, bypass, world.aborts_left, added, world.changes_done)


def canonicalize(world: World, cs: Compiled) -> tuple[bytes, World]:
    """The fingerprint of ``world``'s canonical form, and that form."""
    digest, context = canonical_key(world, cs)
    return digest, canonical_world(world, cs, context)


# -- transitions -----------------------------------------------------------------------
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
            events.append(AddRequest(rid, user=user, priority=prio, prompt_len=prompt, max_tokens=max_tokens,
                                     eos_index=eos))
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
        pending = pending[:ui] + (tuple(rest),) + pending[ui + 1:]
        added = added[:ui] + (added[ui] + 1,) + added[ui + 1:]
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
            history = invariants.DispatchHistory(ledger_tat_ns=tuple(
                (u, t) for u, t in zip(cs.users, ledger) if t is not None))
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
            current = spec_limiter.rescaled_tat_ns(current, old, new, now)
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
        ui = cs.uidx[user]
        current = ledger[ui]
        if current is not None and current - now > cs.burst:
            found.append(("I7", f"I7 (R2): user {user}: a sampling dispatch at {now} ns with the dispatch ledger "
                                f"{float(current - now) / MS:g} ms ahead (> tau {cs.burst / MS:g} ms): the window "
                                f"bound floor((W + tau) x rate) + 1 is exceeded for some window ending now"))
        interval = cs.interval[user] if after is None else spec_limiter.emission_interval_ns(after.config.rate_of(user))
        ledger[ui] = max(current if current is not None else now, now) + interval  # R21: the rate in force
    return tuple(ledger), found


def _check_cleanup(after: SchedulerState, cs: Compiled) -> list[tuple[str, str]]:
    """R6: cleanup at this instant must not change the canonical limiter (module docstring)."""
    now = after.now_ns
    cleaned = spec_limiter.cleanup_idle_users(after.limiter, now)
    kept = {u: t for u, t in after.limiter.tat_ns.items() if t > now}
    got = {u: t for u, t in cleaned.tat_ns.items() if t > now}
    if kept != got or any(u not in after.limiter.tat_ns for u in cleaned.tat_ns):
        return [("R6", f"R6: cleanup at {now} ns changes the limiter: {dict(after.limiter.tat_ns)} -> "
                       f"{dict(cleaned.tat_ns)} (only users with TAT <= now may be forgotten)")]
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
                found.append(("F1", f"F1 (R14): {rid} of user {group[0]} (priority {group[1]}) throttled "
                                    f"{new[rid]} steps in a row while other streams of its group were served "
                                    f"(rotation allows at most {bound})"))
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
        return [("F2", f"F2 (R20): {rid} of user {user} waits a step although its user holds {held.get(user, 0)} "
                       f"< max_num_seqs_per_user={cap} running requests ({len(before.running)} of "
                       f"max_num_seqs={config.max_num_seqs} slots taken at the step's start): another user's "
                       "flood holds back its admission")]
    return []


def _is_progress_event(event: Event) -> bool:
    return isinstance(event, (Step, AdvanceClock))


# -- exploration ---------------------------------------------------------------------------
@dataclass
class Violation:
    """The shortest counterexample found for one check."""

    check: str
    message: str
    length: int  # events in the counterexample (liveness: the prefix to the bad state)
    state_id: int  # the source state (safety) or the bad state (liveness)
    event: Event | None = None  # the violating event (safety)
    events: tuple[Event, ...] = ()  # the concrete, replayable event sequence
    official: str | None = None  # what invariants.check says when the sequence is replayed
    scenario_path: str | None = None
    concrete: bool = False  # rebuilt from the real initial state by concrete events

    def as_json(self) -> dict:
        return {"check": self.check, "message": self.message, "length": self.length,
                "events": [str(e) for e in self.events], "official": self.official,
                "scenario": self.scenario_path}


@dataclass
class ScopeResult:
    """One scope's exploration."""

    name: str
    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    invariant_checks: int = 0
    max_depth: int = 0
    violations: dict[str, Violation] = field(default_factory=dict)
    bound_exceeded: bool = False
    pinned: tuple[int, int] | None = None
    coverage: dict[str, int] = field(default_factory=dict)  # transitions exercising each behaviour
    graph: tuple | None = None  # (fingerprints, parents, depths) when asked for (``keep_graph``)

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    @property
    def pin_ok(self) -> bool:
        return self.pinned is None or self.pinned == (self.states, self.transitions)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.bound_exceeded

    def as_json(self) -> dict:
        return {"name": self.name, "states": self.states, "transitions": self.transitions,
                "states_per_s": round(self.states_per_s, 1), "violations": len(self.violations),
                "seconds": round(self.seconds, 2), "invariant_checks": self.invariant_checks,
                "max_depth": self.max_depth, "bound_exceeded": self.bound_exceeded, "coverage": self.coverage,
                "pinned": None if self.pinned is None else {"states": self.pinned[0], "transitions": self.pinned[1]},
                "details": [v.as_json() for v in self.violations.values()]}


class ScopeBoundExceeded(AssertionError):
    """The scope reached more distinct states than its declared ``max_states``."""


COVERAGE_KEYS = ("scheduled", "sampled", "charged", "refunded", "throttled", "refused_prefill", "wait_hint",
                 "preempted", "preempted_throttled", "admitted", "stop", "length", "stale_output", "rotation",
                 "not_binding", "held")


def _cover(coverage: dict[str, int], obs: Observation, before: SchedulerState) -> None:
    """Count the behaviours a Step transition exercised (scopes must reach the rules)."""
    coverage["scheduled"] += bool(obs.scheduled)
    coverage["sampled"] += bool(obs.sampled)
    coverage["charged"] += bool(obs.charged)
    coverage["refunded"] += bool(obs.refunded)
    coverage["throttled"] += bool(obs.throttled)
    coverage["wait_hint"] += obs.wait_hint_ns is not None
    coverage["preempted"] += bool(obs.preempted)
    coverage["admitted"] += bool(obs.admitted)
    coverage["stop"] += any(f.reason == "stop" for f in obs.finished)
    coverage["length"] += any(f.reason == "length" for f in obs.finished)
    if obs.rate_limited:
        throttled_users = {r.user for r in before.requests if r.request_id in obs.throttled}
        coverage["preempted_throttled"] += any(
            r.request_id in obs.preempted and r.request_id in before.running
            and not spec_limiter.allows(before.limiter, r.user, before.now_ns, before.config.burst_ns)
            for r in before.requests)
        coverage["refused_prefill"] += any(
            rid not in obs.sampled and r.user in throttled_users | {u for u, _ in obs.tat_ns}
            and not spec_limiter.allows(before.limiter, r.user, before.now_ns, before.config.burst_ns)
            for rid, _ in obs.scheduled for r in before.requests if r.request_id == rid)
        coverage["rotation"] += spec_rate.turn_order(before) != before.running
        coverage["not_binding"] += not obs.limit_bound  # R19: compared with the base step (I18)
        coverage["held"] += bool(spec_rate.start_turns(before)[2])  # R14: some user granted, not for all
    coverage["stale_output"] += any(r.request_id in obs.preempted and r.num_in_flight_tokens
                                    for r in before.requests)


def _invariants_per_transition(event: Event, cs: Compiled) -> int:
    """How many invariant checks one transition runs (for the report)."""
    if not isinstance(event, Step):
        return 3  # I8, I11, I12
    if not cs.rate_limited:
        return 6  # + I6, I9, I10
    return 6 + 12 + 3  # + I1-I5, I7, I13-I18; + R6, F1, assert


def explore(scope: Scope, *, max_states: int | None = None, stop_at_first: bool = False,
            on_progress: Callable[[int, int], None] | None = None, concretize_violations: bool = True,
            save_dir: Path | None = None, raise_on_bound: bool = True, strict: bool = True,
            keep_graph: bool = False) -> ScopeResult:
    """Breadth-first search of ``scope``; see the module docstring for what is checked.

    ``stop_at_first``: stop at the first safety violation (liveness is then skipped).
    ``raise_on_bound``: exceeding ``max_states`` raises ``ScopeBoundExceeded`` (else the
    search stops and the result says ``bound_exceeded``; liveness is then skipped).
    ``strict``: a violation that cannot be rebuilt from concrete events raises
    ``ConcretizationError`` (else it stays with ``concrete`` False).
    """
    # The frontier holds millions of small container objects: Python's cyclic collector
    # would rescan them over and over (throughput fell fourfold at 10^5 states). Nothing
    # here forms reference cycles, so it is paused for the search.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _explore(scope, max_states, stop_at_first, on_progress, concretize_violations, save_dir,
                        raise_on_bound, strict, keep_graph)
    finally:
        if collecting:
            gc.enable()


def _explore(scope, max_states, stop_at_first, on_progress, concretize_violations, save_dir, raise_on_bound,
             strict, keep_graph) -> ScopeResult:
    cs = Compiled(scope)
    limit = max_states if max_states is not None else scope.max_states
    started = time.perf_counter()
    result = ScopeResult(scope.name, pinned=scope.pinned)
    key0, rep0 = canonicalize(initial_world(cs), cs)
    index: dict[bytes, int] = {key0: 0}
    keys: list[bytes] = [key0]
    parent = array("q", [-1])
    depth = array("i", [0])
    no_work = bytearray([1])
    crashed = bytearray([0])  # a Step or clock advance from this state raised (liveness unknown)
    productive = bytearray([0])  # some Step from this state scheduled a token
    edge_src = array("i")
    edge_dst = array("i")
    queue: deque[tuple[int, World]] = deque([(0, rep0)])
    transitions = 0
    checks = 0
    coverage = dict.fromkeys(COVERAGE_KEYS, 0)
    while queue:
        sid, world = queue.popleft()
        d = depth[sid]
        for event in enabled_events(world, cs, d, concrete=False):
            transitions += 1
            checks += _invariants_per_transition(event, cs)
            outcome = transition(world, event, cs)
            for check, message in outcome.violations:
                if check not in result.violations:
                    result.violations[check] = Violation(check, message, d + 1, sid, event)
            if outcome.world is None:
                if _is_progress_event(event):
                    crashed[sid] = 1
                continue
            if stop_at_first and outcome.violations:
                queue.clear()
                break
            key, context = canonical_key(outcome.world, cs)
            tid = index.get(key)
            if tid is None:
                rep = canonical_world(outcome.world, cs, context)
                tid = len(keys)
                if tid >= limit:
                    result.bound_exceeded = True
                    queue.clear()
                    break
                index[key] = tid
                keys.append(key)
                parent.append(sid)
                depth.append(d + 1)
                no_work.append(0 if rep.state.requests else 1)
                crashed.append(0)
                productive.append(0)
                queue.append((tid, rep))
                if on_progress is not None and tid % PROGRESS_EVERY == 0:
                    on_progress(tid + 1, transitions)
            if isinstance(event, Step) and outcome.obs is not None:
                _cover(coverage, outcome.obs, world.state)
            if _is_progress_event(event):
                edge_src.append(sid)
                edge_dst.append(tid)
                if isinstance(event, Step) and outcome.obs is not None and outcome.obs.scheduled:
                    productive[sid] = 1
    result.states = len(keys)
    result.transitions = transitions
    result.coverage = coverage
    result.invariant_checks = checks
    result.max_depth = max(depth) if len(depth) else 0
    if result.bound_exceeded and raise_on_bound:
        raise ScopeBoundExceeded(f"scope {scope.name}: more than {limit} distinct states (raise max_states "
                                 f"deliberately if the scope is meant to be this large)")
    if not result.bound_exceeded and not (stop_at_first and result.violations):
        _check_liveness(result, keys, no_work, crashed, productive, edge_src, edge_dst, depth)
    result.seconds = time.perf_counter() - started
    if on_progress is not None:
        on_progress(result.states, transitions)
    if keep_graph:
        result.graph = (keys, parent, depth)
    if concretize_violations:
        for violation in result.violations.values():
            try:
                _concretize(violation, scope, cs, keys, parent, save_dir)
            except ConcretizationError:
                if strict:
                    raise
    return result


class ConcretizationError(AssertionError):
    """A canonical path has no concrete counterpart: the reductions are unsound for the
    spec being checked (a mutation may depend on names or on absolute time)."""


def _backward_closure(n: int, seeds: bytearray, edge_src: array, edge_dst: array) -> bytearray:
    """States from which some seed state is reachable along the edges."""
    # Reverse adjacency in CSR form.
    count = array("i", bytes(4 * (n + 1)))
    for dst in edge_dst:
        count[dst + 1] += 1
    for i in range(n):
        count[i + 1] += count[i]
    fill = array("i", count)
    rev = array("i", bytes(4 * len(edge_dst)))
    for src, dst in zip(edge_src, edge_dst):
        rev[fill[dst]] = src
        fill[dst] += 1
    good = bytearray(seeds)
    stack = [i for i in range(n) if good[i]]
    while stack:
        node = stack.pop()
        for k in range(count[node], count[node + 1]):
            src = rev[k]
            if not good[src]:
                good[src] = 1
                stack.append(src)
    return good


def _check_liveness(result: ScopeResult, keys, no_work, crashed, productive, edge_src, edge_dst, depth) -> None:
    n = len(keys)
    seeds_a = bytearray(1 if (no_work[i] or crashed[i]) else 0 for i in range(n))
    can_finish = _backward_closure(n, seeds_a, edge_src, edge_dst)
    seeds_b = bytearray(1 if (productive[i] or crashed[i] or no_work[i]) else 0 for i in range(n))
    can_progress = _backward_closure(n, seeds_b, edge_src, edge_dst)
    stuck = next((i for i in range(n) if not can_progress[i]), None)  # ids grow with depth: the shallowest
    if stuck is not None:
        result.violations["liveness-b"] = Violation(
            "liveness-b", "liveness (b): work is left and no sequence of steps and clock advances ever schedules "
                          "a token again (engine healthy but stuck)", depth[stuck], stuck)
    unfinished = next((i for i in range(n) if not can_finish[i]), None)
    if unfinished is not None:
        result.violations["liveness-a"] = Violation(
            "liveness-a", "liveness (a): from this state no sequence of steps and clock advances finishes every "
                          "live request", depth[unfinished], unfinished)


# -- counterexamples ---------------------------------------------------------------------
def _concretize(violation: Violation, scope: Scope, cs: Compiled, keys: list[bytes], parent: array,
                save_dir: Path | None) -> None:
    """Rebuild the violation as concrete events from the real initial state (the path's
    canonical states guide the choice at each step), confirm it with the official
    invariants and save it as a replayable ``StepScenario``."""
    world, events = concrete_path(scope, cs, keys, parent, violation.state_id)
    if violation.event is not None:  # safety: the violating transition itself
        for event in enabled_events(world, cs, len(events), concrete=True):
            if type(event) is not type(violation.event):
                continue
            found = [m for c, m in transition(world, event, cs).violations if c == violation.check]
            if found:
                events.append(event)
                violation.message = found[0]  # with the concrete request ids and clock
                break
        else:
            raise ConcretizationError(f"{scope.name}: cannot concretize the violating event of {violation.check}")
    else:  # liveness: show the lack of progress with a tail of steps and clock advances
        longest = max(scope.clock_ns) if scope.clock_ns else 0
        for _ in range(LIVENESS_TAIL_ROUNDS):
            events.append(Step())
            if longest:
                events.append(AdvanceClock(longest))
    violation.events = tuple(events)
    violation.concrete = True
    violation.official = official_verdict(scope.config, violation.events)
    if save_dir is not None:
        from vllm_output_rate.adapter.fidelity import StepScenario

        save_dir.mkdir(parents=True, exist_ok=True)
        target = save_dir / f"modelcheck-{scope.name}-{violation.check}.json"
        target.write_text(StepScenario(scope.config, violation.events).to_json() + "\n")
        violation.scenario_path = str(target)


def concrete_path(scope: Scope, cs: Compiled, keys: list[bytes], parent: array,
                  state_id: int) -> tuple[World, list[Event]]:
    """The shortest path to ``state_id`` as concrete events from the real initial state,
    and the concrete world it reaches (whose canonical form is ``state_id``'s)."""
    path = []
    node = state_id
    while node != -1:
        path.append(node)
        node = parent[node]
    path.reverse()
    world = initial_world(cs)
    events: list[Event] = []
    for depth_index, target in enumerate(path[1:]):
        for event in enabled_events(world, cs, depth_index, concrete=True):
            outcome = transition(world, event, cs)
            if outcome.world is not None and canonical_key(outcome.world, cs)[0] == keys[target]:
                events.append(event)
                world = outcome.world
                break
        else:
            raise ConcretizationError(f"{scope.name}: cannot concretize the path to state {state_id} at depth "
                                      f"{depth_index}")
    return world, events


def sample_scenarios(scope: Scope, count: int, seed: int = 0):
    """``count`` replayable ``StepScenario``s of ``scope``: shortest paths to the deepest
    explored states and to random ones, each followed by steps and clock advances until
    every request has finished (the spec's own run; bounded)."""
    import random

    from vllm_output_rate.adapter.fidelity import StepScenario

    result = explore(scope, concretize_violations=False, keep_graph=True)
    assert result.graph is not None, "keep_graph=True keeps the graph"
    keys, parent, depth = result.graph
    cs = Compiled(scope)
    deepest = sorted(range(len(keys)), key=lambda i: -depth[i])[: max(1, count // 2)]
    rng = random.Random(seed)
    chosen = list(dict.fromkeys(deepest + rng.sample(range(len(keys)), min(len(keys), count))))[:count]
    scenarios = []
    longest = max(scope.clock_ns) if scope.clock_ns else 0
    for state_id in chosen:
        world, events = concrete_path(scope, cs, keys, parent, state_id)
        state = world.state
        for _ in range(200):  # finish everything (liveness says it can; the bound is generous)
            if not state.requests and not state.in_flight:
                break
            for event in (Step(),) + ((AdvanceClock(longest),) if longest else ()):
                state, _ = spec.step(state, event)
                events.append(event)
        scenarios.append(StepScenario(scope.config, tuple(events)))
    return scenarios


def replay_sample_on_vllm(names: list[str], count: int, seed: int = 0) -> list[tuple[str, int, int, str | None]]:
    """Replay ``sample_scenarios`` of each scope on real vLLM 0.32 with the fidelity check
    (feature on: the reference scheduler, white box; off: stock vLLM). Returns (scope,
    scenarios, events, first failure or None) per scope."""
    from vllm_output_rate.adapter.fidelity import run_base
    from vllm_output_rate.adapter.whitebox import run_white_box

    rows = []
    for name in names:
        scope = scope_by_name(name)
        failure = None
        total = 0
        scenarios = sample_scenarios(scope, count, seed)
        for scenario in scenarios:
            total += len(scenario.events)
            verdict = run_white_box(scenario) if scope.config.rate_limited else run_base(scenario)
            if verdict.failure:
                failure = f"event {verdict.event_index}: {verdict.failure}\n" + "\n".join(scenario.lines())
                break
        rows.append((name, len(scenarios), total, failure))
    return rows


def official_verdict(config: EngineConfig, events: tuple[Event, ...]) -> str | None:
    """Replay ``events`` on the spec with ``invariants.check`` and the full dispatch
    history (as the gate does); the first message, or None."""
    state = initial_state(config)
    history = invariants.DispatchHistory() if config.rate_limited else None
    for index, event in enumerate(events):
        before = state
        try:
            state, obs = spec.step(state, event)
        except AssertionError as error:
            return f"event {index}: spec assertion: {error}"
        if history is not None:
            history = invariants.advance_history(history, before, obs)
        message = invariants.check(before, event, state, obs, history)
        if message:
            return f"event {index}: {message}"
    return None


# -- profiles ------------------------------------------------------------------------------
def run_scope(name: str, save_dir: str | None = None, progress_queue=None) -> dict:
    """Explore one manifest scope (a worker entry point); the result as JSON."""
    scope = scope_by_name(name)

    def report(states: int, transitions: int) -> None:
        if progress_queue is not None:
            progress_queue.put((name, states, transitions))

    try:
        result = explore(scope, on_progress=report, save_dir=None if save_dir is None else Path(save_dir))
    except ScopeBoundExceeded as error:
        return {"name": name, "error": str(error)}
    return result.as_json()


def run_profile(profile: str, jobs: int = 2, save_dir: str | None = None,
                on_progress: Callable[[str, int, int], None] | None = None,
                on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Explore every scope of ``profile`` on ``jobs`` processes; results in manifest order."""
    import multiprocessing
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor, as_completed

    names = [s.name for s in profile_scopes(profile)]
    results: dict[str, dict] = {}
    if jobs <= 1:
        for name in names:
            results[name] = run_scope(name, save_dir, None) if on_progress is None else _run_inline(
                name, save_dir, on_progress)
            if on_done is not None:
                on_done(results[name])
        return [results[n] for n in names]
    context = multiprocessing.get_context("fork")
    manager = context.Manager()
    progress_queue = manager.Queue()
    # Biggest scopes first, so that two workers finish at about the same time.
    order = sorted(names, key=lambda n: -scope_by_name(n).max_states)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(run_scope, n, save_dir, progress_queue): n for n in order}
        pending = set(futures)
        while pending:
            try:
                while True:
                    name, states, transitions = progress_queue.get(timeout=0.2)
                    if on_progress is not None:
                        on_progress(name, states, transitions)
            except queue_mod.Empty:
                pass
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                results[futures[future]] = future.result()
                if on_done is not None:
                    on_done(results[futures[future]])
        for _ in as_completed(futures):
            pass
    manager.shutdown()
    return [results[n] for n in names]


def _run_inline(name: str, save_dir: str | None, on_progress: Callable[[str, int, int], None]) -> dict:
    class _Queue:
        @staticmethod
        def put(item) -> None:
            on_progress(*item)

    return run_scope(name, save_dir, _Queue())


def pin_profile(profile: str, path: Path = MANIFEST_PATH, jobs: int = 2) -> list[dict]:
    """Explore ``profile`` and write its scopes' state and transition counts into the
    manifest (only when no scope has a violation)."""
    results = run_profile(profile, jobs=jobs)
    bad = [r["name"] for r in results if "error" in r or r["violations"]]
    assert not bad, f"not pinning: violations or errors in {bad}"
    manifest = load_manifest(path)
    by_name = {r["name"]: r for r in results}
    for entry in manifest["scopes"]:
        if entry["name"] in by_name:
            r = by_name[entry["name"]]
            entry["pinned"] = {"states": r["states"], "transitions": r["transitions"]}
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return results


# -- spec mutations ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """A small deliberate change to one spec rule, applied by monkeypatching spec modules.

    ``patches(config)`` returns (module, attribute, replacement) triples.
    """

    name: str
    rule: str
    description: str
    patches: Callable[[EngineConfig], list[tuple[Any, str, Any]]]


@contextlib.contextmanager
def applied(mutation: Mutation | None, config: EngineConfig) -> Iterator[None]:
    """Apply ``mutation`` for the duration of the block (None: the spec as written)."""
    if mutation is None:
        yield
        return
    saved = []
    try:
        for module, name, value in mutation.patches(config):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _m_no_refund(config):
    return [(spec_limiter, "refund", lambda state, user, rate: state)]


def _m_double_refund(config):
    refund = spec_limiter.refund
    return [(spec_limiter, "refund", lambda state, user, rate: refund(refund(state, user, rate), user, rate))]


def _m_refund_dispatched(config):
    return [(spec, "sampling_dispatches", lambda cycle: frozenset())]


def _m_charge_prompt_chunks(config):
    return [(spec_rate, "samples", lambda request, n: True),
            (spec, "sampling_dispatches", lambda cycle: frozenset(rid for rid, _ in cycle.scheduled))]


def _m_charge_first_chunk(config):
    samples = spec_rate.samples

    def first_chunk(request, n):
        if request.num_output_tokens == 0 and request.num_output_placeholders == 0:
            return request.num_computed_tokens == 0
        return samples(request, n)

    def dispatched(cycle):
        out = set()
        for rid, n in cycle.scheduled:
            request = next(r for r in cycle.state.requests if r.request_id == rid)
            if first_chunk(request, n):
                out.add(rid)
        return frozenset(out)

    return [(spec_rate, "samples", first_chunk), (spec, "sampling_dispatches", dispatched)]


def _m_head_of_line(config):
    visit = spec.visit_waiting

    def visit_waiting(cycle, request_id):
        if (cycle.state.config.rate_limited and cycle.token_budget > 0
                and len(cycle.state.running) < spec.admission_cap(cycle)):
            request = next(r for r in cycle.state.requests if r.request_id == request_id)
            gated, proceed = spec_rate.waiting_gate(cycle, request)
            if not proceed:
                return gated, False  # vLLM 0.32: a waiting request given 0 tokens stops admission
        return visit(cycle, request_id)

    return [(spec, "visit_waiting", visit_waiting)]


def _m_no_prefill_advance(config):
    gate = spec_rate.waiting_gate

    def waiting_gate(cycle, request):
        cycle, proceed = gate(cycle, request)
        return cycle, proceed and request.user not in cycle.refused_users

    return [(spec_rate, "prefill_room", lambda request: 0), (spec_rate, "waiting_gate", waiting_gate)]


def _m_drop_throttled(config):
    decide = spec_rate.decide_running

    def decide_running(cycle, request, n):
        was = cycle.throttled
        cycle, n = decide(cycle, request, n)
        if request.request_id in cycle.throttled - was:  # throttled now: preempt it (KV freed, recompute)
            cycle = spec.preempt(cycle, request.request_id)
        return cycle, n

    return [(spec_rate, "decide_running", decide_running)]


def _m_throttled_count_toward_cap(config):
    def admission_cap(cycle):
        return min(cycle.state.config.max_num_seqs, cycle.state.config.active_cap)

    return [(spec_rate, "admission_cap", admission_cap)]


def _m_no_active_cap(config):
    decide = spec_rate.decide_running

    def decide_running(cycle, request, n):
        saved = cycle.scheduled
        cycle, n = decide(replace(cycle, scheduled=()), request, n)
        return replace(cycle, scheduled=saved), n

    return [(spec_rate, "decide_running", decide_running)]


def _m_victims_ignore_throttled(config):
    return [(spec_rate, "preferred_victim", lambda cycle, request_id: None)]


def _m_no_rotation(config):
    return [(spec_rate, "turn_order", lambda state: state.running)]


def _m_rotate_running(config):
    begin = spec_rate.begin_cycle

    def begin_cycle(cycle):  # the article's rotation: the turn order is applied to ``running``
        cycle = begin(cycle)
        return replace(cycle, state=replace(cycle.state, running=cycle.turn_order))

    return [(spec_rate, "begin_cycle", begin_cycle)]


def _m_burst_one_second(config):
    allows, try_take = spec_limiter.allows, spec_limiter.try_take
    return [(spec_limiter, "allows", lambda state, user, now, burst=0: allows(state, user, now, 10**9)),
            (spec_limiter, "try_take", lambda state, user, rate, now, burst=0: try_take(state, user, rate, now, 10**9))]


def _m_ready_at_floor(config):
    def ready_at_ns(state, user, burst_ns=spec_limiter.BURST_NS):
        tat = state.tat_ns.get(user)
        return None if tat is None else math.floor(tat - burst_ns)

    return [(spec_limiter, "ready_at_ns", ready_at_ns)]


def _m_cleanup_active_users(config):
    cleanup = spec_limiter.cleanup_idle_users
    return [(spec_limiter, "cleanup_idle_users",
             lambda state, now: cleanup(state, now + config.burst_ns))]


def _m_budget_per_request(config):
    def try_charge(cycle, request):
        if request.request_id in cycle.refused_users:
            return cycle, False
        c = cycle.state.config
        limiter, granted = spec_limiter.try_take(cycle.state.limiter, request.request_id, c.rate_of(request.user),
                                                 cycle.now_ns, c.burst_ns)
        if not granted:
            return replace(cycle, refused_users=cycle.refused_users | {request.request_id}), False
        # Refunds (R9) and the wait hint still go by user: move the charge there.
        user_limiter, _ = spec_limiter.try_take(limiter, request.user, c.rate_of(request.user), cycle.now_ns, 10**18)
        return replace(cycle, state=replace(cycle.state, limiter=user_limiter),
                       charged=cycle.charged + (request.request_id,)), True

    return [(spec_rate, "try_charge", try_charge)]


def _m_overrides_ignored(config):
    try_take = spec_limiter.try_take
    default = config.default_rate_tokens_per_s

    def take(state, user, rate, now, burst=spec_limiter.BURST_NS):
        return try_take(state, user, default if default is not None else rate, now, burst)

    return [(spec_limiter, "try_take", take)]


def _m_wait_hint_latest(config):
    end_cycle = spec_rate.end_cycle

    def end(cycle, dispatched):
        state, settled = end_cycle(cycle, dispatched)
        order = [r.user for r in cycle.state.requests]  # arrival order, not names (the checker renames)
        users = sorted(cycle.refused_users, key=lambda u: order.index(u) if u in order else -1)
        ready = [spec_limiter.ready_at_ns(state.limiter, u, state.config.burst_ns) for u in users]
        ready = [t for t in ready if t is not None]
        settled["wait_hint_ns"] = ready[-1] if ready else None
        return state, settled

    return [(spec_rate, "end_cycle", end)]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("NoRefund", "R9", "undispatched charges are never refunded (the refund is reported but not applied)",
             _m_no_refund),
    Mutation("DoubleRefund", "R9", "an undispatched charge is refunded twice", _m_double_refund),
    Mutation("RefundDispatched", "R9", "dispatched charges are refunded too", _m_refund_dispatched),
    Mutation("ChargePromptChunks", "R7", "every scheduled chunk is charged, intermediate prefill chunks included",
             _m_charge_prompt_chunks),
    Mutation("ChargeFirstChunkInstead", "R7", "a prefill is charged at its first chunk, not at the sampling one",
             _m_charge_first_chunk),
    Mutation("HeadOfLineBlocking", "R10", "a refused waiting request stops admission (vLLM 0.32's loop)",
             _m_head_of_line),
    Mutation("NoPrefillAdvance", "R10", "a refused prefill waits instead of advancing to n-1",
             _m_no_prefill_advance),
    Mutation("DropThrottled", "R11", "throttled running requests are preempted (KV freed) instead of kept",
             _m_drop_throttled),
    Mutation("ThrottledCountTowardCap", "R12", "admission counts throttled requests toward the active cap",
             _m_throttled_count_toward_cap),
    Mutation("NoActiveCapInRunningLoop", "R12", "the running loop ignores the active cap A", _m_no_active_cap),
    Mutation("ThrottledNotPreferredVictims", "R13", "victim choice ignores throttling (vLLM's own choice)",
             _m_victims_ignore_throttled),
    Mutation("NoRotation", "R14", "same-user streams are served in list order", _m_no_rotation),
    Mutation("RotateRunning", "R19", "rotation reorders `running` (the article's swap): budget is spent in the "
                                     "rotated order", _m_rotate_running),
    Mutation("BurstOneSecond", "R1/R2", "burst tolerance tau of 1 s instead of 100 ms", _m_burst_one_second),
    Mutation("ReadyAtRoundedDown", "R5", "ready_at = floor(TAT - tau) instead of ceil", _m_ready_at_floor),
    Mutation("CleanupActiveUsers", "R6", "cleanup also forgets users whose TAT is up to tau ahead",
             _m_cleanup_active_users),
    Mutation("BudgetPerRequest", "R1/P2", "the budget is kept per request, not per user", _m_budget_per_request),
    Mutation("OverridesIgnored", "R1", "per-user rate overrides are ignored when charging", _m_overrides_ignored),
    Mutation("WaitHintFromLatestUser", "R16", "the wait hint is the ready time of the last refused user, not "
                                              "the earliest", _m_wait_hint_latest),
)

MUTATION_PROFILE = "mutations"  # the manifest profile whose scopes judge the mutations


@dataclass
class MutationRow:
    mutation: str
    rule: str
    description: str
    caught_by: dict[str, tuple[int, str]]  # check id -> (shortest length, scope)
    seconds: float
    example: Violation | None = None
    example_scope: str | None = None
    example_clean: bool | None = None  # the unmutated spec passes every invariant on the example's events

    @property
    def caught_by_original(self) -> dict[str, tuple[int, str]]:
        return {c: v for c, v in self.caught_by.items() if c not in NEW_CHECKS}


def run_mutation(mutation: Mutation | None, scopes: list[Scope], max_states: int = 300_000) -> MutationRow:
    """Explore each scope with ``mutation`` applied; collect every check that fires with a
    counterexample rebuilt from concrete events (others are not counted)."""
    started = time.perf_counter()
    caught: dict[str, tuple[int, str]] = {}
    example: Violation | None = None
    example_scope = None
    for scope in scopes:
        with applied(mutation, scope.config):
            result = explore(scope, max_states=max_states, raise_on_bound=False, strict=False)
        for v in result.violations.values():
            if not v.concrete:
                continue
            if v.check not in caught or v.length < caught[v.check][0]:
                caught[v.check] = (v.length, scope.name)
            if example is None or (v.length, CHECK_IDS.index(v.check)) < (example.length,
                                                                         CHECK_IDS.index(example.check)):
                example, example_scope = v, scope.name
    name = mutation.name if mutation else "(spec as written)"
    clean = None
    if example is not None:
        config = next(s for s in scopes if s.name == example_scope).config
        clean = official_verdict(config, example.events) is None
    return MutationRow(name, mutation.rule if mutation else "-", mutation.description if mutation else "-",
                       caught, time.perf_counter() - started, example, example_scope, clean)


def _mutation_worker(name: str) -> MutationRow:
    scopes = profile_scopes(MUTATION_PROFILE)
    mutation = None if name == "-" else next(m for m in MUTATIONS if m.name == name)
    return run_mutation(mutation, scopes)


def run_mutations(jobs: int = 2, names: list[str] | None = None,
                  on_row: Callable[[MutationRow], None] | None = None) -> list[MutationRow]:
    """The mutation table: the spec as written first (must be clean), then each mutation."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    wanted = ["-"] + [m.name for m in MUTATIONS if names is None or m.name in names]
    context = multiprocessing.get_context("fork")
    rows: dict[str, MutationRow] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for name, row in zip(wanted, pool.map(_mutation_worker, wanted)):
            rows[name] = row
            if on_row is not None:
                on_row(row)
    return [rows[n] for n in wanted]


def _fmt_caught(caught: dict[str, tuple[int, str]]) -> str:
    if not caught:
        return "**nothing**"
    return ", ".join(f"{c} ({n})" for c, (n, _) in sorted(caught.items(), key=lambda kv: (kv[1][0],
                                                                                       CHECK_IDS.index(kv[0]))))


def mutations_markdown(rows: list[MutationRow], scopes: list[Scope], seconds: float) -> str:
    """docs/SPEC_MUTATIONS.md from the rows (regenerate: ``python -m
    vllm_output_rate.proofs.modelcheck --mutations``)."""
    lines = [
        "# Spec mutations: what the model checker catches",
        "",
        "Generated by `python -m vllm_output_rate.proofs.modelcheck --mutations` "
        "(proofs/modelcheck.py); do not edit by hand.",
        "",
        "Each row applies one small change to one rule of the executable spec (spec/rate.py, "
        "spec/limiter.py, spec/scheduler.py, by monkeypatching for the duration of the run) and runs the "
        f"explicit-state model checker on the {len(scopes)} scopes of the manifest profile `{MUTATION_PROFILE}` "
        f"({', '.join(f'`{s.name}`' for s in scopes)}; proofs/modelcheck_scopes.json). "
        "*Caught by* lists every check that fires, with the length in events of its shortest "
        "counterexample over those scopes. Only counterexamples rebuilt as concrete event sequences from "
        "the real initial state are counted (the checker's state reductions assume the spec ignores names "
        "and absolute time; a counterexample that cannot be rebuilt would be an artefact of that assumption).",
        "",
        "*Before the checker* restricts the column to the properties the spec had before: invariants I1-I12, "
        "assertions inside the spec, liveness. The rows where it says **nothing** are the missing properties "
        "this table exposed; each got one check, all sound on the spec as written (first row; the quick, ci "
        "and release profiles; the fidelity tests against real vLLM):",
        "",
        "| check | property | rules | where |",
        "|---|---|---|---|",
        "| I13 | each user's TAT equals the GCRA replay of its sampling dispatches (up to idle): the limiter "
        "charged exactly what was dispatched, net of refunds | R4, R7, R9 | spec/invariants.py |",
        "| I14 | the wait hint is some user's ready time `ceil(TAT - tau)`, no later than any throttled user's "
        "| R5, R16 | spec/invariants.py |",
        "| I15 | a request throttled at the start of a step is preempted before any other (PRIORITY: of the "
        "victim's priority) | R13 | spec/invariants.py |",
        "| I16 | a step preempts only if KV really ran short (survivors' blocks + last victim's need exceed the "
        "pool) | R11, V6 | spec/invariants.py |",
        "| I17 | a waiting request is admitted unless its user is refused and it cannot prefill, or admission "
        "stopped at or before it (budget, seats `min(M, A + throttled)`, KV) | R10, R12, P4 | "
        "spec/invariants.py |",
        "| F1 | bounded bypass: a throttled stream is passed over by streams of its own (user, priority) group at "
        "most (streams per user - 1) steps in a row | R14 | proofs/modelcheck.py (needs a counter per stream "
        "across steps) |",
        "| R6 | cleanup at any instant leaves the limiter unchanged up to idle users (what lets the checker "
        "drop the 256-step cadence) | R6 | proofs/modelcheck.py |",
        "",
        "Other checks: `I1`-`I12` spec/invariants.py (I7 evaluated exactly in ledger form by the checker, "
        "confirmed by `invariants.i7_window_bound` on replay); `assert` an assertion inside the spec; "
        "`liveness-a` every request not aborted can still finish by steps and clock advances; "
        "`liveness-b` work is left but nothing can ever be scheduled again.",
        "",
        "| mutation | rule | change | caught by (shortest counterexample, events) | before the checker | "
        "shortest |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        shortest = min((n for n, _ in row.caught_by.values()), default=None)
        lines.append(f"| {row.mutation} | {row.rule} | {row.description} | {_fmt_caught(row.caught_by)} | "
                     f"{_fmt_caught(row.caught_by_original)} | {'-' if shortest is None else shortest} |")
    lines += [
        "",
        "Notes. CleanupActiveUsers: the spec runs cleanup every 256 `schedule()` calls, which the scopes' "
        "canonical states never count to, so without the R6 check only a 256-step run could show the extra "
        "grants (I7). OverridesIgnored charges the overridden user (20 tok/s) at the default 3 tok/s: it "
        "under-grants, which an upper bound such as I7 cannot see; I13 sees the wrong charge at once. "
        "BudgetPerRequest over-grants, which I7 sees once a second stream of the user samples.",
        "",
        "## Shortest counterexamples",
        "",
        "Each is a `StepScenario` event sequence (adapter/fidelity.py), rebuilt from the real initial state. "
        "The message is the mutated spec's; *spec as written* says whether the unmutated spec passes every "
        "invariant of spec/invariants.py on the same events (it must: the sequence is a legal scenario).",
        "",
    ]
    for row in rows:
        if row.example is None:
            continue
        clean = "passes" if row.example_clean else "**fails**"
        lines += [f"### {row.mutation} ({row.rule}) -- {row.example.check}, scope `{row.example_scope}`", "",
                  f"{row.example.message}", "", f"Spec as written on these events: {clean}.", "", "```"]
        lines += [f"{i:3d} {e}" for i, e in enumerate(row.example.events)]
        lines += ["```", ""]
    lines += [f"Run time: {seconds:.0f} s on 2 processes.", ""]
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------
def _print_results(results: list[dict]) -> int:
    bad = 0
    for r in results:
        if "error" in r:
            print(f"{r['name']}: ERROR {r['error']}")
            bad += 1
            continue
        pin = r["pinned"]
        pin_note = "" if pin is None or (pin["states"], pin["transitions"]) == (r["states"], r["transitions"]) \
            else f"  (pinned {pin['states']}/{pin['transitions']}: update the manifest deliberately)"
        print(f"{r['name']:<28} states {r['states']:>9} transitions {r['transitions']:>10} "
              f"{r['states_per_s']:>8.0f} st/s depth {r['max_depth']:>3} violations {r['violations']}{pin_note}")
        for v in r["details"]:
            print(f"    {v['check']}: {v['message']}")
            for line in v["events"]:
                print(f"        {line}")
        bad += r["violations"] > 0
    return bad


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.proofs.modelcheck")
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--scope", action="append", default=[])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--pin", action="store_true", help="rewrite the profile's pinned counts in the manifest")
    parser.add_argument("--mutations", action="store_true", help="run the spec mutations, write docs/SPEC_MUTATIONS.md")
    parser.add_argument("--mutation", action="append", default=None, help="only these mutations (no doc written)")
    parser.add_argument("--save", default=None, help="directory for counterexample scenarios")
    parser.add_argument("--replay-sample", type=int, default=0, metavar="N",
                        help="replay N explored paths per scope of the profile on real vLLM (fidelity check)")
    args = parser.parse_args(argv)
    if args.replay_sample:
        names = args.scope or [s.name for s in profile_scopes(args.profile)]
        failed = 0
        for name, count, events, failure in replay_sample_on_vllm(names, args.replay_sample):
            print(f"{name:<28} {count} scenarios, {events} events: {'PASS' if failure is None else 'FAIL'}",
                  flush=True)
            if failure:
                failed += 1
                print(failure)
        return 1 if failed else 0
    if args.mutations or args.mutation:
        started = time.perf_counter()
        rows = run_mutations(jobs=args.jobs, names=args.mutation,
                             on_row=lambda r: print(f"{r.mutation:<30} {r.rule:<6} {_fmt_caught(r.caught_by)} "
                                                    f"[{r.seconds:.0f} s]", flush=True))
        assert not rows[0].caught_by, f"the spec as written fails: {rows[0].caught_by}"
        if args.mutation is None:
            MUTATIONS_DOC.write_text(mutations_markdown(rows, profile_scopes(MUTATION_PROFILE),
                                                        time.perf_counter() - started))
            print(f"wrote {MUTATIONS_DOC}")
        return 0
    if args.pin:
        results = pin_profile(args.profile, jobs=args.jobs)
        _print_results(results)
        print(f"pinned {len(results)} scopes of profile {args.profile} in {MANIFEST_PATH}")
        return 0
    if args.scope:
        results = []
        for name in args.scope:
            results.append(explore(scope_by_name(name), save_dir=None if args.save is None else Path(args.save)
                                   ).as_json())
    else:
        results = run_profile(args.profile, jobs=args.jobs, save_dir=args.save)
    return 1 if _print_results(results) else 0


if __name__ == "__main__":
    sys.exit(main())
