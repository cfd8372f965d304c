"""Test lanes (conftest.py; docs/CONTRIBUTING.md, "Test lanes"): every collected test is in
exactly one lane, ``check``, ``inprocess``, ``live`` or ``soak``, so that ``make check``,
``make live`` and ``make test`` select what their names say and no test falls between them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The root conftest.py (``import conftest`` here would be tests/conftest.py).
_spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
assert _spec is not None and _spec.loader is not None
_root_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root_conftest)
LANES, lane_of = _root_conftest.LANES, _root_conftest.lane_of


class _Item:
    """The part of a pytest item that ``lane_of`` reads: its node id and its markers."""

    def __init__(self, *markers: str) -> None:
        self.nodeid = "tests/test_x.py::test_y"
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


@pytest.mark.check
@pytest.mark.parametrize(
    ("markers", "lane"),
    [((), "inprocess"), (("check",), "check"), (("live",), "live"), (("gpu", "live"), "live"), (("soak",), "soak")],
)
def test_lane_of_a_test_is_its_declared_lane_else_inprocess(markers, lane):
    assert lane_of(_Item(*markers)) == lane


@pytest.mark.check
def test_two_lanes_on_one_test_is_a_collection_error_naming_it():
    with pytest.raises(
        pytest.UsageError, match=r"tests/test_x.py::test_y: in more than one test lane \['check', 'live'\]"
    ):
        lane_of(_Item("check", "live"))


@pytest.mark.slow
def test_every_collected_test_is_in_exactly_one_lane(tmp_path):
    dump = tmp_path / "lanes.tsv"
    env = dict(os.environ, OUTRATE_LANES_DUMP=str(dump))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = [line.split("\t") for line in dump.read_text(encoding="utf-8").splitlines()]
    assert len(rows) > 1000, len(rows)
    lanes = {nodeid: marks.split() for nodeid, marks in rows}
    wrong = {nodeid: marks for nodeid, marks in lanes.items() if len(marks) != 1 or marks[0] not in LANES}
    assert not wrong, list(wrong.items())[:10]
    by_lane = {lane: sum(marks == [lane] for marks in lanes.values()) for lane in LANES}
    assert all(by_lane[lane] > 0 for lane in LANES), by_lane
    assert all(marks == ["live"] for nodeid, marks in lanes.items() if nodeid.startswith("gpu_tests/test_live_")), lanes
