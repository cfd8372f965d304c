"""``additional_config["output_rate"]``: parsing and start-up validation.

Keys (all optional; an empty or missing section means the feature is off, R18):

=============================== ===================================================
``default_tokens_per_s``        rate of every user not listed below; turns it on
``user_tokens_per_s``           ``{"user-a": 100, ...}`` per-user overrides
``max_num_active_seqs``         active cap A (R12); default: vLLM's
                                ``max_num_active_seqs``, else ``max_num_seqs``
``burst_ms``                    burst tolerance tau (R1), default 100
=============================== ===================================================

Source: semantics.md "Configuration"; seed article, start-up flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

from vllm_output_rate.reference.limiter import BURST_NS, parse_rate

KNOWN_KEYS = ("default_tokens_per_s", "user_tokens_per_s", "max_num_active_seqs", "burst_ms")


class OutputRateConfigError(ValueError):
    """A bad ``output_rate`` configuration; the message says what to change."""


@dataclass(frozen=True)
class OutputRateConfig:
    """Validated feature configuration. ``default_rate`` None means the feature is off."""

    default_rate: Fraction | None = None
    user_rates: Mapping[str, Fraction] = field(default_factory=dict)
    max_num_active_seqs: int | None = None
    burst_ns: int = BURST_NS

    @property
    def enabled(self) -> bool:
        return self.default_rate is not None


def parse_output_rate(section: Any) -> OutputRateConfig:
    """Parse and validate ``additional_config["output_rate"]``.

    Raises:
        OutputRateConfigError: unknown keys, bad rates (naming the user and value),
            overrides without a default, a bad active cap or burst.
    """
    if section is None or section == {}:
        return OutputRateConfig()
    if not isinstance(section, Mapping):
        raise OutputRateConfigError(
            f'additional_config["output_rate"] must be a JSON object, got {section!r}'
        )
    unknown = sorted(set(section) - set(KNOWN_KEYS))
    if unknown:
        raise OutputRateConfigError(
            f'unknown key(s) {unknown} in additional_config["output_rate"]; known keys: {list(KNOWN_KEYS)}'
        )
    overrides = section.get("user_tokens_per_s")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise OutputRateConfigError(
            f"user_tokens_per_s must be a JSON object of user -> tokens/s, got {overrides!r}"
        )
    default = section.get("default_tokens_per_s")
    if default is None:
        raise OutputRateConfigError(
            "output_rate is configured without default_tokens_per_s "
            "(--default-user-output-tokens-per-second): set a default rate to turn the feature on, "
            "or remove the output_rate section"
        )
    try:
        default_rate = parse_rate(default, "default_tokens_per_s")
        user_rates = {}
        for user, rate in overrides.items():
            if not isinstance(user, str) or not user:
                raise ValueError(f"user ids in user_tokens_per_s must be non-empty strings, got {user!r}")
            user_rates[user] = parse_rate(rate, f"user_tokens_per_s[{user!r}]")
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    active = section.get("max_num_active_seqs")
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise OutputRateConfigError(f"max_num_active_seqs must be an integer >= 1, got {active!r}")
    burst_ms = section.get("burst_ms", BURST_NS // 1_000_000)
    if isinstance(burst_ms, bool) or not isinstance(burst_ms, int) or burst_ms < 1:
        raise OutputRateConfigError(f"burst_ms must be an integer number of milliseconds >= 1, got {burst_ms!r}")
    return OutputRateConfig(default_rate, user_rates, active, burst_ms * 1_000_000)
