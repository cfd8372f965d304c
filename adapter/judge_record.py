"""What the scenario judge (``adapter/judge.py``) records of each step, from what vLLM
exposes: ``StepStart``, vLLM's requests before one ``schedule()``, and ``record``, the
step's black-box facts appended to the judge's ``records`` for naming a broken rule
(``adapter/attribution.py``).

Each function takes the judge ``j`` (its scenario, ``by_id``, ``start``, ``steps``,
``records``, ``aborted_in_flight``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_output_rate.adapter import attribution


@dataclass(frozen=True)
class StepStart:
    """vLLM's requests before one ``schedule()`` (``_Judge.before_step``): ``running`` in
    order; the unfinished requests with only their sampling position left
    (``decoding``), and those with a token still to dispatch (``demand``)."""

    running: list[str]
    decoding: set[str]
    demand: set[str]
    fresh: set[str] = field(default_factory=set)  # no output and no step in flight yet
    in_flight: set[str] = field(default_factory=set)  # a step still in flight (async placeholders)
    untouched: set[str] = field(default_factory=set)  # no token computed yet
    # FCFS: the first request of vLLM's ``waiting`` and the tokens its whole prompt still needs
    waiting_head: tuple[str, int] | None = None


def record(j: Any, trace) -> None:
    """Append this step's black-box facts to ``records`` (``adapter/attribution.py``)."""
    start = j.start
    fresh = start.fresh if start is not None else set()
    in_flight = start.in_flight if start is not None else set()
    decoding = start.decoding if start is not None else set()
    untouched = start.untouched if start is not None else set(j.by_id)
    demand = start.demand if start is not None else set()
    sampled = set(trace.sampled)
    admitted = set(trace.admitted)
    # A chunk starts the prompt where SchedulerOutput says it starts at token 0 (a
    # prefix-cache hit starts it above 0); without that field, where nothing was computed.
    starts = trace.chunk_start
    untouched = {rid for rid in trace.scheduled if starts.get(rid, 0 if rid in untouched else 1) == 0}
    j.records.append(
        attribution.StepRecord(
            j.steps,
            trace.now_ns,
            [
                attribution.Dispatch(rid, rid in fresh, rid in in_flight, rid in admitted, rid in untouched)
                for rid in trace.sampled
                if rid in j.by_id
            ],
            skipped=[
                rid
                for rid in j.by_id
                if rid in demand and rid not in sampled and (rid in decoding or rid in trace.preempted)
            ]
            + _blocked_head(j, trace),
            chunks=[rid for rid in trace.scheduled if rid in j.by_id and rid not in sampled and rid not in decoding],
            first_chunks=[rid for rid in trace.scheduled if rid in untouched and rid not in sampled],
            finished_in_flight=[
                rid for rid in trace.finished if rid in in_flight and rid in sampled and rid in j.by_id
            ],
            held=_held_at_n_minus_1(j, trace, fresh),
            aborted_in_flight=[rid for rid in j.aborted_in_flight if rid in j.by_id],
        )
    )


def _held_at_n_minus_1(j: Any, trace, fresh: set[str]) -> list[str]:
    """Requests with no output yet whose chunk ends exactly at ``prompt - 1`` in a step
    that left token budget: a final chunk held short of sampling (R10), so their user was
    asked at its charge point and refused."""
    budget = j.scenario.max_num_batched_tokens or 2048
    if sum(trace.scheduled.values()) >= budget:
        return []
    return [
        rid
        for rid, n in trace.scheduled.items()
        if rid in fresh
        and rid in j.by_id
        and rid not in trace.sampled
        and rid in trace.chunk_start
        and trace.chunk_start[rid] + n == j.by_id[rid].prompt_len - 1
    ]


def _blocked_head(j: Any, trace) -> list[str]:
    """The waiting request vLLM's waiting loop reached and could not admit, as a list
    (empty if none): FCFS, the first of ``waiting`` at the step start, not admitted, in a
    step that preempted nothing (vLLM then runs the waiting loop), left a seat free
    (``max_num_seqs``) and left token budget for its whole remaining prompt, so that its
    chunk would sample: its charge point (R7) came before the KV allocation that failed,
    and R9 refunds that charge."""
    head = j.start.waiting_head if j.start is not None else None
    if head is None or trace.preempted or head[0] not in j.by_id or head[0] in trace.scheduled:
        return []
    scenario = j.scenario
    if scenario.max_num_seqs is not None and trace.num_running >= scenario.max_num_seqs:
        return []
    budget = scenario.max_num_batched_tokens or 2048
    return [head[0]] if budget - sum(trace.scheduled.values()) >= head[1] else []
