"""State reduction of the model checker (``proofs/modelcheck.py``, "Canonical states"):
a checker world, its canonical form (clock shifted to 0, TATs as leads, requests renamed
in arrival order, users renamed within their symmetry classes) and that form's 128-bit
fingerprint.
"""

from __future__ import annotations

import hashlib
import marshal
from dataclasses import replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from vllm_output_rate.proofs.modelcheck_scopes import Compiled
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.state import OutputEntry, SchedulerState, initial_state


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
    return World(
        initial_state(scope.config), pending, (None,) * len(cs.users), {}, scope.max_aborts, (0,) * len(cs.users)
    )


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
    new_leads = {
        (mapping[u] if u in mapping else f"q{index[u]}"): lead
        for u, lead in leads.items()
        if u in mapping or u in index
    }
    inverse = {new: old for old, new in mapping.items()}
    pending = tuple(world.pending[cs.uidx[inverse[u]]] for u in cs.users)
    ledger = tuple(ledger_leads.get(inverse[u]) for u in cs.users)
    uidx = cs.uidx
    in_flight = None
    if st.in_flight:
        in_flight = (
            tuple(
                (index[e.request_id], e.num_scheduled_tokens, e.sampled, e.eos)
                for e in st.in_flight
                if e.request_id in index
            )
            or None
        )
    key = (
        # Every request field but the id and user (renamed), the arrival (the rank in
        # ``requests``) and num_preemptions (read by nothing): what canonical_world keeps.
        tuple(
            (
                uidx[mapping[r.user]],
                r.priority,
                r.prompt_len,
                r.max_tokens,
                r.eos_index,
                r.status,
                r.num_computed_tokens,
                r.num_output_tokens,
                r.num_output_placeholders,
                r.num_in_flight_tokens,
                r.num_stale_output_tokens,
                r.num_blocks,
                r.num_sampling_dispatches,
                r.lora,
            )
            for r in requests
        ),
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
            new_requests.append(replace(r, request_id=rid, user=user, arrival=i, num_preemptions=0))
    in_flight = None
    if st.in_flight:
        in_flight = (
            tuple(
                e
                if e.request_id == ids[e.request_id]
                else OutputEntry(ids[e.request_id], e.num_scheduled_tokens, e.sampled, e.eos)
                for e in st.in_flight
                if e.request_id in ids
            )
            or None
        )
    limiter = spec_limiter.LimiterState(MappingProxyType({u: new_leads[u] for u in sorted(new_leads)}))
    last_served = tuple(sorted((mapping[u], p, ids[rid]) for u, p, rid in st.last_served if rid in ids))
    running = set(st.running)
    turns = tuple(ids[rid] for rid in st.turns if rid in running)
    added = tuple(world.added[cs.uidx[inverse[u]]] for u in cs.users)
    bypass = {ids[rid]: n for rid, n in world.bypass.items() if rid in ids and n > 0}
    rep_state = SchedulerState(
        config=st.config,
        now_ns=0,
        requests=tuple(new_requests),
        running=tuple(ids[x] for x in st.running),
        waiting=tuple(ids[x] for x in st.waiting),
        num_free_blocks=st.num_free_blocks,
        in_flight=in_flight,
        num_arrivals=len(new_requests),
        num_schedules=0,
        limiter=limiter,
        last_served=last_served,
        turns=turns,
        pending_rates=st.pending_rates,
    )
    return World(rep_state, pending, ledger, bypass, world.aborts_left, added, world.changes_done)


def canonicalize(world: World, cs: Compiled) -> tuple[bytes, World]:
    """The fingerprint of ``world``'s canonical form, and that form."""
    digest, context = canonical_key(world, cs)
    return digest, canonical_world(world, cs, context)
