"""R27-R29 for any candidate: a plan table whose entries free every user is stock vLLM.

The gate's row ``rate-tables/{sync,async}`` (level exact: the article has no rate table).
Each scenario keeps its own binding rates in ``output_rate`` and adds a rates file
(``output_rate.rates_file``, R21) with a plan table (docs/SPEC.md R27-R29) built from the
scenario's users by ``table_for``:

- the default is the plan ``slow`` (1 token/s: it binds at once), and every user has a
  decoy prefix pattern ``<first character>*`` on ``slow`` too;
- the entry that must win frees the user: its exact id (R27: an exact user wins over any
  prefix), or, for an id longer than one character, in turn, the longer pattern ``<id>*``
  (R27: the longest prefix wins), each on the unlimited plan ``internal`` (R28) or on the
  shadow plan ``trial`` at 1 token/s (R29: a shadow plan counts and throttles nothing).

So no user may ever be throttled, and the candidate must schedule exactly as stock vLLM's
``Scheduler`` / ``AsyncScheduler`` with no output-rate configuration, step for step
(``adapter.feature_off.first_difference``, as R19's ``not-binding`` row). A candidate that
resolves a user to a decoy, charges an unlimited user or enforces a shadow plan throttles
someone and differs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any

from vllm_output_rate.adapter.feature_off import PairedCheck, ample_or_pressured, verdict_against_stock
from vllm_output_rate.adapter.scenarios import Scenario, Verdict, spec_limiter_user

RULES = ("R27", "R28", "R29")


def table_for(scenario: Scenario) -> dict[str, Any]:
    """The rates file of ``scenario`` (module docstring): every user freed by its most
    specific entry, behind decoys on a 1 token/s plan."""
    users = sorted({spec_limiter_user(r.user) for r in scenario.requests})
    entries: dict[str, Any] = {}
    for i, user in enumerate(users):
        entries[f"{user[:1]}*"] = "slow"  # R27 decoy: a shorter prefix
        plan = "trial" if i % 2 else "internal"  # R29 shadow / R28 unlimited, in turn
        if len(user) > 1 and i % 4 >= 2:
            entries[f"{user}*"] = plan  # R27: the longest prefix wins over the decoy
        else:
            entries[user] = {"plan": plan}  # R27: the exact user wins over every prefix
    return {
        "default_plan": "slow",
        "plans": {
            "slow": {"tokens_per_s": 1},
            "trial": {"tokens_per_s": 1, "shadow": True},
            "internal": {"unlimited": True},
        },
        "users": entries,
    }


def run_rate_tables(scheduler_cls: str, scenario: Scenario, style: Any = None) -> Verdict:
    """R27-R29 (level exact): ``scenario`` with its binding rates plus the rates file
    ``table_for(scenario)`` on ``scheduler_cls``, against the same requests with no
    output-rate configuration on stock vLLM: identical batches, preemptions, admissions and
    finishes, step for step."""
    scenario = replace(scenario, feature_on=True)
    directory = tempfile.mkdtemp(prefix="outrate-tables-")
    try:
        path = os.path.join(directory, "rates.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(table_for(scenario), handle)
        return verdict_against_stock(
            scheduler_cls,
            scenario,
            style,
            "R27",
            "exact",
            lambda d: (
                f"with a rate table whose most specific entry puts every user on an unlimited (R28) or shadow "
                f"(R29) plan, behind decoy patterns and a default at 1 token/s (R27), {d.name} scheduled "
                f"{d.where} {d.field} {d.got!r} where stock vLLM {d.stock} has {d.want!r}: no user may be "
                f"throttled (table: {json.dumps(table_for(scenario)['users'])})"
            ),
            output_rate_extra={"rates_file": path},
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _unsupported(style: Any) -> str | None:
    if style is None or getattr(style, "name", None) == "additional-config":
        return None
    return (
        f'the rate table is configured as additional_config["output_rate"]["rates_file"]; '
        f"--config-style {style.name} cannot express it"
    )


#: R27-R29 (level exact): ``run_rate_tables`` on the gate's ample and pressured scenarios
#: with the feature on (their own rates binding); rows ``rate-tables/{sync,async}``.
check_rate_tables = PairedCheck(
    "rate-tables",
    RULES,
    "exact",
    ample_or_pressured,
    run_rate_tables,
    lambda scenario: scenario,
    unsupported=_unsupported,
)
