"""Engine modes a candidate refuses at start-up (docs/SPEC.md, "Modes a patch refuses").

The article refuses many engine modes when the engine is built (speculative decoding, DP,
PP, multimodal, connectors, ...); a patch may refuse more. Before a gate run's rows run,
``probe`` (``adapter/mode_probe.py``) builds the candidate once per engine mode the rows use
(``MODES``), with the feature on, and runs ``PROBE_STEPS`` steps of two users' requests in
that mode:

- ``supported``: it was built and ran;
- ``refused``: a clean exception while it was built (its configuration, through the
  gate's ``--config-style``, or its ``__init__``): a statement of scope, not a failure at
  any level, unless the team requires the mode (``--require-mode NAME``). The rows that
  need the mode (``GateRow.needs``) are *not applicable*; in rows that only draw it
  (``GateRow.draws``) its scenarios are left out (``refusing``: the harness rejects them
  as Hypothesis invalid examples, ``ModeRefused``). A refused mode is probed again with the
  feature OFF: a refusal there breaks R18 (the feature off is the base scheduler);
- ``crashed``: the class raised a programming error (``PROGRAMMING_ERRORS``) while it was
  built, or any exception in the probe's steps; counted against the candidate only if
  stock vLLM runs the same probe (otherwise ``unavailable``: the harness cannot run that
  mode on this vLLM, no verdict on it).

The ``n>1`` mode is vLLM's parallel sampling: the front end fans a request out into
children that share one ``SamplingParams`` (``ParentRequest``); a clean exception when the
children are added is that mode refused (the article refuses beam search at its
entrypoint the same way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from hypothesis.errors import UnsatisfiedAssumption

SUPPORTED = "supported"
REFUSED = "refused"
CRASHED = "crashed"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Mode:
    """One engine mode: ``name`` (as ``--require-mode`` spells it), what it is in vLLM's
    terms, ``shape(EngineShape) -> EngineShape`` turning it on, and ``on(shape)`` telling
    whether a harness shape uses it (None: a per-request mode, seen in no shape)."""

    name: str
    what: str
    shape: Callable[[Any], Any]
    on: Callable[[Any], bool] | None


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode(
            "async",
            "async scheduling (one step in flight)",
            lambda s: replace(s, async_scheduling=True),
            lambda s: s.async_scheduling,
        ),
        Mode(
            "lora", "--enable-lora --max-loras 1", lambda s: replace(s, max_loras=1), lambda s: s.max_loras is not None
        ),
        Mode(
            "priority",
            "--scheduling-policy priority",
            lambda s: replace(s, policy="priority"),
            lambda s: s.policy == "priority",
        ),
        Mode(
            "prefix-caching",
            "--enable-prefix-caching",
            lambda s: replace(s, enable_prefix_caching=True),
            lambda s: s.enable_prefix_caching,
        ),
        Mode(
            "no-chunked-prefill",
            "--no-enable-chunked-prefill",
            lambda s: replace(s, chunked_prefill=False),
            lambda s: not s.chunked_prefill,
        ),
        Mode("n>1", "parallel sampling: children sharing one SamplingParams", lambda s: s, None),
    )
}


def check_mode_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` unchanged as a tuple if each is a key of ``MODES``.

    Raises:
        ValueError: naming the first unknown mode and the known ones.
    """
    names = tuple(names)
    for name in names:
        if name not in MODES:
            raise ValueError(f"unknown engine mode {name!r}: use one of {', '.join(MODES)}")
    return names


@dataclass
class ModeStatus:
    """One row of the candidate's mode matrix. ``status``: ``SUPPORTED``, ``REFUSED``,
    ``CRASHED`` or ``UNAVAILABLE``; ``message``: the exception, ``Type: text`` ("" when
    supported); ``feature_off``: for a refused mode, the refusal with the feature off
    (None: built with the feature off, as R18 asks); ``required``: ``--require-mode``."""

    mode: str
    status: str
    message: str = ""
    feature_off: str | None = None
    required: bool = False

    def as_json(self) -> dict[str, Any]:
        """The row as a JSON-ready dict (the report's ``modes`` list)."""
        return {
            "mode": self.mode,
            "what": MODES[self.mode].what,
            "status": self.status,
            "message": self.message,
            "refused_with_feature_off": self.feature_off,
            "required": self.required,
        }


def refused(matrix: dict[str, ModeStatus]) -> dict[str, str]:
    """The refused modes of ``matrix``: name -> the refusal's message."""
    return {name: row.message for name, row in matrix.items() if row.status == REFUSED}


class ModeRefused(UnsatisfiedAssumption):
    """A scenario in a mode the candidate refused at start-up (``refusing``): not a test of
    the candidate. Inside a Hypothesis hunt it is an invalid example (another is drawn);
    a directed row (``boundaries/*``) skips the scenario."""

    def __init__(self, mode: str, message: str) -> None:
        super().__init__(f"mode {mode} refused at start-up ({message})")
        self.args = (f"mode {mode} refused at start-up ({message})",)
        self.mode = mode


_REFUSED: dict[str, str] = {}  # the running gate's refused modes (``refusing``)


@contextlib.contextmanager
def refusing(modes: dict[str, str]) -> Iterator[None]:
    """Within the block, a harness built with the feature on in one of ``modes`` (name ->
    message) raises ``ModeRefused`` instead of building the candidate."""
    saved = dict(_REFUSED)
    _REFUSED.clear()
    _REFUSED.update(modes)
    try:
        yield
    finally:
        _REFUSED.clear()
        _REFUSED.update(saved)


def check_not_refused(shape: Any) -> None:
    """Raise ``ModeRefused`` if ``shape`` (an ``EngineShape``) has the feature on and uses a
    mode refused in the running gate (``refusing``); the feature off is never skipped (R18)."""
    if not _REFUSED or shape.output_rate is None:
        return
    for name, message in _REFUSED.items():
        on = MODES[name].on
        if on is not None and on(shape):
            raise ModeRefused(name, message)


# Coverage obligations (adapter/coverage.py) reached only in one engine mode: not applicable
# when the candidate refused it (the rows that could reach them leave its scenarios out).
OBLIGATION_MODES = {
    "R8 dispatched after its final token (async)": "async",
    "R10 no chunked prefill: a refused prompt waits whole": "no-chunked-prefill",
    "boundary: priority-throttled-victim": "priority",
    "boundary: priority-throttled-victim-above": "priority",
    "boundary: refused-prompt-ahead": "no-chunked-prefill",
}


def obligation_refused(obligation: str) -> str | None:
    """The refused mode (in the running gate, ``refusing``) that ``obligation`` needs, or None."""
    mode = OBLIGATION_MODES.get(obligation)
    return mode if mode in _REFUSED else None


def matrix_failure(matrix: dict[str, ModeStatus], cls_name: str) -> tuple[str, str] | None:
    """``(rule, failure)`` of the ``modes`` row, or None when it passes: a refusal with the
    feature off (R18), a required mode refused (``--require-mode``), a crash while built or
    in the probe's steps (stock vLLM ran the same probe)."""
    for row in matrix.values():
        if row.status == REFUSED and row.feature_off is not None:
            return "R18", (
                f"{cls_name} refuses mode {row.mode} ({MODES[row.mode].what}) with the feature OFF too "
                f"({row.feature_off}): with the feature off it must be the base scheduler, which runs in that mode"
            )
    for row in matrix.values():
        if row.status == CRASHED:
            return "crash", f"mode {row.mode} ({MODES[row.mode].what}): {cls_name} raised {row.message}"
    for row in matrix.values():
        if row.required and row.status != SUPPORTED:
            return "modes", (
                f"mode {row.mode} is required (--require-mode {row.mode}) but {row.status}: "
                f"{row.message or MODES[row.mode].what}"
            )
    return None
