"""One user budget across engines through Redis or Valkey (rules R23-R26).

``SharedBudgetLimiter`` is the reference limiter (R1-R6 per engine, ``OutputRateLimiter``)
with, on top of it, the lease protocol of ``spec/shared_budget.py``: a sampling dispatch
needs a local grant *and* one grant leased from the user's shared GCRA in the store.

* R23: each store operation is one Lua script, so one atomic round trip: ``LEASE`` takes
  ``n = min(L, grants at now)`` grants and advances the TAT by ``n x T``; ``RETURN`` gives
  back unused grants of a live lease record (``TAT := max(TAT - u x T, now)``) and deletes
  it. ``now`` is the store's ``TIME``, never the engine's clock. TATs are integer ns
  relative to a per-user base second kept with them (exact in Lua's doubles); ``T`` is
  the emission interval rounded *up* to an integer ns (a slightly lower rate, never a
  higher one).
* ``schedule()`` never waits on the network: ``grants_at``/``take_counts``/``refund`` only
  read and change the grants this engine holds, under a lock. A background thread
  (``_refill``) leases ahead of need for every user asked about recently (R24: while it
  holds fewer than L, unconfirmed returns counted, one request at a time) and returns the
  grants of users idle for ``IDLE_RETURN_NS``.
* R25: a store call that fails or takes longer than ``STORE_TIMEOUT_NS`` is abandoned; no
  lease is taken, held grants are spent until their deadline, then the user is throttled;
  the thread keeps trying every refill period and recovers when the store answers.
* R26: the engine id is a new random incarnation per process; the first lease is taken
  only ``STARTUP_HOLD_NS`` after start; an engine spends a lease only until
  ``LEASE_TTL_NS`` after it sent the request.

Configured by one setting, ``output_rate.shared_budget_url`` (``redis://``, ``rediss://``,
``unix://`` or ``valkey://``), see ``reference/config.py``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec.limiter import BURST_NS, NS_PER_S
from vllm_output_rate.spec.shared_budget import (
    LEASE_TTL_NS,
    REFILL_PERIOD_NS,
    STARTUP_HOLD_NS,
    STORE_TIMEOUT_NS,
    holding_cap,
    lease_size,
)

logger = logging.getLogger("vllm_output_rate.shared_budget")

KEY_PREFIX = "outrate:"
IDLE_RETURN_NS: int = 500_000_000  # a user not asked about for this long gives its grants back
DEMAND_NS: int = 2_000_000_000  # a user asked about within this long is kept supplied

# R23: one atomic lease. KEYS[1]: the user's hash. ARGV: T ns, tau ns, want, ttl ms, engine.
LEASE_LUA = """
local t = redis.call('TIME')
local sec, usec = tonumber(t[1]), tonumber(t[2])
local key = KEYS[1]
local base = tonumber(redis.call('HGET', key, 'base'))
local tat = tonumber(redis.call('HGET', key, 'tat'))
if base == nil then base = sec; tat = nil end
if sec - base > 86400 then
  if tat ~= nil then tat = tat - (sec - base) * 1000000000 end
  base = sec
end
local now = (sec - base) * 1000000000 + usec * 1000
if tat == nil or tat < now then tat = now end
local T, tau, want, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local lead = tat - now
local n = 0
if lead <= tau then n = math.floor((tau - lead) / T) + 1 end
if n > want then n = want end
while n > 0 and lead + (n - 1) * T > tau do n = n - 1 end
if n < 1 then return {0, 0} end
tat = tat + n * T
local id = redis.call('HINCRBY', key, 'seq', 1)
redis.call('HSET', key, 'base', base, 'tat', string.format('%.0f', tat))
redis.call('SET', key .. ':lease:' .. id, ARGV[5] .. ' ' .. n, 'PX', ttl)
redis.call('PEXPIRE', key, math.floor((tat - now) / 1000000) + ttl + 60000)
return {n, id}
"""

# R23: one atomic return. KEYS[1]: the user's hash, KEYS[2]: the lease record. ARGV: T ns,
# unused grants, engine. Returns the grants given back (0: record not live or not ours).
RETURN_LUA = """
local rec = redis.call('GET', KEYS[2])
if not rec then return 0 end
local sp = string.find(rec, ' ', 1, true)
if string.sub(rec, 1, sp - 1) ~= ARGV[3] then return 0 end
local n = tonumber(string.sub(rec, sp + 1))
redis.call('DEL', KEYS[2])
local u = tonumber(ARGV[2])
if u > n then u = n end
local base = tonumber(redis.call('HGET', KEYS[1], 'base'))
local tat = tonumber(redis.call('HGET', KEYS[1], 'tat'))
if base == nil or tat == nil or u < 1 then return u end
local t = redis.call('TIME')
local now = (tonumber(t[1]) - base) * 1000000000 + tonumber(t[2]) * 1000
tat = tat - u * tonumber(ARGV[1])
if tat < now then tat = now end
redis.call('HSET', KEYS[1], 'tat', string.format('%.0f', tat))
return u
"""


def user_key(user: str) -> str:
    """The store key of ``user``'s shared GCRA (a hash tag keeps its lease records in the
    same cluster slot)."""
    return f"{KEY_PREFIX}{{{user}}}"


class _UserLeases:
    """What this engine holds of one user's shared budget (spec ``Holding``)."""

    __slots__ = ("grants", "in_flight", "last_asked_ns", "overdraft", "returning")

    def __init__(self) -> None:
        self.grants: dict[int, list[int]] = {}  # lease id -> [grants left, deadline ns]
        self.in_flight = False
        self.returning = 0
        self.last_asked_ns = 0
        self.overdraft = 0  # grants spent beyond holdings by a race with expiry (paid first)

    def spendable(self, now_ns: int) -> int:
        return max(sum(g for g, deadline in self.grants.values() if deadline > now_ns) - self.overdraft, 0)


class SharedBudgetLimiter(OutputRateLimiter):
    """``OutputRateLimiter`` whose grants are also bounded by leases from a shared store.

    Args:
        default_rate_tokens_per_s, user_rates_tokens_per_s, burst_ns: as ``OutputRateLimiter``.
        url: the store (``redis://host:port/db``, ``rediss://``, ``unix://``, ``valkey://``).
        client: a ready ``redis.Redis`` (tests); built from ``url`` when None.
        clock_ns: the engine's monotonic clock (ns); lease deadlines and the refill use it.
        start_thread: start the refill thread (tests may drive ``refill_once`` themselves).
    Raises:
        ValueError: a bad rate or burst (``OutputRateLimiter``), or a URL redis cannot parse.
        ImportError: the ``redis`` package is missing.
    R23-R26.
    """

    def __init__(
        self,
        default_rate_tokens_per_s: object,
        user_rates_tokens_per_s: Mapping[str, object] | None = None,
        burst_ns: int = BURST_NS,
        *,
        url: str,
        client: Any = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        start_thread: bool = True,
    ) -> None:
        super().__init__(default_rate_tokens_per_s, user_rates_tokens_per_s, burst_ns)
        import redis  # deferred: the store client (redis), only needed with the feature configured

        url = "redis://" + url[len("valkey://") :] if url.startswith("valkey://") else url
        timeout_s = STORE_TIMEOUT_NS / NS_PER_S
        self._client: Any = (
            client
            if client is not None
            else redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
            )
        )
        self._lease = self._client.register_script(LEASE_LUA)
        self._return = self._client.register_script(RETURN_LUA)
        self.url = url
        self.engine_id = uuid.uuid4().hex  # R26: a new incarnation per process
        self._clock = clock_ns
        self._started_ns = clock_ns()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._users: dict[str, _UserLeases] = {}
        self._pending_return: dict[tuple[str, int], int] = {}  # (user, lease id) -> grants sent back
        self._forget_later: list[tuple[int, str, int, int]] = []  # unconfirmed returns: (due, user, id, grants)
        self.store_ok = True  # R25: the last store call succeeded
        self.round_trips = 0  # store round trips made (bench)
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="outrate-shared-budget", daemon=True)
            self._thread.start()

    # -- rate constants ----------------------------------------------------------------
    def emission_ns(self, user: str) -> int:
        """R23: the user's emission interval in whole ns, rounded up (never a higher rate)."""
        rate = self.rate_of(user)
        assert rate is not None, f"R28: unlimited user {user!r} has no emission interval"
        return math.ceil(Fraction(NS_PER_S) / rate)

    def lease_grants(self, user: str) -> int:
        """R24: the user's lease size L."""
        rate = self.rate_of(user)
        assert rate is not None, f"R28: unlimited user {user!r} takes no lease"
        return lease_size(rate)

    # -- the hot path (no network) -------------------------------------------------------
    def _leases(self, user: str, now_ns: int) -> _UserLeases:
        held = self._users.get(user)
        if held is None:
            held = self._users[user] = _UserLeases()
            self._wake.set()  # a new user: lease now rather than at the next period
        held.last_asked_ns = now_ns
        return held

    def shared_available(self, user: str) -> int:
        """R24: grants this engine holds for ``user`` now (unexpired leases)."""
        with self._lock:
            held = self._users.get(user)
            return 0 if held is None else held.spendable(self._clock())

    def grants_at(self, user: str, now_ns: int) -> int:
        """R2 and R24: ``min(local grants, shared grants held)``; marks the user as in demand."""
        local = super().grants_at(user, now_ns)
        with self._lock:
            shared = self._leases(user, self._clock()).spendable(self._clock())
        return min(local, shared)

    def allows(self, user: str, now_ns: int) -> bool:
        """R2 and R24: a grant is possible now, locally and from the shared leases."""
        return self.grants_at(user, now_ns) > 0

    def try_take(self, user: str, now_ns: int) -> bool:
        """R2 and R24: one local grant and one shared grant, or nothing."""
        if self.grants_at(user, now_ns) < 1:
            return False
        self.take_counts({user: 1}, now_ns)
        return True

    def take_counts(self, counts: Mapping[str, int], now_ns: int) -> None:
        """R2 and R24: the local charges, and one shared grant spent per charge, from the
        lease that expires first. A charge no lease covers (a lease expired within this
        ``schedule()``) is an overdraft paid by the next lease's first grants."""
        super().take_counts(counts, now_ns)
        with self._lock:
            wall = self._clock()
            for user, count in counts.items():
                held = self._leases(user, wall)
                for lease_id in sorted(held.grants, key=lambda i: held.grants[i][1]):
                    entry = held.grants[lease_id]
                    if entry[1] <= wall or count == 0:
                        continue
                    used = min(entry[0], count)
                    entry[0] -= used
                    count -= used
                held.overdraft += count
                held.grants = {i: g for i, g in held.grants.items() if g[0] > 0 and g[1] > wall}

    def refund(self, user: str) -> None:
        """R4 and R24: undo one charge: the local TAT, and one shared grant back to the
        lease that expires last (lost if every lease expired)."""
        super().refund(user)
        with self._lock:
            held = self._users.get(user)
            if held is None:
                return
            if held.overdraft:
                held.overdraft -= 1
                return
            wall = self._clock()
            live = [i for i, g in held.grants.items() if g[1] > wall]
            if live:
                held.grants[max(live, key=lambda i: held.grants[i][1])][0] += 1
            else:
                self._add_lease(held, -1, 1, wall + REFILL_PERIOD_NS)

    def ready_at_ns(self, user: str) -> int | None:
        """R5 and R16: the local ready time; without shared grants, no later than one refill
        period from now (the refill thread leases meanwhile)."""
        local = super().ready_at_ns(user)
        with self._lock:
            held = self._users.get(user)
            wall = self._clock()
            if held is None or held.spendable(wall) > 0:
                return local
        soon = wall + REFILL_PERIOD_NS
        return soon if local is None else max(local, soon)

    # -- the refill thread (network) ------------------------------------------------------
    @staticmethod
    def _add_lease(held: _UserLeases, lease_id: int, grants: int, deadline_ns: int) -> None:
        pay = min(held.overdraft, grants)
        held.overdraft -= pay
        if grants - pay > 0:
            held.grants[lease_id] = [grants - pay, deadline_ns]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refill_once()
            self._wake.wait(REFILL_PERIOD_NS / NS_PER_S)
            self._wake.clear()

    def refill_once(self) -> None:
        """One pass of the refill: for each user in demand holding fewer than L (its
        unconfirmed returns counted), one ``LEASE``; for each idle user, ``RETURN`` of
        every lease it holds. Store errors are absorbed (R25)."""
        wall = self._clock()
        if wall - self._started_ns < STARTUP_HOLD_NS:  # R26: the predecessor's records expire first
            return
        with self._lock:
            self._expire_unconfirmed()
            todo: list[tuple[str, str, int]] = []
            for user, held in list(self._users.items()):
                idle = wall - held.last_asked_ns
                if idle > IDLE_RETURN_NS and held.grants and not held.overdraft:
                    for lease_id, (grants, deadline) in held.grants.items():
                        if deadline > wall and lease_id >= 0:
                            todo.append(("return", user, lease_id))
                            held.returning += grants
                            self._pending_return[(user, lease_id)] = grants
                    held.grants = {}
                elif (
                    idle <= DEMAND_NS
                    and not held.in_flight
                    and held.spendable(wall) + held.returning < self.lease_grants(user)
                ):
                    held.in_flight = True
                    todo.append(("lease", user, 0))
                elif idle > DEMAND_NS and not held.grants and not held.returning and not held.in_flight:
                    del self._users[user]
        for op, user, lease_id in todo:
            if op == "lease":
                self._do_lease(user)
            else:
                self._do_return(user, lease_id)

    def _do_lease(self, user: str) -> None:
        sent = self._clock()
        want = self.lease_grants(user)
        try:
            self.round_trips += 1
            n, lease_id = self._lease(
                keys=[user_key(user)],
                args=[self.emission_ns(user), self.burst_ns, want, LEASE_TTL_NS // 1_000_000, self.engine_id],
            )
            ok = self._clock() - sent <= STORE_TIMEOUT_NS
            self._store_state(True)
        except Exception as exc:  # R25: any store failure: no lease, fail closed
            n, lease_id, ok = 0, 0, False
            self._store_state(False, exc)
        with self._lock:
            held = self._users.get(user)
            if held is None:
                return
            held.in_flight = False
            if ok and int(n) > 0:  # an answer later than the timeout is abandoned (R25)
                self._add_lease(held, int(lease_id), int(n), sent + LEASE_TTL_NS)

    def _do_return(self, user: str, lease_id: int) -> None:
        with self._lock:
            grants = self._pending_return.get((user, lease_id), 0)
        try:
            self.round_trips += 1
            self._return(
                keys=[user_key(user), f"{user_key(user)}:lease:{lease_id}"],
                args=[self.emission_ns(user), grants, self.engine_id],
            )
            confirmed = True
            self._store_state(True)
        except Exception as exc:  # R25: unconfirmed: counted as held until the record expired
            confirmed = False
            self._store_state(False, exc)
        with self._lock:
            if confirmed:
                self._pending_return.pop((user, lease_id), None)
                held = self._users.get(user)
                if held is not None:
                    held.returning = max(held.returning - grants, 0)
            else:
                self._forget_later.append((self._clock() + LEASE_TTL_NS, user, lease_id, grants))
            self._expire_unconfirmed()

    def _expire_unconfirmed(self) -> None:
        """R24: an unconfirmed return stops counting once its record has surely expired."""
        wall = self._clock()
        keep = []
        for entry in self._forget_later:
            due, user, lease_id, grants = entry
            if due <= wall:
                self._pending_return.pop((user, lease_id), None)
                held = self._users.get(user)
                if held is not None:
                    held.returning = max(held.returning - grants, 0)
            else:
                keep.append(entry)
        self._forget_later = keep

    def _store_state(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self.store_ok:
            logger.warning("output_rate: shared budget store %s answers again; leases resume (R25)", self.url)
        elif not ok and self.store_ok:
            logger.warning(
                "output_rate: shared budget store %s unreachable (%s): no new leases, held grants "
                "are spent, then the users are throttled until it answers (R25)",
                self.url,
                exc,
            )
        self.store_ok = ok

    def close(self) -> None:
        """Stop the refill thread (tests, engine shutdown)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def holding_cap(self, user: str) -> int:
        """R24: H = 2L - 1 for ``user``."""
        return holding_cap(self.lease_grants(user))
