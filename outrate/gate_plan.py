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
