"""Fixtures and test lanes shared by ``tests/`` and ``gpu_tests/`` (pytest loads this file for both).

Lanes (docs/CONTRIBUTING.md, "Test lanes"): every collected test is in exactly one lane,
named by a marker. A module opts into ``check`` (fast: spec, limiter, config, properties,
static checks) with ``pytestmark = pytest.mark.check``; ``live`` (a real vLLM engine) and
``soak`` (minutes of random live load) are declared the same way; every other test is put
in the ``inprocess`` lane here. ``make check`` runs ``-m check``, ``make live`` runs
``-m live``, ``make test`` runs every lane but ``soak`` (``make soak``).

A test module that gives two lane markers is an error at collection, naming the test. The
terminal summary prints each lane's count and time, and the reason of every skipped test.

- ``redis_server``: a ``vllm_output_rate.redis_server.RedisServer`` (a redis-server on a
  free loopback port: ``url``, ``kill()``, ``start()`` again on the same port), started
  for the test and killed after it. R23-R26, marker ``multi_engine``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_output_rate.redis_server import RedisServer

LANES = ("check", "inprocess", "live", "soak")
_DECLARED = ("check", "live", "soak")
_lane_seconds: dict[str, float] = defaultdict(float)
_lane_counts: dict[str, int] = defaultdict(int)


def lane_of(item: pytest.Item) -> str:
    """The one lane of a collected test: its declared lane marker (``check``, ``live`` or
    ``soak``; a ``gpu`` test is ``live``), else ``inprocess``.

    Raises ``pytest.UsageError`` naming the test when it declares more than one lane."""
    declared = {name for name in _DECLARED if item.get_closest_marker(name) is not None}
    if item.get_closest_marker("gpu") is not None:
        declared.add("live")
    if len(declared) > 1:
        raise pytest.UsageError(f"{item.nodeid}: in more than one test lane {sorted(declared)}; keep exactly one")
    return declared.pop() if declared else "inprocess"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test without a declared lane the ``inprocess`` marker (see the module doc).

    With OUTRATE_LANES_DUMP=FILE, write ``nodeid<TAB>lane markers`` per collected test to FILE
    (tests/test_lanes.py reads it to check that every test is in exactly one lane)."""
    for item in items:
        if lane_of(item) == "inprocess":
            item.add_marker(pytest.mark.inprocess)
    dump = os.environ.get("OUTRATE_LANES_DUMP")
    if dump:
        rows = (f"{item.nodeid}\t{' '.join(n for n in LANES if item.get_closest_marker(n))}\n" for item in items)
        Path(dump).write_text("".join(rows), encoding="utf-8")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each test's setup, call and teardown time to its lane's total."""
    lane = next((name for name in LANES if name in report.keywords), "inprocess")
    _lane_seconds[lane] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _lane_counts[lane] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line per lane that ran: tests and seconds (setup, call and teardown)."""
    if not _lane_counts:
        return
    terminalreporter.section("test lanes")
    for lane in LANES:
        if _lane_counts.get(lane):
            terminalreporter.write_line(f"{lane:>10}: {_lane_counts[lane]:5d} tests {_lane_seconds[lane]:8.1f} s")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A running ``RedisServer`` for one test (R23-R26)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()
