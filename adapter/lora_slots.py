"""LoRA slots for any candidate, black-box (gate rows ``lora-slots/{sync,async}``, level should).

The LoRA load of issue 13: ``--enable-lora --max-loras`` K; user "slow" (a rate its long
streams exhaust at once, so it is throttled most steps) decodes on adapters 1..K, holding
every slot while resident (R11); user "fast" (a rate its few tokens never exhaust) then
sends requests on adapter K + 1, and sometimes on adapter 1 too. Resources are ample (KV
blocks, token budget, seats). After every ``schedule()`` the candidate must:

- not crash (level must): vLLM 0.32 counts only the scheduled running requests' adapters,
  so a candidate that admits another adapter beside a throttled holder fails vLLM's own
  ``assert len(scheduled_loras) <= max_loras`` in the next step, and every request on the
  engine dies;
- dispatch each "fast" request to sample within ``BOUND_STEPS`` steps of its arrival
  (level should): docs/SPEC.md Decision "LoRA slots" (R13) preempts a throttled holder of
  the slot another user's request needs, in the first step its user is refused; the slow
  user is refused in at least 3 of any 4 consecutive steps here (at most 0.25 grants per
  step after its burst), so the bound leaves room for the grant steps. A candidate that
  only counts the throttled holder's adapter (as vLLM 0.33 does) makes "fast" wait until
  the slow streams end, seconds later;
- and, after the scenario, finish every request with exactly its ``max_tokens`` outputs
  (level must, P3: a preempted holder resumes, nothing is cut).

Fixtures that fail it: ``tests/fixtures/lora_candidates.py`` (no victim: starves; no
victim and vLLM 0.32's own count: crashes on 0.32).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter.fidelity import StepScenario, engine_shape
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.residency import HuntedCheck, p3_verdict
from vllm_output_rate.adapter.scenarios import Verdict
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, Drain, Event, Step
from vllm_output_rate.spec.state import EngineConfig

SLOW_USER = "slow"
FAST_USER = "fast"
FAST_RATE = "1000"  # tokens/s: 101 grants from idle, above any demand drawn here
SLOW_RATES = ("1", "2", "5")  # x at most 50 ms per step: <= 0.25 grants per step after the burst
BOUND_STEPS = 8  # a fast request samples within this many steps of its arrival (module docstring)
DRAIN_STEPS = 3000
DRAIN_INTERVAL_NS = 50_000_000


class LoraScenario(StepScenario):
    """A LoRA-slot scenario: the engine configuration (``max_loras`` set) and events; saved
    as a plain step scenario."""

    def config_line(self) -> str:
        c = self.config
        return (
            f"config: max_loras={c.max_loras} max_num_seqs={c.max_num_seqs} budget={c.max_num_batched_tokens} "
            f"chunked={c.chunked_prefill} async={c.async_scheduling} policy={c.policy} rates: {SLOW_USER}="
            f"{dict(c.user_rates_tokens_per_s).get(SLOW_USER)} {FAST_USER}={FAST_RATE}"
        )


@st.composite
def lora_scenarios(draw, async_scheduling: bool) -> LoraScenario:
    """Hypothesis strategy: the LoRA load (module docstring), resources ample."""
    max_loras = draw(st.integers(1, 2))
    slow = [
        (draw(st.integers(1, max_loras)), draw(st.integers(1, 12)), draw(st.integers(12, 30)))
        for _ in range(draw(st.integers(max_loras, max_loras + 2)))
    ]
    fast = [
        (draw(st.sampled_from((max_loras + 1, max_loras + 1, 1))), draw(st.integers(1, 12)), draw(st.integers(1, 6)))
        for _ in range(draw(st.integers(1, 3)))
    ]
    arrive = draw(st.integers(2, 6))
    num_steps = arrive + BOUND_STEPS + draw(st.integers(0, 6))
    requests = slow + fast
    config = EngineConfig(
        max_num_seqs=len(requests),
        max_num_batched_tokens=512,
        chunked_prefill=draw(st.booleans()),
        block_size=16,
        num_blocks=1 + sum(-(-(p + m + 1) // 16) for _, p, m in requests) + 4,
        async_scheduling=async_scheduling,
        max_model_len=512,
        default_rate_tokens_per_s=Fraction(FAST_RATE),
        user_rates_tokens_per_s=((SLOW_USER, Fraction(draw(st.sampled_from(SLOW_RATES)))),),
        max_loras=max_loras,
    )
    interval_ns = draw(st.sampled_from((10, 20, 50))) * 1_000_000
    events: list[Event] = [AddRequest(f"s{i}", SLOW_USER, 0, p, m, None, lora) for i, (lora, p, m) in enumerate(slow)]
    for step in range(num_steps):
        if step == arrive:
            events += [AddRequest(f"f{i}", FAST_USER, 0, p, m, None, lora) for i, (lora, p, m) in enumerate(fast)]
        events += [Step(), AdvanceClock(interval_ns)]
    return LoraScenario(config, tuple(events))


class _SlotBound:
    """R13 (LoRA)'s bound during one run: each request of ``FAST_USER`` samples within
    ``BOUND_STEPS`` steps of its arrival (``arrived``: request id -> step before which it
    was added, until it samples)."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self.arrived: dict[str, int] = {}  # fast request -> step before which it was added

    def judge(self, trace, steps: int) -> str | None:
        """After step ``steps``: None, or the failure naming the first fast request past the bound."""
        arrived = self.arrived
        for rid in trace.sampled:
            arrived.pop(rid, None)
        late = sorted(rid for rid, at in arrived.items() if steps - at >= BOUND_STEPS)
        if late:
            return (
                f"R13 (LoRA): {late[0]} of user {FAST_USER!r} has not sampled {BOUND_STEPS} steps after it "
                f"arrived (step {arrived[late[0]]}): the throttled user {SLOW_USER!r} holds the adapter slots "
                f"(max_loras={self.max_loras}) it needs; a throttled holder must give way "
                '(docs/SPEC.md, Decision "LoRA slots")'
            )
        return None


def _apply(harness: Harness, bound: _SlotBound, max_tokens: dict[str, int], steps: int, event: Event) -> None:
    """A scenario event other than ``Step`` (a request added, the clock advanced, a drain) on
    the candidate after ``steps`` steps; an added request noted in ``max_tokens`` (request id
    -> output tokens) and, for ``FAST_USER``, in ``bound``."""
    if isinstance(event, AddRequest):
        harness.add_request(
            event.request_id,
            event.user,
            event.prompt_len,
            event.max_tokens,
            event.eos_index,
            event.priority,
            lora=event.lora,
        )
        max_tokens[event.request_id] = event.max_tokens
        if event.user == FAST_USER:
            bound.arrived[event.request_id] = steps
    elif isinstance(event, AdvanceClock):
        harness.advance(event.delta_ns)
    elif isinstance(event, Drain):
        harness.drain()


def run_lora(scheduler_cls: str, scenario: LoraScenario, style: Any = None, late: list | None = None) -> Verdict:
    """The LoRA-slot properties (module docstring) on one scenario. A crash of the
    candidate (or of vLLM inside its ``schedule()``) propagates to the caller.

    ``late`` None: the bound (level should) ends the run with its verdict. A list: the first
    bound failure of the whole hunt is appended to it as ``(scenario, failure, step)`` and
    the run goes on, so that a crash or a cut request (level must) later in it is still
    found (``LoraCheck``)."""
    harness = Harness(scheduler_cls, engine_shape(scenario.config), style=style)
    bound = _SlotBound(scenario.config.max_loras)
    max_tokens: dict[str, int] = {}
    steps = 0
    judging = True
    for event in scenario.events:
        if not isinstance(event, Step):
            _apply(harness, bound, max_tokens, steps, event)
        else:
            trace = harness.step()
            steps += 1
            failure = bound.judge(trace, steps) if judging else None
            if failure is not None and late is None:
                return Verdict(steps, failure, step=steps - 1, level="should")
            if failure is not None and late is not None:  # kept aside; the rest is judged for level must only
                judging = False
                if not late:
                    late.append((scenario, failure, steps - 1))
    for _ in range(DRAIN_STEPS):
        if len(harness.finished) == len(max_tokens):
            break
        harness.step()
        steps += 1
        harness.advance(DRAIN_INTERVAL_NS)
    if scenario.config.async_scheduling:
        harness.drain()
    return p3_verdict(harness.finished, max_tokens, steps, DRAIN_STEPS, level="must")


#: ``run_lora`` on seeded LoRA scenarios; a failure is shrunk by Hypothesis and saved;
#: rows ``lora-slots/{sync,async}`` (level should; a crash is a must).
_HUNTED = HuntedCheck(
    "lora-slots",
    ("R11", "R13"),
    "should",
    lora_scenarios,
    run_lora,
    rule="R13",
    crash_note=" (with LoRA requests every request on the engine fails)",
)


class LoraCheck:
    """The ``lora-slots/*`` rows. The bound is this project's decision (docs/SPEC.md,
    Decision "LoRA slots"; a warning at should, ``adapter/origins.py``), a crash or a cut
    request an article promise: below level exact the hunt does not stop at a bound failure
    (``run_lora(late=...)``) but looks on for a crash through the whole budget, so a
    candidate that both starves the other user and trips vLLM's ``max_loras`` assertion is
    reported for the crash. With no crash, the bound failure is hunted again, stopping at it,
    so that Hypothesis shrinks it. Called as ``HuntedCheck`` is; ``judge`` is its replay."""

    def __call__(self, scheduler_cls: str, async_mode: bool, hunt: Any, style: Any = None, level: str | None = None):
        if (level or _HUNTED.level) == "exact":
            return _HUNTED(scheduler_cls, async_mode, hunt, style, level)
        late: list = []

        def run_deferred(cls: str, scenario: LoraScenario, st: Any = None) -> Verdict:
            return run_lora(cls, scenario, st, late=late)

        deferred = replace(_HUNTED, run=run_deferred)
        result = deferred(scheduler_cls, async_mode, hunt, style, level)
        if result.result != "pass" or not late:
            return result
        shrunk = _HUNTED(scheduler_cls, async_mode, replace(hunt, tick=lambda: None), style, level)
        if shrunk.result != "fail":  # not found again in the same draws: report it as first seen
            scenario, failure, step = late[0]
            shrunk.result, shrunk.failed_level, shrunk.minimal = "fail", "should", False
            shrunk.failure = f"[should] R13: step {step}: {failure}"
            shrunk.counterexample = scenario.lines()
        for name in ("result", "failure", "failed_level", "counterexample", "saved", "minimal"):
            setattr(result, name, getattr(shrunk, name))
        return result

    def judge(self, scheduler_cls: str, scenario: Any, style: Any = None, level: str | None = None) -> Verdict:
        """The row's verdict on one saved scenario (``HuntedCheck.judge``)."""
        return _HUNTED.judge(scheduler_cls, scenario, style, level)

    def __getattr__(self, name: str) -> Any:  # row, rules, level, ... as the HuntedCheck's
        return getattr(_HUNTED, name)


check_lora = LoraCheck()
