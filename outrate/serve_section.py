"""``outrate serve``'s flags -> the ``output_rate`` section of vLLM's ``additional_config``.

The flags (``FLAG_*``; docs/SPEC.md "Configuration") and their keys (``FLAG_OF_KEY``); rates
as the operator typed them (``1e400`` quoted as ``1e400``, exact, within
``reference.scales.parse_rate``'s bounds); the checks that need no vLLM (A and C <= M,
every flag that needs a default rate); and ``build_output_rate_section``, which ends with
the scheduler's own parser (``reference.config.parse_output_rate``): what passes here
starts. Every refusal is a ``click.UsageError`` saying what to change. ``outrate/serve.py``
builds the vLLM command around the section.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal, InvalidOperation
from typing import Any, NoReturn

import click

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.scales import MAX_RATE_TOKENS_PER_S, parse_rate
from vllm_output_rate.reference.section import OutputRateConfigError, check_override_user, loads_no_duplicates

FLAG_DEFAULT = "--default-user-output-tokens-per-second"
FLAG_USERS = "--user-output-tokens-per-second"
FLAG_TRACE = "--trace-path"
FLAG_BURST = "--burst-ms"
FLAG_PER_USER = "--max-num-seqs-per-user"
FLAG_SHADOW = "--shadow"
FLAG_RATES_FILE = "--rates-file"
FLAG_SHARED_BUDGET = "--shared-budget-url"
FLAG_IDENTITY = "--identity"
FLAG_KEYS_FILE = "--keys-file"
FLAG_ON_CLAIM = "--identity-on-claim"
FLAG_ON_MISSING = "--identity-on-missing"
# The flag of each output_rate key (the message when a key comes in --additional-config).
FLAG_OF_KEY = {
    "default_tokens_per_s": FLAG_DEFAULT,
    "user_tokens_per_s": FLAG_USERS,
    "max_num_active_seqs": "--max-num-active-seqs",
    "burst_ms": FLAG_BURST,
    "trace_path": FLAG_TRACE,
    "max_num_seqs_per_user": FLAG_PER_USER,
    "shadow": FLAG_SHADOW,
    "rates_file": FLAG_RATES_FILE,
    "shared_budget_url": FLAG_SHARED_BUDGET,
    "identity": FLAG_IDENTITY,
    "keys_file": FLAG_KEYS_FILE,
    "identity_on_claim": FLAG_ON_CLAIM,
    "identity_on_missing": FLAG_ON_MISSING,
}


def _parse_default_rate(text: str) -> int | float:
    """The default rate as typed (``text``) -> the JSON number of ``default_tokens_per_s``.

    Raises:
        click.UsageError: see ``_rate_as_typed``.
    """
    return _rate_as_typed(text, FLAG_DEFAULT, f"{FLAG_DEFAULT} 100 or 2.5")


def _rate_as_typed(text: str, name: str, example: str) -> int | float:
    """A rate the operator typed (``text``) -> its JSON number (an int when whole).

    Raises:
        click.UsageError: not a positive finite number of tokens/s within
            ``reference.scales.parse_rate``'s bounds; the message names ``name``, quotes
            ``text`` as typed (``1e400`` stays ``1e400``, not ``inf``), says why, and ends
            with ``example``.
    """
    try:
        number = Decimal(text.strip())
    except InvalidOperation:
        number = None
    if number is None:
        reason = "is not a number"
    elif not number.is_finite():
        reason = "is not finite"
    elif number <= 0:
        reason = "must be > 0"
    elif number > MAX_RATE_TOKENS_PER_S:
        reason = f"must be <= {MAX_RATE_TOKENS_PER_S}"
    else:
        try:
            parse_rate(number, name)
            return int(number) if number == number.to_integral_value() else float(number)
        except ValueError:
            reason = "may have at most 9 decimal places"
    raise click.UsageError(
        f"{name} {reason}, got {text!r}; a rate must be a positive finite number of tokens/s, e.g. {example}"
    )


class _Typed:
    """A JSON number as the operator typed it (``1e400`` stays ``1e400``, ``Infinity``
    stays ``Infinity``); its repr is that text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_user_rates(text: str) -> dict[str, Any]:
    """The per-user overrides as typed (``text``, a JSON object) -> ``user_tokens_per_s``.

    Raises:
        click.UsageError: not JSON, not an object, a key given twice, a key that is no
            valid user id (R17), a bad rate (quoted as typed).
    """
    try:
        value = loads_no_duplicates(text, FLAG_USERS, number_hook=_Typed)
    except OutputRateConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise click.UsageError(
            f"{FLAG_USERS} is not valid JSON ({exc.msg} at character {exc.pos}): {text!r}; "
            f"""give a JSON object of user -> tokens/s, e.g. {FLAG_USERS} '{{"user-a": 100, "user-b": 500}}'"""
        ) from None
    if not isinstance(value, dict):
        raise click.UsageError(
            f"""{FLAG_USERS} must be a JSON object of user -> tokens/s, e.g. '{{"user-a": 100}}', got {text!r}"""
        )
    rates: dict[str, Any] = {}
    for user, rate in value.items():
        try:
            check_override_user(user, FLAG_USERS)  # R17: a key no request can name never matches
        except OutputRateConfigError as exc:
            raise click.UsageError(str(exc)) from None
        name = f"{FLAG_USERS} rate of user {user!r}"
        if isinstance(rate, _Typed):
            rates[user] = _rate_as_typed(rate.text, name, f"""{FLAG_USERS} '{{"user-a": 100}}'""")
            continue
        try:
            rates[user] = parse_rate(rate, name)  # a string, true, null, a list: refused, naming the type
        except ValueError as exc:
            raise click.UsageError(f"{exc}; give a positive number of tokens per second") from None
    return rates


def _check_caps(max_num_seqs: int | None, max_num_active_seqs: int | None, max_num_seqs_per_user: int | None) -> None:
    """``click.UsageError`` if the active cap A or the per-user cap (R20) is above M
    (``--max-num-seqs``), naming the flags to change."""
    if max_num_seqs is not None and max_num_active_seqs is not None and max_num_active_seqs > max_num_seqs:
        raise click.UsageError(
            f"--max-num-active-seqs ({max_num_active_seqs}) must be <= --max-num-seqs ({max_num_seqs}): "
            "lower --max-num-active-seqs or raise --max-num-seqs"
        )
    if max_num_seqs is not None and max_num_seqs_per_user is not None and max_num_seqs_per_user > max_num_seqs:
        raise click.UsageError(  # R20: a cap above M never binds
            f"{FLAG_PER_USER} ({max_num_seqs_per_user}) must be <= --max-num-seqs ({max_num_seqs}): "
            f"lower {FLAG_PER_USER} or raise --max-num-seqs"
        )


def _refuse_without_default(
    *,
    user_rates: str | None,
    burst_ms: int | None,
    trace_path: str | None,
    max_num_seqs_per_user: int | None,
    shadow: bool,
    rates_file: str | None,
    shared_budget_url: str | None,
    identity: dict[str, Any] | None = None,
) -> NoReturn:
    """No ``--default-rate``: ``click.UsageError`` naming the first flag that needs it, or
    saying that the feature would be off."""
    for flag, value in (
        (FLAG_USERS, user_rates),
        (FLAG_BURST, burst_ms),
        (FLAG_TRACE, trace_path),
        (FLAG_PER_USER, max_num_seqs_per_user),
        (FLAG_SHADOW, True if shadow else None),
        (FLAG_RATES_FILE, rates_file),
        (FLAG_SHARED_BUDGET, shared_budget_url),
        *((FLAG_OF_KEY[key], value) for key, value in (identity or {}).items()),
    ):
        if value is not None:
            raise click.UsageError(
                f"{flag} needs {FLAG_DEFAULT}: the default rate turns the feature on "
                f"(add e.g. {FLAG_DEFAULT} 100, or drop {flag})"
            )
    # R18 / Configuration: outrate serve is for the feature; starting stock vLLM without a
    # word would hide a forgotten flag.
    raise click.UsageError(
        f"no {FLAG_DEFAULT}: the output-rate feature would be off and the server would limit nobody; "
        f"add e.g. {FLAG_DEFAULT} 100 (every user not listed in {FLAG_USERS} gets it), "
        "or start plain `vllm serve` for a server without limits"
    )


def build_output_rate_section(
    default_rate: str | None,
    user_rates: str | None,
    max_num_seqs: int | None,
    max_num_active_seqs: int | None,
    trace_path: str | None = None,
    burst_ms: int | None = None,
    max_num_seqs_per_user: int | None = None,
    shadow: bool = False,
    rates_file: str | None = None,
    shared_budget_url: str | None = None,
    identity: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``output_rate`` section for these flags.

    Raises:
        click.UsageError: bad rate or JSON (a key given twice included), overrides, a burst
            or a trace path without a default, A > M, no default rate at all.
    """
    _check_caps(max_num_seqs, max_num_active_seqs, max_num_seqs_per_user)
    if default_rate is None:
        _refuse_without_default(
            user_rates=user_rates,
            burst_ms=burst_ms,
            trace_path=trace_path,
            max_num_seqs_per_user=max_num_seqs_per_user,
            shadow=shadow,
            rates_file=rates_file,
            shared_budget_url=shared_budget_url,
            identity=identity,
        )
    section: dict[str, Any] = {"default_tokens_per_s": _parse_default_rate(default_rate)}
    if user_rates is not None:
        section["user_tokens_per_s"] = _parse_user_rates(user_rates)
    if max_num_active_seqs is not None:
        section["max_num_active_seqs"] = max_num_active_seqs
    if burst_ms is not None:
        section["burst_ms"] = burst_ms
    if max_num_seqs_per_user is not None:
        section["max_num_seqs_per_user"] = max_num_seqs_per_user  # R20
    if shadow:
        section["shadow"] = True  # Decision "Shadow mode"
    if trace_path is not None:
        # Absolute: the engine-core process opens it, and a reader should find the same file.
        section["trace_path"] = os.path.abspath(trace_path) if trace_path.strip() else trace_path
    if rates_file is not None:  # R21; absolute, like the trace: the engine-core process opens it
        section["rates_file"] = os.path.abspath(rates_file) if rates_file.strip() else rates_file
    if shared_budget_url is not None:  # R23-R26
        section["shared_budget_url"] = shared_budget_url
    section.update(_identity_keys(identity))
    try:
        parse_output_rate(section)  # the scheduler's own parser: what passes here starts
    except OutputRateConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return section


def _identity_keys(identity: dict[str, Any] | None) -> dict[str, Any]:
    """R30-R32: the ``output_rate`` identity keys given (``{key: value}``), the keys file
    made absolute (the API server and the engine core open it)."""
    keys = {key: value for key, value in (identity or {}).items() if value is not None}
    if isinstance(keys.get("keys_file"), str) and keys["keys_file"].strip():
        keys["keys_file"] = os.path.abspath(keys["keys_file"])
    return keys
