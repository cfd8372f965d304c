"""Z3-directed boundary scenarios (issue 18 item 1): the gate's power without looking inside.

Each named boundary is a small Z3 problem over integer nanosecond clock readings that
encodes a bounded prefix of the spec's step for the users of one scenario shape:

- the limiter (R1-R5, ``spec/limiter.py``) in the reference's exact scaling (R3): for a
  rate ``p/q`` tokens/s the scaled TAT is ``S = TAT_ns * p``, the emission interval
  ``T = 10**9 q / p`` ns is the integer ``inc = 10**9 q`` and tau is ``burst = tau_ns * p``;
  a user's grants at one instant are ``floor((burst - lead) / inc) + 1`` if
  ``lead = max(S - now p, 0) <= burst``, else 0 (R2);
- the charge condition (R7): a chunk samples iff ``computed + chunk >= n``, chunks of the
  step budget; the prefill room of a refused prefill ``n - 1 - computed`` (R10);
- the refund point (R9): a charge undone at the end of the step is a net zero grant in a
  step in which the user was granted;
- the cleanup cadence (R6): the 256th ``schedule()`` call, with the TAT at ``now`` or
  ``now + 1 ns``.

A model of a problem gives the clock advances (``Scenario.advances_ns``) and, with the
shape, the requests of a rate-limit ``Scenario`` (``adapter/scenarios.py``) that reaches
the boundary. The scenario is then run on the candidate with ``run_scenario``; the
existing black-box judge decides (grant replay at every dispatch: no over-grant on the
"1 ns" twins; the ample-sync under-grant check: a grant exactly at the edge). The judge
also records which boundaries a run actually reached (``adapter/coverage.py``), so a
boundary the model aimed at but the run missed shows as ``not reached``.

Units: ns for times and advances; tokens/s for rates; scaled values in ns x p.
Problems are solved once per (boundary, rate, mode) and cached. Which rates a run uses
depends on the seed; ``--integer-rates`` candidates get integer rates only (3 and 7
tokens/s still have emission intervals that are not a whole number of ns).

Where the parts live: the Z3 encoding in ``adapter/boundary_model.py``, one scenario
builder per boundary in ``adapter/boundary_shapes.py``, the named boundaries and their rate
pools in ``adapter/boundary_catalog.py``; this module solves them per run and runs them as
the gate's ``boundaries/*`` rows.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable
from dataclasses import replace

from vllm_output_rate.adapter.boundary_catalog import BOUNDARIES
from vllm_output_rate.adapter.boundary_shapes import BUILDERS
from vllm_output_rate.adapter.conform import _guarded, _record_failure, _save_counterexample
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.modes import ModeRefused
from vllm_output_rate.adapter.rule_naming import named_verdict
from vllm_output_rate.adapter.scenario_run import minimize, run_scenario
from vllm_output_rate.adapter.scenarios import Scenario
from vllm_output_rate.adapter.z3guard import z3_alone


@functools.cache
def _solved(name: str, rate: str, async_mode: bool, seed: int) -> Scenario | None:
    boundary = next(b for b in BOUNDARIES if b.name == name)
    with z3_alone():  # Z3 in one thread, its objects freed here (adapter/z3guard.py)
        scenario = BUILDERS[boundary.name](rate, async_mode, seed)
    return None if scenario is None else replace(scenario, async_scheduling=async_mode)


def boundary_scenarios(
    async_mode: bool, integer_rates: bool, seed: int, per_boundary: int = 1
) -> list[tuple[str, Scenario]]:
    """The boundary scenarios of one run, as ``(name, scenario)``: for each boundary,
    ``per_boundary`` rates drawn from its pool with ``seed`` (integer rates only with
    ``integer_rates``; past the pool's size the rates repeat with another solver seed),
    each solved once and cached. Names are ``boundary@rate`` (``#n`` for a repeat)."""
    out = []
    for boundary in BOUNDARIES:
        pool = list(boundary.rates(integer_rates))
        random.Random(f"{seed}/{boundary.name}").shuffle(pool)
        for j in range(per_boundary):
            rate, repeat = pool[j % len(pool)], j // len(pool)
            scenario = _solved(boundary.name, rate, async_mode, seed * 1000 + repeat)
            if scenario is not None:
                out.append((f"{boundary.name}@{rate}" + (f"#{repeat}" if repeat else ""), scenario))
    return out


def check_boundaries(
    scheduler_cls: str,
    async_mode: bool,
    seed: int,
    tick: Callable[[], None],
    save_dir=None,
    level: str = "must",
    style=None,
    integer_rates: bool = False,
    per_boundary: int = 1,
):
    """Row ``boundaries/sync`` or ``boundaries/async``: every boundary scenario of
    ``boundary_scenarios`` run on ``scheduler_cls`` with ``run_scenario`` at ``level``.

    Stops at the first failing scenario, made 1-minimal and saved for ``outrate replay``;
    the failure names the boundary. ``result.scenarios`` lists the scenarios by name.
    """
    tag = "async" if async_mode else "sync"
    rules = sorted({r for b in BOUNDARIES for r in b.rules})
    result = CheckResult(f"boundaries/{tag}", rules)
    run = _guarded(lambda scenario: run_scenario(scheduler_cls, scenario, level, style), scheduler_cls)
    named = boundary_scenarios(async_mode, integer_rates, seed, per_boundary)
    result.scenarios = [name for name, _ in named]
    for name, scenario in named:
        tick()
        try:
            verdict = run(scenario)
        except ModeRefused as refused:  # adapter/modes.py: a mode the candidate refused at start-up
            result.scenarios[result.scenarios.index(name)] = f"{name} (not applicable: {refused})"
            continue
        result.examples += 1
        result.steps += verdict.steps
        if verdict.failure is None:
            continue
        with contextlib.suppress(AssertionError):  # the failure did not reproduce: keep the scenario as it was
            scenario = minimize(scheduler_cls, scenario, run=run)
        name_rule = _guarded(lambda s: named_verdict(scheduler_cls, s, level, style), scheduler_cls)
        again = name_rule(scenario)  # named by the rule it breaks (adapter/attribution.py)
        verdict = again if again.failure is not None else verdict
        _record_failure(result, verdict, scenario)
        result.failure = f"{result.failure} (boundary scenario {name})"
        _save_counterexample(result, scenario, save_dir)
        break
    return result
