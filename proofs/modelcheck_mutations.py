"""The spec-mutation catalogue of the model checker (``proofs/modelcheck.py
--mutations``): each mutation changes one rule of the spec; the checker must catch it on
the ``mutations`` profile. The table goes to docs/SPEC_MUTATIONS.md.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_output_rate.proofs.modelcheck_counterexamples import official_verdict
from vllm_output_rate.proofs.modelcheck_explorer import explore
from vllm_output_rate.proofs.modelcheck_results import Violation
from vllm_output_rate.proofs.modelcheck_scopes import Scope, profile_scopes
from vllm_output_rate.proofs.modelcheck_transitions import CHECK_IDS
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import queues as spec_queues
from vllm_output_rate.spec import rate as spec_rate
from vllm_output_rate.spec import scheduler as spec
from vllm_output_rate.spec.state import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
MUTATIONS_DOC = REPO_ROOT / "docs" / "SPEC_MUTATIONS.md"
NEW_CHECKS = ("I13", "I14", "I15", "I16", "I17", "F1", "R6")  # added with the checker (docs/SPEC_MUTATIONS.md)
ORIGINAL_INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12")


Patches = Callable[[EngineConfig], list[tuple[Any, str, Any]]]  # config -> (module, attribute, replacement)


@dataclass(frozen=True)
class Mutation:
    """A small deliberate change to one spec rule, applied by monkeypatching spec modules.

    ``patches(config)`` returns (module, attribute, replacement) triples.
    """

    name: str
    rule: str
    description: str
    patches: Patches


_CATALOGUE: list[Mutation] = []


def _mutation(name: str, rule: str, description: str) -> Callable[[Patches], Patches]:
    """Register the decorated ``patches`` function as the mutation ``name`` of ``rule``
    (``MUTATIONS`` keeps the order of definition)."""

    def register(patches: Patches) -> Patches:
        _CATALOGUE.append(Mutation(name, rule, description, patches))
        return patches

    return register


@contextlib.contextmanager
def applied(mutation: Mutation | None, config: EngineConfig) -> Iterator[None]:
    """Apply ``mutation`` for the duration of the block (None: the spec as written)."""
    if mutation is None:
        yield
        return
    saved = []
    try:
        for module, name, value in mutation.patches(config):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@_mutation("NoRefund", "R9", "undispatched charges are never refunded (the refund is reported but not applied)")
def _m_no_refund(config):
    return [(spec_limiter, "refund", lambda state, user, rate: state)]


@_mutation("DoubleRefund", "R9", "an undispatched charge is refunded twice")
def _m_double_refund(config):
    refund = spec_limiter.refund
    return [(spec_limiter, "refund", lambda state, user, rate: refund(refund(state, user, rate), user, rate))]


@_mutation("RefundDispatched", "R9", "dispatched charges are refunded too")
def _m_refund_dispatched(config):
    return [(spec, "sampling_dispatches", lambda cycle: frozenset())]


@_mutation("ChargePromptChunks", "R7", "every scheduled chunk is charged, intermediate prefill chunks included")
def _m_charge_prompt_chunks(config):
    return [
        (spec_rate, "samples", lambda request, n: True),
        (spec, "sampling_dispatches", lambda cycle: frozenset(rid for rid, _ in cycle.scheduled)),
    ]


@_mutation("ChargeFirstChunkInstead", "R7", "a prefill is charged at its first chunk, not at the sampling one")
def _m_charge_first_chunk(config):
    samples = spec_rate.samples

    def first_chunk(request, n):
        if request.num_output_tokens == 0 and request.num_output_placeholders == 0:
            return request.num_computed_tokens == 0
        return samples(request, n)

    def dispatched(cycle):
        out = set()
        for rid, n in cycle.scheduled:
            request = next(r for r in cycle.state.requests if r.request_id == rid)
            if first_chunk(request, n):
                out.add(rid)
        return frozenset(out)

    return [(spec_rate, "samples", first_chunk), (spec, "sampling_dispatches", dispatched)]


@_mutation("HeadOfLineBlocking", "R10", "a refused waiting request stops admission (vLLM 0.32's loop)")
def _m_head_of_line(config):
    visit = spec.visit_waiting

    def visit_waiting(cycle, request_id):
        if (
            cycle.state.config.rate_limited
            and cycle.token_budget > 0
            and len(cycle.state.running) < spec.admission_cap(cycle)
        ):
            request = next(r for r in cycle.state.requests if r.request_id == request_id)
            gated, proceed = spec_rate.waiting_gate(cycle, request)
            if not proceed:
                return gated, False  # vLLM 0.32: a waiting request given 0 tokens stops admission
        return visit(cycle, request_id)

    return [(spec, "visit_waiting", visit_waiting)]


@_mutation("NoPrefillAdvance", "R10", "a refused prefill waits instead of advancing to n-1")
def _m_no_prefill_advance(config):
    gate = spec_rate.waiting_gate

    def waiting_gate(cycle, request):
        cycle, proceed = gate(cycle, request)
        return cycle, proceed and request.user not in cycle.refused_users

    return [(spec_rate, "prefill_room", lambda request: 0), (spec_rate, "waiting_gate", waiting_gate)]


@_mutation("DropThrottled", "R11", "throttled running requests are preempted (KV freed) instead of kept")
def _m_drop_throttled(config):
    decide = spec_rate.decide_running

    def decide_running(cycle, request, n):
        was = cycle.throttled
        cycle, n = decide(cycle, request, n)
        if request.request_id in cycle.throttled - was:  # throttled now: preempt it (KV freed, recompute)
            cycle = spec_queues.preempt(cycle, request.request_id)
        return cycle, n

    return [(spec_rate, "decide_running", decide_running)]


@_mutation("ThrottledCountTowardCap", "R12", "admission counts throttled requests toward the active cap")
def _m_throttled_count_toward_cap(config):
    def admission_cap(cycle):
        return min(cycle.state.config.max_num_seqs, cycle.state.config.active_cap)

    return [(spec_rate, "admission_cap", admission_cap)]


@_mutation("NoActiveCapInRunningLoop", "R12", "the running loop ignores the active cap A")
def _m_no_active_cap(config):
    decide = spec_rate.decide_running

    def decide_running(cycle, request, n):
        saved = cycle.scheduled
        cycle, n = decide(replace(cycle, scheduled=()), request, n)
        return replace(cycle, scheduled=saved), n

    return [(spec_rate, "decide_running", decide_running)]


@_mutation("ThrottledNotPreferredVictims", "R13", "victim choice ignores throttling (vLLM's own choice)")
def _m_victims_ignore_throttled(config):
    return [(spec_rate, "preferred_victim", lambda cycle, request_id: None)]


@_mutation("NoRotation", "R14", "same-user streams are served in list order")
def _m_no_rotation(config):
    return [(spec_rate, "turn_order", lambda state: state.running)]


@_mutation(
    "RotateRunning", "R19", "rotation reorders `running` (the article's swap): budget is spent in the rotated order"
)
def _m_rotate_running(config):
    begin = spec_rate.begin_cycle

    def begin_cycle(cycle):  # the article's rotation: the turn order is applied to ``running``
        cycle = begin(cycle)
        return replace(cycle, state=replace(cycle.state, running=cycle.turn_order))

    return [(spec_rate, "begin_cycle", begin_cycle)]


@_mutation("BurstOneSecond", "R1/R2", "burst tolerance tau of 1 s instead of 100 ms")
def _m_burst_one_second(config):
    allows, try_take = spec_limiter.allows, spec_limiter.try_take
    return [
        (spec_limiter, "allows", lambda state, user, now, burst=0: allows(state, user, now, 10**9)),
        (spec_limiter, "try_take", lambda state, user, rate, now, burst=0: try_take(state, user, rate, now, 10**9)),
    ]


@_mutation("ReadyAtRoundedDown", "R5", "ready_at = floor(TAT - tau) instead of ceil")
def _m_ready_at_floor(config):
    def ready_at_ns(state, user, burst_ns=spec_limiter.BURST_NS):
        tat = state.tat_ns.get(user)
        return None if tat is None else math.floor(tat - burst_ns)

    return [(spec_limiter, "ready_at_ns", ready_at_ns)]


@_mutation("CleanupActiveUsers", "R6", "cleanup also forgets users whose TAT is up to tau ahead")
def _m_cleanup_active_users(config):
    cleanup = spec_limiter.cleanup_idle_users
    return [(spec_limiter, "cleanup_idle_users", lambda state, now: cleanup(state, now + config.burst_ns))]


@_mutation("BudgetPerRequest", "R1/P2", "the budget is kept per request, not per user")
def _m_budget_per_request(config):
    def try_charge(cycle, request):
        if request.request_id in cycle.refused_users:
            return cycle, False
        c = cycle.state.config
        limiter, granted = spec_limiter.try_take(
            cycle.state.limiter, request.request_id, c.rate_of(request.user), cycle.now_ns, c.burst_ns
        )
        if not granted:
            return replace(cycle, refused_users=cycle.refused_users | {request.request_id}), False
        # Refunds (R9) and the wait hint still go by user: move the charge there.
        user_limiter, _ = spec_limiter.try_take(limiter, request.user, c.rate_of(request.user), cycle.now_ns, 10**18)
        return replace(
            cycle, state=replace(cycle.state, limiter=user_limiter), charged=cycle.charged + (request.request_id,)
        ), True

    return [(spec_rate, "try_charge", try_charge)]


@_mutation("OverridesIgnored", "R1", "per-user rate overrides are ignored when charging")
def _m_overrides_ignored(config):
    try_take = spec_limiter.try_take
    default = config.default_rate_tokens_per_s

    def take(state, user, rate, now, burst=spec_limiter.BURST_NS):
        return try_take(state, user, default if default is not None else rate, now, burst)

    return [(spec_limiter, "try_take", take)]


@_mutation(
    "WaitHintFromLatestUser", "R16", "the wait hint is the ready time of the last refused user, not the earliest"
)
def _m_wait_hint_latest(config):
    end_cycle = spec_rate.end_cycle

    def end(cycle, dispatched):
        state, settled = end_cycle(cycle, dispatched)
        order = [r.user for r in cycle.state.requests]  # arrival order, not names (the checker renames)
        users = sorted(cycle.refused_users, key=lambda u: order.index(u) if u in order else -1)
        ready = [spec_limiter.ready_at_ns(state.limiter, u, state.config.burst_ns) for u in users]
        ready = [t for t in ready if t is not None]
        settled["wait_hint_ns"] = ready[-1] if ready else None
        return state, settled

    return [(spec_rate, "end_cycle", end)]


MUTATIONS: tuple[Mutation, ...] = tuple(_CATALOGUE)  # definition order: the order of docs/SPEC_MUTATIONS.md


MUTATION_PROFILE = "mutations"  # the manifest profile whose scopes judge the mutations


@dataclass
class MutationRow:
    mutation: str
    rule: str
    description: str
    caught_by: dict[str, tuple[int, str]]  # check id -> (shortest length, scope)
    seconds: float
    example: Violation | None = None
    example_scope: str | None = None
    example_clean: bool | None = None  # the unmutated spec passes every invariant on the example's events

    @property
    def caught_by_original(self) -> dict[str, tuple[int, str]]:
        return {c: v for c, v in self.caught_by.items() if c not in NEW_CHECKS}


def run_mutation(mutation: Mutation | None, scopes: list[Scope], max_states: int = 300_000) -> MutationRow:
    """Explore each scope with ``mutation`` applied; collect every check that fires with a
    counterexample rebuilt from concrete events (others are not counted)."""
    started = time.perf_counter()
    caught: dict[str, tuple[int, str]] = {}
    example: Violation | None = None
    example_scope = None
    for scope in scopes:
        with applied(mutation, scope.config):
            result = explore(scope, max_states=max_states, raise_on_bound=False, strict=False)
        for v in result.violations.values():
            if not v.concrete:
                continue
            if v.check not in caught or v.length < caught[v.check][0]:
                caught[v.check] = (v.length, scope.name)
            if example is None or (v.length, CHECK_IDS.index(v.check)) < (
                example.length,
                CHECK_IDS.index(example.check),
            ):
                example, example_scope = v, scope.name
    name = mutation.name if mutation else "(spec as written)"
    clean = None
    if example is not None:
        config = next(s for s in scopes if s.name == example_scope).config
        clean = official_verdict(config, example.events) is None
    return MutationRow(
        name,
        mutation.rule if mutation else "-",
        mutation.description if mutation else "-",
        caught,
        time.perf_counter() - started,
        example,
        example_scope,
        clean,
    )


def _mutation_worker(name: str) -> MutationRow:
    scopes = profile_scopes(MUTATION_PROFILE)
    mutation = None if name == "-" else next(m for m in MUTATIONS if m.name == name)
    return run_mutation(mutation, scopes)


def run_mutations(
    jobs: int = 2, names: list[str] | None = None, on_row: Callable[[MutationRow], None] | None = None
) -> list[MutationRow]:
    """The mutation table: the spec as written first (must be clean), then each mutation."""
    wanted = ["-"] + [m.name for m in MUTATIONS if names is None or m.name in names]
    context = multiprocessing.get_context("fork")
    rows: dict[str, MutationRow] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        for name, row in zip(wanted, pool.map(_mutation_worker, wanted)):
            rows[name] = row
            if on_row is not None:
                on_row(row)
    return [rows[n] for n in wanted]


def _fmt_caught(caught: dict[str, tuple[int, str]]) -> str:
    if not caught:
        return "**nothing**"
    return ", ".join(
        f"{c} ({n})" for c, (n, _) in sorted(caught.items(), key=lambda kv: (kv[1][0], CHECK_IDS.index(kv[0])))
    )


def _markdown_head(scopes: list[Scope]) -> list[str]:
    """The lines of docs/SPEC_MUTATIONS.md above the mutation rows: what the table is, the
    checks the model checker added, and the table's header."""
    return [
        "# Spec mutations: what the model checker catches",
        "",
        "Generated by `python -m vllm_output_rate.proofs.modelcheck --mutations` "
        "(proofs/modelcheck.py); do not edit by hand.",
        "",
        "Each row applies one small change to one rule of the executable spec (spec/rate.py, "
        "spec/limiter.py, spec/scheduler.py, by monkeypatching for the duration of the run) and runs the "
        f"explicit-state model checker on the {len(scopes)} scopes of the manifest profile `{MUTATION_PROFILE}` "
        f"({', '.join(f'`{s.name}`' for s in scopes)}; proofs/modelcheck_scopes.json). "
        "*Caught by* lists every check that fires, with the length in events of its shortest "
        "counterexample over those scopes. Only counterexamples rebuilt as concrete event sequences from "
        "the real initial state are counted (the checker's state reductions assume the spec ignores names "
        "and absolute time; a counterexample that cannot be rebuilt would be an artefact of that assumption).",
        "",
        "*Before the checker* restricts the column to the properties the spec had before: invariants I1-I12, "
        "assertions inside the spec, liveness. The rows where it says **nothing** are the missing properties "
        "this table exposed; each got one check, all sound on the spec as written (first row; the quick, ci "
        "and release profiles; the fidelity tests against real vLLM):",
        "",
        "| check | property | rules | where |",
        "|---|---|---|---|",
        "| I13 | each user's TAT equals the GCRA replay of its sampling dispatches (up to idle): the limiter "
        "charged exactly what was dispatched, net of refunds | R4, R7, R9 | spec/invariants.py |",
        "| I14 | the wait hint is some user's ready time `ceil(TAT - tau)`, no later than any throttled user's "
        "| R5, R16 | spec/invariants.py |",
        "| I15 | a request throttled at the start of a step is preempted before any other (PRIORITY: of the "
        "victim's priority) | R13 | spec/invariants.py |",
        "| I16 | a step preempts only if KV really ran short (survivors' blocks + last victim's need exceed the "
        "pool) | R11, V6 | spec/invariants.py |",
        "| I17 | a waiting request is admitted unless its user is refused and it cannot prefill, or admission "
        "stopped at or before it (budget, seats `min(M, A + throttled)`, KV) | R10, R12, P4 | "
        "spec/invariants.py |",
        "| F1 | bounded bypass: a throttled stream is passed over by streams of its own (user, priority) group at "
        "most (streams per user - 1) steps in a row | R14 | proofs/modelcheck.py (needs a counter per stream "
        "across steps) |",
        "| R6 | cleanup at any instant leaves the limiter unchanged up to idle users (what lets the checker "
        "drop the 256-step cadence) | R6 | proofs/modelcheck.py |",
        "",
        "Other checks: `I1`-`I12` spec/invariants.py (I7 evaluated exactly in ledger form by the checker, "
        "confirmed by `invariants.i7_window_bound` on replay); `assert` an assertion inside the spec; "
        "`liveness-a` every request not aborted can still finish by steps and clock advances; "
        "`liveness-b` work is left but nothing can ever be scheduled again.",
        "",
        "| mutation | rule | change | caught by (shortest counterexample, events) | before the checker | shortest |",
        "|---|---|---|---|---|---|",
    ]


def _example_lines(rows: list[MutationRow]) -> list[str]:
    """One section per row with a counterexample: its check, scope, message, whether the
    unmutated spec passes the same events, and the numbered events."""
    lines: list[str] = []
    for row in rows:
        if row.example is None:
            continue
        clean = "passes" if row.example_clean else "**fails**"
        lines += [
            f"### {row.mutation} ({row.rule}) -- {row.example.check}, scope `{row.example_scope}`",
            "",
            f"{row.example.message}",
            "",
            f"Spec as written on these events: {clean}.",
            "",
            "```",
        ]
        lines += [f"{i:3d} {e}" for i, e in enumerate(row.example.events)]
        lines += ["```", ""]
    return lines


def mutations_markdown(rows: list[MutationRow], scopes: list[Scope], seconds: float) -> str:
    """docs/SPEC_MUTATIONS.md from the rows (regenerate: ``python -m
    vllm_output_rate.proofs.modelcheck --mutations``)."""
    lines = _markdown_head(scopes)
    for row in rows:
        shortest = min((n for n, _ in row.caught_by.values()), default=None)
        lines.append(
            f"| {row.mutation} | {row.rule} | {row.description} | {_fmt_caught(row.caught_by)} | "
            f"{_fmt_caught(row.caught_by_original)} | {'-' if shortest is None else shortest} |"
        )
    lines += [
        "",
        "Notes. CleanupActiveUsers: the spec runs cleanup every 256 `schedule()` calls, which the scopes' "
        "canonical states never count to, so without the R6 check only a 256-step run could show the extra "
        "grants (I7). OverridesIgnored charges the overridden user (20 tok/s) at the default 3 tok/s: it "
        "under-grants, which an upper bound such as I7 cannot see; I13 sees the wrong charge at once. "
        "BudgetPerRequest over-grants, which I7 sees once a second stream of the user samples.",
        "",
        "## Shortest counterexamples",
        "",
        "Each is a `StepScenario` event sequence (adapter/fidelity.py), rebuilt from the real initial state. "
        "The message is the mutated spec's; *spec as written* says whether the unmutated spec passes every "
        "invariant of spec/invariants.py on the same events (it must: the sequence is a legal scenario).",
        "",
    ]
    lines += _example_lines(rows)
    lines += [f"Run time: {seconds:.0f} s on 2 processes.", ""]
    return "\n".join(lines)
