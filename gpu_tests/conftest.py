"""Live suites: a real vLLM engine (engine-core process, model runner) on CPU or GPU.

Shared here, as session fixtures of the same names (test modules take them as fixtures:
``tests/`` has a ``conftest`` module too, so ``import conftest`` would be ambiguous):

- ``tiny_llm(output_rate=..., **overrides)``: ``vllm.LLM`` on the project's tiny model
  (dummy weights) with the reference scheduler;
- ``sampling(user, n)``: the ``SamplingParams`` of one stream of ``user``;
- ``request_steps(trace, client_id)``: per-request step counts read from a live trace
  (prefill chunks, throttled steps), which the checker's summary does not keep;
- ``wait_for_finish(trace, client_ids)``: poll a live trace until the engine has freed
  those requests (an abort reaches the engine core asynchronously).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

REFERENCE_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
REFERENCE_ASYNC_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
SOAK_SKIP = "soak runs for minutes (OUTRATE_SOAK_MINUTES, default 10): select it with `pytest -m soak gpu_tests/`"


def cuda_available() -> bool:
    """True when a CUDA device is usable (the CUDA build of vLLM and torch are installed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items) -> None:
    """``soak`` tests run only when selected with ``-m``; ``gpu`` tests only with CUDA."""
    markexpr = config.getoption("markexpr") or ""
    no_cuda = None
    for item in items:
        if "soak" in item.keywords and "soak" not in markexpr:
            item.add_marker(pytest.mark.skip(reason=SOAK_SKIP))
        if "gpu" in item.keywords:
            if no_cuda is None:
                no_cuda = not cuda_available()
            if no_cuda:
                item.add_marker(
                    pytest.mark.skip(
                        reason="needs a CUDA GPU and the CUDA build of vLLM 0.32.0 (on CPU vLLM forces "
                        "async_scheduling off); see docs/GPU_RUNBOOK.md"
                    )
                )


def tiny_llm(output_rate: dict[str, Any] | None = None, **overrides: Any):
    """A ``vllm.LLM`` on the tiny model (eager, float32) running the reference scheduler.

    ``output_rate`` becomes ``additional_config["output_rate"]``; ``overrides`` replace or
    add ``LLM`` arguments (e.g. ``enable_prefix_caching=True``). Scheduling is sync unless
    ``async_scheduling=True`` is given (GPU only), which selects
    ``RateLimitedAsyncScheduler``: the same suites then run unchanged on CPU and on CUDA,
    where vLLM would otherwise turn async scheduling on by itself.
    """
    from vllm import LLM

    from vllm_output_rate.adapter.tinymodel import default_model_dir

    kwargs: dict[str, Any] = {
        "model": str(default_model_dir()),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.2,  # on CPU: the share of RAM reserved (vLLM checks it at start)
        "kv_cache_memory_bytes": 128 * 2**20,
        "scheduler_cls": REFERENCE_ASYNC_SCHEDULER if overrides.get("async_scheduling") else REFERENCE_SCHEDULER,
        "async_scheduling": False,
    }
    if output_rate is not None:
        kwargs["additional_config"] = {"output_rate": output_rate}
    kwargs.update(overrides)
    return LLM(**kwargs)


def sampling(user: Any, n: int, **overrides: Any):
    """``SamplingParams`` of one stream of ``user``: ``n`` tokens, ``ignore_eos``, token ids only."""
    from vllm import SamplingParams

    kwargs: dict[str, Any] = {
        "max_tokens": n,
        "ignore_eos": True,
        "detokenize": False,
        "extra_args": {"output_rate_user": user},
    }
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def request_steps(trace: str | Path, client_id: str) -> dict[str, int]:
    """Steps of the engine request of ``client_id`` in a trace, by kind.

    ``chunks``: scheduled without sampling (prefill chunks); ``sampled``: dispatched to
    sample; ``throttled``: refused and skipped (R11); ``sampled_span``: the number of
    ``schedule()`` calls from its first sampling dispatch to its last, both included (equal
    to ``sampled`` when it was dispatched in every step between them; 0 if never). Reads
    whole lines only.
    """
    from vllm_output_rate.adapter.trace_checker import engine_id_matches

    counts = {"chunks": 0, "sampled": 0, "throttled": 0, "sampled_span": 0}
    sampled_steps: list[int] = []
    for line in Path(trace).read_text(encoding="utf-8").splitlines(keepends=True):
        record = json.loads(line) if line.endswith("\n") else {}
        for rid, info in (record.get("requests") or {}).items():
            if not engine_id_matches(rid, client_id):
                continue
            if info["throttled"]:
                counts["throttled"] += 1
            elif info["sampled"]:
                counts["sampled"] += 1
                sampled_steps.append(record["step"])
            elif info["tokens"] > 0:
                counts["chunks"] += 1
    if sampled_steps:
        counts["sampled_span"] = max(sampled_steps) - min(sampled_steps) + 1
    return counts


def wait_for_finish(trace: str | Path, client_ids: Iterable[str], timeout_s: float = 10.0):
    """Poll a live trace until the engine freed every request of ``client_ids``.

    Returns ``{client id: RequestSummary or None}`` from the last (partial) check, also on
    timeout: the caller asserts the statuses. The scheduler flushes its trace when it goes
    idle and at least every 0.5 s of steps.
    """
    from vllm_output_rate.adapter.trace_check import check_trace
    from vllm_output_rate.adapter.trace_checker import engine_id_matches

    client_ids = list(client_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        runs = check_trace(trace, partial=True).runs
        found = {}
        for client_id in client_ids:
            matches = [r.requests[rid] for r in runs for rid in r.requests if engine_id_matches(rid, client_id)]
            found[client_id] = matches[0] if len(matches) == 1 else None
        if all(r is not None and r.status is not None for r in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _as_fixture(helper):
    """A session fixture named like ``helper`` that returns it."""

    def fixture():
        return helper

    return pytest.fixture(scope="session", name=helper.__name__)(fixture)


tiny_llm_fixture = _as_fixture(tiny_llm)
sampling_fixture = _as_fixture(sampling)
request_steps_fixture = _as_fixture(request_steps)
wait_for_finish_fixture = _as_fixture(wait_for_finish)
