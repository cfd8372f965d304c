"""R21 for any candidate: rates changed without a restart, black-box, judged by the spec
(gate rows ``rate-change/{sync,async}``; level exact, or must with ``--rate-change``).

The candidate is configured with ``output_rate.rates_file``; the scenario writes a new rate
table to it before some step (``Harness.change_rates``, atomically), which the candidate
must apply at the start of its next ``schedule()``, at that step's clock reading (R21).
Users: two with overrides and one on the default, 1-3 streams each; changes move a user
to or from the default, change the default, raise and lower rates (0.5-200 tok/s), 1-3
changes per scenario; ample token budget, KV blocks and seats, so only the limit can
pause a request. After every step the gate replays it through the spec limiter
(``spec/limiter.py``) with R21 applied at the change (``limiter.change_rates``):

- R21/R2 grant: each user's sampling dispatches of the step, replayed as ``try_take`` at
  the step's instant, are all granted: a candidate that hands out a burst at the change
  (TAT reset to now) or forgives debt (TAT kept while the rate falls), or ignores a lower
  rate, over-grants here;
- R21/R11 pause only when refused (sync): a user with an unfinished request that did not
  sample in the step is refused one more take by the spec: a candidate that ignores a
  higher rate, or adds debt at the change, under-grants here;
- R21 window bound: every window of a user's dispatches holds the piecewise bound
  ``floor(sum(segment x rate) + tau x max rate) + 1`` (``limiter.piecewise_window_bound_tokens``);
- P3: every request ends with exactly its ``max_tokens`` outputs.

Level: the article has no live rate change, so by default these rows judge only at
``exact`` (a candidate of the article is never failed for lacking it); a candidate that
declares the rates file (``--rate-change``, ``GateOptions.rate_change``) is judged at every
level. A configuration style without ``output_rate`` (``engine-args``, ``hook:``) is NOT
TESTED. Counterexamples are Hypothesis-shrunk and saved like the other rows.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import defaultdict
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter.fidelity import StepScenario, engine_shape
from vllm_output_rate.adapter.harness import Harness
from vllm_output_rate.adapter.residency import HuntedCheck, p3_verdict
from vllm_output_rate.adapter.scenarios import Verdict
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.events import AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.state import EngineConfig

RATES = ("0.5", "2", "5", "10", "20", "50", "200")
USERS = ("a", "b", "c")  # a, b: overrides at the start; c: the default
DRAIN_STEPS = 3000  # bound on the steps after a scenario for every request to finish (600 s of clock)
DRAIN_INTERVAL_NS = 200_000_000  # 90 tokens at 0.5 tok/s take 180 s


class RateChangeScenario(StepScenario):
    """A rate-change scenario: the engine configuration (spec ``EngineConfig``) and events;
    saved as a plain step scenario."""

    def config_line(self) -> str:
        c = self.config
        rates = ", ".join(f"{u}={r}" for u, r in c.user_rates_tokens_per_s)
        return (
            f"config: async={c.async_scheduling} chunked={c.chunked_prefill} default_rate="
            f"{c.default_rate_tokens_per_s} rates=[{rates}] (ample budget, KV and seats)"
        )


def _table(draw) -> tuple[str, tuple[tuple[str, str], ...]]:
    default = draw(st.sampled_from(RATES))
    overrides = tuple((u, draw(st.sampled_from(RATES))) for u in USERS if draw(st.booleans()))
    return default, overrides


@st.composite
def rate_change_scenarios(draw, async_scheduling: bool) -> RateChangeScenario:
    """Hypothesis strategy: the shape of the module docstring."""
    chunked = draw(st.booleans())
    streams = [(u, draw(st.integers(1, 3))) for u in USERS]
    requests = [
        (f"{u}{i}", u, draw(st.integers(1, 12)), draw(st.integers(4, 30))) for u, n in streams for i in range(n)
    ]
    num_steps = draw(st.integers(10, 40))
    changes = sorted(set(draw(st.lists(st.integers(1, num_steps - 1), min_size=1, max_size=3))))
    intervals = draw(st.lists(st.sampled_from((0, 1, 5, 10, 20, 50, 120)), min_size=num_steps, max_size=num_steps))
    late = {rid: draw(st.integers(0, num_steps // 2)) for rid, *_ in requests}
    max_model_len = 256
    config = EngineConfig(
        max_num_seqs=len(requests),
        max_num_batched_tokens=max(64, sum(p for _, _, p, _ in requests) + 8) if chunked else max_model_len,
        chunked_prefill=chunked,
        block_size=16,
        num_blocks=1 + sum(math.ceil((p + m + 1) / 16) for _, _, p, m in requests) + 4,
        async_scheduling=async_scheduling,
        max_model_len=max_model_len,
        default_rate_tokens_per_s=Fraction(draw(st.sampled_from(RATES))),
        user_rates_tokens_per_s=(
            ("a", Fraction(draw(st.sampled_from(RATES)))),
            ("b", Fraction(draw(st.sampled_from(RATES)))),
        ),
    )
    events: list[Event] = []
    for step in range(num_steps):
        events += [AddRequest(rid, user, 0, p, m, None) for rid, user, p, m in requests if late[rid] == step]
        if step in changes:
            default, overrides = _table(draw)
            events.append(ChangeRates(default, overrides))
        events += [Step(), AdvanceClock(intervals[step] * 1_000_000)]
    return RateChangeScenario(config, tuple(events))


class _Judge:
    """The spec's view of the scenario: R21's limiter replay, windows, resident requests."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.limiter = spec_limiter.EMPTY
        self.pending: EngineConfig | None = None
        # user -> [(dispatch ns, rate in force)] for the piecewise window bound
        self.dispatches: dict[str, list[int]] = defaultdict(list)
        self.segments: list[tuple[int, EngineConfig]] = [(0, config)]  # (from ns, table in force)
        self.user: dict[str, str] = {}

    def change(self, event: ChangeRates) -> None:
        self.pending = self.config.with_rates(*event.rates())

    def step(self, trace, unfinished: list[str], sync: bool) -> tuple[str, str] | None:
        now = trace.now_ns
        if self.pending is not None:  # R21: at the start of this schedule(), at its clock
            self.limiter = spec_limiter.change_rates(self.limiter, self.config.rate_of, self.pending.rate_of, now)
            self.config, self.pending = self.pending, None
            self.segments.append((now, self.config))
        config, burst = self.config, self.config.burst_ns
        per_user: dict[str, int] = defaultdict(int)
        for rid in trace.sampled:
            per_user[self.user[rid]] += 1
        for user, count in sorted(per_user.items()):
            for k in range(count):
                self.limiter, ok = spec_limiter.try_take(self.limiter, user, config.rate_of(user), now, burst)
                if not ok:
                    return "R21", (
                        f"user {user!r} dispatched {count} sampling steps at {now} ns; the spec grants only "
                        f"{k} at rate {config.rate_of(user)} tok/s (its lead kept in tokens across the "
                        "rate changes, R21): an over-grant"
                    )
            self.dispatches[user] += [now] * count
            broken = self._window(user)
            if broken is not None:
                return "R21", broken
        if sync:
            sampled = set(trace.sampled)
            for rid in unfinished:
                user = self.user[rid]
                if rid in sampled or not spec_limiter.allows(self.limiter, user, now, burst):
                    continue
                return "R21", (
                    f"{rid} of user {user!r} did not sample at {now} ns although the spec still grants its "
                    f"user at rate {config.rate_of(user)} tok/s (TAT "
                    f"{self.limiter.tat_ns.get(user)}): an under-grant (a higher rate not applied, or "
                    "debt added at the change)"
                )
        return None

    def _window(self, user: str) -> str | None:
        """R21: the windows ending at the user's newest dispatch hold the piecewise bound."""
        times = self.dispatches[user]
        end = times[-1]
        for i, start in enumerate(times):
            if i and times[i - 1] == start:
                continue
            count = len(times) - i
            segments: list[tuple[int, Fraction]] = []  # every table in force at some instant of the closed window
            for j, (begin, table) in enumerate(self.segments):
                until = self.segments[j + 1][0] if j + 1 < len(self.segments) else end
                if begin <= end and until >= start:
                    rate = table.rate_of(user)
                    assert rate is not None, f"R28: unlimited user {user!r} has no window bound"  # not drawn here
                    segments.append((max(0, min(until, end) - max(begin, start)), rate))
            bound = spec_limiter.piecewise_window_bound_tokens(segments, self.config.burst_ns)
            if count > bound:
                return (
                    f"user {user!r}: {count} sampling dispatches in [{start}, {end}] ns > the piecewise bound "
                    f"{bound} (segments {[(d, str(r)) for d, r in segments]}, one burst)"
                )
        return None


def run_rate_change(scheduler_cls: str, scenario: RateChangeScenario, style: Any = None) -> Verdict:
    """R21 on one scenario (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="outrate-rates-") as directory:
        shape = engine_shape(scenario.config, rates_file=os.path.join(directory, "rates.json"))
        harness = Harness(scheduler_cls, shape, style=style)
        return _run(harness, scenario)


def _apply(harness: Harness, judge: _Judge, max_tokens: dict[str, int], event: Event) -> None:
    """A scenario event other than ``Step`` (a request added, the clock advanced, a rate
    change, a drain) on the candidate, noted for ``judge`` (users, rate segments) and in
    ``max_tokens`` (request id -> output tokens)."""
    if isinstance(event, AddRequest):
        harness.add_request(event.request_id, event.user, event.prompt_len, event.max_tokens, None)
        judge.user[event.request_id] = event.user
        max_tokens[event.request_id] = event.max_tokens
    elif isinstance(event, AdvanceClock):
        harness.advance(event.delta_ns)
    elif isinstance(event, ChangeRates):
        harness.change_rates(*event.rates())
        judge.change(event)
    elif isinstance(event, Drain):
        harness.drain()


def _run(harness, scenario: RateChangeScenario) -> Verdict:
    config = scenario.config
    judge = _Judge(config)
    max_tokens: dict[str, int] = {}
    steps = 0

    def one_step() -> tuple[str, str] | None:
        nonlocal steps
        unfinished = [rid for rid in max_tokens if rid not in harness.finished]
        trace = harness.step()
        steps += 1
        return judge.step(trace, unfinished, not config.async_scheduling)

    for event in scenario.events:
        if not isinstance(event, Step):
            _apply(harness, judge, max_tokens, event)
        else:
            broken = one_step()
            if broken is not None:
                return Verdict(steps, broken[1], broken[0], steps - 1)
    for _ in range(DRAIN_STEPS):
        if len(harness.finished) == len(max_tokens):
            break
        broken = one_step()
        if broken is not None:
            return Verdict(steps, broken[1], broken[0], steps - 1)
        harness.advance(DRAIN_INTERVAL_NS)
    if config.async_scheduling:
        harness.drain()
    return p3_verdict(
        harness.finished, max_tokens, steps, DRAIN_STEPS, " (a rate change pauses, never cuts)", rule="P3"
    )


#: R21: ``run_rate_change`` on seeded scenarios; a failure is shrunk by Hypothesis and
#: saved; rows ``rate-change/{sync,async}``, at level exact, or at the ``level`` the
#: caller passes (must when the candidate declares the rates file).
check_rate_change = HuntedCheck(
    "rate-change",
    ("R21",),
    "exact",
    rate_change_scenarios,
    run_rate_change,
    rule=None,
    needs_output_rate=(
        "the candidate's configuration style has no rates file (output_rate.rates_file): the "
        "article's flags cannot change a rate without a restart"
    ),
)
