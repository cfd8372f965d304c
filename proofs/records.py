"""The record every prover of ``proofs/`` returns for one property (``outrate prove``,
the gate's ``proofs/z3`` row, ``--json``): one format, built in one place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

RECORD_KEYS = ("name", "rules", "tool", "result", "seconds")
RESULTS = ("proved", "refuted", "unknown")


def proof_record(
    name: str, rules: Iterable[str], tool: str, result: str, seconds: float, **details: Any
) -> dict[str, Any]:
    """``{"name", "rules", "tool", "result", "seconds", **details}`` of one property:
    ``rules`` its rule ids, ``tool`` ``"z3"`` or ``"crosshair"``, ``result`` one of
    ``RESULTS``, ``seconds`` the time it took; ``details`` are the tool's own keys.

    Raises:
        ValueError: ``result`` is not one of ``RESULTS``.
    """
    if result not in RESULTS:
        raise ValueError(f"proof result {result!r} of {name}: expected one of {RESULTS}")
    return {"name": name, "rules": list(rules), "tool": tool, "result": result, "seconds": seconds, **details}
