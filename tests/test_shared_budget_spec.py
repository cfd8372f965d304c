"""The multi-engine shared budget protocol of spec/shared_budget.py (R23-R26), executed.

A seeded random simulation drives E engines against one store with the spec's functions
(lease, return, spend, crash, outages, expiry) and judges every run by the rules: the
cross-engine window bound over every window (R24, in ledger form), no grant spent twice
(R26), nothing leased while the store is down (R25).
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from vllm_output_rate.spec import limiter
from vllm_output_rate.spec import shared_budget as sb

pytestmark = pytest.mark.check

MS = 1_000_000


def test_r23_lease_advances_tat_by_n_times_t_and_returns_move_it_back() -> None:
    rate = Fraction(20)  # T = 50 ms; tau = 100 ms: 3 grants from idle
    store, first = sb.lease(sb.StoreState(), "e1", 2, 0, rate)
    assert first is not None and first.grants == 2 and store.tat_ns == 100 * MS
    store, second = sb.lease(store, "e2", 5, 0, rate)
    assert second is not None and second.grants == 1 and store.tat_ns == 150 * MS
    store, none = sb.lease(store, "e2", 1, 0, rate)
    assert none is None and store.tat_ns == 150 * MS
    store, back = sb.return_unused(store, first.lease_id, "e1", 2, 10 * MS, rate)
    assert back == 2 and store.tat_ns == 50 * MS
    store, again = sb.return_unused(store, first.lease_id, "e1", 2, 10 * MS, rate)
    assert again == 0 and store.tat_ns == 50 * MS  # a return applies at most once
    store, wrong = sb.return_unused(store, second.lease_id, "e1", 1, 10 * MS, rate)
    assert wrong == 0 and second.lease_id in store.leases  # only the holder returns
    store, back = sb.return_unused(store, second.lease_id, "e2", 1, 40 * MS, rate)
    assert back == 1 and store.tat_ns == 40 * MS  # never below now


def test_r23_grants_at_is_r2_at_the_store() -> None:
    rate = Fraction(7, 3)
    state, store = limiter.EMPTY, sb.StoreState()
    for now in (0, 0, 0, 10 * MS, 500 * MS, 500 * MS, 2_000 * MS):
        expected = 0
        probe = state
        while True:
            probe, ok = limiter.try_take(probe, "u", rate, now)
            if not ok:
                break
            expected += 1
        assert sb.store_grants_at(store, now, rate) == expected
        state, _ = limiter.try_take(state, "u", rate, now)
        store, _ = sb.lease(store, "e", 1, now, rate)
        assert store.tat_ns == state.tat_ns["u"]


def test_r24_bound_formulas() -> None:
    assert sb.lease_size(Fraction(20)) == 1 and sb.lease_size(Fraction(1000)) == 50
    assert sb.holding_cap(1) == 1 and sb.holding_cap(50) == 99
    assert (
        sb.shared_window_bound_tokens(1_000 * MS, Fraction(20), 2, 1)
        == limiter.window_bound_tokens(1_000 * MS, Fraction(20)) + 2
    )
    assert sb.shared_ledger_burst_ns(Fraction(20), 2, 3) == limiter.BURST_NS + 2 * 5 * 50 * MS
    assert sb.work_conservation_floor(1_010 * MS, Fraction(100)) == 100
    with pytest.raises(AssertionError):
        sb.lease_size(Fraction(0))


class _Run:
    """The state of one random run of ``_simulate``: the store, each engine's holding and
    local limiter state, and what was dispatched, spent and leased."""

    def __init__(self, engines: int, rate: Fraction) -> None:
        self.rate, self.L = rate, sb.lease_size(rate)
        self.store = sb.StoreState()
        self.holding = {e: sb.Holding() for e in range(engines)}
        self.incarnation = dict.fromkeys(range(engines), 0)
        self.local = dict.fromkeys(range(engines), limiter.EMPTY)
        self.in_flight: dict[int, int] = {}  # engine -> time the request was sent
        self.down = False
        self.dispatches: list[int] = []
        self.spent: dict[int, int] = {}
        self.leased: dict[int, int] = {}

    def crash(self, e: int) -> None:
        """R26: a crash; the new incarnation holds nothing."""
        self.holding[e], self.incarnation[e], self.local[e] = sb.crash(), self.incarnation[e] + 1, limiter.EMPTY
        self.in_flight.pop(e, None)

    def answer(self, e: int, name: str, now: int) -> None:
        """The store answers engine ``e``'s lease request (or the request times out)."""
        h, sent = self.holding[e], self.in_flight.pop(e)
        granted = None
        if not self.down:
            self.store, granted = sb.lease(self.store, name, self.L, now, self.rate)
        grants = dict(h.grants)
        if granted is not None and now - sent <= sb.STORE_TIMEOUT_NS:
            grants[granted.lease_id] = (granted.grants, sent + sb.LEASE_TTL_NS)
            self.leased[granted.lease_id] = granted.grants
        self.holding[e] = sb.Holding(grants, in_flight=False)

    def give_back(self, e: int, name: str, now: int, lease_id: int) -> None:
        """Engine ``e`` returns one lease's remainder."""
        h = self.holding[e]
        unused = h.grants[lease_id][0]
        self.holding[e] = sb.Holding({i: g for i, g in h.grants.items() if i != lease_id}, h.in_flight)
        if not self.down:
            self.store, _ = sb.return_unused(self.store, lease_id, name, unused, now, self.rate)

    def dispatch(self, e: int, now: int) -> None:
        """A sampling dispatch on engine ``e``: the single-engine rules, then a grant."""
        state, ok = limiter.try_take(self.local[e], "u", self.rate, now)
        if ok:
            after, lease_id = sb.spend(self.holding[e], now)
            if lease_id is not None:
                self.local[e], self.holding[e] = state, after
                self.dispatches.append(now)
                self.spent[lease_id] = self.spent.get(lease_id, 0) + 1

    def check_holding_cap(self, now: int) -> None:
        """R24: held + in flight never exceed H = 2L - 1, on every engine."""
        for held in self.holding.values():
            in_hand = held.spendable(now) + held.returning + (self.L if held.in_flight else 0)
            assert in_hand <= sb.holding_cap(self.L), f"an engine holds {in_hand} > H = {sb.holding_cap(self.L)}"


def _simulate(seed: int, engines: int = 2, steps: int = 600, rate: Fraction = Fraction(40)):
    """One random run: returns (dispatch times, spends per lease id, grants per lease id, L).

    While the store is down a request is answered by nothing (R25: no lease is taken)."""
    rng = random.Random(seed)
    run = _Run(engines, rate)
    now = 0
    for _ in range(steps):
        now += rng.choice((0, 1 * MS, 5 * MS, 20 * MS))
        e = rng.randrange(engines)
        name = f"e{e}.{run.incarnation[e]}"
        h = run.holding[e]
        event = rng.random()
        if event < 0.05:
            run.down = not run.down
        elif event < 0.08:
            run.crash(e)
        elif event < 0.3 and sb.wants_lease(h, now, run.L):
            run.in_flight[e] = now
            run.holding[e] = sb.Holding(h.grants, in_flight=True)
        elif event < 0.5 and e in run.in_flight:
            run.answer(e, name, now)
        elif event < 0.6 and h.grants:
            run.give_back(e, name, now, rng.choice(sorted(h.grants)))
        else:
            run.dispatch(e, now)
        run.check_holding_cap(now)
    return run.dispatches, run.spent, run.leased, run.L


@pytest.mark.rules("R24", "R25", "R26")
@pytest.mark.parametrize("seed", range(12))
def test_r24_random_runs_meet_the_cross_engine_bound(seed: int) -> None:
    rate = Fraction(40)
    dispatches, spent, leased, L = _simulate(seed, rate=rate)
    assert dispatches, "the run dispatched nothing: the scenario would judge nothing"
    # Ledger form: a GCRA with tau + E H T grants every dispatch iff every window meets the bound.
    tolerance = sb.shared_ledger_burst_ns(rate, 2, L)
    ledger = Fraction(0)
    for t in dispatches:
        assert ledger - t <= tolerance, f"dispatch at {t} ns exceeds the R24 bound (seed {seed})"
        ledger = max(ledger, Fraction(t)) + limiter.emission_interval_ns(rate)
    # R26: no lease spent beyond its grants (no grant spent twice).
    assert all(spent[i] <= leased[i] for i in spent)


@pytest.mark.rules("R24")
def test_r24_window_bound_checked_directly_on_every_window() -> None:
    rate = Fraction(40)
    dispatches, _, _, L = _simulate(3, rate=rate)
    for i, start in enumerate(dispatches):
        for end in dispatches[i:]:
            count = sum(1 for t in dispatches if start <= t <= end)
            assert count <= sb.shared_window_bound_tokens(end - start, rate, 2, L)


@pytest.mark.rules("R25")
def test_r25_no_lease_while_down_and_holdings_run_out() -> None:
    rate = Fraction(100)
    L = sb.lease_size(rate)
    store, granted = sb.lease(sb.StoreState(), "e0", L, 0, rate)
    holding = sb.Holding({granted.lease_id: (granted.grants, sb.LEASE_TTL_NS)})
    spent = 0
    while True:  # the store is down: the engine spends what it holds, then is throttled
        holding, lease_id = sb.spend(holding, 0)
        if lease_id is None:
            break
        spent += 1
    assert spent == granted.grants <= sb.holding_cap(L)
    assert sb.wants_lease(holding, 0, L)  # it keeps asking; recovery: the store answers later
    store, again = sb.lease(store, "e0", L, sb.lease_size(rate) * limiter.emission_interval_ns(rate), rate)
    assert again is not None and again.grants >= 1


@pytest.mark.rules("R26")
def test_r26_crashed_incarnation_cannot_spend_or_return_old_leases() -> None:
    rate = Fraction(10)
    store, granted = sb.lease(sb.StoreState(), "e0.0", 2, 0, rate)
    tat = store.tat_ns
    restarted = sb.crash()
    assert restarted.spendable(0) == 0 and sb.spend(restarted, 0)[1] is None
    store, back = sb.return_unused(store, granted.lease_id, "e0.1", 2, 0, rate)
    assert back == 0 and store.tat_ns == tat  # the new incarnation cannot return the old lease
    store = sb.expire(store, sb.LEASE_TTL_NS)
    assert granted.lease_id not in store.leases and store.tat_ns == tat  # never handed out again
    held = sb.Holding({granted.lease_id: (2, sb.LEASE_TTL_NS)})
    assert held.spendable(sb.LEASE_TTL_NS) == 0  # past its deadline a lease is not spent
    assert sb.crash_delay_bound_ns(rate, 2) == 3 * limiter.emission_interval_ns(rate)
