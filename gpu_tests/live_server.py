"""``outrate serve`` on loopback for the live operator suites (shadow mode, /metrics).

``serving(work, flags)`` starts ``outrate serve`` on the project's servable tiny model
(dummy weights, float32, eager) on a free loopback port in its own process group, waits
for ``/health``, yields the base URL and always stops the whole group (API server,
engine core, worker): TERM, then KILL. ``scrape(base_url)`` reads ``/metrics`` into
``{(name, labels): value}``.
"""

from __future__ import annotations

import contextlib
import json
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


def server_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a vLLM server on loopback: offline (no model hub, no
    usage stats), INFO logging; ``overrides`` (e.g. ``VLLM_LOGGING_LEVEL="WARNING"``) win."""
    return {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        **overrides,
    }


def tiny_engine_flags(port: int | str) -> list[str]:
    """The vLLM server flags for the project's tiny model on ``127.0.0.1:port``: dummy
    weights, float32, 512-token context, eager (no graph capture)."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
    ]


# The KV cache of a tiny-model server: a fixed 128 MiB (vLLM's CPU default would take GiBs).
TINY_MEMORY_FLAGS = ["--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(128 * 2**20)]


def rate_flags(default: float, users: dict[str, float] | None = None) -> list[str]:
    """``outrate serve`` flags: every user at ``default`` tokens/s, each user of ``users``
    (``{user: tokens/s}``) at its own rate."""
    flags = ["--default-user-output-tokens-per-second", str(default)]
    if users:
        flags += ["--user-output-tokens-per-second", json.dumps(users)]
    return flags


def shared_budget_flags(rate: int, url: str, trace: Path) -> list[str]:
    """``outrate serve`` flags: every user at ``rate`` tokens/s, one shared budget in the
    store at ``url`` (R23-R26), the engine-side trace written to ``trace``."""
    return [*rate_flags(rate), "--shared-budget-url", url, "--trace-path", str(trace)]


def _start(work: Path, flags: list[str], env_extra: dict[str, str] | None) -> tuple[subprocess.Popen, str, Path]:
    """Start ``outrate serve`` (tiny model in ``work``, log ``work/serve.log``) without waiting."""
    from vllm_output_rate.adapter.tinymodel import write_config

    model = write_config(work / "model", tokenizer=True)
    port = free_port()
    log_path = work / "serve.log"
    env = server_env(**(env_extra or {}))
    command = [
        sys.executable,
        "-m",
        "vllm_output_rate.cli",
        "serve",
        str(model),
        *flags,
        "--max-num-seqs",
        "8",
        *tiny_engine_flags(port),
        *TINY_MEMORY_FLAGS,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_ready(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    """Poll ``/health`` until 200; fail the test with the log's tail if the server exits or times out."""
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"outrate serve exited with {proc.returncode}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"server not ready after {READY_TIMEOUT_S} s:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


@contextlib.contextmanager
def serving(work: Path, flags: list[str], env_extra: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``outrate serve MODEL <flags>`` (plus the tiny-model engine flags); yield its URL."""
    with serving_all([(work, flags)], env_extra) as (base_url,):
        yield base_url


@contextlib.contextmanager
def serving_all(servers: list[tuple[Path, list[str]]], env_extra: dict[str, str] | None = None) -> Iterator[list[str]]:
    """Several ``outrate serve`` replicas, one per ``(work directory, flags)``, started at
    once (their start-ups overlap) on their own free ports; yield their URLs in order once
    every one is ready; always stop every process group."""
    started: list[tuple[subprocess.Popen, str, Path]] = []
    try:
        for work, flags in servers:
            started.append(_start(work, flags, env_extra))
        for proc, base_url, log_path in started:
            wait_ready(proc, base_url, log_path)
        yield [base_url for _, base_url, _ in started]
    finally:
        for proc, _, _ in started:
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
