"""Shadow mode (``output_rate.shadow: true``): count what would be throttled, throttle nothing.

docs/SPEC.md, Decision "Shadow mode". The scheduler runs exactly as with the feature off
(every override defers to vLLM's base class, R18), so its schedule is the base class's
step for step (the gate's ``shadow/{sync,async}`` check). After each base ``schedule()``,
``ShadowAccounting.step`` replays the step's sampling dispatches through a real GCRA
limiter (the same ``OutputRateLimiter``, the same rates and burst) at the step's one clock
reading (R16):

- a sampling dispatch (a request in the ``SchedulerOutput`` whose chunk is not a prefill
  chunk, the same test as the single refund point R9) of user u is *granted* while
  ``grants_at(u, now)`` allows (R2), and then charged (``take_counts``, R7);
- the rest of u's dispatches in the step are *would-be throttled*: the requests an
  enforcing scheduler would have refused (R11). Which of u's streams they are is taken
  in batch order (an enforcing scheduler chooses by R14's turns); their number is exact:
  the tokens above u's limit at the demand the engine actually served.

The shadow limiter is charged only for granted dispatches, so its TAT stays what an
enforcing limiter's would be at that demand (never more than tau ahead of the clock): a
user over its limit shows would-be throttles in every step it exceeds the limit, not a
debt that grows without bound.

Cost: one pass over the step's scheduled requests (a dict lookup each) and one limiter
question per user with dispatches; nothing on the base class's decision path. Memory:
request id -> user for the requests seen (pruned every ``PRUNE_INTERVAL_STEPS`` steps and
on every free), plus the limiter's TATs (R6 cleanup at the same cadence).

R29, per-plan shadow: with the feature on and a rate table whose plan says
``"shadow": true``, the enforcing limiter treats that plan's users as unlimited (R28) and
one ``ShadowAccounting`` with ``only_shadow_plans`` replays just their dispatches at the
plan's rate, after the enforcing ``schedule()``. It reads the step's output and never
writes scheduler state, so the enforced users' schedule cannot depend on it.

Source: issue 15 "Operators see and steer the limit", shadow mode; R29.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.section import OutputRateConfig

PRUNE_INTERVAL_STEPS = 256  # R6's cadence: cleanup of idle users and of forgotten request ids
logger = logging.getLogger(__name__)


class ShadowAccounting:
    """The shadow limiter of one scheduler (see module docstring).

    Args:
        config: the validated section (``config.shadow`` is True, or a table with shadow
            plans; rates, table and burst used).
        resolve_user: R17, request -> user, never raising (the scheduler's resolver).
        only_shadow_plans: R29: a ``RateTable``; only the users of its shadow plans are
            counted (the rest are enforced by the scheduler). None: everyone (shadow mode).
    """

    __slots__ = (
        "last_granted",
        "last_would",
        "limiter",
        "only_shadow_plans",
        "resolve_user",
        "step_dispatches",
        "steps",
        "users",
    )

    def __init__(
        self,
        config: OutputRateConfig,
        resolve_user: Callable[[Any], str],
        only_shadow_plans: Any = None,
        prepared: Any = None,
    ) -> None:
        # R27/R29: the table's rates, shadow plans at their own rate (shadow_view); ``prepared``:
        # the table's scales already built (``RateTable.prepare``), so nothing is built here.
        self.limiter = OutputRateLimiter(
            config.default_rate,
            config.user_rates,
            config.burst_ns,
            table=config.rate_table,
            shadow_view=True,
            prepared=prepared,
        )
        self.only_shadow_plans = only_shadow_plans  # R29: a RateTable; only its shadow plans' users count
        self.resolve_user = resolve_user
        self.users: dict[str, str] = {}  # request id -> user (R17, resolved once)
        self.steps = 0
        self.last_granted: list[str] = []  # request ids granted in the last step, in batch order
        self.last_would: list[str] = []  # request ids that would have been throttled in the last step
        self.step_dispatches: dict[str, int] = {}  # user -> sampling dispatches in the last step (all granted)

    def user(self, request_id: str, requests: Mapping[str, Any]) -> str | None:
        """The user of a request (resolved and cached on first sight), None if unknown."""
        user = self.users.get(request_id)
        if user is None:
            request = requests.get(request_id)
            if request is None:
                return None
            user = self.users[request_id] = self.resolve_user(request)
        return user

    def step(self, now_ns: int, scheduler_output: Any, requests: Mapping[str, Any]) -> list[str]:
        """Account one base ``schedule()`` at ``now_ns``; return the would-be throttled ids.

        ``requests``: the scheduler's request id -> ``Request`` map (after the step).
        """
        granted: list[str] = []
        would: list[str] = []
        per_user: dict[str, list[str]] = {}
        users = self.users
        only = self.only_shadow_plans
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.is_prefill_chunk:
                continue  # R7: a chunk that does not sample is not charged
            user = users.get(rid)
            if user is None:
                user = users[rid] = self.resolve_user(request)
            if only is not None and not only.lookup(user).shadow:
                continue  # R29: an enforced user; the scheduler decided its dispatches
            mine = per_user.get(user)
            if mine is None:
                per_user[user] = [rid]
            else:
                mine.append(rid)
        limiter = self.limiter
        takes: dict[str, int] = {}
        for user, ids in per_user.items():
            grants = limiter.grants_at(user, now_ns)  # R2 at the step's clock reading
            if grants >= len(ids):
                granted += ids
                takes[user] = len(ids)
                continue
            if grants:
                takes[user] = grants
                granted += ids[:grants]
            would += ids[grants:]
        if takes:
            limiter.take_counts(takes, now_ns)
        self.last_granted, self.last_would = granted, would
        self.step_dispatches = {user: len(ids) for user, ids in per_user.items()}
        self.steps += 1
        if self.steps % PRUNE_INTERVAL_STEPS == 0:
            limiter.cleanup_idle_users(now_ns)  # R6
            if len(users) > len(requests):
                self.users = {rid: u for rid, u in users.items() if rid in requests}
        return would

    def freed(self, request_id: str) -> None:
        """A request left the scheduler: forget its user."""
        self.users.pop(request_id, None)
