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
import subprocess
import sys
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

# Every VllmConfig the in-process tests build is for a scheduler that runs no kernel: on a CPU
# without triton-cpu, vLLM 0.34's platform check would refuse it (adapter/vllm_compat.py).
from vllm_output_rate.adapter.vllm_compat import scheduler_only_config  # noqa: E402

_SCHEDULER_ONLY = scheduler_only_config()  # held for the session (its exit would undo it)
_SCHEDULER_ONLY.__enter__()


# -- per_release: the tests that depend on vLLM's internals ----------------------------------------
# On an extra vLLM release (`make test VLLM=0.33.0`) only the tests that can behave differently
# between releases run: those that, on the default release, built a vLLM scheduler or a
# ``VllmConfig`` (the seam to vLLM's internals), or started a subprocess that can (``outrate``,
# ``vllm``, ``python -m ...``). tests/per_release.txt records each test (module::test, without
# parameters) as ``+`` (touched the seam) or ``-`` (did not); a test it does not list yet is
# taken as ``+``, so a new test runs on every release until the file is regenerated. `make test`
# on the default release sets OUTRATE_PER_RELEASE_CHECK=1: the run writes what it observed to
# .outrate/per_release.txt and names, in its summary, the tests recorded ``-`` that touched the
# seam (they would be left out on extra releases) with the command that records them.
PER_RELEASE_LIST = Path(__file__).with_name("per_release.txt")
PER_RELEASE_OBSERVED = Path(__file__).resolve().parents[1] / ".outrate" / "per_release.txt"
_running: list[str] = []
_touched: set[str] = set()
_ran: set[str] = set()


def base_test_id(nodeid: str) -> str:
    """``tests/test_x.py::test_y[a-b]`` -> ``tests/test_x.py::test_y`` (parameters dropped)."""
    return nodeid.split("[", 1)[0]


def recorded_per_release() -> dict[str, bool]:
    """tests/per_release.txt as ``{base test id: touched the seam}`` (``+``/``-`` lines; blank
    lines and ``#`` comments ignored).

    Raises ``pytest.UsageError`` naming the line when a line is neither."""
    if not PER_RELEASE_LIST.is_file():
        return {}
    recorded: dict[str, bool] = {}
    for number, line in enumerate(PER_RELEASE_LIST.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line[:2] not in ("+ ", "- "):
            raise pytest.UsageError(f"tests/per_release.txt:{number}: {line!r} is not '+ TEST' or '- TEST'")
        recorded[line[2:]] = line[0] == "+"
    return recorded


def _note_seam() -> None:
    if _running:
        _touched.add(_running[-1])


def _wrap(owner: object, name: str, touches) -> None:
    """Wrap ``owner.name`` so that a call for which ``touches(args)`` holds marks the running test."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if touches(args, kwargs):
            _note_seam()
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _spawns_vllm(args: tuple, kwargs: dict) -> bool:
    argv = kwargs.get("args", args[1] if len(args) > 1 else ())
    words = [argv] if isinstance(argv, str | bytes) else [str(a) for a in argv]
    text = " ".join(str(w) for w in words)
    return "outrate" in text or "vllm" in text or (sys.executable in text and " -m " in f" {text} ")


def _install_seam_recorder() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap(Scheduler, "__init__", lambda a, k: True)
    _wrap(VllmConfig, "__post_init__", lambda a, k: True)
    _wrap(subprocess.Popen, "__init__", _spawns_vllm)


_install_seam_recorder()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Record the running test for the seam recorder above."""
    _running.append(base_test_id(item.nodeid))
    _ran.add(_running[-1])
    try:
        yield
    finally:
        _running.pop()


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``per_release`` every test recorded ``+`` in tests/per_release.txt or not recorded."""
    recorded = recorded_per_release()
    for item in items:
        if recorded.get(base_test_id(item.nodeid), True):
            item.add_marker(pytest.mark.per_release)


def pytest_sessionfinish(session, exitstatus) -> None:
    """With OUTRATE_PER_RELEASE_CHECK=1: write this run's record to .outrate/per_release.txt
    (tests that did not run keep their entry); name the tests recorded ``-`` that touched the
    seam and say how many tests are not recorded yet."""
    if os.environ.get("OUTRATE_PER_RELEASE_CHECK") != "1" or not _ran:
        return
    recorded = recorded_per_release()
    observed = {test: test in _touched for test in _ran}
    merged = {**{t: v for t, v in recorded.items() if t not in _ran}, **observed}
    PER_RELEASE_OBSERVED.parent.mkdir(parents=True, exist_ok=True)
    header = "# Tests run again on every extra vLLM release: + (touched vLLM's internals), - (did not). Generated.\n"
    rows = "".join(f"{'+' if touched else '-'} {test}\n" for test, touched in sorted(merged.items()))
    PER_RELEASE_OBSERVED.write_text(header + rows, encoding="utf-8")
    wrong = sorted(t for t in _touched if recorded.get(t) is False)
    new = sorted(t for t in _ran if t not in recorded)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and (wrong or new):
        reporter.write_line(
            f"per_release: {len(new)} tests not recorded yet (run on every release), {len(wrong)} recorded '-' "
            f"but touched vLLM's internals{': ' + ', '.join(wrong[:5]) if wrong else ''}. "
            "To record them: cp .outrate/per_release.txt tests/per_release.txt"
        )


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
    from vllm_output_rate.adapter import gate_row, registry
    from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER

    specs = {s.name: s for s in registry.registry()}
    sync, async_ = specs[f"{check}/sync"], specs[f"{check}/async"]
    assert [(c.part, c.level) for c in (sync, async_)] == [("candidate", level)] * 2
    assert sync.rules == async_.rules, (sync.rules, async_.rules)
    names = {
        lvl: [p.row.name for p in registry.plan(gate_row.GateOptions(REFERENCE_SCHEDULER, "x.Y", level=lvl))]
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
