"""R18 for any candidate: with the feature off, the class under test is its base class,
step for step.

The same scenario (no output-rate configuration at all) runs on the candidate and on stock
vLLM's ``Scheduler`` / ``AsyncScheduler``; after every step the two ``SchedulerOutput``s must
agree on the batch (request ids and ``num_scheduled_tokens``, in order), the preemptions
and the admissions, and the delivered outputs on the finishes. A patch that still rotates,
charges or reorders with the feature off fails here with the first differing step.
``first_difference`` is the side-by-side run, shared with R19's check
(``adapter/not_binding.py``: the feature on, never binding) and with the shadow-mode check
(``run_shadow`` here: the feature on with binding rates and ``output_rate.shadow: true``,
which must also be stock step for step; docs/SPEC.md, Decision "Shadow mode").
``PairedCheck`` is such a gate row as data: ``check_feature_off`` and ``check_shadow`` here,
``check_not_binding`` in ``adapter/not_binding.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from hypothesis import strategies as st

from vllm_output_rate.adapter import coverage
from vllm_output_rate.adapter.conform import _guarded, _hunt, _record_failure, _save_counterexample
from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.adapter.harness import STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER
from vllm_output_rate.adapter.scenario_run import add_spec, build_harness, minimize, parallel_children
from vllm_output_rate.adapter.scenario_strategies import STEP_INTERVALS_NS, pressured_scenarios, scenarios
from vllm_output_rate.adapter.scenarios import DRAIN_STEP_LIMIT, Hunt, RequestSpec, Scenario, Verdict, feature_off


def base_class(async_mode: bool) -> str:
    """The stock vLLM class a candidate is compared with (R18)."""
    return STOCK_ASYNC_SCHEDULER if async_mode else STOCK_SCHEDULER


def run_feature_off(scheduler_cls: str, scenario: Scenario, style=None) -> Verdict:
    """Run ``scenario`` with the feature off on ``scheduler_cls`` and on its stock base;
    ``failure`` names the first step at which they differ (rule R18, level must)."""
    scenario = feature_off(scenario)
    coverage.note_feature_off(scenario)  # R18's order-sensitive shapes (issue 26)
    base_cls = base_class(scenario.async_scheduling)
    name = scheduler_cls.rpartition(".")[2]
    steps, difference = first_difference(scheduler_cls, scenario, scenario, style)
    if difference is None:
        return Verdict(steps, None)
    step, field, got, want = difference
    if step is None:
        return Verdict(
            steps,
            f"with the feature off, {name} finished {got!r} but stock vLLM finished {want!r}",
            "R18",
            None,
            level="must",
        )
    return Verdict(
        steps,
        f"with the feature off, {name} differs from stock vLLM {base_cls.rpartition('.')[2]} "
        f"at step {step}: {field} {got!r} != {want!r}; the article's patch behaves exactly like "
        "upstream when --default-user-output-tokens-per-second is not set",
        "R18",
        step,
        level="must",
    )


def first_difference(
    scheduler_cls: str,
    scenario: Scenario,
    base_scenario: Scenario,
    style=None,
    output_rate_extra: dict | None = None,
) -> tuple[int, tuple[int | None, str, object, object] | None]:
    """Run ``scenario`` on ``scheduler_cls`` and ``base_scenario`` (the same requests and
    engine shape) on its stock base class, side by side, step for step.

    Returns ``(steps, difference)``: ``difference`` is None if after every step the two
    ``SchedulerOutput``s agree on the batch (request ids and ``num_scheduled_tokens``, in
    order), the preemptions and the admissions, and the delivered outputs on the finishes
    (R18, R19); else ``(step, field, candidate's value, stock's value)``, ``step`` None
    for the finishes after the final drain. ``style`` configures the candidate only;
    ``output_rate_extra``: keys added to the candidate's ``output_rate`` section only (the
    shadow check: ``{"shadow": True}``).
    """
    base_cls = base_class(scenario.async_scheduling)
    candidate = build_harness(scheduler_cls, scenario, style, output_rate_extra=output_rate_extra)
    base = build_harness(base_cls, base_scenario)
    pair = (candidate, base)
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    aborts = scenario.abort_schedule()
    children = [parallel_children(scenario.requests) for _ in pair]  # n > 1: one family per side
    steps = 0
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        while pending and pending[0].at_step <= step:
            r = pending.pop(0)
            for h, shared in zip(pair, children, strict=True):
                add_spec(h, r, shared)
        while aborts and aborts[0][0] <= step and aborts[0][1].at_step < step:
            rid = aborts.pop(0)[1].request_id
            for h in pair:
                h.abort(rid)
        if step >= scenario.num_steps and not pending and not aborts and len(base.finished) == len(scenario.requests):
            break
        got, want = candidate.step(), base.step()
        steps += 1
        for field, a, b in (
            ("batch", list(got.scheduled.items()), list(want.scheduled.items())),
            ("preempted", got.preempted, want.preempted),
            ("admitted", sorted(got.admitted), sorted(want.admitted)),
            ("finished", got.finished, want.finished),
        ):
            if a != b:
                return steps, (step, field, a, b)
        for h in pair:
            h.advance(scenario.step_interval_ns)
    for h in pair:
        h.drain()
    if candidate.finished != base.finished:
        return steps, (None, "finished", candidate.finished, base.finished)
    return steps, None


SHADOW = {"shadow": True}  # the key the shadow check adds to the candidate's section


def run_shadow(scheduler_cls: str, scenario: Scenario) -> Verdict:
    """Shadow mode (level exact, docs/SPEC.md Decision "Shadow mode"): ``scenario`` with the
    feature on, its own (binding) rates and ``output_rate.shadow: true`` on
    ``scheduler_cls``, against the same scenario with no output-rate configuration on stock
    vLLM: identical batches, preemptions, admissions and finishes, step for step."""
    return verdict_against_stock(
        scheduler_cls,
        replace(scenario, feature_on=True),
        None,
        "shadow",
        "exact",
        lambda d: (
            f"in shadow mode (output_rate.shadow: true), {d.name} scheduled {d.where} {d.field} {d.got!r} "
            f"where stock vLLM {d.stock} has {d.want!r}: shadow mode counts what it would throttle and "
            "throttles nothing, so its schedule is the base class's step for step"
        ),
        output_rate_extra=SHADOW,
    )


class StockDifference(NamedTuple):
    """The first difference of a side-by-side run, named for a message: the candidate's
    class name, stock vLLM's class name, "at step N" or "by the end", the field that
    differs (batch, preempted, admitted, finished), the candidate's and stock's values."""

    name: str
    stock: str
    where: str
    field: str
    got: object
    want: object


def verdict_against_stock(
    scheduler_cls: str,
    scenario: Scenario,
    style: Any,
    rule: str,
    level: str,
    message: Callable[[StockDifference], str],
    output_rate_extra: dict | None = None,
) -> Verdict:
    """``scenario`` on ``scheduler_cls`` (configured by ``style``, plus ``output_rate_extra``
    in its ``output_rate`` section) against ``feature_off(scenario)`` on stock vLLM, side by
    side (``first_difference``): the first difference fails with ``message(difference)``,
    named ``rule`` at ``level`` (R19 ``not-binding``, shadow mode)."""
    steps, difference = first_difference(scheduler_cls, scenario, feature_off(scenario), style, output_rate_extra)
    if difference is None:
        return Verdict(steps, None)
    step, field, got, want = difference
    name, stock, where = difference_names(scheduler_cls, scenario.async_scheduling, step)
    return Verdict(steps, message(StockDifference(name, stock, where, field, got, want)), rule, step, level=level)


def difference_names(scheduler_cls: str, async_mode: bool, step: int | None) -> tuple[str, str, str]:
    """(candidate class name, stock class name, "at step N" / "by the end") for the messages
    of the side-by-side checks (R18, R19, shadow mode)."""
    stock = base_class(async_mode).rpartition(".")[2]
    return scheduler_cls.rpartition(".")[2], stock, f"at step {step}" if step is not None else "by the end"


def ample_or_pressured(async_mode: bool, max_steps: int):
    """Hypothesis strategy: the gate's ample (``scenarios``) or pressured
    (``pressured_scenarios``) scenarios of one mode, ``max_steps`` steps at most."""
    return st.one_of(
        scenarios(async_scheduling=async_mode, max_steps=max_steps),
        pressured_scenarios(async_scheduling=async_mode, max_steps=max_steps),
    )


@st.composite
def order_scenarios(draw, async_scheduling: bool) -> Scenario:
    """Hypothesis strategy: R18's shapes where order matters. User ``v`` has a decoding
    stream and, 1-5 steps later, a long prompt (40-400 tokens); user ``w`` (sometimes also
    an anonymous user) decodes beside them, between the two in ``running``; a token budget
    of 8-32 tokens with chunked prefill, so the long prompt takes several steps. A rotation
    or a last-served record left running with the feature off moves the long prompt ahead
    and changes the batch only here (two streams of one user, a long prompt, a binding
    budget: the shape of ``adapter/not_binding.stall_scenarios``, feature off)."""
    arrival = draw(st.integers(1, 5))
    requests = [
        RequestSpec("v-r0", "v", draw(st.integers(1, 8)), draw(st.integers(8, 40))),
        RequestSpec("w-r0", "w", draw(st.integers(1, 8)), draw(st.integers(8, 40))),
    ]
    if draw(st.booleans()):
        requests.append(RequestSpec("x-r0", None, draw(st.integers(1, 8)), draw(st.integers(4, 40))))
    requests.append(RequestSpec("v-long", "v", draw(st.integers(40, 400)), draw(st.integers(1, 8)), at_step=arrival))
    return Scenario(
        rates_tokens_per_s={},
        requests=tuple(requests),
        step_interval_ns=draw(st.sampled_from(STEP_INTERVALS_NS)),
        num_steps=arrival + draw(st.integers(1, 12)),
        chunked_prefill=True,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=draw(st.integers(8, 32)),
        feature_on=False,
    )


def feature_off_scenarios(async_mode: bool, max_steps: int):
    """Hypothesis strategy of R18's row: ``ample_or_pressured`` and the shapes where order
    matters (``order_scenarios``: two streams of one user, a long prompt, a binding token
    budget), which the generic draws rarely reach."""
    return st.one_of(ample_or_pressured(async_mode, max_steps), order_scenarios(async_scheduling=async_mode))


def _every_style(style: Any) -> str | None:
    return None


@dataclass(frozen=True)
class PairedCheck:
    """A gate row that runs the candidate beside stock vLLM, described as data (R18
    ``feature-off/*``, R19 ``not-binding/*``, shadow mode ``shadow/*``).

    ``row``: the row's name before ``/sync`` or ``/async``; ``rules``: the rules it
    covers; ``level``: its level; ``strategy(async_mode, max_steps)``: the scenarios it
    draws; ``run(scheduler_cls, scenario, style) -> Verdict``; ``as_run(scenario)``: the
    scenario as the candidate ran it (what a failure saves); ``unsupported(style)``: why
    the row cannot run with that configuration style (its NOT TESTED reason), None if it can.

    Called as ``check(scheduler_cls, async_mode, hunt, style=None)``: ``run`` on
    ``hunt.examples`` seeded scenarios of at most ``hunt.max_steps`` steps
    (``adapter/scenarios.Hunt``), ``hunt.tick()`` after each; a failure is shrunk by
    Hypothesis, made 1-minimal and saved as ``as_run(scenario)`` in ``hunt.save_dir`` (None:
    not saved). Returns the ``adapter.gate_result.CheckResult`` row.
    """

    row: str
    rules: tuple[str, ...]
    level: str
    strategy: Callable[[bool, int], Any]
    run: Callable[[str, Scenario, Any], Verdict]
    as_run: Callable[[Scenario], Scenario]
    unsupported: Callable[[Any], str | None] = _every_style

    def __call__(self, scheduler_cls: str, async_mode: bool, hunt: Hunt, style: Any = None):
        name = f"{self.row}/{'async' if async_mode else 'sync'}"
        why = self.unsupported(style)
        if why is not None:
            return CheckResult(name, list(self.rules), result="not tested", level=self.level, failure=why)
        result = CheckResult(name, list(self.rules), level=self.level)
        run = _guarded(lambda scenario: self.run(scheduler_cls, scenario, style), scheduler_cls)
        strategy = self.strategy(async_mode, hunt.max_steps)
        failed = _hunt(result, strategy, run, hunt.examples, hunt.seed, hunt.tick)
        if failed is not None:
            scenario = self.as_run(minimize(scheduler_cls, failed[0], run=run))
            _record_failure(result, run(scenario), scenario)
            _save_counterexample(result, scenario, hunt.save_dir)
        return result

    def judge(self, scheduler_cls: str, scenario: Scenario, style: Any = None) -> Verdict:
        """The row's verdict on one saved scenario (``outrate replay``): ``run`` with an
        exception of the candidate as a ``crash`` verdict (level must), as in the hunt."""
        return _guarded(lambda s: self.run(scheduler_cls, s, style), scheduler_cls)(scenario)


def _shadow_unsupported(style: Any) -> str | None:
    if style is None or getattr(style, "name", None) == "additional-config":
        return None
    return (
        f'shadow mode is configured as additional_config["output_rate"]["shadow"]; '
        f"--config-style {style.name} cannot express it"
    )


#: R18 (level must): with no output-rate configuration, the candidate is stock vLLM's
#: ``Scheduler`` / ``AsyncScheduler`` step for step (``run_feature_off``), on scenarios with
#: and without resource pressure; rows ``feature-off/{sync,async}``.
check_feature_off = PairedCheck(
    "feature-off",
    ("R18",),
    "must",
    feature_off_scenarios,
    run_feature_off,
    feature_off,
)

#: The gate's ``shadow/{sync,async}`` row (level exact): ``run_shadow`` on seeded scenarios
#: (ample and pressured, rates 0.3-1000 tokens/s so that the shadow limiter would
#: throttle); a failure is saved as the candidate ran it. A ``style`` other than
#: ``additional_config`` cannot express ``shadow``: the row is then NOT TESTED.
check_shadow = PairedCheck(
    "shadow",
    ("shadow",),
    "exact",
    ample_or_pressured,
    lambda scheduler_cls, scenario, style: run_shadow(scheduler_cls, scenario),
    lambda scenario: scenario,
    unsupported=_shadow_unsupported,
)
