"""``outrate serve`` live: the OpenAI server with the reference scheduler, on loopback.

Starts ``outrate serve`` (a real vLLM 0.32 OpenAI server, the project's servable tiny model,
dummy weights) on a free loopback port, then:

- two users stream chat completions concurrently (``vllm_xargs.output_rate_user``,
  ``ignore_eos``): every stream ends with exactly ``max_tokens`` completion tokens (P3,
  pause never cut), the slow user's tokens respect the GCRA lower bound (R2), and both
  users still make progress at a rate near their limit (P3 resume, P4);
- beam search and a bad identity are refused with HTTP 400 (plugin.py), and the server
  still serves a good request afterwards;
- R9, client cancel: one of two streams of the throttled user is cancelled by closing its
  HTTP connection after a few tokens; the other streams still end with exactly
  ``max_tokens`` tokens, the server serves a new request normally, and the engine-side
  trace (``outrate serve --trace-path``) shows the cancelled request aborted with at least
  as many sampling dispatches as tokens the client received, and no violation.

The server is always shut down (its whole process group), even when a test fails.
About 60-90 s on a 2-core CPU machine, most of it server start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from live_server import rate_flags, serving

from vllm_output_rate.loadtest import gcra_min_span_s, run_measurement

pytestmark = pytest.mark.live

SLOW_RATE = 20  # tokens/s of user "slow"
DEFAULT_RATE = 100  # tokens/s of every other user ("fast")
STREAMS = 2
TOKENS = 40
# Client-side timestamps are taken when a token's chunk arrives, after the step that
# sampled it; the first token's step (a prefill of every new stream) can take longer than
# the last one's (one decode) and its chunk waits behind request intake in the API server,
# so the client first-to-last span may come out shorter than the grant span by a few tens
# of ms (measured: 10-40 ms). The send-to-last span has no such slack (see test).
CLIENT_SPAN_SLACK_S = 0.25


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The server's directory: model, log and the engine trace (``trace.jsonl``)."""
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(work):
    """``outrate serve`` with a fast default user, a slow one and the engine trace in ``work``
    (vLLM logging at WARNING, per-request metrics on); yields its URL."""
    flags = [
        *rate_flags(DEFAULT_RATE, {"slow": SLOW_RATE}),
        "--trace-path",
        str(work / "trace.jsonl"),
        "--enable-per-request-metrics",
    ]
    with serving(work, flags, env_extra={"VLLM_LOGGING_LEVEL": "WARNING"}) as base_url:
        yield base_url


@pytest.mark.rules("R2")
def test_r2_p3_p4_live_two_users_paced_and_complete(server):
    reports, streams = run_measurement(
        server,
        [("slow", STREAMS), ("fast", STREAMS)],
        TOKENS,
        limits={"slow": SLOW_RATE, "fast": DEFAULT_RATE},
        timeout_s=120,
    )
    assert [s.error for s in streams] == [None] * len(streams)
    # P3: paused, never cut -- every stream has exactly TOKENS completion tokens.
    assert [s.completion_tokens for s in streams] == [TOKENS] * len(streams)
    assert [len(s.token_times_s) for s in streams] == [TOKENS] * len(streams)
    assert [s.finish_reason for s in streams] == ["length"] * len(streams)
    slow, fast = reports
    total = STREAMS * TOKENS
    bound_s = gcra_min_span_s(total, SLOW_RATE)  # (80 - 1)/20 - 0.1 = 3.85 s
    # R2, rigorous: the first grant comes after the send, the last token arrives after its grant.
    assert slow.send_to_last_s >= bound_s, f"{total} tokens in {slow.send_to_last_s:.3f} s beat {SLOW_RATE} tok/s"
    # R2, the article's first-to-last span (client clock, see CLIENT_SPAN_SLACK_S).
    assert slow.client_span_s >= bound_s - CLIENT_SPAN_SLACK_S, (slow.client_span_s, bound_s)
    # P3 resume / P4: both users progress near their limits (generous: a loaded CI machine).
    assert slow.client_rate >= 0.5 * SLOW_RATE, slow
    assert fast.client_rate >= 0.5 * DEFAULT_RATE, fast
    assert fast.send_to_last_s < slow.send_to_last_s  # the fast user is not held back by the slow one


def test_beam_search_and_bad_identity_refused_with_400(server):
    import httpx

    url = f"{server}/v1/chat/completions"
    model = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    beam = httpx.post(url, json={**base, "use_beam_search": True, "n": 2}, timeout=30)
    assert beam.status_code == 400, beam.text
    assert "beam search is not supported" in beam.json()["error"]["message"]
    bad = httpx.post(url, json={**base, "vllm_xargs": {"output_rate_user": 12345}}, timeout=30)
    assert bad.status_code == 400, bad.text
    assert "output_rate_user" in bad.json()["error"]["message"]
    good = httpx.post(url, json={**base, "ignore_eos": True, "vllm_xargs": {"output_rate_user": "fast"}}, timeout=30)
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 4


CANCEL_AFTER = 5  # tokens the cancelled stream receives before its client disconnects


@pytest.mark.rules("R9")
def test_r9_live_http_disconnect_cancel_aborts_in_engine_and_others_complete(server, work, wait_for_finish):
    import httpx

    from vllm_output_rate.adapter.trace_check import check_trace

    trace = work / "trace.jsonl"
    _, streams = run_measurement(
        server, [("slow", STREAMS), ("fast", 1)], TOKENS, timeout_s=120, cancel_after={("slow", 0): CANCEL_AFTER}
    )
    assert [s.error for s in streams] == [None] * len(streams)
    cancelled, *others = streams
    assert cancelled.cancelled and len(cancelled.token_times_s) == CANCEL_AFTER and cancelled.request_id
    # P3: the other throttled stream and the other user are not disturbed by the cancel.
    assert [s.completion_tokens for s in others] == [TOKENS] * len(others)
    assert [len(s.token_times_s) for s in others] == [TOKENS] * len(others)
    # The server serves a new request normally afterwards.
    model = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]
    after = httpx.post(
        f"{server}/v1/chat/completions",
        timeout=60,
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "vllm_xargs": {"output_rate_user": "slow"},
        },
    )
    assert after.status_code == 200, after.text
    assert after.json()["usage"]["completion_tokens"] == 4
    # The abort reaches the engine core asynchronously (the API server notices the closed
    # connection when it next writes to it): wait for it in the trace.
    freed = wait_for_finish(trace, [cancelled.request_id])[cancelled.request_id]
    assert freed is not None and freed.status == "FINISHED_ABORTED", freed
    report = check_trace(
        trace, cancelled=[cancelled.request_id], completions={s.request_id: len(s.token_times_s) for s in streams}
    )
    print(
        f"\ncancelled after {CANCEL_AFTER} tokens: {freed.sampled} sampling dispatches in the engine\n"
        f"{report.summary()}"
    )
    assert report.ok, report.summary()
    assert freed.sampled >= CANCEL_AFTER
