"""The model checker's breadth-first explorer (``proofs/modelcheck.py``): every world
reachable in a scope, each transition checked, coverage counted, liveness decided on
the explored graph, violations concretized.
"""

from __future__ import annotations

import gc
import time
from array import array
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from vllm_output_rate.proofs.modelcheck_counterexamples import _concretize
from vllm_output_rate.proofs.modelcheck_liveness import _check_liveness
from vllm_output_rate.proofs.modelcheck_reduction import (
    World,
    canonical_key,
    canonical_world,
    canonicalize,
    initial_world,
)
from vllm_output_rate.proofs.modelcheck_results import ConcretizationError, ScopeBoundExceeded, ScopeResult, Violation
from vllm_output_rate.proofs.modelcheck_scopes import Compiled, Scope
from vllm_output_rate.proofs.modelcheck_transitions import _is_progress_event, enabled_events, transition
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import rate as spec_rate
from vllm_output_rate.spec.events import Event, Step
from vllm_output_rate.spec.state import Observation, SchedulerState

PROGRESS_EVERY = 2000  # states between two progress reports
COVERAGE_KEYS = (
    "scheduled",
    "sampled",
    "charged",
    "refunded",
    "throttled",
    "refused_prefill",
    "wait_hint",
    "preempted",
    "preempted_throttled",
    "admitted",
    "stop",
    "length",
    "stale_output",
    "rotation",
    "not_binding",
    "held",
)


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
            r.request_id in obs.preempted
            and r.request_id in before.running
            and not spec_limiter.allows(before.limiter, r.user, before.now_ns, before.config.burst_ns)
            for r in before.requests
        )
        coverage["refused_prefill"] += any(
            rid not in obs.sampled
            and r.user in throttled_users | {u for u, _ in obs.tat_ns}
            and not spec_limiter.allows(before.limiter, r.user, before.now_ns, before.config.burst_ns)
            for rid, _ in obs.scheduled
            for r in before.requests
            if r.request_id == rid
        )
        coverage["rotation"] += spec_rate.turn_order(before) != before.running
        coverage["not_binding"] += not obs.limit_bound  # R19: compared with the base step (I18)
        coverage["held"] += bool(spec_rate.start_turns(before)[2])  # R14: some user granted, not for all
    coverage["stale_output"] += any(r.request_id in obs.preempted and r.num_in_flight_tokens for r in before.requests)


def _invariants_per_transition(event: Event, cs: Compiled) -> int:
    """How many invariant checks one transition runs (for the report)."""
    if not isinstance(event, Step):
        return 3  # I8, I11, I12
    if not cs.rate_limited:
        return 6  # + I6, I9, I10
    return 6 + 12 + 3  # + I1-I5, I7, I13-I18; + R6, F1, assert


def explore(
    scope: Scope,
    *,
    max_states: int | None = None,
    stop_at_first: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    concretize_violations: bool = True,
    save_dir: Path | None = None,
    raise_on_bound: bool = True,
    strict: bool = True,
    keep_graph: bool = False,
) -> ScopeResult:
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
        return _explore(
            scope,
            max_states,
            stop_at_first,
            on_progress,
            concretize_violations,
            save_dir,
            raise_on_bound,
            strict,
            keep_graph,
        )
    finally:
        if collecting:
            gc.enable()


def _explore(
    scope, max_states, stop_at_first, on_progress, concretize_violations, save_dir, raise_on_bound, strict, keep_graph
) -> ScopeResult:
    cs = Compiled(scope)
    limit = max_states if max_states is not None else scope.max_states
    started = time.perf_counter()
    result = ScopeResult(scope.name, pinned=scope.pinned)
    g = _breadth_first(cs, result, limit, stop_at_first, on_progress)
    result.states = len(g.keys)
    result.transitions = g.transitions
    result.coverage = g.coverage
    result.invariant_checks = g.checks
    result.max_depth = max(g.depth) if len(g.depth) else 0
    if result.bound_exceeded and raise_on_bound:
        raise ScopeBoundExceeded(
            f"scope {scope.name}: more than {limit} distinct states (raise max_states "
            f"deliberately if the scope is meant to be this large)"
        )
    if not result.bound_exceeded and not (stop_at_first and result.violations):
        _check_liveness(result, g.keys, g.no_work, g.crashed, g.productive, g.edge_src, g.edge_dst, g.depth)
    result.seconds = time.perf_counter() - started
    if on_progress is not None:
        on_progress(result.states, g.transitions)
    if keep_graph:
        result.graph = (g.keys, g.parent, g.depth)
    if concretize_violations:
        for violation in result.violations.values():
            try:
                _concretize(violation, scope, cs, g.keys, g.parent, save_dir)
            except ConcretizationError:
                if strict:
                    raise
    return result


class _Graph(NamedTuple):
    """The explored graph, indexed by state id (BFS order): fingerprints, BFS parent and
    depth, per-state flags (no live request; a Step or clock advance raised; some Step
    scheduled a token), the Step/AdvanceClock edges, and the run's counts."""

    keys: list[bytes]
    parent: array
    depth: array
    no_work: bytearray
    crashed: bytearray
    productive: bytearray
    edge_src: array
    edge_dst: array
    transitions: int
    checks: int
    coverage: dict[str, int]


def _record_violations(result: ScopeResult, violations: list[tuple[str, str]], d: int, sid: int, event: Event) -> None:
    """Keep the first violation of each check in ``result``: found by ``event`` from state
    ``sid`` at BFS depth ``d`` (so at depth ``d + 1``)."""
    for check, message in violations:
        if check not in result.violations:
            result.violations[check] = Violation(check, message, d + 1, sid, event)


def _progress_edge(
    event: Event, obs: Observation | None, sid: int, tid: int, edges: tuple[array, array, bytearray]
) -> None:
    """Record the Step/AdvanceClock edge ``sid -> tid`` in ``edges`` (sources, targets, the
    per-state productive flags), and mark ``sid`` productive if a Step scheduled a token."""
    edge_src, edge_dst, productive = edges
    edge_src.append(sid)
    edge_dst.append(tid)
    if isinstance(event, Step) and obs is not None and obs.scheduled:
        productive[sid] = 1


def _breadth_first(
    cs: Compiled, result: ScopeResult, limit: int, stop_at_first: bool, on_progress: Callable[[int, int], None] | None
) -> _Graph:
    """Explore every canonical world reachable in ``cs`` breadth first (at most ``limit``
    states), checking each transition: first violations per check go to ``result``, and
    ``result.bound_exceeded`` is set if the bound cut the search."""
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
            _record_violations(result, outcome.violations, d, sid, event)
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
                _progress_edge(event, outcome.obs, sid, tid, (edge_src, edge_dst, productive))
    return _Graph(keys, parent, depth, no_work, crashed, productive, edge_src, edge_dst, transitions, checks, coverage)
