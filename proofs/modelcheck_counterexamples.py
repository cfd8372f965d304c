"""Counterexamples of the model checker (``proofs/modelcheck.py``): the shortest event
sequence to a violating world, re-run concretely on the spec and saved as a
``StepScenario`` for replay on vLLM.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from vllm_output_rate.proofs.modelcheck_reduction import World, canonical_key, initial_world
from vllm_output_rate.proofs.modelcheck_results import ConcretizationError, Violation
from vllm_output_rate.proofs.modelcheck_scopes import Compiled, Scope
from vllm_output_rate.proofs.modelcheck_transitions import enabled_events, transition
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AdvanceClock, Event, Step
from vllm_output_rate.spec.state import EngineConfig, initial_state

LIVENESS_TAIL_ROUNDS = 8  # a liveness counterexample ends with this many rounds of steps and clock advances


def _concretize(
    violation: Violation, scope: Scope, cs: Compiled, keys: list[bytes], parent: array, save_dir: Path | None
) -> None:
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
        # deferred: adapter.fidelity imports Hypothesis at its top; only a concretized counterexample needs it
        from vllm_output_rate.adapter.fidelity import StepScenario

        save_dir.mkdir(parents=True, exist_ok=True)
        target = save_dir / f"modelcheck-{scope.name}-{violation.check}.json"
        target.write_text(StepScenario(scope.config, violation.events).to_json() + "\n")
        violation.scenario_path = str(target)


def concrete_path(
    scope: Scope, cs: Compiled, keys: list[bytes], parent: array, state_id: int
) -> tuple[World, list[Event]]:
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
            raise ConcretizationError(
                f"{scope.name}: cannot concretize the path to state {state_id} at depth {depth_index}"
            )
    return world, events


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
