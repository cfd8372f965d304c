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

Ample sync scenarios also check R11 "kept resident" (no preemption) and R14 rotation.
Scenarios with resource pressure (``pressured_scenarios``) are judged by the black-box
checks that still hold under pressure plus the white-box invariants on the scheduler's
observation (docs/OBSERVATION.md): charges minus refunds equal sampling dispatches (R7,
R9), refunds only of this step's charges, once (R9), throttled never scheduled (R11),
scheduled running requests <= max_num_active_seqs (R12), every user's TAT equal to the
spec limiter's replay (R1-R6), and the wait hint the earliest ready time (R16).
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
    priority: int = 0
    abort_at_step: int | None = None  # aborted just before this step is scheduled


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
    # Resource pressure; None everywhere = ample (only the rate limit can pause a request).
    max_num_seqs: int | None = None
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None
    block_size: int = 16
    policy: str = "fcfs"

    @property
    def ample(self) -> bool:
        """True when nothing but the rate limit can keep a request from sampling."""
        return (self.max_num_seqs, self.max_num_active_seqs, self.max_num_batched_tokens, self.num_blocks) == (
            None, None, None, None) and not any(r.abort_at_step is not None for r in self.requests)

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
            prio = f", priority={r.priority}" if self.policy == "priority" else ""
            out.append(
                f"step {r.at_step}: add {r.request_id} user={r.user} prompt={r.prompt_len} "
                f"max_tokens={r.max_tokens}{eos}{prio}"
            )
            if r.abort_at_step is not None:
                out.append(f"step {r.abort_at_step}: abort {r.request_id}")
        out.append(f"then {self.num_steps} steps, clock +{self.step_interval_ns / 1e6:g} ms each")
        rates = ", ".join(f"{u}={r}" for u, r in sorted(self.rates_tokens_per_s.items()))
        shape = "" if self.ample else (
            f"; max_num_seqs={self.max_num_seqs}, max_num_active_seqs={self.max_num_active_seqs}, "
            f"max_num_batched_tokens={self.max_num_batched_tokens}, num_blocks={self.num_blocks}x{self.block_size}, "
            f"policy={self.policy}")
        out.insert(0, f"rates (tokens/s): {rates}; chunked_prefill={self.chunked_prefill}, "
                      f"async={self.async_scheduling}{shape}")
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


@st.composite
def pressured_scenarios(draw, async_scheduling: bool | None = None, max_steps: int = 40) -> Scenario:
    """Hypothesis strategy with resource pressure for the white-box checks: few KV blocks
    (preemption), small token budgets (chunking), an active cap below max_num_seqs, FCFS or
    PRIORITY, aborts; and sometimes a run past step 256 (R6 cleanup)."""
    num_users = draw(st.integers(1, 3))
    users = [f"u{i}" for i in range(num_users)]
    rates = {u: draw(st.sampled_from(RATES)) for u in users}
    long_run = draw(st.integers(0, 9)) == 0
    num_steps = 260 if long_run else draw(st.integers(1, max_steps))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    requests = []
    for user in users:
        for k in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, max(0, min(num_steps, 40) - 1)))
            abort = draw(st.integers(at + 1, at + 30)) if draw(st.integers(0, 4)) == 0 else None
            requests.append(RequestSpec(
                request_id=f"{user}-r{k}", user=user, prompt_len=draw(st.integers(1, 40)),
                max_tokens=draw(st.integers(1, 16)), eos_index=draw(st.one_of(st.none(), st.integers(0, 16))),
                at_step=at, priority=draw(st.integers(0, 2)) if policy == "priority" else 0,
                abort_at_step=abort,
            ))
    max_num_seqs = draw(st.integers(1, len(requests) + 1))
    block_size = draw(st.sampled_from([4, 8, 16]))
    longest_blocks = -(-(40 + 16) // block_size)
    chunked = draw(st.booleans())
    return Scenario(
        rates_tokens_per_s=rates,
        requests=tuple(requests),
        step_interval_ns=draw(st.sampled_from([1, 5, 10, 20, 33, 50, 100])) * 1_000_000,
        num_steps=num_steps,
        chunked_prefill=chunked,
        async_scheduling=draw(st.booleans()) if async_scheduling is None else async_scheduling,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=draw(st.integers(1, max_num_seqs)),
        # Without chunked prefill a whole prompt must fit the budget.
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 32, 64, 2048])) if chunked else 2048,
        num_blocks=draw(st.integers(longest_blocks, longest_blocks * 3)),
        block_size=block_size,
        policy=policy,
    )


def build_harness(scheduler_cls: str, scenario: Scenario):
    """A ``Harness`` for ``scenario`` with ample resources (only the limit can pause)."""
    from vllm_output_rate.adapter.harness import EngineShape, Harness

    shape = EngineShape(
        max_num_seqs=scenario.max_num_seqs or max(len(scenario.requests), 1),
        max_num_active_seqs=scenario.max_num_active_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens or 2048,
        chunked_prefill=scenario.chunked_prefill,
        block_size=scenario.block_size,
        num_blocks=scenario.num_blocks or 4096,
        policy=scenario.policy,
        async_scheduling=scenario.async_scheduling,
        output_rate=scenario.output_rate_config(),
    )
    return Harness(scheduler_cls, shape)


def run_scenario(scheduler_cls: str, scenario: Scenario) -> Verdict:
    """Run ``scenario`` on ``scheduler_cls``; stop at the first failing check.

    Black-box checks always (R2 grants, R2 window bound, R11 pause-not-truncate); in ample
    sync scenarios also R11 under-grant, R11 no preemption and R14 fairness; white-box
    invariants whenever the scheduler exposes ``last_step_observation``.
    """
    harness = build_harness(scheduler_cls, scenario)
    judge = _Judge(scenario, harness)
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    aborts = sorted((r for r in scenario.requests if r.abort_at_step is not None), key=lambda r: r.abort_at_step)
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        while pending and pending[0].at_step <= step:
            r = pending.pop(0)
            harness.add_request(r.request_id, r.user, r.prompt_len, r.max_tokens, r.eos_index, r.priority)
        while aborts and aborts[0].abort_at_step <= step and aborts[0].at_step < step:
            harness.abort(aborts.pop(0).request_id)
        if step >= scenario.num_steps and not pending and not aborts and len(harness.finished) == len(judge.by_id):
            break
        unfinished = [rid for rid in harness.num_outputs if rid not in harness.finished]
        trace = harness.step()
        failure = judge.after_step(step, trace, unfinished)
        if failure:
            return Verdict(judge.steps, failure[1], failure[0], step)
        harness.advance(_next_advance_ns(scenario, step, trace, judge.state, judge.by_id, harness))
    harness.drain()
    for rid, r in judge.by_id.items():
        got = harness.finished.get(rid)
        if got is not None and got[0] == "abort":
            continue
        expected = r.max_tokens if r.eos_index is None or r.eos_index >= r.max_tokens else r.eos_index + 1
        if got is None or got[1] != expected:
            return Verdict(judge.steps, f"{rid} ended with {got} but must end with {expected} outputs "
                           "(pause, not truncate)", "R11", None)
    return Verdict(judge.steps, None, sampled_per_user={u: len(t) for u, t in judge.history.items()})


class _Judge:
    """Per-step checks of one scenario run; keeps the spec limiter replay."""

    def __init__(self, scenario: Scenario, harness) -> None:
        self.scenario = scenario
        self.harness = harness
        self.by_id = {r.request_id: r for r in scenario.requests}
        self.state = spec_limiter.EMPTY
        self.history: dict[str, list[int]] = {}  # user -> time of each sampling dispatch
        self.last_sample_step: dict[str, int] = {}  # request id -> last step it sampled
        self.steps = 0

    def after_step(self, step: int, trace, unfinished: list[str]) -> tuple[str, str] | None:
        self.steps += 1
        scenario, now = self.scenario, trace.now_ns
        for rid in trace.sampled:
            user = self.by_id[rid].user
            self.state, granted = spec_limiter.try_take(self.state, user, scenario.rate_of(user), now)
            if not granted:
                return "R2", (f"{rid} (user {user}) sampled at t={now / 1e6:g} ms but the spec limiter "
                              "refuses: over the rate")
            self.history.setdefault(user, []).append(now)
        if self.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            self.state = spec_limiter.cleanup_idle_users(self.state, now)  # R6, same cadence
        if scenario.ample and not scenario.async_scheduling:
            failure = self._ample_sync_checks(step, trace, unfinished)
            if failure:
                return failure
        for rid in trace.sampled:
            self.last_sample_step[rid] = step
        failure = _window_violation(self.history, scenario)
        if failure:
            return "R2", failure
        if trace.white is not None:
            return self._white_box_checks(trace)
        return None

    def _ample_sync_checks(self, step: int, trace, unfinished: list[str]) -> tuple[str, str] | None:
        now, sampled = trace.now_ns, set(trace.sampled)
        for rid in unfinished:
            user = self.by_id[rid].user
            if rid not in sampled and spec_limiter.allows(self.state, user, now):
                return "R11", (f"{rid} (user {user}) was paused at t={now / 1e6:g} ms although the spec "
                               "limiter still grants: under-grant")
        if trace.preempted:
            return "R11", f"{trace.preempted} preempted although KV and seats are ample: throttled must stay resident"
        # R14: between two samples of one stream, every other stream of the same user that
        # was ready (decoding, unfinished) all along samples at least once.
        for rid in trace.sampled:
            previous = self.last_sample_step.get(rid)
            if previous is None:
                continue
            for other in unfinished:
                started = self.last_sample_step.get(other)
                if (other != rid and self.by_id[other].user == self.by_id[rid].user and started is not None
                        and started < previous and other not in sampled):
                    return "R14", (f"{rid} sampled at steps {previous} and {step} while {other} of the same "
                                   f"user waited since step {started}: no rotation")
        return None

    def _white_box_checks(self, trace) -> tuple[str, str] | None:
        white, now = trace.white, trace.now_ns
        charged, refunded, sampled = white["charged"], white["refunded"], set(trace.sampled)
        if len(set(charged)) != len(charged):
            return "R7", f"a request charged twice in one step: charged={charged}"
        if len(set(refunded)) != len(refunded) or not set(refunded) <= set(charged):
            return "R9", f"refunds {refunded} are not a subset of this step's charges {charged}, once each"
        refunded_dispatches = set(refunded) & sampled
        if refunded_dispatches:
            return "R9", f"{sorted(refunded_dispatches)} refunded although dispatched to sample"
        charged_chunks = (set(refunded) & set(trace.scheduled)) - sampled
        if charged_chunks:
            return "R7", (f"{sorted(charged_chunks)} charged (then refunded) for a step in which they are "
                          "scheduled but do not sample: a prompt chunk was charged")
        if set(charged) - set(refunded) != sampled:
            return "R9", (f"charges {charged} minus refunds {refunded} differ from the sampling dispatches "
                          f"{sorted(sampled)}")
        throttled_scheduled = set(white["throttled"]) & set(trace.scheduled)
        if throttled_scheduled:
            return "R11", f"throttled requests {sorted(throttled_scheduled)} were scheduled"
        active_cap = self.scenario.max_num_active_seqs or self.scenario.max_num_seqs or len(self.by_id)
        scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
        if len(scheduled_running) > active_cap:
            return "R12", f"{len(scheduled_running)} running requests scheduled > max_num_active_seqs {active_cap}"
        expected = {u: t for u, t in self.state.tat_ns.items() if t > now}
        got = {u: t for u, t in white["tat_ns"].items() if t > now}
        if expected != got:
            return "R1", f"limiter state {_fmt_tats(got)} differs from the spec's {_fmt_tats(expected)}"
        hint = white["wait_hint_ns"]
        if hint is not None:
            ready = {u: spec_limiter.ready_at_ns(self.state, u) for u in self.state.tat_ns}
            throttled_users = {self.by_id[r].user for r in white["throttled"] if r in self.by_id}
            if hint not in ready.values() or any(ready.get(u) is not None and hint > ready[u] for u in throttled_users):
                return "R16", (f"wait hint {hint} ns is not the earliest ready time of the refused users "
                               f"(spec ready_at: {ready})")
        return None


def _fmt_tats(tats) -> str:
    return "{" + ", ".join(f"{u}: {float(t) / 1e6:.3f} ms" for u, t in sorted(tats.items())) + "}"


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


def minimize(scheduler_cls: str, scenario: Scenario) -> Scenario:
    """Make a failing scenario 1-minimal: drop single requests, aborts and trailing steps
    while it still fails (after Hypothesis's own shrinking)."""
    from dataclasses import replace

    def fails(candidate: Scenario) -> bool:
        return bool(candidate.requests) and run_scenario(scheduler_cls, candidate).failure is not None

    assert fails(scenario), "minimize() needs a failing scenario"
    progress = True
    while progress:
        progress = False
        for i, request in enumerate(scenario.requests):
            smaller = [
                replace(scenario, requests=scenario.requests[:i] + scenario.requests[i + 1:]),
                replace(scenario, requests=scenario.requests[:i] + (replace(request, abort_at_step=None),)
                        + scenario.requests[i + 1:]) if request.abort_at_step is not None else None,
            ]
            for candidate in smaller:
                if candidate is not None and fails(candidate):
                    scenario, progress = candidate, True
                    break
            if progress:
                break
    step = run_scenario(scheduler_cls, scenario).step
    if step is not None and step + 1 < scenario.num_steps:
        candidate = replace(scenario, num_steps=step + 1)
        if fails(candidate):
            scenario = candidate
    return scenario


def event_count(scenario: Scenario) -> int:
    """Length of a counterexample: request additions, aborts, and one "run the steps" event."""
    return len(scenario.requests) + sum(r.abort_at_step is not None for r in scenario.requests) + 1
