"""R30: the API keys file of ``identity "api-key"`` (``output_rate.keys_file``,
``outrate serve --keys-file``, ``outrate keys add``).

A JSON object mapping each user id to the SHA-256 hashes of its keys; it never holds a
raw key::

    {"user-a": ["sha256:9f86d081884c7d65...", "sha256:..."], "user-b": ["sha256:..."]}

A user may hold several keys (all share that user's one budget). A request's bearer token
is hashed (``key_hash``) and looked up; the hash, not the key, is what is compared, so the
file can be read by whoever deploys it without giving anyone a key.

Start-up (``KeysFileWatcher.load_initial``): a missing, unreadable or bad file stops
start-up with a message naming the file and the entry (user and position), never the
entry's text (a raw key pasted by mistake must not reach a log). Checked: JSON with no key
given twice; an object; every user a valid id (R17); every value a non-empty list; every
entry ``sha256:`` and 64 hex digits; no hash under two users.

Run time (``KeysFileWatcher.lookup``): in the API server, off the engine step. At most
once per ``POLL_INTERVAL_NS`` (1 s) one ``os.stat``; the file is read again only when
``(st_mtime_ns, st_size, st_ino)`` changed (write it atomically, as ``add_key`` does). A
bad or missing file is logged once, naming what to fix, and the keys in force are kept,
as for the rates file (R21).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm_output_rate.reference.identity import MAX_USER_ID_CHARS, is_user_id
from vllm_output_rate.reference.section import OutputRateConfigError, loads_no_duplicates

HASH_PREFIX = "sha256:"
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
KEY_PREFIX = "ork-"  # output-rate key: makes a leaked key recognisable to secret scanners
POLL_INTERVAL_NS = 1_000_000_000
MAX_KEYS_FILE_BYTES = 16 << 20


def key_hash(key: str) -> str:
    """R30: the stored form of ``key``: ``"sha256:"`` and the hex SHA-256 of its UTF-8 bytes."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    """A fresh random API key: ``ork-`` and 43 URL-safe characters (256 bits, ``secrets``)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _user_shown(user: object) -> str:
    text = repr(user)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _decoded(text: str, what: str) -> Any:
    """``text`` decoded as JSON, a key given twice refused (``OutputRateConfigError``
    naming ``what``; for bad JSON only the line, never the text)."""
    try:
        return loads_no_duplicates(text, what)
    except json.JSONDecodeError as exc:
        raise OutputRateConfigError(
            f"{what}: not valid JSON (line {exc.lineno}); write an object such as "
            '{"user-a": ["sha256:<64 hex digits>"]}, e.g. with `outrate keys add USER --keys-file FILE`'
        ) from None


def parse_keys_file(text: str, path: str = "keys file") -> dict[str, str]:
    """R30: the ``{hash: user}`` lookup of a keys file's text (module docstring).

    Raises:
        OutputRateConfigError: starting ``keys file PATH:``, naming the bad entry by its user
            and 1-based position (never its text) and saying what to change.
    """
    what = f"keys file {path}"
    data = _decoded(text, what)
    if not isinstance(data, Mapping):
        raise OutputRateConfigError(
            f"{what}: must be a JSON object of user -> list of key hashes, got a {type(data).__name__}"
        )
    lookup: dict[str, str] = {}
    for user, hashes in data.items():
        if not is_user_id(user):
            raise OutputRateConfigError(
                f"{what}: user {_user_shown(user)} is not a valid user id (a non-empty string of at most "
                f"{MAX_USER_ID_CHARS} characters); rename or remove it"
            )
        if not isinstance(hashes, list) or not hashes:
            raise OutputRateConfigError(
                f"{what}: user {_user_shown(user)}: the value must be a non-empty list of key hashes "
                f'("sha256:<64 hex digits>"); remove the user to revoke all its keys'
            )
        for index, entry in enumerate(hashes, start=1):
            if not isinstance(entry, str) or not _HASH_RE.fullmatch(entry):
                raise OutputRateConfigError(
                    f'{what}: user {_user_shown(user)}, entry {index}: not "sha256:" followed by 64 lower-case '
                    "hex digits (the file holds hashes, never raw keys); replace it with the key's hash "
                    "(`outrate keys add` writes one) or remove it"
                )
            other = lookup.get(entry)
            if other is not None:
                raise OutputRateConfigError(
                    f"{what}: user {_user_shown(user)}, entry {index}: the same key hash is also listed under "
                    f"user {_user_shown(other)}; a key belongs to one user, remove one of them"
                )
            lookup[entry] = user
    return lookup


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeysFileWatcher:
    """R30: the keys in force, from one keys file (module docstring).

    Args:
        path: the keys file.
        logger: where run-time problems go (``logging.Logger``-like).
        clock_ns: monotonic clock (ns) of the poll interval; tests pass a fake one.
    """

    def __init__(self, path: str, logger: Any, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.path = path
        self.logger = logger
        self.clock_ns = clock_ns
        self._lookup: dict[str, str] = {}
        self._seen: tuple[int, int, int] | None = None
        self._next_poll_ns = 0
        self._problem_logged = False
        self.reloads = 0

    def load_initial(self) -> dict[str, str]:
        """Start-up: read the file; returns the ``{hash: user}`` lookup now in force.

        Raises:
            OutputRateConfigError: the file is missing, unreadable or bad, naming it and
                the entry at fault.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise OutputRateConfigError(
                f"keys file {self.path} does not exist; create it with `outrate keys add USER --keys-file {self.path}`"
            ) from None
        except OSError as exc:
            raise OutputRateConfigError(f"keys file {self.path}: cannot be read ({exc.strerror})") from None
        self._lookup = self._read(st)
        self._seen = _signature(st)
        self._next_poll_ns = self.clock_ns() + POLL_INTERVAL_NS
        return dict(self._lookup)

    def _read(self, st: os.stat_result) -> dict[str, str]:
        if st.st_size > MAX_KEYS_FILE_BYTES:
            raise OutputRateConfigError(f"keys file {self.path}: {st.st_size} bytes > {MAX_KEYS_FILE_BYTES}")
        try:
            return parse_keys_file(Path(self.path).read_text(encoding="utf-8"), self.path)
        except (OSError, UnicodeDecodeError) as exc:  # the error's text could quote the file: name its kind only
            raise OutputRateConfigError(f"keys file {self.path}: cannot be read ({type(exc).__name__})") from None

    def poll(self) -> None:
        """Reload the file if it changed (at most one ``os.stat`` per second). Never raises:
        a missing or bad file is logged once per version at ERROR, without its content,
        and the keys in force are kept."""
        now = self.clock_ns()
        if now < self._next_poll_ns:
            return
        self._next_poll_ns = now + POLL_INTERVAL_NS
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if not self._problem_logged:
                self._problem_logged = True
                self.logger.error(
                    "output-rate: keys file %s cannot be read (%s); the keys in force are kept",
                    self.path,
                    exc.strerror,
                )
            return
        signature = _signature(st)
        if signature == self._seen:
            return
        self._seen = signature
        try:
            lookup = self._read(st)
        except OutputRateConfigError as exc:
            self.logger.error("output-rate: %s; the keys in force are kept until the file is fixed", exc)
            self._problem_logged = True
            return
        self._problem_logged = False
        self._lookup = lookup
        self.reloads += 1
        self.logger.info(
            "output-rate: keys file %s reloaded: %d key(s) of %d user(s)",
            self.path,
            len(lookup),
            len(set(lookup.values())),
        )

    def user_of(self, token: str) -> str | None:
        """R30: the user whose key is ``token``, or None (no such key). Polls first."""
        self.poll()
        return self._lookup.get(key_hash(token))


def add_key(path: str, user: str) -> str:
    """R30: create a key for ``user``, store its hash in the keys file at ``path`` (created
    if missing, mode 0600, replaced atomically) and return the key (the only copy).

    Raises:
        OutputRateConfigError: ``user`` is not a valid user id, or the existing file is bad
            (naming the entry, as at start-up).
    """
    if not is_user_id(user):
        raise OutputRateConfigError(
            f"USER must be a non-empty string of at most {MAX_USER_ID_CHARS} characters, got {_user_shown(user)}"
        )
    data: dict[str, list[str]] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        parse_keys_file(text, path)  # refuse to extend a bad file
        data = json.loads(text)
    key = new_key()
    data.setdefault(user, []).append(key_hash(key))
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return key
