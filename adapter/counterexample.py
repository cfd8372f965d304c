"""Counterexample files: a gate row's failing scenario with the check that saved it.

A failing candidate row of ``outrate conform --counterexamples DIR`` is saved as one JSON
file (``FORMAT``, ``FORMAT_VERSION``) holding:

- ``check``: the row's name, part, level, the level it judged at (``judged_at``: the gate's
  ``--level`` for the scenario checks, the row's own for the others), the rule and level
  that failed, the row's failure message, and what the check compares with
  (``compares_with``: stock vLLM for feature-off, not-binding and shadow, the 8-step bound
  for lora-slots, the timing bound for engine-wait, the spec limiter for the rest);
- ``gate``: the configuration style, integer rates, burst, profile, seed, the vLLM release
  and the outrate release that wrote the file;
- ``candidate``: the class under test (dotted path), its source file, and the ``--path``
  directories the gate was given (relative to the working directory when under it);
- ``scenario``: the scenario itself, in the format of its check (``adapter/scenarios.py``'s
  rate-limit scenario, ``adapter/fidelity.py``'s step scenario, or, for engine-wait, whose
  one scenario is drawn from the seed, ``{"seed": N}``).

``replay(counterexample, overrides)`` re-runs exactly that check on that scenario
(``KINDS``: one judge per check kind, through the check's own run function and failure
text) and returns the row's failure text, as the gate printed it, or None when it now
passes. ``rerun_command`` is the shell-quoted ``outrate replay`` line the gate prints.
Files written before this format (a bare scenario) are read by ``outrate replay`` as
before, with a note; files of a newer format are refused with the release that wrote them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter import fidelity
from vllm_output_rate.adapter.conform import _guarded, _guarded_step, open_choice_hint
from vllm_output_rate.adapter.engine_wait import check_engine_wait
from vllm_output_rate.adapter.fidelity import StepScenario
from vllm_output_rate.adapter.harness import load_class
from vllm_output_rate.adapter.origins import failed_rule
from vllm_output_rate.adapter.rule_naming import named_verdict
from vllm_output_rate.adapter.scenario_run import run_scenario
from vllm_output_rate.adapter.scenarios import Scenario
from vllm_output_rate.adapter.whitebox import run_white_box

FORMAT = "outrate-counterexample"
FORMAT_VERSION = 1
LIMITER_ORACLE = "the spec limiter (spec/limiter.py) replaying every sampling dispatch, and the spec's invariants"
STOCK = "stock vLLM's Scheduler / AsyncScheduler, step for step"
RULE_TOKEN = re.compile(r"^(R\d+|V\d+|crash|shadow|coverage)$")  # what a row's failure text names as its rule


class CounterexampleError(ValueError):
    """A counterexample file that cannot be replayed as written; the message says why and
    what to do (the CLI turns it into a usage error, exit 2)."""


def outrate_version() -> str:
    """The installed outrate release (the distribution ``vllm-output-rate``), "unknown" if
    not installed as a distribution."""
    try:
        return metadata.version("vllm-output-rate")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Replay:
    """One replay of a saved check: its row name (``check``), the class it runs, the level
    it judges at, the configuration style object (None: ``additional_config``), the
    scenario (loaded in its check's format), the gate's seed, and ``note``: text the row
    adds to its failure (the boundary scenario's name)."""

    check: str
    scheduler_cls: str
    judged_at: str
    style: Any
    scenario: Any
    seed: int = 0
    note: str = ""
    base: Any = None  # base-fidelity only: the vLLM release whose V-rules the spec follows

    @property
    def async_mode(self) -> bool:
        """The row is an async row (``*/async``)."""
        return self.check.endswith("/async")

    @property
    def class_name(self) -> str:
        """The class under test by its own name, as the gate's messages name it."""
        return self.scheduler_cls.rpartition(".")[2]


@dataclass(frozen=True)
class Kind:
    """One kind of gate row (``row``: its name before ``/sync`` or ``/async``): what it
    compares with, how its scenario is stored (``scenario``: "rate-limit", "step" or
    "seed"), and ``judge(replay) -> failure text or None``."""

    row: str
    compares_with: str
    scenario: str
    judge: Callable[[Replay], str | None]
    step_type: Callable[[], type] | None = None  # the step scenario's class (its printed config line)


def failure_text(verdict: Any) -> str:
    """A failing ``Verdict``'s row text, as the gate prints it: ``[level] rule: step N: message``."""
    where = f"step {verdict.step}: " if verdict.step is not None else ""
    return f"[{verdict.level}] {verdict.rule}: {where}{verdict.failure}"


def _text(verdict: Any) -> str | None:
    return None if verdict.failure is None else failure_text(verdict)


def _scheduler_judge(r: Replay) -> str | None:
    """rate-limit/*, invariants/*: the verdict named by the rule it breaks, as the gate
    names the row's failure (``conform.check_scheduler``)."""
    cls = r.scheduler_cls
    return _text(_guarded(lambda s: named_verdict(cls, s, r.judged_at, r.style), cls)(r.scenario))


def _boundaries_judge(r: Replay) -> str | None:
    """boundaries/*: ``run_scenario``, then the failure named by its rule where attribution
    names one (``boundaries.check_boundaries``), with the boundary scenario's name."""
    cls = r.scheduler_cls
    verdict = _guarded(lambda s: run_scenario(cls, s, r.judged_at, r.style), cls)(r.scenario)
    if verdict.failure is None:
        return None
    again = _guarded(lambda s: named_verdict(cls, s, r.judged_at, r.style), cls)(r.scenario)
    return failure_text(again if again.failure is not None else verdict) + r.note


def _paired_judge(load: Callable[[], Any]) -> Callable[[Replay], str | None]:
    """A ``feature_off.PairedCheck`` row (feature-off, not-binding, shadow): the candidate
    beside stock vLLM, through the check's own run function."""

    def judge(r: Replay) -> str | None:
        return _text(load().judge(r.scheduler_cls, r.scenario, r.style))

    return judge


def _hunted_judge(load: Callable[[], Any]) -> Callable[[Replay], str | None]:
    """A ``residency.HuntedCheck`` row (lora-slots, fair-residency, rate-change): the
    check's own run function, rule and crash note."""

    def judge(r: Replay) -> str | None:
        return _text(load().judge(r.scheduler_cls, r.scenario, r.style, r.judged_at))

    return judge


def _engine_wait_judge(r: Replay) -> str | None:
    """engine-wait/*: the row's own check (``engine_wait.check_engine_wait``: the seeded
    scenario through vLLM's engine-core loop, in every world the row runs), level should."""
    result = check_engine_wait(r.scheduler_cls, r.seed, lambda: None, style=r.style)
    return None if result.result != "fail" else f"[should] {result.failure}"


def _white_box_judge(r: Replay) -> str | None:
    """white-box/*: the step spec against the class under test after every event (level
    exact), its message naming the class (``conform.check_white_box``)."""
    cls = r.scheduler_cls
    verdict = _guarded_step(lambda s: run_white_box(s, cls, style=r.style), cls)(r.scenario)
    if verdict.failure is None:
        return None
    failure = f"event {verdict.event_index}: {verdict.failure}".replace(": vLLM ", f": {r.class_name} ")
    return f"[exact] {failure}; {open_choice_hint(failure)}"


def _base_fidelity_judge(r: Replay) -> str | None:
    """base-fidelity/* (spec health): the step spec against stock vLLM (or the class given)."""
    verdict = fidelity.run_step_scenario(r.scheduler_cls, r.scenario, base=r.base)
    if verdict.failure is None:
        return None
    rule = getattr(verdict, "rule", None)
    subject = "stock vLLM" if r.scheduler_cls == fidelity.base_scheduler_cls(r.async_mode) else r.class_name
    text = f"event {verdict.event_index}: {verdict.failure}".replace(": vLLM ", f": {subject} ")
    return text + (f" ({rule})" if rule else "")


def _check(module: str, name: str) -> Callable[[], Any]:
    def load() -> Any:
        return getattr(importlib.import_module(f"vllm_output_rate.adapter.{module}"), name)

    return load


KINDS: tuple[Kind, ...] = (
    Kind("rate-limit", LIMITER_ORACLE, "rate-limit", _scheduler_judge),
    Kind("invariants", LIMITER_ORACLE + " under KV, budget and seat pressure", "rate-limit", _scheduler_judge),
    Kind("boundaries", LIMITER_ORACLE + " on the Z3-directed boundary scenarios", "rate-limit", _boundaries_judge),
    Kind("feature-off", STOCK + ", with no output-rate configuration", "rate-limit", _paired_judge(
        _check("feature_off", "check_feature_off"))),
    Kind("not-binding", STOCK + " (no output-rate configuration), the candidate's rates at 10^6 tokens/s",
         "rate-limit", _paired_judge(_check("not_binding", "check_not_binding"))),
    Kind("shadow", STOCK + ", the candidate in shadow mode", "rate-limit", _paired_judge(
        _check("feature_off", "check_shadow"))),
    Kind("lora-slots", "the 8-step bound (lora_slots.BOUND_STEPS) for another user's adapter request, no "
         "crash, every request finished (P3)", "step", _hunted_judge(_check("lora_slots", "check_lora")),
         _check("lora_slots", "LoraScenario")),
    Kind("fair-residency", "R20's per-user resident cap, judged by the spec", "step",
         _hunted_judge(_check("residency", "check_residency")), _check("residency", "ResidencyScenario")),
    Kind("rate-change", "the spec limiter with R21's rate changes", "step",
         _hunted_judge(_check("rate_change", "check_rate_change")), _check("rate_change", "RateChangeScenario")),
    Kind("engine-wait", "the timing bound: each throttled user's ready time from the spec limiter (no spin, no "
         "oversleep, no early wake, new input wakes the loop)", "seed", _engine_wait_judge),
    Kind("white-box", "the step spec, every field, after every event", "step", _white_box_judge),
    Kind("base-fidelity", "the step spec (V-rules) against stock vLLM", "step", _base_fidelity_judge),
)  # fmt: skip


def kind_of(check: str) -> Kind | None:
    """The kind of the row named ``check`` (``rate-limit/sync`` -> rate-limit), None for a
    row that saves no scenario (coverage, limiter-differential, the proofs' rows)."""
    row = check.rpartition("/")[0] or check
    return next((k for k in KINDS if k.row == row), None)


def _failed_rule(failure: str | None) -> tuple[str | None, str | None]:
    """(level, rule) of a row's failure text ``[level] RULE ...: ...`` (None, None otherwise;
    ``adapter/origins.failed_rule`` reads the rule)."""
    rule = failed_rule(failure)
    if rule is None or failure is None or not RULE_TOKEN.match(rule):  # white box: "[exact] event 2: ..."
        return None, None
    return failure[1:].partition("]")[0], rule


def rule_of(failure: str | None) -> str | None:
    """The rule a row's failure text names (``[should] R19: ...`` -> R19; crash -> crash)."""
    return _failed_rule(failure)[1]


def shown_path(path: str | os.PathLike, cwd: Path | None = None) -> str:
    """``path`` relative to ``cwd`` (default: the working directory) when it lies under it,
    else absolute."""
    cwd = (cwd or Path.cwd()).resolve()
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(cwd))
    except ValueError:
        return str(resolved)


def _source_file(scheduler_cls: str) -> str | None:
    try:
        return shown_path(inspect.getfile(load_class(scheduler_cls)))
    except (TypeError, OSError, ValueError, ImportError):
        return None


def judged_at(check: str, options: Any, row_level: str) -> str:
    """The level a row judges at: the gate's ``--level`` for the scenario checks (it picks
    the properties judged), the row's own level for the others."""
    return options.level if check.rpartition("/")[0] in ("rate-limit", "invariants", "boundaries") else row_level


def record(result: Any, options: Any) -> None:
    """Save a failing row of a gate run (``options``: ``gate_row.GateOptions``) as a
    counterexample file: the scenario its check saved (``result.saved``), or for engine-wait
    the seed, wrapped with the check and the run's settings (module docstring). Sets
    ``result.saved``. A warning row (a project rule failed at should, ``adapter/origins.py``)
    is saved as a failure. Nothing is written for a passing row, a row of no ``KINDS``
    kind, or without ``options.save_dir``."""
    kind = kind_of(result.name)
    if result.result not in ("fail", "warning") or kind is None or options.save_dir is None:
        return
    if result.saved is not None:
        scenario = json.loads(Path(result.saved).read_text())
        path = Path(result.saved)
    elif kind.scenario == "seed":
        scenario = {"seed": options.seed}
        path = Path(options.save_dir) / f"counterexample-{result.name.replace('/', '-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        return
    path.write_text(json.dumps(document(result, options, kind, scenario), indent=1))
    result.saved = str(path)


def document(result: Any, options: Any, kind: Kind, scenario: dict) -> dict:
    """The JSON document of one counterexample file (module docstring)."""
    import vllm  # deferred: vLLM costs ~7 s to import

    failed_level, rule = _failed_rule(result.failure)
    cls = options.async_scheduler_cls if result.name.endswith("/async") else options.scheduler_cls
    if result.part == "spec health":
        cls = None  # stock vLLM, the spec's subject
    note = ""
    if result.failure and result.failure.endswith(")") and " (boundary scenario " in result.failure:
        note = " (boundary scenario " + result.failure.rpartition(" (boundary scenario ")[2]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "check": {
            "name": result.name,
            "part": result.part,
            "level": result.level,
            "judged_at": judged_at(result.name, options, result.level),
            "failed_level": result.failed_level or failed_level,
            "rule": rule,
            "rules": list(result.rules),
            "compares_with": kind.compares_with,
            "failure": result.failure,
            "note": note,
        },
        "gate": {
            "config_style": getattr(options.style, "name", None) or "additional-config",
            "integer_rates": options.integer_rates,
            "burst": "configurable" if options.burst_configurable else "fixed 100 ms",
            "rate_change": options.rate_change,
            "profile": options.profile,
            "level": options.level,
            "seed": options.seed,
            "vllm": vllm.__version__,
            "outrate": outrate_version(),
        },
        "candidate": {
            "class": cls,
            "source": None if cls is None else _source_file(cls),
            "paths": [shown_path(p) for p in getattr(options, "paths", ())],
        },
        "scenario": scenario,
    }


def scenario_text(path: str | os.PathLike) -> str:
    """The JSON text of the scenario saved in ``path``: the ``scenario`` section of a
    counterexample file, or the whole file for a bare scenario (saved outside a gate run)."""
    text = Path(path).read_text()
    data = json.loads(text)
    return json.dumps(data["scenario"]) if is_counterexample(data) else text


def is_counterexample(data: Any) -> bool:
    """``data`` (a parsed JSON file) is a counterexample file of this module's format (any version)."""
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_version(data: dict, name: str) -> None:
    """Raise ``CounterexampleError`` if ``data`` is of a newer format than this release reads,
    naming the release that wrote it and what to do."""
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        wrote = (data.get("gate") or {}).get("outrate", "an unknown release")
        raise CounterexampleError(
            f"{name} was written by outrate {wrote} (counterexample format {version!r}); this outrate "
            f"({outrate_version()}) reads format {FORMAT_VERSION} or older: install outrate {wrote} to replay it, "
            "or re-run the gate with this release to save the counterexample again"
        )


@dataclass
class Loaded:
    """A counterexample file as ``outrate replay`` uses it: the ``Kind``, the JSON
    ``data``, and the scenario loaded in its check's format."""

    kind: Kind
    data: dict
    scenario: Any
    lines: list[str] = field(default_factory=list)

    @property
    def check(self) -> dict:
        """The file's ``check`` section."""
        return self.data["check"]

    @property
    def gate(self) -> dict:
        """The file's ``gate`` section."""
        return self.data["gate"]

    @property
    def candidate(self) -> dict:
        """The file's ``candidate`` section."""
        return self.data["candidate"]


def load(data: dict, name: str) -> Loaded:
    """The counterexample file ``data`` (parsed JSON, file ``name``) with its scenario loaded.

    Raises:
        CounterexampleError: a newer format, a check this release does not know, or a
            section missing; ``adapter.scenario_file.ScenarioFileError``: a bad scenario value
            (the message names the field and the value).
    """
    check_version(data, name)
    for section in ("check", "gate", "candidate", "scenario"):
        if not isinstance(data.get(section), dict):
            raise CounterexampleError(f"{name}: no {section!r} section (a counterexample file holds {section})")
    check = data["check"].get("name")
    kind = kind_of(str(check))
    if kind is None:
        raise CounterexampleError(f"{name}: check {check!r} is not a check this outrate can replay")
    text = json.dumps(data["scenario"])
    if kind.scenario == "rate-limit":
        limited = Scenario.from_json(text)
        return Loaded(kind, data, limited, limited.events())
    if kind.scenario == "step":
        step = StepScenario.from_json(text)
        if kind.step_type is not None:  # the check's own scenario class (its printed config line)
            step = kind.step_type()(step.config, step.events)
        return Loaded(kind, data, step, step.lines())
    seed = data["scenario"].get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise CounterexampleError(f"{name}: scenario.seed must be a non-negative integer, got {seed!r}")
    return Loaded(kind, data, seed, [f"the engine-wait scenario of seed {seed} (adapter/engine_wait.py)"])


def replay(loaded: Loaded, scheduler_cls: str, judged: str, style: Any, base: Any = None) -> str | None:
    """Re-run the check of ``loaded`` on its scenario with class ``scheduler_cls`` at level
    ``judged`` (``style``: the configuration style object): the row's failure text as the
    gate prints it, or None if the check passes."""
    seed = loaded.scenario if loaded.kind.scenario == "seed" else loaded.gate.get("seed", 0)
    r = Replay(
        loaded.check["name"], scheduler_cls, judged, style, loaded.scenario, seed, loaded.check.get("note") or "", base
    )
    return loaded.kind.judge(r)


def default_class(loaded: Loaded) -> str:
    """The class a file's check ran (stock vLLM for a spec-health row)."""
    if loaded.candidate.get("class"):
        return loaded.candidate["class"]
    return fidelity.base_scheduler_cls(loaded.check["name"].endswith("/async"))


def rerun_command(saved: str, cwd: Path | None = None) -> list[str]:
    """The ``outrate replay`` command (argv) that re-runs the file ``saved``: the file and
    every setting its check needs (class, ``--path``, ``--config-style``, ``--level``),
    paths relative to ``cwd`` when under it."""
    data = json.loads(Path(saved).read_text())
    argv = ["outrate", "replay", shown_path(saved, cwd)]
    cls = data["candidate"].get("class")
    if cls:
        argv += ["--scheduler-cls", cls]
    for directory in data["candidate"].get("paths", []):
        argv += ["--path", shown_path(directory, cwd)]
    style = data["gate"].get("config_style", "additional-config")
    if style != "additional-config":
        argv += ["--config-style", style]
    argv += ["--level", data["check"]["judged_at"]]
    return argv


def shell_line(argv: list[str]) -> str:
    """``argv`` as one line a POSIX shell reads back as ``argv`` (``shlex.join``)."""
    return shlex.join(argv)
