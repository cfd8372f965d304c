"""R21: the watched rates file (``output_rate.rates_file``, ``outrate serve --rates-file``).

The operator's interface for changing limits without a restart (docs/SPEC.md R21 and
Decision R21). The file is a JSON object with the two rate keys of ``output_rate``::

    {"default_tokens_per_s": 100, "user_tokens_per_s": {"user-a": 20, "user-b": 250}}

The whole table is replaced: a user left out of ``user_tokens_per_s`` moves to the default.
Validation is start-up's (``config.parse_output_rate``: exact rates, > 0, at most 9
decimal places, a default required) plus: a key given twice is refused, and any other key
of ``output_rate`` (``burst_ms``, ``max_num_active_seqs``, ...) is refused with "needs a
restart"; an unknown key names the nearest valid one.

``RatesFileWatcher.poll()`` is called by the scheduler at the start of each
``schedule()``: one ``os.stat``; the file is read only when ``(st_mtime_ns, st_size,
st_ino)`` changed (write it atomically: a temporary file renamed over it). A bad file is
logged once at ERROR (what to change) and the limits in force are kept; a missing file
keeps them too (logged once at WARNING). It never raises at run time. At start-up
``load_initial()`` reads an existing file and raises on a bad one (start-up stops with the
message as its last line).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.config import (
    KNOWN_KEYS,
    OutputRateConfigError,
    _suggest_keys,
    loads_no_duplicates,
    parse_output_rate,
)

RATE_KEYS = ("default_tokens_per_s", "user_tokens_per_s")
MAX_RATES_FILE_BYTES = 16 << 20  # a rate table far larger than this is not a rate table


@dataclass(frozen=True)
class RateTable:
    """R21: one validated rate table: the default and the overrides, tokens/s (exact)."""

    default_rate: Fraction
    user_rates: Mapping[str, Fraction]


def parse_rates_file(text: str, path: str = "rates file") -> RateTable:
    """R21: parse and validate the text of a rates file (module docstring).

    Raises:
        OutputRateConfigError: not JSON, not an object, a key given twice, another
            ``output_rate`` key (needs a restart), an unknown key (nearest named), no
            default, a bad rate (naming the user and value); every message starts with
            ``rates file PATH:`` and says what to change.
    """
    what = f"rates file {path}"
    try:
        data: Any = loads_no_duplicates(text, what)
    except OutputRateConfigError:
        raise
    except ValueError as exc:
        raise OutputRateConfigError(
            f"{what}: not valid JSON ({exc}); write a JSON object such as "
            '{"default_tokens_per_s": 100, "user_tokens_per_s": {"user-a": 20}}'
        ) from None
    if not isinstance(data, Mapping):
        raise OutputRateConfigError(
            f"{what}: must be a JSON object with default_tokens_per_s and user_tokens_per_s, got {data!r}"
        )
    restart = sorted(k for k in data if k in KNOWN_KEYS and k not in RATE_KEYS)
    if restart:
        raise OutputRateConfigError(
            f"{what}: {', '.join(map(repr, restart))} cannot be changed without a restart; "
            f"the rates file holds only {' and '.join(RATE_KEYS)}"
        )
    unknown = sorted((k for k in data if k not in RATE_KEYS), key=str)
    if unknown:
        raise OutputRateConfigError(
            f"{what}: unknown key(s) {_suggest_keys(unknown, RATE_KEYS)}; known keys: {', '.join(RATE_KEYS)}"
        )
    if data.get("default_tokens_per_s") is None:
        raise OutputRateConfigError(
            f"{what}: no default_tokens_per_s; give the default rate too (the file "
            "replaces the whole rate table, and the feature stays on: R18)"
        )
    try:
        config = parse_output_rate(dict(data))
    except OutputRateConfigError as exc:
        raise OutputRateConfigError(f"{what}: {exc}") from None
    assert config.default_rate is not None
    return RateTable(config.default_rate, dict(config.user_rates))


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class RatesFileWatcher:
    """R21: watches one rates file (module docstring).

    Args:
        path: the file (need not exist yet).
        logger: where run-time problems go (``logging.Logger``-like); default
            ``vllm.output_rate`` (reference/oplog.py).
    """

    def __init__(self, path: str, logger: Any = None) -> None:
        if not isinstance(path, str) or not path.strip():
            raise OutputRateConfigError(f"rates_file must be a non-empty string naming a JSON file, got {path!r}")
        self.path = path
        self._logger = logger
        self._seen: tuple[int, int, int] | None = None  # signature of the last file read (good or bad)
        self._missing_logged = False
        self.reloads = 0  # tables installed from the file (for tests and logs)
        self.errors = 0  # bad files seen

    @property
    def logger(self) -> Any:
        if self._logger is None:
            from vllm_output_rate.reference.oplog import logger

            self._logger = logger
        return self._logger

    def load_initial(self) -> RateTable | None:
        """Start-up: the table of an existing file (None: no file yet; it is watched).

        Raises:
            OutputRateConfigError: a bad file, naming it and what to change.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise OutputRateConfigError(f"rates file {self.path}: cannot be read ({exc})") from None
        table = self._read(st)
        self._seen = _signature(st)
        return table

    def _read(self, st: os.stat_result) -> RateTable:
        if st.st_size > MAX_RATES_FILE_BYTES:
            raise OutputRateConfigError(
                f"rates file {self.path}: {st.st_size} bytes > {MAX_RATES_FILE_BYTES}; this is not a rate table"
            )
        try:
            with open(self.path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise OutputRateConfigError(f"rates file {self.path}: cannot be read ({exc})") from None
        return parse_rates_file(text, self.path)

    def poll(self) -> RateTable | None:
        """The new table if the file changed since the last look and is valid, else None.

        Never raises: a bad or unreadable file is logged once (per version of the file) at
        ERROR and None is returned, so the limits in force stay; a missing file is logged
        once at WARNING. Cost when nothing changed: one ``os.stat``.
        """
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if not self._missing_logged:
                self._missing_logged = True
                what = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
                self.logger.warning(
                    "output-rate: rates file %s %s; the limits in force are kept until it is written", self.path, what
                )
            return None
        self._missing_logged = False
        signature = _signature(st)
        if signature == self._seen:
            return None
        self._seen = signature
        try:
            table = self._read(st)
        except OutputRateConfigError as exc:
            self.errors += 1
            self.logger.error("output-rate: %s; the limits in force are kept until the file is fixed", exc)
            return None
        self.reloads += 1
        return table


def describe(table: RateTable) -> str:
    """A one-line description of a table for the operator log."""
    overrides = ", ".join(f"{u!r} {r} tok/s" for u, r in sorted(table.user_rates.items())[:5])
    more = len(table.user_rates) - 5
    return (
        f"default {table.default_rate} tok/s; {len(table.user_rates)} override(s)"
        + (f": {overrides}" if overrides else "")
        + (f" and {more} more" if more > 0 else "")
    )
