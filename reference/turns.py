"""R14/R15 turns of the reference scheduler: which of a user's streams get its grants.

``Turns`` is the scheduler's collaborator for R19's turn order: ``running`` is never
reordered (vLLM spends the token budget in its order), so a separate order of turns,
kept between steps and rebuilt only when it would change, decides which decoding streams
of a user whose grants do not cover them all get the grants (spec ``rate.turn_order``),
and R15 records the last-served stream of each (user, priority) group.

Source: docs/SPEC.md R14, R15, R19.
"""

from __future__ import annotations

import operator
from typing import Any

_REQUEST_ID = operator.attrgetter("request_id")
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")


class Turns:
    """R14/R15: the order of turns of one scheduler's (``host``) running requests.

    ``order``: request ids of running requests in the order of turns the last step left
    (the requests that left are removed as they leave; never the order of ``running``);
    ``pos``: its places, when asked (``position``); ``streams_of``: user -> running
    requests and ``running_place``: request -> place in ``running`` (``index_streams``);
    ``decoding_seen``: request -> ``num_computed_tokens`` when ``short_streams`` last found
    it decoding; ``group_last``: group key -> its last request id in ``order`` as built
    (R15: the last place); ``last_served``: group key -> request id (R15); ``shrunk``: a
    request left ``order`` since it was built (freed or preempted): rebuild it;
    ``running_after_step``: ``len(running)`` when the last ``schedule()`` returned (between
    steps vLLM only removes from ``running``, so a change says some request left);
    ``caught_up``: ``last_served`` holds every item of ``group_last`` (set only where that
    is made so, cleared wherever either changes otherwise).
    """

    def __init__(self, host: Any) -> None:
        self.host = host
        self.last_served: dict[str, str] = {}
        self.order: dict[str, None] = {}
        self.pos: dict[str, int] | None = None
        self.streams_of: dict[str, list[Any]] | None = None
        self.running_place: dict[Any, int] = {}
        self.decoding_seen: dict[Any, int] = {}
        self.group_last: dict[str, str] = {}
        self.shrunk = True
        self.running_after_step = -1
        self.caught_up = False

    def left(self, request_id: str) -> None:
        """R14: ``request_id`` left ``running`` (freed or preempted): only running requests take turns."""
        self.order.pop(request_id, None)
        self.shrunk = True
        self.pos = None
        self.caught_up = False

    def take(self) -> None:
        """R14: this step's turn order (spec ``rate.turn_order``), kept for the next step.

        The order the last step left (``order``), then the running requests new to it in
        ``running`` order; within it each (user, priority) group rotated within its own
        places so that the stream after the group's last-served one comes first. If the
        last-served stream is no longer running (or is already last), that group keeps its
        order. ``running`` itself is never reordered (R19). O(running); when that order is
        this step's (``hold``), it is kept as it is.
        """
        host = self.host
        if host.shortcuts and self.hold():
            return  # the same order: its places (position) and streams (streams_of) too
        self.pos = None
        turns, limits = self.order, host._limits
        cache = limits.groups
        base = [r for r in host.running if r.request_id in turns]
        if len(base) > 1:
            known = {r.request_id: r for r in base}
            base = [known[rid] for rid in turns if rid in known]
        base += [r for r in host.running if r.request_id not in turns]
        places: dict[str, list[int]] = {}
        for index, request in enumerate(base):
            key = cache.get(request.request_id)
            if key is None:
                limits.user(request)
                key = cache[request.request_id]
            places.setdefault(key, []).append(index)
        order = list(base)
        for key, slots in places.items():
            last = self.last_served.get(key)
            if last is None or len(slots) < 2:
                continue
            members = [base[i] for i in slots]
            pos = next((k for k, r in enumerate(members) if r.request_id == last), None)
            if pos is None or pos == len(members) - 1:
                continue
            for slot, request in zip(slots, members[pos + 1 :] + members[: pos + 1]):
                order[slot] = request
        turns = self.order = dict.fromkeys(map(_REQUEST_ID, order))
        self.group_last = dict(zip(map(cache.__getitem__, turns), turns))  # later places win: the last
        self.shrunk = self.caught_up = False
        self.streams_of = None

    def hold(self) -> bool:
        """R14: the order the last step left is this step's turn order, as ``take`` would
        build it: the same running requests, and no group's last-served stream (R15) is one
        of its running streams other than its last, so no group rotates.

        The same requests: none left (in a step only through ``_preempt_request``, which
        marks ``shrunk``; between steps ``running`` only shrinks, so its length is that of
        the last step's end) and none joined (``order`` as long as ``running``). O(1), and
        O(groups) in C; O(groups) in Python only while some group's last-served stream is
        not its last place."""
        turns, running = self.order, self.host.running
        if self.shrunk or not len(turns) == len(running) == self.running_after_step:
            return False
        if self.caught_up:
            return True  # every group's last-served stream is its last (O(1))
        last_served, group_last = self.last_served, self.group_last
        if group_last.items() <= last_served.items():
            self.caught_up = True
            return True  # every group's last-served stream is its last
        get = last_served.get
        return all((s := get(key)) is None or s == last or s not in turns for key, last in group_last.items())

    def index_streams(self) -> dict[str, list[Any]]:
        """R11/R14: each user's running requests in ``running`` order (``streams_of``) and
        each request's place in ``running`` (``running_place``), built when first asked
        after the turn order was built and kept while it holds (``running`` is then the
        same list in the same order: it changes only by preemption, admission and removal,
        each of which ends the hold)."""
        users = self.host._limits.users
        running = self.host.running
        streams: dict[str, list[Any]] = {}
        for r in running:
            streams.setdefault(users[r.request_id], []).append(r)
        self.streams_of = streams
        self.running_place = dict(zip(running, range(len(running))))
        self.decoding_seen = {}
        return streams

    def position(self) -> dict[str, int]:
        """R14/R15: request id -> place in this step's turn order (built when first asked
        after the order was built or a request left it)."""
        if self.pos is None:
            turns = self.order
            self.pos = dict(zip(turns, range(len(turns))))
        return self.pos

    def turn_order(self, streams: list[Any]) -> list[Any]:
        """R14: one user's running requests (``streams``, in ``running`` order) in this
        step's turn order (``take``)."""
        position = self.position()
        return sorted(streams, key=lambda r: position[r.request_id])

    def short_streams(self, short: dict[str, int]) -> tuple[list[Any], dict[str, list[Any]]]:
        """R11/R14: the refused users' decoding streams in ``running`` order, and the running
        requests of the other ``short`` users (user -> grants now; in ``running`` order, per
        user), from ``streams_of``.

        A stream found decoding in an earlier step of the same index whose
        ``num_computed_tokens`` has not moved since is still decoding: not scheduled since,
        so its prompt + outputs + placeholders and outputs + placeholders are unchanged (an
        output in flight that arrives adds a token and removes a placeholder); a preemption
        (the only way back, with the KV connectors refused) rebuilds the index."""
        streams_of = self.streams_of
        if streams_of is None:
            streams_of = self.index_streams()
        seen = self.decoding_seen.get
        throttled: list[Any] = []
        streams: dict[str, list[Any]] = {}
        refused = 0
        for user, grants in short.items():
            mine = streams_of.get(user)
            if mine is None:
                continue
            if grants:
                streams[user] = mine
            else:  # victims.decoding, inline, unless known from an earlier step
                throttled += [
                    r
                    for r in mine
                    if seen(r) == r.num_computed_tokens
                    or (
                        r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - 1
                        and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
                    )
                ]
                refused += 1
        if refused > 1:
            throttled.sort(key=self.running_place.__getitem__)
        self.decoding_seen.update(zip(throttled, map(_NUM_COMPUTED, throttled)))
        return throttled, streams

    def record_last_served(self, ids: list[str]) -> None:
        """R15: of this step's dispatched charges ``ids``, the one of each (user, priority)
        group that comes last in the step's turn order followed by the requests admitted
        in it (in ``running`` order) becomes the group's last served (spec
        ``rate.next_last_served``). When ``ids`` are exactly the turn order as built, that
        is each group's last place (``group_last``). O(ids log ids) in C."""
        if not ids:
            return
        turns, host = self.order, self.host
        if host.shortcuts and not self.shrunk and len(ids) == len(turns) and turns.keys() == set(ids):
            self.served_in_order()
            return
        self.caught_up = False
        position = self.position()
        ordered = sorted(filter(position.__contains__, ids), key=position.__getitem__)
        if len(ordered) < len(ids):  # admitted in this step: after every turn, in running order
            late = len(position)
            admitted = {r.request_id: late + i for i, r in enumerate(host.running) if r.request_id not in position}
            rest = [rid for rid in ids if rid not in position]
            ordered += sorted(rest, key=lambda rid: admitted.get(rid, late))
        groups = host._limits.groups
        self.last_served.update(zip(map(groups.__getitem__, ordered), ordered))  # later wins: the last

    def served_in_order(self) -> None:
        """R15: every stream of the turn order as built was served in this step: each
        group's last served is its last place (``group_last``). O(1) when it already is."""
        if not self.caught_up:
            self.last_served.update(self.group_last)
            self.caught_up = True

    def forget_finished(self, requests: Any) -> None:
        """R15: forget streams that left the scheduler (``requests``: those still in it;
        rotation ignores the others anyway), so ``last_served`` stays bounded."""
        self.last_served = {k: rid for k, rid in self.last_served.items() if rid in requests}
        self.caught_up = False
