"""``outrate serve`` on loopback for the live operator suites (shadow mode, /metrics).

``serving(work, flags)`` starts ``outrate serve`` on the project's servable tiny model
(dummy weights, float32, eager) on a free loopback port in its own process group, waits
for ``/health``, yields the base URL and always stops the whole group (API server,
engine core, worker): TERM, then KILL. ``scrape(base_url)`` reads ``/metrics`` into
``{(name, labels): value}``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def shutdown(proc: subprocess.Popen) -> None:
    """Stop the server's process group (API server, engine core, worker): TERM, then KILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def serving(work: Path, flags: list[str], env_extra: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``outrate serve MODEL <flags>`` (plus the tiny-model engine flags); yield its URL."""
    import httpx

    from vllm_output_rate.adapter.tinymodel import write_config

    model = write_config(work / "model", tokenizer=True)
    port = free_port()
    log_path = work / "serve.log"
    env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="INFO", **(env_extra or {}))
    command = [
        sys.executable, "-m", "vllm_output_rate.cli", "serve", str(model), *flags,
        "--max-num-seqs", "8",
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(128 * 2**20),
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"outrate serve exited with {proc.returncode}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {READY_TIMEOUT_S} s:\n{log_tail(log_path)}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield base_url
    finally:
        shutdown(proc)


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}`` (prometheus_client's parser)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
