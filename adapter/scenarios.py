"""Rate-limit scenarios on a real scheduler, judged step by step against the spec limiter.

A ``Scenario`` is plain data (JSON-able, replayable): an engine shape, per-user rates, a
list of requests each arriving at some step, a fixed clock advance between steps. Running
it drives a ``Harness`` and applies these checks after every step (black-box: only what
vLLM exposes is used, so any scheduler class can be judged):

- R2/R7 grant: each user's sampling dispatches in the step, replayed as ``try_take`` on
  the exact spec limiter at the step's time, must all be granted (no over-grant);
- R11/R2 pause only when refused (sync mode): if one of the user's unfinished requests
  did not sample in the step, the spec limiter must refuse one more take (the limit, not
  something else, paused it; the scenarios give ample token budget, KV and seats);
- R2 window bound: in every window [t_i, t_j] of step times, a user's sampling dispatches
  <= floor((t_j - t_i + tau) x rate) + 1;
- R11 pause-not-truncate: at the end every request finished with exactly ``max_tokens``
  outputs, or ``eos_index + 1`` if its EOS came first.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.spec import limiter as spec_limiter

MAX_SCENARIO_STEPS = 400
DRAIN_STEP_LIMIT = 2_000  # steps allowed after the scenario to let every request finish


@dataclass(frozen=True)
class RequestSpec:
    """One request: it is added just before step ``at_step`` is scheduled."""

    request_id: str
    user: str
    prompt_len: int
    max_tokens: int
    eos_index: int | None = None
    at_step: int = 0


@dataclass(frozen=True)
class Scenario:
    """A replayable rate-limit scenario (see module docstring)."""

    rates_tokens_per_s: dict[str, str]  # user -> rate as an exact decimal string
    requests: tuple[RequestSpec, ...]
    step_interval_ns: int
    num_steps: int
    chunked_prefill: bool = True
    async_scheduling: bool = False
    default_rate_tokens_per_s: str = "10"

    def output_rate_config(self) -> dict[str, Any]:
        """``additional_config["output_rate"]`` for this scenario."""
        return {
            "default_tokens_per_s": _as_number(self.default_rate_tokens_per_s),
            "user_tokens_per_s": {u: _as_number(r) for u, r in self.rates_tokens_per_s.items()},
        }

    def rate_of(self, user: str) -> Fraction:
        return Fraction(self.rates_tokens_per_s.get(user, self.default_rate_tokens_per_s))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "Scenario":
        data = json.loads(text)
        data["requests"] = tuple(RequestSpec(**r) for r in data["requests"])
        return Scenario(**data)

    def events(self) -> list[str]:
        """The scenario as a short list of events, for printing counterexamples."""
        out = []
        for r in sorted(self.requests, key=lambda r: r.at_step):
            eos = f", eos@{r.eos_index}" if r.eos_index is not None else ""
            out.append(
                f"step {r.at_step}: add {r.request_id} user={r.user} prompt={r.prompt_len} "
                f"max_tokens={r.max_tokens}{eos}"
            )
        out.append(f"then {self.num_steps} steps, clock +{self.step_interval_ns / 1e6:g} ms each")
        rates = ", ".join(f"{u}={r}" for u, r in sorted(self.rates_tokens_per_s.items()))
        out.insert(0, f"rates (tokens/s): {rates}; chunked_prefill={self.chunked_prefill}, "
                      f"async={self.async_scheduling}")
        return out


def _as_number(text: str) -> int | float:
    value = Fraction(text)
    return int(value) if value.denominator == 1 else float(text)


@dataclass
class Verdict:
    """Outcome of one scenario: ``failure`` is None when every check passed."""

    steps: int
    failure: str | None = None
    rule: str | None = None
    step: int | None = None
    sampled_per_user: dict[str, int] = field(default_factory=dict)


RATES = ("2", "5", "10", "20", "50", "100", "3.5", "0.5")


@st.composite
def scenarios(draw, async_scheduling: bool | None = None, max_steps: int = 40) -> Scenario:
    """Hypothesis strategy: 1-3 users, 1-4 streams each, ample budget, KV and seats."""
    num_users = draw(st.integers(1, 3))
    users = [f"u{i}" for i in range(num_users)]
    rates = {u: draw(st.sampled_from(RATES)) for u in users}
    num_steps = draw(st.integers(1, max_steps))
    requests = []
    for user in users:
        for k in range(draw(st.integers(1, 4))):
            eos = draw(st.one_of(st.none(), st.integers(0, 20)))
            requests.append(
                RequestSpec(
                    request_id=f"{user}-r{k}",
                    user=user,
                    prompt_len=draw(st.integers(1, 40)),
                    max_tokens=draw(st.integers(1, 24)),
                    eos_index=eos,
                    at_step=draw(st.integers(0, max(0, num_steps - 1))),
                )
            )
    return Scenario(
        rates_tokens_per_s=rates,
        requests=tuple(requests),
        step_interval_ns=draw(st.sampled_from([1, 5, 10, 20, 33, 50, 100, 250])) * 1_000_000,
        num_steps=num_steps,
        chunked_prefill=draw(st.booleans()),
        async_scheduling=draw(st.booleans()) if async_scheduling is None else async_scheduling,
    )


def build_harness(scheduler_cls: str, scenario: Scenario):
    """A ``Harness`` for ``scenario`` with ample resources (only the limit can pause)."""
    from vllm_output_rate.adapter.harness import EngineShape, Harness

    shape = EngineShape(
        max_num_seqs=max(len(scenario.requests), 1),
        max_num_batched_tokens=2048,
        chunked_prefill=scenario.chunked_prefill,
        num_blocks=4096,
        async_scheduling=scenario.async_scheduling,
        output_rate=scenario.output_rate_config(),
    )
    return Harness(scheduler_cls, shape)


def run_scenario(scheduler_cls: str, scenario: Scenario) -> Verdict:
    """Run ``scenario`` on ``scheduler_cls``; stop at the first failing check."""
    harness = build_harness(scheduler_cls, scenario)
    state = spec_limiter.EMPTY
    history: dict[str, list[int]] = {}  # user -> time of each sampling dispatch
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    by_id = {r.request_id: r for r in scenario.requests}
    steps = 0
    total_steps = scenario.num_steps + DRAIN_STEP_LIMIT
    for step in range(total_steps):
        while pending and pending[0].at_step <= step:
            r = pending.pop(0)
            harness.add_request(r.request_id, r.user, r.prompt_len, r.max_tokens, r.eos_index)
        if step >= scenario.num_steps and not pending and len(harness.finished) == len(by_id):
            break
        unfinished = [rid for rid in harness.num_outputs if rid not in harness.finished]
        trace = harness.step()
        steps += 1
        now = trace.now_ns
        sampled_users: dict[str, int] = {}
        for rid in trace.sampled:
            user = by_id[rid].user
            state, granted = spec_limiter.try_take(state, user, scenario.rate_of(user), now)
            if not granted:
                return Verdict(steps, f"{rid} (user {user}) sampled at t={now / 1e6:g} ms but the spec "
                               f"limiter refuses: over the rate", "R2", step)
            sampled_users[user] = sampled_users.get(user, 0) + 1
            history.setdefault(user, []).append(now)
        if not scenario.async_scheduling:
            sampled = set(trace.sampled)
            for rid in unfinished:
                user = by_id[rid].user
                if rid not in sampled and spec_limiter.allows(state, user, now):
                    return Verdict(steps, f"{rid} (user {user}) was paused at t={now / 1e6:g} ms although "
                                   f"the spec limiter still grants: under-grant", "R11", step)
        failure = _window_violation(history, scenario)
        if failure:
            return Verdict(steps, failure, "R2", step)
        harness.advance(_next_advance_ns(scenario, step, trace, state, by_id, harness))
    harness.drain()
    for rid, r in by_id.items():
        expected = r.max_tokens if r.eos_index is None or r.eos_index >= r.max_tokens else r.eos_index + 1
        got = harness.finished.get(rid)
        if got is None or got[1] != expected:
            return Verdict(steps, f"{rid} ended with {got} but must end with {expected} outputs "
                           "(pause, not truncate)", "R11", None)
    return Verdict(steps, None, sampled_per_user={u: len(t) for u, t in history.items()})


def _next_advance_ns(scenario, step, trace, state, by_id, harness) -> int:
    """The scenario's clock step; after its last step, an idle step jumps to the next
    instant at which the spec limiter grants one of the waiting users (drain phase)."""
    interval = scenario.step_interval_ns
    if step < scenario.num_steps or trace.sampled or trace.scheduled:
        return interval
    users = {by_id[rid].user for rid in harness.num_outputs if rid not in harness.finished}
    ready = [spec_limiter.ready_at_ns(state, u) for u in users]
    ready = [t for t in ready if t is not None]
    return max(interval, min(ready) - trace.now_ns) if ready else interval


def _window_violation(history: dict[str, list[int]], scenario: Scenario) -> str | None:
    """R2 bound on the newest dispatch time against every earlier start time."""
    for user, times in history.items():
        if not times:
            continue
        end = times[-1]
        rate = scenario.rate_of(user)
        for i, start in enumerate(times):
            count = len(times) - i
            bound = spec_limiter.window_bound_tokens(end - start, rate)
            if count > bound:
                return (f"user {user}: {count} sampling dispatches in [{start / 1e6:g}, {end / 1e6:g}] ms "
                        f"> bound {bound} = floor((W + tau) x {rate}) + 1")
    return None
