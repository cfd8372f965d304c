"""Explicit-state model checking of the shared budget protocol (R23-R26): 2 engines, 1 store.

The scope: one user (users are independent at the store), rate fixed by the emission
interval ``T = 2`` ticks, burst tolerance ``tau = 2`` ticks, lease size ``L = 1``, two
engines (engine 1's clock runs ``SKEW`` ticks ahead of the store's), lease ttl ``X`` ticks,
store timeout ``TIMEOUT`` ticks. Every interleaving of these events is explored breadth
first (``explore``):

* ``request(e)``: the engine asks for a lease of L (R24: only while it holds fewer than L
  spendable grants and has no request in flight);
* ``answer(e)``: the store, when up, makes the lease atomically (R23, on its own clock);
* ``deliver(e)``: the answer reaches the engine within the timeout;
* ``timeout(e)``: the engine abandons its request (R25: the store is slow or down); grants
  the store made for it are never spent;
* ``spend(e)``: a sampling dispatch spends one held grant of an unexpired lease. The
  engines' single-engine GCRAs are left out: an engine may spend what it holds at any
  pace, a superset of what R1-R20 allow, so every check below is only harder to pass;
* ``return(e)``: the engine gives back the unused grants of one lease (a message, one at a
  time); ``apply_return(e)``: the store, when up, applies it (R23), possibly late, after the
  engine crashed; a message not applied by the record's expiry never applies (lost);
* ``crash(e)``: the engine's holdings and request are gone (a return already sent may still
  apply); its successor is a new incarnation, which takes no lease before the records of
  its predecessor's unconfirmed returns expired (R26: it waits one ttl after start);
* ``store_down``, ``store_up`` (R25); ``tick``: the clock advances one tick, leases expire
  at the store (after X) and at the engine (X after the request was sent).

Canonical states: every time is kept relative to ``now`` (the protocol depends on
differences only, as R2), leads ``<= 0`` as 0 (``max(TAT, now)``), and leases as a sorted
tuple of their facets (no ids), so the state space is finite.

Checks on every transition:

* R24 ``bound``: the engines' dispatches, replayed through a GCRA with tolerance
  ``tau + E x H x T`` (the ledger form of ``floor((W + tau) r) + 1 + E H`` for every W,
  ``spec.shared_budget.shared_ledger_burst_ns``), are all granted: exact over the whole,
  unbounded history.
* R24 ``cap``: an engine's spendable grants plus its request and returns in flight never
  exceed H.
* R26 ``once``: per lease, grants spent plus grants returned to the store <= n.
* R25 ``closed``: no lease is made while the store is down.
* ``conservation``: when nothing is held or in flight, the store's TAT is no later than a
  GCRA replay of the grants consumed (spent or lost): the store gave back what came back.

Mutants (``MUTANTS``), each must be caught: ``double_spend``, ``lease_leak``,
``lost_return``, ``clock_skew``. ``python -m vllm_output_rate.proofs.modelcheck_shared``
prints the scopes' state counts and the mutant table.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, replace

from vllm_output_rate.spec import shared_budget

T = 2  # emission interval, ticks
TAU = 2  # burst tolerance, ticks
ENGINES = 2
SKEW = 2  # engine 1's clock is this many ticks ahead of the store's
TIMEOUT = 1  # a request older than this many ticks is abandoned
TTL = 3  # lease ttl, ticks


@dataclass(frozen=True)
class Lease:
    """One lease with all its facets: grants n, grants used (spent, or returned and applied
    at the store: R26 keeps ``used <= n``),
    the store record's ticks to live (0: no record), its holder engine and whether the
    holder is still the incarnation that leased it, the grants it holds (-1: not held),
    the engine's ticks to its deadline, the return in flight (-1: none), and whether the
    store's answer is still in flight (``answer_age`` 0; -1: not; its age is the
    request's)."""

    n: int
    used: int = 0
    record: int = 0
    holder: int = 0
    current: bool = True
    held: int = -1
    deadline: int = 0
    returning: int = -1
    answer_age: int = -1


@dataclass(frozen=True)
class World:
    """A checker state: the store's TAT lead and availability, each engine's request (``-1`` none, else its age; ``refused``: answered with no grant), the
    leases, and the two ledger leads (dispatches for R24, consumed grants for
    conservation)."""

    store_lead: int = 0
    store_up: bool = True
    request: tuple[int, ...] = (-1,) * ENGINES
    refused: tuple[bool, ...] = (False,) * ENGINES
    leases: tuple[Lease, ...] = ()
    ledger_dispatch: int = 0
    ledger_consumed: int = 0


@dataclass(frozen=True)
class Scope:
    """A scope: lease size L; ``max_states`` bounds the exploration."""

    name: str
    lease: int
    max_states: int = 400_000


SCOPES: tuple[Scope, ...] = (Scope("shared-2engines-L1", 1),)


@dataclass(frozen=True)
class Mutant:
    """A deliberately wrong protocol: ``rule`` (the rule it breaks), ``what``."""

    name: str
    rule: str
    what: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant("double_spend", "R26", "a returned lease's grants stay spendable at the engine"),
    Mutant("lease_leak", "R24", "the engine asks for a lease whatever it holds"),
    Mutant("lost_return", "R23", "the store deletes the returned record but never moves the TAT back"),
    Mutant("clock_skew", "R23", "the lease takes `now` from the asking engine's clock (engine 1 ahead)"),
)


def _consume(lead: int, count: int) -> int:
    """GCRA ledger: ``count`` grants consumed now: ``L := max(L, now) + count T``."""
    return max(lead, 0) + count * T if count else lead


class _Violation(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def _holder_leases(world: World, e: int) -> list[int]:
    return [i for i, x in enumerate(world.leases) if x.holder == e and x.current]


def _spendable(world: World, e: int) -> int:
    return sum(
        x.held for i, x in enumerate(world.leases) if x.holder == e and x.current and x.held > 0 and x.deadline > 0
    )


def _unconfirmed(world: World, e: int) -> int:
    """R24: grants of ``e``'s returns the store may still apply (they count as held)."""
    return sum(x.returning for x in world.leases if x.holder == e and x.returning >= 0)


def _with(world: World, index: int, lease: Lease | None) -> tuple[Lease, ...]:
    leases = list(world.leases)
    if lease is None:
        del leases[index]
    else:
        leases[index] = lease
    return tuple(leases)


def _set(values: tuple, e: int, value) -> tuple:
    out = list(values)
    out[e] = value
    return tuple(out)


def canonical(world: World) -> World:
    """Drop dead leases and sort the rest. A lease is dead when nothing can touch it any more:
    no grant held, no return and no answer in flight (its record, if still live, is then
    never read again: only a return reads it)."""
    live = tuple(
        sorted(
            (x for x in world.leases if x.held > 0 or x.returning >= 0 or x.answer_age >= 0),
            key=lambda x: (x.n, x.used, x.record, x.holder, x.current, x.held, x.deadline, x.returning, x.answer_age),
        )
    )
    return replace(world, leases=live)


def events(world: World, scope: Scope, mutant: str | None) -> list[tuple[str, int]]:
    """The enabled events of ``world`` as ``(name, engine)`` (engine -1: none)."""
    out: list[tuple[str, int]] = [("tick", -1), ("store_down" if world.store_up else "store_up", -1)]
    for e in range(ENGINES):
        req = world.request[e]
        pending = [i for i in _holder_leases(world, e) if world.leases[i].answer_age >= 0]
        old_return = any(x.returning >= 0 for x in world.leases if x.holder == e and not x.current)
        if (
            req < 0
            and not old_return
            and (mutant == "lease_leak" or _spendable(world, e) + _unconfirmed(world, e) < scope.lease)
        ):
            out.append(("request", e))
        if req >= 0 and not pending and not world.refused[e] and world.store_up:
            out.append(("answer", e))
        if req >= 0 and req <= TIMEOUT and (pending or world.refused[e]):
            out.append(("deliver", e))
        if req >= 0:
            out.append(("timeout", e))
        if _spendable(world, e) > 0:
            out.append(("spend", e))
        returning = any(x.returning >= 0 for x in world.leases if x.holder == e)
        if not returning and any(world.leases[i].held > 0 for i in _holder_leases(world, e)):  # one at a time
            out.append(("return", e))
        if returning and world.store_up:
            out.append(("apply_return", e))
        out.append(("crash", e))
    return list(dict.fromkeys(out))


def _tick(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``tick``: one tick passes; leases expire at the engine (R26: held grants past their
    deadline are lost) and at the store (a return not applied by then never applies)."""
    leases, lost = [], 0
    for x in world.leases:
        deadline = max(x.deadline - 1, 0)
        held = x.held
        if held > 0 and x.deadline > 0 and deadline == 0:  # R26: past its deadline, never spent
            lost += held
            held = -1
        record, returning = max(x.record - 1, 0), x.returning
        if returning >= 0 and record == 0:  # the record expired: this return never applies
            lost += returning
            returning = -1
        leases.append(replace(x, record=record, deadline=deadline, held=held, returning=returning))
    return replace(
        world,
        store_lead=max(world.store_lead - 1, 0),
        request=tuple(min(r + 1, TIMEOUT + 1) if r >= 0 else -1 for r in world.request),
        leases=tuple(leases),
        ledger_dispatch=max(world.ledger_dispatch - 1, 0),
        ledger_consumed=_consume(max(world.ledger_consumed - 1, 0), lost),
    )


def _store_down(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``store_down`` (R25): the store stops answering."""
    return replace(world, store_up=False)


def _store_up(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``store_up`` (R25): the store answers again."""
    return replace(world, store_up=True)


def _request(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``request(e)``: engine ``e`` sends a lease request (age 0)."""
    return replace(world, request=_set(world.request, e, 0))


def _answer(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``answer(e)``: the store makes a lease of up to L on its own clock (R23), or refuses;
    raises ``_Violation("closed")`` while the store is down (R25)."""
    if not world.store_up:
        raise _Violation("closed", "a lease was made while the store is down (R25)")
    skew = SKEW if (mutant == "clock_skew" and e == 1) else 0
    lead = world.store_lead - skew  # R23: the store's clock (the mutant: the engine's)
    eff = max(lead, 0)
    n = 0 if eff > TAU else min(scope.lease, (TAU - eff) // T + 1)
    if n == 0:
        return replace(world, refused=_set(world.refused, e, True))
    new_lead = max(eff + n * T + skew, 0) if skew else eff + n * T
    lease = Lease(n, record=TTL, holder=e, answer_age=0)
    return replace(world, store_lead=new_lead, leases=world.leases + (lease,))


def _deliver(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``deliver(e)``: the answer reaches engine ``e``, which holds the lease's grants until
    TTL after it sent the request."""
    for i in _holder_leases(world, e):
        x = world.leases[i]
        if x.answer_age >= 0:  # the engine's deadline: TTL after it sent the request
            world = replace(
                world, leases=_with(world, i, replace(x, held=x.n, deadline=TTL - world.request[e], answer_age=-1))
            )
    return replace(world, request=_set(world.request, e, -1), refused=_set(world.refused, e, False))


def _timeout(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``timeout(e)`` (R25): engine ``e`` abandons its request; grants made for it are lost."""
    lost = 0
    for i in _holder_leases(world, e):
        x = world.leases[i]
        if x.answer_age >= 0:  # R25: abandoned; the store's record lives on until it expires
            lost += x.n
            world = replace(world, leases=_with(world, i, replace(x, answer_age=-1, current=False)))
    return replace(
        world,
        request=_set(world.request, e, -1),
        refused=_set(world.refused, e, False),
        ledger_consumed=_consume(world.ledger_consumed, lost),
    )


def _spend(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``spend(e)``: one dispatch spends a held grant of the lease nearest its deadline;
    raises ``_Violation`` on ``bound`` (R24) or ``once`` (R26)."""
    i = min(
        (i for i in _holder_leases(world, e) if world.leases[i].held > 0 and world.leases[i].deadline > 0),
        key=lambda i: world.leases[i].deadline,
    )
    x = world.leases[i]
    tolerance = TAU + ENGINES * shared_budget.holding_cap(scope.lease) * T  # R24 in ledger form
    if world.ledger_dispatch > tolerance:
        raise _Violation(
            "bound",
            f"a dispatch exceeds floor((W + tau) r) + 1 + E x H (ledger lead "
            f"{world.ledger_dispatch} > {tolerance} ticks)",
        )
    if x.used + 1 > x.n:
        raise _Violation("once", f"a lease of {x.n} grants had {x.used + 1} spent or returned (R26)")
    return replace(
        world,
        leases=_with(world, i, replace(x, held=x.held - 1, used=x.used + 1)),
        ledger_dispatch=max(world.ledger_dispatch, 0) + T,
        ledger_consumed=_consume(world.ledger_consumed, 1),
    )


def _return(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``return(e)``: engine ``e`` sends back the unused grants of one lease."""
    i = next(i for i in _holder_leases(world, e) if world.leases[i].held > 0 and world.leases[i].returning < 0)
    x = world.leases[i]
    kept = x.held if mutant == "double_spend" else -1
    return replace(world, leases=_with(world, i, replace(x, returning=max(x.held, 0), held=kept)))


def _apply_return(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``apply_return(e)``: the store applies ``e``'s return if its record is live (R23);
    raises ``_Violation("once")`` (R26)."""
    i = next(i for i, x in enumerate(world.leases) if x.holder == e and x.returning >= 0)
    x = world.leases[i]
    u = min(x.returning, x.n) if x.record > 0 else 0  # R23: only a live record, once
    if x.used + u > x.n:
        raise _Violation("once", f"a lease of {x.n} grants had {x.used + u} spent or returned (R26)")
    lead = world.store_lead if mutant == "lost_return" else max(world.store_lead - u * T, 0)
    return replace(
        world,
        store_lead=lead,
        leases=_with(world, i, replace(x, returning=-1, record=0, used=x.used + u)),
        ledger_consumed=_consume(world.ledger_consumed, x.returning - u),
    )


def _crash(world: World, e: int, scope: Scope, mutant: str | None) -> World:
    """``crash(e)`` (R26): ``e``'s holdings and request are gone; a new incarnation."""
    lost = 0
    leases = []
    for x in world.leases:
        if x.holder == e and x.current:
            lost += max(x.held, 0) + (x.n if x.answer_age >= 0 else 0)
            x = replace(x, current=False, held=-1, answer_age=-1)
        leases.append(x)
    return replace(
        world,
        leases=tuple(leases),
        request=_set(world.request, e, -1),
        refused=_set(world.refused, e, False),
        ledger_consumed=_consume(world.ledger_consumed, lost),
    )


_HANDLERS = {
    "tick": _tick,
    "store_down": _store_down,
    "store_up": _store_up,
    "request": _request,
    "answer": _answer,
    "deliver": _deliver,
    "timeout": _timeout,
    "spend": _spend,
    "return": _return,
    "apply_return": _apply_return,
    "crash": _crash,
}


def step(world: World, event: tuple[str, int], scope: Scope, mutant: str | None) -> World:
    """The successor of ``world`` under ``event``; raises ``_Violation`` on a failed check."""
    name, e = event
    handler = _HANDLERS.get(name)
    if handler is None:  # pragma: no cover - events() lists every name above
        raise AssertionError(f"unknown event {name!r}")
    world = handler(world, e, scope, mutant)
    _check_state(world, scope)
    return canonical(world)


def _check_state(world: World, scope: Scope) -> None:
    H = shared_budget.holding_cap(scope.lease)
    for e in range(ENGINES):
        in_flight = (scope.lease if world.request[e] >= 0 else 0) + _unconfirmed(world, e)
        if _spendable(world, e) + in_flight > H:
            raise _Violation("cap", f"engine {e} holds {_spendable(world, e)} + {in_flight} in flight > H = {H} (R24)")
    quiet = all(r < 0 for r in world.request) and all(
        x.held <= 0 and x.returning < 0 and x.answer_age < 0 for x in world.leases
    )
    if quiet and world.store_lead > max(world.ledger_consumed, 0):
        raise _Violation(
            "conservation",
            f"nothing is held, yet the store's TAT lead {world.store_lead} exceeds the "
            f"replay of consumed grants {world.ledger_consumed} (a return was lost)",
        )


@dataclass
class Result:
    """One exploration: states, transitions, seconds, and the first violation (check name,
    message, the shortest event sequence from the initial state) or None."""

    scope: str
    mutant: str | None
    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    violation: tuple[str, str, list[str]] | None = None
    complete: bool = False


def explore(scope: Scope, mutant: str | None = None) -> Result:
    """Breadth-first search of every state of ``scope`` (under ``mutant``, if given), stopping
    at the first violation (its event sequence is the shortest, BFS)."""
    start = time.perf_counter()
    result = Result(scope.name, mutant)
    init = canonical(World())
    parent: dict[World, tuple[World | None, str]] = {init: (None, "")}
    queue = deque([init])
    while queue:
        world = queue.popleft()
        for event in events(world, scope, mutant):
            result.transitions += 1
            try:
                nxt = step(world, event, scope, mutant)
            except _Violation as exc:
                path = [f"{event[0]}({event[1]})" if event[1] >= 0 else event[0]]
                cursor: World | None = world
                while cursor is not None and parent[cursor][0] is not None:
                    path.append(parent[cursor][1])
                    cursor = parent[cursor][0]
                result.violation = (exc.check, str(exc), list(reversed(path)))
                result.states = len(parent)
                result.seconds = round(time.perf_counter() - start, 3)
                return result
            if nxt not in parent:
                parent[nxt] = (world, f"{event[0]}({event[1]})" if event[1] >= 0 else event[0])
                if len(parent) > scope.max_states:
                    raise AssertionError(f"scope {scope.name} exceeds {scope.max_states} states")
                queue.append(nxt)
    result.states = len(parent)
    result.complete = True
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def run_mutants(scopes: tuple[Scope, ...] = SCOPES) -> dict[str, Result]:
    """Each mutant against the scopes, in order, until one catches it: name -> the result
    that caught it (or the last one explored, with no violation: the mutant survived)."""
    out: dict[str, Result] = {}
    for mutant in MUTANTS:
        for scope in scopes:
            result = explore(scope, mutant.name)
            out[mutant.name] = result
            if result.violation is not None:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    ok = True
    for scope in SCOPES:
        r = explore(scope)
        ok = ok and r.violation is None and r.complete
        print(
            f"{scope.name:24} states {r.states:8} transitions {r.transitions:9} {r.seconds:7.2f} s "
            f"{'ok' if r.violation is None else r.violation}"
        )
    for name, r in run_mutants().items():
        caught = r.violation is not None
        ok = ok and caught
        detail = (
            f"caught by {r.violation[0]} in {len(r.violation[2])} events: {' '.join(r.violation[2])}"
            if r.violation
            else "SURVIVED"
        )
        print(f"mutant {name:14} {r.scope:24} {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
