"""Shadow mode live (docs/SPEC.md, Decision "Shadow mode"): ``outrate serve --shadow``.

A real vLLM 0.32 OpenAI server on loopback with ``output_rate.shadow: true`` and the
engine-side trace on (``--trace-path``). User "capped" is configured at 5 tokens/s and
streams 2 x 60 tokens; user "free" (default 10 000 tokens/s) streams 60. In shadow mode
nothing is paused: "capped" gets its tokens far faster than 5 tokens/s (enforcing, 120
tokens would need (120 - 1)/5 - 0.1 = 23.7 s), while the trace shows its would-be
throttles (the tokens above the GCRA's grants), none for "free", no throttled request at
all, and passes the online checker (R2 on the shadow limiter's grants). /metrics reports
the same would-be throttles (``vllm:output_rate_throttled_request_steps_total``) and
``vllm:output_rate_shadow`` 1.

About 40-60 s on a 2-core CPU machine, most of it server start-up.
"""

from __future__ import annotations

import pytest
from live_server import rate_flags, scrape, serving

from vllm_output_rate.loadtest import gcra_min_span_s, run_measurement

pytestmark = pytest.mark.live

CAPPED_RATE, FREE_RATE = 5, 10_000
STREAMS, TOKENS = 2, 60


def test_shadow_live_counts_would_be_throttles_and_pauses_nothing(tmp_path, request_steps):
    from vllm_output_rate.adapter.trace_check import check_trace

    trace = tmp_path / "trace.jsonl"
    flags = [
        *rate_flags(FREE_RATE, {"capped": CAPPED_RATE}),
        "--shadow",
        "--trace-path",
        str(trace),
    ]
    with serving(tmp_path, flags) as url:
        reports, streams = run_measurement(url, [("capped", STREAMS), ("free", 1)], TOKENS, timeout_s=120)
        metrics = scrape(url)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.completion_tokens for s in streams] == [TOKENS] * len(streams)
    capped, _free = reports
    enforced_s = gcra_min_span_s(STREAMS * TOKENS, CAPPED_RATE)
    print(
        f"\ncapped: {capped.tokens} tokens in {capped.send_to_last_s:.2f} s ({capped.client_rate:.1f} tok/s, "
        f"limit {CAPPED_RATE}; enforcing would need >= {enforced_s:.1f} s)"
    )
    # Nothing paused: far above the limit, far below the enforced span.
    assert capped.send_to_last_s < enforced_s / 3, capped
    assert capped.client_rate > 4 * CAPPED_RATE, capped

    report = check_trace(trace, completions={s.request_id: s.completion_tokens for s in streams})
    print(report.summary())
    assert report.ok, report.summary()
    (run,) = report.runs
    assert run.shadow
    users = run.users
    assert users["capped"].dispatches == STREAMS * TOKENS and users["free"].dispatches == TOKENS
    # The shadow limiter granted at most the window bound over the run; the rest would be throttled.
    span_s = users["capped"].span_s
    assert users["capped"].would_throttle >= STREAMS * TOKENS - (int((span_s + 0.1) * CAPPED_RATE) + 1)
    assert users["capped"].would_throttle > 0 and users["free"].would_throttle == 0
    for s in streams:
        assert request_steps(trace, s.request_id)["throttled"] == 0  # no pause at all

    would = {
        labels: v for (name, labels), v in metrics.items() if name == "vllm:output_rate_throttled_request_steps_total"
    }
    assert metrics[("vllm:output_rate_shadow", ())] == 1
    assert would[(("user", "capped"),)] == users["capped"].would_throttle
    assert would.get((("user", "other"),), 0) == 0
