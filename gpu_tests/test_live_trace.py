"""Live decoding with the engine-side event trace, checked by the online checker.

``vllm.LLM`` (the engine-core process runs the reference scheduler) on the project's tiny
model, with ``output_rate.trace_path`` set. Two users decode concurrently: "slow" at
20 tok/s with 4 streams, "fast" at 100 tok/s with 1 stream (the article's setting,
shorter). The trace must pass every check of ``adapter.trace_check`` (window bound and
GCRA replay per user, charge/refund accounting, throttled never scheduled, no lost or
duplicated token against the client's token counts), and the per-user engine-side rates
(sampling dispatches / first-to-last dispatch span, engine clock) are printed.

On CPU (2 cores) about 30-60 s, most of it engine start-up; on a GPU unchanged.
"""

from __future__ import annotations

import time

import pytest

from vllm_output_rate.adapter.trace_check import check_trace

pytestmark = pytest.mark.live

SLOW_RATE, SLOW_STREAMS, SLOW_TOKENS = 20, 4, 50
FAST_RATE, FAST_STREAMS, FAST_TOKENS = 100, 1, 300


def test_live_trace_two_users_checked_online(tmp_path, tiny_llm, sampling):
    trace = tmp_path / "trace.jsonl"
    llm = tiny_llm(
        {"default_tokens_per_s": FAST_RATE, "user_tokens_per_s": {"slow": SLOW_RATE}, "trace_path": str(trace)}
    )
    try:
        prompts = [{"prompt_token_ids": [11 + i, 12, 13, 14, 15]} for i in range(SLOW_STREAMS + FAST_STREAMS)]
        params = [sampling("slow", SLOW_TOKENS)] * SLOW_STREAMS + [sampling("fast", FAST_TOKENS)] * FAST_STREAMS
        started = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.monotonic() - started
    finally:
        del llm

    counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert counts == [SLOW_TOKENS] * SLOW_STREAMS + [FAST_TOKENS] * FAST_STREAMS  # P3: paused, never cut
    report = check_trace(trace, completions={o.request_id: len(o.outputs[0].token_ids) for o in outputs})
    print(f"\nwall {wall_s:.2f} s\n{report.summary()}")
    assert report.ok, report.summary()
    (run,) = report.runs
    assert not run.async_scheduling
    slow, fast = run.users["slow"], run.users["fast"]
    assert slow.dispatches == SLOW_STREAMS * SLOW_TOKENS and fast.dispatches == FAST_STREAMS * FAST_TOKENS
    # Upper side: the checker proved the window bound; here the rate over the whole span
    # (N dispatches need (N - 1 - floor(tau x rate)) / rate s at least).
    assert slow.engine_rate <= SLOW_RATE * 1.05, slow.engine_rate
    # Lower side (P3 resume, P4): generous, a loaded 2-core CI machine.
    assert slow.engine_rate >= 0.8 * SLOW_RATE, slow.engine_rate
    assert fast.engine_rate >= 0.5 * FAST_RATE, fast.engine_rate
    assert run.max_limiter_users <= 2
