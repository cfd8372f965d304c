"""R20 for any candidate: fair residency, black-box (gate rows ``fair-residency/{sync,async}``, level exact).

The flood of issue 13: one user ("flood", a slow rate, throttled most steps) opens more
streams than the engine has resident slots (``max_num_seqs`` M); another user ("other",
a rate its few tokens can never exhaust) sends its requests a few steps later. With
``output_rate.max_num_seqs_per_user`` C configured (C <= M // 2, so that both users at
their cap still leave a slot), the candidate must, after every ``schedule()``:

- never let a user hold more than C resident requests (admitted from waiting and not yet
  preempted or finished, as ``SchedulerOutput`` and the outputs show them);
- admit another user's waiting request in the first step in which its user holds fewer
  than C and fewer than M requests are resident, unless that step preempted (V7) or
  spent the whole token budget: the scenario makes KV blocks, the token budget and the
  other user's rate ample, so nothing else can hold it back. This is the bound of
  docs/SPEC.md R20 (admission delay: 1 step once a slot is free), the model checker's F2;
- and, after the scenario, finish every request with exactly its ``max_tokens`` outputs
  (P3: the cap delays, it never cuts).

Without the cap the article's behaviour fails it (the flood's throttled streams hold
every slot and the other user waits until one of them finishes): ``NoResidencyCap`` in
``tests/fixtures/r20_candidates.py``. A candidate whose configuration style has no
per-user residency cap (``engine-args``, ``hook:``: the article's flags have none) is
NOT TESTED by these rows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter.configstyle import AdditionalConfigStyle
from vllm_output_rate.adapter.conform import _hunt, _save_counterexample
from vllm_output_rate.adapter.fidelity import StepScenario, engine_shape
from vllm_output_rate.adapter.gate_errors import exception_text, reraise_gate_error
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.scenarios import Hunt, Verdict
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Drain, Event, Step
from vllm_output_rate.spec.properties import first_cut
from vllm_output_rate.spec.state import EngineConfig

FLOOD_USER = "flood"
OTHER_USER = "other"
OTHER_RATE = "1000"  # tokens/s: floor(0.1 x 1000) + 1 = 101 grants from idle, above any demand drawn here
DRAIN_STEPS = 4000  # bound on the steps after a scenario for every request to finish
DRAIN_INTERVAL_NS = 50_000_000


class ResidencyScenario(StepScenario):
    """A flood scenario: the engine configuration (spec ``EngineConfig``, C set) and events;
    saved as a plain step scenario."""

    def config_line(self) -> str:
        c = self.config
        return (
            f"config: max_num_seqs={c.max_num_seqs} max_num_seqs_per_user={c.max_num_seqs_per_user} "
            f"budget={c.max_num_batched_tokens} chunked={c.chunked_prefill} async={c.async_scheduling} "
            f"blocks={c.num_blocks}x{c.block_size} rates: {FLOOD_USER}="
            f"{dict(c.user_rates_tokens_per_s).get(FLOOD_USER)} {OTHER_USER}={OTHER_RATE}"
        )


@st.composite
def flood_scenarios(draw, async_scheduling: bool) -> ResidencyScenario:
    """Hypothesis strategy: the flood shape (module docstring), resources ample."""
    max_num_seqs = draw(st.integers(2, 6))
    cap = draw(st.integers(1, max_num_seqs // 2))
    chunked = draw(st.booleans())
    flood = [(draw(st.integers(1, 8)), draw(st.integers(4, 24))) for _ in range(max_num_seqs + draw(st.integers(1, 4)))]
    other = [(draw(st.integers(1, 8)), draw(st.integers(1, 12))) for _ in range(draw(st.integers(1, 3)))]
    arrive = draw(st.integers(1, 6))
    num_steps = arrive + draw(st.integers(4, 20))
    block_size = 16
    blocks = 1 + sum(math.ceil((p + m + 1) / block_size) for p, m in flood + other)
    max_model_len = 128
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_model_len if not chunked else max(16, sum(p for p, _ in flood + other) + 8),
        chunked_prefill=chunked,
        block_size=block_size,
        num_blocks=blocks + 4,
        async_scheduling=async_scheduling,
        max_model_len=max_model_len,
        default_rate_tokens_per_s=Fraction(OTHER_RATE),
        user_rates_tokens_per_s=((FLOOD_USER, Fraction(draw(st.sampled_from(("2", "5", "10"))))),),
        max_num_seqs_per_user=cap,
    )
    interval_ns = draw(st.sampled_from((5, 10, 20, 50))) * 1_000_000
    events: list[Event] = [AddRequest(f"f{i}", FLOOD_USER, 0, p, m, None) for i, (p, m) in enumerate(flood)]
    for step in range(num_steps):
        if step == arrive:
            events += [AddRequest(f"o{i}", OTHER_USER, 0, p, m, None) for i, (p, m) in enumerate(other)]
        events += [Step(), AdvanceClock(interval_ns)]
    return ResidencyScenario(config, tuple(events))


class _Books:
    """What the gate knows from outside: resident and waiting requests, by user."""

    def __init__(self) -> None:
        self.user: dict[str, str] = {}
        self.max_tokens: dict[str, int] = {}
        self.resident: set[str] = set()
        self.waiting: set[str] = set()

    def finish(self, trace) -> None:
        for rid in trace.finished:
            self.resident.discard(rid)
            self.waiting.discard(rid)


def _apply(harness: Harness, books: _Books, event: Event) -> None:
    """A scenario event other than ``Step`` (a request added, the clock advanced, a drain)
    on the candidate, noted in ``books``."""
    if isinstance(event, AddRequest):
        harness.add_request(
            event.request_id, event.user, event.prompt_len, event.max_tokens, event.eos_index, event.priority
        )
        books.user[event.request_id] = event.user
        books.max_tokens[event.request_id] = event.max_tokens
        books.waiting.add(event.request_id)
    elif isinstance(event, AdvanceClock):
        harness.advance(event.delta_ns)
    elif isinstance(event, Drain):
        trace = harness.drain()
        if trace is not None:
            books.finish(trace)


def run_residency(scheduler_cls: str, scenario: ResidencyScenario, style: Any = None) -> Verdict:
    """R20 (level exact) on one flood scenario (module docstring)."""
    config = scenario.config
    cap, seats = config.max_num_seqs_per_user, config.max_num_seqs
    assert cap is not None and 2 * cap <= seats, "R20 gate: the flood shape needs C <= M // 2"
    harness = Harness(scheduler_cls, engine_shape(config), style=style)
    books = _Books()
    steps = 0
    for event in scenario.events:
        if not isinstance(event, Step):
            _apply(harness, books, event)
        else:
            failure = _judge_step(harness, books, cap, seats, config.max_num_batched_tokens)
            steps += 1
            if failure is not None:
                return Verdict(steps, failure, step=steps - 1)
    for _ in range(DRAIN_STEPS):
        if len(harness.finished) == len(books.user):
            break
        failure = _judge_step(harness, books, cap, seats, config.max_num_batched_tokens)
        steps += 1
        if failure is not None:
            return Verdict(steps, failure, step=steps - 1)
        harness.advance(DRAIN_INTERVAL_NS)
    if config.async_scheduling:
        trace = harness.drain()
        if trace is not None:
            books.finish(trace)
    return p3_verdict(harness.finished, books.max_tokens, steps, DRAIN_STEPS, " (the cap delays, it never cuts)")


def p3_verdict(
    finished: dict[str, tuple[str, int]],
    max_tokens: dict[str, int],
    steps: int,
    drain_steps: int,
    note: str = "",
    rule: str | None = None,
    level: str | None = None,
) -> Verdict:
    """P3 once a scenario and its drain are over: ``Verdict(steps)`` if every request of
    ``max_tokens`` (id -> output tokens) ended in ``finished`` (id -> (finish status, output
    tokens)) with exactly its ``max_tokens``, else a failure naming the first that did not
    within ``drain_steps`` steps after the scenario (``note`` appended: why nothing may be
    cut), named ``rule`` at ``level``."""
    cut = first_cut(finished, max_tokens)
    if cut is None:
        return Verdict(steps)
    rid, got = cut
    return Verdict(
        steps,
        f"P3: {rid} ended with {got!r}, expected ('length', {max_tokens[rid]}) within "
        f"{drain_steps} steps after the scenario{note}",
        rule,
        level=level,
    )


def _judge_step(harness, books: _Books, cap: int, seats: int, budget: int) -> str | None:
    """One step on the candidate, then R20's two properties against what it exposed."""
    waiting_before = set(books.waiting)
    trace = harness.step()
    for rid in trace.preempted:
        if rid in books.resident:
            books.resident.discard(rid)
            books.waiting.add(rid)
    for rid in trace.admitted:
        books.waiting.discard(rid)
        books.resident.add(rid)
    held = Counter(books.user[rid] for rid in books.resident)
    over = sorted(u for u, n in held.items() if n > cap)
    if over:
        mine = sorted(rid for rid in books.resident if books.user[rid] == over[0])
        return f"R20: user {over[0]!r} holds {held[over[0]]} resident requests {mine} > max_num_seqs_per_user={cap}"
    spent = sum(trace.scheduled.values()) >= budget
    if not trace.preempted and not spent and len(books.resident) < seats:
        owed = sorted(
            rid for rid in waiting_before & books.waiting if books.user[rid] == OTHER_USER and held[OTHER_USER] < cap
        )
        if owed:
            return (
                f"R20: {owed[0]} of user {OTHER_USER!r} is still waiting although its user holds "
                f"{held[OTHER_USER]} < max_num_seqs_per_user={cap} resident requests, {len(books.resident)} of "
                f"max_num_seqs={seats} slots are taken ({held[FLOOD_USER]} by {FLOOD_USER!r}), nothing was "
                "preempted and the token budget was not spent: one user's flood must not hold back another "
                "user's admission"
            )
    books.finish(trace)
    return None


def style_has_output_rate(style: Any) -> bool:
    """The candidate is configured through ``additional_config["output_rate"]`` (where
    ``max_num_seqs_per_user`` and ``rates_file`` live); other styles (the article's flags)
    have no such keys."""
    return style is None or isinstance(style, AdditionalConfigStyle)


@dataclass(frozen=True)
class HuntedCheck:
    """A gate row of Hypothesis-shrunk step scenarios, described as data (R20
    ``fair-residency/*``, R21 ``rate-change/*``, ``lora-slots/*``).

    ``row``: the row's name before ``/sync`` or ``/async``; ``rules``: the rules it covers;
    ``level``: the level it judges at; ``strategy(async_mode)``: the scenarios it draws;
    ``run(scheduler_cls, scenario, style) -> Verdict``; ``rule``: the rule every failure is
    named (None: the verdict's own); ``needs_output_rate``: the NOT TESTED reason for a
    configuration style without ``additional_config["output_rate"]`` (None: every style
    runs the row); ``crash_note``: appended to a crash's message.

    Called as ``check(scheduler_cls, async_mode, hunt, style=None, level=None)``:
    ``hunt_row`` on ``hunt.examples`` seeded scenarios (``adapter/scenarios.Hunt``; its
    ``max_steps`` unused: the row's scenarios have their own bound), ``hunt.tick()`` after
    each, a failure saved in ``hunt.save_dir`` (None: not saved); ``level`` None judges at
    the row's ``level``. Returns the ``adapter.gate_result.CheckResult`` row.
    """

    row: str
    rules: tuple[str, ...]
    level: str
    strategy: Callable[[bool], Any]
    run: Callable[[str, Any, Any], Verdict]
    rule: str | None
    needs_output_rate: str | None = None
    crash_note: str = ""

    def __call__(self, scheduler_cls: str, async_mode: bool, hunt: Hunt, style: Any = None, level: str | None = None):
        level = level or self.level
        result = CheckResult(f"{self.row}/{'async' if async_mode else 'sync'}", list(self.rules), level=level)
        if self.needs_output_rate is not None and not style_has_output_rate(style):
            result.result = "not tested"
            result.failure = self.needs_output_rate
            return result
        return hunt_row(
            result,
            self.strategy(async_mode),
            lambda scenario: self.run(scheduler_cls, scenario, style),
            scheduler_cls,
            hunt.examples,
            hunt.seed,
            hunt.tick,
            hunt.save_dir,
            rule=self.rule,
            level=level,
            crash_note=self.crash_note,
        )

    def judge(self, scheduler_cls: str, scenario: Any, style: Any = None, level: str | None = None) -> Verdict:
        """The row's verdict on one saved scenario (``outrate replay``), named and levelled
        as in the hunt (``judged``): a crash of the candidate is a ``crash`` at level must."""

        def run_one(one: Any) -> Verdict:
            return self.run(scheduler_cls, one, style)

        return judged(run_one, scheduler_cls, self.rule, level or self.level, self.crash_note)(scenario)


#: R20 (level exact): ``run_residency`` on seeded flood scenarios; a failure is shrunk by
#: Hypothesis and saved; rows ``fair-residency/{sync,async}``.
check_residency = HuntedCheck(
    "fair-residency",
    ("R20",),
    "exact",
    flood_scenarios,
    run_residency,
    rule="R20",
    needs_output_rate=(
        "the candidate's configuration style has no per-user residency cap "
        "(output_rate.max_num_seqs_per_user): the article's flags do not name one"
    ),
)


def judged(
    run_one: Callable[[Any], Verdict], scheduler_cls: str, rule: str | None, level: str, crash_note: str = ""
) -> Callable[[Any], Verdict]:
    """``run_one(scenario)`` as a ``HuntedCheck`` row judges it: a failure named ``rule``
    (None: the verdict's own) at its own level or else ``level``; an exception of the
    candidate (or of vLLM inside it) a ``crash`` at level must, ``crash_note`` appended to
    its message; a gate error re-raised."""

    def run(scenario):
        try:
            verdict = run_one(scenario)
        except Exception as exc:  # the candidate's own error is a finding
            reraise_gate_error(exc)
            return Verdict(
                0,
                f"{scheduler_cls.rpartition('.')[2]} raised {exception_text(exc)}{crash_note}",
                "crash",
                None,
                level="must",
            )
        failed_level = (verdict.level or level) if verdict.failure else None
        return Verdict(
            verdict.steps,
            verdict.failure,
            (rule or verdict.rule) if verdict.failure else None,
            verdict.step,
            level=failed_level,
        )

    return run


def hunt_row(
    result,
    strategy,
    run_one: Callable[[Any], Verdict],
    scheduler_cls: str,
    examples: int,
    seed: int,
    tick: Callable[[], None],
    save_dir: Path | None,
    rule: str | None,
    level: str,
    crash_note: str = "",
):
    """Fill the gate row ``result`` (``gate_result.CheckResult``) from ``examples`` seeded
    scenarios of ``strategy``, each judged by ``run_one(scenario)`` (a ``Verdict``; its
    failure is named ``rule``, or its own rule if ``rule`` is None, at its own level or
    else ``level``). An exception of
    the candidate (or of vLLM inside it) is a ``crash`` at level must (``crash_note`` is
    appended to its message); a gate error is re-raised. A failure is shrunk by
    Hypothesis, printed as ``[level] rule: step N: ...`` and saved. Returns ``result``."""
    run = judged(run_one, scheduler_cls, rule, level, crash_note)
    failed = _hunt(result, strategy, run, examples, seed, tick)
    if failed is not None:
        scenario, verdict = failed
        result.result = "fail"
        result.failed_level = verdict.level
        where = f"step {verdict.step}: " if verdict.step is not None else ""
        result.failure = f"[{verdict.level}] {verdict.rule}: {where}{verdict.failure}"
        result.counterexample = scenario.lines()
        result.minimal = False  # Hypothesis-shrunk only
        _save_counterexample(result, scenario, save_dir)
    return result
