"""The soak as a test (marker ``soak``): ``outrate soak`` for OUTRATE_SOAK_MINUTES minutes.

Not part of ``make test``: collected but skipped unless selected with ``-m soak`` (the
reason is printed). Runs ``outrate soak --users 8 --streams 2`` (async scheduling on a
GPU) in a subprocess and checks its JSON summary: zero violations of the online checker
(which includes completion_tokens exact for every uncancelled stream), cancels happened,
the limiter held at most one TAT per user (R6), and the driver's memory did not grow
with the run (the checker follows the trace incrementally).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.soak

USERS, STREAMS = 8, 2
RSS_GROWTH_LIMIT_MB = 300  # driver RSS after start-up; a 10-minute CPU run grows ~10 MB


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.rules("R2", "R6")
def test_r2_r6_p3_soak_zero_violations_bounded_memory(tmp_path):
    minutes = float(os.environ.get("OUTRATE_SOAK_MINUTES", "10"))
    command = [
        sys.executable,
        "-m",
        "vllm_output_rate.cli",
        "soak",
        "--minutes",
        str(minutes),
        "--users",
        str(USERS),
        "--streams",
        str(STREAMS),
        "--seed",
        "7",
        "--out",
        str(tmp_path),
    ]
    if _cuda():
        command.append("--async-scheduling")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=minutes * 60 + 900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["violations"] == []
    assert summary["cancelled"] > 0
    assert 1 <= summary["max_limiter_users"] <= USERS
    rss = summary["rss_mb"]
    assert rss["max"]["driver"] - rss["start"]["driver"] <= RSS_GROWTH_LIMIT_MB, rss
    assert (tmp_path / "soak.png").stat().st_size > 0
