"""The Z3 encoding behind the boundary scenarios (``adapter/boundaries.py``): a bounded
prefix of scheduling steps (``PrefixModel``: clock advances ``a[i]``, clock readings ``t[i]``)
and one user's limiter trajectory in it (``UserTrajectory``: scaled TAT, grants available, grants).

The limiter (R1-R5, ``spec/limiter.py``) in the reference's exact scaling (R3): for a rate
``p/q`` tokens/s the scaled TAT is ``S = TAT_ns * p``, the emission interval is the integer
``inc = 10**9 q`` and tau is ``burst = tau_ns * p``; a user's grants at one instant are
``floor((burst - lead) / inc) + 1`` if ``lead = max(S - now p, 0) <= burst``, else 0 (R2);
a charge refunded at the end of its step (R9, R4) leaves ``max(TAT, now)``.
Units: ns for times and advances; scaled values in ns x p.
"""

from __future__ import annotations

from fractions import Fraction

import z3

from vllm_output_rate.spec import limiter as spec_limiter

NS_PER_S = spec_limiter.NS_PER_S
BURST_NS = spec_limiter.BURST_NS
CLEANUP_STEP = spec_limiter.CLEANUP_INTERVAL_STEPS - 1  # 0-based index of the 256th schedule()
MAX_ADVANCE_NS = 2 * NS_PER_S  # bound on one solved clock advance
SOLVER_TIMEOUT_MS = 5_000


def zmax(a, b):
    """``max(a, b)`` of two Z3 integer terms, as a Z3 term."""
    return z3.If(a >= b, a, b)


def zmin(a, b):
    """``min(a, b)`` of two Z3 integer terms, as a Z3 term."""
    return z3.If(a <= b, a, b)


class UserTrajectory:
    """One user's limiter trajectory in a ``PrefixModel``: scaled TAT ``S[i]`` before step i,
    grants available ``ga[i]``, grants ``g[i] = min(demand[i], ga[i])`` (R2)."""

    def __init__(
        self, model: PrefixModel, name: str, rate: Fraction, demand: list, refunds: list[int] | None = None
    ) -> None:
        assert len(demand) == model.steps
        refunds = refunds or [0] * model.steps
        self.name, self.rate = name, rate
        self.p, q = rate.numerator, rate.denominator
        self.inc, self.burst = NS_PER_S * q, BURST_NS * rate.numerator
        self.demand = demand
        self.S, self.lead, self.ga, self.g = [z3.IntVal(0)], [], [], []
        for i, d in enumerate(demand):
            nowp = model.t[i] * self.p
            s = self.S[i]
            lead = zmax(s - nowp, 0)
            ga = z3.If(lead > self.burst, 0, (self.burst - lead) / self.inc + 1)
            g = zmin(d, ga) if not isinstance(d, int) or d > 0 else z3.IntVal(0)
            nxt = z3.Int(f"S_{name}_{i + 1}")
            # R2 grants, then R9 refunds of this step's charges (R4: TAT - T each): a take
            # and its refund leave max(TAT, now).
            model.solver.add(nxt == z3.If(g > 0, zmax(s, nowp) + (g - refunds[i]) * self.inc, s))
            if refunds[i]:
                model.solver.add(g == d)
            self.lead.append(lead)
            self.ga.append(ga)
            self.g.append(g)
            self.S.append(nxt)
        self.model = model

    # -- targets (Z3 constraints on step i) ----------------------------------------------
    def granted(self, i: int):
        """Every demanded sampling dispatch of step i is granted."""
        return self.g[i] == self.demand[i]

    def refused(self, i: int):
        """R2: the user is refused at step i (no grant at all)."""
        return self.ga[i] == 0

    def lead_minus_tau(self, i: int):
        """``(TAT - now - tau) x p`` before step i (scaled; 0 = exactly at the burst edge)."""
        return self.S[i] - self.model.t[i] * self.p - self.burst

    def ahead(self, i: int, by_scaled):
        """The TAT before step i is at least ``by_scaled / p`` ns ahead of the clock."""
        return self.S[i] - self.model.t[i] * self.p >= by_scaled


class PrefixModel:
    """A bounded prefix of ``steps`` scheduling steps: clock ``t[i]`` of step i from
    advances ``a[i]`` (after step i), each in [0, MAX_ADVANCE_NS] unless fixed."""

    def __init__(self, steps: int, fixed: dict[int, int] | None = None, seed: int = 0) -> None:
        fixed = fixed or {}
        self.steps = steps
        self.solver = z3.Solver()
        self.solver.set("timeout", SOLVER_TIMEOUT_MS)
        self.solver.set("random_seed", seed)
        self.a: list = []
        self.t: list = [z3.IntVal(0)]
        for i in range(steps - 1):
            if i in fixed:
                a = z3.IntVal(fixed[i])
            else:
                a = z3.Int(f"a{i}")
                self.solver.add(a >= 0, a <= MAX_ADVANCE_NS)
            self.a.append(a)
            self.t.append(self.t[-1] + a)
        self.users: dict[str, UserTrajectory] = {}

    def user(self, name: str, rate: Fraction, demand: list, refunds: list[int] | None = None) -> UserTrajectory:
        user = self.users[name] = UserTrajectory(self, name, rate, demand, refunds)
        return user

    def add(self, *constraints) -> None:
        self.solver.add(*constraints)

    def solve(self) -> tuple[int, ...] | None:
        """The advances of a model (one per step but the last), or None if unsatisfiable."""
        if self.solver.check() != z3.sat:
            return None
        model = self.solver.model()
        return tuple(model.eval(a, model_completion=True).as_long() for a in self.a)
