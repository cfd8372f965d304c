"""R13 preferred victims of the reference scheduler: throttled requests are preempted first.

``Victims`` is the scheduler's collaborator for the requests throttled at the step start
(R11, R14): for the duration of ``super().schedule()`` they sit at the end of ``running``
(FCFS victims are ``running[-1]``) and ``running`` is put back afterwards; under PRIORITY
a failed allocation of a running request first preempts a throttled request of vLLM's
victim priority level; with LoRA, the throttled holders of an adapter slot another user
needs are preempted at the step start.

Source: docs/SPEC.md R11, R13, R14.
"""

from __future__ import annotations

import operator
import time
from itertools import filterfalse
from typing import Any

from vllm.v1.request import RequestStatus

from vllm_output_rate.reference.residency import lora_id
from vllm_output_rate.reference.step_record import StepRecord

_REQUEST_ID = operator.attrgetter("request_id")


def decoding(r: Any) -> bool:
    """R10/R14: only the sampling position is left (a decoding stream), and its last output
    is not already in flight (V3)."""
    return (
        r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - 1
        and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
    )


class Victims:
    """R13: the preferred victims of one scheduler (``host``); ``base_allocate_slots``: the
    KV cache manager's own ``allocate_slots`` (PRIORITY only, see ``allocate_slots``)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.base_allocate_slots: Any = None

    def move_throttled_last(self, step: StepRecord, short: dict[str, int]) -> list[Any] | None:
        """R11, R13, R14: find the requests throttled at the step start and stable-move
        them to the end of ``running`` for the duration of vLLM's loops.

        ``short``: users whose grants at the step's clock reading (``Charging.survey``,
        exact) are fewer than their requests, with those grants. A user's *decoding*
        streams (only the sampling position left, R10; last output not already in
        flight, V3) beyond its grants, in its turn order (the host's ``_turn_order``), are
        throttled at the start: all of them if the user is refused (a refusal holds for the
        whole step, grants only push TAT up; no turn order needed), otherwise those whose
        turn it is not (``step.held``): the user's grants go to the others (R14). The
        running loop skips them anyway; the move changes only vLLM's victims (FCFS:
        ``running[-1]``; PRIORITY: see ``allocate_slots``). They are recorded as throttled
        (R11/R12) and their users for the wait hint (R16) even if the active cap stops the
        running loop before it reaches them. Returns the order before the move, or None if
        nothing moved. O(running).
        """
        host = self.host
        running = host.running
        limits = host._limits
        cache = limits.users
        if host.shortcuts:  # O(short users' streams), from the index kept with the turn order
            throttled, streams = host._turns.short_streams(short)
        else:
            throttled, streams = [], {}
            for r in running:
                user = cache.get(r.request_id) or limits.user(r)
                grants = short.get(user)
                if grants is None:
                    continue
                if grants:
                    streams.setdefault(user, []).append(r)
                elif decoding(r):
                    throttled.append(r)
        held: list[Any] = []
        for user, mine in streams.items():
            grants = short[user]
            in_turn = [r for r in host._turn_order(mine) if decoding(r)]
            if len(in_turn) > grants:
                held += in_turn[grants:]
        if held:
            step.held.update(map(_REQUEST_ID, held))  # R14: not its turn
            passed = set(held).union(throttled)
            throttled = list(filter(passed.__contains__, running))
        step.throttled_at_start = throttled
        ids = list(map(_REQUEST_ID, throttled))
        step.skipped_at_start = set(ids)
        step.throttled.update(ids)
        step.refused_users.update(map(cache.__getitem__, ids))
        if not throttled or running[-len(throttled) :] == throttled:
            return None
        stock_order = list(running)
        moved = set(throttled)
        running[:] = [*filterfalse(moved.__contains__, running), *throttled]
        return stock_order

    def restore_order(self, step: StepRecord, stock_order: list[Any]) -> None:
        """R13: put ``running`` back in the order vLLM alone would have left it.

        vLLM only removes (preempts) and appends (admits) during ``schedule()``; with no
        preemption in the step, ``running`` is the moved order followed by the admitted.
        """
        running = self.host.running
        if self.host.shortcuts and not step.left_running:
            running[:] = [*stock_order, *running[len(stock_order) :]]
            return
        present = set(running)
        before = set(stock_order)
        admitted = [r for r in running if r not in before]
        running[:] = [r for r in stock_order if r in present] + admitted

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """R13 under PRIORITY: before vLLM preempts, preempt a throttled request of its level.

        Replaces ``kv_cache_manager.allocate_slots`` (same arguments and result: the new
        blocks, None when they do not fit). vLLM's victim is the max (priority,
        arrival_time) of ``running``; when an allocation for a running request fails, a
        request throttled at the step start with that same priority (the latest arrival
        first) is preempted instead and the allocation retried. These requests sit after
        the running loop's position (``move_throttled_last``), so removing one does not
        disturb the loop. Waiting-loop allocations are not touched.
        """
        host = self.host
        new_blocks = self.base_allocate_slots(request, *args, **kwargs)
        while new_blocks is None and request.status == RequestStatus.RUNNING and host.running:
            level = max(r.priority for r in host.running)
            step = host._step
            candidates = [
                r
                for r in step.throttled_at_start
                if r.status == RequestStatus.RUNNING
                and r is not request
                and r.priority == level
                and host._request_blocks_can_be_freed(r)
            ]
            if not candidates:
                break
            victim = max(candidates, key=lambda r: r.arrival_time)
            host.running.remove(victim)
            host._preempt_request(victim, time.monotonic(), drop_stale_output=host.requires_kv_delivery)
            step.preempted_for_r13 = True
            new_blocks = self.base_allocate_slots(request, *args, **kwargs)
        return new_blocks

    def free_lora_slot(self, step: StepRecord, short: dict[str, int]) -> None:
        """R13, LoRA: preempt the throttled holders of an adapter slot another user needs.

        Spec ``rate.free_lora_slot``: with ``max_loras`` adapters in use by ``running``, the
        first waiting request (queue order) on another adapter whose user is granted now
        names the need; an adapter all of whose running requests were throttled at the
        step start, with their users refused (``short`` 0) and none of them the needing
        request's user, is freed: the one of the last such request in ``running`` order,
        its holders preempted last first (vLLM's ``_preempt_request``: blocks freed, back
        to the front of ``waiting``). vLLM's waiting loop then runs (these preemptions are
        not the running loop's, V7). O(running + waiting).
        """
        host = self.host
        in_use: dict[int, list[Any]] = {}
        for r in host.running:
            lora = lora_id(r)
            if lora:
                in_use.setdefault(lora, []).append(r)
        if len(in_use) < host.lora_config.max_loras:
            return
        user_of = host._limits.user
        needing = None
        for w in host.waiting:
            lora = lora_id(w)
            if lora and lora not in in_use and host._charging.grants_left(step, user_of(w)):
                needing = w
                break
        if needing is None:
            return
        needing_user = user_of(needing)
        at_start = {id(r) for r in step.throttled_at_start}

        def freeable(holders: list[Any]) -> bool:
            return all(id(r) in at_start and short.get(user_of(r)) == 0 and user_of(r) != needing_user for r in holders)

        candidates = [r for r in host.running if (lora := lora_id(r)) and freeable(in_use[lora])]
        if not candidates:
            return
        now = time.monotonic()
        for victim in reversed(in_use[lora_id(candidates[-1])]):
            host.running.remove(victim)
            host._preempt_request(victim, now, drop_stale_output=host.requires_kv_delivery)
