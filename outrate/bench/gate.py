"""Gate throughput: differential steps/s, spec-only and fidelity scenarios/s, model-checker
states/s (``vllm_output_rate.bench``, "Gate").
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable
from typing import Any

from vllm_output_rate.bench.common import (
    QUICK,
    Plan,
)


# -- gate -------------------------------------------------------------------------------
def seeded_draws(strategy, count: int, seed: int = 0) -> list:
    """``count`` examples of a Hypothesis strategy, always the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings  # deferred: Hypothesis is imported only by a bench run
    from hypothesis import seed as hseed  # deferred: Hypothesis is imported only by a bench run

    drawn: list = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hseed(seed)
    @given(example=strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn[:count]


def _step_model() -> tuple[dict[str, Any] | None, str]:
    """The spec's step model and its scenario class, or (None, why they are not usable)."""
    try:
        # deferred: adapter.fidelity imports Hypothesis at its top; kept off `outrate --help`
        from vllm_output_rate.adapter import fidelity

        # deferred: the spec's step model costs ~80 ms to load, kept off `outrate --help`
        from vllm_output_rate.spec import scheduler as spec_scheduler
        from vllm_output_rate.spec.events import Step  # deferred: as above
        from vllm_output_rate.spec.state import initial_state  # deferred: as above

        parts = {
            "run": spec_scheduler.run,
            "initial_state": initial_state,
            "Step": Step,
            "scenarios": fidelity.base_scenarios,
            "run_step_scenario": fidelity.run_step_scenario,
            "stock_cls": fidelity.base_scheduler_cls,
        }
    except (ImportError, AttributeError) as exc:
        return None, (
            f"not available: the spec step model (vllm_output_rate.spec.scheduler.run) with its "
            f"scenarios (vllm_output_rate.adapter.fidelity.base_scenarios) cannot be used: {exc}"
        )
    return parts, "vllm_output_rate.spec.scheduler.run"


def _find_entry(package: str, modules: tuple[str, ...], attr: str) -> tuple[Callable | None, str]:
    """``attr`` of the first of ``package.modules`` defining it, or (None, why not)."""
    pkg = importlib.import_module(package)
    present = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    for name in modules:
        if name in present:
            module = importlib.import_module(f"{package}.{name}")
            entry = getattr(module, attr, None)
            if callable(entry):
                return entry, f"{package}.{name}.{attr}"
    wanted = " or ".join(f"{package}.{m}.{attr}" for m in modules)
    return None, f"not available: no {wanted} (modules there: {', '.join(present) or 'none'})"


def _rate_row(check: str, what: str, scenarios: int, steps: int, seconds: float) -> dict[str, Any]:
    return {
        "check": check,
        "what": what,
        "scenarios": scenarios,
        "steps": steps,
        "seconds": seconds,
        "scenarios_per_s": scenarios / seconds,
        "steps_per_s": steps / seconds,
    }


def measure_gate(plan: Plan, tick: Callable[[], None]) -> dict[str, Any]:
    """Gate rates: rate-limit differential (real scheduler + spec limiter), spec-only step
    model and spec-vs-vLLM fidelity on the same seeded scenarios, model checker."""
    # deferred: adapter.harness imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    model, model_why = _step_model()
    for mode, cls in (("sync", REFERENCE_SCHEDULER), ("async", REFERENCE_ASYNC_SCHEDULER)):
        rows.append(_differential_row(plan, mode, cls, tick))
        if model is None:
            continue
        try:
            rows += _step_model_rows(plan, mode, model)
        except Exception as exc:  # the step model is young: report, do not fail the benchmark
            skipped[f"spec-only/{mode}"] = f"not measured: the step model raised {type(exc).__name__}: {exc}"
    if model is None:
        skipped["spec-only"] = model_why
    explore, mc_where = _find_entry("vllm_output_rate.proofs", ("modelcheck",), "explore")
    if explore is not None:
        budget = 2_000 if plan.gate_scenarios <= QUICK.gate_scenarios else 200_000
        started = time.perf_counter()
        try:
            states = _explore_states(explore, budget)
        except Exception as exc:  # report, do not fail the benchmark
            skipped["model-checker"] = f"not measured: {type(exc).__name__}: {exc}"
        else:
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "check": "model-checker",
                    "what": mc_where,
                    "states": states,
                    "seconds": seconds,
                    "states_per_s": states / seconds,
                }
            )
    else:
        skipped["model-checker"] = mc_where
    return {"rows": rows, "skipped": skipped}


def _differential_row(plan: Plan, mode: str, cls: str, tick: Callable[[], None]) -> dict[str, Any]:
    """The ``differential/<mode>`` row: ``plan.gate_scenarios`` seeded rate-limit scenarios
    run on the reference class ``cls`` (dotted path) after one untimed warm-up; ``tick``
    after each."""
    # deferred: adapter.scenario_run imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.scenario_run import run_scenario

    # deferred: adapter.scenario_strategies imports Hypothesis at its top
    from vllm_output_rate.adapter.scenario_strategies import scenarios

    drawn = seeded_draws(
        scenarios(async_scheduling=mode == "async", max_steps=plan.gate_max_steps), plan.gate_scenarios
    )
    run_scenario(cls, drawn[0])  # warm-up, untimed: first harness of this class
    steps = 0
    started = time.perf_counter()
    for scenario in drawn:
        steps += run_scenario(cls, scenario).steps
        tick()
    return _rate_row(
        f"differential/{mode}",
        f"adapter.scenario_run.run_scenario on {cls.rsplit('.', 1)[1]}",
        len(drawn),
        steps,
        time.perf_counter() - started,
    )


def _step_model_rows(plan: Plan, mode: str, model: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``spec-only/<mode>`` and ``fidelity/<mode>`` rows on the same seeded step
    scenarios (``model``: the step model's entry points, ``_step_model``), each after one
    untimed warm-up."""
    async_mode = mode == "async"
    step_scenarios = seeded_draws(
        model["scenarios"](async_scheduling=async_mode, max_steps=plan.gate_max_steps), plan.gate_scenarios
    )
    steps = sum(sum(isinstance(e, model["Step"]) for e in sc.events) for sc in step_scenarios)
    model["run"](model["initial_state"](step_scenarios[0].config), step_scenarios[0].events)  # warm-up
    started = time.perf_counter()
    for sc in step_scenarios:
        model["run"](model["initial_state"](sc.config), sc.events)
    rows = [
        _rate_row(
            f"spec-only/{mode}",
            "spec.scheduler.run on adapter.fidelity.base_scenarios",
            len(step_scenarios),
            steps,
            time.perf_counter() - started,
        )
    ]
    stock_cls = model["stock_cls"](async_mode)
    model["run_step_scenario"](stock_cls, step_scenarios[0])  # warm-up, untimed
    steps = 0
    started = time.perf_counter()
    for sc in step_scenarios:
        steps += model["run_step_scenario"](stock_cls, sc).steps
    rows.append(
        _rate_row(
            f"fidelity/{mode}",
            f"adapter.fidelity.run_step_scenario, spec vs {stock_cls.rsplit('.', 1)[1]}",
            len(step_scenarios),
            steps,
            time.perf_counter() - started,
        )
    )
    return rows


def _explore_states(explore: Callable, budget: int) -> int:
    """Distinct states the model checker explores in its first declared scope (<= budget)."""
    # deferred: proofs.modelcheck and the model checker it loads cost ~0.15 s, kept off `outrate --help`
    from vllm_output_rate.proofs import modelcheck

    scope = modelcheck.profile_scopes("quick")[0]
    result = explore(scope, max_states=budget, raise_on_bound=False)
    return int(getattr(result, "states", result))
