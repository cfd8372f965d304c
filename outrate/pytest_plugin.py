"""pytest plugin: run the conformance gate inside a patch's own test suite.

    pytest --outrate-scheduler=my_pkg.sched.MyScheduler [--outrate-async-scheduler=...]
           [--outrate-level must|should|exact] [--outrate-sync-only]
           [--outrate-config-style additional-config|engine-args|hook:pkg.mod.fn]
           [--outrate-burst-configurable] [--outrate-integer-rates] [--outrate-rate-change]
           [--outrate-profile quick|ci|release] [--outrate-seed N]

adds one test item per check of the gate's plan (``vllm_output_rate.gate_plan``: the
adapter's registry plus the spec-health rows of proofs/, the same list ``outrate conform``
runs at that level and profile): ``outrate::rate-limit/sync`` ...
Each fails with the check's counterexample; a candidate check that cannot run (no async
class) is an xfail-free failure naming why (NOT TESTED), as in the CLI. Spec-health
checks run only with ``--outrate-spec-health``. Without ``--outrate-scheduler`` the plugin
adds nothing. A class that cannot be imported, or is no vLLM scheduler, stops the run
with a usage error naming the option (nothing is judged). Registered through the ``pytest11`` entry point; importing it loads no vLLM.
"""

from __future__ import annotations

import warnings

import pytest

from vllm_output_rate import gate_modes
from vllm_output_rate.adapter.configstyle import parse_config_style

# How a pytest run puts a candidate's package on the path (``gate_plan.candidate_class_problem``).
PATH_HINT = " (is its directory on the path? set PYTHONPATH, or pytest's `pythonpath` ini option)"
ASYNC_OPTION = "--outrate-async-scheduler"  # the async slot (``gate_plan.slot_problem``)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outrate", "vllm-output-rate conformance gate")

    def flag(name: str, help_text: str) -> None:
        """An on/off option, off unless given."""
        group.addoption(name, action="store_true", help=help_text)

    group.addoption(
        "--outrate-scheduler",
        default=None,
        metavar="DOTTED.PATH",
        help="run the conformance gate on this scheduler class (sync checks)",
    )
    group.addoption(
        "--outrate-async-scheduler", default=None, metavar="DOTTED.PATH", help="also run the async checks on this class"
    )
    group.addoption(
        "--outrate-profile", default="quick", choices=["quick", "ci", "release"], help="gate budget (default quick)"
    )
    group.addoption("--outrate-seed", type=int, default=0, help="gate seed (default 0)")
    group.addoption(
        "--outrate-level",
        default="should",
        choices=["must", "should", "exact"],
        help="conformance level (default should)",
    )
    flag("--outrate-sync-only", "judge the sync class alone")
    group.addoption(
        "--outrate-config-style",
        default="additional-config",
        help="additional-config | engine-args | hook:pkg.module.function",
    )
    flag("--outrate-burst-configurable", "the candidate reads burst_ms")
    flag("--outrate-integer-rates", "the candidate takes integer rates only")
    flag("--outrate-rate-change", "R21: the candidate reloads output_rate.rates_file (rate-change rows at every level)")
    flag("--outrate-spec-health", "also run the spec-health checks")
    group.addoption(
        "--outrate-require-mode",
        action="append",
        default=[],
        choices=["async", "lora", "priority", "prefix-caching", "no-chunked-prefill", "n>1"],
        help="an engine mode whose refusal at start-up fails the run (repeatable; adapter/modes.py)",
    )


class GateWarning(UserWarning):
    """A project rule failed at level should (adapter/origins.py): reported, never a failure."""


def outcome(result) -> str:
    """What a gate row's ``CheckResult`` is as a pytest item: ``"pass"``; ``"skip"`` (coverage
    not judged, a row not applicable to a mode the candidate refused at start-up);
    ``"warn"`` (a project rule at should: a ``GateWarning``, the item passes); ``"fail"``
    (a failure, or NOT TESTED)."""
    if result.result in ("not judged", "not applicable"):
        return "skip"
    if result.result == "warning":
        return "warn"
    return "pass" if result.result == "pass" else "fail"


class GateCheckItem(pytest.Item):
    """One gate check as a pytest test."""

    def __init__(self, *, check, **kwargs) -> None:
        super().__init__(**kwargs)
        self.check = check

    def runtest(self) -> None:
        result = self.check()
        self.user_properties.append(("outrate_result", result.result))
        verdict = outcome(result)
        if verdict == "skip":  # coverage after another check failed; a mode refused at start-up
            pytest.skip(result.failure)
        if verdict == "warn":
            warnings.warn(GateWarning(f"{result.name}: {result.failure}"), stacklevel=1)
        if verdict == "fail":
            raise GateCheckFailed(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GateCheckFailed):
            r = excinfo.value.result
            verdict = "NOT TESTED" if r.result == "not tested" else "FAILED"
            if r.coverage is not None:  # obligations, not a scenario: no counterexample
                return "\n".join(
                    [f"{r.name} {verdict}: {r.failure}"]
                    + [f"  not reached: {line}" for line in r.coverage.get("not_reached", [])]
                )
            return "\n".join(
                [f"{r.name} {verdict}: {r.failure}", "counterexample:"]
                + [f"  {line}" for line in r.counterexample]
                + ([f"saved: {r.saved}"] if r.saved else [])
            )
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
    # deferred: gate_plan imports the gate's rows (Hypothesis) at its top; only a gate run needs it
    from vllm_output_rate import gate_plan

    # deferred: gate_row imports Hypothesis at its top; only a gate run needs it
    from vllm_output_rate.adapter import gate_row

    sync_only = config.getoption("--outrate-sync-only")
    async_cls = None if sync_only else config.getoption("--outrate-async-scheduler")
    for path, option, async_slot in ((sync_cls, "--outrate-scheduler", False), (async_cls, ASYNC_OPTION, True)):
        problem = None if path is None else gate_plan.candidate_class_problem(path, PATH_HINT)
        if problem is not None:  # the operator's mistake: no check runs, nothing is saved
            raise pytest.UsageError(f"{option}={path}: {problem}")
        problem = None if path is None else gate_plan.slot_problem(path, f"{option}={path}", async_slot, ASYNC_OPTION)
        if problem is not None:  # e.g. a sync class given as the async one
            raise pytest.UsageError(problem)
    style_text = config.getoption("--outrate-config-style")
    style = None
    if style_text != "additional-config":
        style = parse_config_style(style_text)
    options = gate_row.GateOptions(
        scheduler_cls=sync_cls,
        async_scheduler_cls=async_cls,
        level=config.getoption("--outrate-level"),
        profile=config.getoption("--outrate-profile"),
        seed=config.getoption("--outrate-seed"),
        style=style,
        integer_rates=config.getoption("--outrate-integer-rates"),
        burst_configurable=config.getoption("--outrate-burst-configurable"),
        sync_only=sync_only,
        rate_change=config.getoption("--outrate-rate-change"),
        spec_health=config.getoption("--outrate-spec-health"),
        save_dir=config.rootpath / "reports",
        require_modes=tuple(config.getoption("--outrate-require-mode")),
    )
    problem = gate_plan.fractional_rates_problem(options)
    if problem is not None:
        raise pytest.UsageError(f"--outrate-integer-rates: {problem}")
    # deferred: adapter.modes imports Hypothesis at its top; only a gate run needs it
    from vllm_output_rate.adapter import modes

    plan, modes_row, refused = gate_modes.probe(options, gate_plan.plan(options))  # the mode matrix first
    items.append(GateCheckItem.from_parent(session, name="outrate::modes", check=lambda: modes_row))
    for planned in plan:

        def check(planned=planned):
            with modes.refusing(refused):  # a refused mode's scenarios are left out (adapter/modes.py)
                return gate_row.run_planned(planned, options, lambda: None)

        items.append(GateCheckItem.from_parent(session, name=f"outrate::{planned.row.name}", check=check))
