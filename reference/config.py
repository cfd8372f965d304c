"""``additional_config["output_rate"]``: parsing and start-up validation.

Keys (all optional; an empty or missing section means the feature is off, R18):

=============================== ===================================================
``default_tokens_per_s``        rate of every user not listed below; turns it on
``user_tokens_per_s``           ``{"user-a": 100, ...}`` per-user overrides
``max_num_active_seqs``         active cap A (R12); default: vLLM's
                                ``max_num_active_seqs``, else ``max_num_seqs``
``burst_ms``                    burst tolerance tau (R1), default 100
``max_num_seqs_per_user``       R20: resident (running) requests one user may hold,
                                1..``max_num_seqs``; default: no cap (the article's
                                behaviour, docs/SPEC.md Decision R20)
``trace_path``                  file to which the reference scheduler appends one
                                JSON line per ``schedule()`` (the engine-side event
                                trace, ``adapter/trace_check.py``); default: off
``rates_file``                  R21: a JSON file ``{"default_tokens_per_s": ...,
                                "user_tokens_per_s": {...}}`` watched at the start
                                of each ``schedule()``; a change replaces the rate
                                table without a restart (reference/ratesfile.py).
                                Default: off
``shared_budget_url``           R23-R26: ``redis://host:port/db`` (or ``rediss://``,
                                ``unix://``, ``valkey://``): one budget per user
                                across every engine using the same store
                                (reference/shared_budget.py). Default: off
``shadow``                      ``true``: shadow mode (docs/SPEC.md, Decision
                                "Shadow mode"): the limiter counts and reports what
                                it would throttle, and throttles nothing; the
                                schedule is the base class's, step for step.
                                Default ``false``
``identity``                    R30-R32: where the user comes from: ``"body"``
                                (default, R17), ``"header:NAME"`` (a gateway's
                                header) or ``"api-key"`` (the bearer token's user
                                in ``keys_file``); ``identity_on_claim``
                                (``"refuse"``/``"overwrite"``) and
                                ``identity_on_missing`` (``"refuse"``/
                                ``"anonymous"``). reference/identity_middleware.py
=============================== ===================================================

The engine configuration's start-up checks (unsupported modes, caps against
``max_num_seqs``) are ``reference/engine_checks.py``.

Source: docs/SPEC.md "Configuration" (keys, flags and the start-up checks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.identity import IdentitySettings, parse_identity
from vllm_output_rate.reference.keysfile import KeysFileWatcher
from vllm_output_rate.reference.ratesfile import RatesFileWatcher
from vllm_output_rate.reference.scales import parse_rate
from vllm_output_rate.reference.section import (
    KNOWN_KEYS,
    OutputRateConfig,
    OutputRateConfigError,
    _shown_user,
    _suggest_keys,
    check_override_user,
)
from vllm_output_rate.spec.limiter import BURST_NS


def _parse_rates(section: Mapping[str, Any]) -> tuple[Fraction, dict[str, Fraction]]:
    """The default rate and the per-user overrides (tokens/s, exact) of an output_rate section.

    Raises:
        OutputRateConfigError: no default, overrides not an object, a bad user id or rate
            (naming it).
    """
    overrides = section.get("user_tokens_per_s")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise OutputRateConfigError(f"user_tokens_per_s must be a JSON object of user -> tokens/s, got {overrides!r}")
    default = section.get("default_tokens_per_s")
    if default is None:
        raise OutputRateConfigError(
            "output_rate is configured without default_tokens_per_s "
            "(--default-user-output-tokens-per-second): set a default rate to turn the feature on, "
            "or remove the output_rate section"
        )
    try:
        default_rate = parse_rate(default, "default_tokens_per_s")
        user_rates: dict[str, Fraction] = {}
        for user, rate in overrides.items():
            check_override_user(user)
            user_rates[user] = parse_rate(rate, f"user_tokens_per_s[{_shown_user(user)}]")
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    return default_rate, user_rates


def _check_section_shape(section: Any) -> None:
    """R18: a given ``output_rate`` section (not None) is a non-empty JSON object of
    ``KNOWN_KEYS`` only.

    Raises:
        OutputRateConfigError: an empty section (the feature meant on, no rate), not an
            object, or unknown keys (naming them, with the nearest known key).
    """
    if section == {}:
        # An explicit, empty section given to a class that implements it: the operator meant
        # to turn the feature on and gave no rate (R18: "off" is no section at all).
        raise OutputRateConfigError(
            'additional_config["output_rate"] is empty: set default_tokens_per_s '
            "(--default-user-output-tokens-per-second) to turn the feature on, or remove the output_rate "
            "section to turn it off"
        )
    if not isinstance(section, Mapping):
        raise OutputRateConfigError(f'additional_config["output_rate"] must be a JSON object, got {section!r}')
    unknown = sorted(set(section) - set(KNOWN_KEYS), key=str)
    if unknown:
        raise OutputRateConfigError(
            f'unknown key(s) in additional_config["output_rate"]: {_suggest_keys(unknown, KNOWN_KEYS)}; '
            f"known keys: {', '.join(KNOWN_KEYS)}"
        )


def parse_output_rate(section: Any) -> OutputRateConfig:
    """Parse and validate ``additional_config["output_rate"]``.

    ``None`` (no section) is the feature off (R18).

    Raises:
        OutputRateConfigError: an empty section, unknown keys, bad rates (naming the user and
            value), overrides without a default, a bad active cap or burst.
    """
    if section is None:
        return OutputRateConfig()
    _check_section_shape(section)
    default_rate, user_rates = _parse_rates(section)
    active = section.get("max_num_active_seqs")
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise OutputRateConfigError(f"max_num_active_seqs must be an integer >= 1, got {active!r}")
    burst_ms = section.get("burst_ms", BURST_NS // 1_000_000)
    if isinstance(burst_ms, bool) or not isinstance(burst_ms, int) or burst_ms < 1:
        raise OutputRateConfigError(
            f"burst_ms must be an integer number of milliseconds >= 1, got {burst_ms!r}; "
            "set --burst-ms / output_rate.burst_ms to e.g. 100 (the default), or remove it"
        )
    trace_path = section.get("trace_path")
    if trace_path is not None and (not isinstance(trace_path, str) or not trace_path.strip()):
        raise OutputRateConfigError(
            f"trace_path must be a non-empty string naming the file the engine-side event trace is "
            f'appended to, e.g. "/tmp/outrate-trace.jsonl", got {trace_path!r}; remove it to turn tracing off'
        )
    if trace_path is not None:
        _check_trace_path(trace_path)
    shadow = section.get("shadow", False)
    if not isinstance(shadow, bool):
        raise OutputRateConfigError(
            f"shadow must be true or false (a JSON boolean: true counts and reports what would be throttled "
            f"and throttles nothing), got {shadow!r}"
        )
    per_user = section.get("max_num_seqs_per_user")
    if per_user is not None and (isinstance(per_user, bool) or not isinstance(per_user, int) or per_user < 1):
        raise OutputRateConfigError(
            f"max_num_seqs_per_user (--max-num-seqs-per-user) must be an integer >= 1 (resident requests one "
            f"user may hold), got {per_user!r}; remove it for no per-user cap"
        )
    config = OutputRateConfig(default_rate, user_rates, active, burst_ms * 1_000_000, trace_path, shadow=shadow)
    config = replace(config, max_num_seqs_per_user=per_user) if per_user is not None else config
    rates_file = section.get("rates_file")
    if rates_file is not None:
        config = _with_rates_file(config, rates_file)
    url = section.get("shared_budget_url")
    if url is not None:
        config = replace(config, shared_budget_url=check_shared_budget_url(url))
        if config.rate_table is not None and not config.rate_table.is_flat:
            raise OutputRateConfigError(
                f"rates file {rates_file}: plans, patterns and unlimited users (R27-R29) are not supported with "
                "shared_budget_url (the store keeps one rate per user); write default_tokens_per_s and "
                "user_tokens_per_s only, or remove shared_budget_url"
            )
    return _with_identity(config, section)


IDENTITY_KEYS = ("identity", "keys_file", "identity_on_claim", "identity_on_missing")


def _with_identity(config: OutputRateConfig, section: Mapping[str, Any]) -> OutputRateConfig:
    """``config`` with the section's identity settings (R30-R32), if it gives any."""
    if all(section.get(key) is None for key in IDENTITY_KEYS):
        return config
    return replace(config, identity=parse_identity_section(section))


def parse_identity_section(section: Mapping[str, Any]) -> IdentitySettings:
    """R30-R32: the identity settings of an ``output_rate`` section; with ``"api-key"`` the
    keys file is read and checked now (reference/keysfile.py).

    Raises:
        OutputRateConfigError: a bad identity value, or a missing or bad keys file,
            naming the key or the entry and what to change.
    """
    try:
        settings = parse_identity(*(section.get(key) for key in IDENTITY_KEYS))
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    if settings.keys_file is not None:
        KeysFileWatcher(settings.keys_file, logging.getLogger("vllm.output_rate")).load_initial()
    return settings


SHARED_BUDGET_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://")


def check_shared_budget_url(url: Any) -> str:
    """R23-R26: ``shared_budget_url``, the store all engines share each user's budget
    through (docs/SPEC.md, "Multi-engine shared budget").

    Raises:
        OutputRateConfigError: not a string with one of ``SHARED_BUDGET_SCHEMES`` and a host
            or socket path, naming the value.
    """
    if not isinstance(url, str) or not url.startswith(SHARED_BUDGET_SCHEMES) or len(url.split("://", 1)[1]) == 0:
        raise OutputRateConfigError(
            f"shared_budget_url must be the URL of the Redis or Valkey server the engines share budgets through, "
            f'e.g. "redis://127.0.0.1:6379/0" (schemes: {", ".join(SHARED_BUDGET_SCHEMES)}), got {url!r}; '
            "remove it for a budget per engine"
        )
    return url


def _check_trace_path(trace_path: str) -> None:
    """Refuse a ``trace_path`` the engine could not append to, before vLLM starts.

    Missing parent directories are created when the trace opens (``reference/trace.py``);
    refused here: the path is a directory, a parent component is an existing non-directory,
    or the nearest existing parent is not writable.

    Raises:
        OutputRateConfigError: naming the path, the offending component and what to change.
    """
    path = os.path.abspath(trace_path)
    fix = "choose another --trace-path / output_rate.trace_path, or remove it to turn tracing off"
    if os.path.isdir(path):
        raise OutputRateConfigError(f"trace_path {trace_path!r} is a directory, not a file: {fix}")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputRateConfigError(
            f"trace_path {trace_path!r}: {parent!r} exists and is not a directory, so the trace file cannot be "
            f"created below it; {fix}"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputRateConfigError(f"trace_path {trace_path!r}: directory {parent!r} is not writable; {fix}")


def _with_rates_file(config: OutputRateConfig, rates_file: Any) -> OutputRateConfig:
    """R21: ``rates_file`` validated; an existing file's table replaces the section's rates
    (``rate_table``, R27-R29; a bad file stops start-up, naming it and what to change; a
    missing one is watched)."""
    if not isinstance(rates_file, str) or not rates_file.strip():
        raise OutputRateConfigError(
            f"rates_file must be a non-empty string naming a JSON file of rates (watched for changes, R21), e.g. "
            f'"/etc/outrate/rates.json", got {rates_file!r}; remove it to change limits only by a restart'
        )
    table = RatesFileWatcher(rates_file).load_initial()
    config = replace(config, rates_file=rates_file)
    if table is None:
        return config
    # R28: an unlimited default keeps the section's rate as the "feature on" mark (R18); the table decides.
    default = table.default_rate if table.default_rate is not None else config.default_rate
    return replace(config, default_rate=default, user_rates=table.user_rates, rate_table=table)
