"""Differential check of a limiter implementation against the spec limiter (rules R1-R6).

Pure Python: this module imports the spec (``vllm_output_rate.spec.limiter``), the pure
reference limiter (``vllm_output_rate.reference.limiter``) and Hypothesis. It never imports
vLLM, so the command-line gate and the tests can both use it cheaply.

An ``OpSequence`` fixes the users, their rates (tokens/s, exact Fractions) and a list of
operations on one shared monotonic clock (integer ns, starting at 0):

- ``advance`` by ``arg`` ns (0..10**9, sometimes a huge jump up to 10**15). Every advance,
  even by 0 ns, starts a new scheduling step.
- ``advance_to_ready``: move the clock to ``ready_at_ns(user) + arg`` (``arg`` in -1, 0, 1),
  the R5 boundary; a no-op when that time is not ahead of the clock. Starts a new step.
- ``take``: ``try_take(user, now)`` (R2).
- ``refund``: refund one grant made earlier *in the same step* and not yet refunded (R4,
  R9: the scheduler refunds only charges of the current ``schedule()`` call). ``arg`` picks
  which one (modulo the number pending); a no-op when the step has no such grant.
- ``cleanup``: ``cleanup_idle_users(now)`` (R6). Ends the step.

After every operation ``run_differential`` compares, for every user: the grant decision of
the operation, ``allows``, ``ready_at_ns``, ``tat_ns``, and the set of users held, and
returns a one-line description of the first divergence (naming the rule id) or ``None``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, Protocol

from hypothesis import strategies as st

from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

USERS: tuple[str, ...] = ("u0", "u1", "u2")
MAX_ADVANCE_NS: int = 10**9  # an ordinary clock advance: 0..1 s
MAX_JUMP_NS: int = 10**15  # a huge jump (about 11.6 days)
MAX_OPS: int = 100_000  # bound on one sequence (TigerBeetle style)
OP_KINDS: tuple[str, ...] = ("advance", "advance_to_ready", "take", "refund", "cleanup")


@dataclass(frozen=True)
class Op:
    """One operation on the limiters; see the module docstring for ``kind`` and ``arg``."""

    kind: str
    user: str | None = None
    arg: int = 0

    def __post_init__(self) -> None:
        assert self.kind in OP_KINDS, f"unknown op kind {self.kind!r}"

    def __str__(self) -> str:
        if self.kind == "advance":
            return f"advance {self.arg} ns"
        if self.kind == "advance_to_ready":
            return f"advance_to_ready({self.user}) {self.arg:+d} ns"
        if self.kind == "take":
            return f"take({self.user})"
        if self.kind == "refund":
            return f"refund(#{self.arg})"
        return "cleanup"


@dataclass(frozen=True)
class OpSequence:
    """Users, their rates (tokens/s) and the operations to run on a fresh limiter pair.

    ``user_rates`` holds the per-user overrides; a user of ``users`` not listed there gets
    ``default_rate``.
    """

    default_rate: Fraction
    user_rates: tuple[tuple[str, Fraction], ...]
    users: tuple[str, ...]
    ops: tuple[Op, ...]

    def __post_init__(self) -> None:
        assert len(self.ops) <= MAX_OPS, f"{len(self.ops)} ops > {MAX_OPS}"
        assert 1 <= len(self.users) <= len(USERS)

    def __str__(self) -> str:
        rates = ", ".join(f"{u}={r}" for u, r in self.user_rates)
        return f"default={self.default_rate} tok/s, overrides {{{rates}}}, users {list(self.users)}: " + "; ".join(
            str(op) for op in self.ops
        )


# A rate in tokens/s as the reference takes it.
RateLike = int | float | str | Fraction | Decimal


def _to_fraction(rate: RateLike) -> Fraction:
    # Floats are taken as the decimal they are written as (the reference's R3 decision).
    return Fraction(repr(rate)) if isinstance(rate, float) else Fraction(rate)


class SpecLimiter:
    """The exact-rational spec limiter (R1-R6) behind ``OutputRateLimiter``'s interface.

    Holds one ``spec.LimiterState``; every method calls the pure spec function of the same
    name. Times are integer ns, rates tokens/s (int, Fraction, Decimal, or a float read as
    the decimal it is written as). No validation beyond the spec's own assertions.
    """

    def __init__(
        self,
        default_rate_tokens_per_s: RateLike,
        user_rates_tokens_per_s: Mapping[str, RateLike] | None = None,
        burst_ns: int = spec.BURST_NS,
    ) -> None:
        self.burst_ns = burst_ns
        self.default_rate = _to_fraction(default_rate_tokens_per_s)
        self.user_rates = {u: _to_fraction(r) for u, r in (user_rates_tokens_per_s or {}).items()}
        self.state = spec.EMPTY

    def rate_of(self, user: str) -> Fraction:
        """The user's rate in tokens/s (exact)."""
        return self.user_rates.get(user, self.default_rate)

    def try_take(self, user: str, now_ns: int) -> bool:
        """R2: ``spec.try_take`` at ``now_ns`` (ns); True when granted."""
        self.state, granted = spec.try_take(self.state, user, self.rate_of(user), now_ns, self.burst_ns)
        return granted

    def allows(self, user: str, now_ns: int) -> bool:
        """R2: ``spec.allows`` at ``now_ns`` (ns)."""
        return spec.allows(self.state, user, now_ns, self.burst_ns)

    def refund(self, user: str) -> None:
        """R4: ``spec.refund``: TAT := TAT - T."""
        self.state = spec.refund(self.state, user, self.rate_of(user))

    def ready_at_ns(self, user: str) -> int | None:
        """R5: ``spec.ready_at_ns``: ceil(TAT - tau) in ns, None for an idle user."""
        return spec.ready_at_ns(self.state, user, self.burst_ns)

    def tat_ns(self, user: str) -> Fraction | None:
        """R1: the user's exact TAT in ns, None for an idle user."""
        return self.state.tat_ns.get(user)

    def cleanup_idle_users(self, now_ns: int) -> int:
        """R6: ``spec.cleanup_idle_users`` at ``now_ns`` (ns); returns how many were deleted."""
        before = len(self.state.tat_ns)
        self.state = spec.cleanup_idle_users(self.state, now_ns)
        return before - len(self.state.tat_ns)

    def users(self) -> Iterable[str]:
        """Users that currently hold a TAT."""
        return self.state.tat_ns.keys()

    def __len__(self) -> int:
        return len(self.state.tat_ns)


class LimiterLike(Protocol):
    """What ``run_differential`` needs from an implementation (``OutputRateLimiter``'s API)."""

    def try_take(self, user: str, now_ns: int) -> bool: ...
    def allows(self, user: str, now_ns: int) -> bool: ...
    def refund(self, user: str) -> None: ...
    def ready_at_ns(self, user: str) -> int | None: ...
    def tat_ns(self, user: str) -> Fraction | None: ...
    def cleanup_idle_users(self, now_ns: int) -> int: ...
    def users(self) -> Iterable[str]: ...


# ---------------------------------------------------------------------------------------
# Strategies


def rates() -> st.SearchStrategy[Fraction]:
    """Rates in tokens/s accepted by ``parse_rate``: ints 1..10**6, small fractions, 1/7...

    Always exact Fractions with a denominator <= 10**9 and a value in (0, 10**6].
    """
    return st.one_of(
        st.integers(1, 100).map(Fraction),
        st.integers(1, 10**6).map(Fraction),
        st.sampled_from(
            [
                Fraction(1, 7),
                Fraction(1, 3),
                Fraction(1, 2),
                Fraction(5, 2),
                Fraction(10**6),
                Fraction(999_999, 7),
                Fraction(3),
                Fraction(10),
            ]
        ),
        st.builds(Fraction, st.integers(1, 10**4), st.integers(2, 1000)),
    )


def _advance_ns() -> st.SearchStrategy[int]:
    return st.one_of(
        st.just(0),
        st.integers(0, 2_000),
        st.integers(0, MAX_ADVANCE_NS),
        st.sampled_from([spec.BURST_NS - 1, spec.BURST_NS, spec.BURST_NS + 1, MAX_ADVANCE_NS]),
        st.integers(MAX_ADVANCE_NS, MAX_JUMP_NS),
    )


@st.composite
def _step(draw: Any, users: tuple[str, ...]) -> list[Op]:
    """One scheduling step: a clock move, takes at that instant, refunds of some, maybe cleanup."""
    ops: list[Op] = []
    if draw(st.integers(0, 3)) == 0:
        ops.append(Op("advance_to_ready", draw(st.sampled_from(users)), draw(st.sampled_from([-1, 0, 1]))))
    else:
        ops.append(Op("advance", arg=draw(_advance_ns())))
    takes = draw(st.lists(st.sampled_from(users), min_size=0, max_size=6))
    ops.extend(Op("take", u) for u in takes)
    n_refunds = draw(st.integers(0, len(takes)))
    ops.extend(Op("refund", arg=draw(st.integers(0, 5))) for _ in range(n_refunds))
    if draw(st.integers(0, 4)) == 0:
        ops.append(Op("cleanup"))
    return ops


@st.composite
def _sequences(draw: Any, max_len: int) -> OpSequence:
    n_users = draw(st.integers(1, len(USERS)))
    users = USERS[:n_users]
    default_rate = draw(rates())
    overrides = tuple((u, draw(rates())) for u in users if draw(st.booleans()))
    ops: list[Op] = []
    for step in draw(st.lists(_step(users), min_size=1, max_size=max(1, max_len))):
        ops.extend(step)
        if len(ops) >= max_len:
            break
    return OpSequence(default_rate, overrides, users, tuple(ops[:max_len]))


def operations(max_len: int) -> st.SearchStrategy[OpSequence]:
    """Hypothesis strategy of ``OpSequence`` with at most ``max_len`` operations (R1-R6).

    1-3 users, each with an override rate or the default rate (ints up to 10**6 tokens/s
    and fractions such as 1/7); steps of: one clock move (0..10**9 ns, huge jumps up to
    10**15 ns, or exactly to a user's ready_at +-1 ns), takes at that instant, refunds of a
    subset of that step's grants, and sometimes a cleanup.
    """
    assert 1 <= max_len <= MAX_OPS, f"max_len must be in 1..{MAX_OPS}, got {max_len}"
    return _sequences(max_len)


# ---------------------------------------------------------------------------------------
# The differential run


_RULE_OF_OP = {"advance": "R1", "advance_to_ready": "R5", "take": "R2", "refund": "R4", "cleanup": "R6"}


def _compare(model: SpecLimiter, impl: LimiterLike, users: tuple[str, ...], now: int, where: str, op: Op) -> str | None:
    held_s, held_i = set(model.users()), set(impl.users())
    if held_s != held_i:
        rule = "R6" if op.kind == "cleanup" else "R1"
        return f"{rule}: users held differ {where}: spec {sorted(held_s)}, impl {sorted(held_i)}"
    for u in users:
        tat_s, tat_i = model.tat_ns(u), impl.tat_ns(u)
        if tat_s != tat_i:
            rule = "R4" if op.kind == "refund" else "R3"
            return f"{rule}: tat_ns({u}) differs {where}: spec {tat_s}, impl {tat_i}"
        ready_s, ready_i = model.ready_at_ns(u), impl.ready_at_ns(u)
        if ready_s != ready_i:
            return f"R5: ready_at_ns({u}) differs {where}: spec {ready_s}, impl {ready_i}"
        allow_s, allow_i = model.allows(u, now), impl.allows(u, now)
        if allow_s != allow_i:
            return f"R2: allows({u}) differs {where}: spec {allow_s}, impl {allow_i}"
    return None


def _take(
    model: SpecLimiter, impl: LimiterLike, user: str, now: int, where: str, counts: Counter[str], pending: list[str]
) -> str | None:
    """One ``try_take`` on both (R2): None, or the divergence or crash ``where`` it happened."""
    ready = model.ready_at_ns(user)
    granted_s = model.try_take(user, now)
    try:
        granted_i = impl.try_take(user, now)
    except Exception as exc:  # the implementation crashed: report, do not raise
        return f"{_RULE_OF_OP['take']}: implementation raised {type(exc).__name__}: {exc} {where}"
    if granted_s != granted_i:
        return f"R2: grant differs {where}: spec {granted_s}, impl {granted_i}"
    counts["granted" if granted_s else "refused"] += 1
    counts["granted_at_ready"] += granted_s and ready == now
    counts["refused_before_ready"] += (not granted_s) and ready == now + 1
    if granted_s:
        pending.append(user)
    return None


def _cleanup(model: SpecLimiter, impl: LimiterLike, now: int, where: str, counts: Counter[str]) -> str | None:
    """One ``cleanup_idle_users`` on both (R6): None, or the divergence or crash ``where`` it happened."""
    deleted_s = model.cleanup_idle_users(now)
    try:
        deleted_i = impl.cleanup_idle_users(now)
    except Exception as exc:
        return f"{_RULE_OF_OP['cleanup']}: implementation raised {type(exc).__name__}: {exc} {where}"
    if deleted_s != deleted_i:
        return f"R6: cleanup deleted {deleted_i} users, spec {deleted_s}, {where}"
    counts["cleanup_deleted"] += deleted_s
    return None


def _advance(model: SpecLimiter, op: Op, now: int, counts: Counter[str]) -> int:
    """``advance`` (the clock moves ``op.arg`` ns) or ``advance_to_ready`` (to ``op.user``'s
    ready time plus ``op.arg`` ns, never back): the new clock reading (ns)."""
    if op.kind == "advance":
        counts["jump"] += op.arg > MAX_ADVANCE_NS
        return now + op.arg
    assert op.user is not None
    ready = model.ready_at_ns(op.user)
    if ready is not None and ready + op.arg > now:
        return ready + op.arg
    return now


def _refund(
    model: SpecLimiter, impl: LimiterLike, op: Op, i: int, now: int, counts: Counter[str], pending: list[str]
) -> tuple[str | None, str | None]:
    """One ``refund`` on both (R4, R9) of a user of this step's grants, picked from ``pending``
    by ``op.arg`` (none pending: nothing happens). Returns ``(where, crash)``: where the refund
    happened (None: no refund) and the implementation's crash (None: it did not raise)."""
    if not pending:
        return None, None
    user = pending.pop(op.arg % len(pending))
    where = f"at op {i} ({op} of {user}), now={now} ns"
    model.refund(user)
    try:
        impl.refund(user)
    except Exception as exc:
        return where, f"{_RULE_OF_OP[op.kind]}: implementation raised {type(exc).__name__}: {exc} {where}"
    counts["refund"] += 1
    return where, None


def run_differential(
    ops: OpSequence,
    make_impl: Callable[..., LimiterLike] | None = None,
    stats: Counter[str] | None = None,
) -> str | None:
    """Run ``ops`` on the spec limiter and on an implementation; compare after every op.

    Args:
        ops: the users, rates (tokens/s) and operations (clock in integer ns from 0).
        make_impl: builds the implementation as ``make_impl(default_rate, {user: rate})``
            (rates as exact Fractions, tokens/s); default ``OutputRateLimiter``.
        stats: if given, counts of what happened (``granted``, ``refused``, ``refund``,
            ``cleanup_deleted``, ``granted_at_ready``, ``refused_before_ready``, ``jump``),
            to check that generated sequences reach every rule.
    Returns:
        None when the two agree on every op; else one line naming the rule id (R1-R6) and
        the first divergence, e.g. ``"R2: grant differs at op 7 (take(u0)) at now=... ns: ..."``.
    """
    factory = make_impl or OutputRateLimiter
    overrides = dict(ops.user_rates)
    model = SpecLimiter(ops.default_rate, overrides)
    impl = factory(ops.default_rate, overrides)
    counts: Counter[str] = stats if stats is not None else Counter()
    now = 0
    pending: list[str] = []  # users of this step's grants not yet refunded (R9)
    for i, op in enumerate(ops.ops):
        where = f"at op {i} ({op}), now={now} ns"
        rule = _RULE_OF_OP[op.kind]
        found = None
        if op.kind in ("advance", "advance_to_ready"):
            now = _advance(model, op, now, counts)
            pending = []
        elif op.kind == "take":
            assert op.user is not None
            found = _take(model, impl, op.user, now, where, counts, pending)
        elif op.kind == "refund":
            refund_where, found = _refund(model, impl, op, i, now, counts, pending)
            where = refund_where or where
        else:  # cleanup
            found = _cleanup(model, impl, now, where, counts)
            pending = []
        if found is not None:
            return found
        if op.kind != "refund":
            where = f"at op {i} ({op}), now={now} ns"
        try:
            diff = _compare(model, impl, ops.users, now, where, op)
        except Exception as exc:
            return f"{rule}: implementation raised {type(exc).__name__}: {exc} while observing, {where}"
        if diff is not None:
            return diff
    return None
