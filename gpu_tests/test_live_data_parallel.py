"""R24 live: vLLM data parallel (``--data-parallel-size 2``) with the feature on and a
shared budget (``--shared-budget-url``): both ranks' schedulers lease one user's budget
from one Redis.

One ``outrate serve`` with two data-parallel ranks (two engine cores, one API server,
vLLM's own load balancing of requests over the ranks) on the project's tiny model, each
rank writing its own engine-side trace (``PATH`` for rank 0, ``PATH.dp1``), and one
redis-server (the ``redis_server`` fixture of the root conftest). User "big" at RATE
tok/s (T = 50 ms, L = 1, H = 1) streams STREAMS x TOKENS tokens. Checked from both traces
merged (one machine, one monotonic clock): in every window between two dispatches the
ranks together stay within ``floor((W + 0.1 s) x RATE) + 1 + 2 x H``; both ranks served
the user; each rank's trace passes ``outrate check-trace``; every stream ends with all its
tokens. Without the URL the same server is refused at start-up (in-process:
``tests/test_config_validation.py``).

About 90-150 s on a 2-core CPU machine, most of it the start-up of two engine cores.
"""

from __future__ import annotations

from fractions import Fraction

import live_server
import pytest
from live_server import serving, shared_budget_flags

from vllm_output_rate.loadtest import run_measurement
from vllm_output_rate.spec import shared_budget as sb

pytestmark = [pytest.mark.live, pytest.mark.multi_engine]

RATE = 20
STREAMS, TOKENS = 4, 30
USER = "big"


@pytest.mark.rules("R24")
def test_r24_live_data_parallel_two_ranks_share_one_budget(tmp_path, redis_server, monkeypatch):
    from vllm_output_rate.adapter.trace_check import check_trace

    monkeypatch.setattr(live_server, "READY_TIMEOUT_S", 300)  # two engine cores start on two cores
    trace = tmp_path / "trace.jsonl"
    flags = [
        *shared_budget_flags(RATE, redis_server.url, trace),
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "1",
    ]
    with serving(tmp_path, flags) as url:
        _reports, streams = run_measurement(url, [(USER, STREAMS)], TOKENS, timeout_s=120)
    assert [s.error for s in streams] == [None] * STREAMS
    assert [s.completion_tokens for s in streams] == [TOKENS] * STREAMS  # P3

    per_rank = []
    for rank in (0, 1):
        report = check_trace(trace if rank == 0 else f"{trace}.dp1", partial=True)
        assert report.ok, report.summary()  # the rank's own GCRA (R2)
        per_rank.append([t for run in report.runs if USER in run.users for t in run.users[USER].dispatch_ns])
    times = sorted(t for d in per_rank for t in d)
    assert len(times) == STREAMS * TOKENS
    lease = sb.lease_size(Fraction(RATE))
    worst = max(
        ((j - i + 1) - sb.shared_window_bound_tokens(times[j] - times[i], Fraction(RATE), 2, lease), i, j)
        for i in range(len(times))
        for j in range(i, len(times))
    )
    span_s = (times[-1] - times[0]) / 1e9
    print(
        f"\nlimit {RATE} tok/s, 2 ranks, L {lease}; dispatches per rank {[len(d) for d in per_rank]}; combined "
        f"{len(times)} in {span_s:.2f} s = {(len(times) - 1) / span_s:.1f} tok/s; R24 bound over the run "
        f"{sb.shared_window_bound_tokens(times[-1] - times[0], Fraction(RATE), 2, lease)}; tightest window "
        f"{worst[0]} tokens from its bound"
    )
    assert all(per_rank), "both ranks served the user"
    assert worst[0] <= 0, worst  # R24: one budget across both ranks
    assert (len(times) - 1) / span_s <= 1.5 * RATE
