"""Charging of the reference scheduler: R2 grants per step, R7 charge at dispatch, R9 refund.

``Charging`` is the scheduler's collaborator for the limiter's side of a step: the survey
of every user's grants at the step's clock reading (R2, once per user), the refusal of a
sampling chunk (R10/R11), the write of the step's charges to the limiter in one operation
(R2/R7), and the single refund point (R9) that refunds every charge whose request was not
dispatched to sample. The charges themselves are recorded in the step's ``StepRecord`` by
the scheduler's hook (``_RateLimitMixin._reserve_prefill_lookahead``).

Source: docs/SPEC.md R2, R4, R7, R9-R11.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Mapping
from typing import Any

from vllm.v1.request import RequestStatus

from vllm_output_rate.reference.step_record import StepRecord

_RUNNING = RequestStatus.RUNNING
_REQUEST_ID = operator.attrgetter("request_id")
_IS_PREFILL_CHUNK = operator.attrgetter("is_prefill_chunk")


class Charging:
    """R2, R7, R9: grants, charges and refunds of one scheduler (``host``).

    ``spare``: user -> grants at the clock reading of the last full survey (a lower bound
    there), of which ``spare_steps`` steps have each taken ``spare_taken`` since:
    ``spare - spare_steps x spare_taken`` is a lower bound on ``grants_at(user, now)`` for
    every later now (``survey``). ``margin``: while those steps each charged every request
    of the scheduler (``spare_taken`` is then user -> its requests), how many such steps
    ``spare`` covers for every user (the O(1) survey); 0 otherwise. ``spare_version``: the
    ``UserLimits.requests_version`` at which ``spare_taken`` was a copy of ``user_requests``
    (-1: it is not), so the O(1) survey compares the two in O(1).
    The per-step allowances live in the ``StepRecord``.
    """

    def __init__(self, host: Any) -> None:
        self.host = host
        self.forget_spare()

    def forget_spare(self) -> None:
        """R21: the spare-grant bounds were for the old rates (or the TATs changed)."""
        self.spare: dict[str, int] = {}
        self.spare_taken: dict[str, int] = {}
        self.spare_steps = 0
        self.spare_version = -1
        self.margin = 0

    def survey(self, step: StepRecord) -> tuple[bool, dict[str, int]]:
        """R2 at the step's clock reading, once per user with requests in the scheduler.

        Returns ``(enough, short)``: ``enough`` if every user can be granted one token
        per request it has (each request is charged at most once per step, R7, so then no
        user is refused in this step and the hook only records charges); ``short``, the
        users granted fewer tokens now than they have requests, with their exact grants
        (0: refused; R13, R14, R16). The limiter is asked only for users whose
        spare grants from the last steps do not cover their requests: spare grants at an
        earlier clock reading are a lower bound now, as grants only grow with time and
        with refunds. Seeds this step's allowances (``step.grants``) with the result: exact
        where the limiter was asked, otherwise a lower bound that the user's requests
        cannot use up in one step. O(users); O(1) (in Python) in a steady step (``margin``).
        """
        host = self.host
        limits = host._limits
        requests_of = limits.user_requests
        if (
            self.spare_steps < self.margin
            and host._hook_fast
            and host.shortcuts
            and self.spare_version == limits.requests_version  # spare_taken == requests_of
        ):
            # R2: the same requests as in each step since the last full survey, every one
            # charged in each, and ``spare`` covers one more such step for every user: the
            # loop below would find every user covered by its spare grants (``margin``).
            step.steady = True
            return True, {}
        spare, taken, steps = self.spare, self.spare_taken, self.spare_steps
        limiter, now = host.rate_limiter, step.now_ns
        assert limiter is not None, "called by schedule() with the feature on"
        bound: dict[str, int] = {}
        short: dict[str, int] = {}
        for user, requests in requests_of.items():
            grants = spare.get(user, 0) - steps * taken.get(user, 0)
            if grants < requests:
                grants = limiter.grants_at(user, now)
                if grants < requests:
                    short[user] = grants
            bound[user] = grants
        step.grants_at_start = bound
        step.grants = dict(bound)
        if short:
            return False, short
        # Steps of the same charges ``bound`` covers for every user (>= 1 here).
        step.margin = min(map(operator.floordiv, bound.values(), requests_of.values()), default=0)
        return True, short

    def grants_left(self, step: StepRecord, user: str) -> int:
        """R2: grants ``user`` may still receive in this step (the limiter asked once per step)."""
        left = step.grants.get(user)
        if left is None:
            limiter = self.host.rate_limiter
            assert limiter is not None, "the hooks ask for grants with the feature on only"
            left = step.grants[user] = step.grants_at_start[user] = limiter.grants_at(user, step.now_ns)
        return left

    def refuse(
        self, step: StepRecord, request: Any, user: str, num_computed_tokens: int, num_new_tokens: int, end: int
    ) -> int:
        """R10/R11: ``user`` is refused; advance a prefill to n-1 (tokens) or skip the request (0)."""
        step.refused_users.add(user)
        # R10: with chunked prefill, advance to the position just before sampling.
        capped = end - 1 - num_computed_tokens
        if capped <= 0 or not self.host.scheduler_config.enable_chunked_prefill:
            if request.status is _RUNNING:
                step.throttled.add(request.request_id)  # R11: skip, keep resident
            return 0
        return min(num_new_tokens, capped)

    def commit(self, step: StepRecord) -> None:
        """R2/R7: write this step's charges to the limiter in one ``take_counts`` (in a
        steady step, ``take_steady``: the same counts as the last step, O(1) here).

        Equal to one ``try_take`` per charge at the step's clock reading (``limiter.py``).
        Also keeps, per user, a lower bound on the grants left at this clock reading
        (``survey``).
        """
        limiter, now = self.host.rate_limiter, step.now_ns
        assert limiter is not None, "called by schedule() with the feature on"
        if step.unconstrained:
            limits = self.host._limits
            if len(step.charged) == len(limits.users):  # every request charged (once, R7): its user's count
                if step.steady:
                    self.commit_steady(step)
                    return
                counted = dict(limits.user_requests)
                self.spare, self.spare_taken, self.spare_steps = step.grants_at_start, counted, 1
                self.spare_version = limits.requests_version
                self.margin = step.margin
            else:
                ids = step.charged_ids = list(map(_REQUEST_ID, step.charged))
                counted = Counter(map(limits.users.__getitem__, ids))
                if step.steady:  # the bounds the O(1) survey stood on, as the loop would have made them
                    spare, taken, steps = self.spare, self.spare_taken, self.spare_steps
                    step.grants_at_start = {u: spare.get(u, 0) - steps * n for u, n in taken.items()}
                self.spare, self.spare_taken, self.spare_steps = step.grants_at_start, counted, 1
                self.spare_version, self.margin = -1, 0
            limiter.take_counts(counted, now)
            step.taken = counted  # the metrics' granted tokens (reference/metrics.py)
            return
        left = step.grants
        taken = {u: n - left[u] for u, n in step.grants_at_start.items() if n > left[u]}
        limiter.take_counts(taken, now)
        self.spare, self.spare_taken, self.spare_steps, self.margin = left, {}, 0, 0
        self.spare_version = -1
        step.taken = taken  # the metrics' granted tokens (reference/metrics.py)

    def commit_steady(self, step: StepRecord) -> None:
        """R2/R7: ``commit`` of a steady step in which every request was charged: the same
        counts (the same object) as the steps since the last full survey, ``take_steady``."""
        limiter = self.host.rate_limiter
        assert limiter is not None, "called by schedule() with the feature on"
        counted = step.taken = self.spare_taken  # the metrics' granted tokens (reference/metrics.py)
        self.spare_steps += 1
        limiter.take_steady(counted, step.now_ns)

    def settle(self, step: StepRecord, scheduler_output: Any) -> list[str]:
        """R9: the single refund point; R15: record the last-served stream per group.

        Every charge of ``step`` whose request is not in ``scheduler_output`` with a chunk
        that samples is refunded (``limiter.refund``, R4). Returns the refunded request ids,
        in charge order.
        """
        host = self.host
        scheduled = scheduler_output.num_scheduled_tokens
        charged = step.charged
        if self.all_served(step, scheduled) and (host._hook_charges_sample or not any(map(_IS_PREFILL_CHUNK, charged))):
            # R9: every charge dispatched, none as a prefill chunk: in an unconstrained step
            # our own hook charged a chunk only where computed + new reached prompt + outputs
            # + placeholders, which is vLLM's is_prefill_chunk (False) of the chunk it
            # dispatched, as it is the last cap on num_new_tokens (tests/test_shortcuts.py).
            host._turns.served_in_order()  # R15: each group's last place
            return []
        ids = step.charged_ids
        if ids is None:
            ids = list(map(_REQUEST_ID, charged))
        if all(map(scheduled.__contains__, ids)) and not any(map(_IS_PREFILL_CHUNK, charged)):
            # Every charge was dispatched to sample (the usual step): nothing to refund.
            host._record_last_served(ids)
            return []
        refunded = []
        served = []
        limits, limiter = host._limits, host.rate_limiter
        cache = limits.users
        assert limiter is not None, "called by schedule() with the feature on"
        for request in charged:
            rid = request.request_id
            user = cache.get(rid) or limits.user(request)
            if rid in scheduled and not request.is_prefill_chunk:
                served.append(rid)
            else:
                limiter.refund(user)  # R4/R9
                refunded.append(rid)
        host._record_last_served(served)
        return refunded

    def all_served(self, step: StepRecord, scheduled: Mapping[str, int]) -> bool:
        """R9/R15 in O(1): every request in the scheduler was charged in this unconstrained
        step and each one is in ``scheduled``, and they are this step's turn order as built.

        The charges are distinct requests of the scheduler (R7: at most one per request per
        step), so as many charges as requests means every request; with no preemption and
        as many running requests as turns, nothing joined or left, so ``running`` holds them
        all and ``scheduled`` (a subset of ``running``) as many is all of them."""
        host = self.host
        turns = host._turns
        return (
            host.shortcuts
            and step.unconstrained
            and not step.left_running
            and not turns.shrunk
            and len(step.charged) == len(host._limits.users) == len(host.running) == len(turns.order) == len(scheduled)
        )
