"""What the model checker reports for a scope (``proofs/modelcheck.py``): violations,
the scope's result, and the errors of an exceeded state bound or a failed concretization.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_output_rate.spec.events import Event


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
        return {
            "check": self.check,
            "message": self.message,
            "length": self.length,
            "events": [str(e) for e in self.events],
            "official": self.official,
            "scenario": self.scenario_path,
        }


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
        return {
            "name": self.name,
            "states": self.states,
            "transitions": self.transitions,
            "states_per_s": round(self.states_per_s, 1),
            "violations": len(self.violations),
            "seconds": round(self.seconds, 2),
            "invariant_checks": self.invariant_checks,
            "max_depth": self.max_depth,
            "bound_exceeded": self.bound_exceeded,
            "coverage": self.coverage,
            "pinned": None if self.pinned is None else {"states": self.pinned[0], "transitions": self.pinned[1]},
            "details": [v.as_json() for v in self.violations.values()],
        }


class ScopeBoundExceeded(AssertionError):
    """The scope reached more distinct states than its declared ``max_states``."""


class ConcretizationError(AssertionError):
    """A canonical path has no concrete counterpart: the reductions are unsound for the
    spec being checked (a mutation may depend on names or on absolute time)."""
