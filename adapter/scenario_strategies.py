"""Hypothesis strategies drawing rate-limit scenarios (``adapter/scenarios.Scenario``):
``scenarios`` (ample seats, budget and KV: only the limit can pause a request) and
``pressured_scenarios`` (KV, budget and seat pressure, PRIORITY, aborts, long runs), over
the user ids, rates, bursts and clock steps real traffic has.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario

RATES = ("2", "5", "10", "20", "50", "100", "3.5", "0.5", "0.3", "1000", "7.25")
INTEGER_RATES = ("1", "2", "5", "10", "20", "50", "100", "1000")
BURSTS_MS = (100, 100, 20, 250)
# User ids real traffic has (R17: ids are kept exactly as given; None = no
# ``output_rate_user``, the shared ``__anonymous__`` bucket).
USER_IDS = ("u0", "u1", "u2", "User-A", "user-a", " spaced ", "ünï-東京", "x" * 256, None)
# Clock advances between steps, ns: 1 ns to 250 ms (sub-ms steps reach the burst edge and
# ``ready_at`` closely).
STEP_INTERVALS_NS = (
    1,
    999_999,
    1_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    33_333_333,
    50_000_000,
    100_000_000,
    250_000_000,
)


@st.composite
def _users(draw, integer_rates: bool) -> tuple[list[str | None], dict[str, str], str]:
    """1-3 distinct users drawn from ``USER_IDS``; overrides for some of them (the others,
    and the anonymous bucket, use the default rate). Returns (users, overrides, default)."""
    users = draw(st.lists(st.sampled_from(USER_IDS), min_size=1, max_size=3, unique=True))
    pool = INTEGER_RATES if integer_rates else RATES
    default = draw(st.sampled_from(pool))
    overrides = {u: draw(st.sampled_from(pool)) for u in users if u is not None and draw(st.booleans())}
    return users, overrides, default


def _request_id(user: str | None, k: int, index: int) -> str:
    return f"anon-r{k}" if user is None else f"u{index}-r{k}"


@st.composite
def scenarios(
    draw,
    async_scheduling: bool | None = None,
    max_steps: int = 40,
    integer_rates: bool = False,
    burst_configurable: bool = False,
) -> Scenario:
    """Hypothesis strategy: 1-3 users (named, odd ids, anonymous), 1-4 streams each, ample
    budget, KV and seats, sometimes an active cap (R12) below the number of streams, prefix
    caching on or off (the prompts share a prefix: cached-prompt admissions).

    ``integer_rates``: draw integer rates only (the article's flags take integers).
    ``burst_configurable``: sometimes configure a ``burst_ms`` other than 100.
    """
    users, overrides, default = draw(_users(integer_rates))
    num_steps = draw(st.integers(1, max_steps))
    requests = []
    for index, user in enumerate(users):
        for k in range(draw(st.integers(1, 4))):
            eos = draw(st.one_of(st.none(), st.integers(0, 20)))
            requests.append(
                RequestSpec(
                    request_id=_request_id(user, k, index),
                    user=user,
                    prompt_len=draw(st.integers(1, 40)),
                    max_tokens=draw(st.integers(1, 24)),
                    eos_index=eos,
                    at_step=draw(st.integers(0, max(0, num_steps - 1))),
                )
            )
    cap = draw(st.one_of(st.none(), st.integers(1, max(1, len(requests) - 1)))) if len(requests) > 1 else None
    step_interval_ns = draw(st.sampled_from(STEP_INTERVALS_NS))
    chunked = draw(st.booleans())
    async_mode = draw(st.booleans()) if async_scheduling is None else async_scheduling
    drawn = (overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode)
    return _fanned_out(draw, _drawn_scenario(draw, drawn, burst_configurable, max_num_active_seqs=cap))


def _fanned_out(draw, scenario: Scenario) -> Scenario:
    """Sometimes (1 in 4, drawn last) one user's streams made the children of one n > 1
    request, as vLLM's front end fans it out: one prompt, one ``max_tokens``, one arrival,
    one shared ``SamplingParams`` (``parallel_children``); each child keeps its own EOS."""
    by_user: dict[str | None, list[RequestSpec]] = {}
    for r in scenario.requests:
        by_user.setdefault(r.user, []).append(r)
    families = [rs for rs in by_user.values() if len(rs) >= 2]
    if not families or draw(st.integers(0, 3)) != 0:
        return scenario
    family = draw(st.sampled_from(families))
    first = family[0]
    parent = f"{first.request_id.rpartition('-')[0]}-n{len(family)}"
    shared = {"prompt_len": first.prompt_len, "max_tokens": first.max_tokens, "at_step": first.at_step}
    ids = {r.request_id for r in family}
    requests = tuple(replace(r, parent=parent, **shared) if r.request_id in ids else r for r in scenario.requests)
    return replace(scenario, requests=requests)


def _drawn_scenario(draw, drawn: tuple, burst_configurable: bool, **pressure: Any) -> Scenario:
    """The strategies' common end: the scenario of ``drawn`` (overrides, default rate,
    requests, clock step in ns, steps, chunked prefill, async mode) and ``pressure`` (the
    resource limits), all drawn by the caller, with a ``burst_ms`` (sometimes, with
    ``burst_configurable``) and prefix caching drawn last."""
    overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode = drawn
    return Scenario(
        rates_tokens_per_s=overrides,
        default_rate_tokens_per_s=default,
        requests=tuple(requests),
        step_interval_ns=step_interval_ns,
        num_steps=num_steps,
        chunked_prefill=chunked,
        async_scheduling=async_mode,
        **pressure,
        burst_ms=draw(st.sampled_from(BURSTS_MS)) if burst_configurable and draw(st.booleans()) else None,
        prefix_caching=draw(st.booleans()),  # swarm: vLLM's default, a cached-prompt path (issue 18)
    )


@st.composite
def pressured_scenarios(
    draw,
    async_scheduling: bool | None = None,
    max_steps: int = 40,
    integer_rates: bool = False,
    burst_configurable: bool = False,
) -> Scenario:
    """Hypothesis strategy with resource pressure: few KV blocks (preemption), small token
    budgets (chunking), an active cap below max_num_seqs, FCFS or PRIORITY, aborts; and
    sometimes a run past step 256 (R6 cleanup). Users, rates and clock steps as in
    ``scenarios``."""
    users, overrides, default = draw(_users(integer_rates))
    long_run = draw(st.integers(0, 9)) == 0
    num_steps = 260 if long_run else draw(st.integers(1, max_steps))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    requests = []
    for index, user in enumerate(users):
        for k in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, max(0, min(num_steps, 40) - 1)))
            abort = draw(st.integers(at + 1, at + 30)) if draw(st.integers(0, 4)) == 0 else None
            requests.append(
                RequestSpec(
                    request_id=_request_id(user, k, index),
                    user=user,
                    prompt_len=draw(st.integers(1, 40)),
                    max_tokens=draw(st.integers(1, 16)),
                    eos_index=draw(st.one_of(st.none(), st.integers(0, 16))),
                    at_step=at,
                    priority=draw(st.integers(0, 4)) if policy == "priority" else 0,
                    abort_at_step=abort,
                )
            )
    max_num_seqs = draw(st.integers(1, len(requests) + 1))
    block_size = draw(st.sampled_from([4, 8, 16]))
    # The longest request (prompt 40 + 16 outputs) must fit alone; vLLM keeps one null block.
    longest_blocks = -(-(40 + 16) // block_size) + 1
    chunked = draw(st.booleans())
    step_interval_ns = draw(st.sampled_from(STEP_INTERVALS_NS[1:]))
    async_mode = draw(st.booleans()) if async_scheduling is None else async_scheduling
    max_num_active_seqs = draw(st.integers(1, max_num_seqs))
    # Without chunked prefill a whole prompt must fit the budget.
    # vLLM requires max_num_batched_tokens >= max_num_seqs.
    budget = max(draw(st.sampled_from([8, 16, 32, 64, 2048])), max_num_seqs) if chunked else 2048
    drawn = (overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode)
    return _drawn_scenario(
        draw,
        drawn,
        burst_configurable,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=budget,
        num_blocks=draw(st.integers(longest_blocks, longest_blocks * 3)),
        block_size=block_size,
        policy=policy,
    )
