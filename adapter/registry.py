"""The one registry of gate checks, used by ``outrate conform`` and by the pytest plugin
(both through ``vllm_output_rate.gate_plan``, which adds the spec-health rows of proofs/).

Every check is a ``CheckSpec``: its name, its part (``candidate``: it runs the class under
test; ``spec health``: the spec against itself or against stock vLLM, never the
candidate's verdict), the lowest level at which it runs (``adapter/levels.py``), the rules
it covers, and how to run it from ``GateOptions``. ``plan(options)`` lists the checks of a
run with, for each, either a runner or the reason it is not tested; the CLI and the
plugin both run exactly that list, so they give the same verdict at the same level,
profile and seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter.levels import check_level, includes
from vllm_output_rate.adapter.modes import check_mode_names

Tick = Callable[[], None]


@dataclass(frozen=True)
class GateOptions:
    """One gate run's settings.

    ``scheduler_cls`` / ``async_scheduler_cls``: dotted class paths (async None: the async
    checks are NOT TESTED unless ``sync_only``). ``style``: an ``adapter.configstyle``
    object (None: ``additional_config["output_rate"]``). ``integer_rates``: the candidate
    takes integer rates only (the article's flags). ``burst_configurable``: the candidate
    reads ``burst_ms`` (otherwise every scenario uses the article's fixed 100 ms).
    ``rate_change``: the candidate reads ``output_rate.rates_file`` (R21); its
    ``rate-change/*`` rows then judge at every level, not only at exact.
    """

    scheduler_cls: str
    async_scheduler_cls: str | None = None
    level: str = "should"
    profile: str = "ci"
    seed: int = 0
    style: Any = None
    integer_rates: bool = False
    burst_configurable: bool = False
    rate_change: bool = False  # R21: the candidate declares the rates file (opt-in, like burst_configurable)
    require_modes: tuple[str, ...] = ()  # engine modes whose refusal is fatal (adapter/modes.py, --require-mode)
    sync_only: bool = False
    spec_health: bool = True
    save_dir: Path | None = None
    paths: tuple[str, ...] = ()  # --path directories of the candidate (saved in its counterexample files)

    def __post_init__(self) -> None:
        check_level(self.level)
        check_mode_names(self.require_modes)


@dataclass(frozen=True)
class CheckSpec:
    """One registered check (see module docstring). ``total(options)``: the progress bar's
    length; ``run(options, tick) -> CheckResult``. ``async_mode`` None: mode-independent.
    ``modes``: the engine modes every scenario of the row needs, ``draws``: those some of
    its scenarios use (``adapter/modes.py``; ``ROW_MODES``); ``origin``: where its rules come
    from (``adapter/origins.py``; None: from its rules and level)."""

    name: str
    part: str
    level: str
    rules: tuple[str, ...]
    async_mode: bool | None
    total: Callable[[GateOptions], int]
    run: Callable[[GateOptions, Tick], Any]
    opt_in: str | None = None  # a GateOptions flag that makes the row judge at every level (R21: rate_change)
    modes: tuple[str, ...] = ()
    draws: tuple[str, ...] = ()
    origin: str | None = None

    def origin_of(self) -> str:
        """The row's origin (``adapter/origins.row_origin`` unless declared)."""
        from vllm_output_rate.adapter.origins import row_origin

        return self.origin or row_origin(self.rules, self.level)

    def level_for(self, options: GateOptions) -> str:
        """The row's level in this run: ``must`` if the candidate opted in (``opt_in``), else ``level``."""
        return "must" if self.opt_in is not None and getattr(options, self.opt_in) else self.level


@dataclass(frozen=True)
class PlannedCheck:
    """A check of one run: ``skip`` is None when it runs, else why it is not tested;
    ``not_applicable``: why it does not apply (a mode the candidate refused at start-up)."""

    spec: CheckSpec
    skip: str | None = None
    not_applicable: str | None = None


def _budget(options: GateOptions) -> dict:
    from vllm_output_rate.adapter.conform import PROFILES

    return PROFILES[options.profile]


def _step_budget(options: GateOptions) -> dict:
    from vllm_output_rate.adapter.conform import STEP_SPEC_PROFILES

    return STEP_SPEC_PROFILES[options.profile]


def _cls(options: GateOptions, async_mode: bool) -> str:
    """The class an async or sync check runs (an async check is planned only with an async class)."""
    cls = options.async_scheduler_cls if async_mode else options.scheduler_cls
    assert cls is not None, "an async check without --async-scheduler-cls is planned as not tested"
    return cls


def _configured_as(options: GateOptions) -> dict[str, Any]:
    """How the candidate is configured, as the keyword arguments of the scenario checks
    (``check_scheduler``, ``check_white_box``, ``check_boundaries``): its configuration
    ``style`` and whether it takes ``integer_rates`` only."""
    return {"style": options.style, "integer_rates": options.integer_rates}


def _hunt(options: GateOptions, tick: Tick, examples: int, max_steps: int = 40) -> Any:
    """The ``adapter/scenarios.Hunt`` of one row in this gate run: ``examples`` scenarios
    of at most ``max_steps`` steps, the run's seed, progress ``tick`` and save directory."""
    from vllm_output_rate.adapter.scenarios import Hunt

    return Hunt(examples, options.seed, max_steps, tick, options.save_dir)


def _scheduler_check(async_mode: bool, pressured: bool) -> CheckSpec:
    from vllm_output_rate.adapter import conform as gate

    tag = "async" if async_mode else "sync"
    key = "pressured" if pressured else tag

    def run(options: GateOptions, tick: Tick):
        budget = _budget(options)
        result = gate.check_scheduler(
            _cls(options, async_mode),
            async_mode,
            _hunt(options, tick, budget[key], budget["max_steps"]),
            pressured=pressured,
            level=options.level,
            burst_configurable=options.burst_configurable,
            **_configured_as(options),
        )
        return result

    name = f"{'invariants' if pressured else 'rate-limit'}/{tag}"
    rules = (
        ("R1", "R2", "R6", "R7", "R9", "R11", "R12", "R17") if pressured else ("R2", "R7", "R11", "R12", "R14", "R17")
    )
    return CheckSpec(name, "candidate", "must", rules, async_mode, lambda o: _budget(o)[key], run)


def _stock_comparison_check(
    name: str, level: str, rules: tuple[str, ...], async_mode: bool, check: Callable[[], Callable[..., Any]]
) -> CheckSpec:
    """A row that runs the candidate beside stock vLLM on a quarter of the mode's scenario
    budget (at least 5 scenarios): ``check()`` imports and returns the check function,
    called as ``f(class, async_mode, hunt, style)``."""
    key = "async" if async_mode else "sync"

    def examples(options: GateOptions) -> int:
        return max(_budget(options)[key] // 4, 5)

    def run(options: GateOptions, tick: Tick):
        hunt = _hunt(options, tick, examples(options), _budget(options)["max_steps"])
        return check()(_cls(options, async_mode), async_mode, hunt, options.style)

    return CheckSpec(f"{name}/{key}", "candidate", level, rules, async_mode, examples, run)


def _feature_off_check(async_mode: bool) -> CheckSpec:
    def check():
        from vllm_output_rate.adapter.feature_off import check_feature_off

        return check_feature_off

    return _stock_comparison_check("feature-off", "must", ("R18",), async_mode, check)


def _not_binding_check(async_mode: bool) -> CheckSpec:
    def check():
        from vllm_output_rate.adapter.not_binding import check_not_binding

        return check_not_binding

    return _stock_comparison_check("not-binding", "should", ("R19", "R14"), async_mode, check)


def _shadow_check(async_mode: bool) -> CheckSpec:
    """Shadow mode (docs/SPEC.md, Decision "Shadow mode"; level exact, our decision): with
    ``output_rate.shadow: true`` and binding rates the candidate is stock step for step
    (``adapter/feature_off.py``, ``check_shadow``)."""

    def check():
        from vllm_output_rate.adapter.feature_off import check_shadow

        return check_shadow

    return _stock_comparison_check("shadow", "exact", ("shadow",), async_mode, check)


def _rate_tables_check(async_mode: bool) -> CheckSpec:
    """R27-R29 (level exact: the article has no rate table): a plan table whose most
    specific entries free every user is stock step for step (``adapter/rate_tables.py``)."""

    def check():
        from vllm_output_rate.adapter.rate_tables import check_rate_tables

        return check_rate_tables

    return _stock_comparison_check("rate-tables", "exact", ("R27", "R28", "R29"), async_mode, check)


def _white_box_check(async_mode: bool) -> CheckSpec:
    from vllm_output_rate.adapter import conform as gate

    key = "white_async" if async_mode else "white_sync"

    def run(options: GateOptions, tick: Tick):
        return gate.check_white_box(
            _cls(options, async_mode),
            async_mode,
            _hunt(options, tick, _step_budget(options)[key]),
            burst_configurable=options.burst_configurable,
            **_configured_as(options),
        )

    rules = ("R1", "R2", "R4", "R6", "R7", "R9", "R10", "R11", "R12", "R13", "R14", "R15", "R16")
    return CheckSpec(
        f"white-box/{'async' if async_mode else 'sync'}",
        "candidate",
        "exact",
        rules,
        async_mode,
        lambda o: _step_budget(o)[key],
        run,
    )


def _engine_wait_check(async_mode: bool) -> CheckSpec:
    def run(options: GateOptions, tick: Tick):
        from vllm_output_rate.adapter import engine_wait

        result = engine_wait.check_engine_wait(_cls(options, async_mode), options.seed, tick, style=options.style)
        result.minimal = False  # one seeded scenario, not minimized
        if result.result == "fail":
            result.failed_level = "should"
            result.failure = f"[should] {result.failure}"
        return result

    tag = "async" if async_mode else "sync"
    return CheckSpec(f"engine-wait/{tag}", "candidate", "should", ("R16",), async_mode, lambda o: 1, run)


def _per_profile_check(
    name: str,
    level: str,
    rules: tuple[str, ...],
    async_mode: bool,
    load: Callable[[], tuple[dict[str, int], Callable[..., Any]]],
) -> CheckSpec:
    """A row with a fixed number of scenarios per profile: ``load()`` imports and returns
    (scenarios per profile, the check function, called as ``f(class, async_mode, hunt,
    style)``)."""

    def run(options: GateOptions, tick: Tick):
        examples, check = load()
        return check(
            _cls(options, async_mode), async_mode, _hunt(options, tick, examples[options.profile]), options.style
        )

    def total(options: GateOptions) -> int:
        return load()[0][options.profile]

    return CheckSpec(f"{name}/{'async' if async_mode else 'sync'}", "candidate", level, rules, async_mode, total, run)


def _residency_check(async_mode: bool) -> CheckSpec:
    """Issue 13 item 3: R20 fair residency on the flood shape (``adapter/residency.py``)."""

    def load():
        from vllm_output_rate.adapter.residency import EXAMPLES, check_residency

        return EXAMPLES, check_residency

    # Level exact: R20 is this project's extension (off by default; the article has no
    # per-user resident cap), so it never decides an article-style candidate's must/should.
    return _per_profile_check("fair-residency", "exact", ("R20",), async_mode, load)


def _lora_check(async_mode: bool) -> CheckSpec:
    """Issue 13 item 2: LoRA slots on the issue's load (``adapter/lora_slots.py``): no crash
    (must), the other user's adapter served within a bound (should, R13 Decision "LoRA slots")."""

    def load():
        from vllm_output_rate.adapter.lora_slots import EXAMPLES, check_lora

        return EXAMPLES, check_lora

    return _per_profile_check("lora-slots", "should", ("R11", "R13"), async_mode, load)


def _rate_change_check(async_mode: bool) -> CheckSpec:
    """R21: rates changed without a restart through the candidate's rates file
    (``adapter/rate_change.py``). Level exact, as the article has no live rate change; a
    candidate that declares it (``--rate-change``) is judged at every level."""

    def run(options: GateOptions, tick: Tick):
        from vllm_output_rate.adapter.rate_change import EXAMPLES, check_rate_change

        return check_rate_change(
            _cls(options, async_mode),
            async_mode,
            _hunt(options, tick, EXAMPLES[options.profile]),
            options.style,
            level=spec.level_for(options),
        )

    def total(options: GateOptions) -> int:
        from vllm_output_rate.adapter.rate_change import EXAMPLES

        return EXAMPLES[options.profile]

    spec = CheckSpec(
        f"rate-change/{'async' if async_mode else 'sync'}",
        "candidate",
        "exact",
        ("R21",),
        async_mode,
        total,
        run,
        opt_in="rate_change",
    )
    return spec


def _spec_health_checks() -> list[CheckSpec]:
    from vllm_output_rate.adapter import conform as gate

    def fidelity(async_mode: bool) -> CheckSpec:
        key = "base_async" if async_mode else "base_sync"
        rules = tuple(f"V{i}" for i in range(1, 12)) + (("V12",) if async_mode else ())
        return CheckSpec(
            f"base-fidelity/{'async' if async_mode else 'sync'}",
            "spec health",
            "must",
            rules,
            None,
            lambda o: _step_budget(o)[key],
            lambda o, tick: gate.check_base_fidelity(async_mode, _step_budget(o)[key], o.seed, tick, o.save_dir),
        )

    return [
        CheckSpec(
            "limiter-differential",
            "spec health",
            "must",
            ("R1", "R2", "R3", "R4", "R5", "R6"),
            None,
            lambda o: _budget(o)["limiter"],
            lambda o, tick: gate.check_limiter_differential(_budget(o)["limiter"], o.seed, tick),
        ),
        fidelity(False),
        fidelity(True),
    ]


def _boundaries_check(async_mode: bool) -> CheckSpec:
    """Issue 18 item 1: the Z3-directed boundary scenarios (``adapter/boundaries.py``), on
    the candidate at every level, with its config style and integer rates."""

    def per_boundary(options: GateOptions) -> int:
        from vllm_output_rate.adapter.boundary_catalog import PER_BOUNDARY

        return PER_BOUNDARY[options.profile]

    def total(options: GateOptions) -> int:
        from vllm_output_rate.adapter.boundary_catalog import BOUNDARIES

        return len(BOUNDARIES) * per_boundary(options)

    def run(options: GateOptions, tick: Tick):
        from vllm_output_rate.adapter.boundaries import check_boundaries

        return check_boundaries(
            _cls(options, async_mode),
            async_mode,
            options.seed,
            tick,
            options.save_dir,
            level=options.level,
            per_boundary=per_boundary(options),
            **_configured_as(options),
        )

    from vllm_output_rate.adapter.boundary_catalog import BOUNDARIES

    rules = tuple(sorted({r for b in BOUNDARIES for r in b.rules}))
    return CheckSpec(
        f"boundaries/{'async' if async_mode else 'sync'}", "candidate", "must", rules, async_mode, total, run
    )


def _coverage_check() -> CheckSpec:
    """Issue 18 item 2: every obligation of ``adapter/coverage.py`` reached >= k times by
    this run's candidate checks (k per profile); runs last among the candidate checks."""

    def run(options: GateOptions, tick: Tick):
        from vllm_output_rate.adapter.coverage import check_coverage

        tick()
        return check_coverage(options)

    return CheckSpec("coverage", "candidate", "must", tuple(f"R{i}" for i in range(6, 19)), None, lambda o: 1, run)


# The engine modes of each row (adapter/modes.py), by the row's name before "/": (modes every
# scenario needs, modes some scenarios draw). An async row needs "async" as well.
_SCHEDULER_DRAWS = ("priority", "prefix-caching", "no-chunked-prefill")  # scenarios.pressured_scenarios
ROW_MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rate-limit": ((), ("prefix-caching", "no-chunked-prefill")),
    "invariants": ((), _SCHEDULER_DRAWS),
    "feature-off": ((), _SCHEDULER_DRAWS),
    "not-binding": ((), _SCHEDULER_DRAWS),
    "shadow": ((), _SCHEDULER_DRAWS),
    "rate-tables": ((), _SCHEDULER_DRAWS),
    "boundaries": ((), ("priority", "no-chunked-prefill")),
    "fair-residency": ((), ("no-chunked-prefill",)),
    "rate-change": ((), ("no-chunked-prefill",)),
    "lora-slots": (("lora",), ("no-chunked-prefill",)),
    "white-box": ((), ("lora", "priority", "no-chunked-prefill")),
}


# Rows whose origin is not the one of their rules and level (adapter/origins.py): the LoRA
# bound is this project's decision (docs/SPEC.md, Decision "LoRA slots"); a crash stays fatal.
ROW_ORIGINS = {"lora-slots": "project rule"}


def _declared(spec: CheckSpec) -> CheckSpec:
    """``spec`` with its engine modes (``ROW_MODES``, plus ``async`` for an async row) and
    its origin where declared (``ROW_ORIGINS``)."""
    from dataclasses import replace

    row = spec.name.partition("/")[0]
    needs, draws = ROW_MODES.get(row, ((), ()))
    modes = needs + (("async",) if spec.async_mode else ())
    return replace(spec, modes=modes, draws=draws, origin=spec.origin or ROW_ORIGINS.get(row))


def modes_used(planned: Sequence[PlannedCheck]) -> list[str]:
    """The engine modes the rows of ``planned`` that run need or draw (probed before they run)."""
    used: list[str] = []
    for item in planned:
        if item.skip is None and item.spec.part == "candidate":
            used += [m for m in item.spec.modes + item.spec.draws if m not in used]
    return used


def apply_modes(planned: Sequence[PlannedCheck], refused: dict[str, str]) -> list[PlannedCheck]:
    """``planned`` with every row that needs a refused mode (``refused``: name -> message,
    ``adapter/modes.refused``) marked not applicable: "refused at start-up (message)"."""
    from dataclasses import replace

    out = []
    for item in planned:
        hit = [m for m in item.spec.modes if m in refused] if item.skip is None else []
        if hit:
            item = replace(item, not_applicable=f"mode {hit[0]} refused at start-up ({refused[hit[0]]})")
        out.append(item)
    return out


def modes_result(matrix: dict, options: GateOptions):
    """The ``modes`` row (level must, part candidate): the candidate's mode matrix
    (``adapter/modes.probe``) as its ``modes`` table and counterexample lines; it fails on a
    refusal with the feature off (R18), a crash (stock vLLM ran the same probe) or a
    required mode not supported (``--require-mode``)."""
    from vllm_output_rate.adapter import modes
    from vllm_output_rate.adapter.gate_result import CheckResult

    result = CheckResult("modes", ["R18"], examples=len(matrix), part="candidate", level="must")
    result.modes = [row.as_json() for row in matrix.values()]
    result.minimal = False
    lines = [f"{row.mode}: {row.status}" + (f" ({row.message})" if row.message else "") for row in matrix.values()]
    failed = modes.matrix_failure(matrix, options.scheduler_cls.rpartition(".")[2])
    if failed is not None:
        rule, text = failed
        result.result, result.failed_level, result.origin = "fail", "must", "article promise"
        result.failure, result.counterexample = f"[must] {rule}: {text}", lines
    return result


def registry(extra: Sequence[CheckSpec] = ()) -> list[CheckSpec]:
    """Every check of the adapter, candidate checks first, in running order, then ``extra``.

    ``extra``: checks of a higher layer (``proofs/gate_checks.py``'s spec-health rows, added
    by ``vllm_output_rate.gate_plan``: the adapter does not import proofs/)."""
    checks: list[CheckSpec] = []
    for async_mode in (False, True):
        checks += [
            _scheduler_check(async_mode, False),
            _scheduler_check(async_mode, True),
            _feature_off_check(async_mode),
            _not_binding_check(async_mode),
            _boundaries_check(async_mode),
        ]
    checks += [_engine_wait_check(False), _engine_wait_check(True)]
    checks += [_residency_check(False), _residency_check(True)]  # R20
    checks += [_rate_change_check(False), _rate_change_check(True)]  # R21
    checks += [_lora_check(False), _lora_check(True)]  # R11, R13: LoRA slots
    checks += [
        _white_box_check(False),
        _white_box_check(True),
        _shadow_check(False),
        _shadow_check(True),
        _rate_tables_check(False),
        _rate_tables_check(True),
        _coverage_check(),
    ]
    return [_declared(c) for c in checks] + _spec_health_checks() + list(extra)


def plan(options: GateOptions, extra: Sequence[CheckSpec] = ()) -> list[PlannedCheck]:
    """The checks of one run (``registry(extra)``): those at or below ``options.level``; an
    async check without an async class is planned as NOT TESTED (or left out with
    ``sync_only``); spec health is left out with ``spec_health=False``."""
    planned = []
    for spec in registry(extra):
        if spec.part == "spec health" and not options.spec_health:
            continue
        if not includes(options.level, spec.level_for(options)):  # R21: an opt-in row judges at every level
            continue
        if spec.async_mode and options.async_scheduler_cls is None:
            if options.sync_only:
                continue
            planned.append(PlannedCheck(spec, "no --async-scheduler-cls given (use --sync-only to judge sync alone)"))
            continue
        planned.append(PlannedCheck(spec))
    return planned


def run_planned(item: PlannedCheck, options: GateOptions, tick: Tick):
    """Run one planned check (or build its NOT TESTED row); returns a ``CheckResult`` with
    ``part`` and ``level`` set from the registry."""
    import time

    from vllm_output_rate.adapter.gate_result import CheckResult

    spec = item.spec
    if item.skip is not None or item.not_applicable is not None:
        result, why = ("not tested", item.skip) if item.skip is not None else ("not applicable", item.not_applicable)
        return CheckResult(spec.name, list(spec.rules), result=result, failure=why, part=spec.part, level=spec.level)
    from vllm_output_rate.adapter import coverage, origins

    started = time.monotonic()
    if spec.part == "candidate":  # issue 18: obligations reached, summed over the run
        with coverage.collecting() as reached:
            result = spec.run(options, tick)
        # A project rule's failure is a warning at should (adapter/origins.py), never a stop
        origins.judged(
            result, spec.origin_of(), options.level, spec.opt_in is not None and spec.level_for(options) == "must"
        )
        coverage.record_check(options, spec.name, result, reached)
    else:
        result = spec.run(options, tick)
    result.seconds = time.monotonic() - started
    result.part, result.level = spec.part, spec.level_for(options)
    from vllm_output_rate.adapter import counterexample

    counterexample.record(result, options)  # issue 31: the file names the check that saved it
    return result


def exit_code(results: list) -> int:
    """0: every candidate check at or below the level passed and spec health is sound;
    1: a candidate check failed; 2: a check was NOT TESTED (nothing failed); 3: spec
    health failed (the gate's own model is out of step with the installed vLLM or itself:
    the verdict cannot be trusted)."""
    if any(r.result == "fail" and r.part == "candidate" for r in results):
        return 1
    if any(r.result == "fail" for r in results):
        return 3
    if any(r.result == "not tested" for r in results):
        return 2
    return 0
