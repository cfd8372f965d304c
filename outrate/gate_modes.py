"""``outrate conform``'s candidate mode matrix and warnings (issue 26 items 1 and 2).

Before the rows run, ``probe`` builds the candidate once per engine mode the planned rows
use (``adapter/modes.py``), marks the rows that need a refused mode not applicable, and
returns the ``modes`` row. After the run, ``mode_table`` prints the matrix and
``warning_clause`` names the warnings (project rules failed at level should,
``adapter/origins.py``) on the verdict line.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from vllm_output_rate.adapter.origins import WARNING, failed_rule

STATUS_STYLES = {"supported": "green", "refused": "yellow", "crashed": "bold red", "unavailable": "yellow"}


def probe(options: Any, planned: list[Any]) -> tuple[list[Any], Any, dict[str, str]]:
    """Probe the modes of ``planned`` (``gate_row.PlannedRow``s) for ``options``:
    ``(planned with refused modes' rows not applicable, the modes row, refused modes:
    name -> message)``, the last for ``adapter.modes.refusing`` around the run."""
    # deferred: these import Hypothesis at their top; kept off `outrate --help`
    from vllm_output_rate.adapter import gate_row, mode_probe, modes

    matrix = mode_probe.probe(options, gate_row.modes_used(planned))
    refused = modes.refused(matrix)
    return gate_row.apply_modes(planned, refused), gate_row.modes_result(matrix, options), refused


def mode_table(rows: list[dict[str, Any]]) -> Table:
    """The candidate mode matrix (the ``modes`` row's ``modes``): mode, what it is in vLLM,
    status, required, the message (the refusal, with the feature off too if so)."""
    table = Table(title="candidate mode matrix (built once per engine mode, feature on)")
    for col in ("mode", "vLLM", "status", "required", "message"):
        table.add_column(col, overflow="fold")
    for row in rows:
        message = row["message"]
        if row["refused_with_feature_off"]:
            message += f"; with the feature OFF too: {row['refused_with_feature_off']} (R18)"
        status = row["status"]
        table.add_row(
            row["mode"],
            row["what"],
            f"[{STATUS_STYLES[status]}]{status}[/]",
            "yes" if row["required"] else "-",
            message or "-",
        )
    return table


def warning_clause(results: list[Any]) -> str:
    """``N warning(s): row (rule), ...`` for the rows whose project rule failed at should,
    or "" when there are none."""
    warned = [r for r in results if r.result == WARNING]
    if not warned:
        return ""
    named = [f"{r.name} ({failed_rule(r.failure) or 'project rule'})" for r in warned]
    return f"{len(warned)} warning(s): {', '.join(named)}"


def not_applicable_clause(results: list[Any]) -> str:
    """``N not applicable (mode refused at start-up): row, ...`` or ""."""
    rows = [r.name for r in results if r.result == "not applicable"]
    return f"{len(rows)} not applicable (mode refused at start-up): {', '.join(rows)}" if rows else ""
