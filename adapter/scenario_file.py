"""Checks of a saved scenario's fields (``outrate replay FILE``), shared by the rate-limit
``Scenario`` (``adapter/scenarios.py``) and the step scenario (``adapter/fidelity.py``): a
bad value is a ``ScenarioFileError`` naming the field and the value, and saying what a
valid one is.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.identity import MAX_USER_ID_CHARS, is_user_id
from vllm_output_rate.reference.scales import MAX_RATE_TOKENS_PER_S, parse_rate


class ScenarioFileError(ValueError):
    """A saved scenario (``outrate replay FILE``) that cannot be replayed as written: the
    message names the field (a path such as ``requests[2].user``) and the bad value, and
    says what a valid one is."""


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a 300-character user id stays readable)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}... ({len(text)} characters)"


def bad_value(field_name: str, value: Any, want: str) -> ScenarioFileError:
    """The error for ``value`` of ``field_name``: ``FIELD: WANT, got VALUE``."""
    return ScenarioFileError(f"{field_name}: {want}, got {_shown(value)}")


def checked_user_id(value: Any, field_name: str) -> str:
    """R17 (reference/identity.py): ``value`` if it is a valid user id, a non-empty string
    of at most 256 characters.

    Raises:
        ScenarioFileError: naming ``field_name`` and the value (shortened).
    """
    if not is_user_id(value):
        raise bad_value(
            field_name, value, f"a user id must be a non-empty string of at most {MAX_USER_ID_CHARS} characters"
        )
    return value


def checked_rate(value: Any, field_name: str, ratio_ok: bool = False) -> str:
    """A rate in tokens/s as its exact string: a positive finite decimal (a JSON string
    such as ``"2.5"``, or a JSON number), at most 10**9 tokens/s with at most 9 decimal
    places (``reference.scales.parse_rate``); with ``ratio_ok`` also written ``"p/q"``
    (a step scenario's form: ``"5/2"``), still of at most 9 decimal places.

    Raises:
        ScenarioFileError: naming ``field_name`` and the value.
    """
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    text = value.strip() if isinstance(value, str) else repr(value) if numeric else ""
    try:
        rate = Fraction(text) if text and (ratio_ok or "/" not in text) else None
        if (parse_rate(rate, field_name) * 10**9).denominator != 1:  # "1/3": no exact decimal to configure
            raise ValueError(field_name)
    except (ValueError, ZeroDivisionError):
        raise bad_value(
            field_name,
            value,
            f"a rate must be a positive finite decimal number of tokens/s (at most {MAX_RATE_TOKENS_PER_S}, "
            'at most 9 decimal places), e.g. "10" or "2.5"',
        ) from None
    return text


def checked_int(low: int, optional: bool = False) -> Callable[[Any, str], int | None]:
    """A check of an integer field: an int >= ``low`` (None too if ``optional``)."""

    def check(value: Any, field_name: str) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad_value(field_name, value, f"must be an integer >= {low}" + (" or null" if optional else ""))
        return value

    return check


def checked_bool(value: Any, field_name: str) -> bool:
    """A boolean field: JSON ``true`` or ``false``."""
    if not isinstance(value, bool):
        raise bad_value(field_name, value, "must be true or false")
    return value


def checked_policy(value: Any, field_name: str) -> str:
    """vLLM's scheduling policy, ``"fcfs"`` or ``"priority"``."""
    if value not in ("fcfs", "priority"):
        raise bad_value(field_name, value, 'must be "fcfs" or "priority"')
    return value


def checked_advances(value: Any, field_name: str) -> tuple[int, ...] | None:
    """``advances_ns``: null, or a list of clock advances in ns, each an integer >= 0."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_value(field_name, value, "must be null or a list of integers >= 0 (ns)")
    check = checked_int(0)
    return tuple(int(check(v, f"{field_name}[{i}]") or 0) for i, v in enumerate(value))


def checked_object(value: Any, where: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a dict if it is a JSON object with no key outside ``known`` and every
    key of ``required``; else ``ScenarioFileError`` naming ``where`` and the keys."""
    if not isinstance(value, dict):
        raise bad_value(where, value, "must be a JSON object")
    unknown = sorted(set(value) - set(known), key=str)
    if unknown:
        raise ScenarioFileError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ScenarioFileError(f"{where}: missing key(s) {', '.join(missing)}")
    return dict(value)
