"""The ``vllm:output_rate_*`` series on vLLM's own ``/metrics``, live (reference/metrics.py).

``outrate serve`` on loopback: user "slow" named at 20 tokens/s streams 2 x 30 tokens, user
"fast" (not named: label ``other``, default 10 000 tokens/s) streams 60. After the run,
``/metrics`` (served by vLLM's API server) must show, per label, the granted tokens equal
to the client's completion tokens, throttled request-steps and seconds > 0 only for
"slow", the configured limits, and vLLM's own series beside ours.

About 40-60 s on a 2-core CPU machine, most of it server start-up.
"""

from __future__ import annotations

import time

import pytest
from live_server import rate_flags, scrape, serving

from vllm_output_rate.loadtest import run_measurement

pytestmark = pytest.mark.live

SLOW_RATE, DEFAULT_RATE = 20, 10_000


def _series(samples, name):
    return {dict(labels).get("user"): v for (n, labels), v in samples.items() if n == name}


def test_metrics_live_per_label_series_match_the_client(tmp_path):
    with serving(tmp_path, rate_flags(DEFAULT_RATE, {"slow": SLOW_RATE})) as url:
        during = {}
        _reports, streams = run_measurement(url, [("slow", 2), ("fast", 1)], 30, timeout_s=120)
        # The engine core writes its snapshot when it goes idle; the API server may get the
        # last token a moment before that.
        deadline = time.monotonic() + 5
        while True:
            samples = scrape(url)
            granted = _series(samples, "vllm:output_rate_granted_tokens_total")
            if granted.get("slow") == 60 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        during = samples
    assert [s.error for s in streams] == [None] * len(streams)
    client = {u: sum(s.completion_tokens for s in streams if s.user == u) for u in ("slow", "fast")}
    assert client == {"slow": 60, "fast": 30}
    granted = _series(during, "vllm:output_rate_granted_tokens_total")
    throttled = _series(during, "vllm:output_rate_throttled_request_steps_total")
    seconds = _series(during, "vllm:output_rate_throttled_seconds_total")
    limits = _series(during, "vllm:output_rate_limit_tokens_per_second")
    print(f"\ngranted {granted}, throttled request-steps {throttled}, throttled s {seconds}, limits {limits}")
    assert set(granted) == {"slow", "other"}  # bounded labels: named users + other
    assert granted == {"slow": client["slow"], "other": client["fast"]}
    assert throttled["slow"] > 0 and throttled["other"] == 0
    # 60 tokens at 20 tok/s take >= (60 - 1)/20 - 0.1 = 2.85 s, throttled most of it.
    assert 1.0 < seconds["slow"] < 4.0 and seconds["other"] == 0
    assert limits == {"slow": SLOW_RATE, "other": DEFAULT_RATE}
    assert during[("vllm:output_rate_shadow", ())] == 0
    assert during[("vllm:output_rate_throttled_requests", ())] == 0  # idle at the end
    assert any(name.startswith("vllm:num_requests_running") for name, _ in during)  # vLLM's own, same endpoint
