"""``outrate conform`` before and around its checks: the environment is never the candidate's fault.

- ``version_notice``: on a vLLM release that is not supported (``spec/versions.py``), one
  warning line, printed once, first.
- ``preflight``: stock vLLM built in the gate's harness and a few steps of base fidelity
  (``adapter/environment.py``); on failure, one paragraph and exit 3 (no verdict, no
  counterexample files).
- ``unsupported_release_drift``: on an unsupported release, the drift hunt runs within the
  run (about a minute, ``DRIFT_BUDGET_S``) before any candidate row. A diverging V-rule stops
  the run with exit 3, naming the rule with its 1-minimal counterexample; otherwise the
  verdict line says ``on vLLM X.Y.Z, not a supported release; base model held in N scenarios``.
- ``stop_without_verdict``: what every no-verdict stop prints and writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape

from vllm_output_rate.adapter.environment import EXIT_NO_VERDICT, environment_paragraph, stock_preflight
from vllm_output_rate.adapter.versions import profile_and_warning

DRIFT_EXAMPLES = 150
"""Scenarios per drift hunt on an unsupported release (per mode, sync and async)."""
DRIFT_BUDGET_S = 60.0
"""Seconds after which the drift hunt starts no new round (a round under way finishes)."""


def version_notice(version: str) -> str | None:
    """The one warning line for an unsupported ``version`` (None if supported)."""
    return profile_and_warning(version)[1]


def stop_without_verdict(console: Any, paragraph: str, json_path: Path | None, settings: dict[str, Any]) -> int:
    """Print ``paragraph`` (the whole message, nothing else), write the JSON report if asked
    (``settings``, ``exit_code`` 3, no checks, ``no_verdict`` the paragraph), return 3."""
    console.print(escape(paragraph), soft_wrap=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        document = {**settings, "exit_code": EXIT_NO_VERDICT, "no_verdict": paragraph, "checks": []}
        json_path.write_text(json.dumps(document, indent=2))
    return EXIT_NO_VERDICT


def preflight(console: Any, run_base: Callable[..., Any] | None = None) -> str | None:
    """The stock preflight under a status line: None, or the no-verdict paragraph."""
    with console.status("building stock vLLM's scheduler in the gate's harness (a few base-fidelity steps)"):
        what = stock_preflight(run_base)
    return None if what is None else environment_paragraph(what)


def _drift(*args: Any, **kwargs: Any) -> Any:
    """``adapter.drift.drift`` (imported when an unsupported release needs it)."""
    # deferred: adapter.drift imports Hypothesis at its top; kept off `outrate --help`
    from vllm_output_rate.adapter.drift import drift

    return drift(*args, **kwargs)


def unsupported_release_drift(
    console: Any, version: str, drift_fn: Callable[..., Any] | None = None
) -> tuple[str | None, str | None]:
    """On an unsupported ``version``: ``(no-verdict paragraph or None, verdict-line clause or None)``.

    The drift hunt (``adapter/drift.py``) against the profile the release runs with; a
    diverging V-rule gives the paragraph (the rule, its failure and 1-minimal counterexample);
    none gives the clause ``on vLLM X.Y.Z, not a supported release; base model held in N
    scenarios``. A supported version gives ``(None, None)`` without hunting.
    """
    profile, warning = profile_and_warning(version)
    if warning is None:
        return None, None
    hunt = drift_fn if drift_fn is not None else _drift
    with console.status(f"vLLM {version} is not a supported release: hunting base-model drift first (about a minute)"):
        report = hunt(profile, version, warning, examples=DRIFT_EXAMPLES, time_budget_s=DRIFT_BUDGET_S)
    held = sum(report.examples.values())
    if report.found:
        first = report.found[0]
        rules = ", ".join(sorted({e.rule for e in report.found}))
        what = (
            f"vLLM {version} is not a supported release and its stock scheduler leaves the base model "
            f"({profile.version} rows) at {rules}: {first.rule} ({first.mode}) {first.failure}; "
            f"1-minimal counterexample: " + " | ".join(first.counterexample) + "."
        )
        return environment_paragraph(what), None
    clause = f"on vLLM {version}, not a supported release; base model held in {held} scenarios"
    return None, clause
