"""Output-rate series on vLLM's own ``/metrics`` (issue 15, item 1).

vLLM 0.32 drops extra attributes of ``SchedulerStats`` between the engine core and the API
server, so the series travel another way:

1. **Front end** (``plugin.py``, in ``EngineArgs.create_engine_config``, before the engine
   core is spawned; feature on only): ``ensure_metrics_dir()`` creates a private directory
   (``mkdtemp``, mode 0700, removed at exit) and puts it in ``VLLM_OUTPUT_RATE_METRICS_DIR``,
   with the front end's pid in ``VLLM_OUTPUT_RATE_METRICS_OWNER``. The spawned engine core
   inherits both. An operator may set the directory variable itself (then it is kept).
2. **Engine core** (the scheduler, ``MetricsRecorder``): counts per step (see *cost*) and,
   at most once per ``SNAPSHOT_INTERVAL_NS`` (1 s) of the scheduler's clock -- the same
   call site as the operator log's throttled summary (``oplog.ThrottleLog``) -- and when
   the scheduler runs out of requests, writes ``engine-<pid>.json`` in that directory
   atomically (a temporary file, then ``os.replace``). The process that set the variable
   (the front end itself, or an in-process scheduler in the same process) never writes.
3. **API server** (``OutputRateStatLogger``, entry point ``vllm.stat_logger_plugins``,
   which vLLM loads only in the ``AsyncLLM`` process): registers ``OutputRateCollector``
   once on prometheus_client's default registry, which vLLM's ``/metrics`` serves with one
   API server. On each scrape the collector reads the snapshot(s) and yields the families.

Series (``user`` label, bounded: the rate table's plan names, users marked ``"detailed":
true`` and each user named in ``user_tokens_per_s`` by its id while they fit in 1,024 --
at start-up, or first in a rates-file change (R21, ``output_rate.rates_file``) -- every
other user summed into its plan's label, and the default rate's users, ``__anonymous__``
included, into ``other``; reference/ratetable.py):

=================================================== ======= =========================================
``vllm:output_rate_granted_tokens_total{user}``     counter sampling dispatches granted and not refunded
                                                            (R7, R9): the output tokens the users got
``vllm:output_rate_throttled_request_steps_total``  counter running requests skipped in one step because
``{user}``                                                  the user's budget was spent (R11); shadow
                                                            mode: dispatches that would have been refused
``vllm:output_rate_refunds_total{user}``            counter charges refunded at the single refund point (R9)
``vllm:output_rate_throttled_seconds_total{user}``  counter seconds during which at least one request of the
                                                            label was throttled (from a throttled step to
                                                            the next step)
``vllm:output_rate_lead_seconds{user}``             gauge   TAT - now, at least 0 (``other``: the largest
                                                            among the other users); > burst means refused
``vllm:output_rate_limit_tokens_per_second{user}``  gauge   the configured rate (``other``: the default)
``vllm:output_rate_throttled_requests``             gauge   resident requests throttled in the last step
                                                            (engine-wide)
``vllm:output_rate_shadow``                         gauge   1 in shadow mode, else 0
``vllm:output_rate_snapshot_age_seconds``           gauge   seconds since the engine core wrote the
                                                            snapshot (at most ~1 s while it steps)
=================================================== ======= =========================================

**Bounded cardinality and memory.** Labels are the table's labels (``RateTable.labels``:
plans, at most 1,024; detailed users, at most 1,024) plus ``other``; each label a
rates-file change names (R21) gets its series from that change on, at most
``MAX_ADDED_LABELS`` (1024) such names per engine run (a user named later is counted in
its plan's label or ``other``). A label is kept when it leaves the table (its counters
never vanish; its limit gauge shows the default then). So the series count is
``6 x (plans + detailed + 1) + 3`` for one table, whatever the number of users; the
engine core keeps one counter set per label (never per user id), the snapshot holds one
entry per label, and the collector keeps nothing between scrapes.

**Cost in the engine core.** Per ``schedule()``: one loop over the users charged in the step
(a label lookup, cached per user id, and a counter add each), and, only when requests are
throttled or refunded, one pass over those ids. Once per second: copies of the counters
(one entry per label) and of the limiter's TATs handed to the recorder's writer thread,
which computes the leads and writes the file off the step. A rate-table change costs
O(labels). Off (no directory variable, e.g. the gate's in-process harness): nothing.

**Freshness.** Counters are at most one second old while the engine steps and exact once it
goes idle (the idle flush). The lead is corrected at scrape time by the time since the
snapshot (TATs do not move without steps), so it decays while the engine is idle.

Source: issue 15 "Operators see and steer the limit", item 1.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from fractions import Fraction
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm_output_rate.reference.hooks import feature_on
from vllm_output_rate.reference.ratesfile import _lower_priority
from vllm_output_rate.reference.ratetable import Pacer, RateTable

ENV_DIR = "VLLM_OUTPUT_RATE_METRICS_DIR"
ENV_OWNER = "VLLM_OUTPUT_RATE_METRICS_OWNER"
SNAPSHOT_INTERVAL_NS = 1_000_000_000  # at most one snapshot per second of scheduler time
OTHER = "other"  # the label of every user not named in user_tokens_per_s
# R21: labels added by rates-file changes over an engine run, beyond the start-up overrides.
MAX_ADDED_LABELS = 1024
PREFIX = "vllm:output_rate_"
SNAPSHOT_VERSION = 1
CHUNK_LABELS = 64  # the writer thread lets the step run after this many labels
CHUNK_USERS = 1000  # ... and after this many users' leads


# -- front end ------------------------------------------------------------------------
def ensure_metrics_dir() -> str:
    """Make sure the engine core will know where to write (front end, before the spawn).

    Returns a new private temporary directory (removed at exit), put into
    ``VLLM_OUTPUT_RATE_METRICS_DIR`` with this process's pid in
    ``VLLM_OUTPUT_RATE_METRICS_OWNER``. A new one for every engine this front end builds:
    a directory inherited from a parent process, or left by an earlier engine of this
    process, holds snapshots of other engines, which /metrics must not show.
    """
    directory = tempfile.mkdtemp(prefix="outrate-metrics-")
    os.environ[ENV_DIR] = directory
    os.environ[ENV_OWNER] = str(os.getpid())
    atexit.register(shutil.rmtree, directory, True)
    return directory


# -- engine core ----------------------------------------------------------------------
class MetricsRecorder:
    """Per-label counters of one scheduler and their snapshot file (see module docstring).

    Args:
        directory: where ``engine-<pid>.json`` is written.
        user_rates: the configured overrides (their users are labels while at most
            ``ratetable.MAX_DETAILED``).
        default_rate: the rate of ``other``.
        shadow: shadow mode (reported as ``vllm:output_rate_shadow``).
        table: R27-R29: the rate table (``ratetable.RateTable``); its labels replace
            ``user_rates``'.
    """

    def __init__(
        self,
        directory: str,
        user_rates: Mapping[str, Fraction],
        default_rate: Fraction,
        shadow: bool = False,
        table: Any = None,
    ) -> None:
        self.path = os.path.join(directory, f"engine-{os.getpid()}.json")
        self.table = table if table is not None else RateTable.flat(default_rate, user_rates)
        # Users with a label of their own (a detailed or user_tokens_per_s user, ever): kept when they leave.
        self.named = frozenset(u for u in self.table.labels if u not in self.table.plans)
        self.added_labels = 0  # labels named by rates-file changes (R21), <= MAX_ADDED_LABELS
        self.rates = self.table.label_rates()
        self.shadow = shadow
        self.granted: Counter[str] = Counter()
        self.throttled_steps: Counter[str] = Counter()
        self.refunds: Counter[str] = Counter()
        self.throttled_ns: Counter[str] = Counter()
        self.throttled_requests = 0  # in the last step
        self._throttled_labels: Collection[str] = ()  # labels throttled in the last step
        self._last_ns: int | None = None
        self.next_ns = 0  # the first step writes a snapshot
        self.snapshots = 0  # written (for tests)
        self._written_ns = -1  # now_ns of the newest snapshot written (an older one never replaces it)
        self._write_lock = threading.Lock()
        self._queued: tuple[Any, ...] | None = None  # the next snapshot for the writer thread
        self._busy = False  # the writer thread is writing one
        self._handoff = threading.Condition()
        self._writer: threading.Thread | None = None
        self.pacer: Callable[[], None] | None = None  # the writer thread's chunks (ratetable.Pacer)

    @classmethod
    def from_env(cls, config: Any) -> MetricsRecorder | None:
        """A recorder if the front end set ``VLLM_OUTPUT_RATE_METRICS_DIR`` and this is not
        the process that set it (an engine core it spawned); else None (metrics off)."""
        directory = os.environ.get(ENV_DIR)
        if not directory or os.environ.get(ENV_OWNER) == str(os.getpid()):
            return None
        return cls(
            directory,
            config.user_rates,
            config.default_rate,
            bool(getattr(config, "shadow", False)),
            getattr(config, "rate_table", None),
        )

    def label(self, user: str | None) -> str:
        """The ``user`` label of ``user``: its id if it has a label of its own, else its
        plan's (R27) if that is a label, else ``OTHER``. O(1) after its first lookup."""
        if user in self.named:
            return user  # type: ignore[return-value]
        if user is None:
            return OTHER
        label = self.table.lookup(user).label
        return label if label in self.rates else OTHER

    def rates_changed(self, table: Any, default_rate: Any = None) -> None:
        """R21: a new rate table is in force. Each label it names gets its series from now
        on (at most ``MAX_ADDED_LABELS`` added per run; later ones stay in their plan's or
        ``OTHER``); every label keeps its series, and its limit gauge shows the new table's
        rate (the default's for a label that left the table). O(labels): the table's label
        rates were built off the step (``RateTable.prepare``).

        ``table``: a ``ratetable.RateTable``; or, as before, ``user_rates`` with
        ``default_rate`` (today's two keys)."""
        if not isinstance(table, RateTable):
            table = RateTable.flat(default_rate, table)
        prepared = table._prepared
        label_rates = prepared.label_rates if prepared is not None else table.label_rates()
        room = max(0, MAX_ADDED_LABELS - self.added_labels)
        added = [u for u in table.labels if u not in self.rates][:room]
        self.added_labels += len(added)
        keep = set(self.rates) | set(added)
        self.named = self.named | frozenset(u for u in added if u not in table.plans)
        self.table = table
        default = label_rates[OTHER]
        rates = {}
        for key in keep:
            rate = label_rates.get(key)
            if rate is None:  # a label that left the table: its user's rate now, or the default
                rate = default if key in self.table.plans or key not in self.named else _shown(table.rate_of(key))
            rates[key] = rate
        rates.pop(OTHER, None)
        self.rates = {**rates, OTHER: default}

    def step(
        self,
        now_ns: int,
        granted: Mapping[str, int],
        throttled: Collection[str],
        user_of: Callable[[str], str | None],
        refunded_users: Iterable[str | None] = (),
        limiter: Any = None,
    ) -> None:
        """One ``schedule()`` at ``now_ns``.

        ``granted``: user -> sampling dispatches charged in the step (before refunds);
        ``throttled``: ids of the requests throttled (shadow: would-be throttled) in it;
        ``user_of``: request id -> user; ``refunded_users``: the user of each refund (R9);
        ``limiter``: for the leads in a snapshot. A snapshot due at ``now_ns`` is handed to
        the writer thread (``write_async``).
        """
        label = self.label
        counts = self.granted
        for user, n in granted.items():
            counts[label(user)] += n
        for refunded in refunded_users:
            key = label(refunded)
            counts[key] -= 1
            self.refunds[key] += 1
        if self._throttled_labels and self._last_ns is not None:
            elapsed = now_ns - self._last_ns
            for key in self._throttled_labels:
                self.throttled_ns[key] += elapsed
        if throttled:
            labels = list(map(label, map(user_of, throttled)))
            self.throttled_steps.update(labels)
            self._throttled_labels = set(labels)
        else:
            self._throttled_labels = ()
        self.throttled_requests = len(throttled)
        self._last_ns = now_ns
        if now_ns >= self.next_ns:
            self.write_async(now_ns, limiter)

    def _state(self, now_ns: int, limiter: Any) -> tuple[Any, ...]:
        """What a snapshot needs, copied (O(labels + users holding a TAT), C-level copies):
        the writer thread builds the file from it while the step goes on."""
        tats = dict(limiter._tat) if limiter is not None and hasattr(limiter, "_tat") else None
        return (
            now_ns,
            dict(self.granted),
            dict(self.throttled_steps),
            dict(self.refunds),
            dict(self.throttled_ns),
            dict(self.rates),
            self.throttled_requests,
            limiter,
            tats,
        )

    def _leads(
        self,
        rates: Mapping[str, float],
        now_ns: int,
        limiter: Any,
        tats: Mapping[str, int] | None,
        pause: Callable[[], None] | None = None,
    ):
        leads = dict.fromkeys(rates, 0.0)
        if limiter is None:
            return leads
        label = self.label
        if tats is None:  # a limiter without integer TATs (duck-typed): its exact view
            items = ((u, limiter.tat_ns(u)) for u in list(limiter.users()))
            tat_ns_of = ((u, t) for u, t in items if t is not None)
        else:
            scale = limiter._scale
            tat_ns_of = ((u, t / scale(u).p) for u, t in tats.items())
        for i, (user, tat) in enumerate(tat_ns_of, 1):
            key = label(user)
            lead = max(0.0, float(tat - now_ns) / 1e9)
            if lead > leads.get(key, 0.0):
                leads[key] = lead
            if pause is not None and i % CHUNK_USERS == 0:
                pause()
        return leads

    def snapshot(self, now_ns: int, limiter: Any = None) -> dict[str, Any]:
        """The file's content: per label counters, lead and rate; engine-wide gauges."""
        return self._build(self._state(now_ns, limiter))

    def _build(self, state: tuple[Any, ...], pause: Callable[[], None] | None = None) -> dict[str, Any]:
        now_ns, granted, throttled_steps, refunds, throttled_ns, rates, throttled_requests, limiter, tats = state
        leads = self._leads(rates, now_ns, limiter, tats, pause)
        labels = {}
        for i, (key, rate) in enumerate(rates.items(), 1):
            labels[key] = {
                "granted": granted.get(key, 0),
                "throttled_request_steps": throttled_steps.get(key, 0),
                "refunds": refunds.get(key, 0),
                "throttled_seconds": throttled_ns.get(key, 0) / 1e9,
                "lead_seconds": leads.get(key, 0.0),
                "limit_tokens_per_second": rate,
            }
            if pause is not None and i % CHUNK_LABELS == 0:
                pause()
        return {
            "version": SNAPSHOT_VERSION,
            "pid": os.getpid(),
            "now_ns": now_ns,
            "shadow": self.shadow,
            "throttled_requests": throttled_requests,
            "labels": labels,
        }

    def write(self, now_ns: int, limiter: Any = None) -> None:
        """Write the snapshot now, atomically (temporary file + ``os.replace``); never raises."""
        self.next_ns = now_ns + SNAPSHOT_INTERVAL_NS
        self._write_state(self._state(now_ns, limiter))

    def write_async(self, now_ns: int, limiter: Any = None) -> None:
        """Hand the snapshot at ``now_ns`` to the writer thread (started once): the step
        only copies the counters (``_state``); a snapshot not yet written is replaced."""
        self.next_ns = now_ns + SNAPSHOT_INTERVAL_NS
        state = self._state(now_ns, limiter)
        with self._handoff:
            self._queued = state
            self._handoff.notify()
        if self._writer is None:
            self._writer = threading.Thread(target=self._run_writer, name="outrate-metrics", daemon=True)
            self._writer.start()

    def _run_writer(self) -> None:
        _lower_priority()  # below the engine's step on a busy machine
        pacer = self.pacer = Pacer()
        handoff = self._handoff
        while True:
            with handoff:
                handoff.wait_for(lambda: self._queued is not None)
                state, self._queued, self._busy = self._queued, None, True
            assert state is not None  # wait_for above: a snapshot is queued
            try:
                pacer.start()
                self._write_state(state, pacer)
            finally:
                with handoff:
                    self._busy = False
                    handoff.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Tests and benchmarks: wait until the writer thread has written what it was
        given (True), or ``timeout_s`` passed (False)."""
        with self._handoff:
            return self._handoff.wait_for(lambda: self._queued is None and not self._busy, timeout_s)

    def _write_state(self, state: tuple[Any, ...], pause: Callable[[], None] | None = None) -> None:
        with self._write_lock:
            if state[0] < self._written_ns:
                return  # a newer snapshot is already on disk
            try:
                data = _dumps(self._build(state, pause), pause)
                tmp = f"{self.path}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(data)
                os.replace(tmp, self.path)
                self._written_ns = state[0]
                self.snapshots += 1
            except (OSError, RuntimeError, ValueError):
                pass  # metrics must never stop the engine; the snapshot age shows the gap


def _dumps(snapshot: dict[str, Any], pause: Callable[[], None] | None) -> str:
    """``json.dumps(snapshot)``, compact, one label at a time with ``pause()`` every
    ``CHUNK_LABELS`` labels (the writer thread lets the step take the GIL)."""
    if pause is None:
        return json.dumps(snapshot, separators=(",", ":"))
    labels = snapshot["labels"]
    head = json.dumps({**snapshot, "labels": {}}, separators=(",", ":"))[:-3]  # without '{}}'
    parts = []
    for i, (key, values) in enumerate(labels.items(), 1):
        parts.append(f"{json.dumps(key)}:{json.dumps(values, separators=(',', ':'))}")
        if i % CHUNK_LABELS == 0:
            pause()
    return head + "{" + ",".join(parts) + "}}"


def _shown(rate: Fraction | None) -> float:
    """A limit gauge's value: tokens/s, ``inf`` for unlimited (R28)."""
    return float("inf") if rate is None else float(rate)


# -- API server -----------------------------------------------------------------------
def read_snapshots(directory: str) -> list[dict[str, Any]]:
    """Every readable ``engine-*.json`` snapshot in ``directory``."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "engine-*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("version") == SNAPSHOT_VERSION:
            found.append(data)
    return found


COUNTERS = (
    ("granted_tokens", "granted", "Output tokens granted (sampling dispatches charged and not refunded)."),
    (
        "throttled_request_steps",
        "throttled_request_steps",
        "Running requests skipped in one step because the user's budget was spent (shadow mode: would be).",
    ),
    ("refunds", "refunds", "Charges refunded because the charged request was not dispatched (R9)."),
    ("throttled_seconds", "throttled_seconds", "Seconds during which a request of the user was throttled."),
)
GAUGES = (
    ("lead_seconds", "lead_seconds", "TAT - now of the user's GCRA limiter, >= 0 (other: the largest)."),
    ("limit_tokens_per_second", "limit_tokens_per_second", "The configured output-token rate."),
)


class OutputRateCollector:
    """prometheus_client custom collector: the ``vllm:output_rate_*`` families, read from
    the engine core's snapshot(s) on each scrape (see module docstring)."""

    def __init__(self, directory: str, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.directory = directory
        self.clock_ns = clock_ns

    def describe(self):
        return []  # no description at registration: collect() reads files only on a scrape

    def collect(self):
        snapshots = read_snapshots(self.directory)
        now = self.clock_ns()
        merged: dict[str, dict[str, float]] = {}
        for snap in snapshots:
            age_s = max(0.0, (now - snap["now_ns"]) / 1e9)
            for key, values in snap["labels"].items():
                into = merged.setdefault(key, {"lead_seconds": 0.0})
                for field, value in values.items():
                    if field == "lead_seconds":
                        into[field] = max(into[field], max(0.0, value - age_s))
                    elif field == "limit_tokens_per_second":
                        into[field] = value
                    else:
                        into[field] = into.get(field, 0) + value
        for name, field, doc in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["user"])
            for key in sorted(merged):
                family.add_metric([key], merged[key].get(field, 0))
            yield family
        for name, field, doc in GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["user"])
            for key in sorted(merged):
                gauge.add_metric([key], merged[key].get(field, 0))
            yield gauge
        if snapshots:
            yield GaugeMetricFamily(
                PREFIX + "throttled_requests",
                "Resident requests throttled in the last step.",
                value=sum(s.get("throttled_requests", 0) for s in snapshots),
            )
            yield GaugeMetricFamily(
                PREFIX + "shadow",
                "1 in shadow mode (nothing is throttled), else 0.",
                value=1 if any(s.get("shadow") for s in snapshots) else 0,
            )
            yield GaugeMetricFamily(
                PREFIX + "snapshot_age_seconds",
                "Seconds since the engine core wrote its output-rate snapshot.",
                value=max(0.0, (now - max(s["now_ns"] for s in snapshots)) / 1e9),
            )


_COLLECTOR: OutputRateCollector | None = None


def register_collector(directory: str, registry: Any = None) -> OutputRateCollector:
    """Register the collector once per process on ``registry`` (default: prometheus_client's
    default registry, which vLLM's ``/metrics`` serves with one API server)."""
    global _COLLECTOR
    if _COLLECTOR is None:
        if registry is None:
            registry = REGISTRY
        _COLLECTOR = OutputRateCollector(directory)
        registry.register(_COLLECTOR)
    return _COLLECTOR


def _stat_logger_class():
    from vllm.v1.metrics.loggers import StatLoggerBase  # deferred: vLLM's metrics loggers (seconds)

    class OutputRateStatLogger(StatLoggerBase):
        """Entry point ``vllm.stat_logger_plugins``: loaded by vLLM in the API server
        (``AsyncLLM``) only; registers ``OutputRateCollector`` when the feature is on. It
        records nothing itself (the engine core's snapshot is the source)."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            directory = os.environ.get(ENV_DIR)
            if feature_on(vllm_config) and directory:
                register_collector(directory)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return OutputRateStatLogger


def __getattr__(name: str):
    # The class is built on first access so that importing this module (the engine core,
    # the tests) does not import vLLM's metrics loggers.
    if name == "OutputRateStatLogger":
        cls = globals()["OutputRateStatLogger"] = _stat_logger_class()
        return cls
    raise AttributeError(name)
