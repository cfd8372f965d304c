"""The ``vllm.general_plugins`` entry point of vllm-output-rate.

vLLM calls ``register()`` once in every process (API server, engine core, workers) before
it builds anything. Every hook below does nothing unless the output-rate feature is
configured (``additional_config["output_rate"]`` with a default rate, R18), and each one
wraps a vLLM function -- it calls the original, it never replaces vLLM logic:

- Identity (R17): the front end refuses a request whose ``output_rate_user`` is invalid with
  an ``OutputRateRequestError`` (a ``VLLMValidationError`` and a ``ValueError``) that names
  the value -- the OpenAI server answers HTTP 400 to that request alone, and nothing
  reaches the engine core.
- Start-up check ("Configuration"): ``EngineArgs.create_engine_config`` validates the
  ``output_rate`` section in the front end (``check_front_end``), so a bad section (an
  unknown key, with the nearest valid one suggested; overrides without a default; a bad
  rate; ``max_num_active_seqs`` above ``max_num_seqs``), a section given to a scheduler
  class that does not implement it (stock vLLM), or an unsupported mode (speculative
  decoding, DP/PP > 1, connectors, ...) stops ``vllm serve`` / ``LLM()`` before the
  engine core is spawned, with the message as the last line of the traceback (instead of
  "Engine core initialization failed" with the cause in the engine-core log).
- Worker spin (R16, worker side), opt-in: with ``VLLM_OUTPUT_RATE_READER_SPIN_MS`` set
  (e.g. 2) in the server's environment, ``SpinCondition.wait`` (vLLM's shared-memory queue
  reader) is wrapped in worker processes to cap its busy-loop window at that many
  milliseconds instead of 1 s (``READER_SPIN_ENV``). Not on by default: under load the cap
  slowed live decoding below the configured rates.
- Metrics (``reference/metrics.py``): with the feature on, the same wrapper puts a private
  snapshot directory into ``VLLM_OUTPUT_RATE_METRICS_DIR`` before the engine core is
  spawned, so the engine core writes its per-second snapshot there and the API server's
  ``vllm.stat_logger_plugins`` entry point serves it on ``/metrics``.
- Duplicate keys: ``EngineArgs.add_cli_args`` is wrapped so that ``--additional-config``
  refuses a key given twice inside ``output_rate`` (plain JSON keeps the last one).
- Beam search is refused at the serving entry (``BeamSearchOnlineMixin.beam_search`` for the
  OpenAI server, ``BeamSearchOfflineMixin.beam_search`` for ``LLM``): its candidate
  expansion is a series of 1-token requests with many logprobs, not the one-sampled-token-
  per-step path the accounting charges.
- Engine wait (R16): when a step ran no model, the engine core waits on its input queue
  until the earliest ready time among users refused in that step (at most 50 ms) instead of
  spinning in 1 ms sleeps; a new request or abort wakes it at once.

Correctness never depends on this plugin: the scheduler never raises on a bad identity
(``RateLimitedScheduler.add_request``), validates the engine configuration itself, and
never sleeps; without the engine wait, vLLM's own 1 ms idle loop paces throttled users
correctly, only with about 1000 wake-ups per second. ``VLLM_PLUGINS`` can filter this
plugin out (its entry-point name is ``output_rate``).

Source: docs/SPEC.md "Configuration", R16, R17 and Decision R17 (bad identity values).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_output_rate.reference.config import (
    SECTION,
    OutputRateConfigError,
    check_engine_supported,
    nearest_key,
    parse_output_rate,
    section_duplicates_error,
)

# R16: the engine core re-checks at least this often even when no user becomes ready sooner
# (bounds the delay of anything the wait cannot see, e.g. a grammar compiled in the background).
MAX_ENGINE_WAIT_NS = 50_000_000
# R16, worker side (docs/PERFORMANCE.md "Idle cost"): vLLM 0.32's shared-memory message
# queue lets a reader (the multiproc executor's worker waiting for the next RPC) spin with
# sched_yield for 1 s after each message before it parks on its zmq notify socket. While
# every user is throttled the engine core sends an (empty) execute_model RPC at least every
# 50 ms, so the worker never parks: 100% of a core. With the feature on, the front end sets
# this variable (milliseconds) before the engine core is spawned, and the engine core and
# its workers (``VllmWorker-*`` processes only) cap a reader's spin window at it; the writer notifies on every enqueue, so a
# parked reader wakes at once. Operators may set it themselves (1000 restores vLLM's window).
READER_SPIN_ENV = "VLLM_OUTPUT_RATE_READER_SPIN_MS"
DEFAULT_READER_SPIN_MS = 2
WORKER_PROCESS_PREFIX = "VllmWorker"  # vLLM 0.32's multiproc executor names its workers VllmWorker-<rank>

BEAM_SEARCH_REFUSED = (
    "beam search is not supported while per-user output-rate limiting is on "
    "(additional_config['output_rate'] / --default-user-output-tokens-per-second): its candidate "
    "expansion does not go through the one-token-per-step path that is charged. Send the "
    "request without use_beam_search, or use a server without the output-rate feature."
)

_REGISTERED = False
# The wrappers this module installed over vLLM functions (so that a second install is a no-op).
_OUR_WRAPPERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


class OutputRateRequestError(VLLMValidationError, ValueError):
    """A request refused because of the output-rate feature (HTTP 400 for that request only).

    A ``VLLMValidationError`` so that vLLM's ``AsyncLLM.generate`` passes it through as a
    client error (a plain ``ValueError`` raised there becomes an HTTP 500 with an empty
    message); also a ``ValueError`` for callers that catch that. ``parameter`` names the
    request field at fault (vLLM puts it in the error response).
    """

    def __init__(self, message: str, *, parameter: str) -> None:
        VLLMValidationError.__init__(self, message, parameter=parameter)


def _feature_on(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get("output_rate") if isinstance(additional, dict) else None
    return isinstance(section, dict) and section.get("default_tokens_per_s") is not None


def register() -> None:
    """Install the hooks (idempotent; vLLM may call it many times per process).

    A later call also re-installs a hook whose vLLM attribute was replaced since (another
    plugin or fork shim that saved the function before ours and restored it), so the
    front-end checks never silently disappear.
    """
    global _REGISTERED
    if _REGISTERED:
        for install, (owner, name, installed) in list(_INSTALLED.items()):
            if owner.__dict__.get(name) is not installed:
                install()
                _remember(install, owner, name)
        return
    from vllm.engine.arg_utils import EngineArgs

    _install_identity_check()
    _install_startup_check()
    _remember(_install_startup_check, EngineArgs, "create_engine_config")
    _install_cli_duplicate_check()
    _remember(_install_cli_duplicate_check, EngineArgs, "add_cli_args")
    _install_beam_search_refusal()
    _install_engine_wait()
    _install_reader_spin_cap()
    _REGISTERED = True


# install function -> (class, attribute, the object installed there)
_INSTALLED: dict[Any, tuple[type, str, Any]] = {}


def _remember(install, owner: type, name: str) -> None:
    _INSTALLED[install] = (owner, name, owner.__dict__.get(name))


# -- R17: identity checked at the front end -------------------------------------------
def _install_identity_check() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_output_rate.reference.identity import validate_extra_args

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        if isinstance(params, SamplingParams) and _feature_on(self.vllm_config):
            try:
                validate_extra_args(params.extra_args)  # R17: names the bad value
            except ValueError as exc:
                raise OutputRateRequestError(str(exc), parameter="vllm_xargs.output_rate_user") from None
        return original(self, params, supported_tasks)

    InputProcessor._validate_params = _validate_params


# -- start-up: unsupported modes refused before the engine core starts -----------------
def _install_startup_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any):
        vllm_config = original(self, *args, **kwargs)
        check_front_end(vllm_config)
        if _feature_on(vllm_config):
            # /metrics (reference/metrics.py): the engine core spawned after this inherits
            # the snapshot directory; the API server's stat-logger plugin reads it.
            from vllm_output_rate.reference.metrics import ensure_metrics_dir

            ensure_metrics_dir()
            # R16, worker side: the spin cap is opt-in (the operator sets READER_SPIN_ENV,
            # e.g. to DEFAULT_READER_SPIN_MS): under load it slowed live decoding below the
            # configured rates in the full live suite, so it is not on by default.
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


REFERENCE_CLASSES = (
    "vllm_output_rate.reference.scheduler.RateLimitedScheduler",
    "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler",
)


def implements_output_rate(scheduler_cls: Any) -> bool | None:
    """Whether vLLM's ``scheduler_cls`` setting names a class that implements ``output_rate``.

    True for the reference classes and their subclasses; False for vLLM's default (None:
    stock ``Scheduler`` / ``AsyncScheduler``) and any other class; None if a dotted path
    cannot be imported here (vLLM reports that itself).
    """
    if scheduler_cls is None:
        return False
    if isinstance(scheduler_cls, str):
        if scheduler_cls in REFERENCE_CLASSES:
            return True
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            scheduler_cls = resolve_obj_by_qualname(scheduler_cls)
        except Exception:  # not ours to report
            return None
    from vllm_output_rate.reference.scheduler import _RateLimitMixin

    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, _RateLimitMixin)


def check_front_end(vllm_config) -> None:
    """Configuration: every start-up check of the ``output_rate`` section, in the front end.

    Runs in the API-server process (``vllm serve``) or the ``LLM()`` process before the
    engine core is spawned, so the message is the last line the operator sees. Checks:
    a top-level key of ``additional_config`` that looks like a misspelt ``output_rate``
    (with one of our classes); a non-empty section given to a scheduler class that does
    not implement it (refused naming ``--scheduler-cls``); the section itself
    (``parse_output_rate``: unknown keys with the nearest one suggested, overrides
    without a default, bad values); with the feature on, ``max_num_active_seqs`` against
    ``max_num_seqs`` and the unsupported modes (``check_engine_supported``). The
    scheduler's constructor repeats the section and engine checks (authoritative).

    Raises:
        OutputRateConfigError: one message saying what to change.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return
    scheduler_cls = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    section = additional.get(SECTION)
    if section is None:
        near = nearest_key(SECTION, [k for k in additional if isinstance(k, str)], cutoff=0.75)
        if near is not None and implements_output_rate(scheduler_cls):
            raise OutputRateConfigError(
                f"--additional-config has a key {near!r} but no {SECTION!r}: did you mean {SECTION!r}? "
                f"(with {near!r} the output-rate feature stays off)"
            )
        return
    if section != {} and implements_output_rate(scheduler_cls) is False:
        if scheduler_cls is None:
            shown = "vLLM's default scheduler"
        elif isinstance(scheduler_cls, type):
            shown = repr(f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}")
        else:
            shown = repr(scheduler_cls)
        raise OutputRateConfigError(
            f'additional_config["{SECTION}"] is given but --scheduler-cls is {shown}, which does not '
            f"implement it and would not limit anything: add --scheduler-cls {REFERENCE_CLASSES[0]} "
            f"(--async-scheduling: {REFERENCE_CLASSES[1]}), or remove the {SECTION} section"
        )
    config = parse_output_rate(section)
    if config.enabled:
        check_engine_supported(vllm_config)  # the same checks the scheduler makes


# -- duplicate keys in --additional-config (Configuration) --------------------------------
def _install_cli_duplicate_check() -> None:
    """Wrap ``EngineArgs.add_cli_args``: ``--additional-config`` refuses duplicate keys in ``output_rate``.

    vLLM parses the flag with ``json.loads``, which keeps the last of two equal keys. The
    flag's own type is kept and called after the check, so everything else about the
    flag is vLLM's.
    """
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.add_cli_args

    @functools.wraps(original)
    def add_cli_args(parser, *args: Any, **kwargs: Any):
        parser = original(parser, *args, **kwargs)
        for action in getattr(parser, "_actions", []):
            if "--additional-config" in action.option_strings and action.type is not None:
                action.type = _strict_additional_config(action.type)
        return parser

    def _strict_additional_config(vllm_type):
        if vllm_type in _OUR_WRAPPERS:
            return vllm_type

        def parse(text: str):
            message = section_duplicates_error(text) if isinstance(text, str) else None
            if message is not None:
                raise argparse.ArgumentTypeError(message)
            return vllm_type(text)

        _OUR_WRAPPERS.add(parse)
        return parse

    EngineArgs.add_cli_args = staticmethod(add_cli_args)


# -- beam search refused at the serving entry ------------------------------------------
def _refuse_beam_search_if_on(vllm_config) -> None:
    if vllm_config is not None and _feature_on(vllm_config):
        raise OutputRateRequestError(BEAM_SEARCH_REFUSED, parameter="use_beam_search")


def _install_beam_search_refusal() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    online = BeamSearchOnlineMixin.beam_search

    # A plain function returning vLLM's async generator: the refusal is raised at the call
    # in the serving code, before any response starts, and becomes an HTTP 400 there.
    @functools.wraps(online)
    def beam_search_online(self, *args: Any, **kwargs: Any):
        engine_client = getattr(self, "engine_client", None)
        _refuse_beam_search_if_on(getattr(engine_client, "vllm_config", None))
        return online(self, *args, **kwargs)

    BeamSearchOnlineMixin.beam_search = beam_search_online

    offline = BeamSearchOfflineMixin.beam_search

    @functools.wraps(offline)
    def beam_search_offline(self, *args: Any, **kwargs: Any):
        llm_engine = getattr(self, "llm_engine", None)
        _refuse_beam_search_if_on(getattr(llm_engine, "vllm_config", None))
        return offline(self, *args, **kwargs)

    BeamSearchOfflineMixin.beam_search = beam_search_offline


# -- R16: the engine core waits for budget instead of spinning -------------------------
def engine_wait_timeout_ns(core) -> int:
    """R16: how long the engine core may wait after a step that ran no model (0: don't).

    min(50 ms, the scheduler's ``next_ready_ns()`` - now), and 0 unless: the scheduler
    offers ``next_ready_ns`` and some user was refused in the step, the feature is on, the
    engine is a single (non data-parallel) engine, and no batch that ran the model is
    still in flight (async scheduling / pipeline batch queue).
    """
    scheduler = getattr(core, "scheduler", None)
    next_ready_ns = getattr(scheduler, "next_ready_ns", None)
    if scheduler is None or next_ready_ns is None or not _feature_on(getattr(core, "vllm_config", None)):
        return 0
    if getattr(core.vllm_config.parallel_config, "data_parallel_size", 1) > 1:
        return 0  # DP engines must keep stepping together (and DP is refused anyway)
    ready_ns = next_ready_ns()
    if ready_ns is None or not scheduler.has_requests():
        return 0
    if not _nothing_in_flight(core):
        return 0
    clock_ns = getattr(scheduler, "clock_ns", time.monotonic_ns)
    return max(0, min(MAX_ENGINE_WAIT_NS, ready_ns - clock_ns()))


def _nothing_in_flight(core) -> bool:
    """True if no dispatched batch that computes tokens awaits its result (batch queue)."""
    batch_queue = getattr(core, "batch_queue", None)
    if not batch_queue:
        return True
    try:
        return all(entry[1].total_num_scheduled_tokens == 0 for entry in batch_queue)
    except (AttributeError, IndexError, TypeError):
        return False  # an unknown layout: never delay in-flight results


def wait_for_input(input_queue, timeout_s: float) -> bool:
    """Block until ``input_queue`` holds an item or ``timeout_s`` passes; consume nothing.

    The engine core's own loop then handles the item as usual. The check and the wait are
    made under the queue's lock, so a request put in between still wakes the wait at once.
    Returns True if an item is waiting.
    """
    with input_queue.not_empty:
        if not input_queue.queue:
            input_queue.not_empty.wait(timeout_s)
        return bool(input_queue.queue)


def _install_engine_wait() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._process_engine_step

    @functools.wraps(original)
    def _process_engine_step(self) -> bool:
        model_executed = original(self)
        if not model_executed:
            timeout_ns = engine_wait_timeout_ns(self)
            if timeout_ns > 0:
                wait_for_input(self.input_queue, timeout_ns / 1e9)
        return model_executed

    EngineCoreProc._process_engine_step = _process_engine_step


# -- R16, worker side: a shared-memory queue reader does not spin for a whole second --------
def reader_spin_cap_s() -> float | None:
    """The reader spin-window cap in seconds from ``VLLM_OUTPUT_RATE_READER_SPIN_MS``
    (None: unset, or not a number >= 0: vLLM's own 1 s window stays)."""
    text = os.environ.get(READER_SPIN_ENV)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value / 1000 if value >= 0 else None


def _install_reader_spin_cap() -> None:
    """Wrap ``SpinCondition.wait`` (vLLM's shm message-queue reader wait) when the cap is
    set (the engine core and workers of a server with the feature on): before vLLM's own
    wait runs, the reader's busy-loop window is capped at ``reader_spin_cap_s()``. vLLM's
    logic is unchanged: within the window it yields and re-checks the buffer; after it, it
    parks on the notify socket that every enqueue pings (and re-checks every 5 s)."""
    cap = reader_spin_cap_s()
    if cap is None:
        return  # feature off (R18) or this is the front end: vLLM's window
    import multiprocessing

    if not multiprocessing.current_process().name.startswith(WORKER_PROCESS_PREFIX):
        return  # only the worker's RPC reader: the engine core's response reader keeps vLLM's window
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: nothing to cap
        return
    original = SpinCondition.wait
    if original in _OUR_WRAPPERS:
        return

    @functools.wraps(original)
    def wait(self, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > cap:
            self.busy_loop_s = cap
        return original(self, timeout_ms)

    _OUR_WRAPPERS.add(wait)
    SpinCondition.wait = wait
