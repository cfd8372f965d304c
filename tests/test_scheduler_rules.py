"""Scheduler rules R7-R18 on the REAL vLLM 0.32.0 scheduler, in-process, fake clock.

Every test drives ``RateLimitedScheduler`` (sync) or ``RateLimitedAsyncScheduler``
(``async_scheduling=True``, one step in flight) through ``adapter.harness.Harness`` and
compares what vLLM itself exposes (``SchedulerOutput``, finished outputs, ``running``,
KV blocks) plus the white-box ``last_step_observation`` with expectations computed by
hand in the comments.

Notation used in the comments: rate r tok/s gives emission interval T = 1/r s; burst
tolerance tau = 100 ms (R1). A user is granted at ``now`` iff TAT - now <= tau, and then
TAT := max(TAT, now) + T (R2); ready_at = ceil(TAT - tau) (R5). "t=50" means the step
scheduled at fake time 50 ms. Unless stated, prompts are 4 tokens, block size 16.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from fractions import Fraction

import pytest
from vllm.v1.request import RequestStatus

from vllm_output_rate.adapter import engine_shape as engine_shape_module
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER, Harness, StepTrace
from vllm_output_rate.reference.identity import validate_extra_args
from vllm_output_rate.reference.section import OutputRateConfigError
from vllm_output_rate.spec.properties import accounting_error

MS = 1_000_000  # ns per ms
MAX_TEST_STEPS = 400  # bound on every run loop below


# -- helpers -------------------------------------------------------------------
def make(async_scheduling: bool, **shape) -> Harness:
    """A harness on the reference scheduler matching the mode (P5)."""
    cls = REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER
    return Harness(cls, EngineShape(async_scheduling=async_scheduling, **shape))


def check_accounting(trace: StepTrace) -> None:
    """R7 + R9 on one step, from the white-box observation.

    At most one charge per request per step; refunds only of this step's charges, each
    at most once; and charged minus refunded is exactly the set dispatched to sample.
    """
    white = trace.white
    assert white is not None, "the feature is on: the reference must observe every step"
    assert accounting_error(white["charged"], white["refunded"], trace.sampled) is None


def step(h: Harness, dt_ms: int = 0) -> StepTrace:
    """One step with the accounting checks, then advance the clock by ``dt_ms``."""
    trace = h.step()
    check_accounting(trace)
    h.advance(dt_ms * MS)
    return trace


def run_until_done(h: Harness, dt_ms: int, max_steps: int = MAX_TEST_STEPS) -> list[StepTrace]:
    """Step until every added request has finished (and the async pipe is drained)."""
    traces = []
    for _ in range(max_steps):
        if len(h.finished) == len(h.num_outputs) and h._in_flight is None:
            return traces
        if not h.scheduler.has_requests() and h._in_flight is not None:
            h.drain()
            continue
        traces.append(step(h, dt_ms))
    raise AssertionError(f"not finished after {max_steps} steps: finished={h.finished}")


def tat(h: Harness, user: str) -> Fraction | None:
    return h.scheduler.last_step_observation["tat_ns"].get(user)


def is_running(h: Harness, request_id: str) -> bool:
    return any(r.request_id == request_id for r in h.scheduler.running)


# -- R7: charge on dispatch ---------------------------------------------------------
@pytest.mark.rules("R7")
def test_r7_prompt_chunks_never_charged_final_chunk_once(async_scheduling):
    # rate 1000 tok/s (T = 1 ms, never binding at 10 ms steps), max_num_batched_tokens 8,
    # one request, prompt 20, max_tokens 3. Chunks: 8 (0..8), 8 (8..16), 4 (16..20).
    #   t=0   chunk 8  -> no sampling, charged []
    #   t=10  chunk 8  -> charged []
    #   t=20  chunk 4  = final chunk, samples output 1 -> charged [r], TAT 21 ms
    #   t=30  decode 1 -> charged [r], TAT 31 ms
    #   t=40  decode 1 -> charged [r], TAT 41 ms; third output: finished ("length", 3)
    # Async: same dispatches (num_computed_tokens includes the in-flight placeholder and
    # vLLM skips the step after the max_tokens-th token).
    h = make(async_scheduling, max_num_seqs=4, max_num_batched_tokens=8, output_rate={"default_tokens_per_s": 1000})
    h.add_request("r", "u", prompt_len=20, max_tokens=3)
    traces = [step(h, 10) for _ in range(5)]
    assert [t.scheduled for t in traces] == [{"r": 8}, {"r": 8}, {"r": 4}, {"r": 1}, {"r": 1}]
    assert [t.white["charged"] for t in traces] == [[], [], ["r"], ["r"], ["r"]]
    assert [t.white["refunded"] for t in traces] == [[]] * 5
    assert tat(h, "u") == 41 * MS
    assert traces[0].white["wait_hint_ns"] is None  # R16: nobody refused
    run_until_done(h, 10)
    assert h.finished == {"r": ("length", 3)}


@pytest.mark.rules("R7")
def test_r7_decode_charges_one_per_request_per_step(async_scheduling):
    # user u: A, B; user v: C. rate 1000 (T = 1 ms), 10 ms steps, max_tokens 5.
    #   t=0   prefill A, B, C: charged [A, B, C]  (u TAT 1, 2 ms; v TAT 1 ms)
    #   t=10..40 one decode each per step: charged [A, B, C] each step
    #   u: two charges per step, TAT = now + 2 ms after each step -> 42 ms at t=40;
    #   v: 41 ms. Total charges per request = 5 = max_tokens.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 1000})
    for rid, user in (("A", "u"), ("B", "u"), ("C", "v")):
        h.add_request(rid, user, max_tokens=5)
    traces = [step(h, 10) for _ in range(5)]
    for trace in traces:
        assert trace.white["charged"] == ["A", "B", "C"]
        assert list(trace.scheduled) == ["A", "B", "C"]
    assert tat(h, "u") == 42 * MS
    assert tat(h, "v") == 41 * MS
    traces += run_until_done(h, 10)
    charges = Counter(rid for t in traces for rid in t.white["charged"])
    assert charges == {"A": 5, "B": 5, "C": 5}
    assert h.finished == dict.fromkeys("ABC", ("length", 5))


# -- R9: single refund point ---------------------------------------------------------
def _r9_next_step_preempts_and_refunds(h: Harness, kept: str, victim: str, tat_ms: dict[str, int]) -> None:
    """R9: the next step (then 50 ms on) charges A and B and preempts ``victim``.

    Only ``kept`` is scheduled (1 decode token) and exactly the victim's charge is
    refunded; afterwards each user of ``tat_ms`` has that TAT (ms), and A and B (3 output
    tokens each) both finish by length.
    """
    trace = step(h, 50)
    assert trace.scheduled == {kept: 1}
    assert trace.preempted == [victim]
    assert trace.white["charged"] == ["A", "B"]
    assert trace.white["refunded"] == [victim]
    assert {user: tat(h, user) for user in tat_ms} == {user: ms * MS for user, ms in tat_ms.items()}
    run_until_done(h, 50)
    assert h.finished == {"A": ("length", 3), "B": ("length", 3)}


@pytest.mark.rules("R9")
def test_r9_charged_then_self_preempted_is_refunded_once(async_scheduling):
    # FCFS, 3 KV blocks (1 null + 2 usable) of 16 tokens. Users a, b at 10 tok/s (T 100 ms).
    # A: prompt 8 (1 block, room to decode); B: prompt 16 (exactly 1 block).
    #   t=0   A, B prefilled and charged: TAT a = b = 100 ms; free blocks 0.
    #   t=50  A decode (9th token fits) charged: a 100-50 <= 100 -> TAT 200 ms.
    #         B decode needs a 2nd block, none free: FCFS victim running[-1] = B itself,
    #         after B was charged (b TAT 200 ms). R9: refunded -> b TAT back to 100 ms.
    #         charged [A, B], refunded [B], preempted [B], scheduled {A: 1}.
    # B later resumes (recompute) and both end with exactly max_tokens outputs.
    h = make(async_scheduling, num_blocks=3, output_rate={"default_tokens_per_s": 10})
    h.add_request("A", "a", prompt_len=8, max_tokens=3)
    h.add_request("B", "b", prompt_len=16, max_tokens=3)
    t0 = step(h, 50)
    assert t0.white["charged"] == ["A", "B"]
    assert tat(h, "b") == 100 * MS
    _r9_next_step_preempts_and_refunds(h, kept="A", victim="B", tat_ms={"a": 200, "b": 100})  # b's TAT went back


@pytest.mark.rules("R9")
def test_r9_priority_scheduled_then_preempted_later_is_refunded(async_scheduling):
    # PRIORITY policy, 3 KV blocks (2 usable). Users a, b at 10 tok/s.
    # A (priority 1, arrival 0): prompt 8; B (priority 0 = higher, arrival 1): prompt 16.
    #   t=0   only A: prefill, charged (a TAT 100 ms).
    #   t=50  A decode charged (a TAT 200 ms); B admitted, prefill 16, charged (b TAT 150).
    #         Free blocks 0.
    #   t=100 running [A, B]. A decode (10th token, fits) charged: 200-100 <= 100 -> a TAT
    #         300 ms, A scheduled. B decode needs a block: victim = max (priority, arrival)
    #         = A, already scheduled -> unscheduled and preempted later in the same
    #         schedule(). R9: A refunded -> a TAT back to 200 ms.
    #         charged [A, B], refunded [A], preempted [A], scheduled {B: 1}.
    h = make(async_scheduling, num_blocks=3, policy="priority", output_rate={"default_tokens_per_s": 10})
    h.add_request("A", "a", prompt_len=8, max_tokens=3, priority=1)
    assert step(h, 50).white["charged"] == ["A"]
    h.add_request("B", "b", prompt_len=16, max_tokens=3, priority=0)
    t1 = step(h, 50)
    assert t1.white["charged"] == ["A", "B"]
    assert tat(h, "a") == 200 * MS
    _r9_next_step_preempts_and_refunds(h, kept="B", victim="A", tat_ms={"a": 200})  # a's TAT went back


# -- R10: throttled prefill ------------------------------------------------------------
def _r10_scenario(h: Harness) -> None:
    # user u 10 tok/s: X1, X2 (prompt 4, max_tokens 1) take the two grants from idle at
    # t=0 (TAT 100, then 200 ms); X3 (prompt 10, max_tokens 2) is refused at t=0
    # (200 - 0 > 100; u ready at 100 ms). Y (user v, added after X3) must not be blocked.
    h.add_request("X1", "u", prompt_len=4, max_tokens=1)
    h.add_request("X2", "u", prompt_len=4, max_tokens=1)
    h.add_request("X3", "u", prompt_len=10, max_tokens=2)
    h.add_request("Y", "v", prompt_len=4, max_tokens=1)


def _r10_x3_granted_at_100_and_200_ms(h: Harness, first_tokens: int) -> None:
    """From t=100 ms of ``_r10_scenario`` (steps every 50 ms): X3 is granted, scheduled
    ``first_tokens`` tokens and charged; refused at t=150; granted its second output at
    t=200 and finished by length with 2 tokens."""
    t2 = step(h, 50)
    assert t2.scheduled == {"X3": first_tokens}
    assert t2.white["charged"] == ["X3"]
    assert step(h, 50).scheduled == {}
    assert step(h, 50).scheduled == {"X3": 1}
    run_until_done(h, 50)
    assert h.finished["X3"] == ("length", 2)


@pytest.mark.rules("R10")
def test_r10_chunked_refused_prefill_advances_to_n_minus_1(async_scheduling):
    #   t=0   X1 4, X2 4 charged; X3 refused: advances 9 = prompt_len - 1 tokens, no
    #         charge; Y admitted after it and charged.
    #   t=50  X3 needs its last prompt token, which samples: u 200-50 > 100 -> throttled.
    #   t=100 X3 granted (u TAT 300): 1 token, charged; first output.
    #   t=150 refused (300-150 > 100); t=200 granted -> second output, finished.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10})
    _r10_scenario(h)
    t0 = step(h, 50)
    assert t0.scheduled == {"X1": 4, "X2": 4, "X3": 9, "Y": 4}
    assert t0.white["charged"] == ["X1", "X2", "Y"]
    assert t0.white["wait_hint_ns"] == 100 * MS
    t1 = step(h, 50)
    assert t1.scheduled == {}
    assert t1.white["throttled"] == ["X3"]
    assert h.scheduler.requests["X3"].num_computed_tokens == 9
    _r10_x3_granted_at_100_and_200_ms(h, 1)


@pytest.mark.rules("R10")
def test_r10_no_chunked_prefill_whole_prefill_waits(async_scheduling):
    #   t=0   X1, X2 charged; X3 refused and NOT scheduled at all (the whole prefill
    #         waits, R10); Y (later in the waiting queue, other user) still admitted.
    #   t=50  X3 still waiting (u 200-50 > 100), not running so not "throttled".
    #   t=100 X3 granted: the whole 10-token prefill, charged.
    #   t=200 second output (t=150 refused).
    h = make(async_scheduling, chunked_prefill=False, output_rate={"default_tokens_per_s": 10})
    _r10_scenario(h)
    t0 = step(h, 50)
    assert t0.scheduled == {"X1": 4, "X2": 4, "Y": 4}
    assert t0.white["charged"] == ["X1", "X2", "Y"]
    assert h.scheduler.requests["X3"].status == RequestStatus.WAITING
    t1 = step(h, 50)
    assert t1.scheduled == {}
    assert t1.white["throttled"] == []
    assert t1.white["wait_hint_ns"] == 100 * MS
    _r10_x3_granted_at_100_and_200_ms(h, 10)


@pytest.mark.rules("R10")
@pytest.mark.parametrize("prompt_len", [1, 17], ids=["prompt1", "prompt17"])
def test_r10_refused_waiting_request_does_not_block_others(async_scheduling, prompt_len, monkeypatch):
    # A refused user's waiting request that cannot advance without sampling must be
    # skipped, not stop admission (vLLM 0.32 stops at the first 0-token waiting request).
    # user u 10 tok/s; P0, P1 take u's two grants at t=0 (TAT 200 ms).
    # prompt1: P2 has a 1-token prompt: its only prompt token samples.
    # prompt17: prefix caching on; P1 and P2 share a 17-token prompt, so at t=50 P2 hits
    #   16 cached tokens = prompt_len - 1: again only the sampling token is left.
    #   t=50  P2 refused (u 200-50 > 100) and skipped; Y (user v) admitted and charged.
    #   t=100 P2 granted.
    if prompt_len == 17:
        # The gate turns prefix caching off; vLLM's default (and a real deployment) has it on.
        build = engine_shape_module.build_vllm_config

        def with_prefix_caching(shape):
            config = build(shape)
            config.cache_config.enable_prefix_caching = True
            return config

        monkeypatch.setattr(engine_shape_module, "build_vllm_config", with_prefix_caching)
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10})
    assert h.scheduler.kv_cache_manager.enable_caching == (prompt_len == 17)
    h.add_request("P0", "u", prompt_len=4, max_tokens=1)
    h.add_request("P1", "u", prompt_len=17, max_tokens=1)
    t0 = step(h, 50)
    assert t0.white["charged"] == ["P0", "P1"]
    h.add_request("P2", "u", prompt_len=prompt_len, max_tokens=1)
    h.add_request("Y", "v", prompt_len=4, max_tokens=1)
    t1 = step(h, 50)
    assert "Y" in t1.scheduled, "R10: a refused waiting request blocked a later one"
    assert t1.white["charged"] == ["Y"]
    assert t1.scheduled.get("P2", 0) == {1: 0, 17: 0}[prompt_len]
    t2 = step(h, 50)
    assert t2.white["charged"] == ["P2"]
    run_until_done(h, 50)
    assert h.finished["P2"] == ("length", 1)
    assert h.finished["Y"] == ("length", 1)


# -- R11: skip, keep resident ----------------------------------------------------------
@pytest.mark.rules("R11")
def test_r11_throttled_stay_resident_and_resume_without_recompute(async_scheduling):
    # user u 10 tok/s, streams A, B (prompt 4, max_tokens 4), steps every 50 ms.
    # One grant per 100 ms after the two from idle; R14 alternates the streams:
    #   t=0 [A, B] (TAT 200) | t=50 none | t=100 [A] (300) | t=150 none | t=200 [B] (400)
    #   t=300 [A] | t=400 [B] | t=500 [A] (4th: done) | t=600 [B] (4th: done)
    # Throttled: both at every odd step until A is done; at t=550 only B (A is finished,
    # or in async skipped by vLLM as having reached max_tokens); at a granting step the
    # other stream (t=100 B, t=200 A, ... t=500 B; at t=600 A is done).
    # While throttled a request stays in `running`, keeps the same KV block ids and its
    # num_computed_tokens; it is never preempted; total scheduled tokens per request =
    # prompt + max_tokens - 1 (no recompute); each ends with exactly 4 outputs.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10})
    h.add_request("A", "u", max_tokens=4)
    h.add_request("B", "u", max_tokens=4)
    expected_sampled = {0: ["A", "B"], 100: ["A"], 200: ["B"], 300: ["A"], 400: ["B"], 500: ["A"], 600: ["B"]}
    expected_throttled = (
        {t: ["A", "B"] for t in range(50, 500, 100)}
        | {550: ["B"]}
        | {100: ["B"], 200: ["A"], 300: ["B"], 400: ["A"], 500: ["B"]}
    )
    kv = h.scheduler.kv_cache_manager
    before: dict[str, tuple] = {}
    scheduled_tokens = Counter()
    for i in range(13):
        now_ms = 50 * i
        for rid in ("A", "B"):
            if rid in h.scheduler.requests:
                req = h.scheduler.requests[rid]
                before[rid] = (req.num_computed_tokens, kv.get_block_ids(rid))
        trace = step(h, 50)
        assert trace.now_ns == now_ms * MS
        assert trace.sampled == expected_sampled.get(now_ms, []), now_ms
        assert trace.white["throttled"] == expected_throttled.get(now_ms, []), now_ms
        assert trace.preempted == []
        scheduled_tokens.update(trace.scheduled)
        for rid in trace.white["throttled"]:
            assert is_running(h, rid), f"R11: throttled {rid} left running at t={now_ms}"
            req = h.scheduler.requests[rid]
            assert (req.num_computed_tokens, kv.get_block_ids(rid)) == before[rid]
            assert kv.get_block_ids(rid)[0], f"R11: throttled {rid} lost its KV blocks"
    run_until_done(h, 50)
    assert scheduled_tokens == {"A": 4 + 4 - 1, "B": 4 + 4 - 1}
    assert h.finished == {"A": ("length", 4), "B": ("length", 4)}


@pytest.mark.rules("R11")
def test_r11_pause_not_truncate_many_streams_and_eos(async_scheduling):
    # Two users at 20 tok/s with 3 and 2 streams and uneven lengths, one stream stopping on
    # EOS at output index 5 (6 outputs), 10 ms steps: every request ends with exactly
    # max_tokens outputs (or EOS), nothing aborted or truncated. Bound check (R2):
    # dispatches of a user in [0, W] <= (W + tau) * rate + 1.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 20})
    spec = {"a1": ("a", 12, None), "a2": ("a", 7, None), "a3": ("a", 9, 5), "b1": ("b", 10, None), "b2": ("b", 5, None)}
    for rid, (user, max_tokens, eos) in spec.items():
        h.add_request(rid, user, prompt_len=6, max_tokens=max_tokens, eos_index=eos)
    traces = run_until_done(h, 10)
    assert h.finished == {
        "a1": ("length", 12),
        "a2": ("length", 7),
        "a3": ("stop", 6),
        "b1": ("length", 10),
        "b2": ("length", 5),
    }
    for user in ("a", "b"):
        times = [t.now_ns for t in traces for rid in t.sampled if spec[rid][0] == user]
        span_s = Fraction(times[-1] - times[0], 10**9)
        assert len(times) <= (span_s + Fraction(1, 10)) * 20 + 1


# -- R12: skip-not-count ---------------------------------------------------------------
@pytest.mark.rules("R12")
@pytest.mark.parametrize("where", ["vllm_field", "output_rate_key"])
def test_r12_throttled_do_not_count_toward_active_cap(async_scheduling, where):
    # M = max_num_seqs 5, A = 2. user u 10 tok/s (U1, U2), user v 1000 tok/s (V1..V3).
    #   t=0   U1, U2 admitted and charged (u TAT 200 ms).
    #   t=50  U1, U2 throttled. Waiting loop admits while len(running) - throttled < 2:
    #         V1 (2-2 < 2), V2 (3-2 < 2); V3 not (4-2 = 2), although len(running) 4 < M.
    #         scheduled {V1: 4, V2: 4}. (Stock meaning of A would admit nobody: 2 >= 2.)
    #   t=100 running [U1, U2, V1, V2]: U1 granted (u TAT 300), U2 throttled, V1 granted,
    #         V2 not scheduled (2 running already scheduled = A). V3 waits (4 - 1 >= 2).
    #   t=150 R14 rotation [U2, U1, V2, V1]: U2, U1 throttled (u ready at 200 ms);
    #         V2, V1 granted.
    # Every step: scheduled requests <= A; throttled requests remain in running.
    output_rate = {"default_tokens_per_s": 1000, "user_tokens_per_s": {"u": 10}}
    if where == "output_rate_key":
        h = make(async_scheduling, max_num_seqs=5, output_rate=output_rate | {"max_num_active_seqs": 2})
    else:
        h = make(async_scheduling, max_num_seqs=5, max_num_active_seqs=2, output_rate=output_rate)
    h.add_request("U1", "u", max_tokens=20)
    h.add_request("U2", "u", max_tokens=20)
    t0 = step(h, 50)
    assert t0.scheduled == {"U1": 4, "U2": 4}
    for rid in ("V1", "V2", "V3"):
        h.add_request(rid, "v", max_tokens=20)
    t1 = step(h, 50)
    assert t1.white["throttled"] == ["U1", "U2"]
    assert t1.scheduled == {"V1": 4, "V2": 4}
    assert h.scheduler.requests["V3"].status == RequestStatus.WAITING
    assert len(h.scheduler.running) == 4
    t2 = step(h, 50)
    assert t2.scheduled == {"U1": 1, "V1": 1}
    assert t2.white["throttled"] == ["U2"]
    assert h.scheduler.requests["V3"].status == RequestStatus.WAITING
    t3 = step(h, 50)
    assert t3.scheduled == {"V2": 1, "V1": 1}
    assert t3.white["throttled"] == ["U1", "U2"]
    assert t3.white["wait_hint_ns"] == 200 * MS  # R16: u (TAT 300 ms) is refused too
    for trace in [t0, t1, t2, t3] + run_until_done(h, 50):
        assert len(trace.scheduled) <= 2, f"R12: active cap exceeded at {trace.now_ns}: {trace.scheduled}"
        for rid in trace.white["throttled"]:
            assert rid not in trace.scheduled
    assert all(h.finished[rid] == ("length", 20) for rid in ("U1", "U2", "V1", "V2", "V3"))


@pytest.mark.rules("R12")
def test_r12_throttled_behind_the_active_cap_are_still_throttled(async_scheduling):
    # A throttled request that vLLM's running loop never reaches because A requests were
    # already scheduled is still refused this step: reported throttled (R11) and its user's
    # ready_at is the wait hint (R16). M = 3, A = 2; w and u at 5 tok/s (T 200 ms), v 1000.
    #   t=0   W1 (w TAT 200 ms), V1 admitted; U1 waits (2 - 0 >= A).
    #   t=50  W1 throttled (200-50 > 100), V1 granted; U1 admitted (2 - 1 < A), charged
    #         (u TAT 250 ms). running [W1, V1, U1].
    #   t=100 W1 granted (w TAT 400), V1 granted: A reached. U1 refused (250-100 > 100):
    #         throttled [U1], wait hint = u ready_at = 150 ms.
    h = make(
        async_scheduling,
        max_num_seqs=3,
        output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"w": 5, "u": 5}, "max_num_active_seqs": 2},
    )
    h.add_request("W1", "w", max_tokens=5)
    h.add_request("V1", "v", max_tokens=5)
    h.add_request("U1", "u", max_tokens=5)
    assert step(h, 50).scheduled == {"W1": 4, "V1": 4}
    t1 = step(h, 50)
    assert t1.scheduled == {"V1": 1, "U1": 4}
    assert t1.white["throttled"] == ["W1"]
    t2 = step(h, 50)
    assert t2.scheduled == {"W1": 1, "V1": 1}
    assert t2.white["throttled"] == ["U1"]
    assert t2.white["wait_hint_ns"] == 150 * MS
    run_until_done(h, 50)
    assert h.finished == dict.fromkeys(("W1", "V1", "U1"), ("length", 5))


# -- R13: preferred victims --------------------------------------------------------------
def _r13_harness(async_scheduling: bool, policy: str, v2_priority: int = 0) -> Harness:
    # 4 KV blocks (3 usable). user u 1 tok/s (T 1 s), user v 1000 tok/s.
    # Admission order (FCFS and PRIORITY alike): U1 (prompt 4), V1 (prompt 16: its first
    # decode needs a 2nd block), V2 (prompt 4). At t=0 all three prefill: 3 blocks used.
    h = make(
        async_scheduling,
        num_blocks=4,
        policy=policy,
        output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"u": 1}},
    )
    h.add_request("U1", "u", prompt_len=4, max_tokens=2)
    h.add_request("V1", "v", prompt_len=16, max_tokens=3)
    h.add_request("V2", "v", prompt_len=4, max_tokens=3, priority=v2_priority)
    t0 = step(h, 50)
    assert t0.white["charged"] == ["U1", "V1", "V2"]
    return h


@pytest.mark.rules("R13")
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_r13_throttled_requests_are_preempted_first(async_scheduling, policy):
    #   t=50  u refused (TAT 1000 ms - 50 > 100): U1 throttled. V1 needs a block, none
    #         free. Stock victim: V2 (FCFS running[-1]; PRIORITY max (0, arrival 2)).
    #         R13: the throttled U1 is preempted instead; V1 and V2 both decode.
    #         preempted [U1], scheduled {V1: 1, V2: 1}, nothing refunded.
    # U1 resumes (recompute) once u is ready (t=900) and blocks are free; all complete.
    h = _r13_harness(async_scheduling, policy)
    t1 = step(h, 50)
    assert t1.preempted == ["U1"]
    assert t1.scheduled == {"V1": 1, "V2": 1}
    assert t1.white["charged"] == ["V1", "V2"]
    assert t1.white["refunded"] == []
    assert [r.request_id for r in h.scheduler.running] == ["V1", "V2"]
    run_until_done(h, 50)
    assert h.finished == {"U1": ("length", 2), "V1": ("length", 3), "V2": ("length", 3)}


@pytest.mark.rules("R13")
def test_r13_priority_prefers_throttled_only_within_the_same_level(async_scheduling):
    # As above but V2 has priority 1 (lower than U1's 0). The victim level is 1; the
    # throttled U1 is at level 0 and must not be chosen: V2 is preempted, U1 stays.
    h = _r13_harness(async_scheduling, "priority", v2_priority=1)
    t1 = step(h, 50)
    assert t1.preempted == ["V2"]
    assert t1.scheduled == {"V1": 1}
    assert t1.white["throttled"] == ["U1"]
    assert is_running(h, "U1")
    run_until_done(h, 50)
    assert h.finished == {"U1": ("length", 2), "V1": ("length", 3), "V2": ("length", 3)}


@pytest.mark.rules("R13")
def test_r13_running_order_is_unchanged_when_nothing_is_preempted(async_scheduling):
    # R13 may reorder only the choice of victims: with enough KV, `running` after each
    # step is the stock order (admission order, R14 rotation aside). user u 10 tok/s
    # with U1 (throttled from t=50), user v 1000 tok/s with V1, V2 after it.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"u": 10}})
    h.add_request("U1", "u", max_tokens=5)
    h.add_request("U2", "u", max_tokens=5)
    h.add_request("V1", "v", max_tokens=5)
    step(h, 50)
    trace = step(h, 50)
    assert trace.white["throttled"] == ["U1", "U2"]
    assert [r.request_id for r in h.scheduler.running] == ["U1", "U2", "V1"]


# -- R14 / R15: rotation, last served --------------------------------------------------------
@pytest.mark.rules("R14", "R15")
def test_r14_r15_streams_of_one_user_are_served_round_robin(async_scheduling):
    # user u 10 tok/s, 100 ms steps: two grants from idle, then exactly one per step.
    # Added S1, V1 (user v, 1000 tok/s, max_tokens 11), S2, S3; S* max_tokens 4.
    #   t=0   S1 (TAT 100), V1, S2 (TAT 200) charged; S3 refused -> prefill to 3 tokens.
    #         running [S1, V1, S2, S3]; last served of u: S2.
    #   t=100 rotation of u's slots (0, 2, 3) after S2: [S3, V1, S1, S2]: S3 granted.
    #   t=200 after S3: [S1, V1, S2, S3]: S1. t=300: S2. t=400: S3 ... round robin;
    #   S1 finishes at t=800, S2 at t=900 (last served S1 gone or done: order kept),
    #   S3 at t=1000. V1 keeps its slot 1 while all three S run, and samples every step.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"u": 10}})
    h.add_request("S1", "u", max_tokens=4)
    h.add_request("V1", "v", max_tokens=11)
    h.add_request("S2", "u", max_tokens=4)
    h.add_request("S3", "u", max_tokens=4)
    u_sampled = []
    for i in range(11):
        trace = step(h, 100)
        u_sampled.append([rid for rid in trace.sampled if rid.startswith("S")])
        assert "V1" in trace.sampled
        if i <= 7:
            assert [r.request_id for r in h.scheduler.running][1] == "V1", f"R14: V1 moved at t={100 * i}"
    assert u_sampled == [["S1", "S2"], ["S3"], ["S1"], ["S2"], ["S3"], ["S1"], ["S2"], ["S3"], ["S1"], ["S2"], ["S3"]]
    run_until_done(h, 100)
    assert h.finished == {"S1": ("length", 4), "S2": ("length", 4), "S3": ("length", 4), "V1": ("length", 11)}


@pytest.mark.rules("R15")
def test_r15_last_served_forgets_finished_streams(async_scheduling):
    # R15 state must not grow with every user ever served: after the R6 cleanup (every
    # 256 steps) only streams still known to the scheduler are remembered.
    # 40 users, each one request of 2 tokens at 1000 tok/s, all finished long before step 256.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 1000})
    for k in range(40):
        h.add_request(f"r{k}", f"user-{k}", max_tokens=2)
    run_until_done(h, 1)
    for _ in range(260 - h.step_index):
        step(h, 1)
    assert h.scheduler._turns.last_served == {}
    assert len(h.scheduler.rate_limiter) == 0  # R6


# -- R16: the wait hint ------------------------------------------------------------------
@pytest.mark.rules("R16")
def test_r16_wait_hint_is_earliest_ready_at_among_refused_users(async_scheduling):
    # users u 10 tok/s (T 100 ms), w 4 tok/s (T 250 ms), x 3 tok/s (T 333_333_333.3 ns).
    #   t=0   U1 (u TAT 100), U2 (200); U3 refused. W1 (w TAT 250); W2 refused.
    #         X1 (x TAT 1/3 s); X2 refused. ready_at: u 100 ms, w 150 ms,
    #         x ceil(333_333_333.3 - 100_000_000) = 233_333_334.  hint = 100 ms.
    #   t=120 U3 granted (200-120 <= 100, u TAT 300); U1 refused: u ready 200 ms.
    #         W2 refused (250-120 > 100): 150 ms. X2 refused: 233_333_334. hint = 150 ms.
    #   t=150 u refused (ready 200 ms). W2 granted (w TAT 500), W1 refused: w ready 400 ms.
    #         x refused (233_333_334). hint = 200 ms.
    #   t=240 u granted once (U1, TAT 400) then refused: ready 300 ms. w refused (400 ms).
    #         x granted (X2; 333.3-240 <= 100; TAT 666_666_666.7) then refused:
    #         ready ceil(566_666_666.7) = 566_666_667. hint = 300 ms.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10, "user_tokens_per_s": {"w": 4, "x": 3}})
    for rid in ("U1", "U2", "U3", "W1", "W2", "X1", "X2"):
        h.add_request(rid, rid[0].lower(), max_tokens=10)
    expected = [
        (0, 120, ["U1", "U2", "W1", "X1"], 100 * MS),
        (120, 30, ["U3"], 150 * MS),
        (150, 90, ["W2"], 200 * MS),
        (240, 0, None, 300 * MS),
    ]
    for now_ms, dt_ms, charged, hint_ns in expected:
        trace = step(h, dt_ms)
        assert trace.now_ns == now_ms * MS
        if charged is not None:
            assert trace.white["charged"] == charged, now_ms
        assert trace.white["wait_hint_ns"] == hint_ns, now_ms
        assert h.scheduler.next_ready_ns() == hint_ns
    # At t=240 rotation gives u [U1, U2, U3] (last served U3) and x [X2, X1] (last X1).
    assert trace.white["charged"] == ["U1", "X2"]
    assert h.scheduler.rate_limiter.ready_at_ns("x") == 566_666_667


# -- R17: identity ---------------------------------------------------------------------------
@pytest.mark.rules("R17")
def test_r17_user_from_extra_args_anonymous_shared_bucket(async_scheduling):
    # 10 tok/s. N1, N2, N3 carry no output_rate_user: one shared bucket "__anonymous__":
    # N1 (TAT 100), N2 (200) granted at t=0, N3 refused (prefill to n-1). "bob" has his own
    # bucket: B1 granted (TAT 100).
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10})
    for rid in ("N1", "N2", "N3"):
        h.add_request(rid, None)
    h.add_request("B1", "bob")
    trace = step(h, 50)
    assert trace.white["charged"] == ["N1", "N2", "B1"]
    assert trace.scheduled == {"N1": 4, "N2": 4, "N3": 3, "B1": 4}
    assert trace.white["tat_ns"] == {"__anonymous__": 200 * MS, "bob": 100 * MS}


@pytest.mark.rules("R17")
@pytest.mark.parametrize(
    "bad", [42, True, "", "x" * 1000, "y" * 257], ids=["int", "bool", "empty", "1000chars", "257chars"]
)
def test_r17_bad_user_value_named_and_isolated(async_scheduling, bad, caplog):
    # Decision (reference/identity.py): a user id is a non-empty str of <= 256 characters.
    # The front end (plugin.py) refuses a bad one with a ValueError naming the value
    # (repr, cut at 80 characters). The scheduler never raises (an exception inside the
    # engine core would fail every request in flight): it logs the value and charges the
    # request to "__anonymous__". Other requests are unaffected.
    # 10 tok/s, each request in its own bucket: t=0 grants alice, __anonymous__ (the bad
    # one) and the 256-character id: every TAT 100 ms; each ends with its 3 outputs.
    with pytest.raises(ValueError, match="output_rate_user") as info:
        validate_extra_args({"output_rate_user": bad})
    assert repr(bad)[:80] in str(info.value)
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 10})
    h.add_request("good1", "alice", max_tokens=3)
    with caplog.at_level(logging.ERROR):
        h.add_request("bad", bad, max_tokens=3)
    assert repr(bad)[:80] in caplog.text
    long_id = "x" * 256  # the limit, accepted
    h.add_request("good2", long_id, max_tokens=3)
    t0 = step(h, 50)
    assert t0.white["charged"] == ["good1", "bad", "good2"]
    assert t0.white["tat_ns"] == {"alice": 100 * MS, "__anonymous__": 100 * MS, long_id: 100 * MS}
    run_until_done(h, 50)
    assert h.finished == dict.fromkeys(("good1", "bad", "good2"), ("length", 3))


# -- R18: feature off ------------------------------------------------------------------------
def _r18_scenario(h: Harness) -> list[tuple]:
    """Mixed load with chunked prefill, KV pressure (preemptions), EOS, an abort, late
    arrivals, priorities and a value that would be a bad user id with the feature on."""
    specs = [
        ("R0", "a", 40, 20, None, 0),
        ("R1", "b", 20, 30, 10, 0),
        ("R2", None, 8, 25, None, 1),
        ("R3", "a", 30, 15, None, 0),
        ("R4", "c", 16, 12, None, 1),
    ]
    for rid, user, prompt_len, max_tokens, eos, prio in specs:
        h.add_request(rid, user, prompt_len=prompt_len, max_tokens=max_tokens, eos_index=eos, priority=prio)
    out = []
    for i in range(MAX_TEST_STEPS):
        if i == 5:
            h.add_request("R5", "b", prompt_len=24, max_tokens=10)
        if i == 8:
            h.abort("R2")
        if i == 12:
            h.add_request("R6", 42, prompt_len=5, max_tokens=6)
        if i > 12 and not h.scheduler.has_requests():
            break
        t = h.step()
        out.append((t.now_ns, list(t.scheduled.items()), t.sampled, t.preempted, t.finished, t.white))
        h.advance(10 * MS)
    h.drain()
    return out


@pytest.mark.rules("R18")
@pytest.mark.parametrize("section", [None], ids=["no_section"])  # an empty section on our class is refused
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_r18_feature_off_is_trace_identical_to_stock(async_scheduling, stock_cls, reference_cls, section, policy):
    # 4 seqs with vLLM's own max_num_active_seqs 3 (upstream meaning), 32-token batches,
    # 8 KV blocks (7 usable: preemptions happen). Same scenario on stock vLLM and on the
    # reference with the feature off: step-for-step identical traces and results.
    shape = {
        "max_num_seqs": 4,
        "max_num_active_seqs": 3,
        "max_num_batched_tokens": 32,
        "num_blocks": 8,
        "policy": policy,
        "async_scheduling": async_scheduling,
    }
    stock = Harness(stock_cls, EngineShape(**shape))
    ref = Harness(reference_cls, EngineShape(**shape, output_rate=section))
    stock_trace, ref_trace = _r18_scenario(stock), _r18_scenario(ref)
    assert ref.scheduler.rate_limiter is None
    assert any(step_[3] for step_ in stock_trace), "the scenario must exercise preemption"
    assert any(n > 1 for step_ in stock_trace for _, n in step_[1] if n < 32), "and chunked prefill"
    assert len(ref_trace) == len(stock_trace)
    for expected, got in zip(stock_trace, ref_trace):
        assert got == expected
    assert ref.finished == stock.finished
    assert ref.num_outputs == stock.num_outputs


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"default_tokens_per_s": -1}, "default_tokens_per_s must be > 0 tokens per second, got -1"),
        (
            {"default_tokens_per_s": "fast"},
            "default_tokens_per_s must be a number of tokens per second (int or float), got 'fast' of type str",
        ),
        ({"user_tokens_per_s": {"a": 5}}, "output_rate is configured without default_tokens_per_s"),
        (
            {"default_tokens_per_s": 10, "burst": 5},
            """unknown key(s) in additional_config["output_rate"]: 'burst' (did you mean 'burst_ms'?)""",
        ),
        (
            {"default_tokens_per_s": 10, "user_tokens_per_s": {"a": 0}},
            "user_tokens_per_s['a'] must be > 0 tokens per second, got 0",
        ),
        ({"default_tokens_per_s": 10, "max_num_active_seqs": 0}, "max_num_active_seqs must be an integer >= 1, got 0"),
        ({"default_tokens_per_s": 10, "burst_ms": 0}, "burst_ms must be an integer number of milliseconds >= 1, got 0"),
        ([10], 'additional_config["output_rate"] must be a JSON object, got [10]'),
    ],
    ids=["negative", "string", "no_default", "unknown_key", "user_zero", "active_zero", "burst_zero", "not_object"],
)
def test_config_bad_output_rate_fails_at_construction(async_scheduling, section, message):
    with pytest.raises(OutputRateConfigError, match=re.escape(message)):
        make(async_scheduling, output_rate=section)


# -- R2/R7: the per-step fast path (no user can run out of grants) -------------------------
@pytest.mark.rules("R2")
def test_r2_unconstrained_step_needs_a_grant_for_every_request_of_every_user(async_scheduling):
    # The hook skips per-user bookkeeping only in a step where every user can be granted
    # one token per request it has (R7: at most one charge per request per step).
    # "fast" 1000 tok/s: idle burst floor(0.1 x 1000) + 1 = 101 grants >= 2 requests.
    # "slow" 10 tok/s: idle burst floor(0.1 x 10) + 1 = 2 grants; 2 requests fit, 3 do not.
    h = make(async_scheduling, output_rate={"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": 10}})
    for k in range(2):
        h.add_request(f"f{k}", "fast", max_tokens=8)
        h.add_request(f"s{k}", "slow", max_tokens=8)
    step(h, 1)
    assert h.scheduler._step.unconstrained
    assert sorted(h.scheduler.last_step_observation["charged"]) == ["f0", "f1", "s0", "s1"]
    # slow spent its burst at t=0: TAT = 200 ms, 0 spare grants -> the next step asks the limiter.
    h.add_request("s2", "slow", max_tokens=8)
    step(h, 1)
    assert not h.scheduler._step.unconstrained
    assert "s2" not in h.scheduler.last_step_observation["charged"]
    assert "slow" in h.scheduler._step.refused_users
