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
from pathlib import Path

import pytest

# The expensive imports, paid once per session (the harness imports lazily).
for _module in (
    "vllm.config",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.core.sched.scheduler",
    "vllm_output_rate.reference.scheduler",
):
    importlib.import_module(_module)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """P5: run a test on both RateLimitedScheduler and RateLimitedAsyncScheduler."""
    return request.param


@pytest.fixture
def reference_cls(async_scheduling: bool) -> str:
    """The reference scheduler (dotted class path) of the mode ``async_scheduling`` gives:
    RateLimitedAsyncScheduler in async mode, RateLimitedScheduler in sync mode."""
    from vllm_output_rate.adapter.harness import REFERENCE_ASYNC_SCHEDULER, REFERENCE_SCHEDULER

    return REFERENCE_ASYNC_SCHEDULER if async_scheduling else REFERENCE_SCHEDULER


@pytest.fixture
def stock_cls(async_scheduling: bool) -> str:
    """Stock vLLM's scheduler (dotted class path) of the mode ``async_scheduling`` gives:
    AsyncScheduler in async mode, Scheduler in sync mode."""
    from vllm_output_rate.adapter.harness import STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER

    return STOCK_ASYNC_SCHEDULER if async_scheduling else STOCK_SCHEDULER


def _registered_at_level(check: str, level: str, below: str) -> tuple[str, ...]:
    """Assert the gate registers ``check``/sync and ``check``/async as candidate checks at
    conformance ``level`` (one rule tuple for both), planned for the reference at ``level``
    and not at ``below``, the level under it. Returns that rule tuple."""
    from vllm_output_rate.adapter import registry
    from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER

    specs = {s.name: s for s in registry.registry()}
    sync, async_ = specs[f"{check}/sync"], specs[f"{check}/async"]
    assert [(c.part, c.level) for c in (sync, async_)] == [("candidate", level)] * 2
    assert sync.rules == async_.rules, (sync.rules, async_.rules)
    names = {
        lvl: [p.spec.name for p in registry.plan(registry.GateOptions(REFERENCE_SCHEDULER, "x.Y", level=lvl))]
        for lvl in (below, level)
    }
    assert f"{check}/sync" in names[level] and f"{check}/sync" not in names[below]
    return sync.rules


@pytest.fixture
def registered_at_level():
    """``registered_at_level(check, level, below) -> rules``: the registration checks of a
    candidate gate check (see ``_registered_at_level``)."""
    return _registered_at_level


@pytest.fixture
def article_flags(monkeypatch):
    """``article_style.flags.install()`` on vLLM's EngineArgs, undone after the test
    (install() patches the class for good, and importing the scheduler module runs it)."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    before = dict(vars(EngineArgs))
    import article_style.flags

    article_style.flags.install()
    yield article_style.flags
    _restore_engine_args(before)
    assert dict(vars(EngineArgs)) == before


def _restore_engine_args(before: dict) -> None:
    """vLLM's ``EngineArgs`` class attributes back to ``before`` (a ``vars()`` copy)."""
    from vllm.engine.arg_utils import EngineArgs

    for name in set(vars(EngineArgs)) - set(before):
        delattr(EngineArgs, name)
    for name, value in before.items():
        if vars(EngineArgs).get(name) is not value:
            setattr(EngineArgs, name, value)


@pytest.fixture(autouse=True)
def _engine_args_kept():
    """vLLM's ``EngineArgs`` as it was before the test: importing the article-style
    scheduler (``outrate bench`` times it, the mutant catalogue loads it) installs the
    article's engine flags on the class for good, and the engine-args tests that follow
    would see them (``test_configstyle`` then failed, one case ending the process)."""
    from vllm.engine.arg_utils import EngineArgs

    before = dict(vars(EngineArgs))
    yield
    _restore_engine_args(before)


@pytest.fixture(autouse=True)
def _metrics_env_kept():
    """The metrics directory variables as they were before the test: the plugin's front end
    sets them in ``os.environ`` for the engine cores it spawns, and a later test's subprocess
    (``outrate conform``) would otherwise inherit another test's directory."""
    from vllm_output_rate.reference.metrics import ENV_DIR, ENV_OWNER

    before = {name: os.environ.get(name) for name in (ENV_DIR, ENV_OWNER)}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
