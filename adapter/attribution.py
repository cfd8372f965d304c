"""Name the rule a black-box rate failure breaks (the candidate's sampling dispatches against
the spec limiter replayed at ns resolution).

``adapter/judge.py``'s judge replays every sampling dispatch of the candidate as a
``try_take`` on the exact spec limiter and fails the run at the first dispatch the spec
refuses (over-grant, named R2) or the first pause the spec does not explain (under-grant,
named R11). Those names say which property failed, not which rule the candidate broke:
an over-grant can come from a cleanup that deleted a user it should have kept (R6), a
refund that was not due (R9), a free first token (R7), a burst past tau (R1, R2) ...

This module turns such a failure into the rule broken, the way ``adapter/divergence.py``
names V-rules in base fidelity: it replays the same recorded history (``StepRecord``: per
step, the instant, the sampling dispatches in order, the requests that reached their
sampling position without sampling, the intermediate prefill chunks, the pauses the
judge holds to be the limiter's) on the spec limiter with *one* rule changed
(``HYPOTHESES``, each a slip of that rule). A hypothesis explains the failure when its
limiter grants every recorded dispatch up to the failing one and refuses every recorded
pause, the failing one included: the candidate's whole observable behaviour up to the
failure is that of the spec with exactly that rule broken. The first hypothesis in
``HYPOTHESES`` order (the narrowest changes first: ns edges, where a slip that fits fewer
histories comes first -- ready_at rounded down (an excess below 1 ns) and a truncated
emission interval (a drift at rates whose T is not a whole ns) before a burst edge 1 ns
late, a cleanup slip before that edge too (it acts at the cadence only) --, then the
charge point, the refund point, the throttled prefill, pacing, then identity and rates,
then every dispatch charged twice, which fits any rate halved, and last a refusal ignored with chunked prefill, which
fits any over-grant the spec would pause alike) that explains it names the rule; every
other one that explains it too is listed. None explains it: the property's own rule stays.

Black-box only: no field of the candidate's observation interface is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from vllm_output_rate.spec import limiter as spec_limiter

ANONYMOUS = "__anonymous__"
CLEANUP_INTERVAL_STEPS = spec_limiter.CLEANUP_INTERVAL_STEPS
NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class Dispatch:
    """One sampling dispatch: ``request_id``; ``first_token``: the request had no output
    and no step in flight at the step start (its final prefill chunk samples);
    ``in_flight``: a step of it was still in flight (async placeholders) at the step
    start; ``admitted``: it was admitted from ``waiting`` in this step; ``whole_prompt``: its
    chunk starts at token 0 (``SchedulerOutput``'s ``num_computed_tokens``; a prefix-cache
    hit starts it above 0)."""

    request_id: str
    first_token: bool
    in_flight: bool
    admitted: bool
    whole_prompt: bool = False  # the chunk starts at token 0 (no computed or cached token before it)


@dataclass
class StepRecord:
    """What the judge saw of one step (all black-box).

    ``count``: the number of ``schedule()`` calls so far, this one included (R6 cadence);
    ``now_ns``: the step's instant; ``dispatches``: sampling dispatches in
    ``SchedulerOutput`` order; ``skipped``: requests at their sampling position with a
    token to dispatch at the step start that did not sample (a charge the spec would
    refund, R9, or a refusal); ``chunks``: requests scheduled for a chunk that does not
    sample, ``first_chunks`` those of them that start the prompt; ``finished_in_flight``:
    requests that the delivered output finished in this step although this step dispatched
    them again (async: the post-stop token of a stop not yet seen, R8); ``held``: requests
    whose final chunk was held at n - 1 (R10: refused at their charge point);
    ``aborted_in_flight``: requests aborted before the step with a step still in flight;
    ``pauses``: requests whose pause the judge attributes to the limiter (their user must be
    refused after the step's dispatches).
    """

    count: int
    now_ns: int
    dispatches: list[Dispatch]
    skipped: list[str] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    first_chunks: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    aborted_in_flight: list[str] = field(default_factory=list)
    finished_in_flight: list[str] = field(default_factory=list)
    pauses: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Context:
    """The scenario's facts a replay needs: ``users`` request id -> ``output_rate_user``
    (None: none given), ``rates`` bucket -> exact rate (tokens/s), ``default_rate``,
    ``burst_ns`` (tau), ``chunked_prefill``, ``async_mode`` (a step's output is delivered
    after the next ``schedule()``)."""

    users: dict[str, str | None]
    rates: dict[str, Fraction]
    default_rate: Fraction
    burst_ns: int
    chunked_prefill: bool = True  # R10's n - 1 advance exists only with chunked prefill
    async_mode: bool = False

    def rate_of(self, bucket: str) -> Fraction:
        return self.rates.get(bucket, self.default_rate)


def _spec_key(ctx: Context, rid: str) -> str:
    user = ctx.users.get(rid)
    return ANONYMOUS if user is None else user


@dataclass(frozen=True)
class Hypothesis:
    """The spec limiter with one rule changed (module docstring). ``rule``: the rule the
    change breaks; ``slip``: what the changed limiter does, as the failure message says it.

    The hooks default to the spec: ``key(ctx, rid)`` the bucket; ``rate(ctx, bucket)``;
    ``interval(rate)`` T in ns; ``allows(tat, now, tau)``; ``start(tat, now)`` the TAT a
    grant advances from; ``charges(dispatch)`` takes per dispatch; ``cleanup(tat, now,
    tau)`` True: deleted at the cadence (``cleanup_at_start``: at the start of the step
    that reaches it, else at its end); ``decide_at_start``: every dispatch of a step
    judged against the step's starting state, the takes made after; ``skipped_granted``
    / ``skipped_refused``: what a skipped request's bucket undergoes ("take", "refund",
    "forget") when the limiter would grant / refuse it; ``chunk_takes``: a non-sampling
    chunk is charged (``first_chunk_charged``: only one that starts a prompt);
    ``abort_takes``: a take for each request aborted with a step in flight; ``asks(dispatch)``:
    the limiter is asked about it at all (False: neither judged nor charged);
    ``refund_finished_in_flight``: a refund when a request with a step
    in flight finishes; ``refused_prefill_samples``: a refused final prefill chunk
    samples anyway, uncharged (R10), and ``refused_samples``: with chunked prefill any refused
    request does (the n - 1 cap off by one); ``unasked_in_flight``: a dispatch with a step in
    flight is neither asked nor charged (taken as charged already); ``free_first_per_step`` / ``free_running``: the first
    dispatch of each step / every dispatch of an already running request ends uncharged;
    ``burst_ns``: another tau; ``charge_at_output``: a step's dispatches are judged as the
    spec judges them (each against the takes before it in the step) but taken only when their
    output is delivered, granted or not, at that ``schedule()``'s instant."""

    rule: str
    slip: str
    key: Callable[[Context, str], str] = _spec_key
    rate: Callable[[Context, str], Fraction] = lambda ctx, bucket: ctx.rate_of(bucket)
    interval: Callable[[Fraction], Fraction] = spec_limiter.emission_interval_ns
    allows: Callable[[Fraction, int, int], bool] = lambda tat, now, tau: tat - now <= tau
    start: Callable[[Fraction, int], Fraction] = lambda tat, now: max(tat, Fraction(now))
    charges: Callable[[Dispatch], int] = lambda d: 1
    cleanup: Callable[[Fraction, int, int], bool] = lambda tat, now, tau: tat <= now
    decide_at_start: bool = False
    skipped_granted: str | None = None
    skipped_refused: str | None = None
    chunk_takes: bool = False
    refund_finished_in_flight: bool = False
    burst_ns: int | None = None
    free_first_per_step: bool = False
    free_running: bool = False
    refused_prefill_samples: bool = False
    refused_samples: bool = False
    cleanup_at_start: bool = False
    asks: Callable[[Dispatch], bool] = lambda d: True
    abort_takes: bool = False
    unasked_in_flight: bool = False
    first_chunk_charged: bool = False
    charge_at_output: bool = False


def _ceil_ready(tat: Fraction, now: int, tau: int) -> bool:
    return now >= math.floor(tat - tau)  # R5 slip: ready_at rounded down, take iff now >= it


def _lower(ctx: Context, rid: str) -> str:
    user = ctx.users.get(rid)
    return ANONYMOUS if user is None else user.lower()


def _strip(ctx: Context, rid: str) -> str:
    user = ctx.users.get(rid)
    return ANONYMOUS if user is None else user.strip()


def _anon_per_request(ctx: Context, rid: str) -> str:
    user = ctx.users.get(rid)
    return rid if user is None else user


HYPOTHESES: tuple[Hypothesis, ...] = (
    Hypothesis(
        "R2",
        "refuses a take with TAT - now = tau exactly (R2 allows it: TAT - now <= tau)",
        allows=lambda tat, now, tau: tat - now < tau,
    ),
    Hypothesis("R5", "grants a take from ready_at rounded down (R5: ready_at = ceil(TAT - tau))", allows=_ceil_ready),
    Hypothesis(
        "R3",
        "advances the TAT by the emission interval truncated to whole ns (R3: exact T)",
        interval=lambda rate: Fraction(NS_PER_S // rate) if rate <= NS_PER_S else Fraction(1),
    ),
    Hypothesis(
        "R6",
        "deletes at cleanup a user whose TAT is 1 ns ahead of now (R6 deletes only TAT <= now)",
        cleanup=lambda tat, now, tau: tat <= now + 1,
    ),
    Hypothesis(
        "R6",
        "deletes at cleanup users whose TAT is ahead of now within tau (R6 deletes only TAT <= now)",
        cleanup=lambda tat, now, tau: tat - now <= tau,
    ),
    # The same two slips with the cleanup run at the start of the 256th schedule(), before
    # its dispatches (where a cleanup of TAT <= now may as well run: nothing tells them apart).
    Hypothesis(
        "R6",
        "deletes, at a cleanup at the start of schedule(), a user whose TAT is 1 ns ahead of now (R6 "
        "deletes only TAT <= now)",
        cleanup=lambda tat, now, tau: tat <= now + 1,
        cleanup_at_start=True,
    ),
    Hypothesis(
        "R6",
        "deletes, at a cleanup at the start of schedule(), users whose TAT is ahead of now within "
        "tau (R6 deletes only TAT <= now)",
        cleanup=lambda tat, now, tau: tat - now <= tau,
        cleanup_at_start=True,
    ),
    Hypothesis(
        "R2",
        "grants a take with TAT - now = tau + 1 ns (R2 refuses it: TAT - now <= tau)",
        allows=lambda tat, now, tau: tat - now <= tau + 1,
    ),
    # Narrower than a kept charge (it acts only at an abort with a step in flight), so first.
    Hypothesis(
        "R7",
        "charges a request aborted with a step in flight once more, at the abort (R7: one charge per dispatch; "
        "R8: that step stays charged, once)",
        abort_takes=True,
    ),
    Hypothesis(
        "R9",
        "keeps the charge of a request that did not sample (R9 refunds it at the end of schedule())",
        skipped_granted="take",
    ),
    Hypothesis("R9", "refunds an undispatched charge twice (R9: exactly once)", skipped_granted="refund"),
    Hypothesis("R4", "forgets the user's TAT on a refund (R4: TAT := TAT - T)", skipped_granted="forget"),
    Hypothesis(
        "R7",
        "does not charge the final prefill chunk, which samples the first token (R7 charges it)",
        charges=lambda d: 0 if d.first_token else 1,
    ),
    Hypothesis(
        "R7",
        "charges a prompt's first chunk instead of the chunk that samples (R7 charges the sampling one)",
        first_chunk_charged=True,
        charges=lambda d: 1 if d.whole_prompt or not d.first_token else 0,
    ),
    Hypothesis(
        "R7",
        "does not charge a final prefill chunk that follows earlier chunks (R7 charges the chunk that samples)",
        charges=lambda d: 1 if d.whole_prompt or not d.first_token else 0,
    ),
    Hypothesis(
        "R7",
        "never asks about a final prefill chunk that follows earlier chunks, so it samples uncharged even when its "
        "user is refused (R7 charges the chunk that samples)",
        asks=lambda d: d.whole_prompt or not d.first_token,
    ),
    Hypothesis(
        "R7",
        "charges intermediate prefill chunks, which do not sample (R7 charges sampling steps only)",
        chunk_takes=True,
    ),
    Hypothesis(
        "R7",
        "charges a dispatch with a step in flight twice (R7: at most one charge per request per step)",
        charges=lambda d: 2 if d.in_flight else 1,
    ),
    Hypothesis(
        "R7",
        "charges a dispatch with a step in flight three times (R7: at most one charge per request per step)",
        charges=lambda d: 3 if d.in_flight else 1,
    ),
    Hypothesis(
        "R7",
        "judges every dispatch of a step against the TAT at the step's start and charges after "
        "(R7 charges each dispatch when it is made)",
        decide_at_start=True,
    ),
    Hypothesis(
        "R7",
        "takes a step's charges only when the model's output for it is delivered, after the next schedule() in "
        "async mode (R7 charges each sampling step when it is dispatched)",
        charge_at_output=True,
    ),
    Hypothesis(
        "R8",
        "does not charge a dispatch made while the request's previous step is in flight (R8: never under-charge)",
        charges=lambda d: 0 if d.in_flight else 1,
    ),
    Hypothesis(
        "R8",
        "neither asks nor charges for a dispatch made while the request's previous step is in "
        "flight, as if it were charged already (R8: never under-charge)",
        unasked_in_flight=True,
    ),
    Hypothesis(
        "R8",
        "refunds the post-stop token of a request that finishes with a step in flight (R8: it stays charged)",
        refund_finished_in_flight=True,
    ),
    # Before the refund slips that can also reproduce "never paused anything": a candidate
    # with no limit at all (stock vLLM) is named R2, not R9.
    Hypothesis(
        "R2",
        "never refuses a take: no GCRA is applied at all (R2: a take is granted only while TAT - now <= tau)",
        allows=lambda tat, now, tau: True,
    ),
    Hypothesis(
        "R9",
        "refunds the first dispatched charge of each step (R9: a dispatched charge is final)",
        free_first_per_step=True,
    ),
    Hypothesis(
        "R9", "refunds the dispatched charges of running requests (R9: a dispatched charge is final)", free_running=True
    ),
    Hypothesis(
        "R10",
        "lets a refused final prefill chunk reach the sampling position, uncharged (R10 holds it at n - 1)",
        refused_prefill_samples=True,
    ),
    Hypothesis("R2", "advances the TAT on a refused take (R2: a refusal changes nothing)", skipped_refused="take"),
    Hypothesis(
        "R2",
        "advances the TAT without clamping it up to now, banking idle time (R2: max(TAT, now) + T)",
        start=lambda tat, now: tat,
    ),
    Hypothesis("R17", "keys user ids lower-cased (R17: ids are kept exactly)", key=_lower),
    Hypothesis("R17", "keys user ids stripped of surrounding spaces (R17: ids are kept exactly)", key=_strip),
    Hypothesis(
        "R17",
        "gives each request without output_rate_user its own bucket (R17: they share __anonymous__)",
        key=_anon_per_request,
    ),
    Hypothesis(
        "R1",
        "keeps one bucket per request, not per user (R1: one TAT per user)",
        key=lambda ctx, rid: rid,
        rate=lambda ctx, rid: ctx.rate_of(_spec_key(ctx, rid)),
    ),
    # Keyed by request id, the per-user overrides are missed too: every bucket at the default.
    Hypothesis(
        "R1",
        "keeps one bucket per request, not per user, each at the default rate since no override "
        "names a request id (R1: one TAT per user, at its override)",
        key=lambda ctx, rid: rid,
        rate=lambda ctx, bucket: ctx.default_rate,
    ),
    # One bucket for every request: a slip of R1 (one TAT for all users) and of R17 (every
    # request keyed __anonymous__, output_rate_user ignored) alike; nothing black-box tells
    # them apart, so both are named.
    Hypothesis(
        "R1/R17",
        "keeps one bucket for every request at the default rate: one TAT for all users (R1: "
        "one TAT per user), or output_rate_user ignored so that every request is __anonymous__ (R17)",
        key=lambda ctx, rid: ANONYMOUS,
        rate=lambda ctx, bucket: ctx.default_rate,
    ),
    Hypothesis(
        "R1",
        "gives every user the default rate, ignoring its override (R1: the override, else the default)",
        rate=lambda ctx, bucket: ctx.default_rate,
    ),
    Hypothesis("R1", "uses a burst tolerance of 1 s (R1: tau is the configured burst)", burst_ns=NS_PER_S),
    Hypothesis(
        "R7", "charges every sampling dispatch twice (R7: one charge per request per step)", charges=lambda d: 2
    ),
    # Last: with chunked prefill on in every run, it fits any over-grant whose pauses the
    # spec refuses too; a probe without chunked prefill (``naming_probes``) tells it apart.
    Hypothesis(
        "R10",
        "lets any refused request, with chunked prefill, run up to and including its sampling "
        "position, uncharged: the n - 1 cap off by one (R10 holds it at n - 1)",
        refused_samples=True,
    ),
)


class _Replay:
    """One hypothesis' limiter over a recorded history."""

    def __init__(self, hyp: Hypothesis, ctx: Context) -> None:
        self.hyp, self.ctx = hyp, ctx
        self.tat: dict[str, Fraction] = {}
        self.tau = hyp.burst_ns if hyp.burst_ns is not None else ctx.burst_ns
        self.undelivered: list[str] = []  # charge_at_output: the buckets of the step in flight

    def _t(self, bucket: str) -> Fraction:
        return self.hyp.interval(self.hyp.rate(self.ctx, bucket))

    def allowed(self, bucket: str, now: int, tat: dict[str, Fraction] | None = None) -> bool:
        current = (self.tat if tat is None else tat).get(bucket)
        return current is None or self.hyp.allows(current, now, self.tau)

    def take(self, bucket: str, now: int) -> None:
        current = self.tat.get(bucket)
        base = Fraction(now) if current is None else self.hyp.start(current, now)
        self.tat[bucket] = base + self._t(bucket)

    def apply(self, action: str, bucket: str, now: int) -> None:
        if action == "take":
            self.take(bucket, now)
        elif action == "refund" and bucket in self.tat:
            self.tat[bucket] -= self._t(bucket)
        elif action == "forget":
            self.tat.pop(bucket, None)

    def step(self, rec: StepRecord) -> str | None:
        """Replay one step; the first recorded fact the hypothesis contradicts, or None."""
        hyp = self.hyp
        self._before_decisions(rec)
        at_start = dict(self.tat)
        kept = self.tat  # charge_at_output: this step's takes judge its later dispatches only
        if hyp.charge_at_output:
            self.tat = dict(kept)
        refunds: list[str] = []
        failure = self._dispatches(rec, at_start, refunds) or self._chunks(rec)
        if failure is not None:
            return failure
        self._passed_over(rec)
        failure = self._paused(rec)
        if failure is not None:
            return failure
        for bucket in refunds:
            self.apply("refund", bucket, rec.now_ns)
        self._after_decisions(rec, kept)
        return None

    def _cleanup(self, now: int) -> None:
        """The 256th-step cleanup: every bucket the hypothesis' cleanup drops at ``now``."""
        self.tat = {u: t for u, t in self.tat.items() if not self.hyp.cleanup(t, now, self.tau)}

    def _before_decisions(self, rec: StepRecord) -> None:
        """What the hypothesis does before ``schedule()`` decides: takes for aborted
        in-flight requests, and the cleanup when it runs at the step's start."""
        hyp, now = self.hyp, rec.now_ns
        if hyp.abort_takes:
            for rid in rec.aborted_in_flight:
                self.take(hyp.key(self.ctx, rid), now)
        if hyp.cleanup_at_start and rec.count % CLEANUP_INTERVAL_STEPS == 0:
            self._cleanup(now)

    def _dispatches(self, rec: StepRecord, at_start: dict[str, Fraction], refunds: list[str]) -> str | None:
        """Judge and charge the step's sampling dispatches (``refunds`` collects the buckets
        given back at the end of ``schedule()``); the first refusal the candidate did not
        make, or None."""
        hyp, now = self.hyp, rec.now_ns
        for i, d in enumerate(rec.dispatches):
            bucket = hyp.key(self.ctx, d.request_id)
            if (hyp.unasked_in_flight and d.in_flight) or not hyp.asks(d):
                continue  # taken as charged already, or never asked: not judged, not charged
            if not self.allowed(bucket, now, at_start if hyp.decide_at_start else None):
                if self.ctx.chunked_prefill and (
                    hyp.refused_samples or (hyp.refused_prefill_samples and d.first_token)
                ):
                    continue  # the refused chunk was not held at n - 1: it sampled, uncharged
                return f"refuses {d.request_id} at t={now} ns"
            for _ in range(hyp.charges(d)):
                self.take(bucket, now)
            if (hyp.free_first_per_step and i == 0) or (hyp.free_running and not d.admitted):
                refunds.append(bucket)  # given back at the end of schedule(), after every decision
        return None

    def _chunks(self, rec: StepRecord) -> str | None:
        """Charge the prefill chunks a hypothesis charges; the first one it refuses, or None."""
        hyp, now = self.hyp, rec.now_ns
        if hyp.chunk_takes or hyp.first_chunk_charged:
            for rid in rec.chunks if hyp.chunk_takes else rec.first_chunks:
                bucket = hyp.key(self.ctx, rid)
                if not self.allowed(bucket, now):
                    return f"refuses the chunk of {rid} at t={now} ns"
                self.take(bucket, now)
        return None

    def _passed_over(self, rec: StepRecord) -> None:
        """What the hypothesis does to the TAT of requests held, skipped or finished in flight."""
        hyp, now = self.hyp, rec.now_ns
        if hyp.skipped_refused is not None:
            for rid in rec.held:  # refused at the charge point; what a refusal does to the TAT
                bucket = hyp.key(self.ctx, rid)
                if not self.allowed(bucket, now):
                    self.apply(hyp.skipped_refused, bucket, now)
        for rid in rec.skipped:
            bucket = hyp.key(self.ctx, rid)
            if self.allowed(bucket, now):  # a pause the judge holds to be a refusal was not granted
                action = None if rid in rec.pauses else hyp.skipped_granted
            else:
                action = hyp.skipped_refused
            if action is not None:
                self.apply(action, bucket, now)
        if hyp.refund_finished_in_flight:
            for rid in rec.finished_in_flight:
                self.apply("refund", hyp.key(self.ctx, rid), now)

    def _paused(self, rec: StepRecord) -> str | None:
        """The first pause of the candidate that the hypothesis would have granted, or None."""
        for rid in rec.pauses:
            if self.allowed(self.hyp.key(self.ctx, rid), rec.now_ns):
                return f"grants {rid} at t={rec.now_ns} ns, which the candidate paused"
        return None

    def _after_decisions(self, rec: StepRecord, kept: dict[str, Fraction]) -> None:
        """The end of the step: the decisions' copy dropped (``charge_at_output``), the
        cleanup when it runs at the step's end, and the takes that come with the output."""
        hyp, now = self.hyp, rec.now_ns
        if hyp.charge_at_output:
            self.tat = kept  # the decisions' copy dropped: the takes come with the output
        if not hyp.cleanup_at_start and rec.count % CLEANUP_INTERVAL_STEPS == 0:
            self._cleanup(now)
        if hyp.charge_at_output:  # the output delivered after this schedule(): this step's, or the last one's
            sampled = [hyp.key(self.ctx, d.request_id) for d in rec.dispatches]
            delivered, self.undelivered = (self.undelivered, sampled) if self.ctx.async_mode else (sampled, [])
            for bucket in delivered:
                self.take(bucket, now)


def explains(hyp: Hypothesis, histories: list[tuple[Context, list[StepRecord]]]) -> bool:
    """True when ``hyp``'s limiter agrees with every recorded fact of every history (each
    a run of the candidate from an empty limiter, with its scenario's ``Context``)."""
    for ctx, history in histories:
        replay = _Replay(hyp, ctx)
        if any(replay.step(rec) is not None for rec in history):
            return False
    return True


SPEC = Hypothesis("-", "the spec limiter")


def attribute(histories: list[tuple[Context, list[StepRecord]]]) -> tuple[Hypothesis, list[Hypothesis]] | None:
    """(the first hypothesis that explains every history, every other one that does) or
    None (none does, or the unchanged spec does: then the failure is not the limiter's)."""
    if not histories or explains(SPEC, histories):
        return None
    found = [h for h in HYPOTHESES if explains(h, histories)]
    return (found[0], found[1:]) if found else None


def message(name: str, hyp: Hypothesis, others: list[Hypothesis], steps: int, runs: int) -> str:
    """The failure text naming ``hyp.rule`` as broken, with the evidence."""
    also = ""
    if others:
        also = "; the same runs also fit a limiter that " + "; or that ".join(f"{h.slip} [{h.rule}]" for h in others)
    return (
        f"{hyp.rule} broken: {name}'s sampling dispatches and pauses over {steps} steps ({runs} runs: the "
        f"counterexample and its longer probes) are exactly those of the spec limiter, replayed at ns "
        f"resolution, changed in {hyp.rule} alone: one that {hyp.slip}; the spec's own refutes them{also}"
    )
