"""The step spec (``spec/scheduler.py``, ``spec/rate.py``) on small hand-computed scenarios.

Pure Python, no vLLM: every expectation below is worked out by hand in the comments from
the V-rules (vLLM 0.32 behaviour, ``spec/scheduler.py``) and R-rules (docs/SPEC.md).
``tests/test_fidelity.py`` replays several of these scenarios on real vLLM.

Notation: "blocks 4x4" = block size 4 and 4 usable blocks (``num_blocks`` counts vLLM's
null block too, so it is 5). Rate r tok/s gives T = 1/r s; tau = 100 ms; a take at
``now`` is granted iff TAT - now <= tau, then TAT := max(TAT, now) + T (R2).
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest

from vllm_output_rate.spec import invariants
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, Drain, Step
from vllm_output_rate.spec.scheduler import initial_state, step
from vllm_output_rate.spec.state import (
    EngineConfig,
    Finished,
    Observation,
    find,
)

pytestmark = pytest.mark.check

MS = 1_000_000


def cfg(**kw) -> EngineConfig:
    base = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 65, "chunked_prefill": True}
    base.update(kw)
    return EngineConfig(**base)


def rated(rate="10", users=(), **kw) -> EngineConfig:
    """Feature on: default rate ``rate`` tok/s, per-user overrides ``users``."""
    return cfg(
        default_rate_tokens_per_s=Fraction(rate),
        user_rates_tokens_per_s=tuple((u, Fraction(r)) for u, r in users),
        **kw,
    )


def play(config, events):
    """Run the events, checking every invariant after each; return (state, step observations)."""
    state = initial_state(config)
    history = invariants.DispatchHistory()
    out = []
    for event in events:
        before = state
        state, obs = step(state, event)
        if config.rate_limited:
            history = invariants.advance_history(history, before, obs)
        violated = invariants.check(before, event, state, obs, history if config.rate_limited else None)
        assert violated is None, violated
        if isinstance(event, (Step, Drain, Abort)):
            out.append(obs)
    return state, out


def add(rid, user="u", prompt=4, max_tokens=16, eos=None, prio=0):
    return AddRequest(rid, user=user, priority=prio, prompt_len=prompt, max_tokens=max_tokens, eos_index=eos)


def sched(obs: Observation) -> list:
    return list(obs.scheduled)


# -- V-rules: base vLLM 0.32 ---------------------------------------------------------------
def test_v1_running_first_then_waiting_within_one_budget():
    # budget 10: step 0 admits A (6) and the first 4 tokens of B (chunked); step 1: A
    # decodes 1, B's last 2 tokens reach its sampling position.
    _, obs = play(cfg(max_num_batched_tokens=10), [add("A", prompt=6), add("B", prompt=6), Step(), Step()])
    assert sched(obs[0]) == [("A", 6), ("B", 4)] and obs[0].sampled == ("A",)
    assert sched(obs[1]) == [("A", 1), ("B", 2)] and obs[1].sampled == ("A", "B")
    assert obs[0].admitted == ("A", "B") and obs[1].admitted == ()


def test_v3_async_no_step_past_max_tokens():
    # async, prompt 4, max_tokens 2: step 0 prefill (placeholder 1); step 1 decode; step 2:
    # computed 5 + 2 - placeholders 1 = 6 >= 4 + 2: skipped; step 1's output finishes it.
    state, obs = play(cfg(async_scheduling=True), [add("A", max_tokens=2), Step(), Step(), Step()])
    assert [sched(o) for o in obs] == [[("A", 4)], [("A", 1)], []]
    assert obs[2].finished == (Finished("A", "length", 2),)
    assert find(state, "A") is None


def test_v4_async_chunk_capped_by_max_model_len():
    # async, max_model_len 8, prompt 5: computed runs 5, 6, 7 while outputs lag one step;
    # at step 3 the room max_model_len - computed(7) - 1 = 0 -> skipped; step 2's output
    # makes num_tokens 8 >= max_model_len: finished "length" with 3 outputs.
    _, obs = play(cfg(async_scheduling=True, max_model_len=8), [add("A", prompt=5, max_tokens=10)] + [Step()] * 4)
    assert [sched(o) for o in obs] == [[("A", 5)], [("A", 1)], [("A", 1)], []]
    assert obs[3].finished == (Finished("A", "length", 3),)


def test_v5_admission_needs_the_whole_sequence_to_fit():
    # blocks 4x4, budget 8. A (prompt 4) holds 1 block, 3 free. B (prompt 16) needs 4
    # blocks for its whole sequence: refused although its first chunk (8 tokens, 2 blocks)
    # would fit; FCFS: C behind it is not admitted either.
    state, obs = play(
        cfg(num_blocks=5, max_num_batched_tokens=8), [add("A"), Step(), add("B", prompt=16), add("C", prompt=1), Step()]
    )
    assert sched(obs[1]) == [("A", 1)]
    assert state.waiting == ("B", "C") and state.num_free_blocks == 2  # A now holds 2 blocks (5 tokens)


def test_v6_fcfs_preempts_last_running_and_v7_admits_nothing():
    # blocks 4x4: A, B (prompt 4, 1 block each) admitted at step 0, outputs grow both; at
    # step 4 each holds 2 blocks (computed 8), free 0. Step 5: A needs a 3rd block: victim is
    # running[-1] = B (5 outputs), back to the front of waiting; C (prompt 1) is not admitted
    # in that step (V7), and at step 6 B (9 tokens = 3 blocks > 1 free) blocks C (FCFS).
    events = [add("A", max_tokens=10), add("B", max_tokens=10)] + [Step()] * 5 + [add("C", prompt=1), Step(), Step()]
    state, obs = play(cfg(num_blocks=5), events)
    assert sched(obs[5]) == [("A", 1)] and obs[5].preempted == ("B",) and obs[5].admitted == ()
    assert sched(obs[6]) == [("A", 1)] and state.waiting == ("B", "C")
    assert find(state, "B").num_output_tokens == 5 and find(state, "B").num_computed_tokens == 0


def test_v6_fcfs_resumed_request_recomputes_prompt_and_outputs():
    # Same as above; A finishes with 10 outputs at step 9 (its 10th dispatch), freeing 4
    # blocks; step 10 re-admits B with prompt 4 + 5 outputs = 9 tokens in one chunk, which
    # samples B's 6th output.
    events = [add("A", max_tokens=10), add("B", max_tokens=10)] + [Step()] * 11
    _, obs = play(cfg(num_blocks=5), events)
    assert obs[9].finished == (Finished("A", "length", 10),)
    assert sched(obs[10]) == [("B", 9)] and obs[10].sampled == ("B",) and obs[10].admitted == ("B",)


def test_v6_priority_preempts_worst_and_returns_its_budget():
    # PRIORITY, blocks 4x3. A (prio 2) admitted at step 0; B (prio 0) at step 1 takes the
    # last block. Step 3: A decodes (1 token, no new block), then B needs a 2nd block, free
    # 0: the victim is max (priority, arrival) = A, already scheduled: its token goes back
    # to the budget and only B is in the batch.
    events = [add("A", prio=2), Step(), add("B", prompt=3, prio=0), Step(), Step(), Step()]
    state, obs = play(cfg(num_blocks=4, policy="priority"), events)
    assert sched(obs[3]) == [("B", 1)] and obs[3].preempted == ("A",)
    assert state.running == ("B",) and state.waiting == ("A",)


def test_v6_priority_self_preemption_stops_the_running_loop():
    # PRIORITY, blocks 4x4: as above but with one more block. At step 5 A (prio 2, first in
    # running) needs a 3rd block, free 0; the victim is A itself (worst key): the running
    # loop stops, B is not served in that step at all.
    events = [add("A", prio=2), Step(), add("B", prompt=3, prio=0)] + [Step()] * 5
    _, obs = play(cfg(num_blocks=5, policy="priority"), events)
    assert sched(obs[5]) == [] and obs[5].preempted == ("A",)


def test_v8_without_chunked_prefill_a_prompt_waits_for_room():
    # budget = max_model_len = 16, no chunking: A takes 8, B (9 tokens) does not fit the 8
    # left and waits whole; next step A decodes 1 and B (9 <= 15) is admitted.
    config = cfg(chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    _, obs = play(config, [add("A", prompt=8), add("B", prompt=9), Step(), Step()])
    assert sched(obs[0]) == [("A", 8)] and sched(obs[1]) == [("A", 1), ("B", 9)]


def test_v8_priority_queue_pops_by_priority_then_arrival():
    _, obs = play(
        cfg(policy="priority", max_num_seqs=1), [add("A", prio=1), add("B", prio=0), add("C", prio=0), Step()]
    )
    assert obs[0].admitted == ("B",)


def test_v10_eos_stops_with_eos_index_plus_one_outputs():
    _, obs = play(cfg(), [add("A", eos=1), Step(), Step(), Step()])
    assert obs[1].finished == (Finished("A", "stop", 2),) and sched(obs[2]) == []


def test_v12_async_dispatches_once_more_after_eos():
    # async, EOS at output 1: dispatches 0 (prefill), 1 (EOS), 2 (scheduled before the EOS
    # is known, output dropped); step 2 delivers the EOS.
    _, obs = play(cfg(async_scheduling=True), [add("A", eos=1), Step(), Step(), Step(), Step()])
    assert [o.sampled for o in obs] == [("A",), ("A",), ("A",), ()]
    assert obs[2].finished == (Finished("A", "stop", 2),) and obs[3].finished == ()


def test_v10_async_stale_output_of_a_preempted_request_is_delivered():
    # async FCFS, blocks 4x4 as in the V6 test: when B is preempted its decode of the
    # previous step is in flight; that output is still appended (stale), B ends with no
    # placeholders, no in-flight tokens, 0 computed tokens, waiting.
    events = [add("A", max_tokens=12), add("B", max_tokens=12)] + [Step()] * 8
    state = initial_state(cfg(num_blocks=5, async_scheduling=True))
    for event in events:
        before = state
        state, obs = step(state, event)
        if obs.preempted == ("B",):
            b_before = find(before, "B")
            b_after = find(state, "B")
            assert b_before.num_in_flight_tokens == 1 and b_before.num_output_placeholders == 1
            assert b_after.num_output_tokens == b_before.num_output_tokens + 1
            assert (b_after.num_output_placeholders, b_after.num_in_flight_tokens, b_after.num_computed_tokens) == (
                0,
                0,
                0,
            )
            assert b_after.status == "preempted" and "B" in state.waiting
            return
    pytest.fail("B was never preempted")


def test_v11_abort_frees_blocks_and_reports_outputs():
    state, obs = play(cfg(num_blocks=5), [add("A"), Step(), Step(), Abort("A"), Abort("A")])
    assert obs[2].finished == (Finished("A", "abort", 2),) and obs[3].finished == ()
    assert state.num_free_blocks == 4 and state.running == ()


# -- R-rules: the rate limit -----------------------------------------------------------------
@pytest.mark.rules("R7")
def test_r7_charge_only_at_the_sampling_chunk():
    # budget 4, prompt 10: chunks 4, 4, 2; only the last reaches the sampling position.
    _, obs = play(rated(max_num_batched_tokens=4), [add("A", user="a", prompt=10), Step(), Step(), Step()])
    assert [o.charged for o in obs] == [(), (), ("A",)]
    assert obs[2].tat_ns == (("a", Fraction(100 * MS)),)


# Users a (a0, a1) and b (b0); at rate 10 (T = 100 ms), see two_users_three_streams. The
# gate's fidelity and replay tests run the same events on vLLM.
TWO_USERS_THREE_STREAMS = (
    add("a0", "a"),
    add("a1", "a"),
    add("b0", "b"),
    Step(),
    Step(),
    AdvanceClock(100 * MS),
    Step(),
    AdvanceClock(100 * MS),
    Step(),
)


def two_users_three_streams():
    # rate 10 (T = 100 ms). t=0: a0, a1, b0 admitted and charged: TAT_a = 200, TAT_b = 100.
    # step 1 (t=0): a refused at the start (200 - 0 > 100): a0, a1 throttled; b0 charged
    # (TAT_b 200). step 2 (t=100): a0 charged (TAT_a 300), a1 refused (300-100 > 100),
    # b0 charged (300). step 3 (t=200): R14 puts a1 (after the last served a0) first:
    # a1 charged (400), a0 refused; b0 charged (400).
    return play(rated("10"), TWO_USERS_THREE_STREAMS)


@pytest.mark.rules("R11", "R16")
def test_r11_r16_two_users_three_streams_throttle_and_wait_hint():
    state, obs = two_users_three_streams()
    assert obs[0].charged == ("a0", "a1", "b0")
    assert obs[1].charged == ("b0",) and obs[1].throttled == ("a0", "a1") and sched(obs[1]) == [("b0", 1)]
    assert obs[1].wait_hint_ns == 100 * MS  # R5: ceil(TAT_a - tau) = 200 - 100 ms
    assert obs[2].charged == ("a0", "b0") and obs[2].throttled == ("a1",)
    assert obs[2].wait_hint_ns == 200 * MS  # a: 300 - 100
    # R11: a throttled request stays resident and keeps its computed tokens and blocks.
    assert find(state, "a1").status == "running" and find(state, "a1").num_blocks == 2


@pytest.mark.rules("R14", "R15")
def test_r14_r15_streams_of_one_user_take_turns():
    state, obs = two_users_three_streams()
    assert obs[3].charged == ("a1", "b0") and obs[3].throttled == ("a0",)
    assert sched(obs[3]) == [("a1", 1), ("b0", 1)]
    assert ("a", 0, "a1") in state.last_served and ("b", 0, "b0") in state.last_served
    assert dict(obs[3].tat_ns) == {"a": Fraction(400 * MS), "b": Fraction(400 * MS)}


@pytest.mark.rules("R9")
def test_r9_refund_when_admission_fails_for_kv():
    # 1 usable block of 4: A (prompt 8) is charged at t=0 (TAT 100 ms) and then does not fit:
    # refunded at the end of schedule(): TAT back to 0.
    _, obs = play(rated(num_blocks=2), [add("A", "a", prompt=8), Step()])
    assert obs[0].charged == ("A",) and obs[0].refunded == ("A",) and sched(obs[0]) == []
    assert obs[0].tat_ns == (("a", Fraction(0)),)


@pytest.mark.rules("R9")
def test_r9_kv_shortage_preempts_a_charged_request_which_is_refunded():
    # The PRIORITY scenario of test_v6_priority_preempts_worst_...: rate 1000 (T = 1 ms),
    # clock +10 ms per step. Step 3 (t=30 ms): A charged (TAT_a 31 ms) and scheduled, then
    # preempted for B: refunded, TAT_a back to 30 ms; B charged and dispatched (TAT_b 31 ms).
    events = [add("A", "a", prio=2), Step(), AdvanceClock(10 * MS), add("B", "b", prompt=3, prio=0), Step()]
    events += [AdvanceClock(10 * MS), Step(), AdvanceClock(10 * MS), Step()]
    _, obs = play(rated("1000", num_blocks=4, policy="priority"), events)
    assert obs[3].charged == ("A", "B") and obs[3].refunded == ("A",) and obs[3].preempted == ("A",)
    assert obs[3].sampled == ("B",)
    assert dict(obs[3].tat_ns) == {"a": Fraction(30 * MS), "b": Fraction(31 * MS)}


def burst_then(config, extra):
    # a0, a1 spend user a's burst at t=0 (TAT_a 200 ms); the rest arrive in the same step.
    return play(config, [add("a0", "a"), add("a1", "a")] + extra + [Step(), Step()])


@pytest.mark.rules("R10")
def test_r10_chunked_prefill_advances_refused_request_to_n_minus_1():
    state, obs = burst_then(rated("10"), [add("a2", "a", prompt=6)])
    assert sched(obs[0]) == [("a0", 4), ("a1", 4), ("a2", 5)] and obs[0].charged == ("a0", "a1")
    assert find(state, "a2").num_computed_tokens == 5 and obs[1].throttled == ("a0", "a1", "a2")


@pytest.mark.rules("R10")
def test_r10_refused_waiting_request_does_not_block_other_users():
    state, obs = burst_then(
        rated("10", chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64),
        [add("a2", "a"), add("b0", "b")],
    )
    assert obs[0].admitted == ("a0", "a1", "b0") and state.waiting == ("a2",)


@pytest.mark.rules("R12")
def test_r12_active_cap_counts_scheduled_running_not_throttled():
    # A = 1 of M = 4 seats. t=0: a0 admitted (TAT_a 100). Step 1 (t=0): a0 charged again
    # (TAT 200) and fills the active place: b0 waits (1 running - 0 throttled = A).
    # Step 2: a0 throttled at the start: admission cap min(4, 1 + 1) = 2, b0 admitted.
    config = rated("10", output_rate_max_num_active_seqs=1)
    _, obs = play(config, [add("a0", "a"), add("b0", "b"), Step(), Step(), Step()])
    assert obs[0].admitted == ("a0",) and obs[1].admitted == () and obs[1].scheduled_running == 1
    assert obs[2].throttled == ("a0",) and obs[2].admitted == ("b0",)


@pytest.mark.rules("R12")
def test_r12_running_loop_serves_at_most_a_running_requests():
    # A = 1; a0 and b0 both running and both granted: only the first is in the batch,
    # b0 gets 0 tokens without being throttled (no refusal involved).
    config = rated("1000", output_rate_max_num_active_seqs=1, max_num_active_seqs=2)
    _state, obs = play(
        config, [add("a0", "a"), Step(), add("b0", "b"), AdvanceClock(10 * MS), Step(), AdvanceClock(10 * MS), Step()]
    )
    assert obs[0].admitted == ("a0",) and obs[1].admitted == ()  # 1 running, 0 throttled = A
    assert sched(obs[2]) == [("a0", 1)] and obs[2].throttled == ()


@pytest.mark.rules("R13")
def test_r13_fcfs_throttled_request_is_preempted_before_the_last_running():
    # blocks 4x2. a (1 tok/s) and b (1000 tok/s) each get one block at t=0. t=10 ms: a0 is
    # throttled at the start (TAT_a 1 s); b0 needs a 2nd block: stock vLLM would preempt
    # running[-1] = b0 itself; R13 preempts a0 and b0 decodes.
    config = rated("1000", users=(("a", "1"),), num_blocks=3)
    _, obs = play(config, [add("a0", "a"), add("b0", "b"), Step(), AdvanceClock(10 * MS), Step()])
    assert obs[1].preempted == ("a0",) and sched(obs[1]) == [("b0", 1)] and obs[1].throttled == ()
    _, stock = play(cfg(num_blocks=3), [add("a0", "a"), add("b0", "b"), Step(), Step()])
    assert stock[1].preempted == ("b0",)


def priority_victim_level_events(a0_priority: int) -> tuple[EngineConfig, list]:
    """The R13 priority scenarios: (config, events).

    PRIORITY policy, 4 KV blocks of 4 tokens, default 1000 tok/s and user a at 1 tok/s.
    a0 (user a, priority ``a0_priority``), c0 (priority 1) and b0 (3-token prompt,
    priority 0) arrive; one step at t=0, one at t=10 ms.
    """
    config = rated("1000", users=(("a", "1"),), num_blocks=4, policy="priority")
    events = [
        add("a0", "a", prio=a0_priority),
        add("c0", "c", prio=1),
        add("b0", "b", prompt=3, prio=0),
        Step(),
        AdvanceClock(10 * MS),
        Step(),
    ]
    return config, events


@pytest.mark.rules("R13")
def test_r13_priority_prefers_throttled_only_within_the_victim_level():
    # PRIORITY, blocks 4x3. Admission by (priority, arrival): b0 (prio 0), a0, c0 (prio 1),
    # one block each, free 0. t=10 ms: a0 is throttled at the start (a: 1 tok/s, TAT 1 s);
    # b0 decodes within its block; c0 needs a 2nd block: vLLM's victim level is 1, and in it
    # the throttled a0 goes first, so c0 decodes. In stock vLLM a0 is not throttled and
    # needs the block itself; its victim is c0, the max (priority, arrival).
    config, events = priority_victim_level_events(a0_priority=1)
    _, obs = play(config, events)
    assert obs[0].admitted == ("b0", "a0", "c0")
    assert obs[1].preempted == ("a0",) and sched(obs[1]) == [("b0", 1), ("c0", 1)]
    _, stock = play(cfg(num_blocks=4, policy="priority"), [e for e in events if not isinstance(e, AdvanceClock)])
    assert stock[1].preempted == ("c0",) and sched(stock[1]) == [("b0", 1), ("a0", 1)]


@pytest.mark.rules("R13")
def test_r13_priority_never_crosses_levels():
    # Same, but the throttled a0 has priority 0: the victim level is 1 and holds only c0,
    # so vLLM's own victim c0 (itself) is preempted; the throttled a0 stays resident.
    config, events = priority_victim_level_events(a0_priority=0)
    state, obs = play(config, events)
    assert obs[1].throttled == ("a0",) and obs[1].preempted == ("c0",)
    assert "a0" in state.running


@pytest.mark.rules("R8")
def test_r8_async_step_after_eos_stays_charged():
    _, obs = play(rated("1000", async_scheduling=True), [add("A", "a", eos=0), Step(), Step(), Step()])
    assert obs[1].charged == ("A",) and obs[1].refunded == () and obs[1].finished == (Finished("A", "stop", 1),)


@pytest.mark.rules("R6")
def test_r6_idle_users_forgotten_every_256_schedules():
    # One grant at t=0 (TAT 100 ms), then 1 s per step: the TAT stays until the 256th
    # schedule() call, whose cleanup deletes the idle user.
    events = [add("A", "a", max_tokens=1)] + [Step(), AdvanceClock(1_000 * MS)] * 256
    _, obs = play(rated("10"), events)
    assert obs[0].tat_ns == (("a", Fraction(100 * MS)),) and obs[254].tat_ns == obs[0].tat_ns
    assert obs[255].tat_ns == ()


@pytest.mark.rules("R18")
def test_r18_feature_off_observes_no_rate_decisions():
    _, obs = play(cfg(), [add("A"), Step(), Step()])
    assert all(not o.rate_limited and o.charged == () and o.tat_ns == () for o in obs)


# -- invariants catch what they claim to ------------------------------------------------------
def test_invariants_report_bad_observations():
    state = initial_state(rated("10", output_rate_max_num_active_seqs=1))
    bad = Observation(
        "step",
        0,
        scheduled=(("x", 1),),
        sampled=("x",),
        charged=("x", "x"),
        throttled=("x",),
        refunded=("y",),
        scheduled_running=2,
    )
    assert invariants.i1_charges_match_dispatches(state, bad).startswith("I1")
    assert invariants.i2_one_charge_per_request(bad).startswith("I2")
    assert invariants.i3_refunds_only_undispatched_charges(bad).startswith("I3")
    assert invariants.i4_throttled_not_scheduled(bad).startswith("I4")
    assert invariants.i5_active_cap(state, bad).startswith("I5")
    assert invariants.i9_budget(state, Observation("step", 0, scheduled=(("x", 0),))).startswith("I9")
    assert invariants.i10_no_admission_after_preemption(
        Observation("step", 0, preempted=("x",), admitted=("y",))
    ).startswith("I10")
    history = invariants.DispatchHistory()
    for _ in range(3):  # 3 dispatches at one instant > floor(0.1 x 10) + 1 = 2
        history = history.add("a", 0)
    assert invariants.i7_window_bound(history, "a", state).startswith("I7")


def test_spec_step_modules_import_nothing_of_vllm_or_the_project():
    code = (
        "import sys, vllm_output_rate.spec.scheduler, vllm_output_rate.spec.invariants\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or "
        "m.startswith(('vllm_output_rate.reference', 'vllm_output_rate.adapter', 'vllm_output_rate.proofs'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
