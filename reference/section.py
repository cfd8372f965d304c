"""The ``output_rate`` section's value and vocabulary, shared by every reader of an operator file.

``OutputRateConfig`` (the validated section) and ``OutputRateConfigError`` (a bad section,
rates file or keys file; the message says what to change), the section's key names
(``KNOWN_KEYS``, ``SECTION``), strict JSON reading (``loads_no_duplicates``: a key given
twice is refused; ``nearest_key``: a misspelt key is named with the nearest known one) and
the check of a user id given as a key (``check_override_user``, R17).

Parsing the section lives in ``reference/config.py``; the rates file (R21,
``reference/ratesfile.py``), the rate table (R27-R29, ``reference/ratetable.py``) and the
keys file (R30, ``reference/keysfile.py``) read their files with the helpers here, so this
module imports nothing of reference/ but ``identity``.

Source: docs/SPEC.md "Configuration".
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.identity import MAX_USER_ID_CHARS, USER_KEY, IdentitySettings, is_user_id
from vllm_output_rate.spec.limiter import BURST_NS

KNOWN_KEYS = (
    "default_tokens_per_s",
    "user_tokens_per_s",
    "max_num_active_seqs",
    "burst_ms",
    "trace_path",
    "shadow",
    "max_num_seqs_per_user",
    "rates_file",
    "shared_budget_url",
    "identity",
    "keys_file",
    "identity_on_claim",
    "identity_on_missing",
)
SECTION = "output_rate"  # the key of vLLM's additional_config that holds the section


class OutputRateConfigError(ValueError):
    """A bad ``output_rate`` configuration; the message says what to change."""


@dataclass(frozen=True)
class OutputRateConfig:
    """Validated feature configuration. ``default_rate`` None means the feature is off."""

    default_rate: Fraction | None = None
    user_rates: Mapping[str, Fraction | None] = field(default_factory=dict)  # None: unlimited (R28)
    max_num_active_seqs: int | None = None
    burst_ns: int = BURST_NS
    trace_path: str | None = None
    max_num_seqs_per_user: int | None = None  # R20: resident requests per user; None: no cap
    shadow: bool = False  # count and report would-be throttles, throttle nothing (Decision "Shadow mode")
    rates_file: str | None = None  # R21: watched JSON rate table (reference/ratesfile.py); None: off
    shared_budget_url: str | None = None  # R23-R26: the store shared by engines (Redis/Valkey); None: off
    identity: IdentitySettings = field(default_factory=IdentitySettings)  # R30-R32: where the user comes from
    # R27-R29: the rates file's table (plans, patterns, unlimited, per-plan shadow); None: the two keys above
    rate_table: Any = None

    @property
    def enabled(self) -> bool:
        return self.default_rate is not None


def _shown_user(user: object) -> str:
    """``repr(user)`` for a message, cut to 60 characters (ids may be 256 long)."""
    text = repr(user)
    return text if len(text) <= 60 else f"{text[:57]}..."


def check_override_user(user: object, where: str = "user_tokens_per_s") -> str:
    """R17 (reference/identity.py): ``user``, a key of the per-user overrides, if a request
    can name it: a non-empty ``str`` of at most ``MAX_USER_ID_CHARS`` (256) characters. A
    longer key could never match (such a request is refused with HTTP 400).

    Raises:
        OutputRateConfigError: naming ``where``, the key (shortened for display), its
            length and the limit.
    """
    if is_user_id(user):
        return user
    too_long = isinstance(user, str) and len(user) > MAX_USER_ID_CHARS
    length = f" ({len(user)} characters)" if isinstance(user, str) and too_long else ""
    raise OutputRateConfigError(
        f"user ids in {where} must be non-empty strings of at most {MAX_USER_ID_CHARS} characters "
        f"(what a request can give as vllm_xargs.{USER_KEY}), got {_shown_user(user)}{length}; "
        + ("shorten that key or remove it" if too_long else "name the user or remove that key")
    )


def nearest_key(key: object, known: tuple[str, ...] | list[str], cutoff: float = 0.6) -> str | None:
    """The known key closest to a misspelt ``key`` (difflib), or None if none is close."""
    matches = difflib.get_close_matches(str(key), list(known), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _suggest_keys(unknown: list, known: tuple[str, ...]) -> str:
    """``'default_token_per_s' (did you mean 'default_tokens_per_s'?), 'x'`` for a message."""
    parts = []
    for key in unknown:
        near = nearest_key(key, known)
        parts.append(f"{key!r} (did you mean {near!r}?)" if near else repr(key))
    return ", ".join(parts)


def _no_duplicate_keys(what: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json`` ``object_pairs_hook`` refusing a key given twice in one object of ``what``."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise OutputRateConfigError(
                    f"{what}: key {key!r} is given twice ({result[key]!r} and {value!r}); "
                    "JSON keeps only the last one, so give it once with the value you mean"
                )
            result[key] = value
        return result

    return hook


def loads_no_duplicates(text: str, what: str, number_hook: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(text)`` that refuses duplicate keys (Configuration: typos are caught).

    Plain ``json.loads`` keeps the last of ``{"a": 5, "a": 7}`` silently. ``number_hook``:
    if given, every number's text (``Infinity`` and ``NaN`` too) goes through it, as
    ``json.loads``'s ``parse_float``, ``parse_int`` and ``parse_constant``.

    Raises:
        OutputRateConfigError: a key given twice in one object, naming ``what``, the key
            and both values.
        json.JSONDecodeError: ``text`` is not JSON.
    """
    hook = _no_duplicate_keys(what)
    if number_hook is None:
        return json.loads(text, object_pairs_hook=hook)
    return json.loads(
        text, object_pairs_hook=hook, parse_float=number_hook, parse_int=number_hook, parse_constant=number_hook
    )


def section_duplicates_error(text: str) -> str | None:
    """The duplicate-key message for the ``output_rate`` part of an ``--additional-config`` text.

    Only the ``output_rate`` key itself and the objects inside it are checked (the rest
    of ``additional_config`` belongs to vLLM and other plugins). None: no duplicate, or
    ``text`` is not a JSON object (vLLM's own parser reports that).
    """
    try:
        top = json.loads(text, object_pairs_hook=_Pairs)
    except ValueError:
        return None
    if not isinstance(top, _Pairs):
        return None
    sections = [value for key, value in top if key == SECTION]
    if len(sections) > 1:
        return (
            f'--additional-config: key "{SECTION}" is given twice; JSON keeps only the last one, '
            f'so merge them into one "{SECTION}" object'
        )
    if sections:
        try:
            _rebuild(sections[0], _no_duplicate_keys(f'--additional-config "{SECTION}"'))
        except OutputRateConfigError as exc:
            return str(exc)
    return None


class _Pairs(list):
    """A JSON object decoded as its list of (key, value) pairs, duplicates kept."""


def _rebuild(value: Any, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:
    """``value`` (its objects decoded as ``_Pairs``) with every object rebuilt by
    ``object_pairs_hook``, innermost first, as ``json.loads`` with that hook would have
    decoded it; errors the hook raises propagate."""
    if isinstance(value, _Pairs):
        return object_pairs_hook([(key, _rebuild(item, object_pairs_hook)) for key, item in value])
    if isinstance(value, list):
        return [_rebuild(item, object_pairs_hook) for item in value]
    return value
