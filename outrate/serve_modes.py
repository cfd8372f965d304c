"""``outrate serve``: engine modes the feature refuses, found in its arguments before vLLM starts.

With the feature on, the scheduler refuses at start-up the engine modes its accounting does
not cover (``reference.engine_checks.unsupported_modes``; docs/OPERATING.md "Mode matrix").
``refuse_unsupported_modes`` reads, from the arguments ``outrate serve`` passes to ``vllm
serve``, the flags that decide one of those modes with certainty (``MODE_FLAGS``): vLLM's
parser keeps a flag's last value, over a ``--config`` file too, so what is read here is what
the engine gets. It sets the attributes those checks read on a stand-in configuration and
calls the same function, so the reason (``UNSUPPORTED_WHY``) and the fix are the scheduler's
own; only the flag is named as typed. ``outrate serve`` (``--print-command`` included) then
stops with one ``Error:`` line, before vLLM is imported.

Left to the engine's own check (``outrate/serve_run.py`` reports its refusal as one line):
anything set in a ``--config`` file or through an abbreviated flag, the model's kind
(multimodal, hybrid, ...: its config decides), ``--aux-output-config``, ``--convert``, and
``--prefill-schedule-interval`` > 1 without data parallel (refused or not by the installed
vLLM release, which this module does not import).

Source: docs/SPEC.md "Configuration" and docs/MODES.md (the modes and their checks).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import click

from vllm_output_rate.reference.engine_checks import UNSUPPORTED_WHY, unsupported_modes
from vllm_output_rate.reference.section import SECTION


def _int(text: str | None) -> int:
    """An integer flag's value (``ValueError`` when vLLM's parser would refuse it)."""
    return int(str(text))


def _optional_float(text: str | None) -> float | None:
    """A float flag that vLLM reads as None from ``""`` or ``"None"``."""
    return None if text in ("", "None") else float(str(text))


def _optional_json(text: str | None) -> SimpleNamespace | None:
    """A JSON config flag (None from ``""``, ``"None"`` or ``null``, as vLLM reads it); an
    object's keys become attributes (the checks read e.g. ``kv_connector``).

    Raises:
        ValueError: not JSON, or JSON that is neither null nor an object (vLLM refuses it).
    """
    if text in ("", "None"):
        return None
    value = json.loads(str(text))
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return SimpleNamespace(**{str(key): item for key, item in value.items()})


def _text(text: str | None) -> str | None:
    """A string flag (None from ``""`` or ``"None"``, as vLLM's optional flags read it)."""
    return None if text in ("", "None") else text


@dataclass(frozen=True)
class ModeFlag:
    """A ``vllm serve`` flag that decides one attribute ``unsupported_modes`` reads.

    ``spellings``: the flag and its aliases (one argparse destination; a switch also lists
    its ``--no-`` form, which sets it False). ``mode``: the ``UNSUPPORTED_WHY`` mode it can
    turn on. ``owner`` / ``attribute``: where the checks read it (``owner`` None: on the
    configuration itself). ``parse``: the value from the typed text (None for a switch);
    ``ValueError`` when the text decides nothing here (vLLM's parser refuses it).
    ``named``: the flag the scheduler's fix names (replaced by the one typed).
    ``dotted``: vLLM also takes ``--flag.key value`` (a JSON config's keys).
    """

    spellings: tuple[str, ...]
    mode: str
    owner: str | None
    attribute: str
    parse: Callable[[str | None], Any] | None = None
    named: str | None = None
    dotted: bool = False

    @property
    def switch(self) -> bool:
        """A flag without a value (``--x`` / ``--no-x``)."""
        return self.parse is None


DATA_PARALLEL = ModeFlag(
    ("--data-parallel-size", "-dp"), "data parallel > 1", "parallel_config", "data_parallel_size", _int
)
MODE_FLAGS = (
    DATA_PARALLEL,
    ModeFlag(
        ("--pipeline-parallel-size", "-pp"), "pipeline parallel > 1", "parallel_config", "pipeline_parallel_size", _int
    ),
    ModeFlag(
        ("--speculative-config", "-sc"), "speculative decoding", None, "speculative_config", _optional_json, dotted=True
    ),
    ModeFlag(("--spec-method",), "speculative decoding", None, "speculative_config", _text, "--speculative-config"),
    ModeFlag(("--spec-model",), "speculative decoding", None, "speculative_config", _text, "--speculative-config"),
    ModeFlag(("--spec-tokens",), "speculative decoding", None, "speculative_config", _int, "--speculative-config"),
    ModeFlag(("--kv-offloading-size",), "KV offload", "cache_config", "kv_offloading_size", _optional_float),
    ModeFlag(("--kv-transfer-config",), "KV connector", None, "kv_transfer_config", _optional_json, dotted=True),
    ModeFlag(("--ec-transfer-config",), "EC connector", None, "ec_transfer_config", _optional_json, dotted=True),
    ModeFlag(
        ("--enable-return-routed-experts", "--no-enable-return-routed-experts"),
        "aux output connector",
        "aux_output_config",
        "enabled",
    ),
    ModeFlag(("--enable-sleep-mode", "--no-enable-sleep-mode"), "sleep mode", "model_config", "enable_sleep_mode"),
    ModeFlag(("--runner",), "pooling model", "model_config", "runner_type", _text),
    ModeFlag(
        ("--cache-aware-admission-window",),
        "cache-aware admission",
        "scheduler_config",
        "cache_aware_admission_window",
        _int,
    ),
    ModeFlag(
        ("--prefill-schedule-interval",),
        "local prefill cadence",
        "scheduler_config",
        "prefill_schedule_interval",
        _int,
    ),
)
# Without data parallel, whether the interval is refused depends on the installed vLLM
# (engine_checks._local_prefill_cadence imports it to read its version): the engine decides.
_ONLY_WITH_DATA_PARALLEL = "local prefill cadence"


@dataclass(frozen=True)
class _Given:
    """One flag of ``MODE_FLAGS`` as given: its ``ModeFlag``, the name and the text typed
    (``shown``, quoted for a shell), the value text, and the JSON key of a dotted form."""

    flag: ModeFlag
    name: str
    shown: str
    text: str | None
    key: str | None = None


def _normalized(name: str) -> str:
    """A flag name as vLLM's parser reads it: ``_`` -> ``-`` before the first ``.``."""
    if not name.startswith("--"):
        return name
    head, dot, rest = name.partition(".")
    return head.replace("_", "-") + dot + rest


def _find(name: str) -> tuple[ModeFlag, str | None] | None:
    """The ``ModeFlag`` a typed flag ``name`` is (and the key of a dotted form), or None."""
    normal = _normalized(name)
    head, _, key = normal.partition(".")
    for flag in MODE_FLAGS:
        if normal in flag.spellings:
            return flag, None
        if key and flag.dotted and head in flag.spellings:
            return flag, key
    return None


def given_mode_flags(args: list[str]) -> list[_Given]:
    """Every flag of ``MODE_FLAGS`` in ``args`` (the arguments for ``vllm serve``), in order."""
    found: list[_Given] = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        match = _find(name)
        if match is None:
            continue
        flag, key = match
        if flag.switch:
            if not eq:  # a switch takes no value: vLLM's parser refuses --switch=VALUE
                found.append(_Given(flag, name, arg, None))
        elif eq:
            found.append(_Given(flag, name, shlex.quote(arg), value, key))
        elif i + 1 < len(args) and not _is_option(args[i + 1]):
            found.append(_Given(flag, name, shlex.join([arg, args[i + 1]]), args[i + 1], key))
    return found


def _is_option(text: str) -> bool:
    """``text`` is an option, not a value, for argparse: it starts with ``-`` and is not a
    negative number (vLLM's parser then refuses the flag before it for want of a value)."""
    if not text.startswith("-"):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _value(given: _Given) -> Any:
    """The attribute's value from one ``_Given`` (``ValueError``: decided by vLLM's parser)."""
    if given.flag.switch:
        return not _normalized(given.name).startswith("--no-")
    if given.key is not None:  # vLLM merges --flag.key values into one JSON object
        return SimpleNamespace(**{given.key: given.text})
    assert given.flag.parse is not None
    return given.flag.parse(given.text)


def stand_in_config(section: dict[str, Any], args: list[str]) -> tuple[SimpleNamespace, dict[str, _Given]]:
    """The engine configuration, as far as ``args`` decide it, for ``unsupported_modes``; and,
    per mode, the flag that turned it on.

    ``section``: the ``output_rate`` section (its ``shared_budget_url`` lets data parallel
    run). As in vLLM: a flag keeps its last value, a dotted form of a JSON flag is applied
    after every plain one, and an attribute two flags set (``--speculative-config``,
    ``--spec-method``) is on when either turns it on. A value vLLM's parser would refuse
    decides nothing here.
    """
    plain: dict[ModeFlag, tuple[Any, _Given]] = {}
    dotted: dict[ModeFlag, tuple[Any, _Given]] = {}
    for given in given_mode_flags(args):
        try:
            value = _value(given)
        except ValueError:
            continue
        (plain if given.key is None else dotted)[given.flag] = (value, given)
    last = {**plain, **dotted}
    data_parallel = last.get(DATA_PARALLEL, (1, None))[0] > 1
    config = SimpleNamespace(additional_config={SECTION: section})
    turned_on: dict[str, _Given] = {}
    for flag, (value, given) in last.items():
        if value is None or (flag.mode == _ONLY_WITH_DATA_PARALLEL and not data_parallel):
            continue
        part = config if flag.owner is None else config.__dict__.setdefault(flag.owner, SimpleNamespace())
        setattr(part, flag.attribute, value)
        turned_on[flag.mode] = given
    return config, turned_on


def refuse_unsupported_modes(section: dict[str, Any] | None, args: list[str]) -> None:
    """Stop ``outrate serve`` when ``args`` turn on an engine mode the scheduler would refuse.

    ``section``: the ``output_rate`` section (None: feature off, nothing is checked, R18).

    Raises:
        click.UsageError: one line naming, per mode found, the flag and value as typed, the
            scheduler's reason (``UNSUPPORTED_WHY``) and its fix (in the flag as typed).
    """
    if section is None:
        return
    config, turned_on = stand_in_config(section, args)
    parts = []
    for mode, fix in unsupported_modes(config):
        given = turned_on.get(mode)
        if given is None:  # not from these arguments: the engine's check names it
            continue
        fix = fix.replace(given.flag.named or given.flag.spellings[0], given.name)
        parts.append(
            f"{given.shown}: {mode} is not supported with per-user output-rate limiting ({UNSUPPORTED_WHY[mode]}); {fix}"
        )
    if parts:
        raise click.UsageError("; also ".join(parts))
