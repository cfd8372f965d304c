"""The whole gate: the adapter's checks plus the spec-health rows of proofs/.

``outrate conform`` and the pytest plugin (``--outrate-scheduler``) both plan through here,
so they list the same rows. The adapter cannot add the proofs' rows itself: the layers go
one way (``tests/test_layers.py``), and proofs/ sits above the adapter.
"""

from __future__ import annotations

from vllm_output_rate.adapter import registry as adapter_registry
from vllm_output_rate.adapter.registry import CheckSpec, GateOptions, PlannedCheck
from vllm_output_rate.proofs.gate_checks import spec_health_checks


def registry() -> list[CheckSpec]:
    """Every check of the gate, in running order (the adapter's, then proofs/')."""
    return adapter_registry.registry(extra=spec_health_checks())


def plan(options: GateOptions) -> list[PlannedCheck]:
    """The checks of one gate run (``adapter.registry.plan`` with the proofs' rows)."""
    return adapter_registry.plan(options, extra=spec_health_checks())


def candidate_class_problem(path: str, path_hint: str) -> str | None:
    """Why the candidate scheduler class ``path`` (a dotted path) cannot be judged, or None.

    Both fronts (``outrate conform`` and the pytest plugin) refuse such a class before any
    check runs, as the operator's mistake it is, never as a candidate failure. ``path_hint``
    is added when the class's module is not found (how that front extends the path).
    """
    from vllm.v1.core.sched.interface import SchedulerInterface

    from vllm_output_rate.adapter.harness import load_class

    try:
        cls = load_class(path)
    except (ValueError, ImportError) as exc:
        return f"{exc}{path_hint if 'No module named' in str(exc) else ''}"
    if not (isinstance(cls, type) and issubclass(cls, SchedulerInterface)):
        return (
            f"{path} is not a vLLM scheduler class (a subclass of vllm.v1.core.sched.interface."
            f"SchedulerInterface, e.g. of vllm.v1.core.sched.scheduler.Scheduler)"
        )
    return None
