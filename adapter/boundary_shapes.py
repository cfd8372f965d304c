"""The scenario shapes of the Z3-directed boundaries (``adapter/boundaries.py``): one builder
per boundary, ``build(rate, async_mode, seed) -> Scenario | None`` (``BUILDERS``, by name).

Each builder states a small Z3 problem (``adapter/boundary_model.py``) for the users of
its shape, and turns a model's clock advances into the requests and advances of a
rate-limit ``Scenario`` (``adapter/scenarios.py``) that reaches the boundary; None when
the rate has no model within the bounded prefix. Units: ns for advances, tokens/s for rates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction

import z3

from vllm_output_rate.adapter.boundary_model import CLEANUP_STEP, PrefixModel, UserTrajectory, zmin
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario

AFTER_INTERVAL_NS = 1_000_000  # clock step after the solved prefix (then the judge's drain)
FAST_RATE = "1000"  # the default rate of users a shape does not pace


def _scenario(rates: dict[str, str], requests: list[RequestSpec], advances: tuple[int, ...], **shape) -> Scenario:
    return Scenario(
        rates_tokens_per_s=rates,
        default_rate_tokens_per_s=shape.pop("default", FAST_RATE),
        requests=tuple(requests),
        step_interval_ns=AFTER_INTERVAL_NS,
        num_steps=len(advances) + 1,
        advances_ns=advances,
        **shape,
    )


def _one_stream(
    rate: str,
    seed: int,
    target: Callable[[UserTrajectory, int], list],
    min_grants: int = 1,
    no_reset: bool = False,
    max_prefix: int = 8,
) -> Scenario | None:
    """One user ``u`` at ``rate``, one stream decoding from step 0; the first ``K`` steps
    granted (``K >= min_grants``), ``target(u, K)`` at step K. ``no_reset``: the TAT stays
    ahead of the clock from step 1 on (errors of a rounded T accumulate)."""
    r = Fraction(rate)
    for k in range(min_grants, max_prefix + 1):
        m = PrefixModel(k + 1, seed=seed)
        u = m.user("u", r, [1] * (k + 1))
        m.add(*[u.granted(i) for i in range(k)])
        if no_reset:
            m.add(*[u.ahead(i, 0) for i in range(1, k + 1)])
        m.add(*target(u, k))
        advances = m.solve()
        if advances is not None:
            return _scenario({"u": rate}, [RequestSpec("u-r0", "u", 4, k + 3)], advances)
    return None


def _burst_edge(rate, async_mode, seed):
    return _one_stream(rate, seed, lambda u, k: [u.lead_minus_tau(k) == 0], min_grants=1)


def _burst_edge_plus_1ns(rate, async_mode, seed):
    return _one_stream(rate, seed, lambda u, k: [u.lead_minus_tau(k) == u.p], min_grants=1)


def _ready_at(rate, async_mode, seed):
    # x = TAT - tau (scaled X); after >= 2 grants with the TAT never reset, the step runs
    # at ceil(x) with ceil(x) - x = 1/p ns, the least a rate p/q allows: the take is
    # granted with the smallest margin there is.
    def target(u, k):
        x = u.S[k] - u.burst
        return [u.model.t[k] == -((-x) / u.p), x % u.p == u.p - 1]

    return _one_stream(rate, seed, target, min_grants=2, no_reset=True)


def _ready_at_minus_1ns(rate, async_mode, seed):
    # The step runs at ceil(x) - 1 = floor(x), with x - floor(x) in (0, 1/2) ns: refused.
    def target(u, k):
        x = u.S[k] - u.burst
        return [u.model.t[k] == -((-x) / u.p) - 1, x % u.p != 0, 2 * (x % u.p) < u.p]

    return _one_stream(rate, seed, target, min_grants=1)


def _fractional_interval(rate, async_mode, seed):
    # >= 3 grants in separate steps with the TAT never reset to the clock, then a refusal
    # by less than half a ns: only exact arithmetic of the fractional T refuses it.
    def target(u, k):
        over = u.lead_minus_tau(k)
        return [over > 0, 2 * over < u.p] + [u.model.a[i] >= 1 for i in range(k)]

    return _one_stream(rate, seed, target, min_grants=3, no_reset=True)


def _cleanup(rate: str, seed: int, plus_ns: int) -> Scenario | None:
    """R6: one user with 2 grants (steps 0, 1), idle until the 256th ``schedule()``
    (step index 255) whose clock reads ``TAT - plus_ns``; a new request of the same user
    at step 256, same clock (advance 0); with ``plus_ns`` 1, step 257 runs 1 ns past the
    burst edge of the TAT the spec kept (refused)."""
    steps = CLEANUP_STEP + 3
    free = {0, 1, CLEANUP_STEP - 1, CLEANUP_STEP + 1}
    fixed = {i: 0 for i in range(steps - 1) if i not in free}
    m = PrefixModel(steps, fixed=fixed, seed=seed)
    demand = [0] * steps
    demand[0] = demand[1] = demand[CLEANUP_STEP + 1] = demand[CLEANUP_STEP + 2] = 1
    u = m.user("u", Fraction(rate), demand)
    m.add(u.granted(0), u.granted(1), u.granted(CLEANUP_STEP + 1))
    # The TAT the 256th step's cleanup looks at (no grant in that step).
    m.add(u.S[CLEANUP_STEP + 1] == (m.t[CLEANUP_STEP] + plus_ns) * u.p)
    if plus_ns:
        m.add(u.lead_minus_tau(CLEANUP_STEP + 2) == u.p)
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec("u-r0", "u", 4, 2), RequestSpec("u-r1", "u", 4, 3, at_step=CLEANUP_STEP + 1)]
    return _scenario({"u": rate}, requests, advances)


def _cleanup_at_now(rate, async_mode, seed):
    return _cleanup(rate, seed, 0)


def _cleanup_now_plus_1ns(rate, async_mode, seed):
    return _cleanup(rate, seed, 1)


def _prefill_reaches_n(rate, async_mode, seed):
    """R7: chunked prefill under a token budget ``B`` (max_num_batched_tokens), prompt
    ``n = c B`` (c >= 2 chunks): the final chunk reaches n exactly and is charged; the
    user then stays >= T ahead of the clock until a step 1 ns past the burst edge."""
    r = Fraction(rate)
    for decodes in range(1, 7):
        for chunks in (2, 3):
            steps = chunks + decodes + 1
            m = PrefixModel(steps, seed=seed)
            budget, n = z3.Int("budget"), z3.Int("n")
            m.add(budget >= 8, budget <= 16, n == chunks * budget)
            computed, demand = z3.IntVal(0), []
            for i in range(steps):
                if i < chunks:  # R7 charge condition on the chunk of this step
                    chunk = zmin(budget, n - computed)
                    demand.append(z3.If(computed + chunk >= n, 1, 0))
                    computed = computed + chunk
                else:
                    demand.append(z3.IntVal(1))
            u = m.user("u", r, demand)
            m.add(demand[chunks - 1] == 1, *[demand[i] == 0 for i in range(chunks - 1)])
            m.add(*[u.granted(i) for i in range(steps - 1)])
            m.add(*[u.ahead(i, u.inc) for i in range(chunks, steps)])
            m.add(u.lead_minus_tau(steps - 1) == u.p)
            advances = m.solve()
            if advances is None:
                continue
            model = m.solver.model()
            b = model.eval(budget).as_long()
            # One request, one seat: from the final chunk (exactly the budget) on, nothing
            # but the limit can keep it from sampling; an intermediate chunk charged (R7)
            # shows as an under-grant there (P4).
            return _scenario(
                {"u": rate},
                [RequestSpec("u-r0", "u", chunks * b, decodes + 3)],
                advances,
                max_num_batched_tokens=b,
                max_num_seqs=1,
                ample_from_step=chunks - 1,
            )
    return None


def _prefill_ends_n_minus_1(rate, async_mode, seed):
    """R10 (ample, chunked prefill): stream A decodes from step 0; stream B (prompt 8)
    arrives at step j, when the user is refused 1 ns past the burst edge: B advances to
    n - 1 (scheduled, not sampling); at step j + 1 the user is exactly at the edge and
    one of A, B samples."""
    r = Fraction(rate)
    for j in range(1, 6):
        steps = j + 2
        m = PrefixModel(steps, seed=seed)
        u = m.user("u", r, [1] * j + [2, 2])
        m.add(*[u.granted(i) for i in range(j)])
        m.add(u.lead_minus_tau(j) == u.p, u.lead_minus_tau(j + 1) == 0)
        advances = m.solve()
        if advances is not None:
            requests = [RequestSpec("u-r0", "u", 4, j + 3), RequestSpec("u-r1", "u", 8, 2, at_step=j)]
            return _scenario({"u": rate}, requests, advances)
    return None


def _all_refused(rate, async_mode, seed):
    """R16/R11: two users (the anonymous bucket at the default rate, and an odd id at
    ``rate``), one stream each, granted until a step at which both are refused while their
    requests wait: the anonymous bucket 1 ns past its burst edge."""
    r = Fraction(rate)
    odd = "ünï-東京"
    for k in range(1, 7):
        m = PrefixModel(k + 1, seed=seed)
        anon = m.user("anon", r, [1] * (k + 1))
        other = m.user("odd", r, [1] * (k + 1))
        m.add(*[anon.granted(i) for i in range(k)], *[other.granted(i) for i in range(k)])
        m.add(anon.lead_minus_tau(k) == anon.p, other.refused(k))
        advances = m.solve()
        if advances is not None:
            requests = [RequestSpec("anon-r0", None, 4, k + 3), RequestSpec("u1-r0", odd, 5, k + 3)]
            return _scenario({odd: rate}, requests, advances, default=rate)
    return None


def _rotation_wrap(rate, async_mode, seed):
    """R14/R15: one user with 3 streams, all granted their prefill at step 0 (idle burst
    >= 3: rate >= 20), then exactly one grant per step for 14 steps: the turn passes
    through every stream and wraps around to the first, again and again."""
    r = Fraction(rate)
    single = 14  # > R14_BYPASS_FACTOR x 3 streams: a starved stream shows in the bound
    steps = single + 1
    m = PrefixModel(steps, seed=seed)
    u = m.user("u", r, [3] * steps)
    m.add(u.g[0] == 3, *[u.g[i] == 1 for i in range(1, steps)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec(f"u-r{k}", "u", 4, single // 3 + 4) for k in range(3)]
    return _scenario({"u": rate}, requests, advances)


def _charged_then_preempted(rate, async_mode, seed):
    """R9 (FCFS, 3 KV blocks of 16, the shape of test_r9_charged_then_self_preempted):
    A (user a, fast) prompt 8, B (user b at ``rate``) prompt 16. Step 0 both prefill;
    step 1 B is charged, then its decode needs a 2nd block and none is free: B preempts
    itself, and the charge is refunded at the end of the step. A finishes at step 2; B
    resumes (recompute) and is granted at step 3 while b's TAT is still >= 1 ns ahead of
    the clock; step 4 runs 1 ns past b's burst edge (refused; a second refund at step 1
    would grant it)."""
    r = Fraction(rate)
    # Async: A's finish is delivered one step later, so B is charged and refunded once
    # more (its allocation fails at step 3) and resumes at step 4.
    resume = 4 if async_mode else 3
    steps = resume + 2
    m = PrefixModel(steps, seed=seed)
    refunds = [0, 1, 0, 1, 0, 0] if async_mode else [0, 1, 0, 0, 0]
    b = m.user("b", r, [1, 1, 0] + [1] * (steps - 3), refunds=refunds)
    a = m.user("a", Fraction(FAST_RATE), [1, 1, 1] + [0] * (steps - 3))
    m.add(b.granted(0), b.granted(resume), *[a.granted(i) for i in range(3)])
    m.add(b.ahead(resume, b.p), b.lead_minus_tau(resume + 1) == b.p, *[m.a[i] >= 1_000_000 for i in range(steps - 1)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec("a-r0", "a", 8, 3), RequestSpec("b-r0", "b", 16, 3)]
    # From the resume on only B is left (2 of the 3 blocks): an under-grant there (a charge
    # kept although B was preempted, R9) is judged (P4).
    return _scenario({"b": rate}, requests, advances, num_blocks=3, block_size=16, ample_from_step=resume)


def _charged_then_alloc_failure(rate, async_mode, seed):
    """R9 (FCFS, 4 KV blocks of 16): A (user a, fast) prompt 17 holds 2 blocks, B0 (user
    b at ``rate``) prompt 4 the third; both decode at step 1. B1 (user b) prompt 16 arrives
    at step 1: b is granted both (B0's decode and B1's prefill are charged), then B1's
    allocation fails and its charge is refunded. A and B0 finish at step 1; B1 is admitted
    and granted at step 2 while b's TAT minus T is still ahead of the clock; step 3 runs
    1 ns past b's burst edge (refused; a second refund would grant it)."""
    r = Fraction(rate)
    # Async: A and B0 finish one step later; B1's allocation fails again at step 2.
    admit = 3 if async_mode else 2
    steps = admit + 2
    m = PrefixModel(steps, seed=seed)
    refunds = [0, 1, 1, 0, 0] if async_mode else [0, 1, 0, 0]
    b = m.user("b", r, [1, 2] + [1] * (steps - 2), refunds=refunds)
    a = m.user("a", Fraction(FAST_RATE), [1, 1] + [0] * (steps - 2))
    m.add(b.granted(0), b.granted(admit), a.granted(0), a.granted(1))
    m.add(
        b.ahead(admit, b.inc + b.p),
        b.lead_minus_tau(admit + 1) == b.p,
        *[m.a[i] >= 1_000_000 for i in range(steps - 1)],
    )
    advances = m.solve()
    if advances is None:
        return None
    requests = [
        RequestSpec("a-r0", "a", 17, 2),
        RequestSpec("b-r0", "b", 4, 2),
        RequestSpec("b-r1", "b", 16, 2, at_step=1),
    ]
    # From B1's admission on only B1 is left (2 of the 3 usable blocks): under-grant judged.
    return _scenario({"b": rate}, requests, advances, num_blocks=4, block_size=16, ample_from_step=admit)


def _priority_throttled_victim(rate, async_mode, seed, policy: str = "priority", v_priority: int = 0):
    """R13 under PRIORITY (4 KV blocks of 16, the shape of test_r13_*): U1 (user u at
    ``rate``, T > tau) prompt 4, V1 (user v, fast) prompt 16, V2 (v) prompt 4, all
    priority 0. Step 0 all prefill; step 1 u is refused 1 ns past its burst edge (U1
    throttled) and V1's decode needs a block: the throttled U1 is the victim (R13).

    ``v_priority`` 1: V1 and V2 at priority 1, below the throttled U1 (priority 0): vLLM's
    victim level is 1, so V2 is the victim and U1 keeps its KV (a throttled victim taken
    across levels is a violation). ``policy`` "fcfs": the same shape under FCFS, where
    vLLM alone would preempt V2 (the last of ``running``) and the article and this spec
    preempt the throttled U1 (R13 FCFS)."""
    r = Fraction(rate)
    m = PrefixModel(2, seed=seed)
    u = m.user("u", r, [1, 1])
    v = m.user("v", Fraction(FAST_RATE), [2, 2])
    m.add(u.granted(0), u.lead_minus_tau(1) == u.p, v.granted(0), v.granted(1))
    advances = m.solve()
    if advances is None:
        return None
    # V2's EOS comes at its 2nd output: in async its next step is dispatched before the EOS
    # is known and stays charged (R8).
    requests = [
        RequestSpec("u-r0", "u", 4, 2),
        RequestSpec("v-r0", "v", 16, 3, priority=v_priority),
        RequestSpec("v-r1", "v", 4, 3, eos_index=1, priority=v_priority),
    ]
    return _scenario({"u": rate}, requests, advances, num_blocks=4, block_size=16, policy=policy)


def _priority_throttled_victim_above(rate, async_mode, seed):
    return _priority_throttled_victim(rate, async_mode, seed, v_priority=1)


def _fcfs_throttled_victim(rate, async_mode, seed):
    return _priority_throttled_victim(rate, async_mode, seed, policy="fcfs")


def _refused_prefill_ahead(rate, async_mode, seed):
    """R10/P4 with chunked prefill: the shape of ``_refused_prompt_ahead``, but U1's refused
    prompt (4 tokens) can advance to n - 1, so it never ends admission: V (another user's
    request behind it) is admitted in the same step. Head-of-line blocking here is the
    limit's, not vLLM's."""
    scenario = _refused_prompt_ahead(rate, async_mode, seed)
    return None if scenario is None else replace(scenario, chunked_prefill=True)


def _active_cap_throttled_places(rate, async_mode, seed):
    """R12 (active cap 2, ample otherwise): user u (2 grants at once, then refused: 10 to
    19 tokens/s) has two streams admitted at step 0; from step 1 on both are throttled and
    give up both their active places, so of v's three requests arriving at step 1 exactly
    two are admitted (len(running) - throttled < A), and the batch holds A requests."""
    r = Fraction(rate)
    m = PrefixModel(3, seed=seed)
    u = m.user("u", r, [2, 2, 2])
    v = m.user("v", Fraction(FAST_RATE), [0, 2, 2])
    m.add(u.granted(0), u.refused(1), u.refused(2), v.granted(1), v.granted(2))
    m.add(*[m.a[i] >= 1_000_000 for i in range(2)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec(f"u-r{k}", "u", 4, 3) for k in range(2)]
    requests += [RequestSpec(f"v-r{k}", "v", 4, 3, at_step=1) for k in range(3)]
    return _scenario({"u": rate}, requests, advances, max_num_active_seqs=2)


def _running_prefill_refused(rate, async_mode, seed):
    """R10 (chunked prefill, token budget 16): U0 (prompt 4) samples at step 0, when U1
    (prompt 40) starts its prefill; u (T > tau) is refused at steps 1 and 2, so U1, a
    running request, is refused at its final chunk (step 2) and advances to n - 1 (11 of
    the 12 tokens left) while the step leaves budget; its last token samples later."""
    r = Fraction(rate)
    m = PrefixModel(3, seed=seed)
    u = m.user("u", r, [1, 1, 2])
    m.add(u.granted(0), u.refused(1), u.refused(2), *[m.a[i] >= 1_000_000 for i in range(2)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec("u-r0", "u", 4, 3), RequestSpec("u-r1", "u", 40, 2)]
    return _scenario({"u": rate}, requests, advances, max_num_batched_tokens=16)


def _rotation_beside_others(rate, async_mode, seed):
    """R14 beside another user: U0, V0, U1 arrive in that order (u's streams hold places
    0 and 2 of ``running``, v's place 1); after both first tokens u gets exactly one grant
    per step, so its streams take turns by trading places 0 and 2, and V0 keeps place 1."""
    r = Fraction(rate)
    steps = 7
    m = PrefixModel(steps, seed=seed)
    u = m.user("u", r, [2] * steps)
    m.add(u.g[0] == 2, *[u.g[i] == 1 for i in range(1, steps)], *[m.a[i] >= 1_000_000 for i in range(steps - 1)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec("u-r0", "u", 4, 6), RequestSpec("v-r0", "v", 4, 12), RequestSpec("u-r1", "u", 4, 6)]
    return _scenario({"u": rate}, requests, advances)


def _parallel_children(rate, async_mode, seed):
    """R17, n > 1: one request of user u (T > tau) fanned out into 3 children sharing one
    ``SamplingParams`` (vLLM's front end); one child's first token is granted at step 0,
    the other two wait for u's budget. Every child is u's, none anonymous (the anonymous
    bucket, at the default 1000 tokens/s, would grant them at once)."""
    r = Fraction(rate)
    m = PrefixModel(2, seed=seed)
    u = m.user("u", r, [3, 2])
    m.add(u.g[0] == 1, u.refused(1), *[m.a[i] >= 1_000_000 for i in range(1)])
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec(f"u-c{k}", "u", 4, 2, parent="u-n3") for k in range(3)]
    return _scenario({"u": rate}, requests, advances)


def _recompute_after_preemption(rate, async_mode, seed):
    """R7 after a preemption (FCFS, 3 usable KV blocks of 16, token budget 8): A (user a,
    fast, prompt 16, 20 outputs) and B (user b at ``rate``, prompt 12) share the blocks
    until A's growth needs B's; B, last in ``running`` (and throttled: b's burst is spent
    by then), is preempted, and when A finishes B recomputes its prompt and outputs in
    chunks of 8: only the chunk that samples is charged (R7), so b's budget then grants its
    decodes as from the spec's replay; a recompute chunk charged shows as an under-grant."""
    del seed
    m = PrefixModel(2)
    u = m.user("b", Fraction(rate), [1, 1])
    m.add(u.granted(0), u.granted(1), m.a[0] == 1_000_000)
    if m.solve() is None:  # the pool's rates grant 2 tokens 1 ms apart from idle
        return None
    requests = [RequestSpec("a-r0", "a", 16, 20), RequestSpec("b-r0", "b", 12, 10)]
    advances = tuple([1_000_000] * 39)
    return _scenario(
        {"b": rate}, requests, advances, max_num_batched_tokens=8, num_blocks=4, block_size=16, ample_from_step=None
    )


def _refused_prompt_ahead(rate, async_mode, seed):
    """R10 without chunked prefill: U0 (user u at ``rate``, T > tau) decodes from step 0;
    step 1 runs 1 ns past u's burst edge and brings U1 (user u) and, behind it, V (user v,
    fast) into ``waiting``. U1's prompt waits whole (no chunk to advance to n - 1); V, behind
    the refused U1, is admitted by the spec (the article's charge-point placement may hold
    it for this step: an open choice, docs/SPEC.md)."""
    r = Fraction(rate)
    m = PrefixModel(2, seed=seed)
    u = m.user("u", r, [1, 2])
    m.add(u.granted(0), u.lead_minus_tau(1) == u.p)
    advances = m.solve()
    if advances is None:
        return None
    requests = [
        RequestSpec("u-r0", "u", 4, 3),
        RequestSpec("u-r1", "u", 4, 2, at_step=1),
        RequestSpec("v-r0", "v", 4, 2, at_step=1),
    ]
    return _scenario({"u": rate}, requests, advances, chunked_prefill=False)


def _active_cap_binds(rate, async_mode, seed):
    """R12 (active cap 1, ample otherwise): U (user u at ``rate``, T > tau) and V (user v,
    fast), prompt 4 each, both waiting at step 0. Step 0 admits U alone (the cap); step 1
    runs 1 ns past u's burst edge: U is throttled, does not count toward the cap, and V is
    admitted; at step 2 both users are granted and the cap binds: one of the two running
    requests samples, the other waits for the next step although its user is granted."""
    r = Fraction(rate)
    m = PrefixModel(3, seed=seed)
    u = m.user("u", r, [1, 1, 1])
    v = m.user("v", Fraction(FAST_RATE), [0, 1, 1])
    m.add(u.granted(0), u.lead_minus_tau(1) == u.p, u.granted(2), v.granted(1), v.granted(2))
    advances = m.solve()
    if advances is None:
        return None
    requests = [RequestSpec("u-r0", "u", 4, 3), RequestSpec("v-r0", "v", 4, 3)]
    return _scenario({"u": rate}, requests, advances, max_num_active_seqs=1)


BUILDERS: dict[str, Callable[[str, bool, int], Scenario | None]] = {
    "burst-edge": _burst_edge,
    "burst-edge+1ns": _burst_edge_plus_1ns,
    "ready-at": _ready_at,
    "ready-at-1ns": _ready_at_minus_1ns,
    "cleanup-tat-now": _cleanup_at_now,
    "cleanup-tat-now+1ns": _cleanup_now_plus_1ns,
    "prefill-reaches-n": _prefill_reaches_n,
    "prefill-ends-n-1": _prefill_ends_n_minus_1,
    "charged-then-preempted": _charged_then_preempted,
    "charged-then-alloc-failure": _charged_then_alloc_failure,
    "fractional-interval": _fractional_interval,
    "all-refused": _all_refused,
    "rotation-wrap": _rotation_wrap,
    "priority-throttled-victim": _priority_throttled_victim,
    "priority-throttled-victim-above": _priority_throttled_victim_above,
    "fcfs-throttled-victim": _fcfs_throttled_victim,
    "refused-prompt-ahead": _refused_prompt_ahead,
    "active-cap-binds": _active_cap_binds,
    "refused-prefill-ahead": _refused_prefill_ahead,
    "active-cap-throttled-places": _active_cap_throttled_places,
    "running-prefill-refused": _running_prefill_refused,
    "rotation-beside-others": _rotation_beside_others,
    "recompute-after-preemption": _recompute_after_preemption,
    "parallel-children": _parallel_children,
}
