"""The scenario judge's (``adapter/judge.py``) white-box checks at level exact, on the
candidate's ``last_step_observation`` (docs/OBSERVATION.md): charges minus refunds equal
sampling dispatches (R7, R9), refunds only of this step's charges, once (R9), throttled
never scheduled (R11), scheduled running requests <= max_num_active_seqs (R12), every
user's TAT equal to the spec limiter's replay (R1-R6), and the wait hint the earliest ready
time (R16).

Each function takes the judge ``j`` (its scenario, ``state``, ``by_id``, ``user_of``).
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import properties as spec_properties


def white_box_failure(j: Any, trace) -> tuple[str, str, str] | None:
    """The first white-box failure of the step as (rule, "exact", message), or None (also
    when the candidate exposes no observation)."""
    if trace.white is None:
        return None
    failure = _white_box_checks(j, trace)
    return (failure[0], "exact", failure[1]) if failure else None


def _white_box_checks(j: Any, trace) -> tuple[str, str] | None:
    white, now = trace.white, trace.now_ns
    charged, refunded, sampled = white["charged"], white["refunded"], set(trace.sampled)
    refund_error = spec_properties.charge_refund_error(charged, refunded, sampled)
    if refund_error is not None:
        return refund_error
    charged_chunks = (set(refunded) & set(trace.scheduled)) - sampled
    if charged_chunks:
        return "R7", (
            f"{sorted(charged_chunks)} charged (then refunded) for a step in which they are "
            "scheduled but do not sample: a prompt chunk was charged"
        )
    accounting = spec_properties.accounting_error(charged, refunded, sampled)
    if accounting is not None:
        return accounting
    throttled_scheduled = set(white["throttled"]) & set(trace.scheduled)
    if throttled_scheduled:
        return "R11", f"throttled requests {sorted(throttled_scheduled)} were scheduled"
    active_cap = j.scenario.max_num_active_seqs or j.scenario.max_num_seqs or len(j.by_id)
    scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
    if len(scheduled_running) > active_cap:
        return "R12", f"{len(scheduled_running)} running requests scheduled > max_num_active_seqs {active_cap}"
    expected = {u: t for u, t in j.state.tat_ns.items() if t > now}
    got = {u: t for u, t in white["tat_ns"].items() if t > now}
    if expected != got:
        return "R1", f"limiter state {_fmt_tats(got)} differs from the spec's {_fmt_tats(expected)}"
    hint = white["wait_hint_ns"]
    if hint is not None:
        ready = {u: spec_limiter.ready_at_ns(j.state, u) for u in j.state.tat_ns}
        throttled_users = {j.user_of(r) for r in white["throttled"] if r in j.by_id}
        if hint not in ready.values() or any(ready.get(u) is not None and hint > ready[u] for u in throttled_users):
            return "R16", (
                f"wait hint {hint} ns is not the earliest ready time of the refused users (spec ready_at: {ready})"
            )
    return None


def _fmt_tats(tats) -> str:
    return "{" + ", ".join(f"{u}: {float(t) / 1e6:.3f} ms" for u, t in sorted(tats.items())) + "}"
