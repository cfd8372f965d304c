"""R24/R25 live: two ``vllm serve`` replicas share one user's budget through one Redis.

One redis-server on a loopback port (the ``redis_server`` fixture of the root conftest)
and two ``outrate serve`` replicas on the project's tiny model, each with
``--shared-budget-url`` naming it and its own engine-side trace (``--trace-path``). User
"big" (RATE tok/s, so T = 50 ms, L = 1, H = 2L - 1 = 1) streams STREAMS x TOKENS tokens,
its streams alternated over the two replicas (a router without user affinity). About
KILL_AFTER_S into the run the test kills redis-server (SIGKILL) and starts it again on the
same port OUTAGE_S later (empty data set). Checked on the engine side, from both traces
merged (one machine: both engine cores read the same monotonic clock):

- R24: in every window between two dispatches of the merged sequence, the two replicas
  together dispatched at most ``floor((W + 0.1 s) x RATE) + 1 + 2 x H`` tokens
  (``spec.shared_budget.shared_window_bound_tokens``): one budget, not two;
- R25 (fail closed): while the store is down the replicas together dispatch at most what
  they held, ``2 x (H + 1)`` (a grant refunded in the last step at most), so no overshoot;
  the store back, leasing resumes and every stream ends with all its tokens (P3: paused,
  never cut or failed);
- each replica's own trace passes ``outrate check-trace`` (its local GCRA, R2), both
  replicas served the user, and the combined rate before the outage is about one budget.

About 50-70 s on a 2-core CPU machine, most of it the two start-ups (overlapped).
"""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import pytest
from live_server import serving_all, shared_budget_flags

from vllm_output_rate.loadtest import run_measurement
from vllm_output_rate.spec import shared_budget as sb

pytestmark = [pytest.mark.live, pytest.mark.multi_engine]

RATE = 20
STREAMS, TOKENS = 4, 30
KILL_AFTER_S, OUTAGE_S = 2.5, 1.5
USER = "big"


def _worst_window(times_ns: list[int], lease: int) -> tuple[int, int, int]:
    """The window (between two dispatches) where the count comes closest to R24's bound:
    ``(count, bound, window ns)``; count > bound is a violation."""
    times_ns = sorted(times_ns)
    worst: tuple[int, int, int] | None = None
    for i, start in enumerate(times_ns):
        for j in range(i, len(times_ns)):
            window = times_ns[j] - start
            count = j - i + 1
            bound = sb.shared_window_bound_tokens(window, Fraction(RATE), 2, lease)
            if worst is None or count - bound > worst[0] - worst[1]:
                worst = (count, bound, window)
    assert worst is not None, "no dispatch"
    return worst


@pytest.mark.rules("R24", "R25")
def test_r24_r25_live_two_replicas_one_budget_and_redis_killed_mid_run(tmp_path, redis_server):
    from vllm_output_rate.adapter.trace_check import check_trace

    works = [tmp_path / "a", tmp_path / "b"]
    traces = [w / "trace.jsonl" for w in works]
    for w in works:
        w.mkdir()
    flags = [shared_budget_flags(RATE, redis_server.url, trace) for trace in traces]
    with serving_all(list(zip(works, flags))) as urls:
        results: dict[int, list] = {}

        def client(k: int, url: str) -> None:
            results[k] = run_measurement(url, [(USER, STREAMS // 2)], TOKENS, timeout_s=120)[1]

        outage: dict[str, int] = {}

        def kill_and_restart() -> None:
            redis_server.kill()
            outage["from_ns"] = time.monotonic_ns()
            time.sleep(OUTAGE_S)
            outage["to_ns"] = time.monotonic_ns()
            redis_server.start()

        clients = [threading.Thread(target=client, args=(k, url)) for k, url in enumerate(urls)]
        killer = threading.Timer(KILL_AFTER_S, kill_and_restart)
        started = time.monotonic()
        for t in clients:
            t.start()
        killer.start()
        for t in clients:
            t.join()
        killer.join()
        wall_s = time.monotonic() - started

    streams = [s for k in sorted(results) for s in results[k]]
    assert len(streams) == STREAMS
    assert [s.error for s in streams] == [None] * STREAMS
    assert [s.completion_tokens for s in streams] == [TOKENS] * STREAMS  # P3 across the outage

    per_replica = []
    for k, trace in enumerate(traces):
        report = check_trace(trace, completions={s.request_id: s.completion_tokens for s in results[k]})
        assert report.ok, report.summary()  # each replica's own GCRA (R2)
        (run,) = report.runs
        per_replica.append(run.users[USER].dispatch_ns)
    times = sorted(t for d in per_replica for t in d)
    lease = sb.lease_size(Fraction(RATE))
    H = sb.holding_cap(lease)
    span_ns = times[-1] - times[0]
    bound = sb.shared_window_bound_tokens(span_ns, Fraction(RATE), 2, lease)
    count, worst_bound, worst_ns = _worst_window(times, lease)
    before = [t for t in times if t < outage["from_ns"]]
    during = [t for t in times if outage["from_ns"] <= t <= outage["to_ns"]]
    after = [t for t in times if t > outage["to_ns"]]
    before_rate = (len(before) - 1) / ((before[-1] - before[0]) / 1e9)
    after_rate = (len(after) - 1) / ((after[-1] - after[0]) / 1e9)
    print(
        f"\nwall {wall_s:.2f} s; limit {RATE} tok/s, 2 replicas, L {lease}, H {H}; dispatches per replica "
        f"{[len(d) for d in per_replica]}; combined {len(times)} in {span_ns / 1e9:.2f} s = "
        f"{(len(times) - 1) / (span_ns / 1e9):.1f} tok/s (R24 bound over the run {bound}; tightest window "
        f"{count} of {worst_bound} in {worst_ns / 1e9:.2f} s)\nbefore the outage {len(before)} at "
        f"{before_rate:.1f} tok/s; during the {OUTAGE_S} s outage {len(during)} (at most {2 * (H + 1)}); "
        f"after {len(after)} at {after_rate:.1f} tok/s"
    )
    assert all(per_replica), "both replicas served the user"
    assert count <= worst_bound, (count, worst_bound, worst_ns)  # R24: one budget across both replicas
    assert len(during) <= 2 * (H + 1), len(during)  # R25: no lease while the store is down
    assert after, "the streams resumed after the store returned"  # R25: recovery
    assert 0.5 * RATE <= before_rate <= 1.5 * RATE, before_rate  # about one budget, not two
    log = "".join((w / "serve.log").read_text(errors="replace") for w in works)
    assert "unreachable" in log and "answers again" in log  # each state change logged (R25)
