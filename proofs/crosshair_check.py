"""Checking one CrossHair property in this process (``check_property``), for
``crosshair_limiter.py``: the ``CrossHairProperty`` record, the CPU budget per condition, and
the modelling step ``install_ceil_model`` (``math.ceil`` of a ``Fraction`` run symbolically).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm_output_rate.proofs.records import proof_record

# The math.ceil models this module registered with CrossHair (so that a second install is a no-op).
_OUR_CEIL_MODELS: set[Callable[..., Any]] = set()

# CPU seconds per condition. The costliest correct property (the differential) needs about
# 14 s of CPU to exhaust its paths, the others 0.2-4 s (CPU time: a loaded machine makes
# them slower in wall time but does not change the verdicts).
DEFAULT_PER_CONDITION_TIMEOUT_S: float = 30.0


@dataclass(frozen=True)
class CrossHairProperty:
    """A named property: the wrapper function whose PEP 316 condition states it.

    ``cost`` is the CPU seconds it took to confirm on an idle core (used only to share the
    properties out between child processes)."""

    name: str
    rules: tuple[str, ...]
    fn: Callable
    cost: float = 1.0


def install_ceil_model() -> bool:
    """Let CrossHair run ``math.ceil`` on a ``Fraction`` symbolically.

    CrossHair 0.0.113 models ``math.ceil`` by making its argument concrete, which forks one
    path per value and so can never exhaust ``spec.ready_at_ns`` (``math.ceil(TAT - tau)``).
    Python defines ``math.ceil(x)`` for a non-float ``x`` as ``x.__ceil__()``; for a
    ``Fraction`` that is the pure-Python ``-(-numerator // denominator)``, which CrossHair
    executes symbolically. This replaces CrossHair's patch for ``math.ceil`` by exactly
    that delegation for ``Fraction`` arguments (anything else goes to CrossHair's own
    patch). It edits a private CrossHair table; if that is missing nothing is changed, and
    the properties that use ``spec.ready_at_ns`` then come out "unknown", never "proved".

    Returns whether the model is installed.
    """
    try:
        importlib.import_module("crosshair.core_and_libs")  # makes CrossHair's own registrations
        from crosshair.core import _PATCH_REGISTRATIONS  # deferred: CrossHair is imported only to prove
    except ImportError:
        return False
    current = _PATCH_REGISTRATIONS.get(math.ceil)
    if current is None:
        return False
    if current in _OUR_CEIL_MODELS:
        return True

    def ceil_model(x, *rest):
        if type(x) is Fraction and not rest:
            return x.__ceil__()
        return current(x, *rest)

    _OUR_CEIL_MODELS.add(ceil_model)
    _PATCH_REGISTRATIONS[math.ceil] = ceil_model
    return True


def check_property(prop: CrossHairProperty, per_condition_timeout: float = DEFAULT_PER_CONDITION_TIMEOUT_S) -> dict:
    """Run CrossHair on one property *in this process*; return its record.

    ``{"name", "rules", "tool": "crosshair", "result", "seconds", "conditions"}``, where
    ``conditions`` lists ``{"line", "status": confirmed|refuted|unknown, "message"}``
    (``message`` holds CrossHair's counterexample for a refuted condition).
    """
    # deferred: CrossHair (and its Z3) is imported only to prove, in the checker processes
    from crosshair.core_and_libs import AnalysisKind, MessageType, analyze_function
    from crosshair.options import AnalysisOptionSet  # deferred: as above

    install_ceil_model()
    options = AnalysisOptionSet(
        analysis_kind=[AnalysisKind.PEP316],
        per_condition_timeout=per_condition_timeout,
        enabled=True,  # overrides the `# crosshair: off` of the broken functions
    )
    start = time.perf_counter()
    conditions = []
    try:
        for checkable in analyze_function(prop.fn, options):
            for msg in checkable.analyze():
                if msg.state == MessageType.CONFIRMED:
                    status = "confirmed"
                elif msg.state in (MessageType.POST_FAIL, MessageType.EXEC_ERR, MessageType.POST_ERR):
                    status = "refuted"
                else:
                    # CANNOT_CONFIRM: budget or path timeout; PRE_UNSAT: no input meets the
                    # preconditions (vacuous); SYNTAX_ERR / IMPORT_ERR: nothing was checked.
                    status = "unknown"
                conditions.append({"line": msg.line, "status": status, "message": msg.message})
    except Exception as exc:  # a CrossHair crash is "unknown", never a proof
        conditions.append({"line": 0, "status": "unknown", "message": f"crosshair crashed: {exc!r}"})
    statuses = [c["status"] for c in conditions]
    if "refuted" in statuses:
        result = "refuted"
    elif statuses and all(s == "confirmed" for s in statuses):
        result = "proved"
    else:
        result = "unknown"
    return proof_record(
        prop.name, prop.rules, "crosshair", result, round(time.perf_counter() - start, 3), conditions=conditions
    )
