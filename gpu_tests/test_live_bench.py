"""``outrate bench --only live``: the live section's JSON structure (a real engine, tiny run).

Starts three engines in child processes (about 2-3 minutes on 2 CPU cores), hence the
``live`` mark. No timing thresholds: the targets are reported, not asserted.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from vllm_output_rate.bench import LIVE_CPU_TARGET_PERCENT, LIVE_RATIO_TARGET, QUICK
from vllm_output_rate.cli import main

pytestmark = pytest.mark.live


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_bench_live_json_structure(tmp_path):
    report = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "--quick", "--only", "live", "--json", str(report)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(report.read_text())
    assert data["scheduler"] == [] and data["limiter"] is None and data["gate"] is None
    live = data["live"]
    for key in ("tokens_per_s_off", "tokens_per_s_on", "ratio"):
        assert _number(live[key]) and live[key] > 0, key
    for key in ("engine_cpu_throttled_with_wait", "engine_cpu_throttled_without_wait"):
        assert _number(live[key]) and live[key] >= 0, key
    assert live["cpu_unit"] == "percent of one core"
    assert live["ratio_target"] == LIVE_RATIO_TARGET and live["engine_cpu_target"] == LIVE_CPU_TARGET_PERCENT
    throughput = live["throughput"]
    assert throughput["rounds"] == QUICK.live_rounds
    assert len(throughput["tokens_per_s_off_rounds"]) == len(throughput["tokens_per_s_on_rounds"]) == QUICK.live_rounds
    assert throughput["ratio_min"] <= live["ratio"] <= throughput["ratio_max"]
    assert len(throughput["tokens_per_s_on_worker_spin_rounds"]) == QUICK.live_rounds
    assert throughput["worker_fix_ratio_min"] <= live["worker_fix_ratio"] <= throughput["worker_fix_ratio_max"]
    # The throttled runs cannot beat the limit (R2 read backwards), and each run's environment took effect.
    for key, plugins, park in (
        ("throttled_with_wait", None, None),
        ("throttled_wait_worker_spins", None, "0"),
        ("throttled_without_wait", "", None),
    ):
        run = live[key]
        assert run["wall_s"] >= run["min_wall_s"], run
        assert (run["plugins"], run["worker_park"]) == (plugins, park)
        assert {"engine_core", "worker"} <= set(run["cpu_percent"]) and "worker" in run["wakeups_per_s"]
        assert run["engine_and_workers_cpu_percent"] == pytest.approx(
            run["cpu_percent"]["engine_core"] + run["cpu_percent"]["worker"]
        )
    # R16, worker side: a parked reader with the plugin's lossless pings misses none.
    pings = live["pings"]
    assert pings["lossless_park"]["lost"] == 0 and pings["lossless_park"]["messages"] == 2 * QUICK.live_ping_steps
    assert {"vllm_park", "vllm_spin"} <= set(pings)
    assert data["command"] == f"outrate bench --quick --only live --json {report}"
