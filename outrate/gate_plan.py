"""The whole gate: the adapter's checks plus the spec-health rows of proofs/.

``outrate conform`` and the pytest plugin (``--outrate-scheduler``) both plan through here,
so they list the same rows. The adapter cannot add the proofs' rows itself: the layers go
one way (``tests/test_layers.py``), and proofs/ sits above the adapter.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_output_rate.adapter import registry as adapter_registry
from vllm_output_rate.adapter.gate_row import GateOptions, GateRow, PlannedRow
from vllm_output_rate.adapter.harness import load_class
from vllm_output_rate.adapter.scenario_run import build_harness
from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario
from vllm_output_rate.proofs.gate_checks import spec_health_checks


def registry() -> list[GateRow]:
    """Every row of the gate, in running order (the adapter's, then proofs/')."""
    return adapter_registry.registry(extra=spec_health_checks())


def plan(options: GateOptions) -> list[PlannedRow]:
    """The rows of one gate run (``adapter.registry.plan`` with the proofs' rows)."""
    return adapter_registry.plan(options, extra=spec_health_checks())


def candidate_class_problem(path: str, path_hint: str) -> str | None:
    """Why the candidate scheduler class ``path`` (a dotted path) cannot be judged, or None.

    Both fronts (``outrate conform`` and the pytest plugin) refuse such a class before any
    check runs, as the operator's mistake it is, never as a candidate failure: its module is
    not found (``path_hint`` is added: how that front extends the path), its module raises
    while it is imported (the message names the module and the exception,
    ``candidate_import.import_named_module``), or it is no vLLM scheduler class.
    """
    from vllm.v1.core.sched.interface import SchedulerInterface  # deferred: vLLM costs ~7 s to import

    try:
        cls = load_class(path)
    except (ValueError, ImportError) as exc:
        return f"{exc}{path_hint if isinstance(exc, ModuleNotFoundError) else ''}"
    if not (isinstance(cls, type) and issubclass(cls, SchedulerInterface)):
        return (
            f"{path} is not a vLLM scheduler class (a subclass of vllm.v1.core.sched.interface."
            f"SchedulerInterface, e.g. of vllm.v1.core.sched.scheduler.Scheduler)"
        )
    return None


ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"  # what the async slot takes


def slot_problem(path: str, named: str, async_slot: bool, async_option: str) -> str | None:
    """Why the scheduler class ``path`` (a dotted path that ``candidate_class_problem``
    passed) is in the wrong slot, or None: the async slot (``async_slot``) takes a subclass
    of vLLM's ``AsyncScheduler`` only, the sync slot anything but one (stock
    ``AsyncScheduler`` is a ``Scheduler`` subclass too). ``named`` is how the front names
    the class as given (``--scheduler-cls pkg.mod.X``) and begins the message;
    ``async_option`` is the front's async option, named in the message."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # deferred: vLLM costs ~7 s to import

    is_async = issubclass(load_class(path), AsyncScheduler)
    if async_slot and not is_async:
        return f"{named} is not an AsyncScheduler ({ASYNC_SCHEDULER}) subclass: give the async class there"
    if not async_slot and is_async:
        return f"{named} is an AsyncScheduler: give it as {async_option}"
    return None


SKIPPED_DIRS = {"node_modules", "site-packages", "__pycache__", "build", "dist"}


def import_dirs(paths: tuple[str, ...], classes: tuple[str | None, ...]) -> tuple[str, ...]:
    """The directories to put on the import path for ``--path`` ``paths`` (as given) and the
    candidate classes (dotted paths): a directory that is itself the top-level package of
    a class (it holds ``__init__.py`` and is named as the class's first component, e.g.
    ``tests/fixtures/article_style`` for ``article_style.scheduler.X``) stands for the
    directory above it; any other directory is kept."""
    tops = {c.partition(".")[0] for c in classes if c}
    out = []
    for directory in paths:
        d = Path(directory)
        out.append(str(d.parent) if d.name in tops and (d / "__init__.py").is_file() else directory)
    return tuple(out)


def package_hint(dotted: str, paths: tuple[str, ...] = (), limit: int = 4000) -> str:
    """What to give ``--path`` so that the class ``dotted`` imports: where its top-level
    package lies under the working directory or a given ``path`` (searched breadth-first,
    at most ``limit`` directories, hidden ones and ``SKIPPED_DIRS`` left out), e.g.
    ``article_style is a package in tests/fixtures: give --path tests/fixtures``; when it is
    not found, which directory ``--path`` takes."""
    top = dotted.partition(".")[0]
    queue = [Path(p) for p in paths] + [Path(".")]
    seen = 0
    while queue and seen < limit:
        d = queue.pop(0)
        seen += 1
        if (d / top / "__init__.py").is_file() or (d / f"{top}.py").is_file():
            where = os.path.relpath(d.resolve()) if d.resolve().is_relative_to(Path.cwd()) else str(d.resolve())
            kind = "a package" if (d / top).is_dir() else "a module"
            return f" ({top} is {kind} in {where}: give --path {where})"
        try:
            queue += sorted(
                c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".") and c.name not in SKIPPED_DIRS
            )
        except OSError:
            continue
    return f" (give --path DIR: the directory that holds the package {top}, or the package's own directory)"


FRACTIONAL_PROBE_RATE = "3.5"  # tokens/s: the fractional rate the gate's scenarios use most


def fractional_rates_problem(options: GateOptions) -> str | None:
    """Why the gate cannot run ``options`` without ``--integer-rates``, or None.

    A candidate configured through engine arguments (``options.style`` set) that parses its
    rates as integers, as the article's flags do, would refuse every scenario with a
    fractional rate, and each refusal would read as the candidate's crash. One probe
    configuration at ``FRACTIONAL_PROBE_RATE`` tokens/s finds that out before any check runs;
    the caller stops with a usage error naming ``--integer-rates``. The additional-config
    style (``options.style`` None) sends JSON numbers and is not probed.
    """
    if options.integer_rates or options.style is None:
        return None
    probe = Scenario(
        rates_tokens_per_s={},
        requests=(RequestSpec("probe-r0", "probe", 4, 1),),
        step_interval_ns=1_000_000,
        num_steps=1,
        default_rate_tokens_per_s=FRACTIONAL_PROBE_RATE,
    )
    try:
        build_harness(options.scheduler_cls, probe, options.style)
    except ValueError as exc:
        text = str(exc)
        if "--integer-rates" in text:  # adapter/configstyle.py: the engine arguments refused the rate
            reason = text.rpartition("]: ")[2].partition(" (if the candidate")[0]
            return (
                f"the candidate's engine arguments refuse the fractional rate {FRACTIONAL_PROBE_RATE} tokens/s "
                f"({reason}); give --integer-rates if it takes integer rates only, as the article's flags do"
            )
    return None
