"""R21 live: limits changed on a running server through the rates file (``--rates-file``).

A real vLLM 0.32 OpenAI server on loopback (``outrate serve``, the project's tiny model)
with the engine-side trace on. User "up" starts at 10 tok/s, user "down" at 40 tok/s; each
streams 2 x 80 tokens. About 2 s into decoding the operator writes a new rates file
(atomically: a temporary file renamed over it) with "up" at 40 tok/s and "down" at
10 tok/s. Checked on the engine side, from the moment of change (the trace's ``rates``
record, engine clock):

- each user's sampling dispatches from the change to its last one hold the GCRA bound of
  its new rate, ``floor((W + 0.1 s) x B) + 1`` (R21: a window starting at the change holds
  R2's bound at the new rate; "down" keeps its lead in tokens, no debt forgiven);
- the new rate is in force: "up" runs after the change at more than twice its old rate
  (about 40 tok/s on an idle machine; the lower side is generous for a loaded 2-core
  machine), "down" within 10 tok/s's bound and at least 5 tok/s;
- the whole trace passes ``outrate check-trace`` (which applies the change, R21, to its
  GCRA replay), every stream gets all its tokens (P3), and the engine logged the change.

About 40-60 s on a 2-core CPU machine, most of it server start-up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from fractions import Fraction

import pytest
from live_server import rate_flags, serving

from vllm_output_rate.loadtest import run_measurement
from vllm_output_rate.spec import limiter as spec_limiter

pytestmark = pytest.mark.live

BEFORE = {"up": 10, "down": 40}
AFTER = {"up": 40, "down": 10}
DEFAULT_RATE = 1000
STREAMS, TOKENS = 2, 80
CHANGE_AFTER_S = 2.0


def _write_rates(path, rates: dict[str, int]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"default_tokens_per_s": DEFAULT_RATE, "user_tokens_per_s": rates}))
    os.replace(temporary, path)


@pytest.mark.rules("R21")
def test_r21_live_rate_change_takes_effect_within_the_gcra_bound(tmp_path):
    from vllm_output_rate.adapter.trace_check import check_trace

    trace, rates = tmp_path / "trace.jsonl", tmp_path / "rates.json"
    _write_rates(rates, BEFORE)  # read at start-up (the section's own rates are replaced)
    flags = [*rate_flags(1), "--rates-file", str(rates), "--trace-path", str(trace)]
    with serving(tmp_path, flags) as url:
        changer = threading.Timer(CHANGE_AFTER_S, _write_rates, (rates, AFTER))
        started = time.monotonic()
        changer.start()
        try:
            _reports, streams = run_measurement(url, [("up", STREAMS), ("down", STREAMS)], TOKENS, timeout_s=120)
        finally:
            changer.cancel()
        wall_s = time.monotonic() - started
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.completion_tokens for s in streams] == [TOKENS] * len(streams)  # P3

    report = check_trace(trace, completions={s.request_id: s.completion_tokens for s in streams})
    print(f"\nwall {wall_s:.2f} s\n{report.summary()}")
    assert report.ok, report.summary()  # R2 and R21 over the whole run, change included
    (run,) = report.runs
    (change_ns,) = run.rate_changes_ns
    for user, new_rate in AFTER.items():
        summary = run.users[user]
        assert summary.rate == new_rate
        after = [t for t in summary.dispatch_ns if t >= change_ns]
        before = len(summary.dispatch_ns) - len(after)
        window_ns = after[-1] - change_ns
        bound = spec_limiter.window_bound_tokens(window_ns, Fraction(new_rate))
        rate = (len(after) - 1) / (window_ns / 1e9)
        print(
            f"{user}: {before} dispatches before the change at {BEFORE[user]} tok/s, {len(after)} after it in "
            f"{window_ns / 1e9:.2f} s = {rate:.1f} tok/s (limit {new_rate}, GCRA bound {bound})"
        )
        assert before > 0 and len(after) > 10, (before, len(after))
        assert len(after) <= bound  # R21: from the moment of change, the new rate's GCRA bound
        if new_rate > BEFORE[user]:  # the higher rate is in force: at least twice the old one
            assert rate >= 2 * BEFORE[user], rate
        else:  # the lower rate is in force (the bound above) and the user still progresses
            assert rate >= 0.5 * new_rate, rate
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "output-rate limits changed without a restart (R21)" in log
