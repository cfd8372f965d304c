"""Configuration, live: a typo under plain ``vllm serve`` ends with the message as the last line.

Starts a real ``vllm serve`` (vLLM 0.32's own CLI, the project's tiny model) with the
reference scheduler and a misspelt ``output_rate`` key. The plugin validates the section in
the API-server process (``EngineArgs.create_engine_config``), before the engine core is
spawned, so the process exits non-zero within seconds and the last line on stderr names the
bad key and the nearest valid one -- not vLLM's "Engine core initialization failed. See root
cause above" with the cause buried in the engine-core log (issue 15).

The in-process cases of every typo are in ``tests/test_config_validation.py``. About 15 s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from live_server import server_env, tiny_engine_flags

from vllm_output_rate.adapter.tinymodel import write_config
from vllm_output_rate.reference.section import KNOWN_KEYS, OutputRateConfigError

pytestmark = pytest.mark.live

REFERENCE_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"


def test_configuration_plain_vllm_serve_typo_is_the_last_stderr_line(tmp_path):
    model = write_config(tmp_path / "model", tokenizer=True)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--scheduler-cls",
        REFERENCE_SCHEDULER,
        "--additional-config",
        '{"output_rate": {"default_token_per_s": 100}}',
        *tiny_engine_flags(port=1),  # port 1: never bound, start-up must stop before
    ]
    proc = subprocess.run(
        command, capture_output=True, text=True, env=server_env(), timeout=240, start_new_session=True
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, proc.stdout[-2000:]
    assert lines[-1] == (
        f"{OutputRateConfigError.__module__}.{OutputRateConfigError.__qualname__}: unknown key(s) in "
        """additional_config["output_rate"]: 'default_token_per_s' (did you mean 'default_tokens_per_s'?); """
        f"known keys: {', '.join(KNOWN_KEYS)}"
    ), lines[-5:]
    output = proc.stdout + proc.stderr
    assert "Engine core initialization failed" not in output
    assert "EngineCore" not in output  # refused before the engine core was spawned


def test_engine_refusal_under_outrate_serve_ends_with_the_error_line_not_a_traceback(tmp_path):
    # Data parallel from a --config file: not in the arguments outrate serve reads, so the
    # plugin's front-end check (reference/plugin.py) refuses it in the API-server process.
    model = write_config(tmp_path / "model", tokenizer=True)
    (tmp_path / "engine.yaml").write_text("data-parallel-size: 2\n")
    command = [sys.executable, "-m", "vllm_output_rate.cli", "serve", str(model)]
    command += ["--default-user-output-tokens-per-second", "10", "--config", str(tmp_path / "engine.yaml")]
    command += ["--load-format", "dummy", "--max-model-len", "512", "--enforce-eager", "--port", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, start_new_session=True)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, lines[-5:]
    assert lines[-1] == (
        "Error: per-user output-rate limiting (additional_config['output_rate'], "
        "--default-user-output-tokens-per-second) does not support this engine configuration: data parallel > 1: "
        "every data-parallel rank has its own scheduler and would grant its own budget unless the ranks share it "
        "through a store (R23-R26); give --shared-budget-url (output_rate.shared_budget_url, a Redis or Valkey "
        "URL) so the ranks share each user's budget, or set --data-parallel-size 1 (got 2). Change the settings "
        "above, or turn the feature off by removing the output_rate section."
    ), lines[-5:]
    assert "Traceback" not in proc.stdout + proc.stderr
