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
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False, init=False)
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
    ``unconstrained``: no user can be refused in this step (R2 survey); ``steady``: the
    survey found so in O(1) (``Charging.survey``); ``margin``: steps of the same charges
    the bounds of a full survey that found so cover (``Charging.commit``). ``grants`` /
    ``grants_at_start``: user -> grants left / at the survey (R2, tokens). ``taken``: user ->
    grants written to the limiter (the metrics' granted tokens). ``resident`` /
    ``resident_seen``: user -> running requests from the first waiting look, and
    ``len(running)`` when last brought up to date (R20). ``wait_hint_ns``: the earliest
    ready time among refused users, ns, None if none (R16).
    """

    now_ns: int
    charged: list[Any]
    charged_ids: list[str] | None
    refunded: list[str]
    refused_users: set[str]
    throttled: set[str]
    throttled_at_start: list[Any]
    skipped_at_start: set[str]
    held: set[str]
    turn_order: dict[str, None]
    scheduled_running: set[str]
    left_running: int
    preempted_for_r13: bool
    unconstrained: bool
    steady: bool
    margin: int
    grants: dict[str, int]
    grants_at_start: dict[str, int]
    taken: dict[str, int]
    resident: Counter | None
    resident_seen: int
    wait_hint_ns: int | None

    def __init__(self, now_ns: int) -> None:
        # Written out (no field factories): one record is made per schedule(), on the hot path.
        self.now_ns = now_ns
        self.charged = []
        self.charged_ids = None
        self.refunded = []
        self.refused_users = set()
        self.throttled = set()
        self.throttled_at_start = []
        self.skipped_at_start = set()
        self.held = set()
        self.turn_order = {}
        self.scheduled_running = set()
        self.left_running = 0
        self.preempted_for_r13 = self.unconstrained = self.steady = False
        self.margin = 0
        self.grants = {}
        self.grants_at_start = {}
        self.taken = {}
        self.resident = None
        self.resident_seen = 0
        self.wait_hint_ns = None
