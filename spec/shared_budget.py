"""One user budget shared by E engines through a store: the lease protocol, rules R23-R26.

Each engine keeps the single-engine rules (R1-R20) for its own dispatches and, on top of
them, spends one *grant* per sampling dispatch from grants it *leased* ahead of need from
a shared GCRA kept in a store (Redis or Valkey in ``reference/shared_budget.py``). The
store holds, per user, one TAT (ns, on the store's own clock) and the live lease records.

* R23 lease: one atomic operation at the store: ``n = min(L, grants at now)`` grants
  (R2's closed form at the store), ``TAT := max(TAT, now) + n x T``, and a lease record
  ``(lease id, engine, n)`` that lives ``lease_ttl_ns`` on the store's clock. A return of
  ``u`` unused grants of a live lease: ``TAT := max(TAT - u x T, now)`` and the record is
  deleted in the same atomic step, so a lease is returned at most once; a return of an
  unknown (expired, already returned) lease changes nothing. ``now`` is always the
  store's clock, never the engine's (clock skew between engines cannot move the TAT).
* R24 bound: an engine asks for a lease only while it holds fewer than L grants, counting
  the grants of its returns the store has not confirmed (a late return still moves the
  TAT back), and has no lease request in flight, so held plus in flight (lease and
  returns) never exceed ``H = 2L - 1``.
  In any closed window of W ns, all engines together dispatch at most
  ``floor((W + tau) x rate) + 1 + E x H`` (``shared_window_bound_tokens``): the store's
  net grants in the window obey R2's bound and each engine can in addition spend what it
  held when the window opened.
* R25 store slow or down: fail closed. No new lease is taken (a request that times out is
  abandoned; its grants, if the store made them, are never spent), an engine spends only
  the grants it holds, until their lease expires, under the single-engine rules; then the
  user's requests are throttled (R11: paused, resident, never failed). R24's bound holds
  whatever the store does, since it counts only grants the store made. When the store
  answers again, the next refill (at most one refill period later) takes a lease and the
  user is back to its full rate. A *static share* ``rate / E`` per engine while the store
  is unreachable is not taken: an engine cannot tell an outage from a partition, and
  while the others still lease at the full rate the sum would exceed the bound
  (docs/SPEC.md, "Multi-engine shared budget").
* R26 engine crash: a crash deletes the engine's holdings; the restarted engine is a new
  incarnation (new engine id) that holds nothing and can neither spend nor return the old
  leases, and the store never hands a lease's grants out again (no reclaim on expiry). So
  no grant is spent twice. A return the crashed engine had sent may still reach the store;
  the new incarnation takes no lease during its first ``STARTUP_HOLD_NS`` (one ttl), after
  which every record of its predecessor has expired and such a late return is a no-op. At most ``H`` grants are lost with the crash: they delay the
  user's later leases by at most ``H x T`` ns (``crash_delay_bound_ns``), and the store
  forgets their records at the lease expiry.

Work conservation: a user active on one engine only, which asks at least every
``refill_ns <= min(L x T, tau)`` while it holds fewer than L grants, is granted by the
store at the full rate: the store's TAT is never behind ``now`` at a request, so over a
busy period of W ns the engine is granted at least ``floor((W - refill_ns) / T)`` grants,
a shortfall of at most ``refill_ns / W`` of the rate (``work_conservation_floor``).

All functions are pure: the store state is a frozen value, clocks are arguments. Times are
ns (exact ``Fraction``), rates tokens/s, counts tokens. This module imports nothing from
outside ``spec/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType

from vllm_output_rate.spec.limiter import BURST_NS, NS_PER_S, emission_interval_ns

# R24: lease size L covers this much of the user's rate (at least one grant).
LEASE_COVER_NS: int = 50_000_000
# R23/R26: a lease record lives this long on the store's clock; an engine spends a lease's
# grants only until this long after it *sent* the request (its own monotonic clock, so
# that it never outlives the store's record whatever the clocks' offsets).
LEASE_TTL_NS: int = 500_000_000
# R26: a new engine incarnation takes no lease for this long after it starts (its
# predecessor's records have then expired, so their late returns change nothing).
STARTUP_HOLD_NS: int = LEASE_TTL_NS
# Work conservation: the refill thread looks at every user at least this often.
REFILL_PERIOD_NS: int = 10_000_000
# R25: a lease or return round trip that takes longer is abandoned (fail closed).
STORE_TIMEOUT_NS: int = 50_000_000


def lease_size(rate_tokens_per_s: Fraction, cover_ns: int = LEASE_COVER_NS) -> int:
    """R24: the lease size L of a user: grants covering ``cover_ns`` of its rate, >= 1.

    Raises:
        AssertionError: a non-positive rate or cover.
    """
    assert rate_tokens_per_s > 0 and cover_ns > 0, f"bad rate {rate_tokens_per_s!r} or cover {cover_ns!r}"
    return max(1, math.ceil(Fraction(cover_ns, NS_PER_S) * Fraction(rate_tokens_per_s)))


def holding_cap(lease: int) -> int:
    """R24: the most grants one engine holds or has in flight: ``H = 2L - 1``.

    An engine asks only while it holds, with its unconfirmed returns, fewer than L (at most
    L - 1) and has no request in flight, and a lease brings at most L.
    """
    assert lease >= 1, f"lease size must be >= 1, got {lease}"
    return 2 * lease - 1


def shared_window_bound_tokens(
    window_ns: int, rate_tokens_per_s: Fraction, engines: int, lease: int, burst_ns: int = BURST_NS
) -> int:
    """R24: all engines together dispatch at most this many tokens in any closed window.

    ``floor((W + tau) x rate) + 1 + E x (2L - 1)``: R2's single-engine bound plus what the
    E engines held when the window opened.

    Raises:
        AssertionError: a negative window, fewer than one engine, or a lease < 1.
    """
    assert window_ns >= 0 and engines >= 1, f"bad window {window_ns} or engines {engines}"
    single = math.floor(Fraction(window_ns + burst_ns, NS_PER_S) * Fraction(rate_tokens_per_s)) + 1
    return single + engines * holding_cap(lease)


def shared_ledger_burst_ns(rate_tokens_per_s: Fraction, engines: int, lease: int, burst_ns: int = BURST_NS) -> Fraction:
    """R24 in ledger form: the bound ``floor((W + tau) r) + 1 + E H`` for every W is the
    single-engine bound with the burst tolerance ``tau + E x H x T``; a dispatch sequence
    meets it iff a GCRA with that tolerance would grant every dispatch."""
    return burst_ns + engines * holding_cap(lease) * emission_interval_ns(rate_tokens_per_s)


def crash_delay_bound_ns(rate_tokens_per_s: Fraction, lease: int) -> Fraction:
    """R26: the grants lost with a crashed engine delay the user's later leases by at most
    ``H x T`` ns (``(2L - 1) / rate`` seconds)."""
    return holding_cap(lease) * emission_interval_ns(rate_tokens_per_s)


def work_conservation_floor(window_ns: int, rate_tokens_per_s: Fraction, refill_ns: int = REFILL_PERIOD_NS) -> int:
    """Work conservation: grants the store makes at least, over a busy period of
    ``window_ns`` from the first request, to a user active on one engine only that asks
    every ``refill_ns <= min(L T, tau)``: ``floor((W - refill) / T)`` (0 for short W)."""
    if window_ns <= refill_ns:
        return 0
    return math.floor((window_ns - refill_ns) / emission_interval_ns(rate_tokens_per_s))


@dataclass(frozen=True)
class Lease:
    """R23: one live lease record at the store: its id, the engine (incarnation) that
    holds it, its grant count ``n`` and its expiry (store clock, ns)."""

    lease_id: int
    engine: str
    grants: int
    expires_ns: Fraction


@dataclass(frozen=True)
class StoreState:
    """R23: one user's shared GCRA at the store: TAT (ns, store clock, exact; None: idle)
    and the live lease records by id; ``next_id`` numbers the next lease."""

    tat_ns: Fraction | None = None
    leases: Mapping[int, Lease] = field(default_factory=lambda: MappingProxyType({}))
    next_id: int = 1


def store_grants_at(
    store: StoreState, now_ns: int | Fraction, rate_tokens_per_s: Fraction, burst_ns: int = BURST_NS
) -> int:
    """R23 (R2 at the store): how many grants the store could make at ``now_ns``:
    ``floor((tau - lead) / T) + 1`` with ``lead = max(TAT, now) - now``, 0 when the lead
    exceeds tau."""
    lead = 0 if store.tat_ns is None else max(store.tat_ns - now_ns, Fraction(0))
    if lead > burst_ns:
        return 0
    return math.floor((burst_ns - lead) / emission_interval_ns(rate_tokens_per_s)) + 1


def expire(store: StoreState, now_ns: int | Fraction) -> StoreState:
    """R26: drop every lease record whose expiry is ``<= now``; the TAT is untouched (the
    store never hands an expired lease's grants out again)."""
    kept = {i: lease for i, lease in store.leases.items() if lease.expires_ns > now_ns}
    return replace(store, leases=MappingProxyType(kept))


def lease(
    store: StoreState,
    engine: str,
    want: int,
    now_ns: int | Fraction,
    rate_tokens_per_s: Fraction,
    burst_ns: int = BURST_NS,
    ttl_ns: int = LEASE_TTL_NS,
) -> tuple[StoreState, Lease | None]:
    """R23: one atomic lease at the store's ``now_ns``: ``n = min(want, grants_at)``
    grants, ``TAT := max(TAT, now) + n x T``, a record that expires at ``now + ttl``.

    Returns ``(new store, the lease)``, or ``(store after expiry, None)`` when no grant is
    possible now (the TAT is then unchanged).

    Raises:
        AssertionError: ``want`` < 1 or an empty engine id.
    """
    assert want >= 1, f"a lease asks for at least one grant, got {want}"
    assert engine, "a lease names its engine"
    store = expire(store, now_ns)
    n = min(want, store_grants_at(store, now_ns, rate_tokens_per_s, burst_ns))
    if n == 0:
        return store, None
    base = Fraction(now_ns) if store.tat_ns is None else max(store.tat_ns, Fraction(now_ns))
    new = Lease(store.next_id, engine, n, Fraction(now_ns) + ttl_ns)
    leases = dict(store.leases)
    leases[new.lease_id] = new
    tat = base + n * emission_interval_ns(rate_tokens_per_s)
    return StoreState(tat, MappingProxyType(leases), store.next_id + 1), new


def return_unused(
    store: StoreState, lease_id: int, engine: str, unused: int, now_ns: int | Fraction, rate_tokens_per_s: Fraction
) -> tuple[StoreState, int]:
    """R23: give back ``unused`` grants of a live lease, atomically:
    ``TAT := max(TAT - u x T, now)`` with ``u = min(unused, n)``, and delete the record.

    A lease that is not live (expired, already returned) or held by another engine is not
    touched; the answer is then 0. Returns ``(new store, grants given back)``.

    Raises:
        AssertionError: a negative count.
    """
    assert unused >= 0, f"unused grants must be >= 0, got {unused}"
    store = expire(store, now_ns)
    record = store.leases.get(lease_id)
    if record is None or record.engine != engine:
        return store, 0
    u = min(unused, record.grants)
    leases = {i: x for i, x in store.leases.items() if i != lease_id}
    tat = store.tat_ns
    if tat is not None and u > 0:
        tat = max(tat - u * emission_interval_ns(rate_tokens_per_s), Fraction(now_ns))
    return StoreState(tat, MappingProxyType(leases), store.next_id), u


@dataclass(frozen=True)
class Holding:
    """R24/R26: what one engine holds of one user's budget: per lease id the grants not
    yet spent and the spend deadline (engine clock, ns: send time + ttl), whether a lease
    request is in flight, and the grants of returns the store has not confirmed (they
    count as held until confirmed or until their record surely expired)."""

    grants: Mapping[int, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))
    in_flight: bool = False
    returning: int = 0

    def spendable(self, engine_now_ns: int) -> int:
        """Grants of unexpired leases (R26: an expired lease's grants are never spent)."""
        return sum(n for n, deadline in self.grants.values() if deadline > engine_now_ns)


def wants_lease(holding: Holding, engine_now_ns: int, lease_grants: int) -> bool:
    """R24: the engine asks for a lease iff it holds fewer than L spendable grants, its
    unconfirmed returns counted, and has no request in flight, so held + in flight never
    exceed ``H = 2L - 1``."""
    return not holding.in_flight and holding.spendable(engine_now_ns) + holding.returning < lease_grants


def spend(holding: Holding, engine_now_ns: int) -> tuple[Holding, int | None]:
    """R24: spend one grant for one sampling dispatch (after the single-engine rules
    granted it), from the unexpired lease that expires first. Returns ``(holding, lease
    id)``, or ``(holding, None)`` when nothing is spendable (the request is throttled)."""
    live = [(deadline, i) for i, (n, deadline) in holding.grants.items() if n > 0 and deadline > engine_now_ns]
    if not live:
        return holding, None
    _, lease_id = min(live)
    grants = dict(holding.grants)
    n, deadline = grants[lease_id]
    grants[lease_id] = (n - 1, deadline)
    return replace(holding, grants=MappingProxyType(grants)), lease_id


def crash() -> Holding:
    """R26: what a crashed engine's restarted incarnation holds: nothing (and it takes no
    lease during its first ``STARTUP_HOLD_NS``)."""
    return Holding()
