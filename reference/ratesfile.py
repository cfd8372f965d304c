"""R21: the watched rates file (``output_rate.rates_file``, ``outrate serve --rates-file``).

The operator's interface for changing limits without a restart (docs/SPEC.md R21 and
Decision R21). The file is a JSON object: today's two rate keys of ``output_rate``::

    {"default_tokens_per_s": 100, "user_tokens_per_s": {"user-a": 20, "user-b": 250}}

or a plan table (``default_plan``, ``plans``, ``users`` with prefix patterns, unlimited
users and per-plan shadow: R27-R29, reference/ratetable.py). The whole table is replaced:
a user left out moves to the default. Validation is ``ratetable.parse_table`` (exact
rates, > 0, at most 9 decimal places, a default required, entries named in every
message) plus: a key given twice is refused, and any other key of ``output_rate``
(``burst_ms``, ``max_num_active_seqs``, ...) is refused with "needs a restart"; an
unknown key names the nearest valid one.

``RatesFileWatcher.poll()`` is called by the scheduler at the start of each
``schedule()``: one ``os.stat``; the file is read only when ``(st_mtime_ns, st_size,
st_ino)`` changed (write it atomically: a temporary file renamed over it). A file of at
most ``INLINE_BYTES`` (a few hundred users) is read and parsed there, in well under a
millisecond, so it is in force from that very step. A larger one is read, parsed and
validated by the watcher's own thread, off the step (R21, no stall: 100,000 users take a
few hundred ms); the first ``poll()`` after it is ready returns it (an O(1) swap). A bad
file is logged once at ERROR (what to change) and the limits in force are kept; a missing
file keeps them too (logged once at WARNING). It never raises at run time, and its thread
never ends: a failure of the reader process (not of the file) is logged at ERROR and the
same version is read again after a back-off (``RETRY_S``, doubling to ``RETRY_MAX_S``). At start-up
``load_initial()`` reads an existing file and raises on a bad one (start-up stops with the
message as its last line).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from vllm_output_rate.reference.ratetable import (
    CHUNK,
    TABLE_KEYS,
    Pacer,
    RateTable,
    parse_table,
    table_from_lines,
    table_lines,
)
from vllm_output_rate.reference.section import (
    KNOWN_KEYS,
    OutputRateConfigError,
    _suggest_keys,
    loads_no_duplicates,
)

RATE_KEYS = TABLE_KEYS
MAX_RATES_FILE_BYTES = 16 << 20  # a rate table far larger than this is not a rate table
RETRY_S = 0.5  # R21: the watcher thread's first wait after a failure of the reader process (s)
RETRY_MAX_S = 30.0  # ... doubling up to this
INLINE_BYTES = 16 << 10  # R21: a file up to this size is parsed in the step (< 0.3 ms), larger ones off it
__all__ = ["RateTable", "RatesFileWatcher", "ReaderFailed", "parse_rates_file"]


class ReaderFailed(RuntimeError):
    """R21: the reader process failed (it died, or wrote what ``table_lines`` did not);
    the file is not at fault, and the watcher thread tries the same version again."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def parse_rates_file(text: str, path: str = "rates file") -> RateTable:
    """R21: parse and validate the text of a rates file (module docstring).

    Raises:
        OutputRateConfigError: not JSON, not an object, a key given twice, another
            ``output_rate`` key (needs a restart), an unknown key (nearest named), no
            default, a bad rate (naming the user and value), a bad plan table entry
            (``ratetable.parse_table``: naming the entry); every message starts with
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
            f"{what}: must be a JSON object with default_tokens_per_s and user_tokens_per_s (or default_plan, "
            f"plans and users), got {_short(data)}"
        )
    restart = sorted(k for k in data if k in KNOWN_KEYS and k not in RATE_KEYS)
    if restart:
        raise OutputRateConfigError(
            f"{what}: {', '.join(map(repr, restart))} cannot be changed without a restart; "
            f"the rates file holds only {', '.join(RATE_KEYS)}"
        )
    unknown = sorted((k for k in data if k not in RATE_KEYS), key=str)
    if unknown:
        raise OutputRateConfigError(
            f"{what}: unknown key(s) {_suggest_keys(unknown, RATE_KEYS)}; known keys: {', '.join(RATE_KEYS)}"
        )
    try:
        return parse_table(data, what)
    except OutputRateConfigError as exc:
        raise OutputRateConfigError(f"{what}: {exc}") from None


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class RatesFileWatcher:
    """R21: watches one rates file (module docstring).

    Args:
        path: the file (need not exist yet).
        logger: where run-time problems go (``logging.Logger``-like); default
            ``vllm.output_rate`` (reference/oplog.py).
        burst_ns: the limiter's burst tolerance; given, the watcher thread also prepares
            each table it reads (``RateTable.prepare``).
    """

    def __init__(self, path: str, logger: Any = None, burst_ns: int | None = None) -> None:
        if not isinstance(path, str) or not path.strip():
            raise OutputRateConfigError(f"rates_file must be a non-empty string naming a JSON file, got {path!r}")
        self.path = path
        self._logger = logger
        self.burst_ns = burst_ns  # the limiter's tau: tables are prepared for it off the step
        self._seen: tuple[int, int, int] | None = None  # signature of the last file read (good or bad)
        self._missing_logged = False
        self.reloads = 0  # tables installed from the file (for tests and logs)
        self.errors = 0  # bad files seen
        self.failures = 0  # failures of the watcher thread's work (the reader process), each retried
        self.retry_s = RETRY_S
        # Off the step: the signature to read (set by poll), the table read (set by the thread).
        self._wanted: tuple[int, int, int] | None = None
        self._ready: RateTable | None = None
        self._done: tuple[int, int, int] | None = None  # the last signature the thread finished
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pacer = Pacer()  # the watcher thread's chunks (the most it holds the GIL at once)
        self._reader: subprocess.Popen | None = None
        self._retired: list[Any] = []

    @property
    def logger(self) -> Any:
        if self._logger is None:
            # deferred: oplog imports vLLM's logger (seconds); rates files are also read without vLLM
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
        del st  # it exists: read it (the version read is the table's signature)
        table = self._read()
        self._seen = table.signature
        return table

    def _read(self) -> RateTable:
        """The table of the file as it is now (its version: ``table.signature``).

        Raises:
            OutputRateConfigError: too large, unreadable or invalid, naming the file.
        """
        try:
            with open(self.path, encoding="utf-8") as handle:
                st = os.fstat(handle.fileno())  # the version actually read
                if st.st_size > MAX_RATES_FILE_BYTES:
                    raise OutputRateConfigError(
                        f"rates file {self.path}: {st.st_size} bytes > {MAX_RATES_FILE_BYTES} (the size limit); "
                        "this is not a rate table"
                    )
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise OutputRateConfigError(f"rates file {self.path}: cannot be read ({exc})") from None
        table = parse_rates_file(text, self.path)
        table.signature = _signature(st)  # the version read (``prime``)
        return table

    def _reader_process(self) -> subprocess.Popen:
        """The reader process (``python -m vllm_output_rate.reference.ratesfile``,
        ``_reader_main``), started once and kept: it reads a path per line on its stdin."""
        reader = self._reader
        if reader is None or reader.poll() is not None:
            command = [sys.executable, "-m", "vllm_output_rate.reference.ratesfile"]
            self.pacer.start()
            # R21: an explicit copy of the environment. Without env=, the child's execve reads
            # the C library's environ, which another thread may be reallocating at that moment
            # (os.environ changes call setenv/unsetenv); on Linux, subprocess uses vfork, and
            # such an exec failed with EFAULT ("[Errno 14] Bad address").
            reader = self._reader = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=dict(os.environ),
            )
            self.pacer()  # starting the process holds the GIL: a chunk too
        return reader

    def _read_in_reader_process(self) -> RateTable | None:
        """R21, no stall: the file read and validated by the reader process, which writes
        the table as JSON lines; this thread builds it from them a chunk at a time, letting
        the step run between chunks (``Pacer``), so the engine's step never waits for a
        whole JSON document or table. None with the error logged (a bad file: the limits in
        force are kept).

        Raises:
            ReaderFailed: the reader process failed or could not be started (not the
                file's fault: ``_run`` tries this version again)."""
        status: Any = None
        table = None
        try:
            reader = self._reader_process()
            assert reader.stdin is not None and reader.stdout is not None
            reader.stdin.write(self.path + "\n")
            reader.stdin.flush()
            lines = iter(reader.stdout.readline, END + "\n")
            status = json.loads(next(lines, "null"))
            if isinstance(status, dict) and status.get("ok"):
                self.pacer.start()  # the wait for the reader is not a chunk
                table = table_from_lines(lines, self.pacer)
                table.signature = tuple(status["signature"])
            for _ in lines:  # up to the end mark (nothing left after a whole table)
                pass
        except (OSError, ValueError, StopIteration) as exc:
            # The reader process failed, not the file: the thread retries this version (_run).
            self._stop_reader()
            raise ReaderFailed(f"rates file {self.path}: the reader process failed ({exc!r})") from None
        if table is not None:
            return table
        self.errors += 1
        message = status.get("error") if isinstance(status, dict) else None
        self.logger.error(
            "output-rate: %s; the limits in force are kept until the file is fixed",
            message or f"rates file {self.path}: the reader process gave no answer",
        )
        return None

    def _stop_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.kill()
            reader.wait()

    def retire(self, *objects: Any) -> None:
        """R21, no stall: tables and scale maps the step has just replaced; the watcher
        thread empties them a chunk at a time, so their memory is not freed inside a step
        (dropping a 100,000-entry dict takes milliseconds)."""
        self._retired.extend(o for o in objects if o is not None)
        self._wake.set()

    def _drain_retired(self) -> None:
        while self._retired:
            retired = self._retired.pop()
            if retired is _START_READER:
                self._reader_process()
                continue
            for mapping in _big_maps(retired):
                self.pacer.start()
                while mapping:
                    for _ in range(min(len(mapping), CHUNK)):
                        mapping.popitem()
                    self.pacer()

    def prime(self, table: RateTable | None) -> None:
        """Start-up: ``table`` (read by ``load_initial``, perhaps by another watcher) is in
        force; its version of the file is not read again."""
        signature = getattr(table, "signature", None)
        if signature is not None:
            self._seen = signature

    def poll(self) -> RateTable | None:
        """The new table if the file changed and is valid and ready, else None.

        Never raises: a bad or unreadable file is logged once (per version of the file) at
        ERROR and None is returned, so the limits in force stay; a missing file is logged
        once at WARNING. Cost when nothing changed: one ``os.stat``. A changed file of at
        most ``INLINE_BYTES`` is parsed here; a larger one by the watcher thread, and a
        later ``poll()`` returns it once ready (O(1)).
        """
        ready = self._ready
        if ready is not None:
            with self._lock:
                ready, self._ready = self._ready, None
            if ready is not None:
                return ready
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
        if st.st_size > INLINE_BYTES:
            self._read_off_step(signature)
            return None
        return self._read_logged()

    def _read_logged(self) -> RateTable | None:
        """The file's table, or None with the error logged (never raises)."""
        try:
            table = self._read()
        except OutputRateConfigError as exc:
            self.errors += 1
            self.logger.error("output-rate: %s; the limits in force are kept until the file is fixed", exc)
            return None
        self.reloads += 1
        return table

    def _read_off_step(self, signature: tuple[int, int, int]) -> None:
        """Hand the read of the file at ``signature`` to the watcher thread."""
        with self._lock:
            self._wanted = signature
            self._ready = None  # an older version still being read is not installed
        self.start_thread()
        self._wake.set()

    def start_thread(self) -> None:
        """Start the watcher thread (once); with a large file in place, its reader process
        too, so that no step pays for starting it later (the scheduler calls this at
        start-up)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="outrate-rates-file", daemon=True)
        self._thread.start()
        try:
            large = os.stat(self.path).st_size > INLINE_BYTES
        except OSError:
            large = False
        if large:
            self._retired.append(_START_READER)
            self._wake.set()

    def _run(self) -> None:
        """The watcher thread: read and validate each version ``poll`` asks for; empty
        what the step retired. It never ends: a failure (the reader process cannot start
        or dies) is logged at ERROR and the same version is tried again after
        ``retry_s`` (doubling up to ``RETRY_MAX_S``); without that, the file's next
        versions would never be read (R21)."""
        _lower_priority()
        delay = self.retry_s
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self._serve()
            except Exception as exc:  # the thread outlives any failure (docstring)
                self.failures += 1
                self._stop_reader()
                self.logger.error(
                    "output-rate: %s; the limits in force are kept, the file is read again in %.1f s", exc, delay
                )
                time.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                self._wake.set()
            else:
                delay = self.retry_s

    def _serve(self) -> None:
        """One wake of the watcher thread: empty what was retired, then read the version
        ``poll`` asked for, if not read yet.

        Raises:
            ReaderFailed: the reader process failed (``_run`` retries).
            OSError: the reader process could not be started."""
        self._drain_retired()
        with self._lock:
            wanted = self._wanted
            if wanted is None or wanted == self._done:
                return
        table = self._read_in_reader_process()
        if table is not None and table.signature != wanted:
            table = None  # replaced meanwhile: poll asks for the newer version
        if table is not None and self.burst_ns is not None:
            self.pacer.start()
            table.prepare(self.burst_ns, self.pacer)  # scales, labels, log line built here: the step swaps
        with self._lock:
            if self._wanted == wanted:
                self._ready, self._done = table, wanted
                if table is not None:
                    self.reloads += 1

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Tests and benchmarks: wait until the watcher thread has read the last version
        ``poll`` handed to it (True), or ``timeout_s`` passed (False)."""

        deadline = time.monotonic() + timeout_s
        while self._wanted is not None and self._done != self._wanted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True


def describe(table: RateTable) -> str:
    """A one-line description of a table for the operator log (built by the watcher thread
    for a large file)."""
    text = getattr(table, "describe_text", None)
    return text if text is not None else table.describe()


END = "."  # the reader's last line for one file (no JSON line is ".")
_START_READER = object()  # retired marker: the watcher thread starts the reader process


def _big_maps(obj: Any) -> list[Any]:
    """The large mutable maps of a retired table, prepared table or scale map."""
    if isinstance(obj, dict):
        return [obj]
    found = []
    for name in ("exact", "prefixes", "user_rates", "_cache", "scales"):
        value = getattr(obj, name, None)
        if isinstance(value, dict):
            found.append(value)
    prepared = getattr(obj, "_prepared", None)  # a table's scales for the limiters
    if prepared is not None:
        found += [p.scales for p in (prepared.enforced, prepared.shadow) if p is not None]
    return found


def _lower_priority() -> None:
    """Run this thread (Linux: a thread has its own nice value) or process below the
    engine's step on a busy machine; nothing happens where that is not allowed."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _reader_main(argv: list[str]) -> int:
    """The reader process: for each rates file path read from stdin (or ``argv[0]``, once),
    read and validate it; print a status line (``{"ok", "signature"}`` or ``{"ok":
    false, "error"}``), the table as JSON lines (``ratetable.table_lines``) and ``END``.
    Exits 0 at the end of its input (a bad file is a status, not a failure)."""
    _lower_priority()
    out = sys.stdout
    for path in argv[:1] or (line.rstrip("\n") for line in sys.stdin):
        try:
            table = RatesFileWatcher(path)._read()
        except OutputRateConfigError as exc:
            out.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        else:
            out.write(json.dumps({"ok": True, "signature": list(table.signature or ())}) + "\n")
            for line in table_lines(table):
                out.write(line + "\n")
        out.write(END + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_reader_main(sys.argv[1:]))
