"""Z3 proofs of the multi-engine shared budget, rules R23-R26 (``spec/shared_budget.py``).

As in ``proofs/z3_limiter.py``, every property is proved for *unbounded* integers and
reals by an inductive invariant checked one transition at a time (never by unrolling), and
every obligation is checked for vacuity (its hypotheses alone are satisfiable).

What is modelled: one user (the store's operations read and write only the entry of the
user they name, so users are independent), E engines with aggregate holdings ``P`` (grants
held or in flight over all engines), the store's TAT on the store's clock ``c`` (ns,
reals), emission interval ``T > 0`` ns, burst tolerance ``tau >= 0`` ns, lease size
``L >= 1``. The transitions are the protocol's: a lease of ``n = min(L, grants at c)``
grants (R23), a return of ``u`` held grants (``TAT := max(TAT - uT, c)``), a spend of one
held grant (a dispatch), a loss of held grants (a crash, an expired lease, an abandoned
request: R25, R26), and the clock advancing. Store outages are the absence of lease and
return transitions, so every invariant below holds whatever the store's availability.

Properties (``PROPERTIES``; ``run_all()`` for the records, ``python -m
vllm_output_rate.proofs.z3_shared_budget`` for the table):

* ``r24_shared_window_bound``: in any closed window of W ns all engines together dispatch
  at most ``(W + tau) / T + 1 + E x H`` with ``H = 2L - 1`` (and each engine holds at most
  H, from the request rule).
* ``r24_work_conservation``: a user active on one engine only, which asks at intervals of
  at most ``delta <= min(L T, tau)``, is granted at least ``(x - t0) / T`` grants by any
  time x after its first request t0: the store never idles.
* ``r25_fail_closed``: with the store unreachable for a whole window, the engines dispatch
  at most what they held when it opened (``E x H``, below the bound); when it answers
  again, a request ``L x T`` or more after the last lease is granted (recovery).
* ``r26_no_double_spend``: every grant of a lease is spent, returned or lost at most once
  and in total at most the lease's n; a return applies at most once; a crashed engine's
  grants are never spent; the grants lost delay the user's later leases by at most n T.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import z3

from vllm_output_rate.proofs.z3_obligations import Checked, Obligation, z3_proof_record
from vllm_output_rate.proofs.z3_semantics import NS_PER_S


def _zmax(a, b):
    return z3.If(a >= b, a, b)


def _eff(tat, c):
    """R1/R6 at the store: the effective TAT ``max(TAT, now)``."""
    return _zmax(tat, c)


def _lease_count(n, want, tat, c, T, tau):
    """R23: ``n = min(want, grants_at(c))`` exactly, with ``grants_at = floor((tau - lead) / T) + 1``
    (0 when the lead exceeds tau), ``lead = max(TAT, c) - c``, without a division."""
    lead = _eff(tat, c) - c
    return z3.And(
        n >= 0, n <= want, z3.Implies(n >= 1, lead + (n - 1) * T <= tau), z3.Or(n == want, lead + n * T > tau)
    )


def _return_tat(tat, u, c, T):
    """R23: a return of ``u`` grants: ``TAT := max(TAT - u T, now)``."""
    return _zmax(tat - u * T, c)


# --------------------------------------------------------------------------------------
# R24: the cross-engine window bound
# --------------------------------------------------------------------------------------


def _bound_inv(tat, c, s, k, D, P, P0, cap, T, tau):
    """Inductive invariant of the window bound, window opened at ``s`` (``c >= s``).

    ``k``: the store's net grants (leases minus returns) at times in ``[s, c]``; ``D``:
    dispatches in ``[s, c]``; ``P``: grants the engines hold or have in flight now; ``P0``:
    what they held when the window opened; ``cap = E x H``.
    """
    return z3.And(
        c >= s,
        P >= 0,
        cap >= P,
        P0 >= 0,
        cap >= P0,
        D >= 0,
        P0 + k >= D + P,  # every grant spent in the window was held at s or leased in it
        z3.Implies(k > 0, _eff(tat, c) >= s + k * T),
        z3.Implies(k > 0, (k - 1) * T <= c - s + tau),
    )


def _bound_obligations() -> list[Obligation]:
    """R24 window bound, all times ns (reals): invariant ``_bound_inv`` holds when the window
    opens (k = D = 0, P = P0, any TAT) and is preserved by a lease (R23, counted in k), a
    return (k decreases), a spend (D increases), a loss of held grants and the clock
    advancing. Closing: in every state with ``c <= s + W``, ``D <= (W + tau) / T + 1 + cap``.
    ``P`` counts, besides held grants and leases in flight, the grants of returns the store
    may still apply (a late return moves the TAT back: it is a return at the time it is
    applied, and a loss if its record expires first). The per-engine cap: an engine asks
    only while it holds ``h <= L - 1``, unconfirmed returns included, with nothing in
    flight, so ``h + n <= 2L - 1 = H`` after a lease of ``n <= L``."""
    tat, c, c2, s, W, T, tau = z3.Reals("tat c c2 s W T tau")
    k, D, P, P0, cap, n, u, x, want = z3.Ints("k D P P0 cap n u x want")
    h, L = z3.Ints("h L")
    params = [T > 0, tau >= 0, cap >= 0]
    inv = _bound_inv(tat, c, s, k, D, P, P0, cap, T, tau)
    hyp = tuple(params + [inv])
    leased = _return_tat(tat, 0, c, T)  # max(TAT, c)
    return [
        Obligation("open", tuple(params + [P >= 0, cap >= P]), _bound_inv(tat, s, s, 0, 0, P, P, cap, T, tau)),
        Obligation(
            "lease",
            hyp + (want >= 1, _lease_count(n, want, tat, c, T, tau), P + n <= cap),
            _bound_inv(leased + n * T, c, s, k + n, D, P + n, P0, cap, T, tau),
        ),
        Obligation(
            "return",
            hyp + (u >= 0, u <= P),
            _bound_inv(_return_tat(tat, u, c, T), c, s, k - u, D, P - u, P0, cap, T, tau),
        ),
        Obligation("spend", hyp + (P >= 1,), _bound_inv(tat, c, s, k, D + 1, P - 1, P0, cap, T, tau)),
        Obligation("lose", hyp + (x >= 0, x <= P), _bound_inv(tat, c, s, k, D, P - x, P0, cap, T, tau)),
        Obligation("advance", hyp + (c2 >= c,), _bound_inv(tat, c2, s, k, D, P, P0, cap, T, tau)),
        Obligation("per_engine_cap", (L >= 1, h >= 0, h <= L - 1, n >= 0, n <= L), h + n <= 2 * L - 1),
        Obligation("close", hyp + (W >= 0, c <= s + W), (W + tau) / T + 1 + cap >= D),
    ]


# --------------------------------------------------------------------------------------
# R24: work conservation
# --------------------------------------------------------------------------------------


def _wc_obligations() -> list[Obligation]:
    """Work conservation: one engine asks for L grants at times ``c_1 < c_2 < ...`` with
    gaps of at most ``delta``, ``0 < delta <= min(L T, tau)``; the user is idle at the store
    before the first request ``t0`` (``TAT <= t0``). Invariant after each request at c:
    ``TAT >= c + delta`` and ``G T = TAT - t0`` (G: grants so far). Closing: at every time
    x in ``[c, c + delta]`` (until the next request), ``G >= (x - t0) / T``."""
    tat, tat0, c, c2, t0, x, T, tau, delta = z3.Reals("tat tat0 c c2 t0 x T tau delta")
    G, n, n0, L = z3.Ints("G n n0 L")
    params = [T > 0, tau >= 0, L >= 1, delta > 0, delta <= L * T, delta <= tau]
    inv = z3.And(tat >= c + delta, tat - t0 == G * T, c >= t0)
    return [
        Obligation(
            "first_request",
            tuple(params + [tat0 <= t0, _lease_count(n0, L, tat0, t0, T, tau)]),
            z3.And(_eff(tat0, t0) + n0 * T >= t0 + delta, n0 * T == _eff(tat0, t0) + n0 * T - t0),
        ),
        Obligation(
            "next_request",
            tuple(params + [inv, c2 > c, c2 <= c + delta, _lease_count(n, L, tat, c2, T, tau)]),
            z3.And(_eff(tat, c2) + n * T >= c2 + delta, (G + n) * T == _eff(tat, c2) + n * T - t0),
        ),
        Obligation("close", tuple(params + [inv, x >= c, x <= c + delta]), (x - t0) / T <= G),
    ]


# --------------------------------------------------------------------------------------
# R25: the store slow or down
# --------------------------------------------------------------------------------------


def _fail_closed_obligations() -> list[Obligation]:
    """R25: while the store is unreachable no lease or return takes effect. Invariant over
    a window opened at s with the store down throughout: ``D + P <= P0`` and the TAT is
    unchanged; preserved by spends, losses (abandoned requests, expired leases, crashes)
    and the clock. Closing: ``D <= P0 <= E H``, at most the R24 bound for every W >= 0.
    Recovery: the lead ``max(TAT, now) - now`` stays at most ``tau + L T`` (a lease of
    n >= 1 is made only from a lead <= tau - (n - 1) T; time only shrinks it); a request at
    ``c >= t + L T`` (the TAT untouched meanwhile) is granted at least one grant."""
    tat, tat1, c, c2, s, W, T, tau, t = z3.Reals("tat tat1 c c2 s W T tau t")
    D, P, P0, cap, x, n, L = z3.Ints("D P P0 cap x n L")
    params = [T > 0, tau >= 0, cap >= 0]
    inv = z3.And(c >= s, D >= 0, P >= 0, cap >= P0, D + P <= P0, tat == tat1)
    hyp = tuple(params + [inv])
    return [
        Obligation("down_spend", hyp + (P >= 1,), z3.And(c >= s, D + 1 + P - 1 <= P0, tat == tat1)),
        Obligation("down_lose", hyp + (x >= 0, x <= P), z3.And(D + P - x <= P0, P - x >= 0)),
        Obligation("down_advance", hyp + (c2 >= c,), z3.And(c2 >= s, D + P <= P0, tat == tat1)),
        Obligation("down_close", hyp + (W >= 0, c <= s + W), (W + tau) / T + 1 + cap >= D),
        Obligation(
            "lead_after_lease",
            (T > 0, tau >= 0, L >= 1, _eff(tat1, t) - t <= tau + L * T, _lease_count(n, L, tat1, t, T, tau)),
            _eff(tat1, t) + n * T - t <= tau + L * T,
        ),
        Obligation(
            "recovery",
            (T > 0, tau >= 0, L >= 1, tat - t <= tau + L * T, c >= t + L * T, _lease_count(n, L, tat, c, T, tau)),
            n >= 1,
        ),
    ]


# --------------------------------------------------------------------------------------
# R26: engine crash
# --------------------------------------------------------------------------------------


def _lease_life(rem, spent, returned, lost, live, holder, N):
    """One lease's ledger: held remainder, spent, returned, lost; record live; holder up."""
    return z3.And(
        N >= 1,
        rem >= 0,
        spent >= 0,
        returned >= 0,
        lost >= 0,
        rem + spent + returned + lost == N,
        z3.Implies(returned > 0, z3.Not(live)),  # a return deletes the record
        z3.Implies(z3.Not(holder), rem == 0),
    )  # a crashed incarnation holds nothing


def _crash_obligations() -> list[Obligation]:
    """R26 over one lease of N grants (leases are independent): ledger ``_lease_life``
    holds at the lease (all N held, record live, holder up) and is preserved by a spend
    (holder up, a grant held), a return of ``u <= rem`` (only while the record is live: it
    is deleted in the same step), a return of a record no longer live (no effect), a crash
    (the holder's remainder is lost; its successor is another incarnation), the record's
    expiry and the holder's deadline (remainder lost). Closing: ``spent + returned <= N``
    (no grant is spent twice or both spent and returned). Delay: the lost grants leave
    the TAT at most ``N T`` ahead of a return at the crash; as ``max(., c) + m T`` never
    widens a gap, any lease allowed without the loss at c is allowed by ``c + N T``."""
    rem, spent, returned, lost, N, u = z3.Ints("rem spent returned lost N u")
    live, holder = z3.Bools("live holder")
    tat_a, tat_b, c, T, tau, m = z3.Reals("tat_a tat_b c T tau m")
    inv = _lease_life(rem, spent, returned, lost, live, holder, N)
    return [
        Obligation("lease", (N >= 1,), _lease_life(N, 0, 0, 0, True, True, N)),
        Obligation("spend", (inv, holder, rem >= 1), _lease_life(rem - 1, spent + 1, returned, lost, live, holder, N)),
        Obligation(
            "return_live",
            (inv, holder, live, u >= 0, u <= rem),
            _lease_life(rem - u, spent, returned + u, lost, False, holder, N),
        ),
        Obligation("return_not_live", (inv, z3.Not(live)), _lease_life(rem, spent, returned, lost, live, holder, N)),
        Obligation("crash", (inv,), _lease_life(0, spent, returned, lost + rem, live, False, N)),
        Obligation("expire", (inv,), _lease_life(rem, spent, returned, lost, False, holder, N)),
        Obligation("deadline", (inv,), _lease_life(0, spent, returned, lost + rem, live, holder, N)),
        Obligation("close", (inv,), spent + returned <= N),
        Obligation(
            "delay_nonexpansive",
            (T > 0, m >= 0, tat_a >= tat_b, tat_a - tat_b <= N * T, N >= 1),
            _eff(tat_a, c) + m * T - (_eff(tat_b, c) + m * T) <= N * T,
        ),
        Obligation(
            "delay_allowed",
            (T > 0, tau >= 0, N >= 1, tat_a - tat_b <= N * T, tat_b - c <= tau),
            tat_a - (c + N * T) <= tau,
        ),
    ]


def _verdict(checked: Checked) -> tuple[str, str | None]:
    """Proved if every obligation is; else refuted if one is, with the first failing
    obligation and Z3's model as the counterexample (no trace search here)."""
    result = "proved" if checked.all_proved else ("refuted" if "refuted" in checked.statuses else "unknown")
    return result, checked.failures[0] if checked.failures else None


@dataclass(frozen=True)
class SharedProperty:
    """A named property of R23-R26 and its proof obligations; ``run()`` returns the
    record ``{"name", "rules", "tool": "z3", "result": "proved"|"refuted"|"unknown",
    "seconds", "vacuity_ok", "counterexample"}`` (``counterexample``: the first failing
    obligation with Z3's model, which for an inductive step may be unreachable)."""

    name: str
    rules: tuple[str, ...]
    obligations: Callable[[], list[Obligation]]

    def run(self, timeout_ms: int = 5000) -> dict:
        return z3_proof_record(self.name, self.rules, self.obligations, timeout_ms, _verdict)

    @property
    def fn(self) -> Callable[..., dict]:
        return self.run


PROPERTIES: list[SharedProperty] = [
    SharedProperty("r24_shared_window_bound", ("R23", "R24"), _bound_obligations),
    SharedProperty("r24_work_conservation", ("R23", "R24"), _wc_obligations),
    SharedProperty("r25_fail_closed", ("R24", "R25"), _fail_closed_obligations),
    SharedProperty("r26_no_double_spend", ("R23", "R26"), _crash_obligations),
]

assert NS_PER_S == 10**9  # times are ns, as in the single-engine proofs


def run_all(timeout_ms: int = 5000) -> list[dict]:
    """Run every property of R23-R26; one record per property (see ``SharedProperty``)."""
    return [prop.run(timeout_ms) for prop in PROPERTIES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-ms", type=int, default=5000)
    args = parser.parse_args(argv)
    results = run_all(args.timeout_ms)
    print(f"{'property':30} {'result':8} {'seconds':>8} vacuity_ok  rules")
    for r in results:
        print(f"{r['name']:30} {r['result']:8} {r['seconds']:8.3f} {r['vacuity_ok']!s:10}  {','.join(r['rules'])}")
        if r["counterexample"]:
            print(f"    counterexample: {r['counterexample']}")
    return 0 if all(r["result"] == "proved" and r["vacuity_ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
