"""Shared set-up for the in-process tests: offline environment, one vLLM import per session.

Importing vLLM's scheduler costs about 8 s; doing it here, once, at collection time keeps
every test module's own imports cheap. Nothing may be fetched from a model hub.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import importlib

import pytest

# The expensive imports, paid once per session (the harness imports lazily).
for _module in ("vllm.config", "vllm.v1.core.sched.async_scheduler", "vllm.v1.core.sched.scheduler",
                "vllm_output_rate.reference.scheduler"):
    importlib.import_module(_module)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """P5: run a test on both RateLimitedScheduler and RateLimitedAsyncScheduler."""
    return request.param
