"""``StepRecord``: what one ``schedule()`` of the reference scheduler decided, step by step.

The reference's mirror of the spec's ``Cycle`` (``spec/state.py``): the step's one clock
reading (R16), the charges in charge order (R7), the refunds of the single refund point
(R9), the users refused and the requests throttled (R11), the preferred victims (R13),
the turn order (R14) and the wait hint (R16). A new record is made at the start of each
``schedule()`` (``_RateLimitMixin._reset_step_state``); the collaborators (``charging``,
``turns``, ``victims``, ``residency``, ``engine_wait``, ``observation``) write their part
of it, and the last step's record is what the white-box observation reads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class StepRecord:
    """One step's decisions (spec ``state.Cycle``, rate-limit part).

    ``now_ns``: the step's one clock reading, ns (R16). ``charged``: requests charged at
    dispatch, in charge order (R7); ``charged_ids``: their ids once computed.
    ``refunded``: ids refunded by the single refund point (R9). ``refused_users``: users
    refused in this step, not asked again (R10/R11, the wait hint R16). ``throttled``:
    running requests refused and skipped (R11). ``throttled_at_start``: the preferred
    victims, in ``running`` order (R13); ``skipped_at_start``: their ids (the hook refuses
    them at once). ``held``: throttled at the start although the user has grants, not
    their turn (R14). ``turn_order``: request ids in R14's order of turns (the turns
    collaborator's dict, not a copy). ``scheduled_running``: running requests given tokens
    (R12). ``left_running``: requests preempted in this step. ``preempted_for_r13``: the
    step preempted a throttled victim, so the waiting loop admits nothing (R13).
    ``unconstrained``: no user can be refused in this step (R2 survey). ``grants`` /
    ``grants_at_start``: user -> grants left / at the survey (R2, tokens). ``taken``: user ->
    grants written to the limiter (the metrics' granted tokens). ``resident`` /
    ``resident_seen``: user -> running requests from the first waiting look, and
    ``len(running)`` when last brought up to date (R20). ``wait_hint_ns``: the earliest
    ready time among refused users, ns, None if none (R16).
    """

    now_ns: int
    charged: list[Any] = field(default_factory=list)
    charged_ids: list[str] | None = None
    refunded: list[str] = field(default_factory=list)
    refused_users: set[str] = field(default_factory=set)
    throttled: set[str] = field(default_factory=set)
    throttled_at_start: list[Any] = field(default_factory=list)
    skipped_at_start: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    turn_order: dict[str, None] = field(default_factory=dict)
    scheduled_running: set[str] = field(default_factory=set)
    left_running: int = 0
    preempted_for_r13: bool = False
    unconstrained: bool = False
    grants: dict[str, int] = field(default_factory=dict)
    grants_at_start: dict[str, int] = field(default_factory=dict)
    taken: dict[str, int] = field(default_factory=dict)
    resident: Counter | None = None
    resident_seen: int = 0
    wait_hint_ns: int | None = None
