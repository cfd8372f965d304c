"""Replay of the model checker's paths on vLLM (``proofs/modelcheck.py``): sampled
concrete paths of a scope run through the fidelity harness on stock vLLM.
"""

from __future__ import annotations

import random

from vllm_output_rate.proofs.modelcheck_counterexamples import concrete_path
from vllm_output_rate.proofs.modelcheck_explorer import explore
from vllm_output_rate.proofs.modelcheck_scopes import Compiled, Scope, scope_by_name
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.events import AdvanceClock, Step


def sample_scenarios(scope: Scope, count: int, seed: int = 0):
    """``count`` replayable ``StepScenario``s of ``scope``: shortest paths to the deepest
    explored states and to random ones, each followed by steps and clock advances until
    every request has finished (the spec's own run; bounded)."""
    # deferred: adapter.fidelity imports Hypothesis at its top
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
    from vllm_output_rate.adapter.fidelity import run_base  # deferred: adapter.fidelity imports Hypothesis at its top

    # deferred: adapter.whitebox imports Hypothesis at its top
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
