"""Async scheduling live (GPU only): ``RateLimitedAsyncScheduler`` with one step in flight.

vLLM 0.32 forces ``async_scheduling`` off on CPU, so this runs only where CUDA and the
CUDA build of vLLM are present (skipped elsewhere, with that reason). Two users decode
concurrently on the tiny model: "slow" 20 tok/s x 4 streams x 50 tokens and "fast"
100 tok/s x 1 stream x 300 tokens. The engine trace must pass every check of the online
checker in its async form (a finished request may have one more sampling dispatch than
output tokens: R8, one step in flight past a stop), every stream ends with exactly its
token count (P3), and the rates hold (R2). About 1 minute on a GPU, mostly start-up.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.adapter.trace_check import check_trace

pytestmark = [pytest.mark.live, pytest.mark.gpu]

SLOW_RATE, SLOW_STREAMS, SLOW_TOKENS = 20, 4, 50
FAST_RATE, FAST_STREAMS, FAST_TOKENS = 100, 1, 300


@pytest.mark.rules("R8")
def test_r8_p5_live_async_scheduling_paced_and_trace_checked(tmp_path, tiny_llm, sampling):
    trace = tmp_path / "trace.jsonl"
    llm = tiny_llm(
        {"default_tokens_per_s": FAST_RATE, "user_tokens_per_s": {"slow": SLOW_RATE}, "trace_path": str(trace)},
        async_scheduling=True,
    )
    try:
        prompts = [{"prompt_token_ids": [11 + i, 12, 13, 14]} for i in range(SLOW_STREAMS + FAST_STREAMS)]
        params = [sampling("slow", SLOW_TOKENS)] * SLOW_STREAMS + [sampling("fast", FAST_TOKENS)] * FAST_STREAMS
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert counts == [SLOW_TOKENS] * SLOW_STREAMS + [FAST_TOKENS] * FAST_STREAMS
    report = check_trace(trace, completions={o.request_id: len(o.outputs[0].token_ids) for o in outputs})
    print("\n" + report.summary())
    assert report.ok, report.summary()
    (run,) = report.runs
    assert run.async_scheduling
    slow, fast = run.users["slow"], run.users["fast"]
    # R2 (rigorous upper side, proved by the checker over every window) and progress.
    assert 0.8 * SLOW_RATE <= slow.engine_rate <= 1.05 * SLOW_RATE, slow.engine_rate
    assert fast.engine_rate >= 0.5 * FAST_RATE, fast.engine_rate
