"""pytest plugin: run the conformance gate inside a patch's own test suite.

    pytest --outrate-scheduler=my_pkg.sched.MyScheduler [--outrate-async-scheduler=...]
           [--outrate-profile quick|ci|release] [--outrate-seed N]

adds one test item per gate check (``outrate::rate-limit/sync`` ...), each failing with
the check's shrunk, 1-minimal counterexample. Without ``--outrate-scheduler`` the plugin
adds nothing. Registered through the ``pytest11`` entry point; importing it loads no vLLM.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outrate", "vllm-output-rate conformance gate")
    group.addoption("--outrate-scheduler", default=None, metavar="DOTTED.PATH",
                    help="run the conformance gate on this scheduler class (sync checks)")
    group.addoption("--outrate-async-scheduler", default=None, metavar="DOTTED.PATH",
                    help="also run the async checks on this class")
    group.addoption("--outrate-profile", default="quick", choices=["quick", "ci", "release"],
                    help="gate budget (default quick)")
    group.addoption("--outrate-seed", type=int, default=0, help="gate seed (default 0)")


class GateCheckItem(pytest.Item):
    """One gate check as a pytest test."""

    def __init__(self, *, check, **kwargs) -> None:
        super().__init__(**kwargs)
        self.check = check

    def runtest(self) -> None:
        result = self.check()
        if result.result != "pass":
            raise GateCheckFailed(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GateCheckFailed):
            r = excinfo.value.result
            return "\n".join([f"{r.name} FAILED: {r.failure}", "counterexample:"]
                             + [f"  {line}" for line in r.counterexample]
                             + ([f"saved: {r.saved}"] if r.saved else []))
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return "outrate", None, f"outrate gate check {self.name}"


class GateCheckFailed(Exception):
    def __init__(self, result) -> None:
        super().__init__(result.failure)
        self.result = result


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    sync_cls = config.getoption("--outrate-scheduler")
    if not sync_cls:
        return
    from vllm_output_rate.adapter import conform as gate

    async_cls = config.getoption("--outrate-async-scheduler")
    budget = gate.PROFILES[config.getoption("--outrate-profile")]
    seed = config.getoption("--outrate-seed")
    save_dir = config.rootpath / "reports"

    def scheduler_check(cls, async_mode, pressured):
        examples = budget["pressured"] if pressured else budget["async" if async_mode else "sync"]
        return lambda: gate.check_scheduler(cls, async_mode, examples, budget["max_steps"], seed,
                                            lambda: None, save_dir, pressured=pressured)

    checks = [("limiter-differential", lambda: gate.check_limiter_differential(budget["limiter"], seed, lambda: None))]
    for cls, async_mode in [(sync_cls, False)] + ([(async_cls, True)] if async_cls else []):
        tag = "async" if async_mode else "sync"
        checks.append((f"rate-limit/{tag}", scheduler_check(cls, async_mode, False)))
        checks.append((f"invariants/{tag}", scheduler_check(cls, async_mode, True)))
    for name, check in checks:
        items.append(GateCheckItem.from_parent(session, name=f"outrate::{name}", check=check))
