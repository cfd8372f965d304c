"""A saved step scenario's JSON (``adapter/fidelity.StepScenario``, ``outrate replay``),
validated before anything runs: its ``config`` (``config_from_json``) and each of its
``events`` (``event_from_json``), a bad value a ``ScenarioFileError`` naming the field and
the value (``adapter/scenario_file.py``).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from fractions import Fraction
from typing import Any

from vllm_output_rate.adapter.scenario_file import (
    ScenarioFileError,
    bad_value,
    checked_object,
    checked_rate,
    checked_user_id,
)
from vllm_output_rate.spec.events import Abort, AddRequest, AdvanceClock, ChangeRates, Drain, Event, Step
from vllm_output_rate.spec.state import EngineConfig


def frac_out(value: Fraction | None) -> str | None:
    return None if value is None else str(value)


def _frac_in(value: str | None) -> Fraction | None:
    return None if value is None else Fraction(value)


EVENT_KINDS = {cls.__name__: cls for cls in (AddRequest, Abort, AdvanceClock, Step, Drain, ChangeRates)}
# JSON type of a field by its annotation: (Python type, null allowed, what the message asks for).
_JSON_TYPES: dict[str, tuple[type, bool, str]] = {
    "int": (int, False, "an integer"),
    "int | None": (int, True, "an integer or null"),
    "bool": (bool, False, "true or false"),
    "str": (str, False, "a string"),
}


def _typed(cls: type, data: dict[str, Any], where: str) -> None:
    """Check the JSON type of each plain field of dataclass ``cls`` given in ``data``
    (int, optional int, bool, str: by annotation); ``ScenarioFileError`` naming it."""
    for f in fields(cls):
        spec_type = _JSON_TYPES.get(str(f.type))
        if spec_type is None or f.name not in data:
            continue
        want, optional, what = spec_type
        value = data[f.name]
        plain_int = want is not int or not isinstance(value, bool)
        if not ((value is None and optional) or (isinstance(value, want) and plain_int)):
            raise bad_value(f"{where}.{f.name}", value, f"must be {what}")


def _rate_pairs(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """A list of ``[user, rate]`` pairs, each user id (R17) and rate checked."""
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise bad_value(where, value, 'must be a list of [user, rate] pairs, e.g. [["a", "5"]]')
    return tuple(
        (checked_user_id(u, f"{where}[{i}][0]"), checked_rate(r, f"{where}[{i}][1]", ratio_ok=True))
        for i, (u, r) in enumerate(value)
    )


def config_from_json(value: Any) -> EngineConfig:
    """The ``config`` object of a saved step scenario, validated (``StepScenario.from_json``)."""
    config = checked_object(value, "config", tuple(f.name for f in fields(EngineConfig)), required=())
    _typed(EngineConfig, config, "config")
    default = config.get("default_rate_tokens_per_s")
    if default is not None:
        config["default_rate_tokens_per_s"] = Fraction(checked_rate(default, "config.default_rate_tokens_per_s", True))
    pairs = _rate_pairs(config.get("user_rates_tokens_per_s", []), "config.user_rates_tokens_per_s")
    config["user_rates_tokens_per_s"] = tuple((u, Fraction(r)) for u, r in pairs)
    try:
        return EngineConfig(**config)
    except AssertionError as exc:
        raise ScenarioFileError(f"config: {str(exc) or 'a value out of range'}") from None


def event_from_json(value: Any, where: str) -> Event:
    """One object of a saved step scenario's ``events``, validated: its ``type`` one of
    ``EVENT_KINDS``, its fields known, typed and in range, user ids and rates checked."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in EVENT_KINDS:
        raise bad_value(f"{where}.type", kind, f"must be one of {', '.join(EVENT_KINDS)}")
    cls = EVENT_KINDS[kind]
    names = tuple(f.name for f in fields(cls))
    needed = tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
    data = checked_object(value, where, ("type", *names), required=("type", *needed))
    del data["type"]
    _typed(cls, data, where)
    if cls is AddRequest and "user" in data:
        checked_user_id(data["user"], f"{where}.user")
    if cls is ChangeRates:
        data["default_rate_tokens_per_s"] = checked_rate(
            data["default_rate_tokens_per_s"], f"{where}.default_rate_tokens_per_s", ratio_ok=True
        )
        data["user_rates_tokens_per_s"] = _rate_pairs(
            data.get("user_rates_tokens_per_s", []), f"{where}.user_rates_tokens_per_s"
        )
    try:
        return cls(**data)
    except AssertionError as exc:
        raise ScenarioFileError(f"{where} ({kind}): {str(exc) or 'a value out of range'}") from None
