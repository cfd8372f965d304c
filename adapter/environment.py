"""The environment is never the candidate's fault: the gate's stock preflight.

Before any candidate row, ``stock_preflight`` builds stock vLLM's ``Scheduler`` and
``AsyncScheduler`` in the gate's harness (``adapter/harness.py``) and runs a few steps of base
fidelity on them (``PREFLIGHT_SCENARIOS``: admission, decoding, a preemption and its resume,
sync and async). If that fails -- the ``VllmConfig`` cannot be built, vLLM's API moved under
the harness, a package is missing, or the spec no longer predicts stock vLLM on these few
steps -- there is no verdict on the candidate: ``outrate conform`` prints
``environment_paragraph`` and exits 3 without running a candidate row or writing a
counterexample.

During the run, a candidate's exception is a crash only if the stock class survives the same
scenario (``stock_survives``); otherwise the run stops the same way (``EnvironmentFailure``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from vllm_output_rate.adapter.scenarios import DRAIN_STEP_LIMIT, Scenario
from vllm_output_rate.adapter.versions import installed_version
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Drain, Step
from vllm_output_rate.spec.state import EngineConfig
from vllm_output_rate.spec.versions import SUPPORTED_VERSIONS

EXIT_NO_VERDICT = 3
"""``outrate conform``'s exit code when the environment, not the candidate, failed."""

STOCK_CLASS_PATHS = {
    False: "vllm.v1.core.sched.scheduler.Scheduler",
    True: "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
}
"""The stock classes the preflight builds (sync, async); tests may point them elsewhere."""


class EnvironmentFailure(BaseException):
    """The gate cannot run stock vLLM in its harness on the installed vLLM: no verdict.

    ``what``: one sentence saying what failed (the step and the error). A ``BaseException``:
    the candidate guards (``except Exception``) and Hypothesis's shrinking let it through to
    ``outrate conform``, which stops the run."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _preflight_events(async_mode: bool) -> tuple[Any, ...]:
    """Three requests of 30 prompt tokens on 6 KV blocks of 16 tokens: two admitted, decoded
    until the blocks run out (one is preempted, V6), the third admitted and the preempted one
    resumed when blocks are freed (V8), 1 ms between steps."""
    events: list[Any] = [AddRequest(f"p{i}", prompt_len=30, max_tokens=8) for i in range(3)]
    for _ in range(20):
        events += [Step(), AdvanceClock(1_000_000)]
    if async_mode:
        events.append(Drain())
    return tuple(events)


def preflight_scenarios() -> list[Any]:
    """The preflight's base-fidelity scenarios (feature off), sync then async."""
    # deferred: the harness side (hypothesis, the vLLM seam) may not import; stock_preflight says so
    from vllm_output_rate.adapter.fidelity import StepScenario

    return [
        StepScenario(EngineConfig(num_blocks=6, max_num_seqs=4, async_scheduling=a), _preflight_events(a))
        for a in (False, True)
    ]


def _supported() -> str:
    return ", ".join(SUPPORTED_VERSIONS)


def environment_paragraph(what: str) -> str:
    """The one paragraph ``outrate conform`` prints instead of a verdict: what failed, the
    installed vLLM, the supported releases and what to do."""
    try:
        version = installed_version()
    except Exception as exc:  # vLLM itself does not import: say so
        version = f"(not importable: {type(exc).__name__}: {exc})"
    return (
        f"NO VERDICT (exit {EXIT_NO_VERDICT}): the environment, not the candidate, failed. {what} "
        f"Installed vLLM: {version}; supported releases: {_supported()}. No candidate check was judged "
        f"and no counterexample was written. What to do: install a supported release "
        f"(`make install VLLM=X.Y.Z`, then run the gate from that environment), check that "
        f"`python -m vllm_output_rate.envcheck` says 'environment ok', and if it does, report this "
        f"paragraph: the gate's harness needs a change for this vLLM."
    )


def stock_preflight(run_base: Callable[..., Any] | None = None) -> str | None:
    """Build the stock scheduler classes in the harness and run ``preflight_scenarios`` as base
    fidelity; None if both ran and matched the spec, else one sentence saying what failed.

    ``run_base``: ``fidelity.run_step_scenario``-like ``(cls, scenario) -> StepVerdict`` (tests
    pass their own). Never raises for a failure of vLLM or of the environment.
    """
    try:
        # deferred: the harness side (hypothesis, the vLLM seam) may not import; reported below
        from vllm_output_rate.adapter.fidelity import run_step_scenario
    except Exception as exc:  # an import of the gate's vLLM side failed: a missing package, an API break
        return f"Importing the gate's harness failed: {type(exc).__name__}: {exc}."
    run = run_base or run_step_scenario
    for scenario in preflight_scenarios():
        cls = STOCK_CLASS_PATHS[scenario.config.async_scheduling]
        mode = "async" if scenario.config.async_scheduling else "sync"
        try:
            verdict = run(cls, scenario)
        except Exception as exc:  # what failed, where (the last frame), not a traceback
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            return (
                f"Stock vLLM's {cls.rpartition('.')[2]} could not run in the gate's harness ({mode} base-fidelity "
                f"preflight): {type(exc).__name__}: {exc} (at {frame.filename.rpartition('/')[2]}:{frame.lineno})."
            )
        if verdict.failure is not None:
            return (
                f"The spec does not predict stock vLLM's {cls.rpartition('.')[2]} on the {mode} base-fidelity "
                f"preflight (3 requests, 6 KV blocks): event {verdict.event_index}: {verdict.failure}."
            )
    return None


def run_on_stock(scenario: Any) -> None:
    """Run ``scenario`` (a rate-limit ``Scenario`` or a ``StepScenario``) on the stock class of
    its mode (``STOCK_CLASS_PATHS``): the same arrivals, aborts and steps; the rate-limit
    section is ignored by stock vLLM. Raises whatever stock vLLM raises."""
    # deferred: the harness side (hypothesis, the vLLM seam) may not import; stock_preflight says so
    from vllm_output_rate.adapter.fidelity import StepScenario, run_step_scenario

    if isinstance(scenario, StepScenario):
        run_step_scenario(STOCK_CLASS_PATHS[scenario.config.async_scheduling], scenario)
    elif isinstance(scenario, Scenario):
        _drive_stock(scenario)


def _drive_stock(scenario: Any) -> None:
    """A rate-limit ``Scenario``'s arrivals, aborts and steps on the stock class, judging
    nothing (stock vLLM does not limit rates; only whether it raises matters), 1 ms between
    steps, until every request has finished (at most ``DRAIN_STEP_LIMIT`` steps more)."""
    # deferred: the harness side (hypothesis, the vLLM seam) may not import; stock_preflight says so
    from vllm_output_rate.adapter.scenario_run import add_spec, build_harness, parallel_children

    harness = build_harness(STOCK_CLASS_PATHS[scenario.async_scheduling], scenario)
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    aborts = scenario.abort_schedule()
    children = parallel_children(scenario.requests)
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        while pending and pending[0].at_step <= step:
            add_spec(harness, pending.pop(0), children)
        while aborts and aborts[0][0] <= step and aborts[0][1].at_step < step:
            harness.abort(aborts.pop(0)[1].request_id)
        if step >= scenario.num_steps and not pending and len(harness.finished) == len(harness.num_outputs):
            return
        harness.step()
        harness.advance(1_000_000)


_SURVIVED: dict[str, bool] = {}  # repr(scenario) -> stock survived it (one re-run per scenario)


def stock_survives(
    scenario: Any, candidate_error: BaseException, stock_run: Callable[[Any], Any] | None = None
) -> None:
    """A candidate raised ``candidate_error`` on ``scenario``: run ``stock_run(scenario)`` (the
    same scenario on the stock class; default ``run_on_stock``), once per scenario. Returns
    if stock vLLM survives it (the crash is the candidate's); raises ``EnvironmentFailure`` if
    stock raises too.
    """
    key = repr(scenario)
    if _SURVIVED.get(key):
        return
    try:
        (stock_run or run_on_stock)(scenario)
        _SURVIVED[key] = True
    except Exception as exc:
        raise EnvironmentFailure(
            f"The candidate raised {type(candidate_error).__name__}: {candidate_error}; stock vLLM raised "
            f"{type(exc).__name__}: {exc} on the same scenario, so the crash is not the candidate's."
        ) from exc
